"""The optimizer-step guard on 2 and 4 ranks (gloo, CPU), DDP and FSDP2 with fused AdamW.

A NaN injected on one rank before the reduction and a 200x loss spike are both skipped:
parameters (and the optimizer's step counters) are bitwise unchanged on every rank over that
step, every rank takes the same decision on every step, the replicas are bitwise equal after
the run, at most one of 200 normal steps is skipped without cause, and the warm guarded steps
read no scalar to the host (a dispatch-mode count).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]

NORMAL_STEPS = 200
NAN_STEP = 120  # within the normal run, after the spike window's warm-up
SPIKE_STEP = 160
COUNTED = range(100, 110)  # warm guarded steps whose host reads are counted


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _guard_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {kind: _guarded_run(rank, world, kind) for kind in KINDS}
        Path(out, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _guarded_run(rank: int, world: int, kind: str) -> dict:
    """200 normal steps, a NaN on one rank and a 200x spike, under ``kind``; this rank's
    decisions, host reads and the replicas' agreement."""
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.doctor.testing import OpCounter

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    cfg = WatchConfig(skip_spike_score=6.0, collective_timeout_seconds=60)
    watch = GradWatch(model, cfg)
    guarded = watch.guard(opt)
    gen = torch.Generator().manual_seed(1000 + rank)
    skipped: list[int] = []
    scalar_reads = 0
    steps_before: list[float] = []
    for step in range(NORMAL_STEPS + 2):
        x = torch.randn(16, 12, generator=gen)
        if step == NAN_STEP and rank == world - 1:
            x[3, 5] = float("nan")  # one rank only, before DDP's / FSDP's reduction
        y = torch.randn(16, 3, generator=gen)  # noise targets: a steady gradient norm
        loss = (model(x) - y).pow(2).mean()
        if step == SPIKE_STEP:
            loss = loss * 200.0
        before = [_local(p).detach().clone() for p in model.parameters()]
        loss.backward()
        if step in (NAN_STEP, SPIKE_STEP):
            steps_before = [float(s["step"]) for s in opt.state.values()] or [0.0]
        if step in COUNTED:
            with OpCounter() as ops:
                guarded.step()
            scalar_reads += ops.scalar_reads
        else:
            guarded.step()
        guarded.zero_grad()
        after = [_local(p).detach() for p in model.parameters()]
        if all(torch.equal(a, b) for a, b in zip(before, after, strict=True)):
            skipped.append(step)
            unchanged_counters = [float(s["step"]) for s in opt.state.values()] or [0.0]
            if step in (NAN_STEP, SPIKE_STEP):
                assert unchanged_counters == steps_before, (step, unchanged_counters)
    full = [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().flatten()
        for p in model.parameters()
    ]
    gathered: list[list[float] | None] = [None] * world
    dist.all_gather_object(gathered, torch.cat(full).tolist())
    totals = dict(watch.last.skipped_steps) if rank == 0 and watch.last else {}
    watch.close()
    return {
        "skipped": skipped,
        "scalar_reads": scalar_reads,
        "replicas_equal": all(g == gathered[0] for g in gathered),
        "finite": all(v == v for v in gathered[0] or []),
        "totals": totals,
    }


KINDS = ("ddp", "fsdp2")


@pytest.mark.parametrize("world", [2, 4])
def test_guard_skips_nan_and_spike_on_every_rank(tmp_path: Path, world: int) -> None:
    spawn_world(_guard_worker, world, (str(tmp_path),), timeout=240)
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    for kind in KINDS:
        _check(kind, [r[kind] for r in per_rank])


def _check(kind: str, results: list[dict]) -> None:
    first = results[0]
    for rank, res in enumerate(results):
        assert res["skipped"] == first["skipped"], f"{kind}: rank {rank} decided otherwise"
        assert res["replicas_equal"] and res["finite"], kind
        assert res["scalar_reads"] == 0, f"{kind} rank {rank}: {res['scalar_reads']} host reads"
    assert NAN_STEP in first["skipped"] and SPIKE_STEP in first["skipped"], (kind, first)
    without_cause = [s for s in first["skipped"] if s not in (NAN_STEP, SPIKE_STEP)]
    assert len(without_cause) <= 1, (kind, without_cause)
    assert first["totals"]["nonfinite"] == 1, kind
    assert first["totals"]["spike"] == 1 + len(without_cause), kind
