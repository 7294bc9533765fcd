"""The optimizer-step guard's cost: the DDP step of the demo model on 2 gloo ranks (one thread
each) with a ``fused=True`` AdamW, guarded and unguarded, in the same processes, interleaved in
palindromic blocks (A B B A, :func:`gradwatch.doctor.timing.palindromic`) so drift and cache effects
hit both alike; the ratio is the median over blocks with a 95% bootstrap interval
(:func:`benchmarks.results.paired_ratio`).

The kinds (:class:`~benchmarks.results.GuardMode`), each a DDP copy of the same model with a
``fused=True`` AdamW (the optimizers that take the decision as ``found_inf``):

* ``WATCHED``: gradwatch as it runs by default: ``collect`` then ``optimizer.step()``;
* ``COLLECTIVE``: the same plus a bare all-reduce of a float64 vector as long as the packed
  one, awaited before the step, on a gloo group of its own: what the guard's one collective
  per step costs by itself, the floor of any guard that agrees its inputs across ranks;
* ``GUARDED_NONFINITE``: ``watch.guard(optimizer).step()`` with the guard's defaults
  (``skip_nonfinite`` only), which collects and decides, then the fused step with the decision
  as ``found_inf``;
* ``GUARDED``: the same with ``skip_spike_score`` 6 too, scored by the EMA statistic the
  adaptive clip keeps (``guard_spike_statistic="ema"``; the history updated by the guard
  itself: the loop does not clip).

Every step is forward, backward, the optimizer step (and the collect) in the documented loop:
rank 0's exporter thread builds the results. Rank 0's times are kept, of the whole step and of
its optimizer phase (from the end of the backward: collect, all-reduce, decision, fused step),
where the kinds differ. One warm optimizer step
of each kind (collect, decision and fused step) is counted, untimed, under
``gradwatch.doctor.testing.OpCounter``: its aten ops, collectives and host scalar reads (0
expected).

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
from gradwatch.doctor.timing import palindromic

#: ``skip_spike_score`` of the guarded kind.
SPIKE_SCORE = 6.0

#: The kinds that step the bare optimizer after ``collect``.
UNGUARDED = (GuardMode.WATCHED, GuardMode.COLLECTIVE)


def _job(mode: GuardMode, endpoint: bool) -> tuple[nn.Module, Any, Any]:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=True)
    spikes = mode is GuardMode.GUARDED
    watch = GradWatch(model, WatchConfig(
        skip_spike_score=SPIKE_SCORE if spikes else None, guard_spike_statistic="ema",
        collective_timeout_seconds=120, port=0 if endpoint else None, bind_address="127.0.0.1"))
    stepper = opt if mode in UNGUARDED else watch.guard(opt)
    return model, stepper, watch


def _skipped(watch: Any) -> int:
    """The steps ``watch``'s guard skipped so far (read after the timed blocks: a skipped
    fused step returns early, so a kind that skips is timed on cheaper steps)."""
    guard = watch._collector.guard
    return 0 if guard is None else int(guard._skipped)


def _worker(rank: int, port: int, blocks: int, out: str) -> None:
    import torch.distributed as dist

    from gradwatch.doctor.testing import OpCounter

    _init(rank, port)
    kinds = tuple(GuardMode)
    try:
        jobs = {mode: _job(mode, rank == 0) for mode in kinds}
        # The floor's all-reduce: as long as the guard's packed vector, on a group of its own
        packed_length = jobs[GuardMode.WATCHED][2]._collector.resolved.reducer.layout.packed_length
        floor_group = dist.new_group(backend="gloo")
        _, width, batch = build_model(ModelSpec("demo", "demo model"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def backward(mode: GuardMode) -> None:
            model, stepper, _ = jobs[mode]
            stepper.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()

        def optimizer_step(mode: GuardMode, i: int) -> None:
            _, stepper, watch = jobs[mode]
            if mode in UNGUARDED:
                watch.collect(i)
            if mode is GuardMode.COLLECTIVE:
                packed = torch.zeros(packed_length, dtype=torch.float64)
                floor_group.allreduce([packed]).wait()
            stepper.step()  # the guarded kinds collect inside their step

        phases: dict[GuardMode, list[float]] = {mode: [] for mode in kinds}

        def step(mode: GuardMode, i: int) -> None:
            backward(mode)
            started = time.perf_counter()
            optimizer_step(mode, i)
            if i >= 1000:  # the timed steps (palindromic numbers them from 1000 on)
                phases[mode].append(time.perf_counter() - started)

        # three warm-up blocks first (DDP rebuilds its buckets after one step)
        times = palindromic(step, kinds, blocks, barrier=dist.barrier)
        skipped = {mode: _skipped(jobs[mode][2]) for mode in kinds if mode not in UNGUARDED}
        ops = {}
        for mode in kinds:  # one warm optimizer step each: collect, decision, fused step
            backward(mode)
            with OpCounter() as counted:
                optimizer_step(mode, 10**6)
            ops[mode] = counted
        for _, _, watch in jobs.values():
            watch.close()
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(GuardResult(
                model="demo model", blocks=blocks,
                step_times={m: tuple(ts) for m, ts in times.items()},
                optimizer_times={m: tuple(ts) for m, ts in phases.items()},
                scalar_reads=max(ops[m].scalar_reads for m in kinds if m not in UNGUARDED),
                ops={m: counted.total for m, counted in ops.items()},
                collectives={m: counted.collectives for m, counted in ops.items()},
                packed_length=packed_length, skipped=skipped)))
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
