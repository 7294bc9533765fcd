"""Multi-process gloo tests of the distributed reduction: every figure equals the unsharded
reference, with one float64 all-reduce per collect; workers in dist_cases.py.

Each world (2 and 4 ranks) is spawned once per module and runs many cases; every test reads its
case's per-rank results. A world that hangs is killed after WORLD_TIMEOUT seconds.
"""

from __future__ import annotations

from typing import Any

import dist_cases
import pytest
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 150.0
FP32_TOL = 1e-6
FP64_TOL = 1e-12


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(dist_cases.worker, "w2", 2, tmp_path_factory.mktemp("w2"),
                       WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(dist_cases.worker, "w4", 4, tmp_path_factory.mktemp("w4"),
                       WORLD_TIMEOUT)


def _case(world: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return case_results(world, name)


def _check_exact(per_rank: list[dict[str, Any]], tol: float, parallelism: str, world: int) -> None:
    r0 = per_rank[0]
    assert r0["mismatches"] == []
    assert r0["max_rel_err"] <= tol, r0
    for res in per_rank:
        assert res["collectives"] == 1, res["collective_ops"]  # exactly one c10d op per collect
        assert res["collective_ops"] == ["c10d.allreduce_"]
        assert res["collective_dtypes"] == ["torch.float64"]  # never bf16/fp16 on the wire
        assert res["dtensor_ops"] == 0  # norms never dispatched through DTensor
        assert res["world_size"] == world
        assert res["parallelism"] == parallelism
        assert res["global_norm"] == r0["global_norm"]  # every rank sees the same figures


W2_EXACT = [
    ("ddp_fp32", FP32_TOL, "ddp2"),
    ("ddp_fp64", FP64_TOL, "ddp2"),
    ("ddp_1e18", FP32_TOL, "ddp2"),
    # The framework callbacks' view: the unwrapped module of a DDP-trained model reads ddp2 too.
    ("ddp_inner_module", FP32_TOL, "ddp2"),
    ("fsdp2_fp32_1e18", FP32_TOL, "fsdp2x2"),
    ("fsdp2_fp64", FP64_TOL, "fsdp2x2"),
    ("pipeline", FP32_TOL, "pp2"),
    ("fp16_payload", FP32_TOL, "ddp2"),
]
W4_EXACT = [
    ("ddp_fp32", FP32_TOL, "ddp4"),
    ("fsdp2_fp64", FP64_TOL, "fsdp2x4"),
    ("fsdp_tp", FP32_TOL, "fsdp2x2+tp2"),
    ("hsdp", FP32_TOL, "hsdp2x2"),
    ("hsdp_tp_3d", FP32_TOL, "hsdp2x1+tp2"),
    ("pipeline_ddp", FP32_TOL, "pp2+ddp2"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("case", "tol", "parallelism"), W2_EXACT)
def test_two_ranks_match_unsharded(w2: list, case: str, tol: float, parallelism: str) -> None:
    _check_exact(_case(w2, case), tol, parallelism, 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("case", "tol", "parallelism"), W4_EXACT)
def test_four_ranks_match_unsharded(w4: list, case: str, tol: float, parallelism: str) -> None:
    _check_exact(_case(w4, case), tol, parallelism, 4)


@pytest.mark.timeout(240)
def test_distributed_md_states_the_measured_worst_cases(w2: list, w4: list) -> None:
    """docs/distributed.md's worst-case figures are bounds of what the exact cases measure."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    m = re.search(r"stay below ([0-9.e-]+) and ([0-9.e-]+)", " ".join(text.split()))
    assert m is not None, "docs/distributed.md no longer states the measured worst cases"
    bound = {FP32_TOL: float(m.group(1)), FP64_TOL: float(m.group(2))}
    worst = dict.fromkeys(bound, 0.0)
    for world, cases in ((w2, W2_EXACT), (w4, W4_EXACT)):
        for case, tol, _ in cases:
            worst[tol] = max(worst[tol], _case(world, case)[0]["max_rel_err"])
    for tol, figure in bound.items():
        assert worst[tol] <= figure, (tol, worst[tol], figure)
        assert figure < tol  # the figure says more than the tolerance the suite asserts


@pytest.mark.timeout(240)
def test_handshake_only_at_construction(w2: list, w4: list) -> None:
    # One fixed-size all-reduce when every rank agrees (uneven and empty FSDP2 shards
    # included); where ranks differ in structure (pipeline stages) the all-gather of the
    # records and the distinct descriptions once follow it: at most 3, the same count on
    # every rank.
    for world, case, expected in ((w2, "ddp_fp32", 1), (w2, "fsdp2_fp32_1e18", 1),
                                  (w4, "fsdp2_fp64", 1), (w4, "pipeline_ddp", 3)):
        for res in _case(world, case):
            assert res["ctor_collectives"] == expected, case
    for res in _case(w2, "ddp_fp32") + _case(w4, "ddp_fp32"):
        assert res["per_collect"] == [1, 1, 1]


@pytest.mark.timeout(240)
def test_empty_shards_frozen_and_gradless(w2: list, w4: list) -> None:
    fsdp2 = _case(w2, "fsdp2_fp32_1e18")
    assert max(r["empty_local_shards"] for r in fsdp2) > 0
    assert max(r["empty_local_shards"] for r in _case(w4, "fsdp2_fp64")) >= 4
    assert fsdp2[0]["n_with_grad"] < fsdp2[0]["n_params"]  # frozen bias
    ddp = _case(w2, "ddp_fp32")[0]
    assert (ddp["n_params"], ddp["n_with_grad"]) == (8, 5)  # frozen weight, unused layer
    big = _case(w2, "ddp_1e18")[0]
    assert big["global_norm"] > 1e19  # float32 squares of 1e18-scale gradients overflow


@pytest.mark.timeout(240)
def test_pipeline_rank0_covers_every_stage(w2: list, w4: list) -> None:
    for world, case in ((w2, "pipeline"), (w4, "pipeline_ddp")):
        per_rank = _case(world, case)
        names = per_rank[0]["names"]
        assert "layers.stage1.weight" in names and "layers.stage0.weight" in names
        assert all(r["names"] == names for r in per_rank)


@pytest.mark.timeout(240)
def test_fsdp_tp_placements_exercised(w4: list) -> None:
    placements = _case(w4, "fsdp_tp")[0]["placements"]
    assert placements["0.weight"][0].startswith("_StridedShard")
    assert placements["2.bias"] == ["Shard(dim=0)", "Replicate()"]
    assert len(placements["3.weight"]) == 1  # on the dp sub-mesh only: copies across tp


@pytest.mark.timeout(240)
def test_replica_divergence(w2: list, w4: list) -> None:
    for res in _case(w2, "replicated_divergence"):
        measured, expected = res["divergence"], res["expected"]
        assert measured[0] == pytest.approx(expected[0], rel=1e-6) and measured[0] > 0.01
        assert measured[1] == measured[0]  # not a measurement step: last value kept
        assert measured[2] == pytest.approx(expected[2], rel=1e-6)
        assert res["collectives"] == [1, 1, 1]  # packed into the same all-reduce
        assert res["disabled"] is None  # divergence_every=0: nothing measures it
    for case in ("ddp_fp32", "hsdp", "pipeline_ddp"):
        assert _case(w4, case)[0]["replica_divergence"] == 0.0


@pytest.mark.timeout(240)
def test_schedule_skip_is_a_noop(w2: list) -> None:
    for res in _case(w2, "schedule_skip"):
        assert res == {**res, "skipped_collectives": 0, "skipped_step": 0, "same_snapshot": True}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("stage_collision", "LayoutMismatchError", "same stage group"),
        ("config_mismatch", "LayoutMismatchError", "configuration"),
        ("shape_mismatch", "LayoutMismatchError", "different models"),
        ("names_mismatch", "LayoutMismatchError", "different models"),
        ("partial_param", "UnsupportedParallelismError", "Partial"),
    ],
)
def test_bad_layouts_raise_on_every_rank(w2: list, case: str, error: str, words: str) -> None:
    per_rank = _case(w2, case)
    for res in per_rank:
        assert res["error_type"] == error
        assert res["message"].startswith("gradwatch:") and words in res["message"]
        assert res["seconds"] < 10  # no hang
    assert len({r["message"] for r in per_rank}) == 1  # the same error everywhere


@pytest.mark.timeout(240)
def test_mismatched_gradient_placement_refused_together(w2: list) -> None:
    for res in _case(w2, "partial_grad"):
        assert res["collectives"] == 0
        assert "placements" in res["broken"]
        assert res["result"].startswith("GradWatchError: gradwatch: step 0 was not measured")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["timeout_raise", "timeout_absent"])
def test_missing_rank_times_out_with_gradwatch_error(w2: list, case: str) -> None:
    """A rank that never calls collect: the others time out with a GradWatchTimeoutError. A
    rank whose collect raises before the all-reduce issues a stand-in all-reduce instead:
    nobody waits for the timeout, every rank reports the step as not measured, and collection
    goes on (one collective per later collect on every rank)."""
    waiting, missing = _case(w2, case)
    for res in (waiting, missing):
        assert res["close_seconds"] < 5
    if case == "timeout_raise":
        assert waiting["error_type"] == missing["error_type"] == "GradWatchError"
        assert "another rank's local pass failed" in waiting["message"]
        assert "simulated failure inside collect" in missing["message"]
        assert waiting["seconds"] < 2.5  # no timeout
        assert not waiting["broken"] and not missing["broken"]  # both go on collecting
        assert waiting["later_collectives"] == missing["later_collectives"] == 1
        return
    assert waiting["error_type"] == "GradWatchTimeoutError"
    assert waiting["message"].startswith("gradwatch:")
    assert 2.5 < waiting["seconds"] < 20
    assert missing["error_type"] is None


@pytest.mark.timeout(240)
def test_handshake_bytes_constant_across_model_sizes_and_world_sizes(w2: list, w4: list) -> None:
    """Ranks that agree send and receive the same bytes per rank at 2 and 4 ranks, whatever
    the number of parameters (50 or 2,000), FSDP2 with uneven and empty shards included: one
    fixed-size all-reduce (phase 0), no record and no description on the wire. The per-rank
    view adds one all-gather of the host names."""
    import socket

    from gradwatch.reduce.handshake import HOST_BYTES, PHASE0_BYTES

    seen: dict[str, set[tuple[int, int]]] = {}
    for world, per_rank in ((2, _case(w2, "handshake_bytes")), (4, _case(w4, "handshake_bytes"))):
        # rows of 1 and 2W+1 over W ranks, x 3 columns: rank 3 of 4 holds only empty shards
        uneven = {2: [[3, 9], [0, 6]], 4: [[3, 9], [0, 9], [0, 9], [0]]}[world]
        for rank, res in enumerate(per_rank):
            assert res["fsdp2_uneven_2000"]["local_numels"] == uneven[rank]
            for kind in ("replicated", "fsdp2", "fsdp2_uneven", "fsdp2_tp"):
                small, large = res[f"{kind}_50"], res[f"{kind}_2000"]
                assert (small["n_params"], large["n_params"]) == (50, 2000)
                for got in (small, large):
                    assert got["ops"] == ["c10d.allreduce_"], got["ops"]
                    assert (got["sent"], got["received"]) == (PHASE0_BYTES, PHASE0_BYTES)
                    seen.setdefault(kind, set()).add((got["sent"], got["received"]))
                    assert got["hosts"] == []  # not gathered without the per-rank view
            assert "Shard(dim=0)" in res["fsdp2_tp_50"]["placements"][0]
            assert "_StridedShard" in str(res["fsdp2_tp_50"]["placements"])
            assert len(res["fsdp2_tp_50"]["local_numels"]) > 1  # uneven strided shards
            for n in (50, 2000):
                got = res[f"ddp_rank_view_{n}"]
                assert got["rank_view_groups"] > 0
                assert got["ops"] == ["c10d.allreduce_", "c10d._allgather_base_"], got["ops"]
                assert (got["sent"], got["received"]) == (PHASE0_BYTES + HOST_BYTES,
                                                          PHASE0_BYTES + world * HOST_BYTES)
                assert got["hosts"] == [socket.gethostname()] * world
    assert all(len(pairs) == 1 for pairs in seen.values()), seen  # equal at 2 and 4 ranks


@pytest.mark.timeout(240)
def test_mismatch_names_digest_groups_on_every_rank(w4: list) -> None:
    per_rank = _case(w4, "names_mismatch_one_rank")
    for res in per_rank:
        assert res["error_type"] == "LayoutMismatchError" and res["seconds"] < 10
        assert "digest group 0 (ranks 0-1, 3)" in res["message"]
        assert "digest group 1 (ranks 2)" in res["message"]
        assert "'1.weight'" in res["message"]
    assert len({r["message"] for r in per_rank}) == 1


@pytest.mark.timeout(240)
def test_rank_that_never_constructs_times_out_bounded(w2: list) -> None:
    waiting, absent = _case(w2, "never_constructs")
    assert absent["skipped"]
    assert waiting["error_type"] == "GradWatchTimeoutError"
    assert waiting["message"].startswith("gradwatch: construction handshake failed or timed out")
    assert waiting["seconds"] < 10  # bounded by collective_timeout_seconds=3, not a hang
