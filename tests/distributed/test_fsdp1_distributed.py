"""FSDP1 (FullyShardedDataParallel) on gloo: every figure equals an unsharded replica's
averaged gradient, for use_orig_params True and False, every sharding strategy that runs on
CPU, nested wrapping, fp32, bf16 parameters and bf16 MixedPrecision, at 2 and 4 ranks, with at
most one gradwatch all-reduce per collect; clipping, temporaries, no_sync, CPU offload and the
refusals. Workers in tests/helpers/fsdp1_cases.py; one world per size runs every case.
"""

from __future__ import annotations

import math
from typing import Any

import fsdp1_cases
import pytest
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 240.0
TOL = 1e-6


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(fsdp1_cases.worker, "w2", 2, tmp_path_factory.mktemp("fsdp1_w2"),
                       WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(fsdp1_cases.worker, "w4", 4, tmp_path_factory.mktemp("fsdp1_w4"),
                       WORLD_TIMEOUT)


def _check(per_rank: list[dict[str, Any]], parallelism: str, dtype: str) -> None:
    r0 = per_rank[0]
    assert r0["mismatches"] == [], r0["mismatches"]
    assert r0["max_rel_err"] <= TOL, r0
    for res in per_rank:
        assert res["parallelism"] == parallelism
        # Names are the clean state_dict keys, groups match clean patterns ("0.*": the first
        # submodule, whatever the wrapping).
        assert res["names"] == res["state_dict_keys"] == res["reference_names"]
        assert res["first_tensors"] == 2
        assert res["global_norm"] == r0["global_norm"]
        assert res["collectives"] <= 1, res["collective_ops"]
        assert set(res["collective_ops"]) <= {"c10d.allreduce_"}
        assert set(res["collective_dtypes"]) <= {"torch.float64"}
        # The clip: the whole-model norm, bit for bit the same on every rank, and every local
        # gradient scaled by its coefficient.
        assert len(set(res["clip_totals"])) == 1
        assert res["clip_rel_err"] <= TOL
        assert res["clip_grad_rel_err"] <= 1e-6 if dtype == "torch.float32" else 2**-8
        assert res["clipped_grads"] > 0
        assert math.isclose(res["post_clip_norm"], res["max_norm"], rel_tol=1e-5)
        assert res["flat_grad_dtypes"] == [dtype]


W2 = [
    ("full_flat", "fsdp1x2", "torch.float32"),
    ("full_orig", "fsdp1x2", "torch.float32"),
    ("grad_op_flat", "fsdp1x2", "torch.float32"),
    ("grad_op_orig", "fsdp1x2", "torch.float32"),
    ("no_shard_flat", "fsdp1noshard2", "torch.float32"),
    ("no_shard_orig", "fsdp1noshard2", "torch.float32"),
    ("manual_flat", "fsdp1x2", "torch.float32"),
    ("bf16_flat", "fsdp1x2", "torch.bfloat16"),
    ("bf16_orig", "fsdp1x2", "torch.bfloat16"),
    ("mixed_flat", "fsdp1x2", "torch.float32"),
    ("mixed_orig", "fsdp1x2", "torch.float32"),
    ("inner_flat", "fsdp1x2", "torch.float32"),
    ("inner_orig", "fsdp1x2", "torch.float32"),
    ("offload_flat", "fsdp1x2", "torch.float32"),
    ("offload_orig", "fsdp1x2", "torch.float32"),
]
W4 = [
    ("full_flat", "fsdp1x4", "torch.float32"),
    ("full_orig", "fsdp1x4", "torch.float32"),
    ("grad_op_orig", "fsdp1x4", "torch.float32"),
    ("no_shard_flat", "fsdp1noshard4", "torch.float32"),
    ("hybrid_flat", "fsdp1hsdp2x2", "torch.float32"),
    ("hybrid_orig_groups", "fsdp1hsdp2x2", "torch.float32"),
    ("hybrid_zero2_flat_groups", "fsdp1hsdp2x2", "torch.float32"),
    ("hybrid_zero2_orig", "fsdp1hsdp2x2", "torch.float32"),
    ("bf16_flat", "fsdp1x4", "torch.bfloat16"),
    ("bf16_hybrid_orig", "fsdp1hsdp2x2", "torch.bfloat16"),
    ("mixed_orig", "fsdp1x4", "torch.float32"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "parallelism", "dtype"), W2)
def test_two_ranks_match_averaged_replica(w2: list, case: str, parallelism: str,
                                          dtype: str) -> None:
    _check(case_results(w2, case), parallelism, dtype)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("case", "parallelism", "dtype"), W4)
