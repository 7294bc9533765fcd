"""Worker side of tests/distributed/test_rank_view_distributed.py: the per-rank view (DDP comm
hook) in spawned gloo worlds. Every case is collective (all ranks run it; a barrier separates
cases); each rank writes ``{case: result}`` to ``<out>/<rank>.json``. Assertions live in the test
module; cases measure.

References are independent of gradwatch: each rank's *local* gradient is recomputed on a plain
(non-DDP) copy of the module with the same weights and batch, its squares summed per group with
``math.fsum`` over Python floats, and gathered to every rank (``all_gather_object``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import CollectiveSpy, Stage, fsum_sq, run_suite
from dist_cases import config as dist_config
from logs import Capture
from torch import nn

GROUPS = ("weights", "biases", "other")


def config(**overrides: Any) -> Any:
    """The distributed tests' config with the per-rank view on (it is opt-in)."""
    overrides.setdefault("rank_view", True)
    return dist_config(**overrides)


def capture_reduced(watch: Any) -> list[Any]:
    """Record every ReducedVector the watch's reducer returns (test-only access)."""
    seen: list[Any] = []
    original = watch._reducer.pack_and_reduce

    def spy(*args: Any, **kwargs: Any) -> Any:
        reduced = original(*args, **kwargs)
        seen.append(reduced)
        return reduced

    watch._reducer.pack_and_reduce = spy
    return seen


