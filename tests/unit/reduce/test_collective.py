"""The one collective route: every route's :class:`Pending` waits at most once, within its bound,
and says why it failed (multi-rank runs: tests/distributed/test_monitor_on_host.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradwatch.reduce import collective
from gradwatch.reduce.collective import (
    Collective,
    CollectiveFailed,
    CollectiveTimeout,
    Pending,
    StandIn,
    _HostThread,
)


class _Work:
    """A c10d work stand-in recording the bounds it was waited with."""

    def __init__(self) -> None:
        self.waits: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        return True

    def is_completed(self) -> bool:
        return True


class _LateWork(_Work):
    """A work that completes ``after`` waits (c10d's Work::wait(timeout) raises on a timeout
    and leaves the work running), or completes with ``error``."""

    def __init__(self, after: int = 1, error: Exception | None = None) -> None:
        super().__init__()
        self.after, self.error = after, error

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.error is not None:
            raise self.error
        if len(self.waits) <= self.after:
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.error is not None or len(self.waits) > self.after


def test_no_collective_waits_for_nothing() -> None:
    Pending().wait(0.0)


def test_device_work_is_waited_once_within_the_bound() -> None:
    work = _Work()
    pending = Pending(work)
    pending.wait(2.0)
    pending.wait(2.0)
    assert len(work.waits) == 1
    bound = work.waits[0]
    assert bound is not None and 0 < bound.total_seconds() <= 2.0


def test_host_route_not_issued_in_time_raises() -> None:
    pending = Pending.queued()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="not issued in time"):
        pending.wait(0.05)
    assert time.monotonic() - started < 5.0


def test_host_route_failure_is_reported() -> None:
    pending = Pending.queued()
    pending._issued(None, ValueError("gloo is down"), broken=True)
    with pytest.raises(CollectiveFailed, match="gloo is down"):
        pending.wait(1.0)
    assert pending.failure() == "ValueError: gloo is down"


def test_a_stand_in_is_not_a_broken_group() -> None:
    pending = Pending.queued()
    pending._issued(None, ValueError("copy stuck"))
    with pytest.raises(StandIn, match="copy stuck"):
        pending.wait(1.0)
    assert pending.failure() is None


def test_a_timed_out_wait_leaves_the_collective_in_flight() -> None:
    """A straggler: the wait times out, the all-reduce stays issued, a later wait gets it."""
    work = _LateWork(after=1)
    pending = Pending(work)
    with pytest.raises(CollectiveTimeout):
        pending.wait(0.5)
    assert pending.failure() is None and not pending.settled()
    pending.wait(0.5)
    assert pending.settled()


def test_a_failed_collective_is_seen_without_waiting() -> None:
    pending = Pending(_LateWork(error=RuntimeError("Connection closed by peer")))
    assert "Connection closed by peer" in (pending.failure() or "")
    with pytest.raises(CollectiveFailed):
        pending.wait(0.5)


def test_host_route_bound_covers_the_issue_and_the_collective() -> None:
    """One timeout in all: what the issue took is not granted again to the collective."""
    pending, work = Pending.queued(), _Work()
    threading.Timer(0.2, pending._issued, args=(work, None)).start()
    pending.wait(1.0)
    bound = work.waits[0]
    assert bound is not None and bound.total_seconds() <= 0.9


def test_stream_ordering_takes_the_work_once() -> None:
    work = _Work()
    pending = Pending(work)
    pending.order_on_stream()
    pending.wait(1.0)
    assert work.waits == [None]  # ordered on the stream, never waited on the host


def test_one_process_issues_nothing_but_counts() -> None:
    coll = Collective()
    packed = torch.arange(4, dtype=torch.float64)
    result, pending = coll.issue(packed)
    pending.wait(0.0)
    assert result is packed and coll.issued == 1


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("on_host", [False, True])
def test_every_route_sums(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch, on_host: bool
) -> None:
    """The device group in place, or the host gloo group from its thread (a copy): the sum
    arrives either way, and the host route never touches the caller's tensor."""
    monkeypatch.setattr(collective, "MONITOR_ON_HOST_BACKENDS", ("gloo",))
    coll = Collective.open(5.0, "gloo", torch.device("cpu"))
    try:
        assert coll.host_group is not None
        packed = torch.tensor([1.0, -2.5, 3.0], dtype=torch.float64)
        result, pending = coll.issue(packed, on_host=on_host)
        pending.wait(5.0)
        assert result.tolist() == [1.0, -2.5, 3.0]
        assert (result is packed) is not on_host
    finally:
        coll.close()
    assert coll.closed and coll.failure() is None


