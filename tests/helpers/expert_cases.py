"""Workers of tests/distributed/test_experts_distributed.py: expert parallelism (DTensor experts
alone, x FSDP2, x TP; plain per-rank experts), ``main_grad`` gradients, and ``watch()`` on a
refused setup, in spawned gloo worlds.

**The model** (:class:`MoE`): a dense layer ``h = relu(x Wd^T)`` then a mixture of ``E`` linear
experts ``y_t = h_t We[route(t)]`` (fixed routing ``route(t) = t mod E``), loss ``sum(y * c)``.
Under expert parallelism each rank holds ``E / ep`` experts; tokens reach their expert's rank
and come back through the EP group (two autograd-aware all-reduces of zero-padded slots: the
dispatch and combine of an all-to-all), so an expert's gradient sums the tokens of every rank
of its EP group. Under TP the dense rows and the expert output columns are split over the TP
group (the same tokens on its ranks).

**The reference** is an unsharded float64 replica on every rank, with the same weights and
every data-parallel replica's data: its loss is the mean of the replicas' losses, so its
gradient is the averaged full gradient; each parameter's squared norm is a ``math.fsum`` of
Python floats, fed to :func:`dist_cases.compare` (global, per-parameter, per-group, ratios).
The training side averages exactly as its stack does (FSDP2's reduce-scatter with a divide
factor, or the explicit all-reduces a hand-rolled EP job makes). bf16 cases use small integer
data and weights: every product and sum of the forward, backward and averaging is exact in
bf16, so the float64 reference is the very value bf16 training must produce.
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import CollectiveSpy, compare, expect_error, run_suite
from torch import Tensor, nn

D, OUT, E, T = 4, 4, 4, 6  # hidden, expert output, experts in all, tokens per replica


def config(**overrides: Any) -> Any:
    from gradwatch import WatchConfig

    base: dict[str, Any] = {
        "groups": {"experts": ["experts.*"], "dense": ["dense.*"]},
        "ratios": [("experts", "dense")],
        "collective_timeout_seconds": 30,
        "divergence_every": 1,
        "exploding_threshold": 1e30,
        "always_reduce": True,
    }
    base.update(overrides)
    return WatchConfig(**base)


# -- weights, data and the float64 reference ------------------------------------------------


def full_weights(integer: bool) -> tuple[Tensor, Tensor]:
    """``(Wd [D, D], We [E, D, OUT])`` in float64, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    if integer:
        return (torch.randint(-2, 3, (D, D), generator=g).double(),
                torch.randint(-2, 3, (E, D, OUT), generator=g).double())
    return torch.randn(D, D, generator=g).double(), torch.randn(E, D, OUT, generator=g).double()


def replica_data(replica: int, integer: bool) -> tuple[Tensor, Tensor]:
    """``(x [T, D], c [T, OUT])`` of data-parallel replica ``replica`` (float64)."""
    g = torch.Generator().manual_seed(100 + replica)
    if integer:
        return (torch.randint(-1, 2, (T, D), generator=g).double(),
                torch.randint(-1, 2, (T, OUT), generator=g).double())
    return torch.randn(T, D, generator=g).double(), torch.randn(T, OUT, generator=g).double()


ROUTE = torch.arange(T) % E


def reference(replicas: int, integer: bool, plain_experts: bool) -> dict[str, float]:
    """name -> squared norm of the averaged full gradient (float64 replica, ``math.fsum``)."""
    wd, we = (w.clone().requires_grad_(True) for w in full_weights(integer))
    losses = []
    for r in range(replicas):
        x, c = replica_data(r, integer)
        h = torch.relu(x @ wd.T)
        y = torch.stack([h[t] @ we[int(ROUTE[t])] for t in range(T)])
        losses.append((y * c).sum())
    (sum(losses) / replicas).backward()

    def sq(t: Tensor) -> float:
        return math.fsum(v * v for v in t.flatten().tolist())

    out = {"dense.weight": sq(wd.grad)}
    if plain_experts:
        out.update({f"experts.weights.{e}": sq(we.grad[e]) for e in range(E)})
    else:
        out["experts.weight"] = sq(we.grad)
    return out


# -- the sharded model ------------------------------------------------------------------------


@dataclass
class Groups:
    """Where this rank sits: EP and TP groups (None: size 1) and its coordinates there."""

    ep: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    tp: Any = None
    tp_rank: int = 0
    tp_size: int = 1