class Net(nn.Module):
    """Wide enough (20K elements) that a float32 bucket takes the hook's row path; groups
    alternate (weights, biases, other), so rows straddle groups too."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(6, 2000, dtype=dtype)
        self.b = nn.Linear(2000, 3, dtype=dtype)
        self.scale = nn.Parameter(torch.ones(3, dtype=dtype))  # group "other"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) * self.scale


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32, scale: float = 1.0):
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randn(5, 6, generator=g, dtype=dtype) * scale


def group_reference(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """This rank's local (pre-reduction, accumulated) squared norm per group, in float64 from
    a plain copy of ``model`` (no DDP, no gradwatch)."""
    from gradwatch.norms.model import group_of

    plain = type(model)(next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    for x in batches:
        plain(x).pow(2).sum().backward()
    cfg = config()
    out = dict.fromkeys(GROUPS, 0.0)
    parts: dict[str, list[float]] = {g: [] for g in GROUPS}
    for name, p in plain.named_parameters():
        parts[group_of(name, cfg.groups)].append(fsum_sq(p.grad))
    for g in GROUPS:
        out[g] = math.fsum(parts[g])
    return [out[g] for g in GROUPS]


def average_error(model: nn.Module, batches: list[torch.Tensor]) -> float:
    """Largest error of ``model``'s reduced gradients (after a DDP backward) against the
    float64 mean over ranks of each rank's local gradients (a plain copy, same batches),
    relative to the largest reference element: the hook reduced as DDP would."""
    plain = type(model)(next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    for x in batches:
        plain(x).pow(2).sum().backward()
    local = torch.cat([p.grad.double().flatten() for p in plain.parameters()])
    mean = torch.tensor(gather(local.tolist()), dtype=torch.float64).mean(0)
    got = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    return float((got - mean).abs().max() / mean.abs().max())


def gather(obj: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def view_fields(snap: Any) -> dict[str, Any]:
    d = snap.to_dict()
    keys = (
        "rank_view", "nonfinite_origin_ranks", "nonfinite_origin_count", "nonfinite_origin_hosts",
        "nonfinite_origin_groups", "replica_grad_norm_min", "replica_grad_norm_median",
        "replica_grad_norm_max", "replica_grad_norm_max_rank", "replica_outlier_score",
        "replica_outlier_rank", "gradient_noise_scale", "group_noise_scale", "nonfinite_params",
    )  # fmt: skip
    return {k: d[k] for k in keys}


def metric_samples(snap: Any) -> dict[str, Any]:
    """What the endpoint would show for ``snap`` (the exporter's own state functions)."""
    from gradwatch.export.state import Counts, snapshot_samples

    out = {**snapshot_samples(snap, {}, 0), **Counts().after(snap).samples()}
    view = {"gradwatch_nonfinite_origin_ranks", "gradwatch_replica_grad_norm",
            "gradwatch_replica_grad_norm_max_rank", "gradwatch_replica_outlier_score",
            "gradwatch_gradient_noise_scale", "gradwatch_group_gradient_noise_scale",
            "gradwatch_last_nonfinite_origin"}  # fmt: skip
    return {d.name: [[list(labels), value] for labels, value in vals] for d, vals in out.items()
            if d.name in view and vals}  # fmt: skip


# -- scenarios --------------------------------------------------------------------------------


def case_exact(dtype: torch.dtype, **ddp_kwargs: Any) -> Callable[[int, int], dict]:
    """Local norms vs the float64 reference, with a micro-batch accumulated under ``no_sync()``
    on the second step (the local gradient is the accumulated one), one collective per
    collect."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        torch.manual_seed(0)
        model = Net(dtype)
        ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        watch = GradWatch(ddp, config())
        seen = capture_reduced(watch)
        results = []
        for step in range(2):
            # Step 0 is one plain backward (static_graph needs a synchronized first iteration
            # before no_sync(), a DDP rule); step 1 accumulates a micro-batch under no_sync().
            micro = [batch(rank, 100 + step, dtype)] if step == 0 else [
                batch(rank, step, dtype), batch(rank, 100 + step, dtype)]  # fmt: skip
            ref = group_reference(model, micro)
            ddp.zero_grad()
            if len(micro) == 2:
                with ddp.no_sync():
                    ddp(micro[0]).pow(2).sum().backward()
            ddp(micro[-1]).pow(2).sum().backward()
            avg_err = average_error(model, micro)
            plans = watch._resolved.local_view._plans.values()
            with CollectiveSpy() as spy:
                pending = watch.collect(step)
            snap = pending.result()
            per_rank = seen[-1].stats().rank_view.per_rank
            refs = gather(ref)
            errs = [
                abs(got - want) / max(abs(want), 1e-300)
                for got_row, want_row in zip(per_rank, refs, strict=True)
                for got, want in zip(got_row, want_row, strict=True)
            ]
            results.append({"max_rel_err": max(errs), "collectives": spy.collectives,
                            "ops": sorted(k for k in spy.ops if k.startswith("c10d")),
                            "rank_view": snap.rank_view, "avg_err": avg_err,
                            "row_path": [p.rows is not None for p in plans]})  # fmt: skip
        watch.close()
        return {"steps": results}

    return run


def case_nan_origin(rank: int, world: int) -> dict:
    from gradwatch import GradWatch

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    watch = GradWatch(ddp, config())
    x = batch(rank, 0)
    if rank == world - 2:
        x[0, 0] = math.nan  # NaN enters through "a" (and so every group downstream)
    ddp(x).pow(2).sum().backward()
    with Capture() as logs:
        snap = watch.collect(0).result()
    out = {"view": view_fields(snap), "logs": logs.lines, "metrics": metric_samples(snap),
           "host": os.uname().nodename}  # fmt: skip
    watch.close()
    return out


def case_outlier(rank: int, world: int) -> dict:
    from gradwatch import GradWatch

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 3)))  # linear in x
    watch = GradWatch(ddp, config())
    scores = []
    for step in range(3):
        ddp.zero_grad()
        ddp(batch(rank, step, scale=20.0 if rank == world - 1 else 1.0)).pow(2).sum().backward()
        snap = watch.collect(step).result()
        scores.append(view_fields(snap))
    out = {"steps": scores, "metrics": metric_samples(snap)}
    watch.close()
    return out


def case_pipeline_view(rank: int, world: int) -> dict:
    """Two pipeline stages x two DDP replicas: a replica's local norm sums its stages; the
    replica fed a scaled batch is the outlier (named by its lowest rank), then a NaN on one
    stage rank of the other replica is its origin."""
    from torch.distributed.device_mesh import init_device_mesh

    from gradwatch import GradWatch

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    k, replica = mesh.get_coordinate()
    torch.manual_seed(k)
    model = nn.parallel.DistributedDataParallel(Stage(k, 4 + k, 3), process_group=dp_group,
                                                find_unused_parameters=True)  # fmt: skip
    watch = GradWatch(model, config(), process_group=dp_group, stage_group=stage_group)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 4 + k, generator=g) * (10.0 if replica == 1 else 1.0)
    model(x).pow(2).sum().backward()
    outlier = view_fields(watch.collect(0).result())
    model.zero_grad()
    x = torch.randn(3, 4 + k, generator=g)
    if (k, replica) == (1, 0):
        x[0, 0] = math.nan
    model(x).pow(2).sum().backward()
    nan = view_fields(watch.collect(1).result())
    out = {"outlier": outlier, "nan": nan, "coords": [k, replica],
           "replica_groups": [list(r) for r in watch._resolved.layout.replica_groups]}  # fmt: skip
    watch.close()
    return out


class Gaussian(nn.Module):
    """loss = mean_i (w . x_i): the per-sample gradient is x_i ~ N(mu, sigma^2 I_d), so the
    true |G|^2 = |mu|^2, tr(Sigma) = d sigma^2 and B_simple = d sigma^2 / |mu|^2."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(d, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).mean()


NOISE_D, NOISE_MU, NOISE_SIGMA, NOISE_B, NOISE_STEPS = 4000, 0.25, 1.0, 8, 200
TRUE_B_SIMPLE = NOISE_D * NOISE_SIGMA**2 / (NOISE_D * NOISE_MU**2)  # = 16 samples


def case_noise_scale(rank: int, world: int) -> dict:
    from gradwatch import GradWatch

    ddp = nn.parallel.DistributedDataParallel(Gaussian(NOISE_D))
    watch = GradWatch(ddp, config(groups={"w": ["w"]}, ratios=[], batch_size=NOISE_B))
    g = torch.Generator().manual_seed(rank)
    trace = []
    for step in range(NOISE_STEPS):
        ddp.zero_grad()
        x = NOISE_MU + NOISE_SIGMA * torch.randn(NOISE_B, NOISE_D, generator=g, dtype=torch.float64)
        ddp(x).backward()
        snap = watch.collect(step).result()
        trace.append(snap.gradient_noise_scale)
    out = {"trace": trace[-50:], "group": dict(snap.group_noise_scale), "true": TRUE_B_SIMPLE}
    watch.close()
    return out


def case_user_hook_after(rank: int, world: int) -> dict:
    """A user hook registered after gradwatch's: a clear error naming the wrapper; the wrapper
    itself composes (the user hook runs, the view still measures)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import gradwatch
    from gradwatch import GradWatch

    calls = []

    def my_hook(state: Any, bucket: Any):  # type: ignore[no-untyped-def]
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    watch = GradWatch(ddp, config())
    try:
        ddp.register_comm_hook(None, my_hook)
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    try:
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        builtin_error = None
    except Exception as exc:
        builtin_error = f"{type(exc).__name__}: {exc}"
    ddp.register_comm_hook(None, gradwatch.ddp_comm_hook(watch, inner=my_hook))
    ddp(batch(rank, 0)).pow(2).sum().backward()
    snap = watch.collect(0).result()
    # DDP's result with the composed hook equals the plain average.
    torch.manual_seed(0)
    plain = Net()
    grads = []
    for r in range(world):
        plain.zero_grad()
        plain(batch(r, 0)).pow(2).sum().backward()
        grads.append(plain.a.weight.grad.clone())
    expected = torch.stack(grads).mean(0)
    out = {"error": error, "builtin_error": builtin_error, "calls": len(calls),
           "rank_view": snap.rank_view, "max_rank": snap.replica_grad_norm_max_rank,
           "avg_err": float((ddp.module.a.weight.grad - expected).abs().max())}  # fmt: skip
    watch.close()
    return out


def case_user_hook_before(rank: int, world: int) -> dict:
    """A user hook registered before GradWatch: a warning naming the wrapper, no view (the
    metrics are absent), collection otherwise unchanged."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from gradwatch import GradWatch

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    ddp.register_comm_hook(None, allreduce_hook)
    with Capture() as logs:
        watch = GradWatch(ddp, config())
    ddp(batch(rank, 0)).pow(2).sum().backward()
    snap = watch.collect(0).result()
    out = {"logs": logs.lines, "rank_view": snap.rank_view, "metrics": metric_samples(snap),
           "global_norm": snap.global_norm}  # fmt: skip
    watch.close()
    return out


def case_builtin_hook_before(rank: int, world: int) -> dict:
    """A built-in hook (C++, not listed by DDP) registered before GradWatch: a warning naming
    the wrapper and no view, never a construction error."""
    from gradwatch import GradWatch

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    with Capture() as logs:
        watch = GradWatch(ddp, config())
    ddp(batch(rank, 0)).pow(2).sum().backward()
    snap = watch.collect(0).result()
    watch.close()
    return {"logs": logs.lines, "rank_view": snap.rank_view, "metrics": metric_samples(snap),
            "global_norm": snap.global_norm}  # fmt: skip


def case_second_watch(rank: int, world: int) -> dict:
    """A second live GradWatch on the same DDP module is refused naming the wrapper; after the
    first one closes, a new one measures again through the same registered hook."""
    from gradwatch import GradWatch

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net())
    first = GradWatch(ddp, config())
    try:
        GradWatch(ddp, config())
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    first.close()
    again = GradWatch(ddp, config())
    ddp(batch(rank, 0)).pow(2).sum().backward()
    snap = again.collect(0).result()
    again.close()
    return {"error": error, "rank_view_after_close": snap.rank_view}


