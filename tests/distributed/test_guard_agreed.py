"""A NaN that enters one rank after DDP's all-reduce (a post-backward write on the last rank
only), under the default configuration with the guard on: every rank takes the same decision
(the skip), the replicas stay bitwise equal (sha256 of every parameter and optimizer state),
and rank 0's endpoint shows the non-finite step and the skip."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]

STEPS = 8
NAN_STEP = 5


def _digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().numpy().tobytes())
    return h.hexdigest()


def _scrape(url: str, names: tuple[str, ...], step: int) -> dict[str, float]:
    """The samples named ``names`` once the endpoint publishes ``step`` (bounded wait)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 30
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        found = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
                if s.name in names or key in names:
                    found[key] = s.value
        if found.get("gradwatch_step", -1) >= step:
            break
        time.sleep(0.05)
    return found


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        Path(out, f"{rank}.json").write_text(json.dumps(_run(rank, world)))
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int) -> dict:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cfg = WatchConfig(port=0 if rank == 0 else None, collective_timeout_seconds=60)
    watch = GradWatch(model, cfg)
    guarded = watch.guard(opt)
    gen = torch.Generator().manual_seed(1000 + rank)
    skipped: list[int] = []
    for step in range(STEPS):
        x, y = torch.randn(16, 12, generator=gen), torch.randn(16, 3, generator=gen)
        (model(x) - y).pow(2).mean().backward()  # DDP all-reduced the gradients here
        if step == NAN_STEP and rank == world - 1:
            model.module[0].weight.grad[0, 0] = math.nan  # after the reduction, one rank
        before = _digest(model, opt)
        guarded.step()
        guarded.zero_grad()
        if _digest(model, opt) == before:
            skipped.append(step)
    scraped: dict[str, float] = {}
    if rank == 0:
        watch.flush()
        scraped = _scrape(
            watch.metrics_url,
            (
                "gradwatch_step",
                "gradwatch_nonfinite_steps_total",
                "gradwatch_skipped_steps_total{reason=nonfinite}",
            ),
            STEPS - 1,
        )
    watch.close()
    return {"skipped": skipped, "digest": _digest(model, opt), "scraped": scraped}


def test_a_nan_after_the_reduction_on_one_rank_is_every_rank_s_skip(tmp_path: Path) -> None:
    world = 2
    spawn_world(_worker, world, (str(tmp_path),), timeout=180)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    assert [r["skipped"] for r in results] == [[NAN_STEP]] * world
    assert len({r["digest"] for r in results}) == 1, "the replicas split"
    scraped = results[0]["scraped"]
    assert scraped["gradwatch_nonfinite_steps_total"] == 1, scraped
    assert scraped["gradwatch_skipped_steps_total{reason=nonfinite}"] == 1, scraped