def test_the_device_group_is_created_at_its_first_use(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a host group, the handshake and monitoring collects take it; the device group
    exists only once a clip's all-reduce needs it."""
    monkeypatch.setattr(collective, "MONITOR_ON_HOST_BACKENDS", ("gloo",))
    coll = Collective.open(5.0, "gloo", torch.device("cpu"))
    try:
        assert coll.group is None and coll.handshake_group is coll.host_group
        _, pending = coll.issue(torch.ones(2, dtype=torch.float64), on_host=True)
        pending.wait(5.0)
        assert coll.group is None
        packed = torch.tensor([2.0, 3.0], dtype=torch.float64)
        result, pending = coll.issue(packed, on_host=False)
        pending.wait(5.0)
        assert coll.group is not None and result is packed and result.tolist() == [2.0, 3.0]
    finally:
        coll.close()


def test_groups_wait_as_long_as_the_jobs(tmp_path: Path) -> None:
    """gradwatch's groups never time out before the job's default group would."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=1234)
    )
    try:
        assert collective.job_timeout() == timedelta(seconds=1234)
        coll = Collective.open(5.0, "gloo", torch.device("cpu"))
        coll.settle()
        assert coll.group_timeout == 1234.0
        assert coll.group._get_backend(torch.device("cpu")).options._timeout == timedelta(
            seconds=1234
        )
        coll.close()
    finally:
        dist.destroy_process_group()


def test_a_vector_that_never_landed_is_stood_in_for(world_of_one: None) -> None:
    """The host thread never skips an issue: an all-NaN stand-in of the same shape goes out,
    so every rank's sum of that collect says "not measured" and the next collects pair."""
    group = dist.new_group(backend="gloo")
    thread = _HostThread(group, 1.0)

    def stuck(host: torch.Tensor, event: object) -> None:
        raise RuntimeError("the copy never landed")

    thread._land = stuck  # type: ignore[method-assign]
    host = torch.ones(4, dtype=torch.float64)
    pending = thread.submit(host, None)
    with pytest.raises(StandIn, match="never landed"):
        pending.wait(5.0)
    assert thread.failed_copies == 1
    thread.close()


class _RaisingEvent:
    """A CUDA event stand-in whose ``synchronize()`` raises, as on a device error."""

    def synchronize(self) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class _Event:
    def synchronize(self) -> None:
        pass


def test_a_failed_event_wait_never_marks_its_buffer_landed() -> None:
    """The landing thread wakes the waiter at once, but with the error: the flag is not
    "landed", a waiter raises naming it (never a read of a buffer the device did not write,
    and never a wait until the timeout)."""
    flag = collective.landed(_RaisingEvent())
    assert flag.wait(5.0)
    assert not flag.landed() and isinstance(flag.error, RuntimeError)
    started = time.monotonic()
    with pytest.raises(collective.GradWatchError, match=r"never reached the host.*illegal"):
        collective.wait_landed(flag, 30.0, "the packed vector")
    assert time.monotonic() - started < 5.0
    fine = collective.landed(_Event())
    collective.wait_landed(fine, 5.0, "the packed vector")
    assert fine.landed() and fine.error is None


def test_an_audit_copy_whose_wait_failed_is_never_read() -> None:
    from gradwatch.analysis.audit import LocalSquares

    host = torch.full((3,), float("nan"), dtype=torch.float64)  # never written
    copy = LocalSquares(host, collective.landed(_RaisingEvent()))
    copy._landed.wait(5.0)
    assert copy.norm() is None


class _CopySpy(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each ``copy_`` into a tensor and whether it was non-blocking."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket is torch.ops.aten.copy_:
            self.copies.append(bool(args[2] if len(args) > 2 else (kwargs or {}).get(
                "non_blocking", False)))
        return func(*args, **(kwargs or {}))


def test_a_closed_collective_copies_before_it_issues_on_the_host_route(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closed, no thread waits for a copy's event: the host copy is an ordered one, done
    before the all-reduce is issued on the calling thread (a non-blocking copy from a device
    would let gloo send the pinned block's previous contents); open, it stays non-blocking."""
    monkeypatch.setattr(collective, "MONITOR_ON_HOST_BACKENDS", ("gloo",))
    coll = Collective.open(5.0, "gloo", torch.device("cpu"))
    packed = torch.tensor([1.0, 2.0], dtype=torch.float64)
    with _CopySpy() as open_spy:
        _, pending = coll.issue(packed, on_host=True)
    pending.wait(5.0)
    coll.close()
    with _CopySpy() as closed_spy:
        result, pending = coll.issue(packed, on_host=True)
    pending.wait(5.0)
    assert open_spy.copies == [True]
    assert closed_spy.copies == [False]
    assert result.tolist() == [1.0, 2.0]


def test_a_failed_collects_stand_in_for_the_host_route_is_built_on_the_host(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its values are known (zeros, the step slot's marker): built in host memory, nothing
    copied from the device before the host all-reduce."""
    from torch import nn

    from gradwatch import GradWatch, WatchConfig

    monkeypatch.setattr(collective, "MONITOR_ON_HOST_BACKENDS", ("gloo",))
    model = nn.Linear(3, 2)
    with GradWatch(model, WatchConfig()) as watch:
        reducer = watch._reducer
        reducer.collective = Collective.open(5.0, "gloo", torch.device("cpu"))
        assert reducer.collective.host_group is not None
        built: list[torch.device] = []
        issue = reducer.collective.issue

        def spy(packed: torch.Tensor, on_host: bool = False):  # type: ignore[no-untyped-def]
            built.append(packed.device)
            return issue(packed, on_host=on_host)

        monkeypatch.setattr(reducer, "device", torch.device("meta"))  # an accelerator's
        monkeypatch.setattr(reducer.collective, "issue", spy)
        reducer.reduce_failed(step=0, device_collective=False, with_replicas=True)
        assert built == [torch.device("cpu")]


def test_a_vector_that_moves_to_an_accelerator_on_gloo_gets_a_host_route(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gloo with a CPU model opens no host group; after ``model.cuda()`` the packed vector
    follows the gradients, and the host route is added then (one ``new_group``, at the collect
    where every rank's gradients moved), so monitoring collects all-reduce a host copy from the
    host thread instead of blocking the training thread in gloo's ``wait()``. The device is
    stood in for by ``meta`` (the packing's buffers are not rebuilt here)."""
    from torch import nn

    from gradwatch import GradWatch, WatchConfig
    from gradwatch.reduce import packing

    with GradWatch(nn.Linear(3, 2), WatchConfig()) as watch:
        reducer = watch._reducer
        reducer.collective = Collective.open(5.0, "gloo", torch.device("cpu"))
        reducer._backend = "gloo"
        assert reducer.host_group is None and reducer.group is not None
        monkeypatch.setattr(packing, "reducer_device", lambda *_: torch.device("meta"))
        monkeypatch.setattr(reducer, "_plan_packing", lambda layout: None)
        assert reducer.follow(torch.device("meta"))
        assert reducer.host_group is not None and reducer.host_group is not reducer.group
        assert not reducer.collective.open_host_route()  # once
        packed = torch.tensor([1.0, 2.0], dtype=torch.float64)
        result, pending = reducer.collective.issue(packed, on_host=True)
        pending.wait(5.0)
        assert result is not packed and result.tolist() == [1.0, 2.0]  # the host route
        reducer.collective.close()
