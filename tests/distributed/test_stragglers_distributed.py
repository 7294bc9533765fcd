"""Which rank is slow, end to end in a 4-rank gloo world: a rank made slow by a sleep in its
backward is named on rank 0 under DDP and FSDP2, nobody is named persistently without it, and
timing costs no host read and no collective: under plain DDP it rides on the divergence step's
all-reduce, under FSDP2 on every collect's. Workers in straggler_cases.py; the world is spawned
once and killed after WORLD_TIMEOUT seconds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import straggler_cases
from straggler_cases import DDP_CARRY_EVERY, SLOW_RANK, WARM
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 300.0
NAMED_SHARE = 0.8


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(straggler_cases.worker, "w4", 4, tmp_path_factory.mktemp("slow4"),
                       WORLD_TIMEOUT)


def _warm(world: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    r0 = case_results(world, name, "error_in_case")[0]
    return [s for s in r0["snaps"] if s["step"] >= WARM]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["ddp_slow", "fsdp2_slow"])
def test_the_slow_rank_is_named(w4: list, name: str) -> None:
    snaps = _warm(w4, name)
    named = sum(s["slowest_rank"] == SLOW_RANK for s in snaps)
    assert named >= NAMED_SHARE * len(snaps), [s["slowest_rank"] for s in snaps]
    host = case_results(w4, name, "error_in_case")[SLOW_RANK]["host"]
    for s in snaps:
        assert 0 < s["straggler_score"] <= 1
        assert s["work_seconds_min"] <= s["work_seconds_median"] <= s["work_seconds_max"]
        if s["slowest_rank"] == SLOW_RANK:
            assert s["slowest_host"] == host
            assert s["work_seconds_max"] >= straggler_cases.SLEEP_SECONDS  # the sleep is work
            assert s["straggler_score"] < 0.7


@pytest.mark.timeout(400)
def test_no_rank_is_named_persistently_without_a_straggler(w4: list) -> None:
    snaps = _warm(w4, "ddp_control")
    assert all(s["straggler_score"] is not None for s in snaps)  # measured every step
    named = Counter(s["slowest_rank"] for s in snaps if s["slowest_rank"] is not None)
    top = named.most_common(1)
    assert not top or top[0][1] < NAMED_SHARE * len(snaps), named


def _costs(world: list[dict[str, Any]], name: str, key: str) -> list[list[int]]:
    return [[c[key] for c in res["costs"]] for res in case_results(world, name, "error_in_case")]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("timed", "untimed"), [("ddp_slow", "ddp_untimed"),
                                                ("ddp_control", "ddp_untimed"),
                                                ("fsdp2_slow", "fsdp2_untimed")])
def test_timing_adds_no_host_read_and_no_collective(w4: list, timed: str, untimed: str) -> None:
    """Every rank, every warm collect: host reads, scalar reads and c10d collectives of a
    collect with rank timing equal those of the same collect without it."""
    for key in ("host_reads", "scalar_reads", "collectives"):
        assert _costs(w4, timed, key) == _costs(w4, untimed, key), key


@pytest.mark.timeout(400)
def test_under_plain_ddp_ordinary_collects_issue_nothing(w4: list) -> None:
    """The c10d op counter per warm collect: the divergence step's one all-reduce, nothing on
    the ordinary collects between, with rank timing on; every FSDP2 collect its one."""
    for per_rank in _costs(w4, "ddp_slow", "collectives"):
        assert per_rank == [int((WARM + i) % DDP_CARRY_EVERY == 0) for i in range(len(per_rank))]
    # each rank's window after its collect: drained by a carried one, grown by an ordinary one
    for per_rank in _costs(w4, "ddp_slow", "window"):
        assert per_rank == [(WARM + i) % DDP_CARRY_EVERY for i in range(len(per_rank))]
    assert {n for per_rank in _costs(w4, "fsdp2_slow", "window") for n in per_rank} == {0}
    assert {n for per_rank in _costs(w4, "fsdp2_slow", "collectives") for n in per_rank} == {1}
    untimed = case_results(w4, "fsdp2_untimed", "error_in_case")[0]["snaps"]
    assert all(s["straggler_score"] is None for s in untimed)  # off: absent, never 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("name", "every"), [("ddp_slow", DDP_CARRY_EVERY), ("fsdp2_slow", 1)])
def test_snapshots_carry_the_latest_carried_step(w4: list, name: str, every: int) -> None:
    """Rank 0's snapshots: no timing before the first carried step that measured (step 0's
    has no previous collect); after it, the latest carried step's timing with that step."""
    snaps = case_results(w4, name, "error_in_case")[0]["snaps"]
    for s in snaps:
        carried = s["step"] - s["step"] % every
        if carried == 0:
            assert s["rank_timing_step"] is None and s["straggler_score"] is None
        else:
            assert s["rank_timing_step"] == carried, s
            assert s["straggler_score"] is not None


@pytest.mark.timeout(400)
def test_nothing_carrying_the_timing_is_said_and_nothing_is_published(w4: list) -> None:
    """Plain DDP with divergence_every=0: rank 0 warns at construction (the other ranks stay
    quiet) and no snapshot has timing figures (absent, never 0)."""
    per_rank = case_results(w4, "ddp_nothing_carries", "error_in_case")
    assert [r["warned"] for r in per_rank] == [True, False, False, False]
    assert not any(t for r in per_rank for t in r["timed"])
