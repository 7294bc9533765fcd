"""The markdown of docs/performance.md, rendered from a run's typed results alone.

:func:`render` lays out the sections; each ``*_table`` function renders one section's table,
:func:`target_checks` holds every measured value against its stated target, and
:func:`miss_notes` explains the targets a run did not meet (with the causes measured so far).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

from benchmarks import zero_bench
from benchmarks.cases import (
    DDP_OVERHEAD_TARGET,
    FLOAT64_COPIES_ELEMENTS,
    FLOAT64_COPIES_TARGET,
    GUARD_TARGET,
    ITEM_LOOP_PARAMS,
    ITEM_LOOP_TARGET,
    RANK_VIEW_TARGET,
    SCRAPE_SPACING,
    SCRAPERS_TARGET,
    scrape_rate,
)
from benchmarks.results import (
    ClipResult,
    DistributedCase,
    DistributedFailure,
    Failure,
    Fsdp1Result,
    GuardMode,
    GuardResult,
    MixedSizesResult,
    NormCaseResult,
    NormMethod,
    Overhead,
    PairedRatio,
    RankViewMode,
    RankViewResult,
    RunResults,
    ScaleResult,
    ScrapeLatencyResult,
    ScrapersResult,
    SpikeCostResult,
    StepMode,
    Target,
    TargetCheck,
    Timing,
)

GW = NormMethod.GRADWATCH.value

PER_COLLECT_COLUMNS = [
    "case",
    "method",
    "time ms",
    "x get_total_norm",
    "x read limit",
    "rel err vs float64",
    "host syncs",
    "ops",
    "largest temp",
]

# -- formatting -------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def fmt_spread(t: Timing) -> str:
    lo, hi = t.quartiles
    return f"{fmt_ms(lo)}-{fmt_ms(hi)}"


def fmt_timing(t: Timing) -> str:
    """``median (p25-p75)`` in milliseconds."""
    return f"{fmt_ms(t.median)} ({fmt_spread(t)})"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "**NOT MET**"


# -- section tables ---------------------------------------------------------------------------


def per_collect_table(cases: Sequence[NormCaseResult]) -> str:
    rows: list[list[object]] = []
    for case in cases:
        base = case.median(NormMethod.GET_TOTAL_NORM)
        limit = case.read_limit
        for m in case.methods:
            t = m.timing.median
            if m is limit:
                label = f"read limit: {m.method.value} ({case.nbytes / t / 1e9:.1f} GB/s)"
            else:
                label = m.method.value
            err = "-" if m.rel_error is None else f"{m.rel_error:.1e}"
            counts = m.counts
            rows.append([case.label, label, fmt_ms(t), f"{t / base:.2f}",
                         f"{t / limit.timing.median:.2f}", err,
                         counts.host_syncs if counts else "-", counts.ops if counts else "-",
                         fmt_bytes(counts.largest_bytes) if counts else "-"])
    return table(PER_COLLECT_COLUMNS, rows)


def mixed_table(results: Sequence[MixedSizesResult]) -> str:
    rows: list[list[object]] = []
    for r in results:
        base = r.case.median(r.baseline)
        for m in r.case.methods:
            t = m.timing.median
            mark = ""
            if m.method is NormMethod.GRADWATCH:
                mark = (f"{verdict(r.target.met(r.ratio))}: {r.ratio:.3f}x "
                        f"(target {r.target})")
            rows.append([r.case.dtype, m.method.value, fmt_ms(t), fmt_spread(m.timing),
                         f"{t / base:.3f}", f"{m.rel_error:.1e}", mark])
    return table(["dtype", "method", "median ms", "p25-p75 ms", "x target baseline",
                  "rel err vs float64", "target"], rows)


def clipping_tables(results: Sequence[ClipResult]) -> str:
    rows: list[list[object]] = []
    acc_rows: list[list[object]] = []
    for r in results:
        rows.append([r.dtype, "torch.nn.utils.clip_grad_norm_", fmt_ms(r.torch_clip.median),
                     fmt_spread(r.torch_clip), "-", ""])
        for v in r.variants:
            extra = r.extra_pct(v)
            rows.append([r.dtype, v.name, fmt_ms(v.timing.median), fmt_spread(v.timing),
                         f"{extra:+.1f}%", f"{verdict(r.target.met(extra))} ({r.target})"])
        a = r.accuracy
        acc_rows.append([r.dtype, f"{a.n_tensors} x {a.tensor_elements:,}", f"{a.torch_error:.1e}",
                         f"{a.gradwatch_error:.1e}",
                         f"{a.torch_error / a.gradwatch_error:,.0f}x" if a.gradwatch_error > 0
                         else "exact"])
    return (table(["dtype", "method", "median ms", "p25-p75 ms", "extra vs torch", "target"],
                  rows) + "\n\nAccuracy of the returned total norm (relative error vs a float64 "
            "reference), tensors above 64K elements:\n\n"
            + table(["dtype", "tensors", "torch clip_grad_norm_", "watch.clip_grad_norm_",
                     "gradwatch more exact by"], acc_rows))


DISTRIBUTED_COLUMNS = [
    "wrapper", "model", "trainable params / tensors", "step ms without gradwatch (p25-p75)",
    "with `collect` every step (result built by rank 0's exporter thread); "
    "overhead (p25 to p75)",
    "with `collect` + `result()` on the training thread; overhead (p25 to p75)",
    "floor 1: one async all-reduce of the packed vector, nothing else",
    "floor 2: one read of every gradient (`get_total_norm`), nothing else",
    "steps", "collectives / bytes per step without", "... with gradwatch",
    "gradwatch's own per collect (collect+result)",
]


def gradwatch_collectives(r: DistributedCase) -> str:
    """gradwatch's own collectives of an ordinary collect, and of a divergence step when it
    differs (under pure DDP replication: none, and one every ``divergence_every``-th)."""
    own, div = r.gradwatch_counts, r.divergence_counts
    cell = f"{own.collectives} / {fmt_bytes(own.bytes)}"
    if div is not None and div != own:
        cell += (f" ({div.collectives} / {fmt_bytes(div.bytes)} on each divergence step, "
                 f"1 collect in {r.divergence_every})")
    return cell


def distributed_table(results: Sequence[DistributedCase | DistributedFailure]) -> str:
    rows: list[list[object]] = []
    for r in results:
        if isinstance(r, DistributedFailure):
            rows.append([r.wrapper, f"failed: {r.error}"] + [""] * 11)
            continue
        cells = []
        for mode in StepMode:
            cell = fmt_timing(r.timing(mode))
            if mode is not StepMode.PLAIN:
                ov = r.overhead(mode)
                cell += (f"; **{ov.median_pct:+.1f}%** ({ov.p25_pct:+.1f}% to "
                         f"{ov.p75_pct:+.1f}%)")
            cells.append(cell)
        cp, cw = r.counts_plain, r.counts_watched
        rows.append([
            r.wrapper, r.model, f"{r.n_params / 1e6:.3g}M / {r.n_tensors}", *cells, r.steps,
            f"{cp.collectives} / {fmt_bytes(cp.bytes)}",
            f"{cw.collectives} / {fmt_bytes(cw.bytes)}",
            gradwatch_collectives(r),
        ])
    return table(DISTRIBUTED_COLUMNS, rows)


def scrapers_table(results: Sequence[ScrapersResult | Failure]) -> str:
    rows = []
    for r in results:
        if isinstance(r, Failure):
            rows.append([f"failed: {r.error}"] + [""] * 12)
            continue
        latency = (f"{fmt_ms(r.latency.median)} / "
                   f"{fmt_ms(r.latency.p90) if len(r.latency) > 1 else '-'}"
                   if r.latency else "- / -")
        judged = (f"{verdict(r.target.met(r.slowdown_pct))} ({r.target})" if r.target
                  else "context, not judged")
        rows.append(
            [r.clients, f"nice {r.client_nice}", f"{r.seconds_with:.1f} s in {r.cycles} windows",
             fmt_timing(r.without), fmt_timing(r.with_scrapers),
             f"{len(r.without)} / {len(r.with_scrapers)}", f"{r.slowdown_pct:+.1f}%", judged,
             f"{r.served} ({r.served / r.seconds_with:.0f}/s)", r.refused, latency,
             f"{r.client_cpu_seconds / r.seconds_with * 100:.0f}% of a core",
             f"{r.exporter_cpu_seconds / r.seconds_with * 100:.1f}% of a core"])
    return table(
        ["scrapers", "clients' priority", "time with scrapers", "step ms without (p25-p75)",
         "step ms with (p25-p75)", "steps without / with", "difference", "target",
         "scrapes served (per s)", "refused (429) or failed", "scrape latency median / p90 ms",
         "scraper clients' own CPU", "exporter process CPU"], rows)


#: Each kind of step of the per-rank view section, the kind it is compared with, and what the
#: comparison shows.
RANK_VIEW_COMPARISONS: tuple[tuple[RankViewMode, RankViewMode, str], ...] = (
    (RankViewMode.WATCHED, RankViewMode.ALWAYS_REDUCE,
     "no all-reduce on an ordinary collect of pure replication: the default's saving"),
    (RankViewMode.HOOK_ONLY, RankViewMode.ALWAYS_REDUCE,
     "a Python comm hook in place of DDP's built-in C++ all-reduce"),
    (RankViewMode.RANK_VIEW, RankViewMode.WATCHED,
     f"the per-rank view's cost over the default (target {RANK_VIEW_TARGET})"),
    (RankViewMode.RANK_VIEW, RankViewMode.ALWAYS_REDUCE,
     "the view's cost over the same all-reduces (context, not judged)"),
    (RankViewMode.RANK_VIEW, RankViewMode.HOOK_ONLY, "the view's own measurement in the hook"),
    (RankViewMode.IN_CALLBACK, RankViewMode.RANK_VIEW,
     "post-reduction pass in the hook's callback instead of a separate pass in `collect()`"),
)

#: The first row of each per-rank view table: every other kind's step time is in its row.
RANK_VIEW_BASELINE = RankViewMode.ALWAYS_REDUCE


def fmt_ratio(ov: Overhead) -> str:
    """A paired ratio as ``1.023x (+2.3%, IQR -1.0% to +5.1%)``."""
    return (f"{1 + ov.median_pct / 100:.3f}x ({ov.median_pct:+.1f}%, IQR {ov.p25_pct:+.1f}% "
            f"to {ov.p75_pct:+.1f}%)")


def verdict_of(r: PairedRatio) -> str:
    """Whether a paired ratio differs from 1 beyond noise: by the 95% interval of its median,
    and whether the blocks' interquartile range also lies on one side."""
    ci = f"95% CI of the median {r.ci_low_pct:+.1f}% to {r.ci_high_pct:+.1f}%"
    if r.beyond_noise == 0:
        return f"no difference beyond noise ({ci})"
    side = "cheaper" if r.beyond_noise < 0 else "dearer"
    iqr = r.p75_pct < 0 if r.beyond_noise < 0 else r.p25_pct > 0
    return (f"{side} beyond noise ({ci}); the blocks' IQR "
            f"{'too' if iqr else 'straddles 0'}")


