"""Workers for tests/distributed/test_exit.py: a rank that closes its watcher and exits while
its last monitoring all-reduce still waits for a late peer."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

#: How long rank 0 keeps rank 1's last all-reduce in flight.
LATE_S = 2.0


def worker(rank: int, world: int, port: int, out: str, destroy: bool) -> None:
    """Rank 1 collects, drops the pending result unread (as every rank but 0 does), closes and
    returns, with or without ``destroy_process_group()``; rank 0 joins that collect late."""
    from gradwatch import GradWatch, WatchConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(rank)
    model = nn.Linear(64, 64)  # not DDP: every collect all-reduces
    model(torch.randn(4, 64)).square().sum().backward()
    watch = GradWatch(model, WatchConfig(collective_timeout_seconds=30))
    if rank == 0:
        time.sleep(LATE_S)
        watch.collect(0).result()
        watch.close()
        dist.destroy_process_group()
        return
    watch.collect(0)  # issued; its result is never read on this rank
    started = time.monotonic()
    watch.close()
    in_flight = [p for p in watch._reducer.collective._watched if not p.settled()]
    Path(out, "1.json").write_text(json.dumps({
        "close_seconds": time.monotonic() - started, "in_flight": len(in_flight),
    }))
    if destroy:
        dist.destroy_process_group()