def _local(w: Tensor) -> Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


def _gather(t: Tensor, group: Any, rank: int, size: int, dim: int) -> Tensor:
    """Concatenation over ``group`` along ``dim`` (autograd: the backward sums each slot's
    gradients over the group), as a sum of zero-padded slots."""
    if size == 1:
        return t
    from torch.distributed.nn.functional import all_reduce

    shape = list(t.shape)
    shape[dim] *= size
    padded = t.new_zeros(shape)
    index = [slice(None)] * len(shape)
    index[dim] = slice(rank * t.shape[dim], (rank + 1) * t.shape[dim])
    padded[tuple(index)] = t
    return all_reduce(padded, group=group)


class Dense(nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: Tensor, g: Groups) -> Tensor:
        h = torch.relu(x @ _local(self.weight).T)  # [T, D / tp]
        return _gather(h, g.tp, g.tp_rank, g.tp_size, dim=1)


class StackedExperts(nn.Module):
    """torchtitan style: one ``[experts, D, OUT]`` weight (a DTensor ``Shard(0)`` over ep)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def local_experts(self) -> list[Tensor]:
        w = _local(self.weight)
        return [w[j] for j in range(w.shape[0])]

    def forward(self, h: Tensor, g: Groups) -> Tensor:
        return route_through(self.local_experts(), h, g)


class PlainExperts(nn.Module):
    """Megatron style: this rank's experts as ordinary parameters named by global index."""

    def __init__(self, experts: dict[int, Tensor]) -> None:
        super().__init__()
        self.weights = nn.ParameterDict({str(e): nn.Parameter(w) for e, w in experts.items()})

    def local_experts(self) -> list[Tensor]:
        return list(self.weights.values())

    def forward(self, h: Tensor, g: Groups) -> Tensor:
        return route_through(self.local_experts(), h, g)


def route_through(local: list[Tensor], h: Tensor, g: Groups) -> Tensor:
    """Dispatch every EP rank's tokens to the rank of their expert, apply it, combine back;
    returns this rank's tokens' outputs (its TP columns)."""
    tokens = _gather(h, g.ep, g.ep_rank, g.ep_size, dim=0)  # [ep * T, D]
    first = g.ep_rank * len(local)
    cols = local[0].shape[1]
    rows = []
    for t in range(tokens.shape[0]):
        e = int(ROUTE[t % T])
        mine = first <= e < first + len(local)
        rows.append(tokens[t] @ local[e - first] if mine else tokens.new_zeros(cols))
    out = torch.stack(rows)
    if g.ep_size > 1:
        from torch.distributed.nn.functional import all_reduce

        out = all_reduce(out, group=g.ep)
    return out[g.ep_rank * T:(g.ep_rank + 1) * T]


class MoE(nn.Module):
    def __init__(self, dense: nn.Module, experts: nn.Module, g: Groups) -> None:
        super().__init__()
        self.dense = dense
        self.experts = experts
        self.groups = g

    def forward(self, x: Tensor) -> Tensor:
        return self.experts(self.dense(x, self.groups), self.groups)


def local_loss(model: MoE, replica: int, integer: bool, dtype: torch.dtype) -> Tensor:
    g = model.groups
    x, c = replica_data(replica, integer)
    y = model(x.to(dtype))
    width = y.shape[1]
    c = c[:, g.tp_rank * width:(g.tp_rank + 1) * width].to(dtype)
    return (y * c).sum()


def average_(tensors: list[Tensor], group: Any, divisor: int) -> None:
    """Sum over ``group`` (None: no other holder) and divide by ``divisor``, in place."""
    for t in tensors:
        if group is not None:
            dist.all_reduce(t, group=group)
        t.div_(divisor)


# -- the cases ----------------------------------------------------------------------------------


def _measure(model: nn.Module, watch: Any, ref: dict[str, float], extra: dict) -> dict:
    with CollectiveSpy() as spy:
        pending = watch.collect(0)
    snap = pending.result()
    out = compare(snap, ref, watch) if dist.get_rank() == 0 else {}
    out.update(extra, collectives=spy.collectives,
               collective_ops=sorted(k for k in spy.ops if k.startswith("c10d")),
               collective_dtypes=sorted(set(spy.collective_dtypes)),
               dtensor_ops=spy.dtensor_ops, parallelism=snap.parallelism,
               global_norm=snap.global_norm, names=sorted(watch.parameter_names),
               group_norms={k: v.norm for k, v in snap.groups.items()})
    watch.close()
    return out


