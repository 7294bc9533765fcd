"""Worker side of tests/distributed/test_zero.py: DeepSpeed ZeRO stages 0-3 on CPU (gloo), every
case inside one spawned world.

Same conventions as :mod:`dist_cases` (one spawned gloo world per suite, every case collective,
results as JSON per rank; cases measure, the test module asserts). DeepSpeed runs on the CPU
accelerator (``DS_ACCELERATOR=cpu``, set before it is imported) with torch's Adam
(``"torch_adam": true``: no compiled op). Its shared-memory collective op, which it would
JIT-compile at ``init_distributed`` on CPU, is not built: gloo carries every collective.

References, both float64 ``math.fsum`` over exact values:

* the *replica*: an unsharded copy of the model with the same weights, run on every rank's
  data, its per-rank gradients averaged in float64 (the averaged full gradient);
* DeepSpeed's own full gradient (``deepspeed.utils.safe_get_full_grad``: a gather, here only):
  the very values its optimizer will use, which a bf16 replica cannot reproduce bit for bit
  (DeepSpeed averages bf16 gradients in bf16).
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from dist_cases import CollectiveSpy, compare, fsum_sq, run_suite
from torch import nn

GROUPS = {"body": ["body.*"], "head": ["head.*"]}
MICRO_BATCH = 4


class Net(nn.Module):
    """Parameters of several sizes (so partitions split some of them), a frozen one."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(7, width), nn.Tanh(), nn.Linear(width, 5))
        self.head = nn.Linear(5, 3)
        self.frozen = nn.Linear(7, 2)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x))).sum(-1) + self.frozen(x).sum(-1)


def init_deepspeed() -> Any:
    """Import DeepSpeed on the CPU accelerator and adopt the suite's gloo process group."""
    import deepspeed
    import deepspeed.comm.torch

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo only, no JIT op
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()))
    deepspeed.init_distributed("gloo")
    return deepspeed


def ds_config(stage: int, dtype: str = "fp32", gas: int = 1, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


def engine_and_replica(stage: int, dtype: str = "fp32", width: int = 16,
                       **extra: Any) -> tuple[Any, nn.Module]:
    deepspeed = init_deepspeed()
    torch.manual_seed(0)
    model = Net(width)
    replica = copy.deepcopy(model)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(stage, dtype, **extra))
    return engine, replica


def batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 97 * rank + 13 * step + micro)
    return torch.randn(MICRO_BATCH, 7, generator=g)


def _low(engine: Any) -> torch.dtype:
    return next(p for p in engine.module.parameters()).dtype


def backward(engine: Any, step: int, micro: int = 0) -> None:
    x = batch(dist.get_rank(), step, micro).to(_low(engine))
    engine.backward(engine(x).float().pow(2).mean())


def replica_reference(replica: nn.Module, step: int, dtype: torch.dtype,
                      gas: int = 1) -> dict[str, float | None]:
    """name -> exact squared norm of the gradient averaged over every rank's data (and the
    accumulation micro-steps), from an unsharded copy run on each rank's batch."""
    model = copy.deepcopy(replica).to(dtype)
    total: dict[str, torch.Tensor] = {}
    world = dist.get_world_size()
    for rank in range(world):
        for micro in range(gas):
            model.zero_grad(set_to_none=True)
            (model(batch(rank, step, micro).to(dtype)).float().pow(2).mean() / gas).backward()
            for name, p in model.named_parameters():
                if p.grad is not None:
                    g = p.grad.detach().double() / world
                    total[name] = total[name] + g if name in total else g
    return {n: (fsum_sq(total[n]) if n in total else None) for n, _ in model.named_parameters()}


def deepspeed_reference(engine: Any) -> dict[str, float | None]:
    """name -> exact squared norm of DeepSpeed's own full gradient (a collective gather:
    every rank calls it in the same order; tests only)."""
    from deepspeed.utils import safe_get_full_grad

    out: dict[str, float | None] = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p) if p.requires_grad else None
        out[name] = None if g is None else fsum_sq(g)
    return out


def advance_replica(replica: nn.Module, engine: Any) -> None:
    """Give the replica the engine's updated weights (gathered under ZeRO-3; tests only)."""
    from deepspeed.utils import safe_get_full_fp32_param

    with torch.no_grad():
        for (_name, p), (_n, q) in zip(engine.module.named_parameters(),
                                       replica.named_parameters(), strict=True):
            if not p.requires_grad:  # frozen: never changes
                continue
            full = safe_get_full_fp32_param(p)
            if full is None:  # stage 0: the parameter itself is whole
                full = p.detach()
            q.copy_(full.reshape(q.shape).to(q.dtype))


