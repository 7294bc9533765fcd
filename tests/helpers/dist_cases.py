"""Worker side of tests/distributed/test_distributed.py: every case runs inside one spawned
gloo world.

A *suite* is a list of cases run in order by every rank of one world (startup dominates on
2 cores, so each world runs many cases). Every case is collective: all ranks run it, and a
barrier on the default group separates cases. Each rank writes ``{case: result}`` to
``<out>/<rank>.json``; a case that raised records ``{"error": ...}``. Assertions about numbers
live in the test module; cases measure.

The reference of every figure is computed from the full unsharded gradients: ``full_tensor()``
of DTensor gradients (here only, never in gradwatch) or the plain gradient of each stage, as
Python floats squared and summed with ``math.fsum``, then fed through the same host summary
(:func:`gradwatch.analysis.summary.summarize`); the global norm and each parameter norm are also
compared with a direct ``sqrt(fsum(...))``.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# -- instrumentation --------------------------------------------------------------------------


class CollectiveSpy(TorchDispatchMode):
    """Counts c10d ops (like conftest.OpCounter), their tensor dtypes, and DTensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.collective_dtypes: list[str] = []
        self.dtensor_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        self.ops[name] += 1
        leaves = tree_leaves((args, kwargs or {}))
        if name.startswith("c10d"):
            self.collective_dtypes += [str(t.dtype) for t in leaves if isinstance(t, torch.Tensor)]
        if any(type(t).__name__ == "DTensor" for t in leaves):
            self.dtensor_ops += 1
        return func(*args, **(kwargs or {}))

    @property
    def collectives(self) -> int:
        return sum(n for name, n in self.ops.items() if name.startswith("c10d"))


# -- references -------------------------------------------------------------------------------


def fsum_sq(t: torch.Tensor) -> float:
    return math.fsum(x * x for x in t.detach().double().flatten().tolist())


def local_reference(model: nn.Module, clean: Callable[[str], str]) -> dict[str, float | None]:
    """name -> exact squared norm of the full gradient (None: no gradient). Collective for
    DTensor gradients (``full_tensor``): every rank calls it in the same parameter order."""
    out: dict[str, float | None] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None or not p.requires_grad:
            out[clean(name)] = None
            continue
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[clean(name)] = fsum_sq(g)
    return out


def stage_reference(model: nn.Module, clean: Callable[[str], str]) -> dict[str, float | None]:
    """Pipeline: every stage's reference, gathered to every rank (float64 Python floats)."""
    mine = local_reference(model, clean)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[str, float | None] = {}
    for part in everyone:
        for name, sq in part.items():
            if merged.get(name) is None:
                merged[name] = sq
    return merged


def compare(snap: Any, ref_sq: dict[str, float | None], watch: Any) -> dict[str, Any]:
    """Max relative error of every float figure of ``snap`` against the reference; integer
    figures and key sets must match exactly (mismatches are listed)."""
    from gradwatch.analysis.summary import summarize

    lay = watch._resolved.layout
    names = list(lay.names)
    assert set(names) == set(ref_sq), (sorted(names), sorted(ref_sq))
    squares = [ref_sq[n] or 0.0 for n in names]
    has = [0.0 if ref_sq[n] is None else 1.0 for n in names]
    ref = summarize(
        step=snap.step,
        cfg=watch.config,
        names=names,
        groups_of=watch._resolved.groups_of,
        numels=lay.numels,
        squares=squares,
        nonfinite_flags=[0.0] * len(names),
        has_grad=has,
        group_order=watch._resolved.group_order,
    )
    errs: list[float] = []
    mismatches: list[str] = []

    def rel(a: float, b: float, what: str) -> None:
        if a == b:
            errs.append(0.0)
            return
        if not (math.isfinite(a) and math.isfinite(b)):
            mismatches.append(f"{what}: {a} != {b}")
            return
        errs.append(abs(a - b) / max(abs(b), 1e-300))

    direct = math.sqrt(math.fsum(s for s in squares))
    rel(snap.global_norm, direct, "global_norm (direct)")
    rel(snap.global_norm, ref.global_norm, "global_norm")
    rel(snap.health, ref.health, "health")
    if set(snap.param_norms) != set(ref.param_norms):
        mismatches.append(f"param_norms {sorted(snap.param_norms)} != {sorted(ref.param_norms)}")
    for name, norm in ref.param_norms.items():
        rel(snap.param_norms.get(name, math.nan), norm, f"param {name}")
        rel(snap.param_norms.get(name, math.nan), math.sqrt(ref_sq[name] or 0.0), f"param {name}")
    if set(snap.groups) != set(ref.groups):
        mismatches.append(f"groups {sorted(snap.groups)} != {sorted(ref.groups)}")
    for group, stats in ref.groups.items():
        got = snap.groups.get(group)
        if got is None:
            continue
        rel(got.norm, stats.norm, f"group {group}")
        for field in ("numel", "tensors", "vanishing", "exploding", "nonfinite"):
            if getattr(got, field) != getattr(stats, field):
                mismatches.append(f"group {group}.{field}: {getattr(got, field)} != "
                                  f"{getattr(stats, field)}")
    for key, value in ref.ratios.items():
        rel(snap.ratios[key], value, f"ratio {key}")
    for key, value in ref.raw_ratios.items():
        rel(snap.raw_ratios[key], value, f"raw ratio {key}")
    if dict(snap.isolation_violated) != dict(ref.isolation_violated):
        mismatches.append(f"isolation {dict(snap.isolation_violated)}")
    if snap.nonfinite_params:
        mismatches.append(f"nonfinite {snap.nonfinite_params}")
    return {
        "max_rel_err": max(errs, default=0.0),
        "mismatches": mismatches,
        "global_norm": snap.global_norm,
        "ref_global_norm": direct,
        "n_params": len(names),
        "n_with_grad": int(sum(has)),
        "world_size": snap.world_size,
        "parallelism": snap.parallelism,
        "replica_divergence": snap.replica_divergence,
    }


