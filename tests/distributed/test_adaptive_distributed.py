"""clip_grad_norm_("auto") on 2 ranks (gloo, CPU) under DDP, FSDP2, FSDP1, tensor parallel and
two pipeline stages (one per rank, activations and their gradients sent between them), and on
4 ranks under two pipeline stages each sharded by FSDP2 over two data-parallel ranks.

120 steps with 40x gradient spikes at three steps after the 25-step warm-up: every spike's
post-clip whole-model norm (a float64 reference: full_tensor() gathers or an all-reduce of
math.fsum squares, tests only) is within 3x the typical norm, at most 5 ordinary post-warm-up
steps are clipped, the threshold, the coefficient (the host figure and the tensor the gradients
were multiplied by), the warm-up count and the whole history are bitwise equal on both ranks at
every step, and no call (the first, the warm-up's and the spikes' included) reads a scalar to
the host (a dispatch-mode count). A run resumed at 2 ranks under DDP from ``state_dict()``
continues bit for bit as the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from clip_spy import CoefficientSpy
from torch import nn
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]

STEPS = 120
WARMUP = 25
SPIKES = (50, 80, 105)  # after the warm-up
KINDS = ("ddp", "fsdp2", "fsdp1", "tp", "pp")


def _worker(rank: int, world: int, port: int, out: str, kinds: tuple[str, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        results = {kind: _run(rank, world, kind) for kind in kinds}
        Path(out, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@dataclass
class Layout:
    """A model under one parallelism, as this rank holds it.

    Attributes:
        model: this rank's module.
        batch_seed: the seed of this rank's batches (equal on the ranks of one replica).
        watch_kwargs: what ``GradWatch`` needs besides the model (groups).
        sum_group: the group over which this rank's squares are disjoint parts of the whole
            model (summed by the reference); None: this rank's gathered gradients are whole.
        stage: ``(k, peer)`` under pipeline parallelism: this rank's stage and the global
            rank of the other stage of its replica; None otherwise.
    """

    model: nn.Module
    batch_seed: int
    watch_kwargs: dict = field(default_factory=dict)
    sum_group: object = None
    stage: tuple[int, int] | None = None


def _wrap(kind: str, world: int) -> Layout:
    """The model under ``kind``: "ddp", "fsdp2", "fsdp1", "tp", "pp" (rank r holds stage r)
    or "pp_fsdp2" (a (pp=2, dp=2) mesh: each stage sharded by FSDP2 over its dp pair)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    stages = (nn.Sequential(model[0], model[1]), model[2])
    if kind == "pp":  # disjoint parameter names per stage
        return Layout(nn.ModuleDict({f"stage{rank}": stages[rank]}), 1000,
                      {"stage_group": dist.group.WORLD}, dist.group.WORLD, (rank, 1 - rank))
    if kind == "pp_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        k, replica = mesh.get_coordinate()
        stage = fully_shard(stages[k], mesh=mesh["dp"])
        stage_group = mesh["pp"].get_group()
        return Layout(nn.ModuleDict({f"stage{k}": stage}), 1000 + replica,
                      {"stage_group": stage_group, "process_group": mesh["dp"].get_group()},
                      stage_group, (k, (1 - k) * 2 + replica))
    if kind == "ddp":
        return Layout(nn.parallel.DistributedDataParallel(model), 1000 + rank)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        return Layout(fully_shard(model), 1000 + rank)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        fsdp1 = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        return Layout(fsdp1, 1000 + rank, sum_group=dist.group.WORLD)  # disjoint flat shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return Layout(model, 1000)


def _post_clip_norm(layout: Layout) -> float:
    """The whole-model norm of the clipped gradients, float64 (every rank calls it): DTensor
    gradients gathered whole (``full_tensor``), the squares summed over ``sum_group``."""
    squares: list[float] = []
    for p in layout.model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        squares.extend(float(v) ** 2 for v in g.double().flatten())
    local = math.fsum(squares)
    if layout.sum_group is None:
        return math.sqrt(local)
    total = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(total, group=layout.sum_group)  # type: ignore[arg-type]
    return math.sqrt(float(total))


def _backward(layout: Layout, x: torch.Tensor, y: torch.Tensor, scale: float) -> None:
    """The loss ``scale * mse(model(x), y)``, backward; through two pipeline stages, stage 0
    sends its activations to stage 1 of its replica, which sends their gradient back."""
    if layout.stage is None:
        ((layout.model(x) - y).pow(2).mean() * scale).backward()
        return
    k, peer = layout.stage
    stage = next(iter(layout.model.values()))  # type: ignore[operator]
    if k == 0:
        h = stage(x)
        dist.send(h.detach().contiguous(), peer)
        grad = torch.empty_like(h)
        dist.recv(grad, peer)
        h.backward(grad)
    else:
        h = torch.empty(x.shape[0], 16)
        dist.recv(h, peer)
        h.requires_grad_(True)
        ((stage(h) - y).pow(2).mean() * scale).backward()
        dist.send(h.grad.contiguous(), peer)


