"""DeepSpeed ZeRO stages 0-3 on CPU, in a 2-rank and a 4-rank gloo world (workers in
zero_cases.py and, for the adaptive clip, zero_auto_cases.py): global and group norms against an
unsharded replica's averaged gradient and against DeepSpeed's own full gradient, one gradwatch
collective per collect, fp32, bf16 and a loss scale (unscaled), accumulation boundaries,
clipping by a number and by the adaptive threshold ("auto"), and the setups refused at
construction."""

from __future__ import annotations

import math
from typing import Any

import pytest
import zero_auto_cases
import zero_cases
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 280.0
#: A bf16 replica cannot reproduce DeepSpeed's bf16 averaging bit for bit: its figures agree
#: within bf16 rounding; the exact reference of bf16 runs is DeepSpeed's own full gradient.
REPLICA_TOL = {"fp32": 1e-6, "bf16": 2e-2, "bf16_fp32acc": 2e-2}


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(zero_cases.worker, "w2", 2, tmp_path_factory.mktemp("w2"), WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(zero_cases.worker, "w4", 4, tmp_path_factory.mktemp("w4"), WORLD_TIMEOUT)


EXACT = [("w2", s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")] + [
    ("w2", 2, "bf16_fp32acc"), ("w2", 3, "bf16_fp32acc"), ("w4", 3, "fp32"), ("w4", 2, "bf16")]


@pytest.mark.parametrize(("suite", "stage", "dtype"), EXACT)
def test_norms_are_exact_per_stage_and_dtype(
    suite: str, stage: int, dtype: str, request: pytest.FixtureRequest
) -> None:
    world = request.getfixturevalue(suite)
    per_rank = case_results(world, f"exact_s{stage}_{dtype}")
    first = per_rank[0]
    assert first["parallelism"] == f"zero{stage}x{len(world)}"
    assert first["mismatches"] == []
    assert max(first["deepspeed_err"]) <= 1e-6, first["deepspeed_err"]
    assert max(first["replica_err"]) <= REPLICA_TOL[dtype], first["replica_err"]
    for res in per_rank:
        assert res["collectives"] == [1] * len(res["collectives"])  # one all-reduce per collect
        assert res["global_norm"] == first["global_norm"]  # every rank, bit for bit
    assert all(n > 0 for n in first["global_norm"])
    assert all(g["body"] > 0 and g["head"] > 0 for g in first["groups"])
    for ours, theirs in zip(first["global_norm"], first["deepspeed_norm"], strict=True):
        if theirs is not None:  # stage 0 fp32: DeepSpeed computes no norm
            assert abs(ours - theirs) <= 1e-5 * theirs  # DeepSpeed's own (fp32) norm


def test_loss_scaled_figures_are_unscaled(w2: list[dict[str, Any]]) -> None:
    res = case_results(w2, "loss_scale")[0]
    assert res["scale"] == 1024.0
    assert res["err"] <= 1e-6
    assert abs(res["global_norm"] - res["deepspeed_norm"]) <= 1e-5 * res["deepspeed_norm"]


def test_off_the_accumulation_boundary_is_not_measured(w2: list[dict[str, Any]]) -> None:
    for res in case_results(w2, "accumulation"):
        assert isinstance(res["off"], str) and "not measured" in res["off"]
        assert "accumulation boundary" in res["off"]
        assert res["off_collectives"] == 0
        assert res["err"] <= 1e-6 and res["mismatches"] == []


def test_clip_grad_norm_clips_the_partitions(w2: list[dict[str, Any]]) -> None:
    for res in case_results(w2, "clip"):
        assert res["collectives"] == 1
        assert abs(res["total"] - res["exact"]) <= 1e-6 * res["exact"]
        assert abs(res["clipped"] - res["max_norm"]) <= 1e-5 * res["max_norm"]
        assert abs(res["deepspeed_norm"] - res["max_norm"]) <= 1e-5 * res["max_norm"]


def test_clip_is_refused_when_deepspeed_clips_and_its_norm_is_audited(
    w2: list[dict[str, Any]],
) -> None:
    for res in case_results(w2, "clip_refused"):
        for refused in res["refused"]:  # max_norm 1.0, then "auto"
            assert "GradWatchError" in refused
            assert "gradient_clipping=0.05" in refused and "audit_norm" in refused
            assert "set gradient_clipping to 0" in refused
        assert not res["started"]
        # DeepSpeed's get_global_grad_norm() is pre-clip: gradwatch's pre-clip norm equals it
        assert abs(res["global_norm"] - res["deepspeed_norm"]) <= 1e-5 * res["deepspeed_norm"]
        assert res["global_norm"] > 0.05


@pytest.mark.parametrize(("name", "words"), [
    ("refused_offload_optimizer", ["ZeRO-Offload", "offload_optimizer"]),
    ("refused_offload_param", ["ZeRO-Offload", "offload_param"]),
    ("refused_bf16_optimizer", ["BF16_Optimizer", "grad_accum_dtype"]),
])
def test_unmeasurable_setups_are_refused_naming_the_case(
    name: str, words: list[str], w2: list[dict[str, Any]]
) -> None:
    for res in [w[name] for w in w2]:
        assert "UnsupportedParallelismError" in res.get("refusal", ""), res
        for word in words:
            assert word in res["refusal"]


def test_the_engine_of_an_unwrapped_module_is_found(w2: list[dict[str, Any]]) -> None:
    res = case_results(w2, "unwrapped_module")[0]
    assert res["parallelism"] == "zero3x2"
    assert res["err"] <= 1e-6 and res["global_norm"] > 0
    assert "GradWatchError" in res["attach"] and "engine.step()" in res["attach"]


@pytest.mark.parametrize("stage", [2, 3])
def test_no_gradient_sized_temporary(stage: int, w2: list[dict[str, Any]]) -> None:
    for res in case_results(w2, f"temporaries_s{stage}"):
        assert res["local_bytes"] > 2**16
        assert res["largest"] <= res["local_bytes"] // 16, res
        assert math.isfinite(res["largest"])


def test_deepspeed_overflow_skips_are_counted(tmp_path: Any) -> None:
    """Steps 1 and 2 overflow (non-finite gradients under DeepSpeed's loss scaler), which
    skips them, maybe without a log line: each collect reports the skips since the previous
    collect, and the published counter reads them as ``deepspeed_overflow``."""
    world = spawn_suite(zero_cases.worker, "overflow", 2, tmp_path, WORLD_TIMEOUT)
    for res in case_results(world, "overflow_skips"):
        assert res["engine_skipped"] == 2
        assert res["skipped"] == [None, 0, 1, 1]
        assert res["counts"]["deepspeed_overflow"] == 2


def test_update_stats_of_the_fp32_master_weights(tmp_path: Any) -> None:
    """ZeRO stages 0-3: the weight norm of the fp32 master weights to 1e-6 and the update
    each step applied to them to 1e-4, against full fp32 copies gathered around the step."""
    world = spawn_suite(zero_cases.worker, "updates", 2, tmp_path, WORLD_TIMEOUT)
    for name in ("update_stats_s0", "update_stats_s1", "update_stats_s2", "update_stats_s3",
                 "update_stats_s2_bf16", "update_stats_s3_bf16"):
        for res in case_results(world, name):
            rows = res["rows"]
            assert rows[0]["update"] is None, name
            for row in rows:
                assert row["weight"] == pytest.approx(row["ref_weight"], rel=1e-6), name
            for row in rows[1:]:
                assert row["ref_update"] > 0, name
                assert row["update"] == pytest.approx(row["ref_update"], rel=1e-4), name


@pytest.fixture(scope="module")
def costs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(zero_cases.worker, "costs", 2, tmp_path_factory.mktemp("costs"),
                       WORLD_TIMEOUT)


@pytest.mark.parametrize("case", ["costs_s2_fp16", "costs_s3_fp16", "costs_s2_bf16"])
def test_warm_steps_build_no_tensor_and_read_nothing(costs: list[dict[str, Any]],
                                                     case: str) -> None:
    """Warm collects and clips under ZeRO (fp16's loss scale divided out as a kernel argument,
    bf16): no tensor from Python data, no blocking copy, no scalar read, on every rank."""
    for res in case_results(costs, case):
        assert res["last"] is not None and res["last"] > 0
        for python_tensors, blocking, scalar_reads, seen in res["counts"]:
            assert (python_tensors, blocking, scalar_reads) == (0, 0, 0), seen


@pytest.fixture(scope="module")
def auto(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(zero_auto_cases.worker, "auto", 2, tmp_path_factory.mktemp("auto"),
                       WORLD_TIMEOUT * 2)


#: The post-clip norm against ``min(norm, limit)``: fp32 partitions scaled in fp32 round at
#: 1e-6; bf16 ones at bf16's precision.
AUTO_TOL = {"auto_s0": 1e-5, "auto_s1": 1e-5, "auto_s2": 1e-5, "auto_s3": 1e-5,
            "auto_s2_scaled": 1e-5, "auto_s3_bf16": 1e-2}


@pytest.mark.parametrize("case", list(AUTO_TOL))
def test_auto_clip_scales_the_partitions_deepspeed_steps(
    auto: list[dict[str, Any]], case: str
) -> None:
    """clip_grad_norm_("auto") under ZeRO 1-3 (a loss scale, bf16): every figure of the
    adaptive threshold (norm, threshold, limit, warm-up count, the history) and the
    coefficient gradwatch multiplied the partitions by are bitwise equal on both ranks at
    every step; DeepSpeed's full gradient after the clip (a float64 gather) has norm
    ``min(norm, limit)``, and DeepSpeed's own norm in ``engine.step()`` is that clipped norm
    (it steps the clipped partitions); the three 40x spikes end within 3x the typical norm,
    at most 5 ordinary warm steps are clipped, and warm calls read no scalar to the host."""
    per_rank = case_results(auto, case)
    first = per_rank[0]["rows"]
    assert per_rank[0]["parallelism"] == per_rank[1]["parallelism"]
    for res in per_rank:
        assert res["scalar_reads"] == 0, res["scalar_reads"]
    for step, (a, b) in enumerate(zip(first, per_rank[1]["rows"], strict=True)):
        assert len(a["coef"]) == 1, (step, a["coef"])  # one coefficient per clip
        exact = {k: v for k, v in a.items() if k not in ("post", "deepspeed_norm")}
        assert exact == {k: v for k, v in b.items() if k not in ("post", "deepspeed_norm")}, step
    norms = [float.fromhex(r["norm"]) for r in first]
    ordinary = [n for s, n in enumerate(norms) if s not in zero_auto_cases.AUTO_SPIKES]
    typical = sorted(ordinary)[len(ordinary) // 2]
    tol = AUTO_TOL[case]
    for step, row in enumerate(first):
        threshold = row["threshold"]
        assert (threshold is None) == (step < 25), step
        assert row["samples"] == step  # every step measured: one sample each
        want = norms[step] if threshold is None else min(norms[step], float.fromhex(row["limit"]))
        assert row["post"] == pytest.approx(want, rel=tol), step
        if case != "auto_s0":  # stage 0 fp32: DeepSpeed computes no norm
            assert row["deepspeed_norm"] == pytest.approx(want, rel=tol), step
    for spike in zero_auto_cases.AUTO_SPIKES:
        assert norms[spike] > 20 * typical, spike
        assert first[spike]["post"] < 3 * typical, (spike, first[spike]["post"])
        assert float.fromhex(first[spike]["coef"][0]) < 0.1, spike
    clipped = [s for s, row in enumerate(first)
               if s >= 25 and s not in zero_auto_cases.AUTO_SPIKES
               and float.fromhex(row["coef"][0]) < 1.0]
    assert len(clipped) <= 5, clipped


def test_auto_clip_through_a_deepspeed_overflow(auto: list[dict[str, Any]]) -> None:
    """An overflow step under DeepSpeed's loss scaler (step 5, after a 3-step warm-up): the
    clip returns NaN and multiplies by NaN (the gradients are not finite anyway), the history
    is left as it was, bit for bit, DeepSpeed skips that step only, and the next step clips by
    a threshold again; every figure bitwise equal on both ranks."""
    per_rank = case_results(auto, "auto_overflow")
    assert per_rank[0]["rows"] == per_rank[1]["rows"]
    rows = per_rank[0]["rows"]
    for res in per_rank:
        assert res["engine_skipped"] == 1
    assert math.isnan(float.fromhex(rows[5]["norm"]))
    assert math.isnan(float.fromhex(rows[5]["coef"][0]))
    assert rows[5]["state"] == rows[4]["state"]  # no sample
    assert rows[5]["samples"] == rows[6]["samples"] == 5
    for step in (3, 4, 6, 7):
        assert rows[step]["threshold"] is not None
        assert math.isfinite(float.fromhex(rows[step]["norm"]))
        assert 0 < float.fromhex(rows[step]["coef"][0]) <= 1.0
    assert rows[6]["state"] != rows[5]["state"]  # sampled again


def test_auto_clip_off_the_accumulation_boundary_is_refused(auto: list[dict[str, Any]]) -> None:
    """Two micro-steps per optimizer step: "auto" off the boundary raises naming it and takes
    no sample (the history counts optimizer steps); on it, it clips, on both ranks alike."""
    per_rank = case_results(auto, "auto_accumulation")
    assert per_rank[0]["samples"] == per_rank[1]["samples"]
    for res in per_rank:
        for off in res["off"]:
            assert off.startswith("GradWatchError") and "accumulation boundary" in off, off
        assert [s for s, _ in res["samples"]] == [0, 1, 2]
        assert all(math.isfinite(float.fromhex(n)) and float.fromhex(n) > 0
                   for _, n in res["samples"])


@pytest.mark.parametrize("stage", [2, 3])
def test_auto_clip_resumes_from_a_deepspeed_checkpoint(
    auto: list[dict[str, Any]], stage: int
) -> None:
    """ZeRO-2/3: ``watch.state_dict()`` saved in DeepSpeed's checkpoint (``client_state``) at a
    warm step and loaded in a new engine and watcher: every later step (a spike among them)
    has the uninterrupted run's norm, threshold, limit and applied coefficient, bit for bit, on
    both ranks; without the loaded state the threshold starts its warm-up again."""
    per_rank = case_results(auto, f"auto_resume_s{stage}")
    assert per_rank[0]["resumed"] == per_rank[1]["resumed"]
    for res in per_rank:
        assert res["resumed"] == res["whole"]
        for step, (_norm, threshold, _limit, coef) in res["resumed"].items():
            assert threshold != "inf", step
            if int(step) == zero_auto_cases.RESUME_SPIKE:
                assert float.fromhex(coef) < 0.1
        assert all(threshold == "inf" for _n, threshold, _l, _c in res["fresh"].values())
