"""Worker side of tests/distributed/test_fsdp1_distributed.py: FSDP1 cases run inside one
spawned gloo world per size (see dist_cases.run_suite).

The reference of every figure is an unsharded replica with the same weights and the same
data on every rank, its gradients averaged across ranks in float64 (an all-reduce of float64
copies, then / world size), normed with ``math.fsum``: nothing of FSDP's own sharding or of
gradwatch takes part in it. bf16 cases use small-integer weights and inputs with ReLU, so
every product and sum (the local backward in bf16, FSDP's bf16 reduce-scatter with its pre-
and post-division by powers of two) is exact and FSDP's gradient *is* the averaged one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import CollectiveSpy, compare, config, expect_error, run_suite
from torch import nn

FP32 = "fp32"
BF16 = "bf16"  # bf16 parameters, no MixedPrecision
MIXED = "mixed"  # fp32 parameters, FSDP MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)

GROUPS = {"first": ["0.*"], "weights": ["*weight"]}


def _model(kind: str) -> nn.Module:
    """Sizes chosen so shards are uneven and some ranks hold empty slices; ``4`` holds its
    parameters in the root unit (not wrapped on its own)."""
    torch.manual_seed(0)
    if kind == FP32:
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(),
                             nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2), nn.ReLU(),
                          nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-1, 2, p.shape, dtype=torch.float32))
    return model.to(torch.bfloat16) if kind == BF16 else model


def _inputs(kind: str, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if kind == FP32:
        return torch.randn(4, 5, generator=g)
    x = torch.randint(-1, 2, (2, 4), generator=g, dtype=torch.float32)
    return x.to(torch.bfloat16) if kind == BF16 else x


def averaged_reference(kind: str, rank: int, world: int) -> dict[str, float]:
    """name -> squared norm of the replica's gradient averaged over ranks (float64)."""
    replica, x = _model(kind), _inputs(kind, rank)
    if kind != FP32:  # exact either way (small integers); FP32: the job's own dtype
        replica, x = replica.double(), x.double()
    replica(x).sum().backward()
    out = {}
    for name, p in replica.named_parameters():
        g = p.grad.detach().double()
        dist.all_reduce(g)
        g /= world
        out[name] = math.fsum(x * x for x in g.flatten().tolist())
    return out


def _wrap(model: nn.Module, strategy: str, orig: bool, kind: str, nesting: str,
          mesh: Any = None, offload: bool = False) -> nn.Module:
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kw: dict[str, Any] = {
        "device_id": torch.device("cpu"),
        "use_orig_params": orig,
        "sharding_strategy": ShardingStrategy[strategy],
    }
    if mesh is not None:
        kw[mesh[0]] = mesh[1]
    if kind == MIXED:
        kw["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.bfloat16)
    if offload:
        kw["cpu_offload"] = CPUOffload(offload_params=True)
    if nesting == "auto":  # every Linear but the last one its own unit; the root holds it
        first = {id(m) for m in list(model)[:-1] if isinstance(m, nn.Linear)}
        return FSDP(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel:
                    recurse or id(module) in first, **kw)
    if nesting == "manual":  # nested by hand: units 0 and 2, the rest in the root
        model[0] = FSDP(model[0], **kw)
        model[2] = FSDP(model[2], **kw)
        return FSDP(model, **kw)
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kw)