def config(**overrides: Any) -> Any:
    from gradwatch import WatchConfig

    base: dict[str, Any] = {
        "groups": {"weights": ["*weight"], "biases": ["*bias"]},
        "ratios": [("biases", "weights")],
        "collective_timeout_seconds": 30,
        "divergence_every": 1,
        "exploding_threshold": 1e30,
    }
    base.update(overrides)
    return WatchConfig(**base)


def measure(watch: Any, model: nn.Module, step: int, ref: dict[str, float | None]) -> dict:
    """collect() under the spy (and nothing else under it), then compare rank 0's snapshot."""
    with CollectiveSpy() as spy:
        pending = watch.collect(step)
    snap = pending.result()
    out = compare(snap, ref, watch) if dist.get_rank() == 0 else {}
    out.update(
        collectives=spy.collectives,
        collective_ops=sorted(k for k in spy.ops if k.startswith("c10d")),
        collective_dtypes=sorted(set(spy.collective_dtypes)),
        dtensor_ops=spy.dtensor_ops,
        step=snap.step,
        world_size=snap.world_size,
        parallelism=snap.parallelism,
        replica_divergence=snap.replica_divergence,
        global_norm=snap.global_norm,
    )
    return out


def construct(model: nn.Module, cfg: Any, **kwargs: Any) -> tuple[Any, int]:
    """GradWatch(...) under the spy: returns it and the number of c10d ops of construction."""
    from gradwatch import GradWatch

    with CollectiveSpy() as spy:
        watch = GradWatch(model, cfg, **kwargs)
    return watch, spy.collectives


def clean(name: str) -> str:
    from gradwatch.norms.model import clean_name

    return clean_name(name)


def inputs(rank: int, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(*shape, generator=g, dtype=dtype) * scale


# -- scenarios --------------------------------------------------------------------------------


class Tail(nn.Module):
    """A head with a frozen parameter and one that never receives a gradient."""

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, 5, dtype=dtype), nn.Tanh(),
                                  nn.Linear(5, d_out, dtype=dtype))
        self.frozen = nn.Linear(d_in, 2, dtype=dtype)
        self.frozen.weight.requires_grad_(False)
        self.unused = nn.Linear(3, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).sum(-1) + self.frozen(x).sum(-1)


def case_ddp(
    dtype: torch.dtype = torch.float32, scale: float = 1.0, watch_inner: bool = False
) -> Callable[[int, int], dict]:
    """DDP; ``watch_inner``: GradWatch is given the unwrapped module while the DDP wrapper
    trains it, as the Hugging Face Trainer and Lightning callbacks are (still labelled ddp)."""

    def run(rank: int, world: int) -> dict:
        torch.manual_seed(0)
        model = Tail(7, 3, dtype)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        watch, ctor_ops = construct(model if watch_inner else ddp, config())
        ddp(inputs(rank, 4, 7, dtype=dtype)).pow(2).mul(scale).sum().backward()
        ref = local_reference(ddp, clean)
        results = [measure(watch, ddp, step, ref) for step in range(3)]
        watch.close()
        return {**results[0], "ctor_collectives": ctor_ops,
                "per_collect": [r["collectives"] for r in results]}

    return run


