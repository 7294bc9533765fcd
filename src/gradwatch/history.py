"""JSON-lines history of snapshots: rank 0 appends one line per snapshot (``history_path``).

Writer guarantees:

* every line is written with a single ``write`` of the complete ``json + "\\n"`` and flushed, so
  a crash can at worst leave a *truncated last line*;
* before appending to an existing file whose last byte is not a newline (a previous crash), a
  newline is written first, so the torn line stays isolated and never swallows a good one;
* past ``max_bytes`` the file is rotated: ``path`` -> ``path.1`` (one backup, replaced).

The reader (:func:`read_history`) skips any line that is not a complete JSON object (a torn last
line, or a torn line left in the middle by a crash followed by a restart) and reads ``path.1``
first when asked to, so a plot spans the rotation.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gradwatch.snapshot import Snapshot

__all__ = ["HistoryWriter", "iter_history", "read_history"]


def _line(snapshot: Snapshot | dict[str, Any]) -> bytes:
    data = snapshot.to_dict() if isinstance(snapshot, Snapshot) else dict(snapshot)
    data.pop("param_norms", None)  # per-parameter norms would make lines unbounded
    # NaN/Infinity are written as the JS literals Python's json reads back.
    return (json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n").encode()


class HistoryWriter:
    """Appends snapshots as JSON lines to ``path``, rotating to ``path.1`` past ``max_bytes``.

    Thread-safe; ``append`` never raises on I/O errors after the file was opened (it returns
    False and the error is kept in :attr:`last_error`), so a full disk cannot kill training.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int = 64 * 1024 * 1024) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.last_error: OSError | None = None
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self._open()

    def _open(self) -> Any:
        fh = open(self.path, "ab")  # noqa: SIM115 - kept open for the writer's lifetime
        size = fh.tell()
        if size > 0:
            with open(self.path, "rb") as rd:
                rd.seek(size - 1)
                if rd.read(1) != b"\n":
                    fh.write(b"\n")  # isolate a torn line left by a crash
                    fh.flush()
        return fh

    def append(self, snapshot: Snapshot | dict[str, Any]) -> bool:
        line = _line(snapshot)
        with self._lock:
            if self._fh is None:
                return False
            try:
                if self._fh.tell() > 0 and self._fh.tell() + len(line) > self.max_bytes:
                    self._rotate()
                self._fh.write(line)
                self._fh.flush()
                return True
            except OSError as exc:
                self.last_error = exc
                return False

    def _rotate(self) -> None:
        self._fh.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._fh = open(self.path, "ab")  # noqa: SIM115

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                finally:
                    self._fh = None

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_history(
    path: str | os.PathLike[str], *, include_rotated: bool = True
) -> Iterator[dict[str, Any]]:
    """Yield the records of a history file (and its ``.1`` backup first), skipping torn lines."""
    path = Path(path)
    files = [path.with_name(path.name + ".1"), path] if include_rotated else [path]
    for file in files:
        if not file.exists():
            continue
        with open(file, "rb") as fh:
            for raw in fh:
                # a torn line (crash mid-write) fails to parse, or parses to a non-object
                try:
                    rec = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    continue
                if isinstance(rec, dict) and "step" in rec:
                    yield rec


def read_history(
    path: str | os.PathLike[str], *, include_rotated: bool = True
) -> list[dict[str, Any]]:
    """All records of a history file as dicts (see :func:`iter_history`)."""
    return list(iter_history(path, include_rotated=include_rotated))