RANK_VIEW_TEXT = (
    "The per-rank view's cost, the default DDP path's saving and one alternative to the "
    "view's path, in one 2-rank DDP job "
    "(gloo, CPU, spawn, 1 thread per rank) training the demo model ({demo}); "
    "`benchmarks/rankview_bench.py`. Each kind of step runs on a DDP copy of the same model in "
    "the same processes, in {blocks} palindromic blocks (each kind once, then in reverse "
    "order: a linear drift cancels within a block), a barrier before each timed step; a step is "
    "forward, backward, `collect`, optimizer step and `result()` on the training thread (all "
    "of gradwatch's work inside the step); rank 0's times. Ratio = median over blocks of (the "
    "kind's two steps) / (the compared kind's two steps), with the interquartile range over "
    "blocks; the verdict says whether the median differs from 1 beyond noise, by a 95% "
    "bootstrap interval of the median over blocks (the IQR is the spread of single blocks, "
    "not the uncertainty of the median). The kinds: {kinds}. Without the view, gradwatch's "
    "default under pure replication makes no all-reduce on an ordinary collect (each rank "
    "packs every parameter from its own copy of DDP's reduced gradients; the divergence step, "
    "every `divergence_every`-th collect, 100 by default, still all-reduces: "
    "docs/distributed.md, *When gradwatch all-reduces*); `always_reduce=True` restores one "
    "all-reduce per collect (the previous default) and is what the default's saving is "
    "measured against. The view all-reduces on every collect: its target compares it with the "
    "default, and, for context, it is compared with `always_reduce=True` too (its cost over "
    "the same all-reduces). The comm hook alone runs with `always_reduce=True`, so the hook "
    "and the view's own measurement are each compared over the same all-reduces. The "
    "in-callback kind is a prototype that exists in the benchmark only: it computes the "
    "post-reduction per-parameter squares in the comm hook's completion callback (the reduced "
    "bucket, with the view's per-bucket plan) and hands them to `collect()` in place of its "
    "own pass. The view's "
    "measurement dispatched {ops} aten ops over the {buckets} DDP buckets of one backward "
    "(`gradwatch.testing.OpCounter`), no host read. What gradwatch does with these figures "
    "(docs/distributed.md, *Cost*): the view stays opt-in; the prototype replaces the view's "
    "path only when it is cheaper beyond noise (the verdict column) and keeps every guarantee "
    "of that path; so far it has not. The second table times the same "
    "kinds (but the in-callback prototype) in the documented loop: `collect` only, rank 0's "
    "exporter thread building the results (`rank_view(..., LOOP_KINDS, collect_only=True)`), "
    "the same number of blocks; each loop has its row in the Targets table.\n"
)


