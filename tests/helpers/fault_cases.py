"""Workers of tests/distributed/test_fault_matrix.py: every fault of one rank, under every
parallelism, on one spawned gloo world each (cases batched, small models, short timeouts).

Each case trains ``STEPS`` steps: a clip (``clip_grad_norm_``) on steps ``CLIP_STEPS``, a
monitoring collect otherwise. Monitoring collects take the host gloo thread (the route NCCL
jobs take), clips the device group. The last rank is the faulty one; rank 0 publishes (a sink
records every published snapshot). Every rank records its clip norms and its float64 reference
(exact squares of its local gradients, summed over the ranks holding different parts).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import Stage, run_suite
from torch import nn

TIMEOUT_S = 1.0  # collective_timeout_seconds of every case (it bounds construction too)
STEPS = 8
CLIP_STEPS = (1, 4, 7)
MAX_NORM = 0.5  # below the norms: every clip scales
#: The fault's steps, per fault (the straggler's delay is 3x the timeout).
FAULT_STEPS: dict[str, tuple[int, ...]] = {
    "none": (),
    "raise": (2, 4),  # a collect, then a clip
    "host_thread": (2, 6),  # monitoring collects (the host thread feeds those only)
    "straggler": (2, 4),
    "close": (5,),  # closed before step 5's collect, training goes on
}
STRAGGLE_S = 3 * TIMEOUT_S
PARALLELISMS = ("ddp", "ddp_always", "fsdp2", "pipeline")


class _Recorder:
    """A sink: the steps rank 0 published, with their whole-model norm."""

    def __init__(self) -> None:
        self.published: dict[int, float] = {}

    def write(self, snapshot: Any) -> None:
        self.published[int(snapshot.step)] = float(snapshot.global_norm)


def _model(parallelism: str, rank: int) -> tuple[nn.Module, dict[str, Any], bool]:
    """The model, GradWatch's extra arguments, and whether its ranks hold identical replicas."""
    torch.manual_seed(0)
    if parallelism in ("ddp", "ddp_always"):
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        return nn.parallel.DistributedDataParallel(net), {}, True
    if parallelism == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
        return net, {}, False
    torch.manual_seed(rank)
    return Stage(rank, 6, 3), {"stage_group": dist.group.WORLD}, False


def _reference(model: nn.Module, replicas: bool) -> float:
    """The whole model's gradient norm in float64: exact squares of every local gradient
    (``math.fsum``), summed over the ranks holding different parts."""
    local = []
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        g = getattr(g, "_local_tensor", g)
        local.extend(float(x) ** 2 for x in g.detach().double().flatten().tolist())
    sq = math.fsum(local)
    if replicas:
        return math.sqrt(sq)
    total = torch.tensor([sq], dtype=torch.float64)
    dist.all_reduce(total)
    return math.sqrt(float(total))


def _inject(watch: Any, fault: str, rank: int, world: int, step: int) -> Callable[[], None]:
    """Arm ``fault`` on the last rank at its steps; returns the disarm."""
    if rank != world - 1 or step not in FAULT_STEPS[fault]:
        return lambda: None
    if fault == "raise":
        return _arm_raise(watch)
    if fault == "host_thread":
        host = watch._reducer.collective._host
        real_land = host._land

        def stuck(*args: Any) -> None:
            raise RuntimeError("injected: the copy never landed")

        host._land = stuck
        issued = watch._reducer.issued
        copies = host.failed_copies

        def disarm() -> None:
            # The thread stands in asynchronously: restore once it took this collect's vector
            # (a collect that issued nothing, e.g. DDP's default path, has none).
            if watch._reducer.issued > issued:
                threading_wait(lambda: host.failed_copies > copies)
            host._land = real_land

        return disarm
    if fault == "straggler":
        time.sleep(STRAGGLE_S)
    if fault == "close":
        watch.close()
    return lambda: None