def _dtype(integer: bool) -> torch.dtype:
    return torch.bfloat16 if integer else torch.float32


def case_ep_dtensor(integer: bool) -> Callable[[int, int], dict]:
    """Experts a DTensor ``Shard(0)`` over a 1-D ``ep`` mesh of the whole world; the dense
    layer replicated, data-parallel over the same ranks (averaged by an all-reduce)."""

    def run(rank: int, world: int) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from gradwatch import GradWatch

        dtype = _dtype(integer)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        g = Groups(ep=mesh.get_group(), ep_rank=rank, ep_size=world)
        wd, we = (w.to(dtype) for w in full_weights(integer))
        model = MoE(Dense(wd), StackedExperts(distribute_tensor(we, mesh, [Shard(0)])), g)
        watch = GradWatch(model, config())
        local_loss(model, rank, integer, dtype).backward()
        average_([model.dense.weight.grad], dist.group.WORLD, world)
        average_([model.experts.weight.grad._local_tensor], None, world)
        return _measure(model, watch, reference(world, integer, False),
                        {"placements": repr(model.experts.weight.placements)})

    return run


def case_ep_fsdp2(integer: bool) -> Callable[[int, int], dict]:
    """torchtitan's EP x FSDP2 on a (dp, ep) mesh: experts ``Shard(0)`` over ep and
    ``fully_shard`` over dp; the dense layer ``fully_shard`` over the flattened dp x ep
    mesh."""

    def run(rank: int, world: int) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard, distribute_tensor

        from gradwatch import GradWatch

        dtype = _dtype(integer)
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "ep"))
        flat = mesh["dp", "ep"]._flatten("dp_ep")
        ep_rank = mesh.get_local_rank("ep")
        g = Groups(ep=mesh["ep"].get_group(), ep_rank=ep_rank, ep_size=2)
        wd, we = (w.to(dtype) for w in full_weights(integer))
        model = MoE(Dense(wd), StackedExperts(distribute_tensor(we, mesh["ep"], [Shard(0)])), g)
        fully_shard(model.experts, mesh=mesh["dp"])
        fully_shard(model.dense, mesh=flat)
        fully_shard(model, mesh=flat)
        placements = {n: repr(p.placements) for n, p in model.named_parameters()}
        watch = GradWatch(model, config())
        local_loss(model, rank, integer, dtype).backward()
        # FSDP2 averaged the experts' gradients over dp; every rank's tokens reached them, so
        # the average over the world needs a further 1 / ep (torchtitan's divide factor;
        # gloo has no PREMUL_SUM for set_gradient_divide_factor).
        average_([model.experts.weight.grad._local_tensor], None, 2)
        return _measure(model, watch, reference(world, integer, False),
                        {"placements": placements})

    return run


