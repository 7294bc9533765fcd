"""Every rank agrees, no rank stops alone: a setup refused on rank 0 only after the handshake.
Workers in helpers/agree_cases.py (one 2-rank gloo world, the job's own timeout 60 s)."""

from __future__ import annotations

import math
from typing import Any

import agree_cases as ac
import pytest
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("agree")
    return spawn_suite(ac.worker, "", 2, out, timeout=300.0)


@pytest.mark.parametrize("stack", ["ddp", "fsdp2", "fsdp1"])
def test_a_refusal_on_rank0_is_agreed(world: list[dict[str, Any]], stack: str) -> None:
    """Rank 0 cannot write its file_sd target: every rank gets a RefusedWatch at construction
    (no rank waits the job's 60 s timeout on a clip rank 0 never pairs), every rank clips as
    the bare loop would, by the whole model's norm, the same bits on every rank; rank 0
    serves gradwatch_collecting 0; an explicit GradWatch raises on every rank."""
    per_rank = case_results(world, f"refused/{stack}")
    for rank, res in enumerate(per_rank):
        assert res["type"] == "RefusedWatch", (rank, res)
        assert res["seconds"] < 20.0, (rank, res["seconds"])  # the job's timeout is 60 s
        assert any("monitoring is off" in line for line in res["errors"]), res["errors"]
        assert res["explicit"] in ("GradWatchError", "SetupRefusedError"), res["explicit"]
    assert per_rank[0]["explicit"] == "GradWatchError"  # rank 0's own: the file_sd path
    assert per_rank[1]["explicit"] == "SetupRefusedError"
    assert any("file_sd_path" in line for line in per_rank[0]["errors"])
    assert any("rank 0 refused" in line for line in per_rank[1]["errors"])
    assert len({repr(r["clips"]) for r in per_rank}) == 1, [r["clips"] for r in per_rank]
    for clip, ref in zip(per_rank[0]["clips"], per_rank[0]["references"], strict=True):
        assert math.isclose(float(clip), ref, rel_tol=1e-6), (stack, clip, ref)
    assert "gradwatch_collecting 0.0" in per_rank[0]["scrape"], per_rank[0]["scrape"]
