"""The publisher thread and the :class:`Sink` protocol it feeds.

Global rank 0 runs one :class:`Publisher`. The **training thread** only calls
:meth:`Publisher.submit` (appends a pending result to a bounded queue under a lock held for a
few microseconds; never waits, never raises). The **publisher thread** (``gradwatch-publisher``,
a daemon) takes pending results in order, materializes them (``pending.result()``: the wait for
the all-reduce and the host-side summary) and hands each snapshot to every sink in order: the
endpoint's published state, the history file, and any sink a user added.

If publishing falls behind, the oldest pending result is dropped (``MAX_PENDING`` are kept) and
counted in ``gradwatch_dropped_snapshots_total``. An exception while materializing, or raised by
a sink, is logged once per kind, counted in ``gradwatch_publish_errors_total``, and the other
sinks and the next step go on as usual: nothing here can raise into the training loop.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from gradwatch.errors import GradWatchError
from gradwatch.export.metricdef import MAX_PENDING
from gradwatch.snapshot import Snapshot

if TYPE_CHECKING:
    from gradwatch.export.state import SelfStats

__all__ = ["MAX_PENDING", "PendingLike", "Publisher", "Sink", "sink_action"]

# One logger for the whole exporter: users filter or silence "gradwatch.export".
log = logging.getLogger("gradwatch.export")



class PendingLike(Protocol):
    """What the publisher accepts (``gradwatch.PendingSnapshot``)."""

    step: int

    def result(self) -> Snapshot: ...


@runtime_checkable
class Sink(Protocol):
    """A consumer of published snapshots, called by the publisher thread (never by training).

    ``write`` receives every published snapshot of global rank 0, in step order, one call at a
    time. It may block for a while (it delays later steps, which are dropped past
    ``MAX_PENDING`` and counted); an exception it raises is logged once per kind, counted in
    ``gradwatch_publish_errors_total``, and does not stop the other sinks or later steps.

    Two optional members, looked up with ``getattr``:

    * ``action: str`` completes the log line "gradwatch: could not <action> a collected step"
      (e.g. ``"write the history of"``); by default ``"hand <ClassName>"``;
    * ``close() -> None`` is called once, after the last ``write``, when publishing closes.

    :class:`gradwatch.export.history.HistoryWriter` and the endpoint's published state are sinks.
    """

    def write(self, snapshot: Snapshot) -> None: ...


def sink_action(sink: Sink) -> str:
    """The ``action`` of ``sink`` for error logs (see :class:`Sink`)."""
    action = getattr(sink, "action", None)
    return action if isinstance(action, str) and action else f"hand {type(sink).__name__}"


class Publisher:
    """Bounded FIFO of pending results and the daemon thread that hands them to the sinks.

    Thread-safe. ``submit``, ``flush`` and ``add_sink`` may be called from any thread; ``_run``
    is the only consumer. Items carry a sequence number; ``_done`` is the highest one handled
    (published, failed or dropped), which makes ``flush`` exact. Errors and drops are counted in
    ``stats``.
    """

    def __init__(self, sinks: Sequence[Sink], stats: SelfStats) -> None:
        self._sinks = tuple(sinks)
        self._stats = stats
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, PendingLike]] = deque()
        self._submitted = 0
        self._done = 0
        self._stopping = False
        self._in_hand = False  # the thread holds an item it has not finished handling
        self._in_hand_counted = False  # ... already counted (an error, or the first sink had it)
        self._logged_kinds: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="gradwatch-publisher", daemon=True)
        self.thread.start()

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return self._sinks

    def add_sink(self, sink: Sink) -> None:
        """Append ``sink``; it receives the snapshots published from now on."""
        with self._cond:
            self._sinks = (*self._sinks, sink)

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
        """Wait until everything submitted so far is handled; False on timeout or once stopping."""
        with self._cond:
            if self._stopping:
                return False
            target = self._submitted
            return (
                self._cond.wait_for(
                    lambda: self._done >= target or not self.thread.is_alive(), timeout
                )
                and self._done >= target
            )

    def stop(self, timeout: float) -> int:
        """Stop after the item in hand; later ones are discarded. Waits at most ``timeout``.

        Returns how many submitted results were not handled (discarded, plus the one in hand
        when the thread did not end in time and no sink had it yet); they are counted in
        ``gradwatch_dropped_snapshots_total``. A result the first sink (the endpoint's state,
        when there is one) took is counted there already, not again.
        """
        with self._cond:
            self._stopping = True
            lost = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join(max(timeout, 0.0))
        with self._cond:
            if self._in_hand and not self._in_hand_counted:
                lost += 1  # the item in hand: stuck in result() or in a sink
        for _ in range(lost):
            self._stats.add_dropped()
        return lost

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                seq, pending = self._queue.popleft()
                sinks = self._sinks
                self._in_hand, self._in_hand_counted = True, False
            try:
                self._handle(pending, sinks)
            finally:
                with self._cond:
                    self._in_hand = False
                    self._done = max(self._done, seq)
                    self._cond.notify_all()

    def _handle(self, pending: PendingLike, sinks: tuple[Sink, ...]) -> None:
        try:
            snap = pending.result()
        except Exception as exc:  # e.g. GradWatchTimeoutError: a peer stopped collecting
            self._error("materialize", exc)
            self._in_hand_counted = True
            return
        for sink in sinks:
            if self._stopping:  # close() gave up waiting and may be closing the sinks
                return
            try:
                sink.write(snap)
            except Exception as exc:
                self._error(sink_action(sink), exc)
            self._in_hand_counted = True

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