def case_replicated_divergence(rank: int, world: int) -> dict:
    """Plain replicas (no wrapper) with deliberately different gradients: divergence is the
    relative spread of the replicas' global norms, measured every 2nd collect only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    watch, _ = construct(model, config(divergence_every=2))
    out: dict[str, Any] = {"divergence": [], "expected": [], "collectives": []}
    for step in range(3):
        model.zero_grad()
        model(inputs(rank + 10 * step, 5, 4)).sum().backward()
        mine = math.sqrt(math.fsum(fsum_sq(p.grad) for p in model.parameters()))
        norms: list[Any] = [None] * world
        dist.all_gather_object(norms, mine)
        out["expected"].append((max(norms) - min(norms)) / max(norms))
        with CollectiveSpy() as spy:
            pending = watch.collect(step)
        out["collectives"].append(spy.collectives)
        out["divergence"].append(pending.result().replica_divergence)
    watch.close()
    off, _ = construct(model, config(divergence_every=0))
    out["disabled"] = off.collect(0).result().replica_divergence
    off.close()
    return out


def case_fsdp2(dtype: torch.dtype, scale: float) -> Callable[[int, int], dict]:
    """FSDP2 with dims not divisible by the world size; some ranks hold empty shards."""

    def run(rank: int, world: int) -> dict:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(5, 7, dtype=dtype), nn.Tanh(), nn.Linear(7, 3, dtype=dtype), nn.Tanh(),
            nn.Linear(3, 1, dtype=dtype),
        )
        model[2].bias.requires_grad_(False)  # frozen
        for i in (0, 2, 4):
            fully_shard(model[i])
        fully_shard(model)
        empty = sum(1 for p in model.parameters() if p._local_tensor.numel() == 0)
        watch, ctor_ops = construct(model, config())
        (model(inputs(rank, 6, 5, dtype=dtype)) * scale).sum().backward()
        ref = local_reference(model, clean)
        res = measure(watch, model, 0, ref)
        watch.close()
        return {**res, "empty_local_shards": empty, "ctor_collectives": ctor_ops}

    return run


def _tp_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 6, dtype=dtype), nn.ReLU(), nn.Linear(6, 3, dtype=dtype),
        nn.LayerNorm(3, dtype=dtype),
    )


def case_fsdp_tp(rank: int, world: int) -> dict:
    """FSDP2 on the dp dim x Colwise/Rowwise TP on the tp dim of a 2x2 mesh: _StridedShard,
    Shard x Shard, Shard x Replicate, and LayerNorm params on the dp sub-mesh only."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _fsdp_over_tp(mesh, mesh["dp"])


def _fsdp_over_tp(mesh: Any, fsdp_mesh: Any) -> dict:
    """Colwise/Rowwise TP on ``mesh["tp"]``, then FSDP2 over ``fsdp_mesh``; one measured
    collect. The same input on the ranks of a TP group, different across the data dims."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = _tp_model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=fsdp_mesh)
    placements = {clean(n): [repr(x) for x in p.placements] for n, p in model.named_parameters()}
    watch, _ = construct(model, config())
    model(inputs(mesh.get_coordinate()[0], 4, 5)).pow(2).sum().backward()
    ref = local_reference(model, clean)
    res = measure(watch, model, 0, ref)
    watch.close()
    return {**res, "placements": placements}


def case_tp_3d(rank: int, world: int) -> dict:
    """HSDP x TP on a 3-D (replicate=2, shard=1, tp=2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    return _fsdp_over_tp(mesh, mesh["replicate", "shard"])


def case_hsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1))
    fully_shard(model, mesh=mesh)
    watch, _ = construct(model, config())
    model(inputs(rank, 4, 5)).pow(2).sum().backward()
    ref = local_reference(model, clean)
    res = [measure(watch, model, step, ref) for step in range(2)]
    watch.close()
    return {**res[0], "per_collect": [r["collectives"] for r in res]}


