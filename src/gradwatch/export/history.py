"""JSON-lines history of snapshots: rank 0 appends one line per snapshot (``history_path``).

Writer guarantees:

* every line is written with a single ``write`` of the complete ``json + "\\n"`` and flushed, so
  a crash can at worst leave a *truncated last line*;
* before appending to an existing file whose last byte is not a newline (a previous crash, or
  a write that failed half-way), a newline is written first, so the torn line stays isolated and
  never swallows a good one;
* past ``max_bytes`` the file is rotated: ``path`` -> ``path.1`` (one backup, replaced), so the
  two files together never hold much more than ``2 * max_bytes``.

The reader (:func:`read_history`) skips any line that is not a complete JSON object (a torn last
line, or a torn line left in the middle by a crash followed by a restart) and reads ``path.1``
first when asked to, so a plot spans the rotation.

Non-finite numbers. JSON has no NaN or infinity, so a float field of a record
(:data:`FLOAT_FIELDS`, :data:`FLOAT_MAPPINGS` and each group's ``norm``) that is NaN, +Inf or
-Inf is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (the mapping
protobuf's canonical JSON uses), so every line is standard JSON that ``jq`` or any JSON reader
parses. ``null`` keeps its own meaning: *not measured* (spike detection off, no per-rank view,
a step not clipped through gradwatch), which differs from NaN, *measured and undefined* (an
undefined ratio or noise scale, a spike score during warm-up) or *non-finite* (a NaN gradient).
The reader turns those strings in those fields back into floats, and still reads files written
with the bare ``NaN``/``Infinity`` tokens of Python's ``json``.

Inside a training job the writer is a :class:`~gradwatch.export.Sink` driven by the publisher
thread (``GradWatch`` with ``WatchConfig.history_path``), never by the training thread: see
:mod:`gradwatch.export.publishing`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradwatch.snapshot import Snapshot

__all__ = [
    "CLOSE_TIMEOUT",
    "FLOAT_FIELDS",
    "FLOAT_MAPPINGS",
    "HistoryWriter",
    "decode_record",
    "encode_record",
    "iter_history",
    "read_history",
    "rotated_path",
]

log = logging.getLogger("gradwatch.export")

#: How long :meth:`HistoryWriter.close` waits for a write in progress before giving up on it.
CLOSE_TIMEOUT = 1.0


def rotated_path(path: str | os.PathLike[str]) -> Path:
    """The one backup of a rotated history file: ``path`` + ``.1``."""
    path = Path(path)
    return path.with_name(path.name + ".1")


#: Snapshot fields holding one float (or None): their non-finite values are written as strings.
FLOAT_FIELDS = tuple(
    f.name for f in dataclasses.fields(Snapshot) if f.type in ("float", "float | None")
)
#: Snapshot fields mapping a name to a float, likewise.
FLOAT_MAPPINGS = tuple(
    f.name for f in dataclasses.fields(Snapshot) if f.type == "Mapping[str, float]"
)
#: How a non-finite float is spelled in a record, and back.
_SPELLED = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _spell(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value


def _unspell(value: Any) -> Any:
    return _SPELLED.get(value, value) if isinstance(value, str) else value


def _map_floats(record: dict[str, Any], convert: Any) -> dict[str, Any]:
    out = dict(record)
    for name in FLOAT_FIELDS:
        if name in out:
            out[name] = convert(out[name])
    for name in FLOAT_MAPPINGS:
        value = out.get(name)
        if isinstance(value, dict):
            out[name] = {k: convert(v) for k, v in value.items()}
    groups = out.get("groups")
    if isinstance(groups, dict):
        out["groups"] = {
            g: {**stats, "norm": convert(stats["norm"])}
            if isinstance(stats, dict) and "norm" in stats
            else stats
            for g, stats in groups.items()
        }
    return out


def encode_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` (a ``Snapshot.to_dict()``) with its non-finite floats spelled as strings
    (see the module docstring): what a history line holds."""
    return _map_floats(record, _spell)