def rank_view_table(r: RankViewResult | Failure) -> str:
    if isinstance(r, Failure):
        return f"failed: {r.error}"
    base = RANK_VIEW_BASELINE
    rows: list[list[object]] = [
        [base.value, fmt_timing(r.timing(base)), "-", "-", "-",
         "the previous default: one all-reduce per collect"]]
    for mode, over, shows in RANK_VIEW_COMPARISONS:
        if mode not in r.step_times or over not in r.step_times:
            continue  # a kind this loop does not time
        ov = r.ratio(mode, over)
        rows.append([mode.value, fmt_timing(r.timing(mode)), over.value, fmt_ratio(ov),
                     verdict_of(ov), shows])
    return table(["step", "step ms (p25-p75)", "compared with", "ratio (IQR over blocks)",
                  "verdict", "what it shows"], rows)


FSDP1_TEXT = (
    "`benchmarks/fsdp1_bench.py`: {layers} `Linear` layers, each its own FSDP1 unit "
    "(`FULL_SHARD`, `device_id=cpu`), 2 gloo ranks; after one backward, the calls below run "
    "round-robin on the same local shards in palindromic order (rank 0's times). Baseline: "
    "FSDP1's own `FullyShardedDataParallel.clip_grad_norm_` (local norms, one all-reduce, the "
    "multiply by the clamped coefficient; `max_norm` far above the norm). `collect` is "
    "`watch.collect(step).result()` (gradwatch's exact float64 per-parameter norms, its one "
    "all-reduce and the host summary, all on the training thread); `clip` is "
    "`watch.clip_grad_norm_`, the like-for-like replacement of FSDP's call. No target is set "
    "for these rows: they state the cost.\n"
)


def fsdp1_table(results: list[Fsdp1Result] | Failure) -> str:
    if isinstance(results, Failure):
        return f"failed: {results.error}"
    rows: list[list[object]] = []
    for r in results:
        setting = f"use_orig_params={r.use_orig_params}"
        rows.append([setting, "FSDP1 `clip_grad_norm_`", fmt_timing(r.fsdp), "1.00x"])
        rows.append([setting, "gradwatch `collect` + `result()`", fmt_timing(r.collect),
                     f"{r.ratio(r.collect):.2f}x"])
        rows.append([setting, "gradwatch `clip_grad_norm_`", fmt_timing(r.clip),
                     f"{r.ratio(r.clip):.2f}x"])
    return table(["FSDP1", "call", "ms (p25-p75)", "over FSDP1's own"], rows)


GUARD_TEXT = (
    "The optimizer-step guard's cost (`benchmarks/guard_bench.py`): one 2-rank DDP job (gloo, "
    "CPU, spawn, 1 thread per rank) training the demo model ({demo}) with a `fused=True` "
    "AdamW, guarded and unguarded on DDP copies of the same model in the same processes, in "
    "{blocks} palindromic blocks (A B B A), a barrier before each timed step; a step is "
    "forward, backward and the optimizer step, with gradwatch's `collect` in the documented "
    "loop (rank 0's exporter thread builds the results). Unguarded: `collect` then "
    "`optimizer.step()`. Guarded: `watch.guard(optimizer).step()` with `skip_nonfinite` and "
    "`skip_spike_score=6`, which collects, decides on the device (the non-finite flags, the "
    "whole-model norm, the spike window's median and MAD) and passes the decision to the fused "
    "step as `found_inf`. Ratio: the median over blocks of (guarded pair) / (unguarded pair) "
    "- 1, with its 95% bootstrap interval; verdict as in the per-rank view's table. One warm "
    "guarded optimizer step (collect, decision and fused step) dispatched {ops} aten ops, "
    "{extra} more than the unguarded one, and {reads} host scalar reads "
    "(`gradwatch.testing.OpCounter`).\n"
)


def guard_table(r: GuardResult | Failure) -> str:
    if isinstance(r, Failure):
        return f"failed: {r.error}"
    ov = r.ratio()
    return table(
        ["step", "step ms (p25-p75)", "ratio over unguarded (IQR over blocks)", "verdict"],
        [[GuardMode.WATCHED.value, fmt_timing(r.timing(GuardMode.WATCHED)), "-", "-"],
         [GuardMode.GUARDED.value, fmt_timing(r.timing(GuardMode.GUARDED)), fmt_ratio(ov),
          verdict_of(ov)]])


SCALE_TARGET_CASE = "PP x FSDP2 x TP"
SCALE_TARGET_WORLD = 16384
SCALE_SECONDS_TARGET = Target(10.0, " s")
SCALE_GIB_TARGET = Target(1.0, " GiB")

SCALE_TEXT = (
    "Simulated ranks (`benchmarks/scale.py`): a 3,000-parameter transformer-like model (187 "
    "layers of 16 parameters, d=4096, ffn=11008, vocab=50257: uneven and empty shards at "
    "every size) under each parallelism, and HSDP of the same model with its vocabulary padded "
    "to 50,304 (every shard even). Every rank's pieces are built by the production "
    "`piece_from_placements` and described by the production `handshake.describe` (ranks with "
    "the same shard sizes share one description object; standard uneven and empty shards are "
    "described alike, their sizes derived from the spec, so every rank of a stage has one "
    "digest, as in a real run; a self-check compares the shortcuts with torch's shard sizes, "
    "FSDP2 over TP as FSDP2 shards it, and a full describe of every rank on 8 ranks); each "
    "simulated mesh carries the grid of its copies, as a torch "
    "DeviceMesh does. *Layout step*: what each rank runs after phase 0's vote: the coordinate "
    "table, decoding the records and distinct descriptions (records path only) and deriving "
    "the layout, wall time on one core and peak Python memory (tracemalloc). *Handshake "
    "path*: *agreed* when every rank holds the same description and no stage group (phase 0's "
    "fixed-size all-reduce alone), else *records* (the per-rank records all-gathered, plus "
    "each distinct description once when they differ). *Handshake per rank*: bytes of the "
    "tensors this rank passes to the handshake's collectives, sent / received; *former "
    "handshake*: what the previous all-gather of every rank's full JSON description received "
    "per rank. *Per-step vector*: the float64 vector a collect all-reduces (`5N + R + 1` "
    "values, R replica slots capped at 64; under plain DDP only on divergence steps). See "
    "[scale.md](scale.md) for the cost model.\n"
)


