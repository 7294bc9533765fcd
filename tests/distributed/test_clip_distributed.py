"""clip_grad_norm_ under FSDP2 and pipeline stages equals the whole-model result (gloo, CPU)."""

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


def _fsum_sq(tensors) -> float:
    return math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten().tolist())


def _fsdp2_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard

        from gradwatch import GradWatch, WatchConfig

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))  # uneven shards
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        torch.manual_seed(100 + rank)
        (model(torch.randn(5, 10)) * 40).pow(2).sum().backward()
        full = [p.grad.full_tensor().clone() for p in model.parameters()]
        pre = math.sqrt(_fsum_sq(full))
        max_norm = 0.25 * pre
        with GradWatch(model, WatchConfig(collective_timeout_seconds=60)) as watch:
            total = watch.clip_grad_norm_(max_norm, step=0)
            snap = watch.last
        coef = min(1.0, max_norm / (pre + 1e-6))
        errors = [
            float((p.grad.full_tensor().double() - f.double() * coef).abs().max())
            / float(f.double().abs().max() * coef)
            for p, f in zip(model.parameters(), full, strict=True)
        ]
        result = {
            "total": float(total),
            "pre": pre,
            "snap_global": snap.global_norm,
            "clip_coef": snap.clip_coef,
            "coef": coef,
            "max_grad_rel_err": max(errors),
        }
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _pipeline_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from gradwatch import GradWatch, WatchConfig

        torch.manual_seed(rank)
        stage = nn.ModuleDict({f"stage{rank}": nn.Linear(6 + rank, 4)})  # disjoint names
        # 1e18-scale gradients: their float32 squares overflow.
        (stage[f"stage{rank}"](torch.randn(3, 6 + rank)) * 1e18).sum().backward()
        local_sq = _fsum_sq([p.grad for p in stage.parameters()])
        both = [None] * world
        dist.all_gather_object(both, local_sq)
        pre = math.sqrt(math.fsum(both))
        local_before = [p.grad.clone() for p in stage.parameters()]
        torch_local = float(
            torch.nn.utils.get_total_norm([p.grad.double() for p in stage.parameters()])
        )
        with GradWatch(
            stage, WatchConfig(collective_timeout_seconds=60), stage_group=dist.group.WORLD
        ) as watch:
            total = watch.clip_grad_norm_(1.0, step=0)
        coef = min(1.0, 1.0 / (pre + 1e-6))
        err = max(
            float((p.grad.double() - b.double() * coef).abs().max())
            / float(b.double().abs().max() * coef)
            for p, b in zip(stage.parameters(), local_before, strict=True)
        )
        # A step the schedule skips is clipped by the whole-model norm too, without a snapshot.
        for p, b in zip(stage.parameters(), local_before, strict=True):
            p.grad.copy_(b)
        with GradWatch(
            stage,
            WatchConfig(collective_timeout_seconds=60, every_n_steps=2),
            stage_group=dist.group.WORLD,
        ) as watch:
            skipped_total = watch.clip_grad_norm_(1.0, step=1)
            skipped_snapshot = watch.last
        result = {"total": float(total), "pre": pre, "torch_local": torch_local}
        result["max_grad_rel_err"] = err
        result["skipped_total"] = float(skipped_total)
        result["skipped_snapshot"] = skipped_snapshot is not None
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(worker, world: int, tmp_path: Path) -> list[dict]:
    spawn_world(worker, world, (str(tmp_path),), timeout=150.0)
    return [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(world)]


@pytest.mark.timeout(180)
def test_clip_fsdp2_equals_unsharded(tmp_path: Path) -> None:
    results = _run(_fsdp2_worker, 2, tmp_path)
    for r in results:
        assert abs(r["total"] - r["pre"]) <= 1e-6 * r["pre"]
        assert abs(r["snap_global"] - r["pre"]) <= 1e-6 * r["pre"]
        assert r["clip_coef"] == pytest.approx(r["coef"], rel=1e-6)
        assert r["max_grad_rel_err"] <= 1e-6
    assert results[0]["total"] == results[1]["total"]  # every rank clips by the same factor


@pytest.mark.timeout(180)
def test_clip_pipeline_stages_use_whole_model_norm(tmp_path: Path) -> None:
    results = _run(_pipeline_worker, 2, tmp_path)
    for r in results:
        assert math.isfinite(r["total"])  # squares of 1e18-scale gradients overflow float32
        assert abs(r["total"] - r["pre"]) <= 1e-6 * r["pre"]
        # torch's function on one stage sees that stage only: strictly smaller than the whole.
        assert r["torch_local"] < r["pre"] * (1 - 1e-3)
        assert r["max_grad_rel_err"] <= 1e-6
        assert abs(r["skipped_total"] - r["pre"]) <= 1e-6 * r["pre"]
        assert not r["skipped_snapshot"]
