"""Spawned gloo worlds for the distributed tests: a free port, a bounded wait, and a retry when
another process took the port between choosing it and binding it (tests run beside other jobs).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp
from promserver import free_port

#: Attempts when the rendezvous port was taken by someone else in the meantime.
PORT_ATTEMPTS = 3


def _work_then_leave(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """Run ``worker(rank, *args)``; once it returned (its results written, its process group
    destroyed), leave at once with ``os._exit(0)``. A worker that raises leaves as usual, so
    its exception still reaches :func:`spawn_world`. The interpreter's own teardown after a
    gloo job can abort (signal 6, "terminate called without an active exception"): the known,
    not yet explained teardown abort of docs/distributed.md ("Closing"), which is not what
    these tests measure; tests/distributed/test_exit.py tests exits through that teardown
    (``leave_at_once=False``)."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_world(
    worker: Callable[..., None],
    world: int,
    args: Sequence[Any],
    timeout: float,
    leave_at_once: bool = True,
) -> None:
    """Run ``worker(rank, world, port, *args)`` on ``world`` spawned processes; return when all
    exited cleanly. A hang raises ``TimeoutError`` after ``timeout`` seconds (every process is
    killed); a worker's exception is re-raised, except a lost race for the port, which retries
    on a new one. ``leave_at_once``: a worker that returned leaves without the interpreter's
    teardown (:func:`_work_then_leave`); False for the tests of exiting itself."""
    for attempt in range(PORT_ATTEMPTS):
        fn, fn_args = (
            (_work_then_leave, (worker, world, free_port(), *args))
            if leave_at_once
            else (worker, (world, free_port(), *args))
        )
        ctx = mp.start_processes(
            fn,
            args=fn_args,
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


def spawn_suite(
    worker: Callable[..., None], suite: str, world: int, out: Path, timeout: float
) -> list[dict[str, Any]]:
    """Run ``worker(rank, world, port, out, suite)`` on ``world`` ranks (:func:`spawn_world`);
    return each rank's results, ``out/<rank>.json`` (``{case: result}``)."""
    spawn_world(worker, world, (str(out), suite), timeout=timeout)
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


def case_results(
    world: list[dict[str, Any]], name: str, error_key: str = "error"
) -> list[dict[str, Any]]:
    """Case ``name``'s result on every rank, failing with the rank's traceback when the case
    raised there (its exception recorded under ``error_key``)."""
    per_rank = [r[name] for r in world]
    for rank, res in enumerate(per_rank):
        assert error_key not in res, (
            f"rank {rank}: {res[error_key]}\n{res.get('traceback', '')}"
        )
    return per_rank
