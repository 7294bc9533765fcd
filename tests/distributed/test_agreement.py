"""Every rank agrees, no rank stops alone: a setup refused on rank 0 only after the handshake,
a rank that skipped a collect. Workers in helpers/agree_cases.py (one 2-rank gloo world, the
job's own timeout 60 s)."""

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


@pytest.mark.parametrize("stack", ["fsdp2", "pipeline"])
def test_a_step_mismatch_stops_every_rank_together(
    world: list[dict[str, Any]], stack: str
) -> None:
    """The last rank skipped its collect of one step: the first all-reduce that pairs
    different steps is told apart on every rank (the step residues), every rank stops
    collecting right there (nothing left unpaired: no rank waits for the job's 60 s timeout),
    clips the bare loop's way from that step on, and the guard lets the bare step through;
    visible at once (the reason on every rank, ``step_mismatch`` counted on rank 0). No clip
    ever uses a sum of different steps."""
    per_rank = case_results(world, f"mismatch/{stack}")
    for rank, res in enumerate(per_rank):
        assert res["seconds"] < 20.0, (rank, res["seconds"])
        assert res["broken"] is not None and "different steps" in res["broken"], (rank, res)
        assert any("different steps" in line for line in res["errors"]), res["errors"]
    assert per_rank[0]["internal_errors"]["step_mismatch"] >= 1, per_rank[0]["internal_errors"]
    at = ac.MISMATCH_AT
    # Bit for bit alike by iteration: the same guard decision on every rank, and the same
    # clip norm (pipeline stages: until the stop; the bare loop's clip of a stage is its own,
    # and the last rank ran one iteration fewer: the pairs end with it).
    for i, readings in enumerate(zip(*(r["readings"] for r in per_rank), strict=False)):
        assert len(set(readings)) == 1, (stack, i, readings)
    for i, clips in enumerate(zip(*(r["clips"] for r in per_rank), strict=False)):
        if stack != "pipeline" or i < at:
            assert len(set(clips)) == 1, (stack, i, clips)
    # Before the mismatch: gradwatch's whole-model norm, exact; guard decisions made.
    for i in range(at):
        truth = math.sqrt(math.fsum(r["squares"][i] for r in per_rank))
        assert math.isclose(float(per_rank[0]["clips"][i]), truth, rel_tol=1e-6), (i, truth)
        assert per_rank[0]["readings"][i] is not None
    # From the mismatch on: the bare loop's clip (FSDP2: torch's DTensor clip, the whole
    # model's norm; pipeline stages: torch's over the stage, rank-local). The guard: at the
    # mismatched all-reduce itself it sees no measurement and skips nothing; after it, no
    # decision (the bare optimizer step).
    for rank, res in enumerate(per_rank):
        assert "skipped=None" in res["readings"][at], (rank, res["readings"][at])
        for i in range(at, len(res["steps"])):
            own = math.sqrt(res["squares"][i])
            truth = res["references"][i] if stack == "fsdp2" else own
            assert math.isclose(float(res["clips"][i]), truth, rel_tol=1e-6), (rank, i, truth)
            if i > at:
                assert res["readings"][i] is None, (rank, i, res["readings"][i])
    # Published: every step before the mismatch, exact; nothing after.
    published = {int(k): v for k, v in per_rank[0]["published"].items()}
    assert sorted(published) == list(range(at)), published
    for step, norm in published.items():
        truth = math.sqrt(math.fsum(r["squares"][step] for r in per_rank))
        assert math.isclose(norm, truth, rel_tol=1e-6), (step, norm, truth)
