"""What ``rank_timing`` costs under plain DDP: the demo model's step on 2 gloo ranks (one
thread each), gradwatch with its defaults against the same with ``rank_timing=True``, in the
same processes, interleaved in palindromic blocks (A B B A,
:func:`gradwatch.doctor.timing.palindromic`); rank 0's times are kept. Each step is forward,
backward, ``collect``, the optimizer step and ``result()`` on the training thread.

Two figures, because the paired A/B ratio on a 2-core machine has an interval of a few
percent while the target is +0.5%:

* **the paired ratio** (:func:`benchmarks.results.paired_ratio`): median over blocks, with its
  95% bootstrap interval: what the step costs, noise included;
* **the added work** (the verdict's figure, docs/benchmarks.md "Rank timing"): what the timing
  code itself spends per step, measured in-process over the whole run: every call of its code
  on the training thread (the gradient hooks' bodies, ``start``, ``lap``, the pack on carried
  steps, the decode and the snapshot fields, each wrapped by a ``perf_counter`` meter: calls
  times the median call, so a call the scheduler preempted does not count its wait), plus
  autograd's dispatch of its hooks (hook calls per step times the per-call cost of a no-op
  ``post_accumulate_grad`` hook, timed on a one-element leaf in the same process), plus the
  longer packed vector's zero-fill and host copy (``zeros(n).tolist()`` with and without the
  timing section). Its sum over the median step time without timing.

Counted, not timed: gradwatch's c10d collectives per ordinary and per carried collect and the
host reads of a warm collect with timing (``gradwatch.doctor.testing``), on the same jobs.
Standalone::

    PYTHONPATH=src:. python -c "from benchmarks.ranktiming_bench import measure; print(measure(20))"
"""

from __future__ import annotations

import os
import pickle
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.cases import ModelSpec, build_model, wrap
from benchmarks.distributed import WORLD, _free_port, _init
from benchmarks.results import PairedRatio, Target, TargetCheck, Timing, paired_ratio
from gradwatch.doctor.timing import palindromic

KINDS = ("default", "rank_timing")
#: The added work of rank timing per step, over the demo model's 2-rank DDP step.
TARGET = Target(0.5, "%")
#: The heading of the section's known causes in docs/benchmarks.md.
CAUSE = "Rank timing"
HOOK_REPS = 3000  # backward passes per variant of the hook-dispatch measure


@dataclass(frozen=True)
class RankTimingResult:
    """Rank 0's figures: step times per kind (palindromic blocks), the metered time of the
    timing code over the run, the hook dispatch and vector-growth costs, counts."""

    model: str
    blocks: int
    step_times: dict[str, tuple[float, ...]]
    steps: int  # steps run with rank timing while metered (the warm-up blocks' too)
    #: per function of the timing code: calls over those steps, median seconds of one call
    metered: dict[str, tuple[int, float]]
    hook_dispatch_seconds: float  # autograd's cost of one hook call
    vector_seconds: float  # zero-fill + host copy of the timing section, per collect
    carried_collects: int  # collects whose all-reduce carried timing, over those steps
    collectives_ordinary: int  # gradwatch's c10d ops in one warm ordinary collect (timed)
    collectives_ordinary_untimed: int
    collectives_carried: int  # ... in one carried (divergence) collect
    host_reads: int  # host reads of one warm ordinary collect + result() with timing
    host_reads_untimed: int

    def ratio(self) -> PairedRatio:
        return paired_ratio(self.step_times["rank_timing"], self.step_times["default"])

    @property
    def metered_seconds(self) -> float:
        """The timing code's own time over the run: calls x median call, summed."""
        return sum(n * t for n, t in self.metered.values())

    @property
    def hook_calls(self) -> int:
        return self.metered.get("_arrive", (0, 0.0))[0]

    @property
    def added_seconds(self) -> float:
        """The added work per step (see the module docstring)."""
        per_step = self.metered_seconds + self.hook_calls * self.hook_dispatch_seconds
        return per_step / max(self.steps, 1) + self.vector_seconds

    @property
    def added_pct(self) -> float:
        return 100 * self.added_seconds / Timing.of(self.step_times["default"]).median


