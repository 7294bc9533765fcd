"""Spike forensics: the incident file, the batch names, and the action when skips pile up.

* :func:`batch_ids`: what ``watch.note_batch(ids)`` accepts (any JSON-able value up to
  :data:`MAX_BATCH_BYTES` of JSON), frozen as a copy at the call.
* :class:`IncidentLog` (global rank 0, ``WatchConfig.incident_path``): one JSON line per step
  the guard skipped or the adaptive clip cut, ``{"step", "reason", "norm", "threshold",
  "batch"}``; ``reason`` is ``"nonfinite"`` or ``"spike"`` (a guard skip) or ``"clipped"``
  (the norm was above the adaptive threshold), ``norm`` the pre-clip whole-model norm (null
  when not finite), ``threshold`` the adaptive threshold (null without one). The training
  thread queues the step's device figures (no host read); a daemon thread reads them and
  writes. Bounded: at most :data:`MAX_QUEUED` steps wait (more are dropped, counted, logged
  once) and the file stops growing at :data:`MAX_INCIDENT_BYTES` (logged once).
* :class:`SkipLimit` (``on_max_consecutive_skips``): ``"raise"`` raises
  :class:`~gradwatch.errors.GuardStopError`, ``"exit"`` exits with
  :data:`GUARD_STOP_EXIT_CODE`, from the guarded ``step()`` after the one whose skip reached
  ``max_consecutive_skips``, on every rank (the decision is the same bits everywhere), before
  that step is applied. It reads the previous step's decision to the host, once per guarded
  step (on CUDA its copy was queued a step ago: no wait on the current step).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from gradwatch.errors import GuardStopError
from gradwatch.step.adaptive import AdaptiveStep
from gradwatch.step.guard import GuardDecision

__all__ = ["GUARD_STOP_EXIT_CODE", "IncidentLog", "SkipLimit", "batch_ids"]

log = logging.getLogger("gradwatch")

#: The exit code of ``on_max_consecutive_skips="exit"``: ``EX_TEMPFAIL`` of sysexits.h, "try
#: again later": a scheduler requeues the job from its last checkpoint (docs/operations.md).
GUARD_STOP_EXIT_CODE = 75

#: The largest ``note_batch`` value, as JSON.
MAX_BATCH_BYTES = 64 * 1024

#: Steps waiting for the incident writer; more are dropped (counted, logged once).
MAX_QUEUED = 1024

#: The incident file stops growing past this size (logged once).
MAX_INCIDENT_BYTES = 64 * 1024 * 1024

#: ``reason`` of the line written when the skip limit acted.
SKIP_LIMIT_REASON = "max_consecutive_skips"


def batch_ids(ids: Any) -> Any:
    """A JSON copy of ``ids`` (the batch of the coming step); ``ValueError`` naming
    ``note_batch(ids)`` when it is no JSON (NaN, Inf, objects) or longer than
    :data:`MAX_BATCH_BYTES`."""
    try:
        text = json.dumps(ids, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"gradwatch: note_batch(ids) must be JSON-able: {exc}") from exc
    if len(text) > MAX_BATCH_BYTES:
        raise ValueError(
            f"gradwatch: note_batch(ids) is {len(text)} bytes of JSON, over {MAX_BATCH_BYTES}"
        )
    return json.loads(text)


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class _Pending:
    """One collected step as queued by the training thread (device figures, unread)."""

    step: int
    batch: Any
    norm: Tensor | None
    adaptive: AdaptiveStep | None
    decision: GuardDecision | None

    def record(self) -> dict[str, Any] | None:
        """The incident line of this step, None when it was neither skipped nor clipped."""
        reason = None
        threshold = None
        norm = None if self.norm is None else float(self.norm)
        if self.adaptive is not None:
            reading = self.adaptive.reading()
            threshold, norm = reading.threshold, reading.norm
            if reading.clipped:
                reason = "clipped"
        if self.decision is not None:
            skipped = self.decision.reading().skipped
            if skipped is not None:
                reason = skipped
        if reason is None:
            return None
        return {
            "step": self.step,
            "reason": reason,
            "norm": _finite_or_none(norm),
            "threshold": threshold,
            "batch": self.batch,
        }


class IncidentLog:
    """The incident file of global rank 0 (see the module docstring).

    Args:
        path: the JSON-lines file (appended to; its directory is created).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:  # an unwritable path fails at construction, naming the field
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.open("a").close()
        except OSError as exc:
            raise ValueError(
                f"gradwatch: incident_path {str(path)!r} cannot be written: {exc}"
            ) from exc
        self.dropped = 0
        self.failed = 0  # steps whose line could not be written
        self._logged: set[str] = set()
        self._full = False
        self._queue: queue.Queue[_Pending | dict[str, Any] | None] = queue.Queue(MAX_QUEUED)
        self._thread = threading.Thread(
            target=self._run, name="gradwatch-incidents", daemon=True
        )
        self._thread.start()

    @classmethod
    def of(cls, path: Path | None) -> IncidentLog | None:
        """The incident file at ``path`` (None: none)."""
        return None if path is None else cls(path)

    @staticmethod
    def close_any(incidents: IncidentLog | None) -> None:
        """Close ``incidents`` when there is one."""
        if incidents is not None:
            incidents.close()

    def submit(
        self,
        step: int,
        batch: Any,
        norm: Tensor | None,
        adaptive: AdaptiveStep | None,
        decision: GuardDecision | None,
    ) -> None:
        """Queue one collected step (training thread: no host read, never blocks)."""
        if adaptive is None and decision is None:
            return  # neither a clip threshold nor a guard: nothing to report
        self._put(_Pending(step, batch, norm, adaptive, decision))

    def write(self, line: dict[str, Any]) -> None:
        """Queue a line written as it is (the skip limit's)."""
        self._put(line)

    def _put(self, item: _Pending | dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning(
                    "gradwatch: the incident writer is behind by %d steps; steps are dropped "
                    "from %s (counted in IncidentLog.dropped)", MAX_QUEUED, self.path
                )

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                record = item if isinstance(item, dict) else item.record()
                if record is not None:
                    self._append(record)
            except Exception as exc:  # never-crash boundary: forensics never stop training
                self.failed += 1
                if type(exc).__name__ not in self._logged:
                    self._logged.add(type(exc).__name__)
                    log.warning(
                        "gradwatch: an incident could not be written to %s: %s: %s (logged "
                        "once per error type, counted in IncidentLog.failed)",
                        self.path, type(exc).__name__, exc,
                    )
            finally:
                self._queue.task_done()

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        with self.path.open("a", encoding="utf-8") as f:
            if f.tell() + len(line) > MAX_INCIDENT_BYTES:
                if not self._full:
                    self._full = True
                    log.warning("gradwatch: incident file %s reached %d bytes; no more lines "
                                "are written", self.path, MAX_INCIDENT_BYTES)
                return
            f.write(line)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout`` seconds) until every queued step is written."""
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (bounded wait) and stop the writer."""
        self.flush(timeout)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            return
        self._thread.join(timeout)