class Stage(nn.Module):
    """One pipeline stage: names are unique across stages (``stage{k}.*``)."""

    def __init__(self, k: int, d_in: int, d_out: int, shared_names: bool = False) -> None:
        super().__init__()
        prefix = "stage" if not shared_names else "block"
        self.layers = nn.ModuleDict({f"{prefix}{0 if shared_names else k}": nn.Linear(d_in, d_out)})
        self.idle = nn.ModuleDict({f"idle{k}": nn.Linear(2, 2)})  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return next(iter(self.layers.values()))(x)


def case_pipeline(with_ddp: bool, scale: float = 1.0) -> Callable[[int, int], dict]:
    """Two stages; with_ddp: x two DDP replicas on a (pp=2, dp=2) mesh."""

    def run(rank: int, world: int) -> dict:
        if with_ddp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
            stage_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
            k, replica = mesh.get_coordinate()
        else:
            stage_group, dp_group, k, replica = dist.group.WORLD, None, rank, 0
        torch.manual_seed(k)
        model: nn.Module = Stage(k, 4 + k, 3)
        if with_ddp:
            model = nn.parallel.DistributedDataParallel(
                model, process_group=dp_group, find_unused_parameters=True
            )
        watch, ctor_ops = construct(
            model, config(), process_group=dp_group, stage_group=stage_group
        )
        (model(inputs(rank, 3, 4 + k)) * scale).pow(2).sum().backward()
        ref = stage_reference(model, clean)
        res = measure(watch, model, 0, ref)
        names = list(watch.parameter_names)
        watch.close()
        return {**res, "names": names, "ctor_collectives": ctor_ops, "replica": replica}

    return run


def expect_error(build: Callable[[], Any]) -> dict:
    t0 = time.monotonic()
    try:
        watch = build()
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - t0}
    watch.close()
    return {"error_type": None}


def result_or_error(pending: Any) -> dict:
    """What ``pending.result()`` raised, by type and message (``error_type`` None: nothing)."""
    try:
        pending.result()
    except Exception as exc:
        return {"error_type": type(exc).__name__, "message": str(exc)}
    return {"error_type": None}


def case_stage_collision(rank: int, world: int) -> dict:
    from gradwatch import GradWatch

    model = Stage(rank, 4, 3, shared_names=True)  # both stages name their layer "block0"
    return expect_error(lambda: GradWatch(model, config(), stage_group=dist.group.WORLD))


def case_config_mismatch(rank: int, world: int) -> dict:
    from gradwatch import GradWatch

    model = nn.Linear(3, 2)
    return expect_error(lambda: GradWatch(model, config(every_n_steps=1 + rank)))


def case_shape_mismatch(rank: int, world: int) -> dict:
    from gradwatch import GradWatch

    model = nn.Linear(3, 2 + rank)
    return expect_error(lambda: GradWatch(model, config()))


def case_names_mismatch(rank: int, world: int) -> dict:
    """Rank 1 holds an extra parameter and no stage_group was passed."""
    from gradwatch import GradWatch

    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(1 + rank)])
    return expect_error(lambda: GradWatch(model, config()))


def case_names_mismatch_one_rank(rank: int, world: int) -> dict:
    """Rank 2 alone holds an extra layer: two digest groups, named in the error."""
    from gradwatch import GradWatch

    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(2 if rank == 2 else 1)])
    return expect_error(lambda: GradWatch(model, config()))


