"""Optimizer-update health in a 2-rank gloo world (workers in update_cases.py): weight norms,
applied updates and their ratio against float64 references from whole-parameter copies, under
DDP (with and without gradwatch's all-reduce) and FSDP2, with no extra collective."""

from __future__ import annotations

from typing import Any

import pytest
import update_cases
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 150.0
WEIGHT_TOL = 1e-6
UPDATE_TOL = 1e-4


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(update_cases.worker, "w2", 2, tmp_path_factory.mktemp("w2"),
                       WORLD_TIMEOUT)


@pytest.mark.parametrize("name", ["ddp_alone", "ddp_reduced", "fsdp2_sgd", "fsdp2_fused_adamw"])
def test_update_figures_match_whole_parameter_copies(
    name: str, w2: list[dict[str, Any]]
) -> None:
    per_rank = case_results(w2, name)
    for res in per_rank:
        rows = res["rows"]
        assert rows[0]["update"] is None and rows[0]["weight"] is not None
        for row in rows[1:]:
            ref = row["ref"]
            assert ref["update"] > 0
            assert row["weight"] == pytest.approx(ref["weight"], rel=WEIGHT_TOL)
            assert row["first_weight"] == pytest.approx(ref["first_weight"], rel=WEIGHT_TOL)
            assert row["update"] == pytest.approx(ref["update"], rel=UPDATE_TOL)
            assert row["first_update"] == pytest.approx(ref["first_update"], rel=UPDATE_TOL)
            assert row["ratio"] == pytest.approx(ref["update"] / ref["weight"], rel=UPDATE_TOL)
            assert row["stalled"] == pytest.approx(ref["stalled"], abs=1e-3)
        assert rows == per_rank[0]["rows"]  # every rank reads the same figures


def test_update_stats_add_no_collective(w2: list[dict[str, Any]]) -> None:
    """Under DDP's replication the collects still skip the all-reduce; otherwise one each."""
    for res in case_results(w2, "ddp_alone"):
        assert res["collectives"] == [0, 0, 0, 0]
    for name in ("ddp_reduced", "fsdp2_sgd"):
        for res in case_results(w2, name):
            assert res["collectives"] == [1, 1, 1, 1]


def test_fsdp1_is_refused_naming_the_setting(w2: list[dict[str, Any]]) -> None:
    for res in case_results(w2, "fsdp1_refused"):
        assert res["error_type"] == "UnsupportedParallelismError", res
        assert "update_stats" in res["message"]
