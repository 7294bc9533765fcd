"""Spawned gloo worlds for the distributed tests: a free port, a bounded wait, and a retry when
another process took the port between choosing it and binding it (tests run beside other jobs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp
from promserver import free_port

#: Attempts when the rendezvous port was taken by someone else in the meantime.
PORT_ATTEMPTS = 3


def spawn_world(
    worker: Callable[..., None], world: int, args: Sequence[Any], timeout: float
) -> None:
    """Run ``worker(rank, world, port, *args)`` on ``world`` spawned processes; return when all
    exited cleanly. A hang raises ``TimeoutError`` after ``timeout`` seconds (every process is
    killed); a worker's exception is re-raised, except a lost race for the port, which retries
    on a new one."""
    for attempt in range(PORT_ATTEMPTS):
        ctx = mp.start_processes(
            worker,
            args=(world, free_port(), *args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world}-rank world did not finish in {timeout}s (hang)")
            return
        except mp.ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