def _mesh(how: str, world: int) -> Any:
    """The hybrid strategies' groups: a 2-D DeviceMesh, or the (intra, inter) group tuple."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if how == "device_mesh":
        return ("device_mesh", mesh)
    return ("process_group", (mesh["shard"].get_group(), mesh["replicate"].get_group()))


def _local_grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def case_fsdp1(strategy: str, orig: bool, kind: str = FP32, nesting: str = "auto",
               hybrid: str = "device_mesh", offload: bool = False,
               inner: bool = False) -> Callable[[int, int], dict]:
    """One FSDP1 configuration: a collect measured against the averaged replica (names by
    the clean state_dict keys, groups by clean patterns), its collectives counted, then a clip
    checked on every rank against the pre-clip local gradients."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        mesh = _mesh(hybrid, world) if "HYBRID" in strategy else None
        model = _wrap(_model(kind), strategy, orig, kind, nesting, mesh, offload)
        watched = model.module if inner else model
        cfg = config(groups=GROUPS, ratios=[("first", "weights")])
        with CollectiveSpy() as spy:
            watch = GradWatch(watched, cfg)
        ctor = spy.collectives
        ref = averaged_reference(kind, rank, world)
        model(_inputs(kind, rank)).float().sum().backward()
        with CollectiveSpy() as spy:
            pending = watch.collect(0)
        snap = pending.result()
        out = compare(snap, ref, watch) if rank == 0 else {}
        before = _local_grads(model)
        pre = math.sqrt(math.fsum(ref.values()))
        max_norm = 0.5 * pre
        total = float(watch.clip_grad_norm_(max_norm, step=1))
        coef = min(1.0, max_norm / (pre + 1e-6))
        after = _local_grads(model)
        errs = [float((a.double() - b.double() * coef).abs().max()) / max(
                    float(b.double().abs().max()) * coef, 1e-30)
                for a, b in zip(after, before, strict=True) if b is not None and b.numel()]
        totals: list[Any] = [None] * world
        dist.all_gather_object(totals, total)
        keys = list(model.state_dict().keys())
        out.update(
            parallelism=snap.parallelism,
            names=sorted(watch.parameter_names),
            state_dict_keys=sorted(keys),
            synced=watch._resolved.layout.replicated_synced,
            reference_names=sorted(ref),
            first_tensors=snap.groups["first"].tensors,
            collectives=spy.collectives,
            collective_ops=sorted(k for k in spy.ops if k.startswith("c10d")),
            collective_dtypes=sorted(set(spy.collective_dtypes)),
            ctor_collectives=ctor,
            global_norm=snap.global_norm,
            clip_total=total,
            clip_totals=totals,
            clip_rel_err=abs(total - pre) / pre,
            clip_grad_rel_err=max(errs, default=0.0),
            clipped_grads=len(errs),
            post_clip_norm=watch.collect(2).result().global_norm,
            max_norm=max_norm,
            flat_grad_dtypes=sorted({str(p.grad.dtype) for p in model.parameters()
                                     if p.grad is not None}),
        )
        watch.close()
        if strategy == "NO_SHARD":  # an ordinary collect (no divergence step) all-reduces nothing
            quiet = GradWatch(watched, config(groups=GROUPS, ratios=[], divergence_every=0))
            model(_inputs(kind, rank)).float().sum().backward()  # accumulates: 2x + clipped
            with CollectiveSpy() as spy:
                pending = quiet.collect(3)
            mine = math.sqrt(math.fsum(float(x) ** 2 for g in _local_grads(model)
                                       if g is not None for x in g.double().flatten().tolist()))
            out.update(ordinary_collectives=spy.collectives,
                       ordinary_rel_err=abs(pending.result().global_norm - mine) / mine)
            quiet.close()
        return out

    return run


