"""Expert parallelism, ``main_grad`` and ``watch()`` on a refused setup, in 2- and 4-rank gloo
worlds (workers in helpers/expert_cases.py): every figure within 1e-6 relative of a float64
unsharded replica's averaged gradient, fp32 and bf16, one gradwatch all-reduce per collect.
"""

from __future__ import annotations

from typing import Any

import expert_cases
import pytest
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 150.0
TOL = 1e-6


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(expert_cases.worker, "w2", 2, tmp_path_factory.mktemp("ep2"),
                       WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(expert_cases.worker, "w4", 4, tmp_path_factory.mktemp("ep4"),
                       WORLD_TIMEOUT)


def _check_exact(per_rank: list[dict[str, Any]], parallelism: str) -> None:
    r0 = per_rank[0]
    assert r0["mismatches"] == [], r0["mismatches"]
    assert r0["max_rel_err"] <= TOL, r0
    assert r0["global_norm"] > 0.0
    assert set(r0["group_norms"]) == {"experts", "dense"}
    assert r0["group_norms"]["experts"] > 0.0  # experts are in the norm
    for res in per_rank:
        assert res["collectives"] == 1, res["collective_ops"]  # one gradwatch op per collect
        assert res["collective_ops"] == ["c10d.allreduce_"]
        assert res["collective_dtypes"] == ["torch.float64"]
        assert res["dtensor_ops"] == 0  # norms never dispatched through DTensor
        assert res["parallelism"] == parallelism
        assert res["global_norm"] == r0["global_norm"]


W2_EXACT = [
    ("ep_dtensor_fp32", "ep2"),
    ("ep_dtensor_bf16", "ep2"),
    ("ep_plain_fp32", "replicated2"),
    ("ep_plain_bf16", "replicated2"),
    ("main_grad_fp32", "replicated2"),
    ("main_grad_bf16", "replicated2"),
]
W4_EXACT = [
    ("ep_fsdp2_fp32", "fsdp2x4+ep2"),
    ("ep_fsdp2_bf16", "fsdp2x4+ep2"),
    ("ep_tp_fp32", "tp2+ep2"),
    ("ep_tp_bf16", "tp2+ep2"),
    ("ep_plain_fp32", "replicated4"),
    ("ep_plain_bf16", "replicated4"),
    ("ep_dtensor_fp32", "ep4"),
    ("ep_dtensor_bf16", "ep4"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("case", "parallelism"), W2_EXACT)
def test_two_ranks_match_the_unsharded_replica(w2: list, case: str, parallelism: str) -> None:
    _check_exact(case_results(w2, case), parallelism)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("case", "parallelism"), W4_EXACT)
def test_four_ranks_match_the_unsharded_replica(w4: list, case: str, parallelism: str) -> None:
    _check_exact(case_results(w4, case), parallelism)


@pytest.mark.timeout(240)
def test_expert_layouts_are_what_they_claim(w2: list, w4: list) -> None:
    # DTensor experts: sharded over ep (and tp); with FSDP2, strided over dp on top.
    assert case_results(w2, "ep_dtensor_fp32")[0]["placements"] == "(Shard(dim=0),)"
    assert case_results(w4, "ep_tp_fp32")[0]["placements"] == "(Shard(dim=0), Shard(dim=2))"
    fsdp = case_results(w4, "ep_fsdp2_fp32")[0]["placements"]
    assert "_StridedShard" in fsdp["experts.weight"] and "Shard(dim=0)" in fsdp["experts.weight"]
    # Plain experts: each rank holds half of them, names by global index; every rank's layout
    # names all four.
    for world in (w2, w4):
        per_rank = case_results(world, "ep_plain_fp32")
        assert per_rank[0]["held"] == ["0", "1"] and per_rank[1]["held"] == ["2", "3"]
        for res in per_rank:
            assert [n for n in res["names"] if n.startswith("experts.")] == [
                f"experts.weights.{e}" for e in range(4)]


@pytest.mark.timeout(240)
def test_plain_experts_need_a_true_declaration(w2: list) -> None:
    for res in case_results(w2, "ep_plain_undeclared"):
        assert res["error_type"] == "LayoutMismatchError"
        assert "expert_parameters" in res["message"]
    for res in case_results(w2, "ep_plain_coinciding_names"):
        assert res["error_type"] == "LayoutMismatchError"
        assert "held by exactly the ranks that hold 'dense.weight'" in res["message"]
        assert "experts.weights.0" in res["message"]


@pytest.mark.timeout(240)
def test_main_grad_is_read_and_clipped(w2: list) -> None:
    for case in ("main_grad_fp32", "main_grad_bf16"):
        for res in case_results(w2, case):
            assert res["grads_none"] and res["grads_none_after_clip"]
            assert res["main_grad_dtypes"] == ["torch.float32"]
            assert abs(res["clip_total"] - res["clip_before"]) <= TOL * res["clip_before"]
            assert abs(res["clip_after"] - res["clip_max_norm"]) <= 1e-5 * res["clip_max_norm"]
    for res in case_results(w2, "megatron_distributed_optimizer"):
        assert res["error_type"] == "UnsupportedParallelismError"
        assert "use_distributed_optimizer" in res["message"]


@pytest.mark.timeout(240)
def test_watch_never_takes_the_job_down(w2: list) -> None:
    per_rank = case_results(w2, "watch_refused")
    for rank, res in enumerate(per_rank):
        assert res["type"] == "RefusedWatch"
        assert res["collectives"] == 0  # a no-op: collect and clip issue nothing
        assert res["snapshot_step"] == 0
        refusals = [m for m in res["error_logs"] if "monitoring is off" in m]
        assert len(refusals) == 1 and "Partial" in refusals[0], res["error_logs"]
        explicit = res["explicit"]
        assert explicit["error_type"] == "UnsupportedParallelismError"
        assert (res["url"] is not None) == (rank == 0)  # only rank 0 serves
    scrape = per_rank[0]["scrape"]
    assert "gradwatch_collecting 0.0" in scrape, scrape
    assert any('parallelism="refused"' in line for line in scrape), scrape
