"""Which rank is slow, host side: the timing section's codec against an independent reference
(sorted Python floats), the snapshot fields, the metrics' samples, and the timer's clock."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from torch import nn

from gradwatch.export.metricdef import PublishedStep
from gradwatch.export.rankmetrics import RANK_WORK_SECONDS, SLOWEST_RANK, STRAGGLER_SCORE
from gradwatch.reduce.ranktiming import (
    TIMING_BINS,
    TIMING_BINS_PER_OCTAVE,
    TIMING_FLOOR,
    TIMING_WIDTH,
    RankTiming,
    bin_of,
    pack_timing,
    timing_fields,
)
from gradwatch.snapshot import Snapshot
from gradwatch.step.ranktimer import RankTimer


def _reduced(times: list[float | None]) -> list[float]:
    """What the SUM all-reduce of every rank's section gives (float64, as on the wire)."""
    total = torch.zeros(TIMING_WIDTH, dtype=torch.float64)
    for rank, t in enumerate(times):
        mine = torch.zeros(TIMING_WIDTH, dtype=torch.float64)
        pack_timing(mine, rank, t)
        total += mine
    return total.tolist()


def _edge(k: int) -> float:
    return TIMING_FLOOR * 2.0 ** (k / TIMING_BINS_PER_OCTAVE)


def test_bins_are_log_spaced_and_clamped() -> None:
    for k in range(1, TIMING_BINS - 1):
        mid = math.sqrt(_edge(k) * _edge(k + 1))
        assert bin_of(mid) == k
    assert bin_of(0.0) == bin_of(1e-9) == bin_of(math.nan) == 0
    assert bin_of(1e9) == TIMING_BINS - 1


@pytest.mark.parametrize("world", [2, 3, 4, 17, 64, 1000])
def test_slowest_rank_and_extremes_against_the_sorted_reference(world: int) -> None:
    rng = random.Random(world)
    for _ in range(50):
        times = [rng.uniform(0.005, 0.05) for _ in range(world)]
        slow = rng.randrange(world)
        times[slow] = rng.uniform(0.06, 3.0)  # more than a bin above every other
        timing = RankTiming.from_section(_reduced(times), world)
        assert timing is not None
        assert timing.slowest_rank == slow
        assert timing.slowest_seconds == times[slow] == timing.max_seconds  # exact
        ordered = sorted(times)
        bins = [bin_of(t) for t in times]
        if bins.count(bin_of(ordered[0])) == 1:
            assert timing.min_seconds == ordered[0]
        width = 2.0 ** (1 / TIMING_BINS_PER_OCTAVE)
        assert ordered[0] / width < timing.min_seconds < ordered[0] * width
        median = ordered[(world - 1) // 2]
        assert median / width < timing.median_seconds < median * width
        assert timing.straggler_score == pytest.approx(timing.min_seconds / times[slow])


def test_no_rank_is_named_when_the_top_bin_is_shared() -> None:
    k = bin_of(0.1)
    a, b = _edge(k) * 1.001, _edge(k + 1) * 0.999  # same bin, a few percent apart
    timing = RankTiming.from_section(_reduced([0.01, a, b, 0.012]), 4)
    assert timing is not None
    assert timing.slowest_rank is None and timing.slowest_seconds is None
    assert timing.max_seconds == pytest.approx((a + b) / 2)


def test_absent_unless_every_rank_measured() -> None:
    assert RankTiming.from_section(_reduced([0.01, None, 0.02]), 3) is None
    assert RankTiming.from_section(_reduced([0.01, math.nan, 0.02]), 3) is None
    assert RankTiming.from_section(_reduced([None, None]), 2) is None


def test_snapshot_fields_and_metrics() -> None:
    timing = RankTiming.from_section(_reduced([0.01, 0.21, 0.0105, 0.011]), 4)
    assert timing is not None
    fields = timing_fields(timing, ("a", "b", "c", "d"), 3)
    snap = Snapshot(step=3, **fields)
    assert snap.slowest_rank == 1 and snap.slowest_host == "b"
    assert snap.work_seconds_min == 0.01 and snap.work_seconds_max == 0.21
    assert snap.straggler_score == pytest.approx(0.01 / 0.21)
    assert snap.rank_timing_step == 3
    assert Snapshot.from_dict(snap.to_dict()) == snap
    published = PublishedStep(snap=snap, top_k=0, ratio_labels={})
    assert SLOWEST_RANK.read(published) == ((("b",), 1.0),)
    assert STRAGGLER_SCORE.read(published) == (((), snap.straggler_score),)
    assert RANK_WORK_SECONDS.read(published) == (
        (("min",), 0.01), (("median",), snap.work_seconds_median), (("max",), 0.21))
    bare = PublishedStep(snap=Snapshot(step=3), top_k=0, ratio_labels={})
    assert all(d.read(bare) is None for d in (SLOWEST_RANK, STRAGGLER_SCORE, RANK_WORK_SECONDS))


def test_timer_stops_at_the_last_gradient_hook() -> None:
    model = nn.Linear(4, 2)
    timer = RankTimer(list(model.parameters()))
    assert timer.take() is None  # nothing started: not measured
    timer.start()
    model(torch.ones(3, 4)).sum().backward()
    done = time.perf_counter()
    time.sleep(0.05)  # after the backward: waiting, not working
    work = timer.take()
    assert work is not None and 0 <= work <= done - timer._started
    timer.start()
    time.sleep(0.02)  # no backward: the work runs up to now
    work = timer.take()
    assert work is not None and work >= 0.02
    timer.close()


@pytest.mark.parametrize("world", [2, 256, 16384])
def test_the_timing_section_is_the_same_size_at_every_world(world: int) -> None:
    """Per-rank bytes independent of the world size (benchmarks/scale.py shows it for the
    simulated worlds): the section is last in the packed vector, ``TIMING_WIDTH`` long."""
    from gradwatch.reduce.layout import Layout
    from gradwatch.reduce.sections import sections

    base = Layout(names=("a", "b"), numels=(3, 4), local_to_global=(0, 1),
                  contributes=(True, True), replica_slot=(-1, -1), replicas=1,
                  world_size=world, rank=world - 1)  # fmt: skip
    timed = Layout(**{**base.__dict__, "rank_timing": True})
    at = sections(timed)
    assert at.rank_timing.stop - at.rank_timing.start == TIMING_WIDTH
    assert at.rank_timing.stop == at.length == sections(base).length + TIMING_WIDTH
