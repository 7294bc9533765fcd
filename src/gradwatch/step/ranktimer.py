"""This rank's working time per step, and its summary over the steps since the last carried
step: the measurement of :mod:`gradwatch.reduce.ranktiming` (what a step's working time is, how
the all-reduce carries it).

**The step's working time.** The clock starts at the end of each ``collect`` and stops at the
rank's *arrival*: the last gradient accumulated in this step's backward (a
``post_accumulate_grad`` hook per plain leaf parameter; under FSDP2 per unsharded parameter,
whose gradient autograd accumulates before FSDP2's reduce-scatter). Without such a hook (FSDP1's
flat shards, DeepSpeed's partitions) the arrival is the next ``collect``. On the host clock the
hooks store a ``time.perf_counter()`` reading: no device op, no host read, no synchronization.

**On a CUDA device** (:class:`DeviceClock`, untested here: docs/gpu.md) the host clock would
measure when the host *queued* the work, so the step is timed by two CUDA events recorded on
the current stream: one at the end of ``collect``, one in the hook of the parameter whose
gradient arrived last in the previous step (learned from the hooks' order on the host: one
event record per step, not one per parameter). ``elapsed_time`` is read only once ``query()``
says both events completed, at a later collect: never ``synchronize``.

**The window** (:class:`WorkWindow`). Every collect adds its step's time (on a CUDA device:
every step whose events completed since); only the collects that all-reduce anyway *carry*
the window (:meth:`gradwatch.reduce.packing.Reducer.issues_collective`): the rank packs the
median of its window, one number whatever the window's length, and starts a new window. Under
plain DDP, whose ordinary collects issue nothing, that is every ``divergence_every`` collects.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

#: The window keeps this many of its latest working times (host memory only; the wire
#: carries one number per rank whatever the window).
WINDOW_SAMPLES = 1024
#: Event pairs awaiting completion on a CUDA device; beyond, the oldest pair is dropped
#: (its step is not measured: never waited for).
PENDING_EVENTS = 64


class EventLike(Protocol):
    """What :class:`DeviceClock` uses of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: Any) -> float: ...


class WorkWindow:
    """This rank's working times (seconds) since the last carried step."""

    def __init__(self, samples: int = WINDOW_SAMPLES) -> None:
        self._times: deque[float] = deque(maxlen=samples)

    def __len__(self) -> int:
        return len(self._times)

    def add(self, seconds: float) -> None:
        """Add one step's working time (a non-finite or negative reading is not a time)."""
        if math.isfinite(seconds) and seconds >= 0:
            self._times.append(seconds)

    def drain(self) -> float | None:
        """The window's median (None when empty), and a new, empty window: what a carried
        step packs."""
        if not self._times:
            return None
        median = statistics.median(self._times)
        self._times.clear()
        return median


class DeviceClock:
    """Each step's working time from two CUDA events (see the module docstring).

    ``events`` makes an event (``lambda: torch.cuda.Event(enable_timing=True)``; tests pass a
    fake). Events are reused from a pool; an event pair is read only when both report
    completed, and at most :data:`PENDING_EVENTS` pairs wait.
    """

    def __init__(self, events: Callable[[], EventLike]) -> None:
        self._events = events
        self._pool: list[EventLike] = []
        self._pending: deque[tuple[EventLike, EventLike]] = deque()
        self._start: EventLike | None = None
        self._arrival: EventLike | None = None
        self.dropped = 0  # pairs dropped unread (the queue was full)

    def _event(self) -> EventLike:
        return self._pool.pop() if self._pool else self._events()

    def start(self) -> None:
        """Record the start event on the current stream (the end of a collect)."""
        if self._start is not None and self._arrival is None:
            self._pool.append(self._start)  # the previous step never arrived on the device
        self._start, self._arrival = self._event(), None
        self._start.record()

    def arrive(self) -> None:
        """Record the arrival event on the current stream (the learned last gradient)."""
        if self._start is not None and self._arrival is None:
            self._arrival = self._event()
            self._arrival.record()

    def lap(self, window: WorkWindow) -> None:
        """Queue this step's pair (when it arrived) and add every completed pair's time to
        ``window``, oldest first; an incomplete pair stops the reading (the stream runs in
        order)."""
        if self._start is not None and self._arrival is not None:
            self._pending.append((self._start, self._arrival))
            self._start = self._arrival = None
            if len(self._pending) > PENDING_EVENTS:
                self._pool.extend(self._pending.popleft())
                self.dropped += 1
        while self._pending and self._pending[0][0].query() and self._pending[0][1].query():
            start, arrival = self._pending.popleft()
            window.add(start.elapsed_time(arrival) / 1000.0)  # milliseconds
            self._pool.extend((start, arrival))


