"""The one place gradwatch issues and waits for its all-reduce: three routes, one pending type.

Every collect's packed vector takes one of three routes, decided identically on every rank:

* **the device group**: gradwatch's own process group on the job's backend (so its traffic
  never interleaves with the job's collectives on the default group; created at construction,
  or at the first clip where a host group exists), issued asynchronously on the training
  thread; a clip takes it, as it needs the reduced norm on the device;
* **the host group**: a gloo group for the monitoring-only all-reduces of NCCL jobs (and of
  gloo jobs with accelerator gradients): the vector is copied to pinned host memory and a
  daemon thread issues the all-reduce once the copy landed, so nothing waits on the training
  stream;
* **no collective**: one process, or a collect whose figures every rank already holds (see
  :meth:`gradwatch.reduce.packing.Reducer.issues_collective`).

Each returns a :class:`Pending` whose :meth:`Pending.wait` bounds the whole wait (the copy to
the host, the issue, the collective) by one timeout; :func:`wait_event` bounds the wait for a
device-to-host copy.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import math
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradwatch.errors import GradWatchError, GradWatchTimeoutError

log = logging.getLogger("gradwatch")

#: Backends whose monitoring-only collects all-reduce on a separate gloo group from a background
#: thread, so a rank that stops collecting never stalls the training stream (an NCCL collective
#: awaited by the training stream would, and the NCCL watchdog would then abort the job). Clips
#: keep the job's backend. Tests add "gloo" to run the same path on CPU.
MONITOR_ON_HOST_BACKENDS: tuple[str, ...] = ("nccl",)


def bound_device() -> torch.device | None:
    """The device the default process group was bound to (``init_process_group(device_id=)``),
    if any (``ProcessGroup.bound_device_id``)."""
    with contextlib.suppress(AttributeError, RuntimeError, ValueError):  # private c10d API
        bound = dist.distributed_c10d._get_default_group().bound_device_id
        if bound is not None:
            return torch.device(bound)
    return None


def reducer_device(
    gradients: torch.device | None, backend: str | None, bound: torch.device | None
) -> torch.device:
    """Where the packed vector lives, so no collect copies between host and device.

    The gradients' accelerator when they have one, whatever the backend and world size (a
    single-GPU job reduces and clips on its GPU); under NCCL the process group's bound device
    comes first (``device_id=``), then the gradients', and ``current_device()`` only as the
    last resort (gradients on the CPU, e.g. FSDP2 CPU offload): ranks that bind their GPU by
    ``device_id=`` or ``model.to(cuda:k)`` without ``set_device`` would otherwise all pick
    cuda:0. Without NCCL and without accelerator gradients: the CPU.
    """
    if backend is not None and "nccl" in backend:
        if bound is not None:
            return bound
        if gradients is not None and gradients.type == "cuda":
            return gradients
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    if gradients is not None:
        return gradients
    return _CPU


_CPU = torch.device("cpu")  # immutable: one shared value, not one built per collect


def capturing() -> bool:
    """Is the calling thread's current CUDA stream capturing a graph? (False without CUDA
    initialized: nothing can be capturing.) A collect inside a capture would record a pinned
    allocation, an event and a ``fill_`` of the step into the graph, replayed with stale
    values: refused (:class:`gradwatch.errors.GradWatchError`)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def refuse_capture() -> None:
    """Raise :class:`~gradwatch.errors.GradWatchError` when called inside CUDA graph capture
    (:func:`capturing`): ``collect()`` and ``clip_grad_norm_()`` are refused there, never
    recorded into the graph."""
    if capturing():
        raise GradWatchError(
            "gradwatch: collect() and clip_grad_norm_() cannot run inside CUDA graph "
            "capture (its all-reduce, event and host copy would be replayed with stale "
            "values); call them outside the captured region (docs/gpu.md)"
        )


