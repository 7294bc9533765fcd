"""Warm collects, clips and guarded steps read nothing back and build nothing from Python data,
on every documented path that runs on a CPU: DDP, FSDP1, FSDP2 (2 gloo ranks). Counted with
gradwatch's dispatch-mode instruments (``OpCounter``: ``aten._local_scalar_dense``;
``BlockingCopyCounter``: tensors made from Python data, which on an accelerator travel by a
blocking copy, and blocking host<->device copies). ZeRO: tests/distributed/test_zero.py;
Lightning: test_integration_cost.py; gradients split between host and device:
tests/unit/norms/test_stats.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]

KINDS = ("ddp", "fsdp1", "fsdp2")
MODES = ("collect", "clip", "guard")
COLD = 2  # steps that build plans and buffers
STEPS = 5


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, device_id=torch.device("cpu"))
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def _counted(rank: int, kind: str, mode: str) -> list[list[Any]]:
    """[python tensors, blocking copies, scalar reads, ops seen] of each warm step."""
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.doctor.testing import OpCounter, count_blocking_copies

    model = _model(kind)
    # Guarded: a fused optimizer takes the decision on the device (a non-fused one reads it,
    # one scalar per step, as docs/integrations.md says).
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if mode == "guard"
        else torch.optim.SGD(model.parameters(), lr=1e-3)
    )
    watch = GradWatch(model, WatchConfig(collective_timeout_seconds=60))
    guarded = watch.guard(opt) if mode == "guard" else None
    gen = torch.Generator().manual_seed(100 + rank)
    counts = []
    for step in range(STEPS):
        loss = model(torch.randn(8, 12, generator=gen)).pow(2).mean()
        loss.backward()
        with count_blocking_copies() as copies, OpCounter() as ops:
            if mode == "collect":
                watch.collect(step)
            elif mode == "clip":
                watch.clip_grad_norm_(1e-3, step=step)
            else:
                assert guarded is not None
                guarded.step()
        if step >= COLD:
            counts.append([copies.python_tensors, copies.blocking_copies, ops.scalar_reads,
                           copies.describe()])
        if guarded is None:
            opt.step()
        opt.zero_grad()
    assert watch.last is not None and watch.last.step == STEPS - 1
    watch.close()
    return counts


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {f"{k}/{m}": _counted(rank, k, m) for k in KINDS for m in MODES}
        Path(out, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("warm_costs")
    spawn_world(_worker, 2, (str(out),), timeout=240)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_warm_steps_read_nothing_and_build_nothing(
    counted: list[dict[str, Any]], kind: str, mode: str
) -> None:
    for rank, per_rank in enumerate(counted):
        steps = per_rank[f"{kind}/{mode}"]
        assert len(steps) == STEPS - COLD
        for python_tensors, blocking, scalar_reads, seen in steps:
            assert (python_tensors, blocking, scalar_reads) == (0, 0, 0), (rank, seen)