def _row(watch: object, total: torch.Tensor, spy: CoefficientSpy, post: float) -> dict:
    """One step's figures as exact hex strings (``post``: the float64 reference)."""
    history = watch._collector.history  # type: ignore[attr-defined]
    assert history is not None and history.last is not None
    reading = history.last.reading()
    return {
        "norm": float(total).hex(),
        "threshold": None if reading.threshold is None else reading.threshold.hex(),
        "limit": None if reading.limit is None else reading.limit.hex(),
        "coef": reading.coef.hex(),
        "applied": spy.hex(),
        "samples": reading.samples,
        "state": [float(t).hex() for t in history.state()],
        "post": post,
    }


def _run(rank: int, world: int, kind: str) -> dict:
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.doctor.testing import OpCounter

    layout = _wrap(kind, world)
    opt = torch.optim.SGD(layout.model.parameters(), lr=1e-3)
    watch = GradWatch(layout.model, WatchConfig(collective_timeout_seconds=60),
                      **layout.watch_kwargs)
    assert watch.config.adaptive_clip_warmup == WARMUP
    gen = torch.Generator().manual_seed(layout.batch_seed)
    rows: list[dict] = []
    scalar_reads = 0
    for step in range(STEPS):
        x = torch.randn(16, 12, generator=gen)
        y = torch.randn(16, 4, generator=gen)  # noise targets: a steady gradient norm
        _backward(layout, x, y, 40.0 if step in SPIKES else 1.0)
        with CoefficientSpy() as spy, OpCounter() as ops:
            total = watch.clip_grad_norm_("auto", step=step)
        scalar_reads += ops.scalar_reads
        rows.append(_row(watch, total, spy, _post_clip_norm(layout)))
        opt.step()
        opt.zero_grad()
    parallelism = watch.parallelism
    watch.close()
    return {"rows": rows, "scalar_reads": scalar_reads, "parallelism": parallelism}