def scale_table(results: Sequence[ScaleResult]) -> str:
    if not results:
        return "skipped"
    return table(
        ["case", "ranks", "mesh", "distinct descriptions", "handshake path", "layout step",
         "peak memory", "handshake per rank (sent / received)", "former handshake (received)",
         "per-step vector (R)"],
        [[r.case, f"{r.world:,}", r.mesh, r.distinct,
          "agreed (phase 0 only)" if r.agreed else "records", f"{r.seconds:.2f} s",
          fmt_bytes(r.peak_bytes), f"{fmt_bytes(r.sent_bytes)} / {fmt_bytes(r.received_bytes)}",
          fmt_bytes(r.old_received_bytes), f"{fmt_bytes(r.packed_bytes)} ({r.replicas})"]
         for r in results])


def scrape_latency_table(results: Sequence[ScrapeLatencyResult]) -> str:
    return table(["parameters", "top-k", "collect+result ms", "scrape ms, new step (render)",
                  "max", "scrape ms, cached", "body", "scrapes"],
                 [[r.n_params, r.top_k, fmt_ms(r.collect.median), fmt_ms(r.render.median),
                   fmt_ms(max(r.render.samples)), fmt_ms(r.cached.median),
                   fmt_bytes(r.body_bytes), r.scrapes] for r in results])


def spike_cost_table(r: SpikeCostResult) -> str:
    return table(["parameters", "groups", "window", "result() ms", "spike scoring ms",
                  "share of result()", "target"],
                 [[r.n_params, r.groups, r.window, fmt_timing(r.result), fmt_timing(r.score),
                   f"{r.share_pct:.2f}%", f"{verdict(r.target.met(r.share_pct))} ({r.target})"]])


SPIKE_TEXT = (
    "Host cost of spike detection (`gradwatch.spikes`: a rolling median and MAD of each "
    "series' log-norm) in `result()`: the global norm and {groups} groups, windows of {window} "
    "steps, full (their most expensive state). `result()` is timed with detection on, on "
    "{params:,} parameters of 64 elements in one process; the scoring alone is timed on the "
    "same snapshots. It adds no device op, host read or collective (tests/unit/test_spikes.py "
    "counts them).\n"
)


# -- targets ----------------------------------------------------------------------------------


def _ddp_cases(run: RunResults) -> list[DistributedCase]:
    return [r for r in run.distributed or ()
            if isinstance(r, DistributedCase) and r.wrapper == "ddp"]


WATCHED_MODES = (StepMode.COLLECT, StepMode.COLLECT_RESULT)


def target_checks(run: RunResults) -> list[TargetCheck]:
    """Every measured value that has a stated target, in the report's order."""
    checks: list[TargetCheck] = []
    for m in run.mixed:
        short = "fp32" if m.case.dtype == "float32" else "bf16"
        checks.append(TargetCheck(
            "norm cost", f"{short} {m.sizes}: {GW} {m.target} {m.baseline.value}",
            m.target, m.ratio, f"{m.ratio:.3f}x"))
    for case in run.norm_cases:
        if case.n_tensors == ITEM_LOOP_PARAMS:
            s = case.speedup(NormMethod.ITEM_LOOP)
            checks.append(TargetCheck(
                "norm cost", f"{case.label}: {GW} {ITEM_LOOP_TARGET} faster than "
                f"{NormMethod.ITEM_LOOP.value}", ITEM_LOOP_TARGET, s, f"{s:.2f}x"))
        if case.total_elements >= FLOAT64_COPIES_ELEMENTS:
            s = case.speedup(NormMethod.FLOAT64_COPIES)
            checks.append(TargetCheck(
                "norm cost", f"{case.label}: {GW} {FLOAT64_COPIES_TARGET} faster than "
                f"{NormMethod.FLOAT64_COPIES.value}", FLOAT64_COPIES_TARGET, s, f"{s:.1f}x"))
    for r in _ddp_cases(run):
        for mode in WATCHED_MODES:
            ov = r.overhead(mode)
            checks.append(TargetCheck(
                "distributed", f"DDP step overhead, gradwatch every step, {r.model}, "
                f"{mode.watched}: {DDP_OVERHEAD_TARGET}", DDP_OVERHEAD_TARGET, ov.median_pct,
                f"{ov.median_pct:+.1f}% (IQR {ov.p25_pct:+.1f}% to {ov.p75_pct:+.1f}%)"))
    for rv in _rank_view_results(run):
        ov = rv.ratio(RankViewMode.RANK_VIEW, RankViewMode.WATCHED)
        checks.append(TargetCheck(
            "distributed", f"DDP step with the per-rank view, {rv.model}, {rv.loop}: within "
            f"+{RANK_VIEW_TARGET.limit:g}% of the step watched without it ({RANK_VIEW_TARGET})",
            RANK_VIEW_TARGET, ov.median_pct, fmt_ratio(ov)))
    if isinstance(run.guard, GuardResult):
        ov = run.guard.ratio()
        checks.append(TargetCheck(
            "distributed", f"DDP step guarded by `watch.guard` (fused AdamW), {run.guard.model}: "
            f"{GUARD_TARGET} over the unguarded step", GUARD_TARGET, ov.median_pct,
            fmt_ratio(ov)))
    for c in run.clipping:
        for v in c.variants:
            extra = c.extra_pct(v)
            checks.append(TargetCheck(
                "clipping", f"{c.dtype} {v.name}: {c.target} over torch's clip", c.target,
                extra, f"{extra:+.1f}%"))
    if run.spike_cost is not None:
        sc = run.spike_cost
        checks.append(TargetCheck(
            "spikes", f"spike detection at {sc.n_params:,} parameters, {sc.groups} groups: "
            f"{sc.target} of result()", sc.target, sc.share_pct, f"{sc.share_pct:.2f}%"))
    for r in run.scale:
        if r.case == SCALE_TARGET_CASE and r.world == SCALE_TARGET_WORLD:
            subject = f"{r.case} layout step at {r.world:,} simulated ranks, one core"
            checks.append(TargetCheck("scale", f"{subject}: {SCALE_SECONDS_TARGET}",
                                      SCALE_SECONDS_TARGET, r.seconds, f"{r.seconds:.2f} s"))
            gib = r.peak_bytes / 2**30
            checks.append(TargetCheck("scale", f"{subject}: peak memory {SCALE_GIB_TARGET}",
                                      SCALE_GIB_TARGET, gib, fmt_bytes(r.peak_bytes)))
    for s in _judged_scrapers(run):
        checks.append(TargetCheck(
            "scraping", f"DDP step time with {s.n_scrapers} scrapers: {s.target}", s.target,
            s.slowdown_pct, f"{s.slowdown_pct:+.1f}%"))
    return checks


