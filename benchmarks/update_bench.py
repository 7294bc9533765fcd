"""The cost of optimizer-update health (``update_stats=True``): the DDP step of the demo model
on 2 gloo ranks (one thread each) with an AdamW (foreach, torch's default on CPU), watched by
gradwatch without and with update stats, in the same processes, interleaved in palindromic
blocks (A B C C B A, :func:`gradwatch.doctor.timing.palindromic`) so drift and cache effects hit
every kind alike; each ratio is the median over blocks with a 95% bootstrap interval
(:func:`benchmarks.results.paired_ratio`).

A third kind, the **floor**, is the job without update stats plus a bare optimizer step
post-hook (:class:`FloorHook`) doing the least work any exact per-element update figure needs:
one compiled pass (inductor, as the meter's kernels) that reads every parameter and its AdamW
state (``exp_avg``, ``exp_avg_sq``) once and reduces them to one float64 scalar, nothing read
on the host, no Python per parameter (its tensor lists are built once). Its ratio over the
step without update stats is what memory traffic alone costs here: if the floor already costs
the target, no implementation of these exact figures meets it on this machine.

A fourth kind, the **arithmetic floor**, is the same hook whose pass also computes, per
element, Adam's quotient ``m / (sqrt(v) + eps)`` added to the weight (one square root and one
division: the update ``lr * m_hat / (sqrt(v_hat) + eps)`` is a per-element quotient that no
exact figure of the applied update can skip, and the weight it is rounded against), summed in
float64. It computes less than the meter must (no decay inverted, no count, no weight norm):
if it already costs more than the target, no exact figure of Adam's applied update computed
after the step meets the target on this machine.

Every step is forward, backward, ``collect`` and the optimizer step (the update's measurement
runs in the optimizer's step post-hook), as the documented loop. Rank 0's times are kept.

The steady state is timed: the job with update stats is built with the default
``compile_kernels="background"``; two warm steps show the meter every layout (its fused
kernels start compiling on the compile thread, the steps measure eagerly meanwhile), then each
rank waits for its kernels (``KernelCache.wait``) and a barrier follows, so every timed step
of every rank runs the compiled kernels. The seconds from the first step to ready are reported
(both ranks compile at once), and so is the number of kernels that failed to compile (0
expected: a failure would leave the eager path timed).

Untimed, after the blocks: one warm step of each kind under ``torch.profiler`` (the aten ops
dispatched, the compiled kernels' wrappers included, and the scalar reads among them: the
difference is what update stats add); one more under ``gradwatch.doctor.testing.OpCounter``
(a dispatch mode: the eager path runs under it, host scalar reads 0 expected); the training
thread's CPU time per step (``time.thread_time``, interleaved steps of the four kinds);
memory: the meter's persistent buffers, and the largest allocation of one warm optimizer step
with and without it (the host reads and the allocation: the kinds without and with update
stats) (``largest_allocation``), against the parameters' bytes.

Standalone::

    PYTHONPATH=src:. python -c "from benchmarks.update_bench import updates; print(updates(20))"
"""

from __future__ import annotations

import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init
from benchmarks.results import UpdateStatsMode, UpdateStatsResult
from gradwatch.doctor.timing import palindromic


def floor_pass(params: list[Tensor], ms: list[Tensor], vs: list[Tensor]) -> Tensor:
    """Every element of the weights and of Adam's two moments read once, summed in float64:
    one float64 scalar (what :class:`FloorHook` compiles)."""
    return torch.stack([(p + m + v).to(torch.float64).sum()
                        for p, m, v in zip(params, ms, vs, strict=True)]).sum()


def arithmetic_floor_pass(params: list[Tensor], ms: list[Tensor], vs: list[Tensor]
                          ) -> Tensor:
    """:func:`floor_pass` plus the per-element arithmetic of Adam's update: each weight plus
    ``m / (sqrt(v) + eps)``, summed in float64 (what :class:`FloorHook` compiles for the
    arithmetic floor)."""
    return torch.stack([(p + m / (v.sqrt() + 1e-8)).to(torch.float64).sum()
                        for p, m, v in zip(params, ms, vs, strict=True)]).sum()