def _check(kind: str, results: list[dict]) -> None:
    """Every clause of the spike run (module docstring) for ``kind``, over every rank."""
    first = results[0]["rows"]
    for res in results:
        assert res["scalar_reads"] == 0, (kind, res["scalar_reads"])
        assert res["parallelism"] == results[0]["parallelism"]
        for step, (a, b) in enumerate(zip(first, res["rows"], strict=True)):
            assert len(b["applied"]) == 1, (kind, step, b["applied"])  # one factor per clip
            assert b["applied"] == [b["coef"]], (kind, step)  # the host figure is the factor
            assert b["samples"] == step, (kind, step)  # every step measured, counted once
            exact = {k: v for k, v in a.items() if k != "post"}
            assert exact == {k: v for k, v in b.items() if k != "post"}, (kind, step)
    norms = [float.fromhex(r["norm"]) for r in first]
    ordinary = [n for s, n in enumerate(norms) if s not in SPIKES]
    typical = sorted(ordinary)[len(ordinary) // 2]
    for res in results:
        for step, row in enumerate(res["rows"]):
            threshold = row["threshold"]
            assert (threshold is None) == (step < WARMUP), (kind, step)
            if threshold is not None:
                # the clipped gradients' norm, measured independently, is min(norm, limit)
                want = min(norms[step], float.fromhex(row["limit"]))
                assert row["post"] == pytest.approx(want, rel=1e-5), (kind, step)
    for spike in SPIKES:
        assert norms[spike] > 20 * typical, (kind, spike)
        assert first[spike]["post"] < 3 * typical, (kind, spike, first[spike]["post"])
    clipped = [
        s for s, row in enumerate(first)
        if s >= WARMUP and s not in SPIKES and float.fromhex(row["coef"]) < 1.0
    ]
    assert len(clipped) <= 5, (kind, clipped)


def test_auto_clip_agrees_on_every_rank_and_cuts_spikes(tmp_path: Path) -> None:
    spawn_world(_worker, 2, (str(tmp_path), KINDS), timeout=420)
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for kind in KINDS:
        results = [r[kind] for r in per_rank]
        if kind == "pp":
            assert results[0]["parallelism"].startswith("pp2"), results[0]["parallelism"]
        _check(kind, results)


def test_auto_clip_agrees_across_pipeline_stages_of_fsdp2_shards(tmp_path: Path) -> None:
    """4 ranks, a (pp=2, dp=2) mesh: two pipeline stages, each sharded by FSDP2 over its two
    data-parallel ranks (two replicas on their own batches): the same clauses, every rank of
    every stage bit for bit."""
    spawn_world(_worker, 4, (str(tmp_path), ("pp_fsdp2",)), timeout=420)
    results = [json.loads((tmp_path / f"{r}.json").read_text())["pp_fsdp2"] for r in range(4)]
    assert results[0]["parallelism"].startswith("pp2+fsdp2x2"), results[0]["parallelism"]
    _check("pp_fsdp2", results)


RESUME_STEPS = 60
RESUME_AT = 40  # warm, after the first spike
RESUME_SPIKES = (30, 50)


def _resume_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(2000 + rank)
        batches = [(torch.randn(16, 12, generator=gen), torch.randn(16, 4, generator=gen))
                   for _ in range(RESUME_STEPS)]
        whole = _train(batches, range(RESUME_STEPS), None, Path(out))
        first = _train(batches, range(RESUME_AT), None, Path(out))
        resumed = _train(batches, range(RESUME_AT, RESUME_STEPS), Path(out, "ckpt.pt"), Path(out))
        fresh = _train(batches, range(RESUME_AT, RESUME_STEPS), Path(out, "ckpt.pt"), Path(out),
                       load_watch=False)
        Path(out, f"{rank}.json").write_text(json.dumps({
            "whole": whole, "first": first, "resumed": resumed, "fresh": fresh,
        }))
    finally:
        dist.destroy_process_group()


def _train(
    batches: list[tuple[torch.Tensor, torch.Tensor]], steps: range, resume: Path | None,
    out: Path, load_watch: bool = True,
) -> dict:
    """DDP training with ``clip_grad_norm_("auto")`` over ``steps``; started from the checkpoint
    ``resume`` (rank 0 wrote it, every rank loads it) or from scratch. A run that stops before
    the last step saves the checkpoint (model, optimizer, ``watch.state_dict()``) at its end,
    from rank 0, the way a training script does; every rank's own ``state_dict()`` is
    returned too (hex), to show they agree."""
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0 if resume is None else 7)  # a resumed run's own init is overwritten
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    checkpoint = None
    if resume is not None:
        checkpoint = torch.load(resume, weights_only=True)
        net.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    layout = Layout(nn.parallel.DistributedDataParallel(net), 0)
    watch = GradWatch(layout.model, WatchConfig(collective_timeout_seconds=60))
    if checkpoint is not None and load_watch:
        watch.load_state_dict(checkpoint["gradwatch"])
    rows: dict[int, dict] = {}
    for step in steps:
        x, y = batches[step]
        _backward(layout, x, y, 40.0 if step in RESUME_SPIKES else 1.0)
        with CoefficientSpy() as spy:
            total = watch.clip_grad_norm_("auto", step=step)
        rows[step] = _row(watch, total, spy, _post_clip_norm(layout))
        opt.step()
        opt.zero_grad()
    state = watch.state_dict()
    saved = [float(t).hex() for t in (state["adaptive_clip"][k] for k in ("mean", "var", "count"))]
    if steps.stop < RESUME_STEPS:
        if dist.get_rank() == 0:
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "gradwatch": state}, out / "ckpt.pt")
        dist.barrier()
    watch.close()
    return {"rows": {str(k): v for k, v in rows.items()}, "saved": saved}


def test_a_resumed_run_continues_the_threshold_bit_for_bit(tmp_path: Path) -> None:
    """2 ranks, DDP: a run stopped at a warm step and resumed from its checkpoint (model,
    optimizer and ``watch.state_dict()``, saved by rank 0, loaded by both) clips every later
    step (a spike among them) by the same threshold, limit and coefficient, bit for bit, as
    the uninterrupted run, on both ranks; a resumed watcher that did not load the state starts
    its warm-up again (so the comparison can fail)."""
    spawn_world(_resume_worker, 2, (str(tmp_path),), timeout=300)
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for res in per_rank:
        assert res["first"]["saved"] == per_rank[0]["first"]["saved"]  # every rank's state
        assert res["first"]["saved"] == res["whole"]["rows"][str(RESUME_AT - 1)]["state"]
        for step in range(RESUME_AT, RESUME_STEPS):
            whole, resumed = res["whole"]["rows"][str(step)], res["resumed"]["rows"][str(step)]
            assert whole["threshold"] is not None
            exact = {k: v for k, v in whole.items() if k != "post"}
            assert exact == {k: v for k, v in resumed.items() if k != "post"}, step
            assert res["fresh"]["rows"][str(step)]["threshold"] is None, step
        assert res["resumed"]["rows"] == per_rank[0]["resumed"]["rows"]
        spike = res["resumed"]["rows"][str(RESUME_SPIKES[1])]
        assert float.fromhex(spike["coef"]) < 0.1
    # the uninterrupted run's state at the end agrees on both ranks and with the resumed run's
    assert per_rank[0]["whole"]["saved"] == per_rank[1]["resumed"]["saved"]
