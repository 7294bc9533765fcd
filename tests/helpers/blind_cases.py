"""Workers of tests/distributed/test_never_blind_distributed.py: failures on some ranks keep
every rank's collective sequence aligned, and models changed after construction."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_cases import run_suite
from torch import nn


def _grads_norm(model: nn.Module) -> float:
    """The whole model's gradient norm, from every rank's local gradients (a reference)."""
    local = 0.0
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "_local_tensor"):
            g = g._local_tensor
        local += float(g.double().pow(2).sum())
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return math.sqrt(float(total))


def _outcome(pending: Any) -> dict[str, Any]:
    try:
        snap = pending.result()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"step": snap.step, "global_norm": snap.global_norm}


def case_fsdp2_meta_to_empty(rank: int, world: int) -> dict[str, Any]:
    """Build on meta, fully_shard, construct GradWatch, to_empty, initialize, train: exact."""
    from torch.distributed.fsdp import fully_shard

    from gradwatch import GradWatch, WatchConfig

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    watch = GradWatch(model, WatchConfig(port=None, collective_timeout_seconds=20))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    out: dict[str, Any] = {"steps": []}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(10 + step + rank)
        model(torch.randn(3, 6)).pow(2).sum().backward()
        res = _outcome(watch.collect(step))
        res["reference"] = _grads_norm(model)
        out["steps"].append(res)
    out["broken"] = watch._collector.broken
    watch.close()
    return out


def case_plain_meta_to_empty(rank: int, world: int) -> dict[str, Any]:
    """A plain module built on meta and watched before to_empty(): every rank names the
    replaced parameter, with no collective timeout (the failed-marked all-reduce keeps the
    ranks aligned); a watcher built after to_empty() is exact."""
    from gradwatch import GradWatch, WatchConfig

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    watch = GradWatch(model, WatchConfig(port=None, collective_timeout_seconds=20))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    model(torch.randn(3, 6)).pow(2).sum().backward()
    t0 = time.monotonic()
    out = {"replaced": _outcome(watch.collect(0)), "seconds": time.monotonic() - t0}
    out["broken"] = watch._collector.broken
    watch.close()
    with GradWatch(model, WatchConfig(port=None, collective_timeout_seconds=20)) as again:
        out["after"] = _outcome(again.collect(0))
    out["reference"] = _grads_norm(model) / math.sqrt(world)  # identical replicas
    return out


def case_one_rank_fails_once(rank: int, world: int) -> dict[str, Any]:
    """The last rank's local pass raises at step 1 only: every rank reports step 1 as not
    measured, no rank waits for a timeout, and step 2 is measured everywhere."""
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    watch = GradWatch(model, WatchConfig(port=None, collective_timeout_seconds=20))
    real = watch._collector.engine.squared_norms_and_plan
    out: dict[str, Any] = {"steps": []}
    for step in range(3):
        model.zero_grad(set_to_none=True)
        model(torch.randn(2, 5)).sum().backward()
        if step == 1 and rank == world - 1:

            def boom(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("simulated one-off failure")

            watch._collector.engine.squared_norms_and_plan = boom  # type: ignore[method-assign]
        t0 = time.monotonic()
        res = _outcome(watch.collect(step))
        res["seconds"] = time.monotonic() - t0
        watch._collector.engine.squared_norms_and_plan = real  # type: ignore[method-assign]
        out["steps"].append(res)
    out["broken"] = watch._collector.broken
    watch.close()
    return out


CASES: list[tuple[str, Callable[[int, int], dict[str, Any]]]] = [
    ("fsdp2_meta_to_empty", case_fsdp2_meta_to_empty),
    ("plain_meta_to_empty", case_plain_meta_to_empty),
    ("one_rank_fails_once", case_one_rank_fails_once),
]


def worker(rank: int, world: int, port: int, out: str) -> None:
    run_suite(rank, world, port, out, CASES)
