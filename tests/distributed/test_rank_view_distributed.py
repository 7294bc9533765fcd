"""Multi-process gloo tests of the per-rank view (DDP comm hook): each rank's pre-reduction
norms against a float64 reference, the origin of a NaN, the outlier replica, the gradient noise
scale against its true value, the bad inputs. Workers in rankview_cases.py; one 2-rank and one
4-rank world, each spawned once and killed after WORLD_TIMEOUT seconds.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import rankview_cases
from worlds import case_results, spawn_suite

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 200.0
FP32_TOL = 1e-6
FP64_TOL = 1e-12
WRAPPER = "gradwatch.ddp_comm_hook(watch, inner=your_hook)"


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(rankview_cases.worker, "w2", 2, tmp_path_factory.mktemp("rv2"),
                       WORLD_TIMEOUT)


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(rankview_cases.worker, "w4", 4, tmp_path_factory.mktemp("rv4"),
                       WORLD_TIMEOUT)


def _case(world: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return case_results(world, name, "error_in_case")


def _metric(res: dict[str, Any], name: str) -> dict[tuple[str, ...], float]:
    return {tuple(labels): value for labels, value in res["metrics"].get(name, [])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "tol"), [("exact_fp32", FP32_TOL), ("exact_fp64_bucket_view_static", FP64_TOL)]
)
def test_local_norms_equal_the_float64_reference(w4: list, case: str, tol: float) -> None:
    """no_sync() accumulation, gradient_as_bucket_view and static_graph: each rank's local
    group norms (before the reduction) match its own accumulated gradient; still one float64
    all-reduce per collect."""
    for res in _case(w4, case):
        for step in res["steps"]:
            # float32 on CPU: the row path over the bucket buffer; float64: foreach norms
            assert step["row_path"] and all(step["row_path"]) == (case == "exact_fp32")
            assert step["rank_view"] is True
            assert step["max_rel_err"] <= tol, step
            assert step["avg_err"] <= tol, step  # the hook reduced as DDP would (the average)
            assert step["collectives"] == 1 and step["ops"] == ["c10d.allreduce_"]


@pytest.mark.timeout(300)
def test_nan_on_one_rank_is_named_as_the_origin(w4: list) -> None:
    per_rank = _case(w4, "nan_origin")
    r0 = per_rank[0]
    bad = len(per_rank) - 2
    view = r0["view"]
    assert view["nonfinite_params"]  # after the reduction every rank sees NaN...
    assert view["nonfinite_origin_ranks"] == [bad]  # ...which started on one rank only
    assert view["nonfinite_origin_count"] == 1
    assert view["nonfinite_origin_hosts"] == [per_rank[bad]["host"]]
    assert set(view["nonfinite_origin_groups"]) == {"weights", "biases", "other"}
    assert any(f"rank(s) {bad} " in line and "before the reduction" in line for line in r0["logs"])
    assert _metric(r0, "gradwatch_nonfinite_origin_ranks") == {(): 1.0}
    assert _metric(r0, "gradwatch_last_nonfinite_origin") == {
        (str(bad), per_rank[bad]["host"]): 0.0
    }
    assert view["replica_grad_norm_max_rank"] == bad
    assert view["replica_outlier_score"] == math.inf


@pytest.mark.timeout(300)
def test_rank_fed_a_scaled_batch_is_the_outlier(w4: list) -> None:
    r0 = _case(w4, "outlier")[0]
    last = len(_case(w4, "outlier")) - 1
    for view in r0["steps"]:
        assert view["nonfinite_origin_ranks"] == [] and view["nonfinite_origin_count"] == 0
        assert view["replica_grad_norm_max_rank"] == last
        assert view["replica_outlier_rank"] == last
        assert view["replica_outlier_score"] > 5  # 20x the batch: far from the median
        lo, mid, hi = (view[f"replica_grad_norm_{s}"] for s in ("min", "median", "max"))
        assert 0 < lo <= mid < hi
    metrics = _metric(r0, "gradwatch_replica_grad_norm")
    assert set(metrics) == {("min",), ("median",), ("max",)}
    assert _metric(r0, "gradwatch_replica_grad_norm_max_rank") == {(): float(last)}
    assert _metric(r0, "gradwatch_nonfinite_origin_ranks") == {(): 0.0}


@pytest.mark.timeout(300)
def test_pipeline_replica_sums_its_stages(w4: list) -> None:
    per_rank = _case(w4, "pipeline_view")
    r0 = per_rank[0]
    groups = r0["replica_groups"]
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    scaled = next(g for g in groups if per_rank[g[0]]["coords"][1] == 1)
    assert r0["outlier"]["replica_grad_norm_max_rank"] == min(scaled)
    nan_rank = next(r for r, res in enumerate(per_rank) if res["coords"] == [1, 0])
    assert r0["nan"]["nonfinite_origin_ranks"] == [nan_rank]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", ["w2", "w4"])
def test_noise_scale_within_ten_percent(world: str, request: pytest.FixtureRequest) -> None:
    r0 = _case(request.getfixturevalue(world), "noise_scale")[0]
    true = r0["true"]
    for value in r0["trace"]:  # the last 50 steps, once the window filled
        assert abs(value - true) <= 0.1 * true, (value, true)
    assert abs(r0["group"]["w"] - true) <= 0.1 * true


@pytest.mark.timeout(300)
def test_user_hook_after_gradwatch_names_the_wrapper_which_composes(w2: list) -> None:
    for res in _case(w2, "user_hook_after"):
        assert res["error"].startswith("GradWatchError: gradwatch:") and WRAPPER in res["error"]
        assert "my_hook" in res["error"]
        assert WRAPPER in res["builtin_error"]
        assert res["calls"] >= 1  # the user's hook ran inside gradwatch's
        assert res["rank_view"] is True
        assert res["avg_err"] < 1e-6  # DDP's average is unchanged


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["user_hook_before", "builtin_hook_before"])
def test_user_hook_before_gradwatch_warns_and_the_view_is_absent(w2: list, case: str) -> None:
    for rank, res in enumerate(_case(w2, case)):
        assert res["rank_view"] is False
        assert res["metrics"] == {}  # absent, not zero
        assert math.isfinite(res["global_norm"])
        if rank == 0:
            assert any(WRAPPER in line for line in res["logs"])


@pytest.mark.timeout(300)
def test_second_gradwatch_on_one_ddp_module_is_refused(w2: list) -> None:
    for res in _case(w2, "second_watch"):
        assert res["error"].startswith("GradWatchError: gradwatch:")
        assert "gradwatch.ddp_comm_hook" in res["error"] and "close()" in res["error"]
        assert res["rank_view_after_close"] is True


@pytest.mark.timeout(300)
def test_ranks_disagreeing_on_rank_view_fail_the_handshake(w2: list) -> None:
    per_rank = _case(w2, "rank_view_mismatch")
    for res in per_rank:
        assert res["error_type"] == "LayoutMismatchError"
        assert "configuration" in res["message"]
        assert res["seconds"] < 10
    assert len({r["message"] for r in per_rank}) == 1


@pytest.mark.timeout(300)
def test_fsdp2_has_no_rank_view_and_no_metrics(w2: list) -> None:
    for res in _case(w2, "fsdp2_absent"):
        assert res["parallelism"] == "fsdp2x2"
        assert res["rank_view"] is False
        assert res["metrics"] == {}