class RankTimer:
    """This rank's working time per step (see the module docstring); training thread only.

    :meth:`start` at the end of each collect, :meth:`lap` at the next collect's pack, which
    adds the step to :attr:`window`; the packer drains the window on carried steps. The arrival
    hooks (one ``post_accumulate_grad`` hook per plain leaf parameter, and under FSDP2 per
    unsharded parameter) store a host timestamp: no device op, no host read. With ``device``
    (a :class:`DeviceClock`) they also note which parameter arrived last, and that
    parameter's hook records the arrival event.
    """

    def __init__(
        self, params: Sequence[Any], model: Any = None, device: DeviceClock | None = None
    ) -> None:
        self._started: float | None = None
        self._arrived: float | None = None
        self.window = WorkWindow()
        self.device = device
        self._last: Any = None  # the parameter whose gradient arrived last (device clock)
        self._learned: Any = None  # last step's: its hook records the arrival event
        self._hook = self._arrive if device is None else self._arrive_on_device
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook)
            for p in params
            if getattr(p, "is_leaf", False) and p.requires_grad
            and not hasattr(p, "_local_tensor")
        ]
        self._fsdp2 = fsdp2_params(model) if model is not None else []
        self._hooked: set[int] = set()

    def _hook_unsharded(self) -> None:
        """Hook the FSDP2 unsharded parameters that exist by now (FSDP2 creates each at its
        first all-gather and reuses it for the rest of the run)."""
        for fsdp_param in self._fsdp2:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and id(fsdp_param) not in self._hooked:
                self._hooked.add(id(fsdp_param))
                self._handles.append(unsharded.register_post_accumulate_grad_hook(self._hook))
        if len(self._hooked) == len(self._fsdp2):
            self._fsdp2 = []

    def _arrive(self, _param: Any) -> None:
        self._arrived = time.perf_counter()

    def _arrive_on_device(self, param: Any) -> None:
        self._arrived = time.perf_counter()
        self._last = param
        if param is self._learned and self.device is not None:
            self.device.arrive()

    def start(self) -> None:
        """The step's work starts now (the end of a collect)."""
        if self._fsdp2:
            self._hook_unsharded()
        self._started = time.perf_counter()
        self._arrived = None
        if self.device is not None:
            self.device.start()

    def take(self) -> float | None:
        """The host clock's working time since :meth:`start` (None before the first): up to
        the last gradient hook of this step, else up to now."""
        if self._started is None:
            return None
        end = self._arrived if self._arrived is not None else time.perf_counter()
        return max(end - self._started, 0.0)

    def lap(self) -> WorkWindow:
        """Add this step's working time to the window (on a device clock: the steps whose
        events completed since) and return the window, for the packer to drain on a carried
        step."""
        if self.device is not None:
            self._learned, self._last = self._last, None
            self.device.lap(self.window)
        else:
            seconds = self.take()
            if seconds is not None:
                self.window.add(seconds)
        self._started = None
        return self.window

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def cuda_clock(params: Sequence[Any]) -> DeviceClock | None:
    """A :class:`DeviceClock` of CUDA events when the gradients live on a CUDA device, else
    None (the host clock)."""
    if not any(getattr(getattr(p, "device", None), "type", None) == "cuda" for p in params):
        return None
    import torch

    return DeviceClock(lambda: torch.cuda.Event(enable_timing=True))


def close_timer(timer: RankTimer | None) -> None:
    """Remove ``timer``'s hooks (nothing without one)."""
    if timer is not None:
        timer.close()


def fsdp2_params(model: Any) -> list[Any]:
    """The FSDP2 parameter records (``FSDPParam``) of ``model``'s ``fully_shard`` modules;
    empty without FSDP2. Reads FSDP2's private state (``_get_fsdp_state``), guarded: an
    unknown layout gives no records (the arrival is then the collect)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out: list[Any] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            group = module._get_fsdp_state()._fsdp_param_group
        except AttributeError:
            return []
        if group is not None:
            out.extend(getattr(group, "fsdp_params", ()))
    return out