class SkipLimit:
    """The ``on_max_consecutive_skips`` action (``"raise"`` or ``"exit"``), checked at each
    guarded step against the previous step's decision (see the module docstring).

    Args:
        action: ``"raise"`` or ``"exit"``.
        limit: ``max_consecutive_skips``.
        incidents: rank 0's incident file (None elsewhere or without one): gets a last line
            ``{"reason": "max_consecutive_skips", ...}`` and is flushed before acting.
    """

    def __init__(self, action: str, limit: int, incidents: IncidentLog | None) -> None:
        self.action = action
        self.limit = limit
        self._incidents = incidents
        self._previous: tuple[int, GuardDecision] | None = None

    def check(self, step: int, decision: GuardDecision | None) -> None:
        """Act when the previous guarded step's skip reached the limit; then remember this
        one. Raises :class:`GuardStopError` or ``SystemExit(GUARD_STOP_EXIT_CODE)``."""
        previous, self._previous = self._previous, (
            None if decision is None else (step, decision)
        )
        if previous is None:
            return
        reached_at, earlier = previous
        reading = earlier.reading()
        if reading.skipped is None or reading.consecutive < self.limit:
            return
        message = (
            f"gradwatch: the guard skipped {reading.consecutive} steps in a row up to step "
            f"{reached_at} (max_consecutive_skips); on_max_consecutive_skips={self.action!r}"
        )
        if self._incidents is not None:
            self._incidents.write({
                "step": reached_at, "reason": SKIP_LIMIT_REASON, "norm": None,
                "threshold": None, "batch": None, "action": self.action,
                "exit_code": GUARD_STOP_EXIT_CODE if self.action == "exit" else None,
            })
            self._incidents.flush()
        log.error("%s", message)
        if self.action == "exit":
            raise SystemExit(GUARD_STOP_EXIT_CODE)
        raise GuardStopError(message)
