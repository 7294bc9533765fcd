"""The per-rank view's cost: the DDP step of the demo model with and without
``WatchConfig.rank_view``, on 2 gloo ranks (one thread each), interleaved.

Run directly (not part of ``make bench``)::

    PYTHONPATH=src:. python -c \
        "from benchmarks.rankview_bench import rank_view_overhead; print(rank_view_overhead(150))"
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init


def _rank_view_worker(rank: int, port: int, steps: int, out: str) -> None:
    """Two DDP copies of the demo model, one watched with the per-rank view and one without,
    stepped alternately (palindromic pairs) so drift and cache effects hit both alike."""
    import torch.distributed as dist

    from gradwatch import GradWatch, WatchConfig

    _init(rank, port)
    try:
        jobs = []
        for view in (False, True):
            torch.manual_seed(0)
            model, width, batch = build_model(ModelSpec("demo", "demo model"))
            model = wrap(model, "ddp")
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            watch = GradWatch(model, WatchConfig(rank_view=view, collective_timeout_seconds=120))
            jobs.append((model, opt, watch))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def step(k: int, i: int) -> float:
            model, opt, watch = jobs[k]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            pending = watch.collect(i)
            opt.step()
            pending.result()
            return time.perf_counter() - t0

        for i in range(8):  # warm-up (DDP rebuilds its buckets after the first iteration)
            step(i % 2, i)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(steps):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for k in order:
                times[bool(k)].append(step(k, 100 + i))
        for _, _, watch in jobs:
            watch.close()
        if rank == 0:
            Path(out).write_text(json.dumps({str(k): v for k, v in times.items()}))
    finally:
        dist.destroy_process_group()


def rank_view_overhead(steps: int = 200) -> dict[str, float]:
    """The DDP step (forward, backward, collect, optimizer step, result) of the demo model with
    the per-rank view over the same step without it, on 2 ranks: medians (ms) and their ratio
    (target: at most 1.02)."""
    import statistics

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.json")
        mp.spawn(_rank_view_worker, args=(_free_port(), steps, path), nprocs=WORLD, join=True)
        times = json.loads(Path(path).read_text())
    without, with_view = statistics.median(times["False"]), statistics.median(times["True"])
    pairs = [b / a for a, b in zip(times["False"], times["True"], strict=True)]
    return {
        "step_ms_without_view": without * 1e3,
        "step_ms_with_view": with_view * 1e3,
        "ratio_of_medians": with_view / without,
        "median_paired_ratio": statistics.median(pairs),
    }