class ByteSpy(TorchDispatchMode):
    """Per c10d op, the bytes of its smallest tensor argument (what this rank sends: the input
    of an all-gather, the all-reduced buffer) and of its largest (what it receives)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.sent = 0
        self.received = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if name.startswith("c10d"):
            sizes = [t.numel() * t.element_size() for t in tree_leaves((args, kwargs or {}))
                     if isinstance(t, torch.Tensor)]
            self.ops.append(name)
            self.sent += min(sizes, default=0)
            self.received += max(sizes, default=0)
        return func(*args, **(kwargs or {}))


def case_handshake_bytes(rank: int, world: int) -> dict:
    """Handshake bytes of 50- and 2,000-parameter models every rank agrees on: plain replicas,
    FSDP2 with even shards, FSDP2 with uneven and empty shards (rows 2 x world + 1 and 1),
    FSDP2 over TP on a (world/2, 2) mesh (the same uneven rows: strided shards), and DDP with
    the per-rank view on (which gathers the host names)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from gradwatch import GradWatch

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    for n in (50, 2000):
        for kind in ("replicated", "fsdp2", "fsdp2_uneven", "fsdp2_tp", "ddp_rank_view"):
            torch.manual_seed(0)
            model: nn.Module = nn.Module()
            rows = [2 * world + 1 if i % 2 else 1 for i in range(n)] \
                if kind in ("fsdp2_uneven", "fsdp2_tp") else [2 * world] * n
            model.params = nn.ParameterList([nn.Parameter(torch.randn(r, 3)) for r in rows])
            overrides: dict[str, Any] = {}
            if kind in ("fsdp2", "fsdp2_uneven"):
                fully_shard(model)
            elif kind == "fsdp2_tp":
                for i, p in enumerate(list(model.params)):
                    model.params[i] = nn.Parameter(distribute_tensor(p.data, mesh["tp"],
                                                                     [Shard(0)]))
                fully_shard(model, mesh=mesh["dp"])
            elif kind == "ddp_rank_view":
                model = nn.parallel.DistributedDataParallel(model)
                overrides["rank_view"] = True
            with ByteSpy() as spy:
                watch = GradWatch(model, config(**overrides))
            out[f"{kind}_{n}"] = {
                "sent": spy.sent, "received": spy.received, "ops": spy.ops,
                "n_params": watch._resolved.layout.size,
                "placements": sorted({repr(getattr(p, "placements", None))
                                      for p in model.parameters()}),
                "rank_view_groups": watch._resolved.layout.rank_view_groups,
                "hosts": list(watch._resolved.layout.hosts),
                "local_numels": sorted({p.to_local().numel() if hasattr(p, "to_local")
                                        else p.numel() for p in model.parameters()}),
            }
            watch.close()
    return out


def case_partial_param(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from gradwatch import GradWatch

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Linear(3, 2)
    model.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [Partial()]))
    return expect_error(lambda: GradWatch(model, config()))


def case_partial_grad(rank: int, world: int) -> dict:
    """A gradient placed differently from its parameter is refused on every rank together (the
    collect logs the error and stops), with no collective issued and no hang."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Linear(3, 2 * world)
    model.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)]))
    model.bias.grad = torch.ones(2 * world)
    watch, _ = construct(model, config())
    model.weight.grad = DTensor.from_local(torch.ones(2 * world, 3), mesh, [Partial()])
    with CollectiveSpy() as spy:
        pending = watch.collect(0)
    try:
        outcome = pending.result().step
    except Exception as exc:  # the step was not measured: the result says so
        outcome = f"{type(exc).__name__}: {exc}"
    out = {"collectives": spy.collectives, "broken": watch._collector.broken, "result": outcome}
    watch.close()
    return out


def case_schedule_skip(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    watch, _ = construct(model, config(every_n_steps=2))
    model(inputs(rank, 2, 3)).sum().backward()
    first = watch.collect(0).result()
    with CollectiveSpy() as spy:
        skipped = watch.collect(1)
    snap = skipped.result()
    watch.close()
    return {"skipped_collectives": spy.collectives, "skipped_step": snap.step,
            "same_snapshot": snap is first}


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3).to(torch.bfloat16)
        self.b = nn.Linear(3, 2).to(torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.to(torch.bfloat16)).to(torch.float16)).float()


def case_fp16_payload(rank: int, world: int) -> dict:
    """bf16 and fp16 gradients: the all-reduce payload is float64."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Mixed())
    watch, _ = construct(ddp, config())
    ddp(inputs(rank, 2, 4)).sum().backward()
    ref = local_reference(ddp, clean)
    res = measure(watch, ddp, 0, ref)
    watch.close()
    return res


