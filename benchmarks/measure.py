"""How the benchmarks time and count, and the single-process measurements.

Every comparison is interleaved: the compared methods run round-robin on the same tensors,
each round in a rotated order, so load drift (other jobs on a shared machine) hits all of them
alike; results are medians with quartiles. Op and host-read counts come from separate untimed
calls under :mod:`gradwatch.doctor.testing`'s instruments, so counting never slows a timed call.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from benchmarks.cases import (
    CLIP_TARGET,
    SCRAPE_SPACING,
    SCRAPE_TOP_K,
    SPIKE_GROUPS,
    SPIKE_TARGET,
    GradHolder,
    NormCase,
    dtype_name,
    float64_reference,
    gradient_bytes,
    make_grads,
    mixed_baseline,
    mixed_label,
    mixed_sizes,
    norm_methods,
    scrape_rate,
    split_sizes,
)
from benchmarks.results import (
    ClipAccuracy,
    ClipResult,
    ClipVariant,
    Counts,
    MethodResult,
    MixedSizesResult,
    NormCaseResult,
    NormMethod,
    ScrapeLatencyResult,
    SpikeCostResult,
    Timing,
)
from gradwatch.doctor import timing
from gradwatch.doctor.testing import OpCounter, count_host_reads, largest_allocation

K = TypeVar("K")


# -- timing and counting ----------------------------------------------------------------------


def interleaved(
    fns: Mapping[K, Callable[[], Any]],
    rounds: tuple[int, int],
    budget_s: float,
    sync: Callable[[], None] | None = None,
) -> dict[K, Timing]:
    """:func:`gradwatch.doctor.timing.interleaved`, each method's times as a :class:`Timing`."""
    times = timing.interleaved(fns, rounds, budget_s, sync)
    return {name: Timing.of(ts) for name, ts in times.items()}


def count(fn: Callable[[], Any], allocations: bool = True) -> Counts:
    """Runs ``fn()`` once under both counters (and once more under the profiler).

    Host syncs = scalar reads seen by the dispatch mode (``item``/``float``/``bool``) plus
    ``tolist``/``numpy`` calls (``item`` is counted once: it dispatches
    ``_local_scalar_dense``). Largest bytes: the larger of the largest new op output seen by
    the dispatch mode and the profiler's largest per-op allocation, which also sees memory
    allocated inside a kernel.
    """
    with count_host_reads() as reads, OpCounter() as ops:
        fn()
    syncs = ops.scalar_reads + reads["tolist"] + reads["numpy"]
    inner = largest_allocation(fn) if allocations else 0
    return Counts(host_syncs=syncs, ops=ops.total, largest_bytes=max(ops.largest_bytes, inner))


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / reference


# -- the total norm ---------------------------------------------------------------------------


def _norm_case(grads: list[Tensor], label: str, rounds: tuple[int, int], budget_s: float,
               *, with_counts: bool, read_limit: bool,
               sync: Callable[[], None] | None = None) -> NormCaseResult:
    """Every compared method on ``grads``: timed interleaved, then counted and checked."""
    from gradwatch import GradWatch, WatchConfig

    reference = float64_reference(grads)
    model = GradHolder(grads)
    with GradWatch(model, WatchConfig()) as watch:
        ready_kernels(watch, lambda: watch.collect(0).result())  # the steady state is timed
        fns = norm_methods(grads, lambda: watch.collect(0).result().global_norm, model)
        if not read_limit:
            fns = {m: fn for m, fn in fns.items() if not m.is_read_limit}
        times = interleaved(fns, rounds, budget_s, sync)
        fastest_read = min((m for m in fns if m.is_read_limit), key=lambda m: times[m].median,
                           default=None)
        methods = []
        for method, fn in fns.items():
            if method.is_read_limit and method is not fastest_read:
                continue  # only the faster way to read every byte is the limit
            methods.append(MethodResult(
                method, times[method],
                counts=count(fn) if with_counts else None,
                rel_error=None if method.is_read_limit else relative_error(fn(), reference)))
    return NormCaseResult(
        label=label, n_tensors=len(grads), total_elements=sum(g.numel() for g in grads),
        dtype=dtype_name(grads[0].dtype), nbytes=gradient_bytes(grads), methods=tuple(methods),
        rounds=len(times[NormMethod.GRADWATCH]))


