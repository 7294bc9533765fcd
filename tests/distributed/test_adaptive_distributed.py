"""clip_grad_norm_("auto") on 2 ranks (gloo, CPU) under DDP, FSDP2, FSDP1 and tensor parallel.

120 steps with 40x gradient spikes at three steps after the 25-step warm-up: every spike's
post-clip whole-model norm (a float64 reference: full_tensor() gathers or an all-reduce of
math.fsum squares, tests only) is within 3x the typical norm, at most 5 ordinary post-warm-up
steps are clipped, the threshold, the coefficient, the warm-up count and the whole history are
bitwise equal on both ranks at every step, and the warm calls read no scalar to the host (a
dispatch-mode count).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]

STEPS = 120
WARMUP = 25
SPIKES = (50, 80, 105)  # after the warm-up
COUNTED = range(60, 70)  # warm calls whose host reads are counted
KINDS = ("ddp", "fsdp2", "fsdp1", "tp")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {kind: _run(rank, world, kind) for kind in KINDS}
        Path(out, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _wrap(kind: str, world: int) -> tuple[nn.Module, bool]:
    """The model under ``kind``; whether the ranks must see the same batch (TP)."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model), False
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        return fully_shard(model), False
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu")), False
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, True


def _post_clip_norm(model: nn.Module, kind: str) -> float:
    """The whole-model norm of the clipped gradients, float64 (every rank calls it)."""
    squares: list[float] = []
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        squares.extend(float(v) ** 2 for v in g.double().flatten())
    local = math.fsum(squares)
    if kind != "fsdp1":  # DDP: replicated; DTensors: gathered whole
        return math.sqrt(local)
    total = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(total)  # FSDP1: disjoint flat shards
    return math.sqrt(float(total))


def _run(rank: int, world: int, kind: str) -> dict:
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.doctor.testing import OpCounter

    model, same_batch = _wrap(kind, world)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = GradWatch(model, WatchConfig(collective_timeout_seconds=60))
    assert watch.config.adaptive_clip_warmup == WARMUP
    gen = torch.Generator().manual_seed(1000 + (0 if same_batch else rank))
    rows: list[dict] = []
    scalar_reads = 0
    for step in range(STEPS):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randn(16, 4, generator=gen)  # noise targets: a steady gradient norm
        loss = (model(x) - y).pow(2).mean() * (40.0 if step in SPIKES else 1.0)
        loss.backward()
        if step in COUNTED:
            with OpCounter() as ops:
                total = watch.clip_grad_norm_("auto", step=step)
            scalar_reads += ops.scalar_reads
        else:
            total = watch.clip_grad_norm_("auto", step=step)
        history = watch._collector.history
        assert history is not None and history.last is not None
        reading = history.last.reading()
        rows.append({
            "norm": float(total).hex(),
            "threshold": None if reading.threshold is None else reading.threshold.hex(),
            "limit": None if reading.limit is None else reading.limit.hex(),
            "coef": reading.coef.hex(),
            "samples": reading.samples,
            "state": [float(t).hex() for t in history.state()],
            "post": _post_clip_norm(model, kind),
        })
        opt.step()
        opt.zero_grad()
    watch.close()
    return {"rows": rows, "scalar_reads": scalar_reads}


def test_auto_clip_agrees_on_every_rank_and_cuts_spikes(tmp_path: Path) -> None:
    spawn_world(_worker, 2, (str(tmp_path),), timeout=420)
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for kind in KINDS:
        results = [r[kind] for r in per_rank]
        for res in results:
            assert res["scalar_reads"] == 0, (kind, res["scalar_reads"])
        first = results[0]["rows"]
        for step, (a, b) in enumerate(zip(first, results[1]["rows"], strict=True)):
            exact = {k: v for k, v in a.items() if k != "post"}
            assert exact == {k: v for k, v in b.items() if k != "post"}, (kind, step)
        norms = [float.fromhex(r["norm"]) for r in first]
        ordinary = [n for s, n in enumerate(norms) if s not in SPIKES]
        typical = sorted(ordinary)[len(ordinary) // 2]
        for step, row in enumerate(first):
            threshold = row["threshold"]
            assert (threshold is None) == (step < WARMUP), (kind, step)
            if threshold is not None:
                # the clipped gradients' norm, measured independently, is min(norm, limit)
                want = min(norms[step], float.fromhex(row["limit"]))
                assert row["post"] == pytest.approx(want, rel=1e-5), (kind, step)
        for spike in SPIKES:
            assert norms[spike] > 20 * typical, (kind, spike)
            assert first[spike]["post"] < 3 * typical, (kind, spike, first[spike]["post"])
        clipped = [
            s for s, row in enumerate(first)
            if s >= WARMUP and s not in SPIKES and float.fromhex(row["coef"]) < 1.0
        ]
        assert len(clipped) <= 5, (kind, clipped)