def case_ep_tp(integer: bool) -> Callable[[int, int], dict]:
    """EP x TP on an (ep, tp) mesh, the case where experts went missing from norms: experts
    ``(Shard(0), Shard(2))`` (experts over ep, output columns over tp), the dense layer
    row-sharded over tp and data-parallel over ep (averaged by an all-reduce over ep)."""

    def run(rank: int, world: int) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from gradwatch import GradWatch

        dtype = _dtype(integer)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "tp"))
        ep_rank, tp_rank = mesh.get_local_rank("ep"), mesh.get_local_rank("tp")
        g = Groups(ep=mesh["ep"].get_group(), ep_rank=ep_rank, ep_size=2,
                   tp=mesh["tp"].get_group(), tp_rank=tp_rank, tp_size=world // 2)
        wd, we = (w.to(dtype) for w in full_weights(integer))
        model = MoE(Dense(distribute_tensor(wd, mesh["tp"], [Shard(0)])),
                    StackedExperts(distribute_tensor(we, mesh, [Shard(0), Shard(2)])), g)
        watch = GradWatch(model, config())
        local_loss(model, ep_rank, integer, dtype).backward()
        average_([model.dense.weight.grad._local_tensor], g.ep, 2)
        average_([model.experts.weight.grad._local_tensor], None, 2)
        return _measure(model, watch, reference(2, integer, False),
                        {"placements": repr(model.experts.weight.placements)})

    return run


def _plain_model(world: int, integer: bool) -> tuple[MoE, Any]:
    """Plain per-rank experts on an (edp, ep) grid: rank r holds experts of EP rank r % 2
    (ep = 2), named by global index; returns the model and the expert-data-parallel group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("edp", "ep"))
    ep_rank = mesh.get_local_rank("ep")
    g = Groups(ep=mesh["ep"].get_group(), ep_rank=ep_rank, ep_size=2)
    wd, we = (w.to(_dtype(integer)) for w in full_weights(integer))
    per_rank = E // 2
    mine = {e: we[e].clone() for e in range(ep_rank * per_rank, (ep_rank + 1) * per_rank)}
    model = MoE(Dense(wd.clone()), PlainExperts(mine), g)
    return model, (mesh["edp"].get_group() if world > 2 else None)


def case_ep_plain(integer: bool) -> Callable[[int, int], dict]:
    """Plain per-rank experts declared by ``expert_parameters``; dense averaged over the
    world, each expert over its expert-data-parallel group (divided by the world: every rank's
    tokens reach it)."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        model, edp = _plain_model(world, integer)
        watch = GradWatch(model, config(expert_parameters=["experts.*"]))
        local_loss(model, rank, integer, _dtype(integer)).backward()
        average_([model.dense.weight.grad], dist.group.WORLD, world)
        average_([p.grad for p in model.experts.weights.values()], edp, world)
        held = sorted(model.experts.weights)
        return _measure(model, watch, reference(world, integer, True), {"held": held})

    return run


def case_ep_plain_undeclared(rank: int, world: int) -> dict:
    """The same model without the declaration: refused, the error naming expert_parameters."""
    from gradwatch import GradWatch

    model, _ = _plain_model(world, False)
    return expect_error(lambda: GradWatch(model, config()))


def case_ep_plain_coinciding_names(rank: int, world: int) -> dict:
    """Declared experts named by their rank-local index (``experts.weights.0`` on every rank,
    different experts): refused rather than counted once as replicas."""
    from gradwatch import GradWatch

    g = Groups()
    model = MoE(Dense(torch.ones(D, D)), PlainExperts({0: torch.full((D, OUT), float(rank))}), g)
    return expect_error(lambda: GradWatch(model, config(expert_parameters=["experts.*"])))


# -- main_grad ----------------------------------------------------------------------------------


class MegatronLayoutDDP(nn.Module):
    """The gradient layout of Megatron-Core's ``DistributedDataParallel`` (its
    ``_ParamAndGradBuffer`` with ``grad_reduce_in_fp32``), which cannot be constructed without
    CUDA: one contiguous float32 buffer, parameters in reverse order; ``param.main_grad`` a
    view of its slice; after backward each ``.grad`` is added into ``main_grad`` and set to
    None; ``finish_grad_sync()`` scales the buffer by ``1 / dp size`` and all-reduces it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.grad_data = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        at = 0
        for p in reversed(params):
            p.main_grad = self.grad_data[at:at + p.numel()].view(p.shape)
            at += p.numel()
        self._params = params

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x)

    def finish_grad_sync(self) -> None:
        for p in self._params:  # what Megatron's backward post-hook does per parameter
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None
        self.grad_data.mul_(1.0 / dist.get_world_size())
        dist.all_reduce(self.grad_data)


def case_main_grad(integer: bool) -> Callable[[int, int], dict]:
    """Dense MoE-free model under the Megatron-Core layout: measured from ``main_grad``
    (``.grad`` None), exact against the float64 replica; then clipping scales ``main_grad``."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        dtype = _dtype(integer)
        wd, we = (w.to(dtype) for w in full_weights(integer))
        inner = MoE(Dense(wd), StackedExperts(we), Groups())
        ddp = MegatronLayoutDDP(inner)
        watch = GradWatch(ddp, config())
        local_loss(inner, rank, integer, dtype).backward()
        ddp.finish_grad_sync()
        grads_none = all(p.grad is None for p in inner.parameters())
        res = _measure(ddp, watch, reference(world, integer, False),
                       {"grads_none": grads_none,
                        "main_grad_dtypes": sorted({str(p.main_grad.dtype)
                                                    for p in inner.parameters()})})
        # Clipping scales main_grad, the tensor the optimizer reads, by the whole-model norm.
        watch = GradWatch(ddp, config())
        before = math.sqrt(math.fsum(v * v for v in ddp.grad_data.double().tolist()))
        max_norm = before / 4
        total = float(watch.clip_grad_norm_(max_norm, step=1))
        after = math.sqrt(math.fsum(v * v for v in ddp.grad_data.double().tolist()))
        watch.close()
        res.update(clip_total=total, clip_before=before, clip_after=after,
                   clip_max_norm=max_norm,
                   grads_none_after_clip=all(p.grad is None for p in inner.parameters()))
        return res

    return run


def case_megatron_distributed_optimizer(rank: int, world: int) -> dict:
    """A Megatron-Core DDP configured for the distributed optimizer is refused, naming it."""
    from types import SimpleNamespace

    from gradwatch import GradWatch

    ddp = MegatronLayoutDDP(nn.Linear(3, 2))
    ddp.ddp_config = SimpleNamespace(use_distributed_optimizer=True)  # type: ignore[assignment]
    return expect_error(lambda: GradWatch(ddp, config()))


# -- gradwatch.watch() on a refused setup ----------------------------------------------------


def case_watch_refused(rank: int, world: int) -> dict:
    """A parameter with a Partial placement (refused at construction): ``watch()`` logs once,
    returns a no-op on every rank, and rank 0 serves ``gradwatch_collecting 0``; an explicit
    ``GradWatch`` raises."""
    import logging

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    import gradwatch

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Linear(3, 2)
    model.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 3), mesh, [Partial()]))
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(level=logging.ERROR)
    logging.getLogger("gradwatch").addHandler(handler)
    os.environ["GRADWATCH_PORT"] = "0"
    try:
        watch = gradwatch.watch(model, collective_timeout_seconds=30)
    finally:
        del os.environ["GRADWATCH_PORT"]
    model.bias.grad = torch.ones(2)
    with CollectiveSpy() as spy:
        pending = watch.collect(0)
        watch.clip_grad_norm_(1.0)
    out: dict[str, Any] = {
        "type": type(watch).__name__,
        "collectives": spy.collectives,
        "snapshot_step": pending.result().step,
        "error_logs": [r.getMessage() for r in records],
        "url": watch.metrics_url,
    }
    logging.getLogger("gradwatch").removeHandler(handler)
    if watch.metrics_url is not None:
        deadline = time.monotonic() + 20
        text = ""
        while "gradwatch_collecting" not in text and time.monotonic() < deadline:
            with urllib.request.urlopen(watch.metrics_url, timeout=5) as response:
                text = response.read().decode()
            time.sleep(0.1)
        out["scrape"] = [line for line in text.splitlines()
                         if line.startswith(("gradwatch_collecting", "gradwatch_run_info"))]
    watch.close()
    out["explicit"] = expect_error(lambda: gradwatch.GradWatch(model, config()))
    return out