def _arm_raise(watch: Any) -> Callable[[], None]:
    """Make this rank's local pass raise (its norm engine's); returns the disarm."""
    engine = watch._collector.engine
    real = engine.squared_norms_and_plan

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the local pass raised")

    engine.squared_norms_and_plan = boom
    return lambda: setattr(engine, "squared_norms_and_plan", real)


def _digest(model: nn.Module) -> str:
    """The bytes of every parameter (local shards): equal digests, bitwise-equal replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(getattr(p, "_local_tensor", p).detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def threading_wait(done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.001)


def case(parallelism: str, fault: str) -> Callable[[int, int], dict[str, Any]]:
    def run(rank: int, world: int) -> dict[str, Any]:
        from gradwatch import GradWatch, WatchConfig, collective

        collective.MONITOR_ON_HOST_BACKENDS = ("nccl", "gloo")
        model, extra, replicas = _model(parallelism, rank)
        cfg = WatchConfig(
            port=None,
            collective_timeout_seconds=TIMEOUT_S,
            always_reduce=parallelism == "ddp_always",
            divergence_every=3,
        )
        watch = GradWatch(model, cfg, **extra)
        recorder = _Recorder()
        if rank == 0:
            watch.add_sink(recorder)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        steps: list[dict[str, Any]] = []
        dist.barrier()
        started = time.monotonic()
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step + rank)
            model(torch.randn(4, 6)).pow(2).sum().backward()
            ref = _reference(model, replicas)
            disarm = _inject(watch, fault, rank, world, step)
            rec: dict[str, Any] = {"step": step, "reference": ref}
            if step in CLIP_STEPS:
                rec["clip"] = float(watch.clip_grad_norm_(MAX_NORM, step=step))
            else:
                watch.collect(step)
            disarm()
            opt.step()
            steps.append(rec)
        seconds = time.monotonic() - started
        flushed = watch.flush(timeout=10 * TIMEOUT_S + 10)
        errors = dict(watch._reporter.stats._internal_errors) if rank == 0 else {}
        out = {
            "steps": steps,
            "seconds": seconds,
            "published": recorder.published,
            "flushed": flushed,
            "broken": watch._collector.broken,
            "internal_errors": errors,
            "params": _digest(model),
        }
        watch.close()
        return out

    return run


#: The guarded case (DDP's default path, fused AdamW, ``skip_nonfinite`` and
#: ``skip_spike_score``): the last rank's local pass raises on ``GUARD_RAISE_STEPS``, among them
#: the step whose gradients hold a NaN (from one rank, before DDP's reduction; decided in the
#: guarded ``step()``'s own collect) and the 200x spike (decided from the step's clip).
GUARD_STEPS = 12
GUARD_CLIP_STEPS = (1, 4, 8)
GUARD_NAN_STEP = 6
GUARD_SPIKE_STEP = 8
GUARD_RAISE_STEPS = (3, GUARD_NAN_STEP, GUARD_SPIKE_STEP)
#: With ``always_reduce`` the failing rank stands in: on a normal step and on the step right
#: after the NaN skip (where the others' consecutive-skip count returns to 0).
GUARD_STAND_IN_RAISE_STEPS = (3, GUARD_NAN_STEP + 1)


def guard_case(rank: int, world: int, always_reduce: bool = False) -> dict[str, Any]:
    """Each rank's guard decisions (their host readings, ``None``: no decision) and whether
    its parameters changed, per step; its guard's device state and its parameters' digest at
    the end. ``always_reduce``: every collect all-reduces, so the failing rank stands in."""
    from gradwatch import GradWatch, WatchConfig

    model, _, _ = _model("ddp", rank)
    cfg = WatchConfig(
        port=None, collective_timeout_seconds=TIMEOUT_S, divergence_every=5,
        skip_nonfinite=True, skip_spike_score=6.0, spike_window=8, spike_warmup=4,
        always_reduce=always_reduce,
    )
    raise_steps = GUARD_STAND_IN_RAISE_STEPS if always_reduce else GUARD_RAISE_STEPS
    watch = GradWatch(model, cfg)
    collector = watch._collector
    decide = collector.guard_decision
    decisions: list[Any] = []

    def recorded(scaler: Any, optimizer: Any) -> Any:
        decision = decide(scaler, optimizer)
        decisions.append(decision)
        return decision

    collector.guard_decision = recorded  # type: ignore[method-assign]
    opt = watch.guard(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    changed: list[bool] = []
    for step in range(GUARD_STEPS):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step + rank)
        loss = model(torch.randn(4, 6)).pow(2).sum()
        if step == GUARD_NAN_STEP and rank == 0:
            loss = loss * math.nan  # one rank's NaN: DDP's all-reduce spreads it
        if step == GUARD_SPIKE_STEP:
            loss = loss * 200.0
        loss.backward()
        before = _digest(model)
        armed = rank == world - 1 and step in raise_steps
        disarm = _arm_raise(watch) if armed else lambda: None
        if step in GUARD_CLIP_STEPS:
            watch.clip_grad_norm_(MAX_NORM, step=step)
        opt.step()  # the clip's decision, or a collect of its own
        disarm()
        changed.append(_digest(model) != before)
    guard = collector.guard
    assert guard is not None and guard._window is not None
    state = [guard._consecutive, guard._skipped, guard._skipped_nonfinite,
             guard._window.samples]
    out = {
        "decisions": [None if d is None else repr(d.reading()) for d in decisions],
        "changed": changed,
        "guard_state": repr([t.tolist() for t in state]),
        "params": _digest(model),
    }
    watch.close()
    return out


def guard_stand_in_case(rank: int, world: int) -> dict[str, Any]:
    """:func:`guard_case` with ``always_reduce``: the failing rank's stand-in all-reduce."""
    return guard_case(rank, world, always_reduce=True)


