"""The publisher thread and the :class:`Sink` protocol it feeds.

Global rank 0 runs one :class:`Publisher`. The **training thread** only calls
:meth:`Publisher.submit` (appends a pending result to a bounded queue under a lock held for a
few microseconds; never waits, never raises). The **publisher thread** (``gradwatch-publisher``,
a daemon) takes pending results in order, materializes them (``pending.result()``: the wait for
the all-reduce and the host-side summary), publishes each snapshot on the endpoint (the
in-memory :class:`~gradwatch.export.state.PublishedState`) and hands it to one
:class:`~gradwatch.export.sinkworker.SinkWorker` per other sink (the history file, the trackers,
any sink a user added): each has its own bounded queue and thread, so a slow, failing or hung
sink never delays the endpoint or another sink (see :mod:`gradwatch.export.sinkworker`).

If materializing falls behind, the oldest pending result is dropped (``MAX_PENDING`` are kept)
and counted in ``gradwatch_dropped_snapshots_total``. An exception while materializing or
publishing on the endpoint is logged once per kind and counted in
``gradwatch_publish_errors_total``; a sink's are counted per sink
(``gradwatch_sink_errors_total``, ``gradwatch_sink_dropped_steps_total``). Nothing here can
raise into the training loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gradwatch.errors import GradWatchError
from gradwatch.export.metricdef import MAX_PENDING
from gradwatch.export.sinkworker import SinkWorker, sink_name
from gradwatch.snapshot import Snapshot

if TYPE_CHECKING:
    from gradwatch.export.state import SelfStats

__all__ = [
    "MAX_PENDING",
    "PendingLike",
    "Publisher",
    "Sink",
    "sink_action",
]

# One logger for the whole exporter: users filter or silence "gradwatch.export".
log = logging.getLogger("gradwatch.export")



class PendingLike(Protocol):
    """What the publisher accepts (``gradwatch.PendingSnapshot``)."""

    step: int

    def result(self) -> Snapshot: ...


@runtime_checkable
class Sink(Protocol):
    """A consumer of published snapshots, called by its own worker thread (never by training).

    ``write`` receives the published snapshots of global rank 0, in step order, one call at a
    time, from the sink's thread ``gradwatch-sink-<name>``. It may block or raise without
    delaying the endpoint or the other sinks: a sink that falls behind keeps the newest
    ``sink_queue_size`` steps, a ``write`` that raises is retried with backoff, and every step
    it never gets is counted (``gradwatch_sink_errors_total{sink}``,
    ``gradwatch_sink_dropped_steps_total{sink}``; :mod:`gradwatch.export.sinkworker`).

    Optional members, looked up with ``getattr``:

    * ``name: str``: the ``sink`` label (``history``, ``tensorboard``...); by default the class
      name;
    * ``action: str`` completes log lines such as "could not <action> a collected step";
    * ``note_dropped(total: int) -> None``: called before each ``write`` with how many steps
      this sink has lost so far, so it can record them itself (the tracker sinks log
      ``<prefix>/dropped_steps``);
    * ``close() -> None`` is called once, after the last ``write``, when publishing closes.

    :class:`gradwatch.export.history.HistoryWriter` and the endpoint's published state are sinks.
    """

    def write(self, snapshot: Snapshot) -> None: ...


def sink_action(sink: Sink) -> str:
    """The ``action`` of ``sink`` for error logs (see :class:`Sink`)."""
    action = getattr(sink, "action", None)
    return action if isinstance(action, str) and action else f"hand {type(sink).__name__}"


class Publisher:
    """Bounded FIFO of pending results and the daemon thread that publishes them on the endpoint
    (``endpoint``, written in this thread: in memory, microseconds) and offers them to one
    :class:`~gradwatch.export.sinkworker.SinkWorker` per other sink.

    Thread-safe. ``submit``, ``flush`` and ``add_sink`` may be called from any thread; ``_run``
    is the only consumer. Items carry a sequence number; ``_done`` is the highest one handled
    (published, failed or dropped), which makes ``flush`` exact. Errors and drops are counted in
    ``stats``.

    Args:
        endpoint: the endpoint's published state, or None without an endpoint.
        sinks: the other sinks, each fed by its own worker.
        stats: the exporter's self-stats.
        queue_size: each sink's queue (``WatchConfig.sink_queue_size``).
        sink_timeout: a sink's write running longer is reported
            (``WatchConfig.sink_timeout_seconds``).
    """

    def __init__(
        self,
        endpoint: Sink | None,
        sinks: Sequence[Sink],
        stats: SelfStats,
        *,
        queue_size: int,
        sink_timeout: float,
    ) -> None:
        self._endpoint = endpoint
        self._stats = stats
        self._queue_size = queue_size
        self._sink_timeout = sink_timeout
        self._cond = threading.Condition()
        self._workers: tuple[SinkWorker, ...] = ()
        self._queue: deque[tuple[int, PendingLike]] = deque()
        self._submitted = 0
        self._done = 0
        self._stopping = False
        self._in_hand = False  # the thread holds an item it has not finished handling
        self._in_hand_counted = False  # ... already counted (an error, or the endpoint had it)
        self._logged_kinds: set[str] = set()
        for sink in sinks:
            self.add_sink(sink)
        self.thread = threading.Thread(target=self._run, name="gradwatch-publisher", daemon=True)
        self.thread.start()

    @property
    def sinks(self) -> tuple[Sink, ...]:
        """The endpoint's state (when there is one), then every other sink in order."""
        first = () if self._endpoint is None else (self._endpoint,)
        return (*first, *(w.sink for w in self._workers))

    @property
    def workers(self) -> tuple[SinkWorker, ...]:
        return self._workers

    def add_sink(self, sink: Sink) -> None:
        """Feed ``sink`` from its own worker; it receives the snapshots published from now on.
        Its ``sink`` series start at 0 at once."""
        with self._cond:
            if self._stopping:
                return
            name = sink_name(sink, {w.name for w in self._workers})
            self._stats.add_sink(name)
            worker = SinkWorker(
                sink, name, self._stats, queue_size=self._queue_size, timeout=self._sink_timeout
            )
            self._workers = (*self._workers, worker)

    def submit(self, pending: PendingLike) -> bool:
        """Queue ``pending``; False (ignored) once stopping. Never blocks on the device."""
        with self._cond:
            if self._stopping:
                return False
            self._submitted += 1
            if len(self._queue) >= MAX_PENDING:
                self._queue.popleft()
                self._stats.add_dropped()
            self._queue.append((self._submitted, pending))
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        """:meth:`flush_endpoint` then :meth:`flush_sinks`, within ``timeout`` seconds."""
        deadline = time.monotonic() + max(timeout, 0.0)
        return self.flush_endpoint(deadline) and self.flush_sinks(deadline)

    def flush_endpoint(self, deadline: float) -> bool:
        """Wait (until the monotonic ``deadline``) until everything submitted so far is handled:
        materialized, on the endpoint and offered to every sink; False on timeout or once
        stopping."""
        with self._cond:
            if self._stopping:
                return False
            target = self._submitted
            handled = self._cond.wait_for(
                lambda: self._done >= target or not self.thread.is_alive(),
                max(deadline - time.monotonic(), 0.0),
            )
            return bool(handled) and self._done >= target

    def flush_sinks(self, deadline: float) -> bool:
        """Wait (until the monotonic ``deadline``) until every sink wrote, or lost and counted,
        what it was offered so far; False when one did not in time (each such sink logged)."""
        return all([w.flush(deadline) for w in self._workers])

    def stop(self, timeout: float) -> int:
        """Stop after the item in hand; later ones are discarded. Waits at most ``timeout``,
        then stops every sink's worker within the same bound.

        Returns how many submitted results were not handled (discarded, plus the one in hand
        when the thread did not end in time and the endpoint did not have it yet); they are
        counted in ``gradwatch_dropped_snapshots_total``. What a sink lost is counted per sink
        (``gradwatch_sink_dropped_steps_total``).
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            self._stopping = True
            lost = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join(max(timeout, 0.0))
        with self._cond:
            if self._in_hand and not self._in_hand_counted:
                lost += 1  # the item in hand: stuck in result()
        for _ in range(lost):
            self._stats.add_dropped()
        for worker in self._workers:
            worker.stop(deadline)
        return lost

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                seq, pending = self._queue.popleft()
                self._in_hand, self._in_hand_counted = True, False
            try:
                self._handle(pending)
            finally:
                with self._cond:
                    self._in_hand = False
                    self._done = max(self._done, seq)
                    self._cond.notify_all()

    def _handle(self, pending: PendingLike) -> None:
        try:
            snap = pending.result()
        except Exception as exc:  # e.g. GradWatchTimeoutError: a peer stopped collecting
            self._error("materialize", exc)
            self._in_hand_counted = True
            return
        if self._endpoint is not None:
            try:
                self._endpoint.write(snap)
            except Exception as exc:
                self._error(sink_action(self._endpoint), exc)
        self._in_hand_counted = True
        for worker in self._workers:
            worker.offer(snap)  # never blocks: each sink has its own queue and thread

    def _error(self, action: str, exc: Exception) -> None:
        self._stats.add_error()
        kind = f"{action}:{type(exc).__name__}"
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            log.warning(
                "gradwatch: could not %s a collected step (%s: %s); counted in "
                "gradwatch_publish_errors_total, later errors of this kind are not logged",
                action,
                type(exc).__name__,
                exc,
                # gradwatch's own errors (a straggler's timeout...) say all in one line; a
                # traceback is for the unexpected (a bug in a sink)
                exc_info=None if isinstance(exc, GradWatchError) else exc,
            )
