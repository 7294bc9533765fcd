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


def worker(rank: int, world: int, port: int, out: str, mode: str) -> None:
    """Rank 1 collects, drops the pending result unread (as every rank but 0 does), closes and
    returns, with or without ``destroy_process_group()`` (``mode`` "exit", "destroy"); rank 0
    joins that collect late. ``mode`` "raise": rank 1's ``with GradWatch(...)`` block ends by
    an exception, whose exit must not wait for the late peer."""
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
        closing = Path(out, "closing")
        deadline = time.monotonic() + 60
        while not closing.exists() and time.monotonic() < deadline:  # rank 1 is about to wait
            time.sleep(0.01)
        time.sleep(LATE_S)
        watch.collect(0).result()
        if mode == "raise":
            dist.barrier()
        watch.close()
        dist.destroy_process_group()
        return
    if mode == "raise":
        started = time.monotonic()
        Path(out, "closing").touch()
        try:
            with watch:
                watch.collect(0)
                raise RuntimeError("the training loop failed")
        except RuntimeError:
            pass
        Path(out, "1.json").write_text(json.dumps({"close_seconds": time.monotonic() - started}))
        dist.barrier()  # rank 0 joined the collect: let the all-reduce finish before leaving
        watch._reducer.collective.drain(30.0)
        return
    watch.collect(0)  # issued; its result is never read on this rank
    started = time.monotonic()
    Path(out, "closing").touch()
    watch.close()
    in_flight = [p for p in watch._reducer.collective._watched if not p.settled()]
    Path(out, "1.json").write_text(json.dumps({
        "close_seconds": time.monotonic() - started, "in_flight": len(in_flight),
    }))
    if mode == "destroy":
        dist.destroy_process_group()