GUARD_CASES = ("guard/raise", "guard_always/raise")
CASES: list[tuple[str, Callable[[int, int], dict[str, Any]]]] = [
    (f"{p}/{f}", case(p, f)) for p in PARALLELISMS for f in FAULT_STEPS
] + list(zip(GUARD_CASES, (guard_case, guard_stand_in_case), strict=True))


def worker(rank: int, world: int, port: int, out: str, suite: str = "") -> None:
    run_suite(rank, world, port, out, CASES)


DEATH_STEP = 3
DEATH_TIMEOUT_S = 5.0


def dying_worker(rank: int, world: int, port: int, out: str) -> None:
    """A pipeline job whose last rank dies (``os._exit``) before step ``DEATH_STEP``'s collect:
    the others' collects never wait, every survivor stops collecting, visibly, within bounds."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    res: dict[str, Any] = {"collect_seconds": [], "errors": []}
    try:
        from gradwatch import GradWatch, WatchConfig, collective

        collective.MONITOR_ON_HOST_BACKENDS = ("nccl", "gloo")
        model, extra, _ = _model("pipeline", rank)
        watch = GradWatch(
            model, WatchConfig(port=None, collective_timeout_seconds=DEATH_TIMEOUT_S), **extra
        )
        dist.barrier()
        started = time.monotonic()
        for step in range(STEPS):
            if rank == world - 1 and step == DEATH_STEP:
                os._exit(0)
            model.zero_grad(set_to_none=True)
            model(torch.randn(4, 6)).pow(2).sum().backward()
            t0 = time.monotonic()
            pending = watch.collect(step)
            res["collect_seconds"].append(time.monotonic() - t0)
            if step >= DEATH_STEP:
                time.sleep(0.2)  # the peer's death reaches gloo
            if rank == 0:  # the publisher's read; the other survivors never wait
                try:
                    pending.result()
                except Exception as exc:
                    res["errors"].append(f"{step}: {type(exc).__name__}: {exc}")
        res["seconds"] = time.monotonic() - started
        res["broken"] = watch._collector.broken
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
    Path(out, f"{rank}.json").write_text(json.dumps(res, default=str))
    os._exit(0)  # the group lost a rank: no orderly teardown