def decode_record(record: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_record`: ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` in the float
    fields become floats again (a record of an older file, with bare tokens, is unchanged)."""
    return _map_floats(record, _unspell)


def _line(snapshot: Snapshot | dict[str, Any]) -> bytes:
    data = snapshot.to_dict() if isinstance(snapshot, Snapshot) else dict(snapshot)
    data.pop("param_norms", None)  # per-parameter norms would make lines unbounded
    text = json.dumps(encode_record(data), separators=(",", ":"), sort_keys=True)
    return (text + "\n").encode()


class HistoryWriter:
    """Appends snapshots as JSON lines to ``path``, rotating to ``path.1`` past ``max_bytes``.

    Thread-safe, and a :class:`~gradwatch.export.Sink` (``write``, ``action``, ``close``). Two
    ways to write:

    * :meth:`write` raises the ``OSError`` of a failed write (the history's sink thread uses it,
      so the failure is counted, logged and retried like any sink's);
    * :meth:`append` never raises on I/O errors: it returns False and keeps the error in
      :attr:`last_error`, so a full disk cannot kill whoever calls it.

    After a failed write the file is closed and reopened by the next write, which isolates a
    half-written line with a newline (see the module docstring). A file removed or replaced
    while open (its directory deleted, say) is noticed at the next write (one ``stat``), logged,
    and created again with its directory: lines never go to a file nobody can read.

    With ``lazy=True`` nothing touches the file system until the first write, so constructing
    the writer can neither block on a slow file system nor fail; otherwise the file is opened
    (and its directory created) here and errors raise at once.
    """

    #: The ``sink`` label of its ``gradwatch_sink_*`` series.
    name = "history"
    #: Completes "could not ... a collected step" in error logs.
    action = "write the history of"

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = 64 * 1024 * 1024,
        *,
        lazy: bool = False,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.last_error: OSError | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._fh: Any = None
        if not lazy:
            self._fh = self._open()

    def _open(self) -> Any:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "ab")  # noqa: SIM115 - kept open for the writer's lifetime
        try:
            size = fh.tell()
            if size > 0:
                with open(self.path, "rb") as rd:
                    rd.seek(size - 1)
                    if rd.read(1) != b"\n":
                        fh.write(b"\n")  # isolate a torn line left by a crash
                        fh.flush()
        except BaseException:
            fh.close()
            raise
        return fh

    def write(self, snapshot: Snapshot | dict[str, Any]) -> None:
        """Append one line (rotating first if it would pass ``max_bytes``); raise on I/O errors.

        A no-op after :meth:`close`.
        """
        line = _line(snapshot)
        with self._lock:
            if self._closed:
                return
            try:
                if self._fh is not None and not _still_at(self._fh, self.path):
                    self._removed()
                if self._fh is None:
                    self._fh = self._open()
                if self._fh.tell() > 0 and self._fh.tell() + len(line) > self.max_bytes:
                    self._rotate()
                self._fh.write(line)
                self._fh.flush()
                if self._closed:  # close() gave up waiting for this write: do not keep the file
                    self._discard_handle()
            except OSError as exc:
                self.last_error = exc
                self._discard_handle()  # reopen next time: isolates a half-written line
                raise

    def append(self, snapshot: Snapshot | dict[str, Any]) -> bool:
        """Like :meth:`write`, but returns False instead of raising on I/O errors."""
        try:
            self.write(snapshot)
        except OSError:
            return False
        with self._lock:
            return not self._closed

    def _removed(self) -> None:
        """The file (or its directory) was removed or replaced under the writer: lines written
        to the old handle would vanish, so the next write creates it again (and its
        directory)."""
        self._discard_handle()
        log.warning(
            "gradwatch: the history file %s was removed or replaced while open; writing a new "
            "one there from this step on",
            self.path,
        )

    def _discard_handle(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):  # flushing the buffered rest may fail again
                fh.close()

    def _rotate(self) -> None:
        self._fh.close()
        self._fh = None
        os.replace(self.path, rotated_path(self.path))
        self._fh = open(self.path, "ab")  # noqa: SIM115

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close the file; later writes are ignored. Idempotent.

        Waits at most ``timeout`` seconds for a write in progress (a file system that blocks,
        e.g. a hung network mount, or a FIFO nobody reads): past that the writer is only marked
        closed, and the blocked write discards its handle if it ever returns.
        """
        self._closed = True  # an attribute store: seen by a write that holds the lock
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            return
        try:
            fh, self._fh = self._fh, None
            if fh is not None:
                fh.close()
        finally:
            self._lock.release()

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_history(
    path: str | os.PathLike[str], *, include_rotated: bool = True
) -> Iterator[dict[str, Any]]:
    """Yield the records of a history file (and its ``.1`` backup first), skipping torn lines.

    A record is a JSON object with a ``step``; anything else (a truncated line, a torn line
    followed by the newline a restart added, blank lines) is skipped silently, because the
    writer's only failure mode is a line cut short.

    Safe against a writer rotating meanwhile: both files are opened before either is read,
    the backup first, so the records come in order and none twice; a file that is missing is
    skipped. When a rotation happened between the two opens (the backup path now names another
    file), they are opened again, a few times at most.
    """
    path = Path(path)
    backup_path = rotated_path(path)
    with contextlib.ExitStack() as stack:
        for _ in range(_OPEN_ATTEMPTS):
            stack.close()
            backup = _open_if_present(backup_path, stack) if include_rotated else None
            live = _open_if_present(path, stack)
            if backup is None or _still_at(backup, backup_path):
                break
        for fh in (backup, live):
            if fh is None:
                continue
            for raw in fh:
                # a torn line (crash mid-write) fails to parse, or parses to a non-object
                try:
                    rec = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    continue
                if isinstance(rec, dict) and "step" in rec:
                    yield decode_record(rec)


# A reader retries its opens this many times when a rotation slips between them; rotations are
# far apart (max_bytes of lines), so a second attempt all but always sees a quiet pair.
_OPEN_ATTEMPTS = 3


def _open_if_present(path: Path, stack: contextlib.ExitStack) -> Any:
    try:
        return stack.enter_context(open(path, "rb"))
    except FileNotFoundError:
        return None


def _still_at(fh: Any, path: Path) -> bool:
    """True if ``path`` still names the file ``fh`` has open."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fh.fileno())
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def read_history(
    path: str | os.PathLike[str], *, include_rotated: bool = True
) -> list[dict[str, Any]]:
    """All records of a history file as dicts (see :func:`iter_history`)."""
    return list(iter_history(path, include_rotated=include_rotated))


#: Fields of a history record that must be mappings (when present and not null).
RECORD_MAPPINGS = ("groups", "ratios", "raw_ratios", "param_norms", "isolation_violated")


def malformed_record(record: dict[str, Any]) -> str | None:
    """Why ``record`` cannot be drawn (a line gradwatch did not write), or None."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"'step' is {type(step).__name__}, not an integer"
    for key in RECORD_MAPPINGS:
        value = record.get(key)
        if value is not None and not isinstance(value, dict):
            return f"{key!r} is {type(value).__name__}, not a mapping"
    return None


def where_in_history(path: Path, record: dict[str, Any]) -> str:
    """``file line n`` of ``record`` (found again by parsing each line: error path only)."""
    for file in (rotated_path(path), path):
        try:
            with open(file, "rb") as fh:
                for number, raw in enumerate(fh, 1):
                    try:
                        if decode_record(json.loads(raw)) == record:
                            return f"{file} line {number}"
                    except (ValueError, UnicodeDecodeError):
                        continue
        except OSError:
            continue
    return str(path)