def test_four_ranks_match_averaged_replica(w4: list, case: str, parallelism: str,
                                           dtype: str) -> None:
    _check(case_results(w4, case), parallelism, dtype)


@pytest.mark.timeout(300)
def test_handshake_agrees_in_one_vote(w2: list, w4: list) -> None:
    """Every rank describes the flat shards alike (slices derived from the placement), so the
    construction handshake is phase 0's one all-reduce: with the world group, a device_mesh
    or the standard layout of process groups."""
    for world, cases in ((w2, W2), (w4, W4)):
        for case, _p, _d in cases:
            for res in case_results(world, case):
                assert res["ctor_collectives"] == 1, (case, res["ctor_collectives"])


@pytest.mark.timeout(300)
def test_no_shard_replicas_need_no_all_reduce(w2: list, w4: list) -> None:
    """NO_SHARD over the world: FSDP all-reduced every gradient, so only divergence steps
    (every collect here: divergence_every=1) all-reduce, as under DDP."""
    for world, case in ((w2, "no_shard_flat"), (w2, "no_shard_orig"), (w4, "no_shard_flat")):
        for r in case_results(world, case):
            assert r["synced"]
            assert r["ordinary_collectives"] == 0
            # this rank's own copy of the reduced gradients, measured alone
            assert r["ordinary_rel_err"] <= TOL
    assert not any(r["synced"] for r in case_results(w4, "hybrid_flat"))


@pytest.mark.timeout(300)
def test_no_gradient_sized_temporary(w2: list) -> None:
    for res in case_results(w2, "temporaries"):
        for mode in ("orig_False", "orig_True"):
            r = res[mode]
            assert r["largest_bytes"] <= r["smallest_grad_bytes"] // 64, r
            assert r["collectives"] == 1 and r["collective_ops"] == ["c10d.allreduce_"], r
            assert r["collective_bytes"] == r["packed_bytes"], r  # no gradient gathered


@pytest.mark.timeout(300)
def test_no_sync_is_not_measured(w2: list) -> None:
    for res in case_results(w2, "no_sync"):
        for mode in ("orig_False", "orig_True"):
            r = res[mode]
            assert r["inside"].startswith("GradWatchError") and "no_sync" in r["inside"], r
            assert r["after"] > 0 and r["broken"] is None, r


@pytest.mark.timeout(300)
def test_mixed_fsdp1_fsdp2_refused(w2: list) -> None:
    for res in case_results(w2, "mixed_fsdp2"):
        assert res["error_type"] == "UnsupportedParallelismError", res
        assert "FSDP1" in res["message"] and "FSDP2" in res["message"], res


@pytest.fixture(scope="module")
def hf2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(fsdp1_cases.worker, "hf", 2, tmp_path_factory.mktemp("fsdp1_hf2"),
                       WORLD_TIMEOUT)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["hf_flat", "hf_orig"])
def test_huggingface_trainer_clip_is_routed_and_pre_clip(hf2: list, case: str) -> None:
    """The Trainer's clip under FSDP1 goes through gradwatch: the published figure of every
    step is the pre-clip norm (float64 reference of the averaged replica, clip active), the
    total the Trainer logs is that norm, the same on every rank, and the model is clipped to
    max_norm as FSDP's own clip would."""
    for res in case_results(hf2, case):
        assert res["routed"] and res["route_removed"]
        pre, max_norm = res["pre"], res["max_norm"]
        assert max_norm < pre  # the clip acts
        for step, seen in enumerate(res["steps"], start=1):
            assert seen["step"] == step
            assert abs(seen["published"] - pre) <= TOL * pre, (seen, pre)
            assert abs(seen["total"] - pre) <= TOL * pre, (seen, pre)
            assert seen["clip_coef"] == pytest.approx(max_norm / (pre + 1e-6), rel=1e-6)
            assert math.isclose(seen["post_clip"], max_norm, rel_tol=1e-5)
    totals = {tuple(s["total"] for s in r["steps"]) for r in case_results(hf2, case)}
    assert len(totals) == 1  # bit for bit on every rank
