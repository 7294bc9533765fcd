"""Worker side of tests/distributed/test_replicated_collects.py: collects that skip gradwatch's
all-reduce under pure DDP replication (every rank holds every parameter whole, DDP reduces them
over the whole world), and the guards that move to the steps that keep it.

Same conventions as :mod:`dist_cases` (one spawned gloo world per suite, every case collective,
results as JSON per rank; cases measure, the test module asserts). References are float64
``math.fsum`` over each rank's own gradients after DDP's reduction, computed on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import (
    CollectiveSpy,
    Tail,
    clean,
    compare,
    config,
    construct,
    fsum_sq,
    inputs,
    local_reference,
    run_suite,
)
from logs import Capture
from torch import nn


def _ddp(dtype: torch.dtype = torch.float32) -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(Tail(7, 3, dtype), find_unused_parameters=True)


def _backward(ddp: nn.Module, rank: int, step: int, dtype: torch.dtype = torch.float32,
              poison: bool = False) -> None:
    ddp.zero_grad(set_to_none=True)
    x = inputs(rank + 100 * step, 4, 7, dtype=dtype)
    if poison:
        x[0, 0] = math.nan
    ddp(x).pow(2).sum().backward()


def _collect(watch: Any, step: int) -> tuple[Any, int, float]:
    """(snapshot or the error text, c10d ops issued by collect + result, seconds)."""
    t0 = time.monotonic()
    with CollectiveSpy() as spy:
        pending = watch.collect(step)
        try:
            snap: Any = pending.result()
        except Exception as exc:
            snap = f"{type(exc).__name__}: {exc}"
    return snap, spy.collectives, time.monotonic() - t0


def case_alone(dtype: torch.dtype) -> Callable[[int, int], dict]:
    """Six collects, divergence every 3rd: collects 0 and 3 all-reduce, the others none; every
    rank's snapshot (not only rank 0's) equals the float64 reference of the reduced gradients."""

    def run(rank: int, world: int) -> dict:
        ddp = _ddp(dtype)
        watch, _ = construct(ddp, config(divergence_every=3))
        out: dict[str, Any] = {"collectives": [], "max_rel_err": [], "mismatches": [],
                               "global_norm": [], "divergence": [],
                               "synced": watch._resolved.layout.replicated_synced}
        for step in range(6):
            _backward(ddp, rank, step, dtype)
            ref = local_reference(ddp, clean)
            snap, ops, _ = _collect(watch, step)
            found = compare(snap, ref, watch)
            out["collectives"].append(ops)
            out["max_rel_err"].append(found["max_rel_err"])
            out["mismatches"] += found["mismatches"]
            out["global_norm"].append(snap.global_norm)
            out["divergence"].append(snap.replica_divergence)
        watch.close()
        return out

    return run


def case_clip(rank: int, world: int) -> dict:
    """``clip_grad_norm_`` without the all-reduce: the whole model's norm on every rank, the
    same on every rank bit for bit, gradients clipped like torch's function on one replica."""
    ddp = _ddp()
    watch, _ = construct(ddp, config(divergence_every=0))
    _backward(ddp, rank, 0)
    params = [p for p in ddp.parameters() if p.grad is not None]
    expected = [p.grad.detach().clone() for p in params]
    exact = math.sqrt(math.fsum(fsum_sq(g) for g in expected))
    coef = min(1.0, 0.1 / (exact + 1e-6))  # torch's clip_grad_norm_ formula
    with CollectiveSpy() as spy:
        total = watch.clip_grad_norm_(0.1, step=0)
    totals: list[Any] = [None] * world
    dist.all_gather_object(totals, float(total))
    errs = [
        float((p.grad.double() - g.double() * coef).abs().max()
               / g.double().abs().max().clamp_min(1e-300))
        for p, g in zip(params, expected, strict=True)
    ]
    snap = watch.last
    watch.close()
    return {"collectives": spy.collectives, "total": float(total), "exact": exact,
            "totals": totals, "max_grad_rel_err": max(errs),
            "clip_coef": snap.clip_coef if snap is not None else None, "coef": coef}


def case_always_reduce(rank: int, world: int) -> dict:
    ddp = _ddp()
    watch, _ = construct(ddp, config(divergence_every=0, always_reduce=True))
    out: dict[str, Any] = {"collectives": [], "synced": watch._resolved.layout.replicated_synced}
    for step in range(2):
        _backward(ddp, rank, step)
        _snap, ops, _ = _collect(watch, step)
        out["collectives"].append(ops)
    watch.close()
    return out


def case_nan_one_rank(rank: int, world: int) -> dict:
    """A NaN in the last rank's batch: DDP's all-reduce spreads it to every rank's gradients,
    so every rank's own statistics (no all-reduce) report it."""
    ddp = _ddp()
    watch, _ = construct(ddp, config(divergence_every=0))
    _backward(ddp, rank, 0, poison=rank == world - 1)
    snap, ops, _ = _collect(watch, 0)
    watch.close()
    return {"collectives": ops, "is_finite": snap.is_finite,
            "nonfinite_params": list(snap.nonfinite_params)}