def _judged_scrapers(run: RunResults) -> list[ScrapersResult]:
    """The scrapers rows held to their target (the others are shown for context)."""
    return [s for s in run.scrapers or () if isinstance(s, ScrapersResult) and s.target]


def targets_table(run: RunResults) -> str:
    return table(["area", "target", "measured", "verdict"],
                 [[c.area, c.subject, c.shown, verdict(c.met)] for c in target_checks(run)])


def _floor_note(r: DistributedCase) -> str:
    """What the two floors of a DDP case cost by themselves, for the notes."""
    ar = r.overhead(StepMode.FLOOR_ALL_REDUCE).median_pct
    rd = r.overhead(StepMode.FLOOR_READ).median_pct
    read = (f" The floors measured in the same run: one read of every gradient alone "
            f"{rd:+.1f}% (no norm can skip it)")
    if r.gradwatch_counts.collectives == 0:
        when = (f"only on the divergence step, 1 collect in {r.divergence_every}"
                if r.divergence_counts is not None else "on no collect here")
        return (f"{read}, the floor of an ordinary collect, which makes no collective here; "
                f"one async gloo all-reduce of a vector as long as the packed one alone "
                f"{ar:+.1f}%, which gradwatch adds {when}.")
    return (f"{read}; one async gloo all-reduce of the packed vector alone {ar:+.1f}% (the "
            f"collective every collect makes here): together {ar + rd:+.1f}% before any of "
            "gradwatch's own work.")


def _issuing(r: DistributedCase) -> str:
    """What a collect starts besides its ops, for the DDP overhead note."""
    if r.gradwatch_counts.collectives == 0:
        return "; an ordinary collect makes no collective here"
    return ", and issuing the gloo all-reduce, which by itself wakes gloo's threads"


def miss_notes(run: RunResults) -> str:
    """Plain explanations for the targets this run did not meet (measured causes)."""
    out = []
    for m in run.mixed:
        if m.target.met(m.ratio):
            continue
        if m.case.dtype == "float32":
            out.append(
                f"* **Mixed sizes, fp32 ({m.ratio:.2f}x, target {m.target} "
                f"{m.baseline.value}): not met** in this run. "
                "Where the time goes: gradwatch norms large tensors as float32 rows of 512 "
                "elements (what keeps its error near 1e-10 here, against 1e-5 for "
                "`get_total_norm`), a kernel about 7% slower than torch's whole-tensor "
                "`_foreach_norm` on 1,000,000-element tensors on this CPU; the small tensors "
                "and the partial last rows are copied into the pack buffer; `result()` builds "
                "the snapshot (per-parameter Python). No kernel tried here (rows of "
                "256-2,048, einsum/bmm, strided column sums) was both faster and within the "
                "1e-6 bound. See the spread in the mixed-sizes table: run-to-run noise on this "
                "machine is of the same size as the margin.")
        else:
            out.append(f"* **Mixed sizes, bf16 ({m.ratio:.2f}x, target {m.target} "
                       f"{m.baseline.value}): not met** in this run; see the spread in the "
                       "mixed-sizes table.")
    for r in _ddp_cases(run):
        for mode in WATCHED_MODES:
            ov = r.overhead(mode)
            if DDP_OVERHEAD_TARGET.met(ov.median_pct):
                continue
            out.append(
                f"* **DDP overhead, {r.model}, {mode.watched} ({ov.median_pct:+.1f}%, target "
                f"{DDP_OVERHEAD_TARGET}): not met.** Each watched step adds gradwatch's fixed "
                f"cost: about {r.extra_ms(mode):.1f} ms in medians, on a "
                f"{r.timing(StepMode.PLAIN).median * 1e3:.1f} ms step. Of it, the `collect()` "
                f"call on rank 0's training thread takes {r.collect_call.median * 1e3:.2f} ms "
                f"(about 20 dispatched ops on caches cold after backward{_issuing(r)}); the "
                "rest is rank 0's exporter thread building the snapshot under the GIL, and "
                "gloo's threads, on a machine where each rank has one core. The interquartile "
                "range shows how much of it is this shared 2-core machine's noise."
                f"{_floor_note(r)}")
    for rv in _rank_view_results(run):
        out += _rank_view_miss(rv)
    if isinstance(run.guard, GuardResult) and not GUARD_TARGET.met(run.guard.ratio().median_pct):
        ov = run.guard.ratio()
        extra = (run.guard.timing(GuardMode.GUARDED).median
                 - run.guard.timing(GuardMode.WATCHED).median) * 1e3
        out.append(
            f"* **The guarded DDP step ({fmt_ratio(ov)}, target {GUARD_TARGET}): not met** in "
            f"this run ({verdict_of(ov)}). The guarded optimizer step dispatches "
            f"{run.guard.ops} ops in all (the collect's included; "
            f"{run.guard.ops - run.guard.unguarded_ops} more than the unguarded one) and reads "
            f"nothing to the host; about {extra:.2f} ms in medians. The interquartile range "
            "shows how much of it is this shared 2-core machine's noise.")
    for c in run.clipping:
        extras = [c.extra_pct(v) for v in c.variants if not c.target.met(c.extra_pct(v))]
        if not extras:
            continue
        why = ("torch computes the bf16 norm with bf16 outputs (its error is in the "
               "accuracy table) while gradwatch widens every element to float32 (1M "
               "elements at a time, through a 4 MiB buffer) to norm it exactly: a write and "
               "a read more per element than torch's pass" if c.dtype == "bfloat16" else
               "the same exact-norm costs as on the mixed sizes, less diluted because the "
               "clipping multiply is shared")
        out.append(
            f"* **Clipping, {c.dtype} ({', '.join(f'{e:+.1f}%' for e in extras)}, target "
            f"{c.target}): not met.** Cause: {why}. What it buys: relative error "
            f"{c.accuracy.gradwatch_error:.0e} instead of {c.accuracy.torch_error:.0e}.")
    for s in _judged_scrapers(run):
        if s.target is None or s.target.met(s.slowdown_pct):
            continue
        hit = next((r.cached.median for r in run.scrape_latency if r.top_k == 50), None)
        cost = f" (a cached scrape round trip takes {hit * 1e3:.1f} ms here)" if hit else ""
        out.append(
            f"* **Scrapers during training ({s.slowdown_pct:+.1f}%, target {s.target}): not "
            "met.** Scrapes are served by the exporter process, not by rank 0's interpreter "
            f"(each client address gets {scrape_rate():g} scrapes/s{cost}); on this 2-core "
            "machine the clients (a process of their own) and the exporter process still "
            "take CPU from the two ranks (see the last two columns), and rank 1 waits for "
            "rank 0 in DDP's all-reduce.")
    for case in run.norm_cases:
        s64 = case.speedup(NormMethod.FLOAT64_COPIES)
        if case.total_elements >= FLOAT64_COPIES_ELEMENTS and not FLOAT64_COPIES_TARGET.met(s64):
            out.append(
                f"* **{case.label}: {GW} only {s64:.1f}x faster than float64 copies, target "
                f"{FLOAT64_COPIES_TARGET}: not met.** The copies' cost is dominated by "
                "allocating and faulting in float64 tensors, which varies with the allocator's "
                "state from run to run (compare the two 200M cases and earlier runs); "
                "gradwatch's bf16 cost includes widening every element to float32, 1M elements "
                "at a time through a 4 MiB buffer.")
    speedups = [c.speedup(NormMethod.ITEM_LOOP) for c in run.norm_cases
                if c.n_tensors == ITEM_LOOP_PARAMS]
    if speedups and not ITEM_LOOP_TARGET.met(min(speedups)):
        out.append(f"* **{GW} {ITEM_LOOP_TARGET} faster than a {NormMethod.ITEM_LOOP.value} "
                   f"at {ITEM_LOOP_PARAMS:,} parameters: not met on CPU** (measured "
                   f"{min(speedups):.2f}x to {max(speedups):.2f}x); see the notes on "
                   "`.item()` loops and float64 copies on CPU.")
    return "\n".join(out) if out else "Every target was met in this run."