def case_timeout_raise(rank: int, world: int) -> dict:
    """The last rank raises inside collect (before the all-reduce): the others get a
    GradWatchTimeoutError from ``pending.result()`` instead of hanging."""
    from gradwatch import GradWatch

    model = nn.Linear(3, 2)
    model(inputs(rank, 2, 3)).sum().backward()
    watch = GradWatch(model, config(collective_timeout_seconds=3))
    if rank == world - 1:

        def boom(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("simulated failure inside collect")

        watch._collector.engine.squared_norms_and_plan = boom  # type: ignore[method-assign]
    t0 = time.monotonic()
    out = result_or_error(watch.collect(0))
    out["seconds"] = time.monotonic() - t0
    out["broken"] = watch._collector.broken is not None
    # A later collect is a no-op on every rank: no collective, no new wait.
    with CollectiveSpy() as spy:
        watch.collect(1)
    out["later_collectives"] = spy.collectives
    dist.barrier()  # the failing rank keeps its group open until the others have timed out
    t1 = time.monotonic()
    watch.close()
    out["close_seconds"] = time.monotonic() - t1
    return out


def case_timeout_absent(rank: int, world: int) -> dict:
    """The last rank never calls collect and stays alive (a real wait, not a closed socket)."""
    from gradwatch import GradWatch

    model = nn.Linear(3, 2)
    model(inputs(rank, 2, 3)).sum().backward()
    watch = GradWatch(model, config(collective_timeout_seconds=3))
    out: dict[str, Any] = {"error_type": None}
    t0 = time.monotonic()
    if rank != world - 1:
        out = result_or_error(watch.collect(0))
    out["seconds"] = time.monotonic() - t0
    dist.barrier()
    t1 = time.monotonic()
    watch.close()
    out["close_seconds"] = time.monotonic() - t1
    return out


def case_never_constructs(rank: int, world: int) -> dict:
    """The last rank never constructs GradWatch (and stays alive): the others get the bounded
    handshake timeout error. Last of its suite: the absent rank never creates gradwatch's
    process group, so later groups would not pair up."""
    from gradwatch import GradWatch

    if rank == world - 1:
        out: dict[str, Any] = {"error_type": None, "skipped": True}
    else:
        out = expect_error(
            lambda: GradWatch(nn.Linear(3, 2), config(collective_timeout_seconds=3)))
    dist.barrier()
    return out


SUITES: dict[str, list[tuple[str, Callable[[int, int], dict]]]] = {
    "w2": [
        ("ddp_fp32", case_ddp()),
        ("ddp_fp64", case_ddp(torch.float64)),
        ("ddp_1e18", case_ddp(torch.float32, 1e18)),
        ("ddp_inner_module", case_ddp(watch_inner=True)),
        ("fsdp2_fp32_1e18", case_fsdp2(torch.float32, 1e18)),
        ("fsdp2_fp64", case_fsdp2(torch.float64, 1.0)),
        ("pipeline", case_pipeline(with_ddp=False, scale=1e18)),
        ("replicated_divergence", case_replicated_divergence),
        ("fp16_payload", case_fp16_payload),
        ("schedule_skip", case_schedule_skip),
        ("stage_collision", case_stage_collision),
        ("config_mismatch", case_config_mismatch),
        ("shape_mismatch", case_shape_mismatch),
        ("names_mismatch", case_names_mismatch),
        ("handshake_bytes", case_handshake_bytes),
        ("partial_param", case_partial_param),
        ("partial_grad", case_partial_grad),
        ("timeout_raise", case_timeout_raise),
        ("timeout_absent", case_timeout_absent),
        ("never_constructs", case_never_constructs),  # last: see its docstring
    ],
    "w4": [
        ("ddp_fp32", case_ddp()),
        ("fsdp2_fp64", case_fsdp2(torch.float64, 1.0)),
        ("fsdp_tp", case_fsdp_tp),
        ("hsdp", case_hsdp),
        ("hsdp_tp_3d", case_tp_3d),
        ("pipeline_ddp", case_pipeline(with_ddp=True)),
        ("handshake_bytes", case_handshake_bytes),
        ("names_mismatch_one_rank", case_names_mismatch_one_rank),
    ],
}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite])


def run_suite(
    rank: int,
    world: int,
    port: int,
    out: str,
    cases: Sequence[tuple[str, Callable[[int, int], dict]]],
    error_key: str = "error",
) -> None:
    """One gloo rank running ``cases`` in order, a barrier after each; each case's result (or
    its exception under ``error_key``) goes to ``out/<rank>.json`` as soon as it is known."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name, case in cases:
            t0 = time.monotonic()
            try:
                results[name] = case(rank, world)
            except Exception as exc:
                results[name] = {error_key: f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()}
            results[name]["case_seconds"] = time.monotonic() - t0
            Path(out, f"{rank}.json").write_text(json.dumps(results, default=str))
            dist.barrier()
    finally:
        Path(out, f"{rank}.json").write_text(json.dumps(results, default=str))
        dist.destroy_process_group()