def case_step_mismatch(rank: int, world: int) -> dict:
    """Ranks that collect different steps: not seen by a collect without the all-reduce, logged
    at the next divergence step (divergence every 2nd collect)."""
    with Capture() as records:
        ddp = _ddp()
        watch, _ = construct(ddp, config(divergence_every=2))
        logged = []
        collectives = []
        for k, step in enumerate((0, 1, 2)):
            _backward(ddp, rank, k)
            mine = step if k == 0 or rank == 0 else step + 10  # collects 1 and 2 disagree
            _snap, ops, _ = _collect(watch, mine)
            collectives.append(ops)
            logged.append(any("different steps" in m for m in records.lines))
        watch.close()
    return {"collectives": collectives, "logged": logged}


def case_failing_rank(rank: int, world: int) -> dict:
    """The last rank's local pass fails on a collect without the all-reduce: it issues no
    stand-in, its own result says the step was not measured, the others publish their own
    exact measurement at once; the next divergence step all-reduces on every rank, aligned."""
    ddp = _ddp()
    watch, _ = construct(ddp, config(divergence_every=2, collective_timeout_seconds=10))
    out: dict[str, Any] = {"collectives": [], "results": [], "seconds": [], "max_rel_err": []}
    engine = watch._collector.engine
    original = engine.squared_norms_and_plan
    for step in range(3):
        _backward(ddp, rank, step)
        if step == 1 and rank == world - 1:

            def boom(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("simulated failure inside collect")

            engine.squared_norms_and_plan = boom  # type: ignore[method-assign]
        ref = local_reference(ddp, clean)
        snap, ops, seconds = _collect(watch, step)
        engine.squared_norms_and_plan = original  # type: ignore[method-assign]
        out["collectives"].append(ops)
        out["seconds"].append(seconds)
        out["results"].append(snap if isinstance(snap, str) else "measured")
        out["max_rel_err"].append(
            None if isinstance(snap, str) else compare(snap, ref, watch)["max_rel_err"])
    out["broken"] = watch._collector.broken
    watch.close()
    return out


def case_rank_stops(rank: int, world: int) -> dict:
    """The last rank stops collecting after the first collect (alive, still training): the
    others' collects without the all-reduce have nothing to wait for."""
    ddp = _ddp()
    watch, _ = construct(ddp, config(divergence_every=100, collective_timeout_seconds=10))
    out: dict[str, Any] = {"results": [], "seconds": []}
    for step in range(4):
        _backward(ddp, rank, step)
        if step and rank == world - 1:
            continue
        snap, _ops, seconds = _collect(watch, step)
        out["results"].append(snap if isinstance(snap, str) else "measured")
        out["seconds"].append(seconds)
    dist.barrier()
    watch.close()
    return out


class _Ignored(Tail):
    """DDP does not reduce ``body.0.bias`` (``_ddp_params_and_buffers_to_ignore``)."""

    _ddp_params_and_buffers_to_ignore = ("body.0.bias",)


def case_not_pure(kind: str) -> Callable[[int, int], dict]:
    """Jobs where some rank's gradients are not the reduced ones: one all-reduce per collect.
    ``ignored``: a parameter DDP ignores; ``no_ddp``: plain replicas; ``hooked``: a comm hook
    registered before GradWatch (a hook may skip the all-reduce); ``subgroup``: DDP over half
    the world (two DDP groups)."""

    def run(rank: int, world: int) -> dict:
        torch.manual_seed(0)
        if kind == "ignored":
            model: nn.Module = nn.parallel.DistributedDataParallel(
                _Ignored(7, 3), find_unused_parameters=True)
        elif kind == "no_ddp":
            model = Tail(7, 3)
        elif kind == "hooked":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                allreduce_hook,
            )

            model = nn.parallel.DistributedDataParallel(Tail(7, 3), find_unused_parameters=True)
            model.register_comm_hook(None, allreduce_hook)
        else:
            halves = [dist.new_group(list(range(h, h + world // 2)))
                      for h in (0, world // 2)]
            model = nn.parallel.DistributedDataParallel(
                Tail(7, 3), process_group=halves[rank // (world // 2)],
                find_unused_parameters=kind == "subgroup")
        watch, _ = construct(model, config(divergence_every=0))
        _backward(model, rank, 0)
        _snap, ops, _ = _collect(watch, 0)
        synced = watch._resolved.layout.replicated_synced
        watch.close()
        return {"collectives": ops, "synced": synced}

    return run


SUITES: dict[str, list[tuple[str, Callable[[int, int], dict]]]] = {
    "w2": [
        ("alone_fp32", case_alone(torch.float32)),
        ("alone_fp64", case_alone(torch.float64)),
        ("clip", case_clip),
        ("always_reduce", case_always_reduce),
        ("nan_one_rank", case_nan_one_rank),
        ("step_mismatch", case_step_mismatch),
        ("failing_rank", case_failing_rank),
        ("not_pure_ignored", case_not_pure("ignored")),
        ("not_pure_no_ddp", case_not_pure("no_ddp")),
        ("not_pure_hooked", case_not_pure("hooked")),
        ("rank_stops", case_rank_stops),
    ],
    "w4": [
        ("alone_fp32", case_alone(torch.float32)),
        ("clip", case_clip),
        ("nan_one_rank", case_nan_one_rank),
        ("not_pure_subgroup", case_not_pure("subgroup")),
    ],
}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite])