def per_collect(cases: Sequence[NormCase], rounds: tuple[int, int], budget_s: float,
                device: str = "cpu") -> list[NormCaseResult]:
    """Per-collect cost of every method, with host syncs, ops and the largest temporary."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    out = []
    for case in cases:
        grads = make_grads(split_sizes(case.n_tensors, case.total), case.dtype, device=device)
        out.append(_norm_case(grads, case.label, rounds, budget_s, with_counts=True,
                              read_limit=True, sync=sync))
        del grads  # the 200M-element cases: free before the next one allocates
    return out


def mixed(rounds: tuple[int, int], budget_s: float, big: int) -> list[MixedSizesResult]:
    """gradwatch against its target baseline on 48 x ``big`` + 200 small tensors."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        grads = make_grads(mixed_sizes(big), dtype, seed=2)
        baseline, target = mixed_baseline(dtype)
        case = _norm_case(grads, dtype_name(dtype), rounds, budget_s, with_counts=False,
                          read_limit=False)
        out.append(MixedSizesResult(case, mixed_label(big), baseline, target))
    return out


# -- clipping ---------------------------------------------------------------------------------

#: The variants of gradwatch's clipping, against torch's.
CLIP_PENDING = "watch.clip_grad_norm_ (snapshot left pending)"
CLIP_BUILT = "watch.clip_grad_norm_ + snapshot built"


def _clip_accuracy(grads: Sequence[Tensor], max_norm: float) -> ClipAccuracy:
    """The returned total norm's error, on the large (1M-element) tensors only, where
    float32 sums drift."""
    from gradwatch import GradWatch, WatchConfig

    large = [g for g in grads if g.numel() > 65536]
    reference = float64_reference(large)
    model = GradHolder(large)
    # The steady state's figure (the compiled kernels), compiled here: none left compiling.
    with GradWatch(model, WatchConfig(compile_kernels="wait")) as watch:
        gw = float(watch.clip_grad_norm_(max_norm, step=0))
    th = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm))
    return ClipAccuracy(n_tensors=len(large), tensor_elements=large[0].numel(),
                        torch_error=relative_error(th, reference),
                        gradwatch_error=relative_error(gw, reference))


def clipping(rounds: tuple[int, int], budget_s: float, big: int) -> list[ClipResult]:
    """watch.clip_grad_norm_ vs torch.nn.utils.clip_grad_norm_ on the same gradients, per dtype.

    max_norm is far above the norm, so both multiply by exactly 1 and the gradients stay the
    same across repetitions (both scale unconditionally, like clip_grads_with_norm_).
    """
    return [_clip_case(dtype, rounds, budget_s, big, max_norm=1e9)
            for dtype in (torch.float32, torch.bfloat16)]


def _clip_case(dtype: torch.dtype, rounds: tuple[int, int], budget_s: float, big: int,
               max_norm: float) -> ClipResult:
    from gradwatch import GradWatch, WatchConfig

    grads = make_grads(mixed_sizes(big), dtype, seed=3)
    model = GradHolder(grads)
    params = list(model.parameters())
    with GradWatch(model, WatchConfig()) as watch:

        def torch_clip() -> Tensor:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)

        def clip_pending() -> Tensor:
            return watch.clip_grad_norm_(max_norm, step=0)

        def clip_built() -> Tensor:
            total = watch.clip_grad_norm_(max_norm, step=0)
            watch.last  # noqa: B018 - materializes the snapshot (what the exporter thread does)
            return total

        compile_s = ready_kernels(watch, clip_pending)
        times = interleaved({"torch": torch_clip, CLIP_PENDING: clip_pending,
                             CLIP_BUILT: clip_built}, rounds, budget_s)
    return ClipResult(
        dtype=dtype_name(dtype), torch_clip=times["torch"],
        variants=(ClipVariant(CLIP_PENDING, times[CLIP_PENDING]),
                  ClipVariant(CLIP_BUILT, times[CLIP_BUILT])),
        accuracy=_clip_accuracy(grads, max_norm), target=CLIP_TARGET, compile_s=compile_s)


