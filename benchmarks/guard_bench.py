"""The optimizer-step guard's cost: the DDP step of the demo model on 2 gloo ranks (one thread
each), guarded and unguarded, in the same processes, interleaved in palindromic blocks so drift
and cache effects hit both alike.

The kinds (:class:`~benchmarks.results.GuardMode`), each a DDP copy of the same model with a
``fused=True`` SGD (the optimizers that take the decision as ``found_inf``):

* ``WATCHED``: gradwatch as it runs by default: ``collect`` then ``optimizer.step()``;
* ``GUARDED``: ``watch.guard(optimizer).step()`` (``skip_nonfinite`` and ``skip_spike_score``
  6: the spike window on the device), which collects and decides, then the fused step with the
  decision as ``found_inf``.

Every step is forward, backward, the optimizer step (and the collect) in the documented loop:
rank 0's exporter thread builds the results. Rank 0's times are kept. The warm guarded steps'
host scalar reads are counted over its optimizer step (collect, decision and fused step;
``gradwatch.testing.OpCounter``): 0 expected.

Standalone::

    PYTHONPATH=src:. python -c "from benchmarks.guard_bench import guard; print(guard(20))"
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init
from benchmarks.results import GuardMode, GuardResult

#: ``skip_spike_score`` of the guarded kind.
SPIKE_SCORE = 6.0


def _job(mode: GuardMode, endpoint: bool) -> tuple[nn.Module, Any, Any]:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                          fused=True)
    watch = GradWatch(model, WatchConfig(
        skip_spike_score=SPIKE_SCORE, collective_timeout_seconds=120,
        port=0 if endpoint else None, bind_address="127.0.0.1"))
    stepper = watch.guard(opt) if mode is GuardMode.GUARDED else opt
    return model, stepper, watch


def _worker(rank: int, port: int, blocks: int, out: str) -> None:
    import torch.distributed as dist

    from gradwatch.testing import OpCounter

    _init(rank, port)
    kinds = tuple(GuardMode)
    block = (*kinds, *reversed(kinds))
    try:
        jobs = {mode: _job(mode, rank == 0) for mode in kinds}
        _, width, batch = build_model(ModelSpec("demo", "demo model"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def backward(mode: GuardMode) -> None:
            model, stepper, _ = jobs[mode]
            stepper.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()

        def optimizer_step(mode: GuardMode, i: int) -> None:
            _, stepper, watch = jobs[mode]
            if mode is GuardMode.WATCHED:
                watch.collect(i)
            stepper.step()  # the guarded kind collects inside its step

        def step(mode: GuardMode, i: int) -> None:
            backward(mode)
            optimizer_step(mode, i)

        for i in range(3 * len(block)):  # warm-up (DDP rebuilds its buckets after one step)
            step(block[i % len(block)], i)
        times: dict[GuardMode, list[float]] = {m: [] for m in kinds}
        for i in range(blocks * len(block)):
            mode = block[i % len(block)]
            dist.barrier()
            t0 = time.perf_counter()
            step(mode, 1000 + i)
            times[mode].append(time.perf_counter() - t0)
        dist.barrier()
        backward(GuardMode.GUARDED)
        with OpCounter() as ops:  # the guarded optimizer step: collect, decision, fused step
            optimizer_step(GuardMode.GUARDED, 10**6)
        for _, _, watch in jobs.values():
            watch.close()
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(GuardResult(
                model="demo model", blocks=blocks,
                step_times={m: tuple(ts) for m, ts in times.items()},
                scalar_reads=ops.scalar_reads, ops=ops.total)))
    finally:
        dist.destroy_process_group()


def guard(blocks: int = 300) -> GuardResult:
    """``blocks`` palindromic blocks of every :class:`GuardMode` on 2 spawned ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        mp.spawn(_worker, args=(_free_port(), blocks, path), nprocs=WORLD, join=True)
        # our own child wrote it, into our own temporary directory
        result: GuardResult = pickle.loads(Path(path).read_bytes())
    return result