def config(**overrides: Any) -> Any:
    from gradwatch import WatchConfig

    base: dict[str, Any] = {"groups": GROUPS, "collective_timeout_seconds": 30,
                            "exploding_threshold": 1e30}
    base.update(overrides)
    return WatchConfig(**base)


def case_exact(stage: int, dtype: str = "fp32", steps: int = 2,
               **extra: Any) -> Callable[[int, int], dict]:
    """Every figure against the replica (fp32: 1e-6; bf16: its rounding) and against
    DeepSpeed's own full gradient (1e-6), one gradwatch collective per collect, and
    DeepSpeed's own global norm after the step (sanity)."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        engine, replica = engine_and_replica(stage, dtype, **extra)
        watch = GradWatch(engine, config())
        out: dict[str, Any] = {"replica_err": [], "deepspeed_err": [], "collectives": [],
                               "mismatches": [], "global_norm": [], "deepspeed_norm": [],
                               "parallelism": watch.parallelism, "groups": []}
        low = _low(engine)
        for step in range(steps):
            backward(engine, step)
            ref_ds = deepspeed_reference(engine)
            ref_replica = replica_reference(replica, step, low)
            with CollectiveSpy() as spy:
                snap = watch.collect(step).result()
            out["collectives"].append(spy.collectives)
            found = compare(snap, ref_ds, watch)
            out["deepspeed_err"].append(found["max_rel_err"])
            out["mismatches"] += found["mismatches"]
            out["replica_err"].append(compare(snap, ref_replica, watch)["max_rel_err"])
            out["global_norm"].append(snap.global_norm)
            out["groups"].append({k: g.norm for k, g in snap.groups.items()})
            engine.step()
            norm = engine.get_global_grad_norm()
            out["deepspeed_norm"].append(None if norm is None else float(norm))
            advance_replica(replica, engine)
        watch.close()
        return out

    return run


def case_loss_scale(rank: int, world: int) -> dict:
    """A loss scale of 1024 in DeepSpeed's ZeRO loss scaler (the one its fp16 mode drives; its
    CPU accelerator refuses fp16 itself): figures are of the unscaled gradients, as
    DeepSpeed's own norm is."""
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(2)
    engine.optimizer.loss_scaler.cur_scale = 1024.0  # static: backward scales, step unscales
    watch = GradWatch(engine, config())
    backward(engine, 0)
    ref = deepspeed_reference(engine)  # DeepSpeed's full gradients still carry the scale
    scale = float(engine.optimizer.loss_scale)
    unscaled = {n: (None if v is None else v / scale**2) for n, v in ref.items()}
    snap = watch.collect(0).result()
    found = compare(snap, unscaled, watch)
    engine.step()
    norm = engine.get_global_grad_norm()
    watch.close()
    return {"err": found["max_rel_err"], "scale": scale, "global_norm": snap.global_norm,
            "deepspeed_norm": None if norm is None else float(norm)}


def case_accumulation(rank: int, world: int) -> dict:
    """Two micro-steps per optimizer step: off the boundary a collect is "not measured" (never
    zeros) and issues no collective; on it, the accumulated average is exact."""
    from gradwatch import GradWatch

    engine, replica = engine_and_replica(2, gas=2)
    watch = GradWatch(engine, config())
    backward(engine, 0, micro=0)
    with CollectiveSpy() as spy:
        pending = watch.collect(0)
    try:
        off: Any = pending.result().global_norm
    except Exception as exc:
        off = f"{type(exc).__name__}: {exc}"
    engine.step()  # off the boundary: no optimizer step
    backward(engine, 0, micro=1)
    snap = watch.collect(1).result()
    ref = replica_reference(replica, 0, torch.float32, gas=2)
    found = compare(snap, ref, watch)
    engine.step()
    watch.close()
    return {"off": off, "off_collectives": spy.collectives, "err": found["max_rel_err"],
            "mismatches": found["mismatches"]}


def case_clip(rank: int, world: int) -> dict:
    """clip_grad_norm_ with DeepSpeed's own clipping off: the pre-clip whole-model norm, the
    partitions clipped in place (DeepSpeed's norm in step() is then the clipped one)."""
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(2)
    watch = GradWatch(engine, config())
    backward(engine, 0)
    ref = deepspeed_reference(engine)
    exact = math.sqrt(math.fsum(v for v in ref.values() if v is not None))
    max_norm = exact / 4
    with CollectiveSpy() as spy:
        total = float(watch.clip_grad_norm_(max_norm, step=0))
    after = deepspeed_reference(engine)
    clipped = math.sqrt(math.fsum(v for v in after.values() if v is not None))
    engine.step()
    ds_norm = engine.get_global_grad_norm()
    watch.close()
    return {"total": total, "exact": exact, "max_norm": max_norm, "clipped": clipped,
            "collectives": spy.collectives, "deepspeed_norm": float(ds_norm)}


