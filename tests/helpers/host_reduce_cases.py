"""Workers for tests/distributed/test_monitor_on_host.py: the monitoring-only collect on the
host gloo group (the path NCCL jobs take), forced on a gloo world."""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TIMEOUT_S = 4.0


def _norm(model: nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))


def run(rank: int) -> tuple[dict[str, Any], Any]:
    from gradwatch import GradWatch, GradWatchError, GradWatchTimeoutError, WatchConfig, collective
    from gradwatch.doctor.testing import OpCounter

    collective.MONITOR_ON_HOST_BACKENDS = ("nccl", "gloo")
    torch.manual_seed(0)  # identical replicas: the whole-model norm is one copy's
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 5))
    model(torch.randn(8, 40)).square().sum().backward()
    watch = GradWatch(model, WatchConfig(collective_timeout_seconds=TIMEOUT_S))
    res: dict[str, Any] = {"host_group": watch._reducer.host_group is not None}
    res["reference"] = _norm(model)
    with OpCounter() as ops:
        pending = watch.collect(0)
    res["collect_collectives"] = ops.collectives  # issued by the host thread, not here
    res["collect_norm"] = pending.result().global_norm
    # The device group serves clips only: none yet after construction and a monitoring collect.
    res["device_group_before_clip"] = watch._reducer.group is not None
    with OpCounter() as ops:
        total = watch.clip_grad_norm_(1e30, step=1)  # the device path: the job's backend
    res["clip_collectives"] = ops.collectives
    res["clip_norm"] = float(total)
    res["device_group_after_clip"] = watch._reducer.group is not None
    res["clip_snapshot_norm"] = watch.last.global_norm if watch.last else None
    if rank == 1:  # a one-off failure of rank 1's local pass: a stand-in on the host path
        real = watch._collector.engine.squared_norms_and_plan

        def boom(*args: Any, **kwargs: Any) -> Any:
            watch._collector.engine.squared_norms_and_plan = real
            raise RuntimeError("simulated failure inside collect")

        watch._collector.engine.squared_norms_and_plan = boom
    try:
        watch.collect(2).result()
        res["failed_step"] = "measured"
    except GradWatchError as exc:
        res["failed_step"] = type(exc).__name__
    res["recovered_norm"] = watch.collect(3).result().global_norm
    if rank == 0:
        started = time.monotonic()
        pending = watch.collect(4)  # rank 1 stopped collecting
        res["collect_seconds"] = time.monotonic() - started
        started = time.monotonic()
        try:
            pending.result()
            res["result"] = "returned"
        except GradWatchTimeoutError as exc:
            res["result"] = f"GradWatchTimeoutError: {exc}"
        res["result_seconds"] = time.monotonic() - started
    return res, watch


def worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    watch = None
    try:
        try:
            res, watch = run(rank)
        except Exception as exc:
            res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        Path(out, f"{rank}.json").write_text(json.dumps(res, default=str))
        # Rank 1 stopped collecting but lives on (its watch open) until rank 0's wait ended.
        dist.barrier()
    finally:
        if watch is not None:
            watch.close()
        dist.destroy_process_group()
