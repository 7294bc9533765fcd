"""The norm auditor against real failure reproductions on 2 gloo ranks: a hand-written FSDP2
clip that sums local shard norms without the all-reduce, a DDP loop that all-reduces already
averaged gradients again, and a correct ``torch.nn.utils.clip_grad_norm_`` on DDP (silent)."""

from __future__ import annotations

import json
import math
import os
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from logs import Capture
from torch import nn
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]

STEPS = 3


def _fsum_sq(tensors) -> float:
    return math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten().tolist())


def _audit_series(url: str, source: str, steps: int) -> tuple[float, float]:
    """(ratio, disagreements) of ``source`` once all ``steps`` were audited (bounded wait)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("source") == source:
                    found[s.name] = s.value
        ratio = found.get("gradwatch_reported_norm_ratio")
        count = found.get("gradwatch_norm_audit_disagreements_total")
        audited = ratio is not None and (count == steps or count == 0.0)
        if audited or time.monotonic() > deadline:
            return (math.nan if ratio is None else ratio), (math.nan if count is None else count)
        time.sleep(0.05)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def _backward(model: nn.Module, rank: int, step: int) -> None:
    torch.manual_seed(100 * step + rank)
    (model(torch.randn(6, 12)) * 3).pow(2).mean().backward()


def _fsdp2_local_clip(rank: int, source: str) -> dict:
    """The bug: the clip norm is this rank's shards only (no all-reduce of the squares)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.utils import get_total_norm

    from gradwatch import GradWatch, WatchConfig

    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    out: dict = {"exact": [], "local": []}
    with GradWatch(model, WatchConfig(port=0, collective_timeout_seconds=60)) as watch:
        for step in range(STEPS):
            model.zero_grad()
            _backward(model, rank, step)
            out["exact"].append(
                math.sqrt(_fsum_sq(p.grad.full_tensor() for p in model.parameters()))
            )
            out["local"].append(math.sqrt(_fsum_sq(p.grad.to_local() for p in model.parameters())))
            total = get_total_norm([p.grad for p in model.parameters()], 2.0)
            out.setdefault("total_to_local", []).append(float(total.to_local()))
            watch.collect(step)
            local_sq = sum(p.grad.to_local().pow(2).sum() for p in model.parameters())
            norm = local_sq.sqrt()  # the missing dist.all_reduce(local_sq) is the bug
            coef = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
            for p in model.parameters():
                p.grad.to_local().mul_(coef)
            watch.audit_norm(norm, step=step, source=source)
        watch.flush()
        if rank == 0:
            out["ratio"], out["disagreements"] = _audit_series(watch.metrics_url, source, STEPS)
    return out


def _ddp_loop(rank: int, world: int, source: str, reduce_again: bool) -> dict:
    """DDP averages the gradients; the buggy loop all-reduces them (a sum) once more."""
    from gradwatch import GradWatch, WatchConfig

    model = nn.parallel.DistributedDataParallel(_model())
    out: dict = {"exact": []}
    with GradWatch(model, WatchConfig(port=0, collective_timeout_seconds=60)) as watch:
        for step in range(STEPS):
            model.zero_grad()
            _backward(model, rank, step)
            out["exact"].append(math.sqrt(_fsum_sq(p.grad for p in model.parameters())))
            watch.collect(step)
            if reduce_again:
                for p in model.parameters():
                    dist.all_reduce(p.grad)  # the bug: already averaged by DDP
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            watch.audit_norm(norm, step=step, source=source)
            assert watch.last is not None  # every rank builds its results: rank 0 alone logs
        watch.flush()
        if rank == 0:
            out["ratio"], out["disagreements"] = _audit_series(watch.metrics_url, source, STEPS)
    return out


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("GRADWATCH_PORT", None)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        with Capture() as handler:
            result = {
                "fsdp2_local": _fsdp2_local_clip(rank, "fsdp_clip"),
                "ddp_twice": _ddp_loop(rank, world, "ddp_twice", reduce_again=True),
                "ddp_correct": _ddp_loop(rank, world, "torch_clip", reduce_again=False),
                "messages": handler.lines,
            }
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_audit_diagnoses_reproduced_bugs_and_stays_silent_on_a_correct_loop(
    tmp_path: Path,
) -> None:
    spawn_world(_worker, 2, (str(tmp_path),), timeout=200.0)
    r = json.loads((tmp_path / "0.json").read_text())
    messages = r["messages"]

    # FSDP2 clip by the local shard norm: the ratio is rank 0's local / whole-model norm, from
    # float64 references, and the diagnosis names the local norm and 1/sqrt(2).
    fsdp = r["fsdp2_local"]
    want = fsdp["local"][-1] / fsdp["exact"][-1]
    assert want < 0.95  # the reproduction is a real disagreement
    assert fsdp["ratio"] == pytest.approx(want, rel=1e-5)
    assert fsdp["disagreements"] == STEPS
    logged = [m for m in messages if "'fsdp_clip'" in m and "likely cause" in m]
    assert logged and "local norm" in logged[0] and "1/sqrt(2)" in logged[0], messages
    # docs/integrations.md, section 7: torch's get_total_norm of DTensor gradients is already
    # the whole model's norm, replicated: its to_local() is no rank-local norm (ratio 1).
    for got, exact in zip(fsdp["total_to_local"], fsdp["exact"], strict=True):
        assert got == pytest.approx(exact, rel=1e-6)

    # Gradients all-reduced again after DDP averaged them: twice the norm, diagnosed.
    twice = r["ddp_twice"]
    assert twice["ratio"] == pytest.approx(2.0, rel=1e-5)
    assert twice["disagreements"] == STEPS
    logged = [m for m in messages if "'ddp_twice'" in m]
    assert len(logged) == 1 and "reduced twice" in logged[0], messages

    # torch's clip on DDP is right (replicas hold the whole gradient): no alarm.
    correct = r["ddp_correct"]
    assert correct["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert correct["disagreements"] == 0
    assert not [m for m in messages if "'torch_clip'" in m]

    # Rank 1 built the same results (watch.last) and judged the same reports: only rank 0 logs.
    rank1 = json.loads((tmp_path / "1.json").read_text())["messages"]
    assert not [m for m in rank1 if "disagrees" in m], rank1