class LandedFlag(threading.Event):
    """Set when a recorded event completed, or when waiting for it raised: then :attr:`error`
    holds why, and the buffer the event guards was never known to be written (a device error).
    :meth:`landed` is the only test for "the data is there"; :func:`wait_landed` raises on an
    error instead of returning."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def landed(self) -> bool:
        """Set, and the wait succeeded: the guarded buffer holds the device's data."""
        return self.is_set() and self.error is None


class _Landing:
    """One daemon thread that waits for CUDA events in record order (``Event.synchronize()``)
    and wakes each waiter the moment its event completed: no sleep poll (a poll is late by its
    period, every read), never ``query()``. Events are created with ``blocking=True``, so the
    wait yields the core.

    Capture windows (:func:`capture_window`): while one is open the thread makes no CUDA call
    at all; opening one first waits (bounded) for a wait in progress to return. A CUDA graph
    captured in ``"global"`` mode (``torch.cuda.graph``'s default ``capture_error_mode``)
    forbids potentially unsafe CUDA calls from *every* thread, so an event wait from this
    thread during such a capture could invalidate it; ``"thread_local"`` and ``"relaxed"``
    captures do not need a window."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, LandedFlag]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._gate = threading.Condition()
        self._windows = 0  # capture windows open
        self._in_wait = False  # inside Event.synchronize()

    def watch(self, event: Any) -> LandedFlag:
        """A flag set once ``event`` completed, or once its wait raised (with the error: the
        waiter never reads the buffer then)."""
        landed = LandedFlag()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="gradwatch-landing", daemon=True
                )
                self._thread.start()
        self._queue.put((event, landed))
        return landed

    def _run(self) -> None:
        while True:
            event, landed = self._queue.get()
            with self._gate:
                self._gate.wait_for(lambda: self._windows == 0)
                self._in_wait = True
            try:
                event.synchronize()
            except Exception as exc:  # never-crash boundary: the waiter raises it instead
                landed.error = exc
            finally:
                with self._gate:
                    self._in_wait = False
                    self._gate.notify_all()
                landed.set()

    @contextlib.contextmanager
    def window(self, timeout: float) -> Iterator[None]:
        with self._gate:
            self._windows += 1
            if not self._gate.wait_for(lambda: not self._in_wait, timeout):
                log.warning(
                    "gradwatch: capture_window(): an event wait still runs after %.1fs (the "
                    "device is busy); a capture in 'global' mode may fail", timeout,
                )
        try:
            yield
        finally:
            with self._gate:
                self._windows -= 1
                self._gate.notify_all()


_LANDING = _Landing()


def capture_window(timeout: float = 60.0) -> contextlib.AbstractContextManager[None]:
    """A region in which gradwatch's threads make no CUDA call: open it around a CUDA graph
    capture in ``"global"`` mode (the default of ``torch.cuda.graph``)::

        with gradwatch.capture_window(), torch.cuda.graph(g):
            ...

    Entering waits, at most ``timeout`` seconds, for an event wait in progress (events recorded
    before the window, i.e. device work already queued: ``torch.cuda.graph`` itself
    synchronizes the device before it captures); a longer wait is logged and the window opens
    anyway. Inside it, results whose device data has not landed wait for the window to close
    (bounded by ``collective_timeout_seconds``, then "not measured"); ``collect()`` and
    ``clip_grad_norm_()`` inside the capture itself are refused (:func:`refuse_capture`).
    Windows nest and may be opened from any thread. Not needed for ``"thread_local"`` or
    ``"relaxed"`` captures (``torch.compile``'s CUDA graphs use ``"thread_local"``)."""
    return _LANDING.window(timeout)


def landed(event: Any) -> LandedFlag:
    """Start watching ``event`` (a CUDA event, or anything with ``synchronize()``): the flag is
    set when it completed. Watch it as soon as it is recorded, so the wait overlaps the
    device's work."""
    return _LANDING.watch(event)


def record_event(device: torch.device) -> Any:
    """A blocking-sync CUDA event recorded on ``device``'s current stream (``Event.record()``
    alone uses the *current* device's stream, which may be another GPU's)."""
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    return event


def wait_landed(flag: threading.Event, timeout: float, what: str) -> None:
    """Wait at most ``timeout`` seconds for a :func:`landed` flag, woken when it is set; a
    flag whose event wait raised raises :class:`GradWatchError` (the data never landed)."""
    if not flag.wait(timeout):
        raise GradWatchTimeoutError(
            f"gradwatch: {what} did not reach the host within {timeout}s "
            "(collective_timeout_seconds): the device is stuck"
        )
    error = getattr(flag, "error", None)
    if error is not None:
        raise GradWatchError(
            f"gradwatch: {what} never reached the host: waiting for its copy raised "
            f"{type(error).__name__}: {error}"
        ) from error


def wait_event(event: Any, timeout: float, what: str) -> None:
    """Wait for a CUDA event for at most ``timeout`` seconds, woken when it completes
    (:func:`landed`; ``Event.synchronize()`` itself has no timeout)."""
    wait_landed(landed(event), timeout, what)


class CollectiveTimeout(RuntimeError):
    """The all-reduce is still in flight after the wait's timeout (a straggler, or a rank that
    has not reached this collect yet): it stays issued and completes when the others arrive, so
    the ranks' collective sequences stay aligned; only this step goes unmeasured."""


class CollectiveFailed(RuntimeError):
    """The all-reduce completed with an error (a dead peer, a broken group, its group's own
    timeout): the group cannot be trusted any more."""


class StandIn(RuntimeError):
    """This rank's host thread could not await its vector's copy and all-reduced an all-NaN
    stand-in instead: the step is not measured on any rank, the group is fine."""


#: The ready event of every :class:`Pending` issued at construction: set once, never cleared.
_ISSUED = threading.Event()
_ISSUED.set()


class Pending:
    """One issued all-reduce (or none), whatever its route; :meth:`wait` may be retried after a
    :class:`CollectiveTimeout` (the collective is never abandoned).

    ``work``: the c10d work of a device-group all-reduce, or None when there is nothing to wait
    for. :meth:`queued` makes the pending result of a host-group all-reduce, which the host
    thread issues later (:meth:`_issued`).
    """

    def __init__(self, work: Any = None) -> None:
        # Issued already: the one shared set event (never cleared), no Event built per collect
        self._ready = _ISSUED
        self._work: Any = work
        self._error: BaseException | None = None
        self._broken = False  # the group refused the all-reduce (vs. a stand-in was issued)

    @classmethod
    def queued(cls) -> Pending:
        pending = cls()
        pending._ready = threading.Event()  # its own, set once the host thread issued it
        return pending

    def _issued(self, work: Any, error: BaseException | None, broken: bool = False) -> None:
        self._work, self._error, self._broken = work, error, broken
        self._ready.set()

    def settled(self) -> bool:
        """Completed (successfully or not) or never issued: nothing left to watch."""
        if not self._ready.is_set():
            return False
        work = self._work
        return work is None or bool(work.is_completed())

    def failure(self) -> str | None:
        """Without waiting: why the all-reduce failed, if it already completed with an error
        (None while it is in flight, or when it succeeded)."""
        if not self._ready.is_set():
            return None
        if self._broken:
            return f"{type(self._error).__name__}: {self._error}"
        work = self._work
        if work is None:
            return None
        try:
            if not work.is_completed():
                return None
            work.wait()
        except Exception as exc:  # the work's own error, raised again by wait()
            return f"{type(exc).__name__}: {exc}"
        return None

    def order_on_stream(self) -> None:
        """Accelerator backends: make the current stream wait for the collective (no host
        wait); later device work, and the copy to the host, then follow it."""
        if self._ready.is_set() and self._work is not None:
            self._work.wait()
            self._work = None

    def wait(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds in all for the all-reduce to be issued and to
        complete. :class:`CollectiveTimeout` when it is still in flight (a later wait may
        succeed), :class:`CollectiveFailed` when it completed with an error or this rank could
        not feed it (its host thread issued a stand-in instead: see :class:`_HostThread`)."""
        deadline = time.monotonic() + timeout
        # is_set() first: an issued one (nearly always) is not waited on under the event's lock
        if not self._ready.is_set() and not self._ready.wait(timeout):
            raise CollectiveTimeout("the monitoring all-reduce was not issued in time")
        if self._error is not None:
            if self._broken:
                raise CollectiveFailed(f"{type(self._error).__name__}: {self._error}")
            raise StandIn(f"this rank's packed vector never reached the host ({self._error}); "
                          "an all-NaN stand-in was all-reduced instead")
        work = self._work
        if work is not None:
            left = max(0.001, deadline - time.monotonic())
            try:
                work.wait(timedelta(seconds=left))
            except Exception as exc:
                # A wait that timed out leaves the work running (c10d's Work::wait); one that
                # completed with an error is a broken group.
                if not work.is_completed():
                    raise CollectiveTimeout(f"still in flight after {timeout}s") from exc
                raise CollectiveFailed(f"{type(exc).__name__}: {exc}") from exc
            self._work = None


class _HostThread:
    """Issues the monitoring-only all-reduces on a gloo group, in collect order, from one daemon
    thread: it waits (bounded) for each vector's copy to pinned host memory, then issues the
    asynchronous gloo all-reduce. Nothing here ever touches the training stream.

    Every submitted vector is issued, in order: when its copy cannot be awaited (the wait raised
    or timed out), an all-NaN stand-in of the same shape is all-reduced instead (a fresh tensor:
    the late copy may still land in the original), so every rank's sum of that collect carries
    NaN in its step slot and every rank reports the step as not measured, while the next
    collects still pair step for step (gloo pairs collectives by order)."""

    def __init__(self, group: Any, timeout: float) -> None:
        self._group = group
        self._timeout = timeout
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.SUM
        self._thread: threading.Thread | None = None
        self.failed_copies = 0  # collects whose vector was replaced by the all-NaN stand-in

    def submit(self, host: Tensor, event: Any) -> Pending:
        work = Pending.queued()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="gradwatch-host-reduce", daemon=True
            )
            self._thread.start()
        self._queue.put((host, event, work))
        return work

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            host, event, work = item
            try:
                self._land(host, event)
            except Exception as exc:  # reported by result(), never raised in training
                self._stand_in(host, work, exc)
                continue
            try:
                work._issued(self._group.allreduce([host], self._options), None)
            except Exception as exc:  # the group itself refused: broken
                work._issued(None, exc, broken=True)

    def _land(self, host: Tensor, event: threading.Event | None) -> None:
        """Wait (bounded) until the copy of the packed vector into ``host`` landed."""
        if event is not None:
            wait_landed(event, self._timeout, "the packed vector")

    def _stand_in(self, host: Tensor, work: Pending, exc: Exception) -> None:
        if not self.failed_copies:
            log.error(
                "gradwatch: the packed vector of a collect never reached the host (%s: %s); an "
                "all-NaN stand-in keeps the ranks' collectives paired: that step is not "
                "measured on any rank (logged once)", type(exc).__name__, exc,
            )
        self.failed_copies += 1
        stand_in = torch.full(host.shape, math.nan, dtype=host.dtype)
        try:
            self._group.allreduce([stand_in], self._options)
        except Exception as inner:
            work._issued(None, inner, broken=True)
            return
        work._issued(None, exc)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=1.0)
            self._thread = None


def job_timeout() -> timedelta:
    """The job's default process-group timeout (``init_process_group(timeout=)``), read from
    the default group's backend options; torch's default for the backend when it cannot be
    read."""
    with contextlib.suppress(AttributeError, RuntimeError, ValueError):  # private c10d API
        default = dist.distributed_c10d._get_default_group()
        for device in default._device_types:
            timeout = default._get_backend(device).options._timeout
            if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
                return timeout
    return dist.distributed_c10d.default_pg_timeout


#: The construction's setup vote (:meth:`Collective.agree`): two float64s, whatever the world.
SETUP_VOTE_BYTES = 16

#: Issued all-reduces whose completion each collect checks without waiting (oldest dropped).
_WATCHED = 64

#: Every multi-rank :class:`Collective` still alive, drained by :func:`_drain_at_exit`.
_OPEN: weakref.WeakSet[Collective] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    """At interpreter exit (while it is still whole): wait, bounded, for the all-reduces of
    watchers that were never closed, or collected after ``close()`` (see
    :meth:`Collective.drain`). Not when the program is dying of an uncaught exception: it
    fails either way, and must not wait for peers that may never come."""
    if getattr(sys, "last_value", None) is not None:
        return
    for collective in list(_OPEN):
        collective.drain(collective.timeout)


class Collective:
    """gradwatch's process groups and the all-reduces issued on them, in collect order.

    ``Collective.open`` (every rank of the world, in the same order relative to the job's
    groups) creates the device group or, where the monitoring all-reduce must not wait on the
    training stream, the host group and its thread (the device group then at its first use:
    :meth:`device_group`). ``Collective()`` alone is a world of one:
    nothing is issued. Thread-safety: :meth:`issue` runs on the training thread; the returned
    :class:`Pending` may be waited on from any thread.

    Timeouts: the groups are created with ``collective_timeout_seconds`` (which bounds the
    construction handshake), then :meth:`settle` raises their own timeout to the job's default
    process-group timeout when that is longer, so gradwatch's groups never abort an operation
    the job's own collectives would still wait for. ``collective_timeout_seconds`` keeps
    bounding every *wait* gradwatch makes off the clip path (:meth:`Pending.wait`).
    """

    def __init__(
        self, group: Any = None, host_group: Any = None, timeout: float = 0.0, lazy: bool = False
    ) -> None:
        self.group = group
        self._lazy = lazy  # the device group is created at its first all-reduce (see open())
        self.host_group = host_group  # gloo group of the monitoring-only collects
        self.timeout = timeout
        self.group_timeout = timeout  # the groups' own timeout (see settle())
        self.handshake_device = torch.device("cpu")  # where the handshake's tensors live
        self.issued = 0  # all-reduces issued: tells whether a failed collect issued its own
        self.closed = False
        self._host = _HostThread(host_group, timeout) if host_group is not None else None
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.SUM
        self._watched: collections.deque[Pending] = collections.deque(maxlen=_WATCHED)

    @classmethod
    def open(cls, timeout: float, backend: str, device: torch.device) -> Collective:
        """The groups of a multi-rank job on ``backend`` whose packed vector lives on
        ``device``; collective over the world (``new_group``)."""
        span = timedelta(seconds=timeout)
        # Gloo with CUDA gradients too: its work.wait() would block the training thread.
        on_host = any(b in backend for b in MONITOR_ON_HOST_BACKENDS)
        if on_host or device.type != "cpu":
            # The host group carries the handshake and every monitoring collect. The device
            # group serves clips and the guard only: it is created at the first all-reduce
            # that takes it (:meth:`device_group`), so a job that never clips through
            # gradwatch holds no second communicator on its backend.
            opened = cls(None, dist.new_group(backend="gloo", timeout=span), timeout, lazy=True)
        else:
            opened = cls(dist.new_group(timeout=span), None, timeout)
        _OPEN.add(opened)
        return opened

    def open_host_route(self) -> bool:
        """Add the host group :meth:`open` gives a job whose vector lives on an accelerator,
        when the vector moved there after construction on a backend that opened none (gloo
        with a CPU model, then ``model.cuda()``): without it every monitoring collect would
        all-reduce device tensors on gloo, whose ``wait()`` blocks the training thread until
        the backward is done. ``new_group`` is collective over the world: called from the
        collect at which the gradients moved, the same collect on every rank (they move alike
        on every rank, as :meth:`Reducer.follow` assumes). True when it was added."""
        if self.host_group is not None or self.group is None or self.closed:
            return False
        self.host_group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=self.group_timeout)
        )
        self._host = _HostThread(self.host_group, self.timeout)
        return True

    @property
    def handshake_group(self) -> Any:
        """The group the construction handshake runs on: the host group when there is one."""
        return self.host_group if self.host_group is not None else self.group

    def device_group(self) -> Any:
        """The device group, created here at its first use when :meth:`open` deferred it.
        ``new_group`` is collective over the world: the first clip (or guarded collect, or
        its stand-in) is the same entry of every rank's collective sequence, so every rank
        creates it at the same point relative to the job's own groups. Created with the
        groups' settled timeout (:meth:`settle`)."""
        if self.group is None and self._lazy:
            self.group = dist.new_group(timeout=timedelta(seconds=self.group_timeout))
        return self.group

    def settle(self) -> None:
        """After the handshake: give gradwatch's groups the job's default process-group
        timeout when it is longer than ``collective_timeout_seconds`` (an operation queued
        behind a slow job collective must not be aborted before the job's own would be)."""
        longest = max(timedelta(seconds=self.timeout), job_timeout())
        for group in (self.group, self.host_group):
            if group is not None:
                with contextlib.suppress(AttributeError, RuntimeError, ValueError):
                    dist.distributed_c10d._set_pg_timeout(longest, group)
        self.group_timeout = longest.total_seconds()

    def agree(self, refused: bool) -> tuple[int, int]:
        """Did any rank refuse the setup? Agreed by every rank: one SUM all-reduce of a
        fixed-size float64 pair (:data:`SETUP_VOTE_BYTES`: 1 and this rank's id when it
        refused, zeros otherwise) on the handshake's group (its tensors' device); returns
        ``(refusing ranks, sum of their ids)``, the same on every rank (one refusing rank:
        its id). Every rank calls it once, as its construction's last collective, whatever it
        decided: nothing is left unpaired.

        The wait is bounded by the groups' settled timeout (the job's, :meth:`settle`), not by
        ``collective_timeout_seconds``: a rank that gives up earlier than a peer whose vote
        still arrives would take the other decision. A vote that fails or times out raises
        :class:`~gradwatch.errors.GradWatchTimeoutError` (the group is broken on every rank,
        so every rank refuses)."""
        group = self.handshake_group
        if group is None:  # a world of one: this rank's own answer, no collective
            return (1, 0) if refused else (0, 0)
        votes = torch.zeros(2, dtype=torch.float64, device=self.handshake_device)
        if refused:
            votes.fill_(1.0)
            votes[1] = float(dist.get_rank(group))
        try:
            Pending(group.allreduce([votes], self._options)).wait(
                max(self.timeout, self.group_timeout)
            )
        except RuntimeError as exc:
            raise GradWatchTimeoutError(
                f"gradwatch: the ranks could not agree on the setup ({type(exc).__name__}: "
                f"{exc}); every rank must construct GradWatch"
            ) from exc
        count, ranks = votes.cpu().tolist()
        return int(count), int(ranks)

    def failure(self) -> str | None:
        """Without waiting: why an all-reduce issued earlier failed, if one did (a broken
        group or a dead peer); checked by every rank at every collect, so every rank stops on
        its own next collect, not only the one that publishes."""
        while self._watched and self._watched[0].settled():
            why = self._watched[0].failure()
            if why is not None:
                return why
            self._watched.popleft()
        return None

    def issue(self, packed: Tensor, on_host: bool = False) -> tuple[Tensor, Pending]:
        """All-reduce (SUM) ``packed``: on the host group when ``on_host`` and there is one,
        else on the device group (in place). Returns the tensor that will hold the sum (a host
        copy on the host route) and its :class:`Pending`. After :meth:`close` the same groups
        still carry it (a closed watcher keeps its place in the ranks' collective sequence)."""
        self.issued += 1
        if on_host and self.host_group is not None:
            # A copy to (pinned) host memory queued on the vector's stream, the gloo
            # all-reduce issued by the host thread once it landed.
            host = torch.empty(
                packed.shape, dtype=packed.dtype, pin_memory=packed.device.type != "cpu"
            )
            if self._host is None:
                # Closed: no thread waits for the copy, the all-reduce is issued right here,
                # so the copy must be done first (a non-blocking one would send whatever the
                # reused pinned block held). Stand-ins for this route are built on the host
                # (Reducer.reduce_failed): this copy of a device vector is the exception.
                host.copy_(packed)
                pending = Pending(self.host_group.allreduce([host], self._options))
                self._watched.append(pending)
                return host, pending
            host.copy_(packed, non_blocking=True)
            event = None
            if packed.device.type != "cpu":  # the CUDA path: no CUDA device in CI
                event = landed(record_event(packed.device))
            pending = self._host.submit(host, event)
            self._watched.append(pending)
            return host, pending
        group = self.device_group()
        if group is None:
            return packed, Pending()
        # The process group's own method: the same c10d op as dist.all_reduce without its
        # Python checks (a measurable share of a small all-reduce on gloo), all of which hold
        # by construction (one dense float64 tensor, a group this rank belongs to).
        pending = Pending(group.allreduce([packed], self._options))
        self._watched.append(pending)
        return packed, pending

    def drain(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds in all until no all-reduce this rank issued is
        still in flight (or queued on the host thread); True when none is left.

        Why: ``destroy_process_group()`` does not wait for a gloo all-reduce in flight, and a
        process that exits while one is (its handle already dropped, which is the normal
        case for a monitoring all-reduce no one reads, e.g. on ranks other than 0) can be
        aborted by the C++ runtime as the work's thread outlives the interpreter
        (``terminate called without an active exception``, exit signal 6): the job would
        end failed after training finished."""
        deadline = time.monotonic() + timeout
        while self._watched:
            try:
                self._watched[0].wait(max(0.0, deadline - time.monotonic()))
            except CollectiveTimeout:
                return False
            except (CollectiveFailed, StandIn):
                pass  # completed, with an error: nothing in flight
            self._watched.popleft()
        return True

    def close(self, drain: bool = True) -> None:
        """Wait (bounded by ``collective_timeout_seconds``) for this rank's all-reduces in
        flight (:meth:`drain`; not with ``drain=False``: an exception is ending the training
        loop, and the peers may never come), then stop the host thread. The groups are kept
        (a closed watcher's explicit collects and clips still issue their all-reduce, so the other
        ranks' sequences stay aligned) and *not* destroyed here: ranks close at different
        moments, and destroying a gloo group while a peer may still be receiving the last
        message of its final collective can abort that peer's process. The job's
        ``destroy_process_group()`` (or process exit) releases them with every other group;
        an exit handler drains the all-reduces of watchers never closed."""
        if drain and not self.closed:
            started = time.monotonic()
            if not self.drain(self.timeout):
                log.warning(
                    "gradwatch: close(): a gradwatch all-reduce is still in flight after "
                    "%.0fs (collective_timeout_seconds): a rank stopped collecting or died",
                    self.timeout,
                )
            elif time.monotonic() - started > 1.0:
                log.info("gradwatch: close() waited %.1fs for the other ranks' last collect",
                         time.monotonic() - started)
        self.closed = True
        if self._host is not None:
            self._host.close()
            self._host = None
