"""What ``rank_timing`` costs: the DDP step of the demo model on 2 gloo ranks (one thread
each), three kinds interleaved in palindromic blocks (:func:`gradwatch.doctor.timing.palindromic`)
so drift and cache effects hit every kind alike; rank 0's times are kept.

* ``default``: gradwatch as it runs by default (under this pure replication an ordinary collect
  issues no all-reduce of its own);
* ``always_reduce``: ``WatchConfig(always_reduce=True)``: one all-reduce per collect;
* ``rank_timing``: ``WatchConfig(rank_timing=True)``: one all-reduce per collect (rank timing
  needs it) carrying the timing section, the gradient hooks, the host clock.

``rank_timing`` vs ``default`` is the cost a plain-DDP user pays when turning it on;
``rank_timing`` vs ``always_reduce`` is timing's own cost over the same all-reduce (what it
adds under FSDP2 and every stack where the all-reduce runs anyway). Each step is forward,
backward, ``collect``, optimizer step and ``result()`` on the training thread. Standalone::

    PYTHONPATH=src:. python -m benchmarks.ranktiming_bench 40
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init
from gradwatch.doctor.timing import palindromic

KINDS = ("default", "always_reduce", "rank_timing")


def _job(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    watch = GradWatch(model, WatchConfig(
        always_reduce=kind == "always_reduce", rank_timing=kind == "rank_timing",
        collective_timeout_seconds=120))
    return model, opt, watch


def _worker(rank: int, port: int, blocks: int, out: str) -> None:
    import torch.distributed as dist

    _init(rank, port)
    try:
        jobs = {kind: _job(kind) for kind in KINDS}
        _, width, batch = build_model(ModelSpec("demo", "demo model"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def step(kind: str, i: int) -> None:
            model, opt, watch = jobs[kind]
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            pending = watch.collect(i)
            opt.step()
            pending.result()

        times = palindromic(step, KINDS, blocks, barrier=dist.barrier)
        for _, _, watch in jobs.values():
            watch.close()
        if rank == 0:
            Path(out).write_bytes(pickle.dumps({k: list(v) for k, v in times.items()}))
    finally:
        dist.destroy_process_group()


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median of the per-sample ratios ``a[i] / b[i]`` (samples of one block pair up)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def rank_timing_cost(blocks: int = 40) -> dict[str, Any]:
    """Median step times per kind (seconds) and the paired ratios of ``rank_timing``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        mp.spawn(_worker, args=(_free_port(), blocks, path), nprocs=WORLD, join=True)
        times: dict[str, list[float]] = pickle.loads(Path(path).read_bytes())  # our own file
    return {
        "median_seconds": {k: statistics.median(v) for k, v in times.items()},
        "rank_timing/default": paired_ratio(times["rank_timing"], times["default"]),
        "rank_timing/always_reduce": paired_ratio(times["rank_timing"], times["always_reduce"]),
        "always_reduce/default": paired_ratio(times["always_reduce"], times["default"]),
        "samples": len(times["default"]),
    }


if __name__ == "__main__":
    print(rank_timing_cost(int(sys.argv[1]) if len(sys.argv) > 1 else 40))
