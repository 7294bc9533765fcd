"""The cost of optimizer-update health (``update_stats=True``): the DDP step of the demo model
on 2 gloo ranks (one thread each) with an AdamW (foreach, torch's default on CPU), watched by
gradwatch without and with update stats, in the same processes, interleaved in palindromic
blocks (A B B A, :func:`gradwatch.doctor.timing.palindromic`) so drift and cache effects hit
both alike; the ratio is the median over blocks with a 95% bootstrap interval
(:func:`benchmarks.results.paired_ratio`).

Every step is forward, backward, ``collect`` and the optimizer step (the update's measurement
runs in the optimizer's step post-hook), as the documented loop. Rank 0's times are kept. One
warm step with update stats is counted, untimed, under ``gradwatch.doctor.testing.OpCounter``
(host scalar reads: 0 expected); memory: the meter's persistent buffers, and the largest
allocation of one warm optimizer step with and without it (``largest_allocation``), against
the parameters' bytes.

Standalone::

    PYTHONPATH=src:. python -c "from benchmarks.update_bench import updates; print(updates(20))"
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init
from benchmarks.results import UpdateStatsMode, UpdateStatsResult
from gradwatch.doctor.timing import palindromic


def _job(mode: UpdateStatsMode) -> tuple[nn.Module, Any, Any]:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    watch = GradWatch(model, WatchConfig(
        update_stats=mode is UpdateStatsMode.UPDATES, collective_timeout_seconds=120))
    return model, opt, watch


def _persistent_bytes(watch: Any) -> int:
    """The update meter's persistent device buffers (figures, indices, masks; the weight
    views it keeps are views of the parameters, no memory of their own)."""
    meter = watch._resolved.updates
    if meter is None:
        return 0
    held = [meter._updates, meter._group, meter._mask, meter._all, *meter._indices.values()]
    return sum(t.numel() * t.element_size() for t in held)


def _worker(rank: int, port: int, blocks: int, out: str) -> None:
    import torch.distributed as dist

    from gradwatch.doctor.testing import OpCounter, largest_allocation

    _init(rank, port)
    kinds = tuple(UpdateStatsMode)
    try:
        jobs = {mode: _job(mode) for mode in kinds}
        _, width, batch = build_model(ModelSpec("demo", "demo model"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def backward(mode: UpdateStatsMode) -> None:
            model, opt, _ = jobs[mode]
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()

        def optimizer_step(mode: UpdateStatsMode, i: int) -> None:
            _, opt, watch = jobs[mode]
            watch.collect(i)
            opt.step()

        def step(mode: UpdateStatsMode, i: int) -> None:
            backward(mode)
            optimizer_step(mode, i)

        times = palindromic(step, kinds, blocks, barrier=dist.barrier)
        reads = {}
        peak = {}
        for mode in kinds:
            backward(mode)
            with OpCounter() as counted:
                optimizer_step(mode, 10**6)
            reads[mode] = counted.scalar_reads
            backward(mode)
            peak[mode] = largest_allocation(lambda mode=mode: optimizer_step(mode, 10**6 + 1))
        model, _, watch = jobs[UpdateStatsMode.UPDATES]
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        persistent = _persistent_bytes(watch)
        for _, _, w in jobs.values():
            w.close()
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(UpdateStatsResult(
                model="demo model", blocks=blocks,
                step_times={m: tuple(ts) for m, ts in times.items()},
                scalar_reads=reads[UpdateStatsMode.UPDATES] - reads[UpdateStatsMode.WATCHED],
                parameter_bytes=param_bytes, persistent_bytes=persistent,
                largest_allocation={m: int(b) for m, b in peak.items()})))
    finally:
        dist.destroy_process_group()


def updates(blocks: int = 300) -> UpdateStatsResult:
    """``blocks`` palindromic blocks of both :class:`UpdateStatsMode` kinds on 2 spawned
    ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        mp.spawn(_worker, args=(_free_port(), blocks, path), nprocs=WORLD, join=True)
        # our own child wrote it, into our own temporary directory
        result: UpdateStatsResult = pickle.loads(Path(path).read_bytes())
    return result
