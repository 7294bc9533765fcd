"""One decision on every rank, under faults: a rank's local pass raising, its host thread
failing to feed an all-reduce, a straggler past ``collective_timeout_seconds``, a rank closing
its watcher early, a rank dying; under DDP (default and ``always_reduce``), FSDP2 and pipeline
stages, on 2 and 4 gloo ranks. Invariants checked against a float64 reference: no published
figure off by more than 1e-6 relative, no two ranks clipping with different norms, every step
after a straggler published again, each run within 2x its fault-free time plus the injected
delay, training always completes. Workers in helpers/fault_cases.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import fault_cases as fc
import pytest
from worlds import case_results, spawn_suite, spawn_world

pytestmark = [pytest.mark.distributed]

#: Scheduling noise allowed on top of the bound (seconds).
NOISE_S = 0.5

CASES = [name for name, _ in fc.CASES if not name.endswith("/none") and name not in fc.GUARD_CASES]


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp(f"faults{request.param}")
    return spawn_suite(fc.worker, "", request.param, out, timeout=300.0)


def _unpublishable(parallelism: str, fault: str, world: int) -> set[int]:
    """The steps a fault may leave unmeasured: the faulty steps themselves (a straggler's own
    step, a failed pass, a stand-in) and, once a watcher closed, every monitoring collect."""
    steps = set(fc.FAULT_STEPS[fault])
    if fault == "close":
        steps |= {s for s in range(min(steps), fc.STEPS) if s not in fc.CLIP_STEPS}
    return steps


@pytest.mark.parametrize("name", CASES)
def test_invariants_hold_under_every_fault(world: list[dict[str, Any]], name: str) -> None:
    parallelism, fault = name.split("/")
    per_rank = case_results(world, name)
    baseline = case_results(world, f"{parallelism}/none")
    ref = {s["step"]: s["reference"] for s in per_rank[0]["steps"]}
    # Published figures: each off the float64 reference by <= 1e-6 relative.
    published = {int(k): v for k, v in per_rank[0]["published"].items()}
    for step, norm in published.items():
        assert abs(norm - ref[step]) <= 1e-6 * ref[step], (name, step, norm, ref[step])
    # Resumes: every step the fault did not touch is published (after a straggler too).
    expected = set(range(fc.STEPS)) - _unpublishable(parallelism, fault, len(world))
    missing = expected - set(published)
    assert not missing, (name, sorted(missing), per_rank[0]["internal_errors"])
    # One clip decision: every rank's clip norm equal bit for bit, exact when measured; on
    # the DDP default path (no all-reduce for a clip) too, where a rank whose pass failed
    # alone measures again with the other ranks' arithmetic.
    for step in fc.CLIP_STEPS:
        clips = [r["steps"][step]["clip"] for r in per_rank]
        assert len({repr(c) for c in clips}) == 1, (name, step, clips)
        if not math.isnan(clips[0]):
            assert abs(clips[0] - ref[step]) <= 1e-6 * ref[step], (name, step, clips, ref[step])
    # Replicas took the same optimizer steps: their parameters end equal bit for bit.
    if parallelism in ("ddp", "ddp_always"):
        digests = [r["params"] for r in per_rank]
        assert len(set(digests)) == 1, (name, digests)
    # Collection never stops on a transient fault, on any rank.
    assert all(r["broken"] is None for r in per_rank), [r["broken"] for r in per_rank]
    assert per_rank[0]["flushed"] is True
    # Bounded: within 2x the fault-free run plus the injected delay (plus NOISE_S: runs of a
    # tenth of a second on a machine shared by every rank are scheduled, not measured).
    injected = len(fc.FAULT_STEPS[fault]) * fc.STRAGGLE_S if fault == "straggler" else 0.0
    fault_free = max(r["seconds"] for r in baseline)
    for r in per_rank:
        assert r["seconds"] <= 2 * fault_free + injected + NOISE_S, (
            name, r["seconds"], fault_free)


@pytest.mark.parametrize("name", fc.GUARD_CASES)
def test_one_guard_decision_when_one_pass_fails_alone(
    world: list[dict[str, Any]], name: str
) -> None:
    """The optimizer-step guard on (non-finite and spike skips, fused AdamW), DDP. On DDP's
    default path (no gradwatch all-reduce) the last rank's local pass raises on a normal step,
    on the step with a NaN and on the 200x spike: that rank measures again and decides as the
    others. With ``always_reduce`` it raises on a normal step and on the one after the NaN
    skip: it decides from its stand-in all-reduce, as the others do (nobody skips; every
    consecutive-skip count returns to 0). Either way every rank skips both bad steps, takes
    the same decision on every step (its spike window too, bit for bit) and ends with the same
    parameters."""
    per_rank = case_results(world, name)
    for rank, r in enumerate(per_rank):
        assert None not in r["decisions"], (rank, r["decisions"])
        skipped = [s for s, changed in enumerate(r["changed"]) if not changed]
        assert skipped == [fc.GUARD_NAN_STEP, fc.GUARD_SPIKE_STEP], (rank, skipped)
    assert len({repr(r["decisions"]) for r in per_rank}) == 1, [r["decisions"] for r in per_rank]
    assert len({r["guard_state"] for r in per_rank}) == 1, [r["guard_state"] for r in per_rank]
    assert len({r["params"] for r in per_rank}) == 1, [r["params"] for r in per_rank]


@pytest.mark.parametrize("fault", ["raise", "host_thread", "straggler", "close"])
def test_each_unmeasured_step_is_counted(world: list[dict[str, Any]], fault: str) -> None:
    kinds = {"raise": "other_rank", "host_thread": "other_rank",
             "straggler": "collective_timeout", "close": "other_rank_closed"}
    for parallelism in fc.PARALLELISMS:
        res = case_results(world, f"{parallelism}/{fault}")[0]
        ref_steps = set(range(fc.STEPS))
        unmeasured = ref_steps - {int(k) for k in res["published"]}
        counted = sum(res["internal_errors"].values())
        assert counted >= len(unmeasured), (parallelism, fault, res["internal_errors"])
        if unmeasured and fault != "straggler":
            assert res["internal_errors"][kinds[fault]] >= 1, (parallelism, res)


def test_a_dead_rank_stops_collection_on_every_survivor(tmp_path: Path) -> None:
    import json

    spawn_world(fc.dying_worker, 3, (str(tmp_path),), timeout=120.0)
    survivors = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(survivors):
        assert "error" not in res, res.get("traceback")
        assert res["broken"] is not None, (rank, res)  # stopped, on every survivor alike
        assert max(res["collect_seconds"]) < 1.0  # the training thread never waited
        # No wait outlives collective_timeout_seconds: a dead peer fails the all-reduce.
        assert res["seconds"] < fc.STEPS * 0.2 + 2 * fc.DEATH_TIMEOUT_S
    assert survivors[0]["errors"], "rank 0 must say why the steps after the death are missing"


# -- the agreement cells: faults x stacks x what gradwatch does to the run -------------------


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import matrix_cases as mc

    out = tmp_path_factory.mktemp("matrix")
    return spawn_suite(mc.worker, "", 2, out, timeout=600.0)


def _same(a: str, b: float) -> bool:
    """A figure (``repr``) equal to a float64 reference within 1e-6 relative (NaN: NaN)."""
    value = float(a)
    if math.isnan(b) or math.isnan(value):
        return math.isnan(b) and math.isnan(value)
    return abs(value - b) <= 1e-6 * abs(b)


def _cells() -> list[str]:
    import matrix_cases as mc

    return ["/".join(c) for c in mc.selection()]


@pytest.mark.parametrize("cell", _cells())
def test_every_cell_agrees(matrix: list[dict[str, Any]], cell: str) -> None:
    """Each cell (see helpers/matrix_cases.py): finished within bounds (no hang: the job's own
    timeout is 60 s); the same effective decision on every rank, iteration by iteration
    (parameters stepped or not, the clip norm bit for bit); no wrong figure (every published
    norm and every clip norm the whole model's, within 1e-6 of the float64 reference, or NaN
    where it is NaN); the fault visible (endpoint, counts or log) and collection stopped only
    by a step mismatch, on every rank."""
    import matrix_cases as mc

    stack, fault, mode = cell.split("/")
    per_rank = case_results(matrix, cell)
    injected = 2 * mc.STRAGGLE_S if fault == "straggler" else 0.0
    for r in per_rank:
        assert r["seconds"] < 20.0 + injected, (cell, r["seconds"])
    # One decision: every rank stepped (or skipped) alike, clipped by the same norm.
    runs = [r["iterations"] for r in per_rank]
    assert [it["changed"] for it in runs[0]] == [it["changed"] for it in runs[1]], cell
    if "clip" in mode:
        assert [it["clip"] for it in runs[0]] == [it["clip"] for it in runs[1]], cell
        for it in runs[0]:  # measured or the bare loop's: the whole model's norm, or NaN
            assert math.isnan(float(it["clip"])) or _same(it["clip"], it["reference"]), (
                cell, it)
    guarded = "guard" in mode
    if guarded and fault != "closed":  # (a closed watcher's guard has no decision: the
        # others' see its stand-in, skip nothing; every rank steps: ``changed`` above)
        assert per_rank[0]["readings"] == per_rank[1]["readings"], cell
    if stack in ("ddp", "ddp_always") and (guarded or fault != "nan_after"):
        # (A NaN one replica alone holds after the reduction, stepped unguarded, splits the
        # replicas in the bare loop too: the guard's agreed decision is what prevents it.)
        assert per_rank[0]["params"] == per_rank[1]["params"], cell
    # No wrong figure: every published norm exact.
    # A guard that collects itself numbers its collects by optimizer steps (gradwatch's own
    # counter: the iteration), the other modes by the loop's step.
    self_numbered = mode in ("guard", "guard_scaler")
    refs = {(i if self_numbered else it["step"]): it["reference"]
            for i, it in enumerate(runs[0])}
    if fault == "nan_after":  # the last rank's NaN is the whole model's, whoever reads it
        refs[mc.FAULT_STEP] = math.nan
    published = {int(k): v for k, v in per_rank[0]["published"].items()}
    for step, snap in published.items():
        assert _same(snap["norm"], refs[step]), (cell, step, snap, refs[step])
    # Visible: each unpublished step counted; collection stops only on a step mismatch.
    measured = per_rank[0]["type"] == "GradWatch"
    missing = {s for s in refs if s not in published} if measured else set()
    errors = per_rank[0]["internal_errors"]
    stopped = [r["broken"] for r in per_rank]
    if fault == "skip_one":  # stopped at the mismatch, on every rank: counted, not collecting
        assert all(b is not None and "different steps" in b for b in stopped), (cell, stopped)
        assert errors["step_mismatch"] >= 1, (cell, errors)
        assert missing == set(range(mc.FAULT_STEP, mc.STEPS)), (cell, sorted(missing))
    else:
        assert sum(errors.values()) >= len(missing), (cell, sorted(missing), errors)
        assert stopped == [None, None], (cell, stopped)
    _fault_visible(cell, fault, per_rank, published, missing, set(refs))


def _fault_visible(cell: str, fault: str, per_rank: list[dict[str, Any]],
                   published: dict[int, Any], missing: set[int], steps: set[int]) -> None:
    import matrix_cases as mc

    errors = per_rank[0]["internal_errors"]
    at = mc.FAULT_STEP
    if fault in ("nan_before", "nan_after"):
        assert published[at]["nonfinite"] > 0, (cell, published.get(at))
    if fault == "nan_after" and cell.startswith("ddp/"):  # agreed by the guard's all-reduce
        for rank, r in enumerate(per_rank):  # the NaN step skipped on both ranks, counted
            changed = [it["changed"] for it in r["iterations"]]
            assert changed == [s != at for s in range(mc.STEPS)], (cell, rank, changed)
        assert published[at]["skipped"].get("nonfinite", 0) >= 1, (cell, published[at])
    if fault == "straggler":
        assert missing <= {at, at + 2}, (cell, missing)
        assert errors["collective_timeout"] >= len(missing), (cell, errors)
    elif fault in ("raise_retried", "skip_all"):  # nothing reached gradwatch: all measured
        assert set(published) == steps, (cell, sorted(published), sorted(steps))
    elif fault == "failed_pass":
        assert missing <= {at}, (cell, missing)
        assert any("failed on rank 1" in line for line in per_rank[1]["log"]), per_rank[1]["log"]
    elif fault == "refused":
        assert [r["type"] for r in per_rank] == ["RefusedWatch"] * 2, cell
        assert "gradwatch_collecting 0.0" in per_rank[0]["scrape"], per_rank[0]["scrape"]
    elif fault == "closed":
        assert missing <= set(range(at, mc.STEPS)), (cell, missing)
        if missing:
            assert errors["other_rank_closed"] >= 1, (cell, errors)
    elif fault == "disabled":
        assert [r["type"] for r in per_rank] == ["NoOpWatch"] * 2, cell  # by choice: silent
