"""Worker side of tests/distributed/test_updates_distributed.py: optimizer-update health in a
2-rank gloo world (DDP, with and without gradwatch's all-reduce, and FSDP2 with uneven and
empty shards).

The reference is computed from copies of the whole parameters in float64, taken before and
after each optimizer step (``full_tensor()`` of DTensor parameters: here only, never in
gradwatch), summed with ``math.fsum``. Each case returns, per collect from the second on, the
snapshot's figures and the reference of the step before it; the test module judges them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import CollectiveSpy, expect_error, inputs, run_suite
from torch import nn


def _full(p: torch.Tensor) -> torch.Tensor:
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().to(torch.float64).clone()


def _norm(parts: list[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(x * x for t in parts for x in t.reshape(-1).tolist()))


def _reference(model: nn.Module, step: Callable[[], None]) -> dict[str, Any]:
    names = [n for n, _ in model.named_parameters()]
    before = [_full(p) for p in model.parameters()]
    grads = [
        None if p.grad is None else _full(p.grad) for p in model.parameters()
    ]
    step()
    after = [_full(p) for p in model.parameters()]
    moving = [g != 0 for g in grads if g is not None]
    same = [a == b for a, b, g in zip(after, before, grads, strict=True) if g is not None]
    eligible = sum(int(m.sum()) for m in moving)
    first = [i for i, n in enumerate(names) if "0." in n.split("module.")[-1][:2]]
    return {
        "weight": _norm(after),
        "update": _norm([a - b for a, b in zip(after, before, strict=True)]),
        "stalled": sum(int((m & s).sum()) for m, s in zip(moving, same, strict=True))
        / eligible,
        "first_weight": _norm([after[i] for i in first]),
        "first_update": _norm([after[i] - before[i] for i in first]),
    }


def _run(
    model: nn.Module, watched: nn.Module, opt: torch.optim.Optimizer, rank: int, **cfg: Any
) -> dict[str, Any]:
    from gradwatch import GradWatch, WatchConfig

    config = WatchConfig(update_stats=True, groups={"first": ["0.*"]},
                         collective_timeout_seconds=30, divergence_every=0, **cfg)
    watch = GradWatch(watched, config)
    rows: list[dict[str, Any]] = []
    ref = None
    collectives = []
    for step in range(4):
        model(inputs(rank + 7 * step, 6, 5)).pow(2).sum().backward()
        with CollectiveSpy() as spy:
            pending = watch.collect(step)
        collectives.append(spy.collectives)
        snap = pending.result()
        rows.append({
            "weight": snap.weight_norm, "update": snap.update_norm,
            "ratio": snap.update_ratio, "stalled": snap.stalled_fraction,
            "first_weight": snap.groups["first"].weight_norm,
            "first_update": snap.groups["first"].update_norm,
            "ref": ref,
        })

        def step_now() -> None:
            opt.step()
            opt.zero_grad()

        ref = _reference(model, step_now)
    watch.close()
    return {"rows": rows, "collectives": collectives, "rank": dist.get_rank()}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


def case_ddp(always_reduce: bool) -> Callable[[int, int], dict]:
    def run(rank: int, world: int) -> dict:
        model = _mlp()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, foreach=True, weight_decay=0.1)
        return _run(ddp, ddp, opt, rank, always_reduce=always_reduce)

    return run


def case_fsdp2(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    return _run(model, model, opt, rank)


def case_fsdp2_fused_adamw(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return _run(model, model, opt, rank)


def case_fsdp1_refused(rank: int, world: int) -> dict:
    """FSDP1 steps flat copies of the parameters: refused at construction, naming the
    setting, on every rank alike."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from gradwatch import GradWatch, WatchConfig

    model = FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"))
    return expect_error(lambda: GradWatch(model, WatchConfig(update_stats=True)))


SUITES = {
    "w2": [
        ("fsdp1_refused", case_fsdp1_refused),
        ("ddp_alone", case_ddp(always_reduce=False)),
        ("ddp_reduced", case_ddp(always_reduce=True)),
        ("fsdp2_sgd", case_fsdp2),
        ("fsdp2_fused_adamw", case_fsdp2_fused_adamw),
    ],
}


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, SUITES[suite])