def case_clip_refused(rank: int, world: int) -> dict:
    """DeepSpeed clips itself (gradient_clipping > 0): clip_grad_norm_ (a number or "auto")
    refuses, collect()
    measures the pre-clip gradients, which audit DeepSpeed's own norm."""
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(2, gradient_clipping=0.05)
    watch = GradWatch(engine, config())
    backward(engine, 0)
    refused: list[str] = []
    for max_norm in (1.0, "auto"):
        try:
            watch.clip_grad_norm_(max_norm, step=0)
            refused.append("")
        except Exception as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    started = watch._collector.history is not None  # a refused "auto" starts no history
    snap = watch.collect(0).result()
    engine.step()
    ds_norm = float(engine.get_global_grad_norm())
    watch.audit_norm(ds_norm, step=0, source="deepspeed")
    watch.flush()
    watch.close()
    return {"refused": refused, "started": started, "global_norm": snap.global_norm,
            "deepspeed_norm": ds_norm}


def case_refused(kind: str) -> Callable[[int, int], dict]:
    """Setups gradwatch cannot measure exactly: refused at construction, naming the case."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        extra: dict[str, Any] = {}
        stage, dtype = 2, "fp32"
        if kind == "offload_optimizer":
            extra = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                     "zero_force_ds_cpu_optimizer": False}
        elif kind == "offload_param":
            stage = 3
            extra = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                     "zero_force_ds_cpu_optimizer": False}
        elif kind == "bf16_optimizer":
            stage, dtype = 1, "bf16"
            extra = {"data_types": {"grad_accum_dtype": "fp32"}}
        engine, _ = engine_and_replica(stage, dtype, **extra)
        try:
            GradWatch(engine, config()).close()
            return {"error": "", "optimizer": type(engine.optimizer).__name__}
        except Exception as exc:
            return {"refusal": f"{type(exc).__name__}: {exc}",
                    "optimizer": type(engine.optimizer).__name__}

    return run


def case_unwrapped_module(rank: int, world: int) -> dict:
    """GradWatch given the module a framework hands its callbacks: the engine training it is
    found, so the figures are the partitions', not the empty ``.grad``s."""
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(3)
    watch = GradWatch(engine.module, config())
    backward(engine, 0)
    ref = deepspeed_reference(engine)
    snap = watch.collect(0).result()
    found = compare(snap, ref, watch)
    try:
        watch.attach(engine.optimizer)  # no hook can see the gradients: refused
        attach = ""
    except Exception as exc:
        attach = f"{type(exc).__name__}: {exc}"
    engine.step()
    watch.close()
    return {"err": found["max_rel_err"], "parallelism": watch.parallelism,
            "global_norm": snap.global_norm, "attach": attach}