SUITES: dict[str, list[tuple[str, Callable[[int, int], dict]]]] = {
    "w2": [
        ("ep_dtensor_fp32", case_ep_dtensor(False)),
        ("ep_dtensor_bf16", case_ep_dtensor(True)),
        ("ep_plain_fp32", case_ep_plain(False)),
        ("ep_plain_bf16", case_ep_plain(True)),
        ("ep_plain_undeclared", case_ep_plain_undeclared),
        ("ep_plain_coinciding_names", case_ep_plain_coinciding_names),
        ("main_grad_fp32", case_main_grad(False)),
        ("main_grad_bf16", case_main_grad(True)),
        ("megatron_distributed_optimizer", case_megatron_distributed_optimizer),
        ("watch_refused", case_watch_refused),
    ],
    "w4": [
        ("ep_fsdp2_fp32", case_ep_fsdp2(False)),
        ("ep_fsdp2_bf16", case_ep_fsdp2(True)),
        ("ep_tp_fp32", case_ep_tp(False)),
        ("ep_tp_bf16", case_ep_tp(True)),
        ("ep_plain_fp32", case_ep_plain(False)),
        ("ep_plain_bf16", case_ep_plain(True)),
        ("ep_dtensor_fp32", case_ep_dtensor(False)),
        ("ep_dtensor_bf16", case_ep_dtensor(True)),
    ],
}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite])