class FloorHook:
    """An optimizer step post-hook doing the least work an exact per-element figure of the
    applied update needs: :func:`floor_pass` compiled (:func:`compile_traced`, the meter's
    compiler) over the parameters with Adam state, called on the tensor lists built at the
    first step (which compiles it: an untimed warm-up step); its scalar is kept, never read."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 fn: Callable[..., Tensor] = floor_pass) -> None:
        self.fn = fn
        self.kernel: Callable[..., Tensor] | None = None
        self.args: tuple[list[Tensor], list[Tensor], list[Tensor]] = ([], [], [])
        self.out: Tensor | None = None
        self.handle = optimizer.register_step_post_hook(self)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.kernel is None:
            from gradwatch.norms.kernels import compile_traced

            state = optimizer.state
            params = [p for g in optimizer.param_groups for p in g["params"] if p in state]
            self.args = (params, [state[p]["exp_avg"] for p in params],
                         [state[p]["exp_avg_sq"] for p in params])
            self.kernel = compile_traced(self.fn, lambda: self.args)
        with torch.no_grad():
            self.out = self.kernel(*self.args)


def _job(mode: UpdateStatsMode, compile_kernels: str = "background"
         ) -> tuple[nn.Module, Any, Any]:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    watch = GradWatch(model, WatchConfig(
        update_stats=mode is UpdateStatsMode.UPDATES, collective_timeout_seconds=120,
        compile_kernels=compile_kernels))  # type: ignore[arg-type]
    if mode is UpdateStatsMode.FLOOR:
        FloorHook(opt)
    elif mode is UpdateStatsMode.ARITHMETIC_FLOOR:
        FloorHook(opt, arithmetic_floor_pass)
    return model, opt, watch


def _until_compiled(step: Callable[[int], None], watch: Any) -> tuple[float, int, int]:
    """Two steps (every layout seen), then wait for the meter's kernels: (seconds from the
    first step to ready, kernels ready, kernels failed)."""
    start = time.perf_counter()
    for i in range(2):
        step(-2 + i)
    cache = watch._resolved.updates.fused.cache
    cache.wait(timeout=900)
    return time.perf_counter() - start, cache.ready, cache.failed


def _profiled_ops(fn: Callable[[], None]) -> tuple[int, int]:
    """(aten ops dispatched, scalar reads among them) while ``fn`` runs, from the profiler
    (not a dispatch mode: the compiled kernels run under it)."""
    from torch.profiler import ProfilerActivity, profile

    from gradwatch.doctor.testing import _without_profiler_banners

    with _without_profiler_banners(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return (sum(n.startswith("aten::") for n in names),
            sum(n == "aten::_local_scalar_dense" for n in names))


def _thread_ms(step: Callable[[UpdateStatsMode, int], None], kinds: tuple, steps: int
               ) -> dict[UpdateStatsMode, float]:
    """Median CPU time of the training thread per step (ms), the kinds interleaved."""
    times: dict[UpdateStatsMode, list[float]] = {k: [] for k in kinds}
    for i in range(steps):
        for mode in kinds if i % 2 == 0 else kinds[::-1]:
            t0 = time.thread_time()
            step(mode, 2 * 10**6 + i)
            times[mode].append(time.thread_time() - t0)
    return {k: 1e3 * statistics.median(ts) for k, ts in times.items()}


def _persistent_bytes(watch: Any) -> int:
    """The update meter's persistent device buffers (figures, indices, masks; the weight
    views it keeps are views of the parameters, no memory of their own)."""
    meter = watch._resolved.updates
    if meter is None:
        return 0
    sums = meter._section
    held = [meter._updates, sums.group, sums.mask, sums.all, *meter._indices.values()]
    return sum(t.numel() * t.element_size() for t in held)


def _worker(rank: int, port: int, blocks: int, out: str, compile_kernels: str) -> None:
    import torch.distributed as dist

    from gradwatch.doctor.testing import OpCounter, largest_allocation

    _init(rank, port)
    kinds = tuple(UpdateStatsMode)
    try:
        jobs = {mode: _job(mode, compile_kernels) for mode in kinds}
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

        compile_s, ready, failed = _until_compiled(
            lambda i: step(UpdateStatsMode.UPDATES, i), jobs[UpdateStatsMode.UPDATES][2])
        step(UpdateStatsMode.FLOOR, -3)  # the floor hooks' compiles
        step(UpdateStatsMode.ARITHMETIC_FLOOR, -3)
        dist.barrier()
        times = palindromic(step, kinds, blocks, barrier=dist.barrier)
        reads = {}
        peak = {}
        ops = {}
        for mode in kinds:
            ops[mode] = _profiled_ops(lambda mode=mode: step(mode, 3 * 10**6))
        thread = _thread_ms(step, kinds, max(20, min(blocks, 200)))
        for mode in (UpdateStatsMode.WATCHED, UpdateStatsMode.UPDATES):
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
                largest_allocation={m: int(b) for m, b in peak.items()},
                compile_seconds=compile_s, kernels_ready=ready, kernels_failed=failed,
                ops_per_step={m: o for m, (o, _) in ops.items()},
                profiled_scalar_reads=(ops[UpdateStatsMode.UPDATES][1]
                                       - ops[UpdateStatsMode.WATCHED][1]),
                thread_ms=thread)))
    finally:
        dist.destroy_process_group()


def updates(blocks: int = 300, compile_kernels: str = "background") -> UpdateStatsResult:
    """``blocks`` palindromic blocks of the :class:`UpdateStatsMode` kinds on 2 spawned
    ranks (``compile_kernels="off"``: the eager path, for comparison)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        mp.spawn(_worker, args=(_free_port(), blocks, path, compile_kernels), nprocs=WORLD,
                 join=True)
        # our own child wrote it, into our own temporary directory
        result: UpdateStatsResult = pickle.loads(Path(path).read_bytes())
    return result