def _rank_view_results(run: RunResults) -> list[RankViewResult]:
    """The per-rank view's measured loops (result() on the training thread, collect only)."""
    return [r for r in (run.rank_view, run.rank_view_loop) if isinstance(r, RankViewResult)]


def _iqr(ov: Overhead) -> str:
    return f"{ov.median_pct:+.1f}% (IQR {ov.p25_pct:+.1f}% to {ov.p75_pct:+.1f}%)"


def _rank_view_miss(r: RankViewResult) -> list[str]:
    ov = r.ratio(RankViewMode.RANK_VIEW, RankViewMode.WATCHED)
    if RANK_VIEW_TARGET.met(ov.median_pct):
        return []
    reduce = r.ratio(RankViewMode.ALWAYS_REDUCE, RankViewMode.WATCHED)
    hook = r.ratio(RankViewMode.HOOK_ONLY, RankViewMode.ALWAYS_REDUCE)
    own = r.ratio(RankViewMode.RANK_VIEW, RankViewMode.HOOK_ONLY)
    extra = (r.timing(RankViewMode.RANK_VIEW).median
             - r.timing(RankViewMode.WATCHED).median) * 1e3
    return [
        f"* **DDP step with the per-rank view, {r.loop} ({ov.median_pct:+.1f}%, target "
        f"{RANK_VIEW_TARGET}): not met.** The view all-reduces on every collect, which the "
        "default under pure replication does not. Measured in the same run: one all-reduce "
        f"per collect (`always_reduce=True`) {_iqr(reduce)} over the default; the comm hook "
        f"alone, measuring nothing, {_iqr(hook)} over DDP's built-in reduction, both with "
        "`always_reduce=True` (what differs: per bucket, a "
        "Python call from the autograd thread and a Python completion callback on gloo's "
        "thread, both taking the GIL, where DDP's built-in all-reduce stays in C++; DDP "
        "accepts no other kind of hook from Python); the view's own measurement "
        f"({r.hook_ops} aten ops over {r.buckets} buckets, no host read) {_iqr(own)} over the "
        f"hook alone. About {extra:.2f} ms in medians on a "
        f"{r.timing(RankViewMode.WATCHED).median * 1e3:.1f} ms step; the interquartile range "
        "shows how much of it is this shared 2-core machine's noise. The view stays opt-in "
        "(`rank_view=False` by default) for that reason."]


# -- the whole page ---------------------------------------------------------------------------


def machine() -> str:
    """The machine, for the report: CPU (``lscpu``), memory, versions, load."""
    import torch

    info: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    load = os.getloadavg()
    return "\n".join([
        f"* CPU (`lscpu`): {info.get('Model name', '?')}, {info.get('CPU(s)', os.cpu_count())} "
        f"logical CPUs ({info.get('Core(s) per socket', '?')} cores per socket, "
        f"{info.get('Thread(s) per core', '?')} thread(s) per core), "
        f"{info.get('Hypervisor vendor', 'no') + ' VM' if info.get('Hypervisor vendor') else ''}"
        f", {mem} RAM",
        f"* Python {platform.python_version()}, torch {torch.__version__}; "
        f"`torch.set_num_threads(1)` for every single-process case, 1 thread per rank in the "
        f"distributed ones",
        f"* load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (the machine is "
        "shared: other jobs may run; that is why every comparison is interleaved)",
    ])


