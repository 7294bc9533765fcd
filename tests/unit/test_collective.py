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

from gradwatch import collective
from gradwatch.collective import Collective, Pending


class _Work:
    """A c10d work stand-in recording the bounds it was waited with."""

    def __init__(self) -> None:
        self.waits: list[timedelta | None] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        return True


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
    pending._issued(None, ValueError("gloo is down"))
    with pytest.raises(RuntimeError, match="monitoring all-reduce failed: gloo is down"):
        pending.wait(1.0)


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
    assert coll.group is None and coll.host_group is None
