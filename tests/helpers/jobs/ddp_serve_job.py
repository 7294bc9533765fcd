"""A 2-rank gloo DDP training job with gradwatch serving, driven by tests/e2e/test_export_e2e.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/jobs/ddp_serve_job.py WORKDIR

Handshake through files in WORKDIR (the test creates the flag files, the job the JSON ones):

1. every rank writes ``rank<r>.json`` = ``{"metrics_url": ...}`` once its GradWatch exists;
2. phase 1: ``--steps`` training steps, each collected and materialized (``result()``); rank 0
   writes ``phase1.json`` = ``{"snapshots": {step: global_norm}, "last_step": n}``, then every
   rank waits for the flag ``resume`` (the endpoint keeps serving the last step meanwhile);
3. phase 2: training until the test creates ``stop`` (both ranks stop at the same step: the
   flag is agreed through a one-element all-reduce per step); rank 0 writes ``phase2.json``
   with the snapshots and ``step_times`` = ``[[monotonic start, seconds], ...]``;
4. every rank waits for ``exit``, closes its GradWatch and leaves.

Every wait has a deadline (``--deadline`` seconds in all), so an orphaned job exits by itself.
JSON is written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradwatch import GradWatch, WatchConfig


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))  # NaN/Infinity allowed: Python's json reads them back
    os.replace(tmp, path)


def wait_for_flag(path: Path, deadline: float) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"ddp_serve_job: gave up waiting for {path.name}")
        time.sleep(0.02)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128))
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--deadline", type=float, default=240.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline
    work: Path = args.workdir

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # different data per rank; DDP averages the gradients
    model = nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = WatchConfig(
        port=0,
        bind_address="127.0.0.1",
        groups={"backbone": ["backbone.*"]},
        ratios=[("backbone", "other")],
    )
    watch = GradWatch(model, cfg)
    write_json(work / f"rank{rank}.json", {"metrics_url": watch.metrics_url, "world": world})

    def train_step(step: int) -> float:
        x = torch.randn(args.batch_size, 32)
        y = torch.randn(args.batch_size, 4)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        snap = watch.collect(step=step).result()
        opt.step()
        return snap.global_norm

    try:
        snapshots: dict[int, float] = {}
        for step in range(args.steps):
            snapshots[step] = train_step(step)
        if rank == 0:
            write_json(work / "phase1.json", {"snapshots": snapshots, "last_step": step})
        wait_for_flag(work / "resume", deadline)

        snapshots = {}
        step_times: list[list[float]] = []
        stop = torch.zeros(1)
        step = args.steps
        while True:
            stop.fill_(float((work / "stop").exists() or time.monotonic() > deadline - 30))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # both ranks leave at the same step
            if stop.item():
                break
            started = time.monotonic()
            snapshots[step] = train_step(step)
            step_times.append([started, time.monotonic() - started])
            step += 1
        if rank == 0:
            last = max(snapshots) if snapshots else None
            write_json(
                work / "phase2.json",
                {"snapshots": snapshots, "last_step": last, "step_times": step_times},
            )
        wait_for_flag(work / "exit", deadline)
    finally:
        watch.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