def case_rank_view_mismatch(rank: int, world: int) -> dict:
    from dist_cases import expect_error

    from gradwatch import GradWatch

    ddp = nn.parallel.DistributedDataParallel(Net())
    return expect_error(lambda: GradWatch(ddp, config(rank_view=rank == 0)))


def case_fsdp2_absent(rank: int, world: int) -> dict:
    """FSDP2 has no pre-reduce-scatter hook gradwatch uses: the view and its metrics are
    absent (not zero)."""
    from torch.distributed.fsdp import fully_shard

    from gradwatch import GradWatch

    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    watch = GradWatch(model, config())
    model(batch(rank, 0)).pow(2).sum().backward()
    snap = watch.collect(0).result()
    out = {"rank_view": snap.rank_view, "metrics": metric_samples(snap),
           "parallelism": snap.parallelism}  # fmt: skip
    watch.close()
    return out


SUITES: dict[str, list[tuple[str, Callable[[int, int], dict]]]] = {
    "w2": [
        ("noise_scale", case_noise_scale),
        ("user_hook_after", case_user_hook_after),
        ("user_hook_before", case_user_hook_before),
        ("builtin_hook_before", case_builtin_hook_before),
        ("second_watch", case_second_watch),
        ("rank_view_mismatch", case_rank_view_mismatch),
        ("fsdp2_absent", case_fsdp2_absent),
    ],
    "w4": [
        ("exact_fp32", case_exact(torch.float32)),
        ("exact_fp64_bucket_view_static", case_exact(
            torch.float64, gradient_as_bucket_view=True, static_graph=True)),
        ("nan_origin", case_nan_origin),
        ("outlier", case_outlier),
        ("pipeline_view", case_pipeline_view),
        ("noise_scale", case_noise_scale),
    ],
}  # fmt: skip


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    # An unexpected exception goes under "error_in_case": "error" is what some cases expect.
    run_suite(rank, world, port, out, SUITES[suite], error_key="error_in_case")