def case_temporaries(rank: int, world: int) -> dict:
    """Larger units: the collect allocates nothing gradient-sized, gathers nothing, and its
    one collective carries O(parameters) float64 (gradwatch.doctor.testing.OpCounter)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from gradwatch import GradWatch
    from gradwatch.doctor.testing import OpCounter

    out: dict[str, Any] = {}
    for orig in (False, True):
        torch.manual_seed(0)
        model = FSDP(nn.Sequential(nn.Linear(300, 400), nn.Tanh(), nn.Linear(400, 300)),
                     device_id=torch.device("cpu"), use_orig_params=orig,
                     auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        watch = GradWatch(model, config())
        model(torch.randn(3, 300)).sum().backward()
        watch.collect(0).result()  # the plan
        with OpCounter() as ops:
            watch.collect(1).result()
        smallest = min(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                       if p.grad is not None and p.grad.numel() > 1000)
        out[f"orig_{orig}"] = {
            "largest_bytes": ops.largest_bytes, "largest_op": ops.largest_op,
            "smallest_grad_bytes": smallest, "collectives": ops.collectives,
            "collective_ops": sorted(k for k in ops.ops if k.startswith("c10d")),
            "collective_bytes": ops.collective_bytes,
            "packed_bytes": watch._resolved.layout.packed_length * 8,
        }
        watch.close()
    return out


def case_no_sync(rank: int, world: int) -> dict:
    """A collect inside no_sync() (FSDP1 holds the unsharded, unreduced gradient) is not
    measured, on every rank alike, saying why; the next synchronized step is."""
    from gradwatch import GradWatch

    out: dict[str, Any] = {}
    for orig in (False, True):
        model = _wrap(_model(FP32), "FULL_SHARD", orig, FP32, "auto")
        watch = GradWatch(model, config(groups=GROUPS, ratios=[]))
        with model.no_sync():
            model(_inputs(FP32, rank)).sum().backward()
            pending = watch.collect(0)
        try:
            pending.result()
            first = "measured"
        except Exception as exc:
            first = f"{type(exc).__name__}: {exc}"
        model(_inputs(FP32, rank)).sum().backward()
        snap = watch.collect(1).result()
        out[f"orig_{orig}"] = {"inside": first, "after": snap.global_norm,
                               "broken": watch._collector.broken}
        watch.close()
    return out


def case_mixed_fsdp2(rank: int, world: int) -> dict:
    """FSDP1 and FSDP2 units in one model: refused at construction, naming both."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard

    from gradwatch import GradWatch

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model[0] = FSDP(model[0], device_id=torch.device("cpu"))
    fully_shard(model[1])
    return expect_error(lambda: GradWatch(model, config()))


def case_offload(orig: bool) -> Callable[[int, int], dict]:
    """FSDP1's CPUOffload(offload_params=True): the flat gradient is FSDP's CPU copy of the
    shard, measured like any other. FSDP1 needs an accelerator for two calls of that path
    (pinning the CPU shard, synchronizing the device stream), stubbed here on the CPU; the
    copies of the gradient into its CPU shard are FSDP's own."""

    def run(rank: int, world: int) -> dict:
        pin, pinned, sync = torch.Tensor.pin_memory, torch.Tensor.is_pinned, None
        stream = torch.cpu.Stream
        sync = getattr(stream, "synchronize", None)
        torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
        torch.Tensor.is_pinned = lambda self, *a, **k: True  # type: ignore[method-assign]
        stream.synchronize = lambda self: None  # type: ignore[attr-defined]
        try:
            res = case_fsdp1("FULL_SHARD", orig, offload=True)(rank, world)
        finally:
            torch.Tensor.pin_memory = pin  # type: ignore[method-assign]
            torch.Tensor.is_pinned = pinned  # type: ignore[method-assign]
            if sync is None:
                del stream.synchronize  # type: ignore[attr-defined]
            else:
                stream.synchronize = sync  # type: ignore[attr-defined]
        return res

    return run


