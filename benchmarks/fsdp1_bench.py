"""gradwatch's collect under FSDP1 against FSDP1's own norm computation, on 2 gloo ranks (one
thread each), in the same process and on the same gradients.

One model (:data:`LAYERS` ``Linear(WIDTH, WIDTH)`` layers, each its own FSDP1 unit, the root
holding none), ``FULL_SHARD``, for ``use_orig_params`` False and True. After one backward the
compared calls run round-robin on the same local shards, ``rounds`` times, in palindromic order
so a linear drift cancels:

* ``fsdp``: ``FullyShardedDataParallel.clip_grad_norm_(max_norm)`` on the root: FSDP's own
  whole-model norm (local norms, one all-reduce over the shard group, a multiply of every local
  gradient by the clamped coefficient, here 1: ``max_norm`` is far above the norm);
* ``collect``: ``watch.collect(step).result()``: exact float64 norms of every original
  parameter's slice, one all-reduce, the host summary (all of gradwatch's work, on the
  training thread);
* ``clip``: ``watch.clip_grad_norm_(max_norm)``: the same pass and all-reduce, then the
  multiply: the like-for-like replacement of FSDP's call.

Rank 0's times are kept. Standalone::

    PYTHONPATH=src:. python -c "from benchmarks.fsdp1_bench import fsdp1; print(fsdp1(30))"
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.results import Failure, Fsdp1Result, Timing

WORLD = 2
LAYERS = 8
WIDTH = 512
KINDS = ("fsdp", "collect", "clip")
MAX_NORM = 1e30


def _worker(rank: int, port: int, rounds: int, width: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        found = [_measure(orig, rounds, width) for orig in (False, True)]
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(found))
    finally:
        dist.destroy_process_group()


def _measure(orig: bool, rounds: int, width: int) -> Fsdp1Result:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(width, width), nn.Tanh())]
    model = FSDP(nn.Sequential(*layers), device_id=torch.device("cpu"), use_orig_params=orig,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    watch = GradWatch(model, WatchConfig(collective_timeout_seconds=120))
    gen = torch.Generator().manual_seed(10 + dist.get_rank())
    model(torch.randn(16, width, generator=gen)).pow(2).mean().backward()
    step = 0

    def call(kind: str) -> None:
        nonlocal step
        step += 1
        if kind == "fsdp":
            model.clip_grad_norm_(MAX_NORM)
        elif kind == "collect":
            watch.collect(step).result()
        else:
            watch.clip_grad_norm_(MAX_NORM, step=step)

    order = (*KINDS, *reversed(KINDS))
    for kind in order:  # warm-up: plans, buffers
        call(kind)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(max(1, rounds // 2)):
        for kind in order:
            dist.barrier()
            t0 = time.perf_counter()
            call(kind)
            times[kind].append(time.perf_counter() - t0)
    n_params = sum(math.prod(s) for u in watch._fsdp1.units for s in u.shapes)
    watch.close()
    return Fsdp1Result(
        use_orig_params=orig, layers=LAYERS, n_params=n_params,
        n_tensors=len(watch.parameter_names),
        fsdp=Timing.of(times["fsdp"]), collect=Timing.of(times["collect"]),
        clip=Timing.of(times["clip"]))


def fsdp1(rounds: int, width: int = WIDTH) -> list[Fsdp1Result] | Failure:
    """Both ``use_orig_params`` settings on 2 spawned ranks; a failure is reported, not
    raised."""
    import torch.multiprocessing as mp

    from benchmarks.distributed import _free_port

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        try:
            mp.spawn(_worker, args=(_free_port(), rounds, width, path), nprocs=WORLD, join=True)
            # our own child wrote it, into our own temporary directory
            return list(pickle.loads(Path(path).read_bytes()))
        except Exception as exc:  # report, don't lose the other sections
            return Failure(f"{type(exc).__name__}: {exc}")
