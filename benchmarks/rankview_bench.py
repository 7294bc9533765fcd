"""The per-rank view's cost, the default DDP path's saving, and one alternative to the view's
path: the DDP step of the demo model on 2 gloo ranks (one thread each), every kind of step in
the same process, interleaved in palindromic blocks so drift and cache effects hit every kind
alike.

The kinds (:class:`~benchmarks.results.RankViewMode`), each a DDP copy of the same model:

* ``WATCHED``: gradwatch as it runs by default (no comm hook: DDP's built-in all-reduce; under
  this pure replication an ordinary collect issues no all-reduce of its own, the divergence
  step, every ``divergence_every``-th collect, does).
* ``ALWAYS_REDUCE``: ``WatchConfig(always_reduce=True)`` without the view: one all-reduce per
  collect, what the default's saving is measured against.
* ``HOOK_ONLY``: as ``ALWAYS_REDUCE``, with gradwatch's comm hook registered but measuring
  nothing (``ddp_comm_hook`` of a watch without the view): what the Python hook itself costs
  over DDP's built-in reduction, over the same all-reduces as ``RANK_VIEW``.
* ``RANK_VIEW``: ``WatchConfig(rank_view=True)``: the hook measures each bucket before the
  all-reduce; ``collect()`` reads every gradient again for the post-reduction statistics and
  all-reduces (the other ranks' local figures), on every collect.
* ``IN_CALLBACK`` (prototype, this module only): as ``RANK_VIEW``, but the hook's completion
  callback computes the post-reduction per-parameter squares from the reduced bucket (hot in
  cache) with the same per-bucket plan, so ``collect()`` skips its own pass and only packs and
  issues the collective.

Every step is forward, backward, ``collect``, optimizer step and ``result()`` on the training
thread (all of gradwatch's work inside the timed step; ``collect_only=True``: the documented
loop, ``collect`` only, rank 0's exporter thread building the results). Each block runs every
kind once, then in reverse order, so a linear drift cancels within a block. Rank 0's times are
kept.

Standalone::

    PYTHONPATH=src:. python -c \
        "from benchmarks.rankview_bench import rank_view; print(rank_view(20))"

``make bench`` runs every kind with ``result()`` on the training thread, then
:data:`LOOP_KINDS` in the documented collect-only loop::

    rank_view(300, LOOP_KINDS, collect_only=True)
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init
from benchmarks.results import RankViewMode, RankViewResult
from gradwatch.doctor.timing import palindromic
from gradwatch.stacks.ddp_hook import _sum_options

#: The kinds timed in the documented collect-only loop too (the in-callback prototype only
#: moves work between two calls on the training thread: the other loop shows it).
LOOP_KINDS = (RankViewMode.WATCHED, RankViewMode.ALWAYS_REDUCE, RankViewMode.HOOK_ONLY,
              RankViewMode.RANK_VIEW)


class _InCallbackSquares:
    """Prototype: the post-reduction per-parameter squared norms, computed in the comm hook's
    completion callback from the reduced bucket, handed to ``collect()`` in place of the
    engine's pass (its ``squared_norms_and_plan``).

    The reduction is ``allreduce_hook``'s (divide by the group size, all-reduce) with one
    callback; per bucket, the rank view's own plan (:class:`gradwatch.stacks.ddp_hook._BucketPlan`)
    with parameters in place of groups: rows of 512 float32 elements normed in place, squared
    into float64 and added per parameter by ``index_add_``, straddling rows element by element. The
    squares land in the plain band of a ``3N`` banded vector (no repair pass: a benchmark
    prototype, not the engine's exactness contract for extreme magnitudes)."""

    def __init__(self, params: list[Tensor]) -> None:
        from gradwatch.stacks.ddp_hook import _BucketPlan

        self._plan_type = _BucketPlan
        self._n = len(params)
        self._index = {id(p): i for i, p in enumerate(params)}
        self._plans: dict[int, Any] = {}  # by bucket index
        self._acc = torch.zeros(3 * self._n + 1, dtype=torch.float64)  # + one discard slot

    def hook(self, state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
        group = state
        buffer = bucket.buffer()
        buffer.div_(group.size())
        if bucket.index() == 0:
            self._acc.zero_()
        plan = self._plans.get(bucket.index())
        if plan is None or plan.source() is not buffer:  # found again by buffer, as the view's
            positions = [self._index[id(p)] for p in bucket.parameters()]
            plan = self._plans[bucket.index()] = self._plan_type.build(
                buffer, bucket.gradients(), positions, 3 * self._n)
        acc = self._acc

        def reduced(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
            out = fut.value()[0]
            plan.add_squares(acc, out)
            return out

        return group.allreduce([buffer], _sum_options()).get_future().then(reduced)

    def squared_norms_and_plan(self, tensors: Any, out_device: Any = None) -> tuple[Tensor, None]:
        return self._acc[: 3 * self._n].clone(), None


def _job(mode: RankViewMode, endpoint: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from gradwatch import GradWatch, WatchConfig, ddp_comm_hook

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    view = mode in (RankViewMode.RANK_VIEW, RankViewMode.IN_CALLBACK)
    # ``endpoint``: rank 0 serves the endpoint, so its exporter thread builds the results, as
    # deployed (the collect-only loop).
    always = mode in (RankViewMode.ALWAYS_REDUCE, RankViewMode.HOOK_ONLY)
    watch = GradWatch(model, WatchConfig(
        rank_view=view, always_reduce=always, collective_timeout_seconds=120,
        port=0 if endpoint else None, bind_address="127.0.0.1"))
    ddp: Any = model
    if mode is RankViewMode.HOOK_ONLY:
        ddp.register_comm_hook(ddp.process_group, ddp_comm_hook(watch))
    elif mode is RankViewMode.IN_CALLBACK:
        squares = _InCallbackSquares(watch._resolved.params)
        ddp.register_comm_hook(ddp.process_group, ddp_comm_hook(watch, inner=squares.hook))
        watch._collector.engine = squares
    # The kinds' labels say which collects all-reduce: hold each watch to its label (an
    # ordinary collect, not a divergence step).
    if watch._reducer.issues_collective(False) is (mode is RankViewMode.WATCHED):
        raise RuntimeError(f"{mode.name}: an ordinary collect would "
                           f"{'' if mode is RankViewMode.WATCHED else 'not '}all-reduce")
    return model, opt, watch


def _hook_ops(watch: Any, step: Callable[[], None]) -> tuple[int, int]:
    """(buckets, aten ops) of one backward's rank-view measurement
    (:meth:`gradwatch.stacks.ddp_hook.LocalView.observe`, all buckets) under
    :class:`gradwatch.doctor.testing.OpCounter`."""
    from gradwatch.doctor.testing import OpCounter
    from gradwatch.stacks.ddp_hook import LocalView

    observe = LocalView.observe
    counted = {"buckets": 0, "ops": 0}

    def counting(self: LocalView, bucket: Any) -> None:
        with OpCounter() as ops:
            observe(self, bucket)
        counted["buckets"] += 1
        counted["ops"] += ops.total

    LocalView.observe = counting  # type: ignore[method-assign]
    try:
        step()
    finally:
        LocalView.observe = observe  # type: ignore[method-assign]
    return counted["buckets"], counted["ops"]


def _worker(rank: int, port: int, blocks: int, out: str, kinds: tuple[RankViewMode, ...],
            collect_only: bool) -> None:
    import torch.distributed as dist

    _init(rank, port)
    try:
        jobs = {mode: _job(mode, collect_only and rank == 0) for mode in kinds}
        _, width, batch = build_model(ModelSpec("demo", "demo model"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def step(mode: RankViewMode, i: int) -> None:
            model, opt, watch = jobs[mode]
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            pending = watch.collect(i)
            opt.step()
            if not collect_only:
                pending.result()

        # three warm-up blocks first (DDP rebuilds its buckets after one step)
        times = palindromic(step, kinds, blocks, barrier=dist.barrier)
        buckets = ops = 0
        if RankViewMode.RANK_VIEW in jobs:
            buckets, ops = _hook_ops(jobs[RankViewMode.RANK_VIEW][2],
                                     lambda: step(RankViewMode.RANK_VIEW, 10**6))
        for _, _, watch in jobs.values():
            watch.close()
        if rank == 0:
            n_params = sum(p.numel() for p in next(iter(jobs.values()))[0].parameters()
                           if p.requires_grad)
            Path(out).write_bytes(pickle.dumps(RankViewResult(
                model="demo model", n_params=n_params, blocks=blocks,
                step_times={m: tuple(ts) for m, ts in times.items()},
                buckets=buckets, hook_ops=ops, collect_only=collect_only)))
    finally:
        dist.destroy_process_group()


def rank_view(blocks: int = 120, kinds: tuple[RankViewMode, ...] = tuple(RankViewMode),
              collect_only: bool = False) -> RankViewResult:
    """``blocks`` palindromic blocks of ``kinds`` (``make bench``: every
    :class:`RankViewMode`) on 2 spawned ranks. ``collect_only``: the documented loop instead
    (``collect`` only, rank 0's exporter thread builds the results; standalone, not in
    ``make bench``)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        mp.spawn(_worker, args=(_free_port(), blocks, path, tuple(kinds), collect_only),
                 nprocs=WORLD, join=True)
        # our own child wrote it, into our own temporary directory
        result: RankViewResult = pickle.loads(Path(path).read_bytes())
    return result
