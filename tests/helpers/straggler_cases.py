"""Worker side of tests/distributed/test_stragglers_distributed.py: which rank is slow, in a
spawned gloo world. Every case is collective (a barrier separates cases); each rank writes
``{case: result}`` to ``<out>/<rank>.json``. Cases measure; assertions live in the test module.

The straggler is made, not guessed: rank ``SLOW_RANK`` sleeps ``SLEEP_SECONDS`` in a backward
hook of the model's last layer on every step (before any of its gradients exist, so inside its
own work), while every rank's results are read only after the loop (a rank reading results in
the loop would add that work to its own time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from dist_cases import config, run_suite
from torch import nn

from gradwatch.doctor.testing import OpCounter, count_host_reads

SLOW_RANK = 1
SLEEP_SECONDS = 0.2
STEPS = 24
WARM = 10  # steps from which the test judges (the first step has no working time)
#: Under plain DDP the timing rides on the divergence step only (ordinary collects issue no
#: all-reduce): every second collect here, every ``divergence_every`` (100) by default.
DDP_CARRY_EVERY = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _sleep_in_backward(module: nn.Module, _grad: Any) -> None:
    time.sleep(SLEEP_SECONDS)


def _train(
    rank: int, wrap: str, slow: bool, timing: bool = True, always_reduce: bool = False
) -> dict[str, Any]:
    """``STEPS`` training steps of ``Net`` under ``wrap`` ("ddp" or "fsdp2"); per warm step the
    collect's host reads, scalar reads and collectives; the snapshots' timing fields."""
    from gradwatch import GradWatch

    torch.manual_seed(0)
    net = Net()
    if slow and rank == SLOW_RANK:
        net.b.register_full_backward_pre_hook(_sleep_in_backward)
    if wrap == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = GradWatch(
        model,
        config(rank_timing=timing, divergence_every=DDP_CARRY_EVERY if wrap == "ddp" else 0,
               always_reduce=always_reduce),
    )
    pendings, costs = [], []
    for step in range(STEPS):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        with count_host_reads() as reads, OpCounter() as ops:
            pendings.append(watch.collect(step))
        timer = watch._resolved.timer  # its window: the steps since the last carried one
        if step >= WARM:
            costs.append({"host_reads": sum(reads.values()), "scalar_reads": ops.scalar_reads,
                          "collectives": ops.collectives,
                          "window": len(timer.window) if timer is not None else -1})  # fmt: skip
        opt.step()
    snaps = [p.result() for p in pendings]
    watch.close()
    keys = ("step", "slowest_rank", "slowest_host", "straggler_score", "work_seconds_min",
            "work_seconds_median", "work_seconds_max", "rank_timing_step")  # fmt: skip
    return {"snaps": [{k: getattr(s, k) for k in keys} for s in snaps], "costs": costs,
            "host": __import__("socket").gethostname()}  # fmt: skip


def case(
    wrap: str, slow: bool, timing: bool = True, always_reduce: bool = False
) -> Callable[[int, int], dict]:
    return lambda rank, world: _train(rank, wrap, slow, timing, always_reduce)


def case_nothing_carries(rank: int, world: int) -> dict[str, Any]:
    """Plain DDP with ``divergence_every=0``: no collect all-reduces, so nothing carries the
    timing; rank 0 says so when the watcher is built, and every snapshot's timing is absent."""
    from logs import Capture

    from gradwatch import GradWatch

    model = nn.parallel.DistributedDataParallel(Net())
    with Capture() as logged:
        watch = GradWatch(model, config(rank_timing=True, divergence_every=0))
    pendings = []
    for step in range(4):
        model.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        pendings.append(watch.collect(step))
    snaps = [p.result() for p in pendings]
    watch.close()
    return {"warned": any("rank_timing" in line for line in logged.lines),
            "timed": [s.straggler_score is not None or s.rank_timing_step is not None
                      for s in snaps]}  # fmt: skip


SUITES: dict[str, list[tuple[str, Callable[[int, int], dict]]]] = {
    "w4": [
        ("ddp_slow", case("ddp", slow=True)),
        ("ddp_control", case("ddp", slow=False)),
        ("ddp_untimed", case("ddp", slow=False, timing=False)),
        ("fsdp2_slow", case("fsdp2", slow=True)),
        ("fsdp2_untimed", case("fsdp2", slow=False, timing=False)),
        ("ddp_nothing_carries", case_nothing_carries),
    ],
}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite], error_key="error_in_case")
