"""Collects without gradwatch's all-reduce under pure DDP replication, in a 2-rank and a 4-rank
gloo world (workers in replicated_cases.py): exact statistics on every rank from its own copy,
no collective but on divergence steps, identical clipping, and the guards that move to the
steps that keep the all-reduce (step check, failing and stopped ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import replicated_cases
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 150.0
TOL = {"alone_fp32": 1e-6, "alone_fp64": 1e-12}


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(replicated_cases.worker, "w2", 2, tmp_path_factory.mktemp("w2"),
                       WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(replicated_cases.worker, "w4", 4, tmp_path_factory.mktemp("w4"),
                       WORLD_TIMEOUT)


def _case(world: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return case_results(world, name)


@pytest.mark.parametrize(("suite", "name"), [("w2", "alone_fp32"), ("w2", "alone_fp64"),
                                             ("w4", "alone_fp32")])
def test_every_rank_measures_alone_between_divergence_steps(
    suite: str, name: str, request: pytest.FixtureRequest
) -> None:
    per_rank = _case(request.getfixturevalue(suite), name)
    for res in per_rank:
        assert res["synced"] is True
        assert res["collectives"] == [1, 0, 0, 1, 0, 0]  # divergence_every=3
        assert res["mismatches"] == []
        assert max(res["max_rel_err"]) <= TOL[name], res["max_rel_err"]
        assert res["global_norm"] == per_rank[0]["global_norm"]  # bit for bit
        assert res["divergence"][0] == res["divergence"][3] == 0.0  # identical replicas
        assert all(n > 0 for n in res["global_norm"])


@pytest.mark.parametrize("suite", ["w2", "w4"])
def test_clip_without_the_all_reduce_is_exact_and_identical(
    suite: str, request: pytest.FixtureRequest
) -> None:
    per_rank = _case(request.getfixturevalue(suite), "clip")
    for res in per_rank:
        assert res["collectives"] == 0
        assert res["coef"] < 1.0  # the case clips
        assert abs(res["total"] - res["exact"]) <= 1e-6 * res["exact"]
        assert len(set(res["totals"])) == 1  # every rank clipped with the same norm
        assert res["max_grad_rel_err"] <= 1e-6
    assert abs(per_rank[0]["clip_coef"] - per_rank[0]["coef"]) <= 1e-6


def test_always_reduce_restores_one_all_reduce_per_collect(w2: list[dict[str, Any]]) -> None:
    for res in _case(w2, "always_reduce"):
        assert res["synced"] is False
        assert res["collectives"] == [1, 1]


@pytest.mark.parametrize("suite", ["w2", "w4"])
def test_a_nan_on_one_rank_is_seen_without_the_all_reduce(
    suite: str, request: pytest.FixtureRequest
) -> None:
    for res in _case(request.getfixturevalue(suite), "nan_one_rank"):
        assert res["collectives"] == 0
        assert res["is_finite"] is False and res["nonfinite_params"]


def test_step_mismatch_is_logged_at_the_next_divergence_step(w2: list[dict[str, Any]]) -> None:
    for res in _case(w2, "step_mismatch"):
        assert res["collectives"] == [1, 0, 1]
        assert res["logged"] == [False, False, True]


def test_a_failing_rank_issues_no_stand_in_and_the_next_divergence_step_aligns(
    w2: list[dict[str, Any]],
) -> None:
    first, last = _case(w2, "failing_rank")
    for res in (first, last):
        assert res["collectives"] == [1, 0, 1]
        assert res["broken"] is None
        assert max(s for s in res["seconds"]) < 5.0  # no wait for the timeout (10 s)
    assert first["results"] == ["measured"] * 3
    assert max(first["max_rel_err"]) <= 1e-6
    assert last["results"][0] == last["results"][2] == "measured"
    assert "not measured" in last["results"][1] and "simulated failure" in last["results"][1]


def test_a_rank_that_stops_collecting_stalls_nobody(w2: list[dict[str, Any]]) -> None:
    first, last = _case(w2, "rank_stops")
    assert first["results"] == ["measured"] * 4
    assert max(first["seconds"][1:]) < 5.0  # the timeout is 10 s
    assert last["results"] == ["measured"]


@pytest.mark.parametrize(("suite", "name"), [("w2", "not_pure_ignored"),
                                             ("w2", "not_pure_no_ddp"),
                                             ("w2", "not_pure_hooked"),
                                             ("w4", "not_pure_subgroup")])
def test_gradients_ddp_does_not_reduce_over_the_world_keep_the_all_reduce(
    suite: str, name: str, request: pytest.FixtureRequest
) -> None:
    for res in _case(request.getfixturevalue(suite), name):
        assert res["synced"] is False
        assert res["collectives"] == 1