PER_COLLECT_TEXT = (
    "Cases: `N x, M elements`: N parameter tensors, half of them small (bias-like, at most "
    "1,024 elements), the rest sharing the bulk; 1-D, contiguous. Every method runs on the "
    "same gradients in the same process; times are medians over rounds that run every "
    "method once, round-robin ({rounds} rounds). The methods: `gradwatch collect()+result()`, "
    "gradwatch's default path, `GradWatch(model).collect(step).result()` (snapshot included); "
    "`get_total_norm(...).item()`, `torch.nn.utils.get_total_norm(grads).item()`; "
    "`_foreach_norm(dtype=f32)+stack+item` (bf16 only), "
    "`torch._foreach_norm(grads, 2, dtype=torch.float32)` + stack + item; the per-parameter "
    "`.item()` loop, `sum(g.norm().item() ** 2)` over parameters; float64 copies, "
    "`_foreach_norm` of `g.double()` copies; Lightning's `grad_norm(model, 2)` (a "
    "per-parameter dict of norms plus `torch.tensor(list(norms.values())).norm()`, which reads "
    "every norm to the host), total `.item()`; and the read limit, one read of every gradient "
    "byte on the same tensors: the faster of a `sum` over each tensor and one "
    "`torch._foreach_max`, with the read bandwidth it implies. `x get_total_norm`, "
    "`x read limit`: time ratios. Relative error against a float64 reference. Host syncs = "
    "`_local_scalar_dense` (`item`, `float`, `bool`) + `tolist`/`numpy` calls and ops = aten "
    "ops dispatched, both from a separate untimed call under a `TorchDispatchMode`; largest "
    "temp = the largest memory one op allocated, from another untimed call under "
    "`torch.profiler` (`profile_memory=True`), which also sees allocations inside an op's "
    "kernel: `vector_norm(bf16, dtype=torch.float32)` and `_foreach_norm(bf16, "
    "dtype=torch.float32)` widen a float32 copy of each whole tensor (gradwatch avoids it: it "
    "widens 1M elements at a time into a reused 4 MiB buffer, allocated once and not counted "
    "per call), `g.double()` is a float64 copy (gradwatch.testing, benchmarks/measure.py).\n"
)

CPU_NOTES_TEXT = (
    "On CPU `.item()` is a cheap host read, not a device synchronization, so the per-parameter "
    "`.item()` loop costs one read of the gradient bytes plus a few microseconds per tensor: "
    f"gradwatch can only be {ITEM_LOOP_TARGET.limit:g}x faster than the loop where the loop "
    f"spends more than {ITEM_LOOP_TARGET.limit:g}x the read limit on per-tensor overhead; "
    "compare the loop's `x read limit` column. The target "
    f"({ITEM_LOOP_TARGET} faster than the loop at {ITEM_LOOP_PARAMS:,} parameters) is stated "
    "for accelerators, where each `.item()` waits for the device; it is reported here as "
    "measured on CPU. The float64 copies allocate and write a float64 copy of every gradient, "
    "so their cost grows with the allocator's behaviour on large tensors (page faults on fresh "
    "mappings). At 200M elements the loop is within a few percent of the read limit, so no "
    f"method can be {ITEM_LOOP_TARGET.limit:g}x faster than it on this machine; at 1M elements "
    "the loop costs a few microseconds per tensor, which any path that dispatches one op per "
    "tensor (gradwatch's `_foreach_copy_`, torch's `_foreach_norm`, which loops over tensors "
    "on CPU) also pays.\n"
)

CLIPPING_TEXT = (
    "Same {sizes} gradients; `max_norm` = 1e9, so both multiply every gradient "
    "by exactly 1 (both scale unconditionally) and the gradients are unchanged between "
    "calls. `watch.clip_grad_norm_` computes the exact per-parameter norms, the total and "
    "the clipping in one pass; its snapshot is built lazily (by the exporter thread when an "
    "endpoint is on), so both the call alone and the call plus the snapshot are shown.\n"
)

DISTRIBUTED_TEXT = (
    "Models: the model `make demo` trains (gradwatch.cli.demo_job.DemoNet, {demo}, in its "
    "last phase where every trainable parameter gets a gradient; DDP with "
    "`find_unused_parameters=True` as the demo does) and an MLP of 4 x `Linear(1024, 1024)` + "
    "ReLU + `Linear(1024, 1)` (batch 32); SGD, MSE loss; DDP, and FSDP2 with every trainable "
    "`Linear` and the root `fully_shard`ed; rank 0 serves the endpoint (`port=0`), as "
    "deployed. Five kinds of step, in blocks of ten (each kind, then the same backwards, so a "
    "linear drift cancels within a block), a barrier before each timed step; rank 0's times: "
    "without gradwatch; with `watch.collect(step)` after backward (the documented loop: the "
    "snapshot is built by rank 0's exporter thread, nobody waits on rank 1); with `collect` "
    "and `result()` after `optimizer.step()` on the training thread (all of gradwatch's work "
    "in the step, the worst case); and two floors without gradwatch: one async all-reduce of "
    "a float64 vector as long as gradwatch's packed one, on a group of its own, awaited by "
    "another thread (as `collect`'s is by the exporter thread), which is what a collect that "
    "all-reduces pays at least, and one read of every gradient "
    "(`torch.nn.utils.get_total_norm`, no host read), which any norm pays. gradwatch runs "
    "its default configuration: under FSDP2 every collect all-reduces gradwatch's packed "
    "vector; under DDP (every rank holds every parameter whole and DDP already reduced the "
    "gradients) an ordinary collect makes no collective, and only the divergence step (every "
    "`divergence_every`-th collect, 100 by default; the timed DDP steps include theirs) "
    "all-reduces, as every collect does with `always_reduce=True` or `rank_view=True` "
    "(docs/distributed.md, *When gradwatch all-reduces*). Overhead = median over blocks of "
    "(with / without - 1); its spread is the interquartile range over blocks. Collectives and "
    "bytes per step counted in one untimed step under a `TorchDispatchMode` (bytes = largest "
    "tensor argument of each c10d op: the all-reduced bucket, the full all-gathered / "
    "reduce-scattered buffer); gradwatch's own, of one ordinary collect and `result()`, with "
    "a divergence step's in parentheses where they differ.\n"
)


