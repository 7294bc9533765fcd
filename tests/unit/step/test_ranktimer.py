"""This rank's working-time window and the CUDA-event clock, on the CPU: the window's median
against ``statistics.median`` of the same times, and the event clock's protocol driven by a
fake event (reads only completed pairs, never synchronizes, one arrival event per step), and
the snapshots' carried timing."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from torch import nn

from gradwatch.reduce.ranktiming import TIMING_WIDTH, CarriedTiming, RankTiming, pack_timing
from gradwatch.step.ranktimer import PENDING_EVENTS, DeviceClock, RankTimer, WorkWindow


def test_the_window_packs_its_median_and_starts_again() -> None:
    rng = random.Random(3)
    window = WorkWindow()
    assert window.drain() is None  # nothing measured: nothing packed, never 0
    for n in (1, 2, 7, 100):
        times = [rng.uniform(0.001, 2.0) for _ in range(n)]
        for t in times:
            window.add(t)
        window.add(float("nan"))
        window.add(-1.0)  # not times
        assert window.drain() == statistics.median(times)
        assert len(window) == 0


def test_the_window_keeps_its_latest_samples() -> None:
    window = WorkWindow(samples=4)
    for t in (9.0, 9.0, 9.0, 1.0, 2.0, 3.0, 4.0):
        window.add(t)
    assert window.drain() == 2.5


class FakeEvent:
    """A CUDA event stand-in: ``record`` stamps the fake stream's time; completes when the
    test says so. No ``synchronize``: calling it would raise."""

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.at: float | None = None
        self.records = 0

    def record(self) -> None:
        self.at = self.stream.now
        self.records += 1
        self.stream.recorded.append(self)

    def query(self) -> bool:
        self.stream.queries += 1
        return self.at is not None and self.at <= self.stream.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an incomplete event"
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1000.0


class FakeStream:
    def __init__(self) -> None:
        self.now = 0.0  # the time of the next recorded work
        self.done = -1.0  # the device completed everything recorded up to this time
        self.recorded: list[FakeEvent] = []
        self.queries = 0
        self.made = 0

    def event(self) -> FakeEvent:
        self.made += 1
        return FakeEvent(self)


def _step(clock: DeviceClock, stream: FakeStream, window: WorkWindow, work: float) -> None:
    clock.start()
    stream.now += work
    clock.arrive()
    clock.arrive()  # one arrival per step: the second is ignored
    stream.now += 0.5  # waiting on peers: after the arrival, not counted
    clock.lap(window)


def test_the_device_clock_reads_completed_pairs_only() -> None:
    stream = FakeStream()
    clock, window = DeviceClock(stream.event), WorkWindow()
    works = [0.1, 0.2, 0.3]
    for w in works:
        _step(clock, stream, window, w)
    assert len(window) == 0  # the device is behind: nothing read, nothing waited for
    stream.done = stream.recorded[3].at or 0.0  # the second pair's arrival completed
    clock.start()
    clock.lap(window)  # no arrival this step: nothing queued for it
    assert window.drain() == pytest.approx(statistics.median(works[:2]))
    _step(clock, stream, window, 0.4)
    stream.done = stream.now
    clock.start()
    clock.lap(window)
    assert window.drain() == pytest.approx(statistics.median([0.3, 0.4]))
    made = stream.made
    for _ in range(10):  # read as they complete: the pool's events serve every later step
        _step(clock, stream, window, 0.1)
        stream.done = stream.now
    assert stream.made == made


def test_the_device_clock_drops_pairs_it_cannot_read() -> None:
    stream = FakeStream()
    clock, window = DeviceClock(stream.event), WorkWindow()
    for _ in range(PENDING_EVENTS + 5):
        _step(clock, stream, window, 0.1)
    assert clock.dropped == 5 and len(window) == 0
    stream.done = stream.now
    clock.start()
    clock.lap(window)
    assert len(window) == PENDING_EVENTS and clock.dropped == 5


def test_the_timer_records_one_arrival_event_per_step_at_the_learned_last_gradient() -> None:
    stream = FakeStream()
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    timer = RankTimer(list(model.parameters()), device=DeviceClock(stream.event))
    for _ in range(4):
        timer.start()
        stream.now += 0.1
        model(torch.ones(3, 4)).sum().backward()
        timer.lap()
    # step 1 learns which gradient arrives last; then one start and one arrival per step
    assert len(stream.recorded) == 4 + 3
    stream.done = stream.now
    timer.start()
    timer.lap()
    assert len(timer.window) == 3
    timer.close()


def test_the_host_timer_adds_each_lap_to_the_window() -> None:
    model = nn.Linear(4, 2)
    timer = RankTimer(list(model.parameters()))
    assert len(timer.lap()) == 0  # no start: nothing measured
    for _ in range(3):
        timer.start()
        model(torch.ones(3, 4)).sum().backward()
        window = timer.lap()
    assert len(window) == 3 and (window.drain() or 0) >= 0
    timer.close()


def _timing(times: list[float]) -> RankTiming:
    total = torch.zeros(TIMING_WIDTH, dtype=torch.float64)
    for rank, t in enumerate(times):
        mine = torch.zeros(TIMING_WIDTH, dtype=torch.float64)
        pack_timing(mine, rank, t)
        total += mine
    timing = RankTiming.from_section(total.tolist(), len(times))
    assert timing is not None
    return timing


def test_snapshots_carry_the_latest_carried_step_never_a_guess() -> None:
    carried = CarriedTiming()
    hosts = ("a", "b")
    assert carried.fields(0, None, hosts) == {}  # before the first carried step: absent
    first = _timing([0.01, 0.3])
    assert carried.fields(4, first, hosts)["rank_timing_step"] == 4
    later = carried.fields(7, None, hosts)
    assert later["rank_timing_step"] == 4 and later["slowest_rank"] == 1
    assert carried.fields(3, None, hosts) == {}  # an earlier step never gets a later timing
    second = _timing([0.4, 0.01])
    assert carried.fields(8, second, hosts)["slowest_rank"] == 0
    assert carried.fields(2, first, hosts)["rank_timing_step"] == 2  # built late: its own
    assert carried.fields(9, None, hosts)["rank_timing_step"] == 8  # the latest stays