class _Meter:
    """Wraps the timing code's functions with a ``perf_counter`` meter (the wrapper's own
    two clock reads are outside the metered interval)."""

    def __init__(self) -> None:
        self.durations: dict[str, list[float]] = defaultdict(list)  # by function name
        self.steps = 0  # steps run with the meter on (warm-up blocks included)
        self.on = False
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)
        meter = self

        def metered(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if meter.on:
                    meter.durations[name].append(time.perf_counter() - t0)

        self._undo.append((owner, name, inner))
        setattr(owner, name, metered)

    def install(self) -> None:
        from gradwatch.reduce import packing, ranktiming, reduced
        from gradwatch.step.ranktimer import RankTimer, WorkWindow

        self.wrap(RankTimer, "_arrive")
        for name in ("start", "lap"):
            self.wrap(RankTimer, name)
        self.wrap(WorkWindow, "drain")
        self.wrap(packing, "pack_timing")
        self.wrap(ranktiming.CarriedTiming, "fields")
        self.wrap(reduced.RankTiming, "from_section")

    def calls(self) -> dict[str, tuple[int, float]]:
        """Per metered function: its calls and the median duration of one call (a median:
        a call that the scheduler preempted on a loaded machine does not count its wait)."""
        return {name: (len(d), statistics.median(d)) for name, d in self.durations.items()}

    def uninstall(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)


def _best(fn: Callable[[], Any], reps: int) -> float:
    """The median of ``reps`` timed calls of ``fn``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hook_dispatch_seconds(reps: int = HOOK_REPS) -> float:
    """Autograd's cost of calling one no-op ``post_accumulate_grad`` hook: the backward of a
    one-element leaf with the hook minus without it, interleaved in blocks of 100."""
    bare, hooked = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    hooked.register_post_accumulate_grad_hook(lambda _p: None)

    def backward(p: torch.Tensor) -> None:
        (p * 2.0).sum().backward()
        p.grad = None

    with_hook, without = [], []
    for _ in range(max(reps // 100, 1)):
        without.append(_best(lambda: backward(bare), 100))
        with_hook.append(_best(lambda: backward(hooked), 100))
    return max(statistics.median(with_hook) - statistics.median(without), 0.0)


def vector_seconds(length: int, section: int, reps: int = 2000) -> float:
    """What the longer packed vector costs per collect: zero-fill and host copy of
    ``length`` float64 against ``length - section``."""
    def copy(n: int) -> Callable[[], Any]:
        return lambda: torch.zeros(n, dtype=torch.float64).tolist()

    longer = [_best(copy(length), 50) for _ in range(reps // 50)]
    shorter = [_best(copy(length - section), 50) for _ in range(reps // 50)]
    return max(statistics.median(longer) - statistics.median(shorter), 0.0)


def _job(kind: str, divergence_every: int = 100) -> tuple[nn.Module, Any, Any]:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, _, _ = build_model(ModelSpec("demo", "demo model"))
    model = wrap(model, "ddp")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    watch = GradWatch(model, WatchConfig(
        rank_timing=kind == "rank_timing", divergence_every=divergence_every,
        collective_timeout_seconds=120))
    return model, opt, watch


def _counts(x: torch.Tensor, y: torch.Tensor) -> dict[str, dict[str, int]]:
    """Collectives and host reads of one warm collect + ``result()`` per kind, ordinary
    (``divergence_every=0``: no collect is a divergence step) and carried (``1``: every
    collect is one)."""
    from gradwatch.doctor.testing import OpCounter, count_host_reads

    out: dict[str, dict[str, int]] = {}
    for kind in KINDS:
        for label, every in (("ordinary", 0), ("carried", 1)):
            model, opt, watch = _job(kind, every)
            for i in range(3):  # two warm collects, the third counted
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                with count_host_reads() as reads, OpCounter() as ops:
                    watch.collect(i).result()
                opt.step()
            out[f"{kind}/{label}"] = {"collectives": ops.collectives,
                                      "host_reads": sum(reads.values())}
            watch.close()
    return out


def _worker(rank: int, port: int, blocks: int, out: str) -> None:
    import torch.distributed as dist

    from gradwatch.reduce.ranktiming import TIMING_WIDTH
    from gradwatch.reduce.sections import sections

    _init(rank, port)
    meter = _Meter()
    meter.install()
    try:
        jobs = {kind: _job(kind) for kind in KINDS}
        _, width, batch = build_model(ModelSpec("demo", "demo model"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

        def step(kind: str, i: int) -> None:
            model, opt, watch = jobs[kind]
            meter.on = kind == "rank_timing"
            meter.steps += meter.on
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            pending = watch.collect(i)
            opt.step()
            pending.result()
            meter.on = False

        times = palindromic(step, KINDS, blocks, barrier=dist.barrier)
        calls = meter.calls()
        length = sections(jobs["rank_timing"][2]._resolved.layout).length
        for _, _, w in jobs.values():
            w.close()
        counts = _counts(x, y)
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(RankTimingResult(
                model="demo model", blocks=blocks,
                step_times={k: tuple(v) for k, v in times.items()},
                steps=meter.steps, metered=calls,
                hook_dispatch_seconds=hook_dispatch_seconds(),
                vector_seconds=vector_seconds(length, TIMING_WIDTH),
                carried_collects=calls.get("pack_timing", (0, 0.0))[0],
                collectives_ordinary=counts["rank_timing/ordinary"]["collectives"],
                collectives_ordinary_untimed=counts["default/ordinary"]["collectives"],
                collectives_carried=counts["rank_timing/carried"]["collectives"],
                host_reads=counts["rank_timing/ordinary"]["host_reads"],
                host_reads_untimed=counts["default/ordinary"]["host_reads"])))
    finally:
        meter.uninstall()
        dist.destroy_process_group()


def measure(blocks: int = 300) -> RankTimingResult:
    """``blocks`` palindromic blocks of both kinds on 2 spawned ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        mp.spawn(_worker, args=(_free_port(), blocks, path), nprocs=WORLD, join=True)
        # our own child wrote it, into our own temporary directory
        result: RankTimingResult = pickle.loads(Path(path).read_bytes())
    return result


def checks(result: RankTimingResult | Any) -> list[TargetCheck]:
    """The targets-table rows: the added work against :data:`TARGET`; collectives added per
    ordinary collect and host reads added per warm collect against 0."""
    if not isinstance(result, RankTimingResult):
        return []
    figures = _figures(result)
    subject = f"DDP step with `rank_timing=True`, {result.model}, 2 ranks"
    return [
        TargetCheck("distributed", f"{subject}: added work {TARGET} of the step", TARGET,
                    result.added_pct, f"{result.added_pct:+.3f}%", figures, CAUSE),
        TargetCheck("distributed", f"{subject}: collectives added per ordinary collect <= 0",
                    Target(0, ""), result.collectives_ordinary
                    - result.collectives_ordinary_untimed,
                    str(result.collectives_ordinary - result.collectives_ordinary_untimed),
                    figures, CAUSE),
        TargetCheck("distributed", f"{subject}: host reads added per warm collect <= 0",
                    Target(0, ""), result.host_reads - result.host_reads_untimed,
                    str(result.host_reads - result.host_reads_untimed), figures, CAUSE),
    ]


def _figures(r: RankTimingResult) -> str:
    from benchmarks.report import fmt_ratio

    steps = max(r.steps, 1)
    ov = r.ratio()
    return (f"added work {r.added_seconds * 1e6:.1f} us per step (metered code "
            f"{r.metered_seconds / steps * 1e6:.1f} us, {r.hook_calls / steps:.0f} hook calls x "
            f"{r.hook_dispatch_seconds * 1e6:.2f} us dispatch, longer vector "
            f"{r.vector_seconds * 1e6:.2f} us); paired A/B {fmt_ratio(ov)}, 95% CI of the "
            f"median {ov.ci_low_pct:+.1f}% to {ov.ci_high_pct:+.1f}%; {r.carried_collects} "
            f"carried collects in {r.steps} steps")


def text(result: RankTimingResult | Any) -> str:
    """The section's markdown (``result`` None: skipped; a failure: its message)."""
    from benchmarks.page import fmt_timing, table
    from benchmarks.report import fmt_ratio, verdict_of

    if result is None:
        return "skipped\n"
    if not isinstance(result, RankTimingResult):
        return f"failed: {getattr(result, 'error', result)}\n"
    r = result
    ov = r.ratio()
    rows = [["gradwatch, defaults", fmt_timing(Timing.of(r.step_times["default"])), "-", "-"],
            ["gradwatch, `rank_timing=True`", fmt_timing(Timing.of(r.step_times["rank_timing"])),
             fmt_ratio(ov), verdict_of(ov)]]
    added = r.added_pct
    met = "met" if TARGET.met(added) else "NOT met"
    return (
        f"Blocks: {r.blocks}. Target: the added work of rank timing {TARGET} of the demo "
        f"model's 2-rank DDP step (verdict from the added work, not the A/B ratio: "
        f"see the method): {added:+.3f}% ({met}); {_figures(r)}.\n\n"
        f"Collectives per collect: ordinary {r.collectives_ordinary} with timing, "
        f"{r.collectives_ordinary_untimed} without; carried (divergence step) "
        f"{r.collectives_carried}. Host reads per warm collect + `result()`: {r.host_reads} "
        f"with timing, {r.host_reads_untimed} without.\n\n"
        + table(["step", "step ms (p25-p75)", "ratio over defaults (IQR over blocks)",
                 "verdict"], rows) + "\n"
    )