def case_temporaries(stage: int) -> Callable[[int, int], dict]:
    """No gradient-sized temporary: the largest allocation of a warm collect against this
    rank's gradient bytes."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch
        from gradwatch.doctor.testing import largest_allocation

        engine, _replica = engine_and_replica(stage, width=8192)
        watch = GradWatch(engine, config())
        backward(engine, 0)
        watch.collect(0).result()  # builds the plan (persistent buffers)
        local = watch._resolved.gradients.read().tensors
        local_bytes = sum(t.numel() * t.element_size() for t in local if t is not None)
        largest = largest_allocation(lambda: watch.collect(1).result())
        engine.step()
        watch.close()
        return {"largest": largest, "local_bytes": local_bytes}

    return run


def case_overflow_skips(rank: int, world: int) -> dict:
    """Steps DeepSpeed's loss scaler skips on an overflow (non-finite gradients at steps 1 and
    2): each collect reports the steps the engine skipped since the previous collect (None on
    the first), and the published counter counts them under ``deepspeed_overflow``."""
    from gradwatch import GradWatch
    from gradwatch.export.state import PublishedState

    engine, _replica = engine_and_replica(2)
    engine.optimizer.loss_scaler.cur_scale = 1024.0  # the scaler that detects overflows
    watch = GradWatch(engine, config())
    state = PublishedState(config())
    skipped: list[Any] = []
    for step in range(4):
        x = batch(dist.get_rank(), step).to(_low(engine))
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss * float("inf") if step in (1, 2) else loss)
        snap = watch.collect(step).result()
        state.write(snap)
        skipped.append(snap.deepspeed_skipped_steps)
        engine.step()
    watch.close()
    counts = dict(state.current().counts.step_skips)
    return {"skipped": skipped, "engine_skipped": int(engine.skipped_steps), "counts": counts}


def case_update_stats(stage: int, dtype: str = "fp32") -> Callable[[int, int], dict]:
    """``update_stats`` under ZeRO: the weight norm and the applied update of the fp32 master
    weights, against full fp32 copies gathered before and after each step (tests only).
    Stage 0 steps the parameters themselves (frozen ones included in the weight norm); stages
    1-2 the master weights of the trained parameters only (DeepSpeed keeps none of frozen
    ones)."""

    def full_master(engine: Any) -> list[torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        out = []
        for p in engine.module.parameters():
            if not p.requires_grad and stage > 0:
                continue
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            out.append((p.detach() if full is None else full).double().clone().reshape(-1))
        return out

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        engine, _replica = engine_and_replica(stage, dtype)
        watch = GradWatch(engine, config(update_stats=True))
        rows: list[dict[str, Any]] = []
        previous: float | None = None
        for step in range(3):
            backward(engine, step)
            before = full_master(engine)
            snap = watch.collect(step).result()
            rows.append({"weight": snap.weight_norm, "update": snap.update_norm,
                         "ref_weight": math.sqrt(math.fsum(fsum_sq(t) for t in before)),
                         "ref_update": previous})
            engine.step()
            after = full_master(engine)
            previous = math.sqrt(math.fsum(fsum_sq(a - b) for a, b in zip(after, before,
                                                                           strict=True)))
        watch.close()
        return {"rows": rows}

    return run


def case_warm_costs(stage: int, dtype: str, loss_scale: float | None) -> Callable[[int, int], dict]:
    """Warm collects and clips (after two cold steps): tensors built from
    Python data, blocking host<->device copies and scalar reads, counted by gradwatch's
    dispatch-mode counters. ``loss_scale``: DeepSpeed's fp16 loss scale set in its loss
    scaler (its CPU accelerator refuses fp16 itself), whose division is what is checked."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch
        from gradwatch.doctor.testing import OpCounter, count_blocking_copies

        engine, _replica = engine_and_replica(stage, dtype)
        if loss_scale is not None:
            engine.optimizer.loss_scaler.cur_scale = loss_scale
        watch = GradWatch(engine, config())
        out: dict[str, Any] = {"counts": []}
        for step in range(4):
            backward(engine, step)
            with count_blocking_copies() as copies, OpCounter() as ops:
                if step % 2:
                    watch.clip_grad_norm_(1e6, step=step)  # gradwatch clips, DeepSpeed does not
                else:
                    watch.collect(step)
            if step >= 2:
                out["counts"].append([copies.python_tensors, copies.blocking_copies,
                                      ops.scalar_reads, copies.describe()])
            out["last"] = watch.last.global_norm if watch.last is not None else None
            engine.step()
        watch.close()
        return out

    return run


SUITES: dict[str, list[tuple[str, Callable[[int, int], dict]]]] = {
    "costs": [
        ("costs_s2_fp16", case_warm_costs(2, "fp32", 1024.0)),
        ("costs_s3_fp16", case_warm_costs(3, "fp32", 1024.0)),
        ("costs_s2_bf16", case_warm_costs(2, "bf16", None)),
    ],
    "w2": [
        *[(f"exact_s{s}_{d}", case_exact(s, d)) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")],
        # bf16 parameters accumulating fp32 gradients: ZeRO-2's compact fp32 partition buffer
        ("exact_s2_bf16_fp32acc",
         case_exact(2, "bf16", data_types={"grad_accum_dtype": "fp32"})),
        ("exact_s3_bf16_fp32acc",
         case_exact(3, "bf16", data_types={"grad_accum_dtype": "fp32"})),
        ("loss_scale", case_loss_scale),
        ("accumulation", case_accumulation),
        ("clip", case_clip),
        ("clip_refused", case_clip_refused),
        ("refused_offload_optimizer", case_refused("offload_optimizer")),
        ("refused_offload_param", case_refused("offload_param")),
        ("refused_bf16_optimizer", case_refused("bf16_optimizer")),
        ("unwrapped_module", case_unwrapped_module),
        ("temporaries_s2", case_temporaries(2)),
        ("temporaries_s3", case_temporaries(3)),
    ],
    "overflow": [("overflow_skips", case_overflow_skips)],
    "updates": [(f"update_stats_s{s}", case_update_stats(s)) for s in (0, 1, 2, 3)]
    + [(f"update_stats_s{s}_bf16", case_update_stats(s, "bf16")) for s in (2, 3)],
    "w4": [
        ("exact_s3_fp32", case_exact(3, "fp32")),
        ("exact_s2_bf16", case_exact(2, "bf16")),
    ],
}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite])
