"""Which rank is slow, end to end in a 4-rank gloo world: a rank made slow by a sleep in its
backward is named on rank 0 under DDP and FSDP2, nobody is named persistently without it, and
timing costs no host read and no collective beyond the step's one all-reduce. Workers in
straggler_cases.py; the world is spawned once and killed after WORLD_TIMEOUT seconds."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import straggler_cases
from straggler_cases import SLOW_RANK, WARM
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
@pytest.mark.parametrize(("timed", "untimed"), [("ddp_slow", "ddp_untimed_reduced"),
                                                ("ddp_control", "ddp_untimed_reduced"),
                                                ("fsdp2_slow", "fsdp2_untimed")])
def test_timing_adds_no_host_read_in_warm_collects(w4: list, timed: str, untimed: str) -> None:
    """Every rank, every warm collect: the host reads and scalar reads of collect with rank
    timing equal those of an untimed collect that all-reduces too (none of them read the
    timing section; under DDP timing makes every collect all-reduce, whose step agreement the
    next collect reads from host memory)."""
    for key in ("host_reads", "scalar_reads"):
        assert _costs(w4, timed, key) == _costs(w4, untimed, key), key


@pytest.mark.timeout(400)
def test_timing_adds_no_collective_under_fsdp2(w4: list) -> None:
    assert _costs(w4, "fsdp2_slow", "collectives") == _costs(w4, "fsdp2_untimed", "collectives")
    assert {n for per_rank in _costs(w4, "fsdp2_slow", "collectives") for n in per_rank} == {1}
    untimed = case_results(w4, "fsdp2_untimed", "error_in_case")[0]["snaps"]
    assert all(s["straggler_score"] is None for s in untimed)  # off: absent, never 0


@pytest.mark.timeout(400)
def test_under_plain_ddp_timing_keeps_the_one_all_reduce(w4: list) -> None:
    """Plain DDP collects skip gradwatch's all-reduce (DDP reduced every gradient); rank
    timing needs it on every collect: exactly one, the packed vector's, never more."""
    assert {n for r in _costs(w4, "ddp_untimed", "collectives") for n in r} == {0}
    assert {n for r in _costs(w4, "ddp_slow", "collectives") for n in r} == {1}