def ready_kernels(watch: Any, first_call: Callable[[], object]) -> float:
    """Steady state before timing: ``first_call()`` (which plans and starts compiling the
    engine's kernels off the training thread, as in a job: the default ``compile_kernels``)
    and the wait until every kernel is ready; the seconds it took. An engine without kernels
    (``compile_kernels="off"``) returns at once."""
    t0 = time.perf_counter()
    first_call()
    watch._collector.engine.kernels.wait(timeout=600)
    return time.perf_counter() - t0


# -- scrape latency ---------------------------------------------------------------------------


def scrape_latency(n_params: int, rounds: int) -> list[ScrapeLatencyResult]:
    """Per round: collect a step, wait until it is published, GET three times (the first
    renders the new step, the next two hit the cache)."""
    from gradwatch import GradWatch, WatchConfig

    pause = SCRAPE_SPACING / scrape_rate()
    model = GradHolder(make_grads([64] * n_params, torch.float32))
    out = []
    for top_k in SCRAPE_TOP_K:
        cfg = WatchConfig(port=0, bind_address="127.0.0.1", param_metrics_top_k=top_k)
        with GradWatch(model, cfg) as watch:
            url = watch.metrics_url
            assert url is not None
            collect: list[float] = []
            render: list[float] = []
            cached: list[float] = []
            size = 0
            for i in range(rounds):
                t0 = time.perf_counter()
                watch.collect(i).result()
                collect.append(time.perf_counter() - t0)
                watch.flush(30)
                for j in range(3):
                    time.sleep(pause)
                    t0 = time.perf_counter()
                    with urllib.request.urlopen(url, timeout=30) as resp:
                        size = len(resp.read())
                    (render if j == 0 else cached).append(time.perf_counter() - t0)
        out.append(ScrapeLatencyResult(n_params, top_k, Timing.of(collect), Timing.of(render),
                                       Timing.of(cached), size))
    return out


# -- spike detection --------------------------------------------------------------------------


def spike_cost(n_params: int, rounds: int) -> SpikeCostResult:
    """``result()`` of ``n_params`` 64-element parameters in :data:`SPIKE_GROUPS` groups with
    spike detection on (the defaults), against ``SpikeDetector.score`` alone on the same
    snapshots once every window is full (its most expensive state)."""
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.analysis.spikes import SpikeDetector

    model = GradHolder(make_grads([64] * n_params, torch.float32))
    # Parameter names are ps.0, ps.1, ...: one group per last digit.
    cfg = WatchConfig(groups={f"g{d}": [f"ps.*{d}"] for d in range(SPIKE_GROUPS)})
    result: list[float] = []
    snaps = []
    with GradWatch(model, cfg) as watch:
        for i in range(rounds):
            pending = watch.collect(i)
            t0 = time.perf_counter()
            snaps.append(pending.result())
            result.append(time.perf_counter() - t0)
    detector = SpikeDetector(cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup)
    order = 0
    for k in range(cfg.spike_window):  # fill every window
        order += 1
        detector.score(snaps[k % len(snaps)], order)
    score: list[float] = []
    for _ in range(10):
        for snap in snaps:
            order += 1
            t0 = time.perf_counter()
            detector.score(snap, order)
            score.append(time.perf_counter() - t0)
    return SpikeCostResult(
        n_params, SPIKE_GROUPS, cfg.spike_window, Timing.of(result), Timing.of(score),
        SPIKE_TARGET,
    )
