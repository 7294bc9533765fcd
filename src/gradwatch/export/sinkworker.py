"""One sink's bounded queue and worker thread, so no sink can hold up the endpoint or another sink.

Rank 0's publisher thread materializes each step, publishes it on the endpoint, then hands the
snapshot to one :class:`SinkWorker` per sink (the history file, each tracker, each user
:class:`~gradwatch.export.publisher.Sink`) with :meth:`SinkWorker.offer`: a deque append under
a lock held for microseconds, never a wait. Each worker (a daemon thread named
``gradwatch-sink-<name>``) writes its snapshots in step order.

Nothing is lost silently. A sink that falls behind keeps the newest ``queue_size`` steps
(``WatchConfig.sink_queue_size``): an offer to a full queue drops the oldest waiting step. A
``write`` that raises is counted in ``gradwatch_sink_errors_total{sink}`` and retried with
exponential backoff (:data:`RETRY_FIRST_SECONDS` doubling up to :data:`RETRY_MAX_SECONDS`);
after :data:`RETRY_ATTEMPTS` failed attempts the step is given up and the worker goes on with
the next one, still backing off until a write succeeds. A ``write`` that runs longer than
``WatchConfig.sink_timeout_seconds`` is counted once per stall as an error (the sink is
blocked; its queue keeps the newest steps meanwhile). Every step a sink never got (dropped from
a full queue, given up, discarded or stuck at close) is counted in
``gradwatch_sink_dropped_steps_total{sink}``. The sink itself is told, through its optional
``note_dropped(total)`` before each write, how many collected steps it never got: its own
losses plus the steps the publisher dropped before any sink saw them
(``gradwatch_dropped_snapshots_total``); the tracker sinks log it as the scalar
``<prefix>/dropped_steps``. The first error, drop and recovery of each sink are logged at
once, later ones at most once per :data:`LOG_INTERVAL_SECONDS` with how many happened since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Protocol

from gradwatch.snapshot import Snapshot

__all__ = [
    "LOG_INTERVAL_SECONDS",
    "RETRY_ATTEMPTS",
    "RETRY_FIRST_SECONDS",
    "RETRY_MAX_SECONDS",
    "RateLimitedLog",
    "SinkWorker",
    "sink_name",
]

log = logging.getLogger("gradwatch.export")

#: A failed write is retried after this long, doubling at each failure until a write succeeds.
RETRY_FIRST_SECONDS = 0.1
#: The longest wait between two attempts of a failing sink.
RETRY_MAX_SECONDS = 10.0
#: Attempts of one step before it is given up (counted as dropped) for the next one.
RETRY_ATTEMPTS = 3
#: How often a flush waiting for a sink looks whether it stalled meanwhile.
_FLUSH_POLL_SECONDS = 0.1
#: After the first of a kind, a sink's errors, drops and recoveries are logged at most this often.
LOG_INTERVAL_SECONDS = 60.0


class Sink(Protocol):
    """What a worker writes to (:class:`gradwatch.export.publisher.Sink`, whose module imports
    this one)."""

    def write(self, snapshot: Snapshot) -> None: ...


class SinkCounters(Protocol):
    """Where a worker counts (:class:`~gradwatch.export.state.SelfStats`)."""

    def add_sink_error(self, sink: str) -> None: ...

    def add_sink_dropped(self, sink: str, steps: int = 1) -> None: ...

    @property
    def dropped(self) -> int:
        """Collected steps the publisher dropped before any sink saw them."""
        ...


def sink_name(sink: Sink, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """The ``sink`` label of ``sink``: its ``name`` attribute (``history``, ``tensorboard``,
    ``wandb``, ``mlflow``), else its class name; ``_2``, ``_3``... when already ``taken``."""
    name = getattr(sink, "name", None)
    base = name if isinstance(name, str) and name else type(sink).__name__
    label, n = base, 1
    while label in taken:
        n += 1
        label = f"{base}_{n}"
    return label


class RateLimitedLog:
    """Warnings of one sink: the first of each kind at once, later ones at most once per
    ``interval`` seconds, saying how many were not logged since. Thread-safe."""

    def __init__(self, interval: float = LOG_INTERVAL_SECONDS) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def warning(self, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``kind`` was logged less than ``interval`` ago (then
        count it); True when logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._muted[kind] = self._muted.get(kind, 0) + 1
                return False
            self._last[kind] = now
            muted = self._muted.pop(kind, 0)
        suffix = f" ({muted} more since the last such message)" if muted else ""
        log.warning(message + suffix, *args)
        return True


class SinkWorker:
    """One sink, its bounded FIFO of snapshots and the daemon thread that writes them.

    Thread-safe: :meth:`offer` (the publisher thread), :meth:`flush` and :meth:`stop` (any
    thread); ``_run`` is the only consumer. Items carry a sequence number; ``_done`` is the
    highest one handled (written, given up or dropped), which makes :meth:`flush` exact.
    """

    def __init__(
        self,
        sink: Sink,
        name: str,
        counters: SinkCounters,
        *,
        queue_size: int,
        timeout: float,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {queue_size}")
        self.sink = sink
        self.name = name
        self._counters = counters
        self._queue_size = queue_size
        self._timeout = timeout
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, Snapshot]] = deque()
        self._offered = 0
        self._done = 0
        self._stopping = False
        self._in_hand = False
        self._dropped = 0  # every step this sink never got, for note_dropped
        self._busy_since: float | None = None  # monotonic start of the write in progress
        self._stall_reported = False
        self._backoff = 0.0  # 0 while the sink is healthy
        self._log = RateLimitedLog()
        self.thread = threading.Thread(target=self._run, name=f"gradwatch-sink-{name}", daemon=True)
        self.thread.start()

    @property
    def dropped(self) -> int:
        """Steps this sink never got so far (its ``gradwatch_sink_dropped_steps_total``)."""
        with self._cond:
            return self._dropped

    def offer(self, snapshot: Snapshot) -> None:
        """Queue ``snapshot`` for the sink; never blocks on it, never raises. A full queue drops
        its oldest step (counted); ignored once stopping."""
        dropped = 0
        with self._cond:
            if self._stopping:
                return
            self._offered += 1
            if len(self._queue) >= self._queue_size:
                seq, _ = self._queue.popleft()
                self._done = max(self._done, seq)
                dropped = self._drop_locked(1)
            self._queue.append((self._offered, snapshot))
            self._cond.notify_all()
        if dropped:  # logged outside the lock: a slow log handler never holds the publisher
            self._log_drop(1, "queue", dropped)
        self._check_stall()

    def flush(self, deadline: float, *, wait_failing: bool = False) -> bool:
        """Wait (until the monotonic ``deadline``) until every step offered so far was written,
        given up or dropped; False on timeout or once stopping (logged, rate-limited).

        A sink that is failing (retrying with backoff) or stalled (a write running past
        ``timeout``) is not waited for unless ``wait_failing``: its steps will be written or
        counted as lost without the caller, and a dead tracker must not make every
        ``flush()`` last its whole timeout.
        """
        with self._cond:
            if self._stopping:
                return False
            target = self._offered
            while self._done < target and self.thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (not wait_failing and self._failing()):
                    break
                self._cond.wait(min(remaining, _FLUSH_POLL_SECONDS))  # a stall is not notified
            if self._done >= target:
                return True
            waiting = len(self._queue) + int(self._in_hand)
            failing = self._failing()
        self._log.warning(
            "flush",
            "gradwatch: flushing returned with %d step(s) not yet written by the %r sink (%s)",
            waiting, self.name,
            "failing or stalled: not waited for" if failing
            else "the timeout of flush() or close() passed",
        )  # fmt: skip
        return False

    def _failing(self) -> bool:
        """Retrying a failed write, or in a write running past ``timeout``."""
        busy = self._busy_since
        return self._backoff > 0 or (busy is not None and time.monotonic() - busy > self._timeout)

    def stop(self, deadline: float) -> int:
        """Stop after the write in hand, waiting for it until the monotonic ``deadline``; the
        waiting steps are discarded. Returns how many steps were lost (discarded, plus the one
        in hand when the thread did not end in time), counted as dropped."""
        with self._cond:
            self._stopping = True
            lost = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join(max(deadline - time.monotonic(), 0.0))
        with self._cond:
            if self._in_hand:
                lost += 1  # stuck in the sink's write (or its backoff) and abandoned
                self._in_hand = False
            total = self._drop_locked(lost) if lost else 0
        if lost:
            self._log_drop(lost, "close", total)
        return lost

    # -- the worker thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                seq, snapshot = self._queue.popleft()
                self._in_hand = True
            self._deliver(snapshot)
            with self._cond:
                if self._in_hand:  # else stop() counted it already
                    self._in_hand = False
                self._done = max(self._done, seq)
                self._cond.notify_all()

    def _deliver(self, snapshot: Snapshot) -> None:
        """Write ``snapshot``, retrying with backoff; give it up after ``RETRY_ATTEMPTS``."""
        for attempt in range(1, RETRY_ATTEMPTS + 1):
            if self._backoff and not self._sleep(self._backoff):
                return  # stopping: stop() counts the step in hand
            try:
                self._write(snapshot)
            except Exception as exc:
                self._failed(exc, attempt)
                continue
            if self._backoff:
                self._backoff = 0.0
                self._log.warning(
                    "recovered", "gradwatch: the %r sink writes again (step %d)", self.name,
                    snapshot.step,
                )
            return
        with self._cond:
            total = self._drop_locked(1) if self._in_hand else 0
        if total:
            self._log_drop(1, "given up", total)

    def _write(self, snapshot: Snapshot) -> None:
        note = getattr(self.sink, "note_dropped", None)
        self._busy_since = time.monotonic()
        try:
            if callable(note):  # every collected step it never got, here or upstream
                note(self.dropped + self._counters.dropped)
            self.sink.write(snapshot)
        finally:
            self._busy_since = None
            self._stall_reported = False

    def _failed(self, exc: Exception, attempt: int) -> None:
        self._counters.add_sink_error(self.name)
        self._backoff = min(
            max(self._backoff * 2.0, RETRY_FIRST_SECONDS), RETRY_MAX_SECONDS
        )
        self._log.warning(
            f"error:{type(exc).__name__}",
            "gradwatch: the %r sink failed to write a step (%s: %s; attempt %d of %d, next in "
            "%.1fs); counted in gradwatch_sink_errors_total{sink=%r}. The endpoint and the "
            "other sinks are not affected",
            self.name, type(exc).__name__, exc, attempt, RETRY_ATTEMPTS, self._backoff,
            self.name,
        )  # fmt: skip

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless stopping meanwhile; False when stopping."""
        with self._cond:
            return not self._cond.wait_for(lambda: self._stopping, seconds)

    def _check_stall(self) -> None:
        """Count a write running past ``timeout`` once (the publisher thread, at each offer)."""
        since = self._busy_since
        if since is None or self._stall_reported or time.monotonic() - since <= self._timeout:
            return
        self._stall_reported = True
        self._counters.add_sink_error(self.name)
        self._log.warning(
            "blocked",
            "gradwatch: the %r sink has been writing one step for more than "
            "sink_timeout_seconds=%.1fs (a tracker server or file system that hangs?); counted "
            "in gradwatch_sink_errors_total{sink=%r}, its queue keeps the newest %d steps",
            self.name, self._timeout, self.name, self._queue_size,
        )  # fmt: skip

    def _drop_locked(self, steps: int) -> int:
        """Count ``steps`` lost (the caller holds ``_cond``); the total so far."""
        self._dropped += steps
        self._counters.add_sink_dropped(self.name, steps)
        return self._dropped

    def _log_drop(self, steps: int, why: str, total: int) -> None:
        self._log.warning(
            f"drop:{why}",
            "gradwatch: the %r sink lost %d step(s) (%s; %d so far); counted in "
            "gradwatch_sink_dropped_steps_total{sink=%r} and given to the sink",
            self.name, steps, _WHY[why], total, self.name,
        )  # fmt: skip


_WHY = {
    "queue": "it fell behind: its queue was full and the oldest waiting step was dropped",
    "given up": f"its write failed {RETRY_ATTEMPTS} times",
    "close": "closing did not wait for it",
}