def render(run: RunResults) -> str:
    """The whole of docs/performance.md."""
    rate = scrape_rate()
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in run.section_seconds.items())
    skipped = "skipped: --no-distributed"
    dist_text = skipped if run.distributed is None else distributed_table(run.distributed)
    scrapers_text = skipped if run.scrapers is None else scrapers_table(run.scrapers)
    if run.rank_view is None:
        rank_view_text = skipped + "\n"
    elif isinstance(run.rank_view, Failure):
        rank_view_text = rank_view_table(run.rank_view) + "\n"
    else:
        rank_view_text = RANK_VIEW_TEXT.format(
            demo=run.demo_model, blocks=run.rank_view.blocks, ops=run.rank_view.hook_ops,
            buckets=run.rank_view.buckets,
            kinds="; ".join(f"*{m.value}*" for m in RankViewMode),
        ) + "\n" + rank_view_table(run.rank_view) + "\n"
        if run.rank_view_loop is not None:
            rank_view_text += (
                "\nThe documented loop (`collect` only; rank 0's exporter thread builds the "
                "results):\n\n" + rank_view_table(run.rank_view_loop) + "\n")
    if run.fsdp1 is None:
        fsdp1_text = skipped + "\n"
    else:
        layers = run.fsdp1[0].layers if isinstance(run.fsdp1, list) and run.fsdp1 else "?"
        fsdp1_text = FSDP1_TEXT.format(layers=layers) + "\n" + fsdp1_table(run.fsdp1) + "\n"
    if run.guard is None:
        guard_text = skipped + "\n"
    elif isinstance(run.guard, Failure):
        guard_text = guard_table(run.guard) + "\n"
    else:
        guard_text = GUARD_TEXT.format(
            demo=run.demo_model, blocks=run.guard.blocks, ops=run.guard.ops,
            extra=run.guard.ops - run.guard.unguarded_ops, reads=run.guard.scalar_reads,
        ) + "\n" + guard_table(run.guard) + "\n"
    if run.cuda_device is None:
        cuda_text = ("skipped: `torch.cuda.is_available()` is False on this machine (no GPU), "
                     "so no GPU figure is published. On a machine with CUDA the same cases run "
                     "here, on the GPU.")
    else:
        cuda_text = (f"Device: {run.cuda_device}. Same cases and methods as the CPU table, "
                     "`torch.cuda.synchronize()` after each call.\n\n"
                     + per_collect_table(run.cuda_cases))
    if run.spike_cost is None:
        spike_text = "not measured"
    else:
        spike_text = SPIKE_TEXT.format(
            groups=run.spike_cost.groups, window=run.spike_cost.window,
            params=run.spike_cost.n_params,
        ) + "\n" + spike_cost_table(run.spike_cost)
    mixed_rounds = run.mixed[0].case.rounds if run.mixed else "?"
    sizes = run.mixed[0].sizes if run.mixed else "48 x 1M + 200 small"
    scrape_params = run.scrape_latency[0].n_params if run.scrape_latency else "?"
    targets = " and ".join(f"{'fp32' if m.case.dtype == 'float32' else 'bf16'}: {GW} "
                           f"{m.target} {m.baseline.value}" for m in run.mixed)
    parts = [
        "# Performance\n",
        "<!-- Generated by `make bench` (benchmarks/run.py). Do not edit by hand. -->\n",
        f"Command: `{run.command}` (`make bench` runs `.venv/bin/python benchmarks/run.py --out "
        f"docs/performance.md`). Wall time of this run: {run.total_seconds:.0f} s ({sections}).\n",
        "## Machine\n",
        run.machine + "\n",
        "## Targets\n",
        targets_table(run) + "\n",
        "### Targets not met, and why\n",
        miss_notes(run) + "\n",
        "## Per-collect cost (one process, one thread)\n",
        PER_COLLECT_TEXT.format(rounds=f"{run.rounds[0]}-{run.rounds[1]}"),
        per_collect_table(run.norm_cases) + "\n",
        f"## Mixed sizes: {sizes} tensors (16-4,096 elements), one thread\n",
        f"Targets: {targets}. Same methods as above, {mixed_rounds} interleaved rounds; the "
        "spread is the interquartile range of the per-call times.\n",
        mixed_table(run.mixed) + "\n",
        "## `.item()` loops and float64 copies on CPU\n",
        CPU_NOTES_TEXT,
        "## Clipping (one process, one thread, CPU)\n",
        CLIPPING_TEXT.format(sizes=sizes),
        clipping_tables(run.clipping) + "\n",
        "## Distributed (2 ranks, gloo, CPU, spawn, 1 thread per rank)\n",
        DISTRIBUTED_TEXT.format(demo=run.demo_model),
        dist_text + "\n",
        "## Per-rank view and the DDP path (2 ranks, gloo, CPU)\n",
        rank_view_text,
        "## FSDP1: gradwatch against FSDP1's own norm (2 ranks, gloo, CPU)\n",
        fsdp1_text,
        "## DeepSpeed ZeRO-2: collect against DeepSpeed's own norm (2 ranks, gloo, CPU)\n",
        zero_bench.text(run.zero),
        "## The optimizer-step guard (2 ranks, gloo, CPU)\n",
        guard_text,
        "## Construction at scale (simulated ranks, one core)\n",
        SCALE_TEXT,
        scale_table(run.scale) + "\n",
        "## Scrapers during training\n",
        "2-rank DDP (gloo) job training the demo model (as above), `collect` every step, rank 0 "
        "serving `param_metrics_top_k=50`; the clients are threads of a process of their own on "
        "the loopback: loops of back-to-back GETs claiming to be Prometheus (`User-Agent: "
        "Prometheus/...`), connections sending their request head a byte a second (slowloris), "
        "and concurrent ordinary clients looping GETs. In life the clients run on other "
        "machines; here they share the job's two cores, so the judged row runs them at nice 19 "
        "(standing in for remote machines: what the job then pays is the exporter process and "
        "the kernel's network work, not the load generator), and a second row, for context, "
        "runs them at the job's own priority. The exporter process's CPU time is read from "
        "`/proc` over the windows with clients. Windows with and without clients "
        "alternate; a step counts when it lies wholly inside a window (a window with clients "
        "lasts until the last in-flight request returns). Target: the step time with clients "
        f"{SCRAPERS_TARGET} over the step without them. Scrapes are served by the exporter "
        "process, outside the training interpreter: the training process renders the "
        "exposition at most once per change whatever the clients do; each client address gets "
        f"{rate:g} scrapes/s, more wait or get 429 after a delay, and no User-Agent is "
        "privileged.\n",
        scrapers_text + "\n",
        "## Scrape latency\n",
        f"{scrape_params} parameters of 64 elements, one process; each round collects a step, "
        f"waits until it is published, then GETs three times "
        f"{SCRAPE_SPACING * 1000 / rate:.0f} ms apart "
        f"(sequential, under the endpoint's {rate:g}/s bound per client, so no GET waits for "
        "it). The exposition is rendered once when the step is published (`flush` waits for "
        "it); every GET is then served by the exporter process, the first one included.\n",
        scrape_latency_table(run.scrape_latency) + "\n",
        "## Spike detection\n",
        spike_text + "\n",
        "## CUDA\n",
        cuda_text + "\n",
        f"Load average at end: {run.load_end[0]:.2f} {run.load_end[1]:.2f} "
        f"{run.load_end[2]:.2f} (start {run.load_start[0]:.2f}).\n",
    ]
    return "\n".join(parts)