W2 = [
    ("full_flat", case_fsdp1("FULL_SHARD", False)),
    ("full_orig", case_fsdp1("FULL_SHARD", True)),
    ("grad_op_flat", case_fsdp1("SHARD_GRAD_OP", False, nesting="manual")),
    ("grad_op_orig", case_fsdp1("SHARD_GRAD_OP", True)),
    ("no_shard_flat", case_fsdp1("NO_SHARD", False)),
    ("no_shard_orig", case_fsdp1("NO_SHARD", True, nesting="manual")),
    ("manual_flat", case_fsdp1("FULL_SHARD", False, nesting="manual")),
    ("bf16_flat", case_fsdp1("FULL_SHARD", False, kind=BF16)),
    ("bf16_orig", case_fsdp1("FULL_SHARD", True, kind=BF16, nesting="manual")),
    ("mixed_flat", case_fsdp1("FULL_SHARD", False, kind=MIXED)),
    ("mixed_orig", case_fsdp1("SHARD_GRAD_OP", True, kind=MIXED)),
    ("inner_flat", case_fsdp1("FULL_SHARD", False, inner=True)),
    ("inner_orig", case_fsdp1("FULL_SHARD", True, inner=True)),
    ("offload_flat", case_offload(False)),
    ("offload_orig", case_offload(True)),
    ("temporaries", case_temporaries),
    ("no_sync", case_no_sync),
    ("mixed_fsdp2", case_mixed_fsdp2),
]
W4 = [
    ("full_flat", case_fsdp1("FULL_SHARD", False)),
    ("full_orig", case_fsdp1("FULL_SHARD", True, nesting="manual")),
    ("grad_op_orig", case_fsdp1("SHARD_GRAD_OP", True)),
    ("no_shard_flat", case_fsdp1("NO_SHARD", False)),
    ("hybrid_flat", case_fsdp1("HYBRID_SHARD", False)),
    ("hybrid_orig_groups", case_fsdp1("HYBRID_SHARD", True, hybrid="process_group")),
    ("hybrid_zero2_flat_groups", case_fsdp1("_HYBRID_SHARD_ZERO2", False,
                                            hybrid="process_group")),
    ("hybrid_zero2_orig", case_fsdp1("_HYBRID_SHARD_ZERO2", True)),
    ("bf16_flat", case_fsdp1("FULL_SHARD", False, kind=BF16, nesting="manual")),
    ("bf16_hybrid_orig", case_fsdp1("HYBRID_SHARD", True, kind=BF16)),
    ("mixed_orig", case_fsdp1("FULL_SHARD", True, kind=MIXED)),
]
def case_hf_trainer_clip(orig: bool) -> Callable[[int, int], dict]:
    """The Hugging Face callback's route under FSDP1: the Trainer's call sequence (the
    callback handed the unwrapped model, ``accelerator.clip_grad_norm_(fsdp.parameters(),
    max_norm)`` after backward, ``on_pre_optimizer_step`` after it) with accelerate's own
    ``Accelerator.clip_grad_norm_`` on an accelerator that runs FSDP1 (accelerate runs FSDP
    only on an accelerator device, so its state is stood in for: the distributed type, its
    models, no scaler). Two steps of the same gradient, clipping at half its norm: what
    gradwatch published, the clip's total, and the full post-clip norm of every rank's shard."""

    def run(rank: int, world: int) -> dict:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        from gradwatch.integrations.huggingface import GradWatchCallback

        inner = _model(FP32)
        model = _wrap(inner, "FULL_SHARD", orig, FP32, "auto")

        class FSDP1Accelerator:
            distributed_type = DistributedType.FSDP
            is_fsdp2 = False
            scaler = None
            _models = (model,)

            def unscale_gradients(self) -> None:
                pass

        class Args:
            max_grad_norm = 0.0

        class State:
            global_step = 0
            log_history: tuple = ()

        ref = averaged_reference(FP32, rank, world)
        pre = math.sqrt(math.fsum(ref.values()))
        Args.max_grad_norm = 0.5 * pre
        callback = GradWatchCallback(config(groups=GROUPS, ratios=[]))
        callback.on_train_begin(Args(), State(), None, model=inner)
        out: dict[str, Any] = {"routed": callback.routed, "pre": pre, "steps": []}
        for _ in range(2):
            model.zero_grad()
            model(_inputs(FP32, rank)).sum().backward()
            total = Accelerator.clip_grad_norm_(
                FSDP1Accelerator(), model.parameters(), Args.max_grad_norm
            )
            callback.on_pre_optimizer_step(Args(), State(), None)
            State.global_step += 1
            local = math.fsum(float(x) ** 2 for g in _local_grads(model) if g is not None
                              for x in g.double().flatten().tolist())
            shards: list[Any] = [None] * world
            dist.all_gather_object(shards, local)
            assert callback.watch is not None
            snap = callback.watch.last
            out["steps"].append({
                "published": snap.global_norm if snap is not None else None,
                "step": snap.step if snap is not None else None,
                "clip_coef": snap.clip_coef if snap is not None else None,
                "total": float(total),
                "post_clip": math.sqrt(math.fsum(shards)),
            })
        out["max_norm"] = Args.max_grad_norm
        callback.on_train_end(Args(), State(), None)
        out["route_removed"] = "clip_grad_norm_" not in Accelerator.__dict__ or (
            Accelerator.clip_grad_norm_.__qualname__ == "Accelerator.clip_grad_norm_")
        return out

    return run


HF = [("hf_flat", case_hf_trainer_clip(False)), ("hf_orig", case_hf_trainer_clip(True))]

SUITES = {"w2": W2, "w4": W4, "hf": HF}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite])
