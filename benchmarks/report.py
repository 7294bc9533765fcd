"""The markdown of docs/performance.md, rendered from a run's typed results alone.

Numbers and verdicts only: :func:`render` lays out the sections, each ``*_table`` function
renders one section's table, :func:`target_checks` holds every measured value against its stated
target, and :func:`miss_notes` tabulates the targets a run did not meet with the figures of the
same run that bear on them. How each section measures and the known causes of the misses are
written by hand in docs/benchmarks.md, whose headings the sections link to (:func:`method_link`,
:data:`CAUSES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from benchmarks import divergence_bench, norm_report, ranktiming_bench, shapes, zero_bench
from benchmarks.cases import (
    DDP_OVERHEAD_TARGET,
    GUARD_TARGET,
    HOST_READS_TARGET,
    RANK_VIEW_TARGET,
    SCRAPE_SPACING,
    SCRAPERS_TARGET,
    UPDATE_STATS_MEMORY_TARGET,
    UPDATE_STATS_TARGET,
    WALL_TIME_BUDGET_S,
    scrape_rate,
)
from benchmarks.page import (
    METHODS_PAGE,
    anchor,
    fmt_bytes,
    fmt_ms,
    fmt_timing,
    method_link,
    table,
    verdict,
)
from benchmarks.results import (
    DistributedCase,
    DistributedFailure,
    Failure,
    Fsdp1Result,
    GuardMode,
    GuardResult,
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
    UpdateStatsMode,
    UpdateStatsResult,
)

GW = NormMethod.GRADWATCH.value

#: The known causes of the targets a run can miss: headings of docs/benchmarks.md's
#: *Known causes of the targets not met* (a test checks each stands there).
CAUSES = (
    "Mixed sizes, fp32",
    "Mixed sizes, bf16",
    "DDP step overhead",
    "Per-rank view",
    "The guarded step",
    "Update stats",
    ranktiming_bench.CAUSE,
    "Clipping, bf16",
    "Clipping, fp32",
    "Float64 copies",
    "Shapes",
    "Scrapers",
    "Spike detection and construction at scale",
    "Host reads per collect",
    "DeepSpeed ZeRO-2",
    "Adaptive clipping: a divergence case",
)


# -- section tables ---------------------------------------------------------------------------


DISTRIBUTED_COLUMNS = [
    "wrapper", "model", "trainable params / tensors", "step ms without gradwatch (p25-p75)",
    "`collect` every step: ms; overhead (p25 to p75)",
    "`collect` + `result()` on the training thread: ms; overhead (p25 to p75)",
    "floor 1: one all-reduce of the packed vector", "floor 2: one read of every gradient",
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


def rank_view_table(r: RankViewResult | Failure) -> str:
    if isinstance(r, Failure):
        return f"failed: {r.error}"
    base = RANK_VIEW_BASELINE
    rows: list[list[object]] = [
        [base.value, fmt_timing(r.timing(base)), "-", "-", "-",
         "one all-reduce per collect, what the default's saving is measured against"]]
    for mode, over, shows in RANK_VIEW_COMPARISONS:
        if mode not in r.step_times or over not in r.step_times:
            continue  # a kind this loop does not time
        ov = r.ratio(mode, over)
        rows.append([mode.value, fmt_timing(r.timing(mode)), over.value, fmt_ratio(ov),
                     verdict_of(ov), shows])
    return table(["step", "step ms (p25-p75)", "compared with", "ratio (IQR over blocks)",
                  "verdict", "what it shows"], rows)


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


#: The guarded kinds, each judged against the target, and the configuration each runs.
GUARDED_MODES = (GuardMode.GUARDED_NONFINITE, GuardMode.GUARDED)
GUARD_CONFIGS = ("`skip_nonfinite`",
                 "`skip_nonfinite` + `skip_spike_score=6`, `guard_spike_statistic=\"ema\"`")


def guard_table(r: GuardResult | Failure) -> str:
    if isinstance(r, Failure):
        return f"failed: {r.error}"
    rows = [[GuardMode.WATCHED.value, fmt_timing(r.timing(GuardMode.WATCHED)),
             f"{r.optimizer_ms(GuardMode.WATCHED):.2f}", "-", "-", "-"]]
    for mode in (GuardMode.COLLECTIVE, *GUARDED_MODES):
        ov = r.ratio(mode)
        floor = "-" if mode is GuardMode.COLLECTIVE else fmt_ratio(
            r.ratio(mode, GuardMode.COLLECTIVE))
        rows.append([mode.value, fmt_timing(r.timing(mode)), f"{r.optimizer_ms(mode):.2f}",
                     fmt_ratio(ov), verdict_of(ov), floor])
    return table(
        ["step", "step ms (p25-p75)", "optimizer phase ms (median)",
         "ratio over unguarded (IQR over blocks)", "verdict", "over the bare all-reduce"], rows)


def update_stats_table(r: UpdateStatsResult | Failure) -> str:
    if isinstance(r, Failure):
        return f"failed: {r.error}"
    rows = [[UpdateStatsMode.WATCHED.value, fmt_timing(r.timing(UpdateStatsMode.WATCHED)), "-",
             "-"]]
    for mode in (UpdateStatsMode.UPDATES, UpdateStatsMode.FLOOR,
                 UpdateStatsMode.ARITHMETIC_FLOOR):
        if mode in r.step_times:
            ov = r.ratio(mode)
            rows.append([mode.value, fmt_timing(r.timing(mode)), fmt_ratio(ov), verdict_of(ov)])
    return table(["step", "step ms (p25-p75)", "ratio over the step without (IQR over blocks)",
                  "verdict"], rows)


def _update_stats_figures(r: UpdateStatsResult) -> str:
    extra = (r.timing(UpdateStatsMode.UPDATES).median
             - r.timing(UpdateStatsMode.WATCHED).median) * 1e3
    peak = r.largest_allocation
    return (f"{extra:+.2f} ms; {verdict_of(r.ratio())}; {r.scalar_reads} host reads added per "
            f"step; persistent memory {r.persistent_bytes} B ({r.persistent_pct:.3f}% of "
            f"{r.parameter_bytes} B of parameters); largest allocation of a warm step "
            f"{peak[UpdateStatsMode.UPDATES]} B with, {peak[UpdateStatsMode.WATCHED]} B without"
            + _update_stats_kernels(r) + _update_stats_floor(r))


def _update_stats_floor(r: UpdateStatsResult) -> str:
    """The floor hooks' costs: what reading the weights and Adam's state once costs the step,
    and that read with Adam's per-element arithmetic."""
    out = ""
    for mode, name, what, meaning in (
            (UpdateStatsMode.FLOOR, "the floor", "one compiled pass reading the weights and "
             "Adam's state once, no figure", "no exact per-element update figure costs less "
             "here"),
            (UpdateStatsMode.ARITHMETIC_FLOOR, "the arithmetic floor", "that pass also "
             "computing Adam's per-element quotient", "no exact figure of Adam's applied "
             "update computed after the step costs less here")):
        if mode not in r.step_times:
            continue
        fl = r.ratio(mode)
        extra = (r.timing(mode).median - r.timing(UpdateStatsMode.WATCHED).median) * 1e3
        nan = float("nan")
        cpu = r.thread_ms.get(mode, nan) - r.thread_ms.get(UpdateStatsMode.WATCHED, nan)
        out += (f"; {name} ({what}): {fl.median_pct:+.1f}% (95% CI {fl.ci_low_pct:+.1f}% to "
                f"{fl.ci_high_pct:+.1f}%), {extra:+.2f} ms, training-thread CPU {cpu:+.2f} "
                f"ms: {meaning}")
    return out


def _update_stats_kernels(r: UpdateStatsResult) -> str:
    """The fused kernels' compile and what a warm step dispatches and costs the thread."""
    if not r.ops_per_step or not r.thread_ms:
        return ""
    w, u = UpdateStatsMode.WATCHED, UpdateStatsMode.UPDATES
    return (f"; fused kernels: {r.kernels_ready} compiled ({r.kernels_failed} failed) "
            f"{r.compile_seconds:.1f} s after the first step (in the background); aten ops "
            f"per warm step {r.ops_per_step[u]} with, {r.ops_per_step[w]} without "
            f"({r.profiled_scalar_reads:+d} scalar reads, profiler); training-thread CPU per "
            f"step {r.thread_ms[u]:.2f} ms with, {r.thread_ms[w]:.2f} ms without "
            f"({r.thread_ms[u] - r.thread_ms[w]:+.2f} ms)")


def _update_stats_section(r: UpdateStatsResult | Failure) -> str:
    if isinstance(r, Failure):
        return update_stats_table(r)
    return (f"Blocks: {r.blocks}. {_update_stats_figures(r)}.\n\n" + update_stats_table(r))


SCALE_TARGET_CASE = "PP x FSDP2 x TP"
SCALE_TARGET_WORLD = 16384
SCALE_SECONDS_TARGET = Target(10.0, " s")
SCALE_GIB_TARGET = Target(1.0, " GiB")

def scale_table(results: Sequence[ScaleResult]) -> str:
    if not results:
        return "skipped"
    return table(
        ["case", "ranks", "mesh", "distinct descriptions", "handshake path", "layout step",
         "peak memory", "handshake per rank (sent / received)",
         "all-gather of every description (received)",
         "per-step vector (R)", "with rank timing (its section, per rank)"],
        [[r.case, f"{r.world:,}", r.mesh, r.distinct,
          "agreed (phase 0 only)" if r.agreed else "records", f"{r.seconds:.2f} s",
          fmt_bytes(r.peak_bytes), f"{fmt_bytes(r.sent_bytes)} / {fmt_bytes(r.received_bytes)}",
          fmt_bytes(r.gather_all_received_bytes), f"{fmt_bytes(r.packed_bytes)} ({r.replicas})",
          f"{fmt_bytes(r.timed_packed_bytes)} ({fmt_bytes(r.timing_bytes)})"]
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


# -- targets ----------------------------------------------------------------------------------


def _ddp_cases(run: RunResults) -> list[DistributedCase]:
    return [r for r in run.distributed or ()
            if isinstance(r, DistributedCase) and r.wrapper == "ddp"]


WATCHED_MODES = (StepMode.COLLECT, StepMode.COLLECT_RESULT)


def _iqr(ov: Overhead) -> str:
    return f"{ov.median_pct:+.1f}% (IQR {ov.p25_pct:+.1f}% to {ov.p75_pct:+.1f}%)"


def _ddp_figures(r: DistributedCase, mode: StepMode) -> str:
    """The figures that bear on a DDP overhead: the extra time, the collect call, gradwatch's
    own collectives and the two floors of the same run."""
    own = r.gradwatch_counts.collectives
    return (f"+{r.extra_ms(mode):.2f} ms on a {r.timing(StepMode.PLAIN).median * 1e3:.1f} ms "
            f"step; `collect()` call {r.collect_call.median * 1e3:.2f} ms; gradwatch's "
            f"collectives per ordinary collect: {own}; floors: gradient read "
            f"{_iqr(r.overhead(StepMode.FLOOR_READ))}, all-reduce "
            f"{_iqr(r.overhead(StepMode.FLOOR_ALL_REDUCE))}")


def _rank_view_figures(r: RankViewResult) -> str:
    """The view's cost split into its parts, measured in the same run."""
    extra = (r.timing(RankViewMode.RANK_VIEW).median
             - r.timing(RankViewMode.WATCHED).median) * 1e3
    reduce = r.ratio(RankViewMode.ALWAYS_REDUCE, RankViewMode.WATCHED)
    hook = r.ratio(RankViewMode.HOOK_ONLY, RankViewMode.ALWAYS_REDUCE)
    own = r.ratio(RankViewMode.RANK_VIEW, RankViewMode.HOOK_ONLY)
    return (f"+{extra:.2f} ms on a {r.timing(RankViewMode.WATCHED).median * 1e3:.1f} ms step; "
            f"`always_reduce=True` over the default {_iqr(reduce)}; the hook alone over DDP's "
            f"built-in reduction {_iqr(hook)}; the view's measurement ({r.hook_ops} ops, "
            f"{r.buckets} buckets) over the hook {_iqr(own)}")


def _guard_figures(g: GuardResult, mode: GuardMode) -> str:
    ov = g.ratio(mode)
    extra = (g.timing(mode).median - g.timing(GuardMode.WATCHED).median) * 1e3
    floor = g.ratio(GuardMode.COLLECTIVE)
    return (f"{extra:+.2f} ms; {verdict_of(ov)}; {g.ops[mode]} ops ({g.extra_ops(mode)} more "
            f"than unguarded), {g.collectives.get(mode, 0)} collective(s) and "
            f"{g.scalar_reads} host reads per guarded step; the bare all-reduce alone "
            f"{floor.median_pct:+.1f}% (95% CI {floor.ci_low_pct:+.1f}% to "
            f"{floor.ci_high_pct:+.1f}%: the floor on gloo)")


def _scrapers_figures(run: RunResults, s: ScrapersResult) -> str:
    hit = next((r.cached.median for r in run.scrape_latency if r.top_k == 50), None)
    cached = f"cached scrape {hit * 1e3:.1f} ms; " if hit else ""
    return (f"{cached}{scrape_rate():g} scrapes/s per client address; exporter process "
            f"{s.exporter_cpu_seconds / s.seconds_with * 100:.1f}% of a core, clients "
            f"{s.client_cpu_seconds / s.seconds_with * 100:.0f}% of a core")


def target_checks(run: RunResults) -> list[TargetCheck]:
    """Every measured value that has a stated target, in the report's order, each with the
    figures of the same run that bear on a miss and the heading of its known cause."""
    checks: list[TargetCheck] = list(shapes.checks(run.shapes))
    checks += ranktiming_bench.checks(run.rank_timing)
    checks += shapes.collect_call_checks(run.collect_call)
    checks += norm_report.norm_cost_checks(run.mixed, run.norm_cases)
    for r in _ddp_cases(run):
        for mode in WATCHED_MODES:
            ov = r.overhead(mode)
            checks.append(TargetCheck(
                "distributed", f"DDP step overhead, gradwatch every step, {r.model}, "
                f"{mode.watched}: {DDP_OVERHEAD_TARGET}", DDP_OVERHEAD_TARGET, ov.median_pct,
                _iqr(ov), _ddp_figures(r, mode), "DDP step overhead"))
    for rv in _rank_view_results(run):
        ov = rv.ratio(RankViewMode.RANK_VIEW, RankViewMode.WATCHED)
        checks.append(TargetCheck(
            "distributed", f"DDP step with the per-rank view, {rv.model}, {rv.loop}: within "
            f"+{RANK_VIEW_TARGET.limit:g}% of the step watched without it ({RANK_VIEW_TARGET})",
            RANK_VIEW_TARGET, ov.median_pct, fmt_ratio(ov), _rank_view_figures(rv),
            "Per-rank view"))
    if isinstance(run.guard, GuardResult):
        for mode, config in zip(GUARDED_MODES, GUARD_CONFIGS, strict=True):
            ov = run.guard.ratio(mode)
            checks.append(step_cost_check(
                f"{run.guard.model} guarded by `watch.guard` ({config}, fused AdamW)",
                GUARD_TARGET, ov, "the unguarded step", _guard_figures(run.guard, mode),
                "The guarded step"))
    if isinstance(run.updates, UpdateStatsResult):
        ov = run.updates.ratio()
        checks.append(step_cost_check(
            f"{run.updates.model} with `update_stats=True` (AdamW)", UPDATE_STATS_TARGET, ov,
            "the step without it", _update_stats_figures(run.updates), "Update stats"))
        checks.append(TargetCheck(
            "distributed", f"persistent memory `update_stats=True` adds, {run.updates.model}: "
            f"{UPDATE_STATS_MEMORY_TARGET} of the parameters' bytes", UPDATE_STATS_MEMORY_TARGET,
            run.updates.persistent_pct, f"{run.updates.persistent_pct:.3f}%",
            _update_stats_figures(run.updates), "Update stats"))
    checks += warm_step_host_reads(run)
    checks += _zero_checks(run.zero)
    checks += norm_report.clipping_checks(run.clipping)
    if run.spike_cost is not None:
        sc = run.spike_cost
        checks.append(TargetCheck(
            "spikes", f"spike detection at {sc.n_params:,} parameters, {sc.groups} groups: "
            f"{sc.target} of result()", sc.target, sc.share_pct, f"{sc.share_pct:.2f}%",
            f"load average at end {run.load_end[0]:.2f}",
            "Spike detection and construction at scale"))
    for r in run.scale:
        if r.case == SCALE_TARGET_CASE and r.world == SCALE_TARGET_WORLD:
            subject = f"{r.case} layout step at {r.world:,} simulated ranks, one core"
            load = f"load average at end {run.load_end[0]:.2f}"
            cause = "Spike detection and construction at scale"
            checks.append(TargetCheck("scale", f"{subject}: {SCALE_SECONDS_TARGET}",
                                      SCALE_SECONDS_TARGET, r.seconds, f"{r.seconds:.2f} s",
                                      load, cause))
            gib = r.peak_bytes / 2**30
            checks.append(TargetCheck("scale", f"{subject}: peak memory {SCALE_GIB_TARGET}",
                                      SCALE_GIB_TARGET, gib, fmt_bytes(r.peak_bytes), load,
                                      cause))
    for s in _judged_scrapers(run):
        checks.append(TargetCheck(
            "scraping", f"DDP step time with {s.n_scrapers} scrapers: {s.target}", s.target,
            s.slowdown_pct, f"{s.slowdown_pct:+.1f}%", _scrapers_figures(run, s), "Scrapers"))
    checks += _divergence_checks(run.divergence)
    unknown = {c.cause for c in checks} - set(CAUSES)
    assert not unknown, f"causes without a section in docs/{METHODS_PAGE}: {unknown}"
    return checks


def step_cost_check(step: str, target: Target, ov: PairedRatio, over: str, figures: str,
                    cause: str) -> TargetCheck:
    """A targets-table row: the paired ratio ``ov`` of the 2-rank DDP step of ``step`` (the
    model and what gradwatch does in it) over ``over``, held to ``target`` (extra percent)."""
    return TargetCheck("distributed", f"2-rank DDP step of the {step}: {target} over {over}",
                       target, ov.median_pct, fmt_ratio(ov), figures, cause)


#: A warm training step's host reads gradwatch adds: none (each would stall an accelerator).
NO_HOST_READS = Target(0, " host reads")


def no_host_reads_check(subject: str, reads: int, cause: str) -> TargetCheck:
    """A targets-table row: ``reads`` host scalar reads gradwatch added to one warm step of a
    distributed section (an untimed step under ``OpCounter``) held to :data:`NO_HOST_READS`."""
    return TargetCheck("host reads", f"{subject}: {NO_HOST_READS}", NO_HOST_READS, reads,
                       str(reads), "one warm step counted under a dispatch-mode counter", cause)


def warm_step_host_reads(run: RunResults) -> list[TargetCheck]:
    """The distributed sections' host reads per warm step."""
    checks = []
    if isinstance(run.guard, GuardResult):
        checks.append(no_host_reads_check(
            f"host reads of a warm guarded optimizer step, {run.guard.model}, 2-rank DDP",
            run.guard.scalar_reads, "The guarded step"))
    if isinstance(run.updates, UpdateStatsResult):
        checks.append(no_host_reads_check(
            f"host reads update stats add to a warm step, {run.updates.model}, 2-rank DDP",
            run.updates.scalar_reads, "Update stats"))
    return checks


def _zero_checks(z: object) -> list[TargetCheck]:
    if not isinstance(z, zero_bench.ZeroNormResult):
        return []
    target = Target(zero_bench.TARGET, "x")
    return [TargetCheck(
        "distributed", f"DeepSpeed ZeRO-{z.stage}, {z.world} ranks: {GW} {target} DeepSpeed's "
        "`scaled_global_norm`", target, z.ratio, f"{z.ratio:.2f}x",
        f"medians {z.gradwatch.median * 1e3:.2f} / {z.deepspeed.median * 1e3:.2f} ms",
        "DeepSpeed ZeRO-2")]


def _divergence_checks(d: divergence_bench.DivergenceResult | None) -> list[TargetCheck]:
    """One row: every arm of the divergence case as its target says (fixed clipping diverges
    and "auto" does not with corrupt batches, neither arm without)."""
    if d is None:
        return []
    as_said = sum(r.diverged == (r.every != 0 and r.mode != "auto") for r in d.runs)
    target = Target(len(d.runs), f" of {len(d.runs)} arms", at_most=False)
    wrong = [f"{r.mode}, 1 in {r.every}, seed {r.seed}" if r.every else
             f"{r.mode}, control, seed {r.seed}"
             for r in d.runs if r.diverged != (r.every != 0 and r.mode != "auto")]
    return [TargetCheck(
        "adaptive clipping", f"divergence case ({divergence_bench.TARGET}): {target}", target,
        as_said, f"{as_said} of {len(d.runs)}", "not as the target says: " + "; ".join(wrong),
        "Adaptive clipping: a divergence case")]


def _judged_scrapers(run: RunResults) -> list[ScrapersResult]:
    """The scrapers rows held to their target (the others are shown for context)."""
    return [s for s in run.scrapers or () if isinstance(s, ScrapersResult) and s.target]


def _rank_view_results(run: RunResults) -> list[RankViewResult]:
    """The per-rank view's measured loops (result() on the training thread, collect only)."""
    return [r for r in (run.rank_view, run.rank_view_loop) if isinstance(r, RankViewResult)]


def targets_table(run: RunResults) -> str:
    return table(["area", "target", "measured", "verdict"],
                 [[c.area, c.subject, c.shown, verdict(c.met)] for c in target_checks(run)])


def miss_notes(run: RunResults) -> str:
    """The targets this run did not meet, each with the figures of the same run that bear on
    it and a link to its known cause in docs/benchmarks.md."""
    missed = [c for c in target_checks(run) if not c.met]
    if not missed:
        return "Every target was met in this run."
    return table(["target", "measured", "figures of the same run", "known cause"],
                 [[c.subject, c.shown, c.figures,
                   f"[{c.cause}]({METHODS_PAGE}#{anchor(c.cause)})"] for c in missed])


# -- the whole page ---------------------------------------------------------------------------


def _skipped_or(result: object, body: Callable[[], str]) -> str:
    """A section's body: ``skipped`` when it did not run, else ``body()``."""
    return "skipped: --no-distributed\n" if result is None else body() + "\n"


def _rank_view_section(run: RunResults) -> str:
    r = run.rank_view
    if not isinstance(r, RankViewResult):
        return rank_view_table(r)  # type: ignore[arg-type]  # a Failure
    text = (f"Blocks: {r.blocks}. The view's measurement: {r.hook_ops} aten ops over "
            f"{r.buckets} DDP buckets of one backward.\n\n" + rank_view_table(r) + "\n")
    if run.rank_view_loop is not None:
        text += ("\nThe documented loop (`collect` only):\n\n"
                 + rank_view_table(run.rank_view_loop) + "\n")
    return text.removesuffix("\n")


def _guard_section(g: GuardResult | Failure) -> str:
    if isinstance(g, Failure):
        return guard_table(g)
    ops = "; ".join(f"{config}: {g.ops[mode]} aten ops ({g.extra_ops(mode)} more than an "
                    f"unguarded one), {g.collectives.get(mode, 0)} collective(s)"
                    for mode, config in zip(GUARDED_MODES, GUARD_CONFIGS, strict=True))
    unguarded = g.collectives.get(GuardMode.WATCHED, 0)
    return (f"Blocks: {g.blocks}. One warm guarded optimizer step, {ops}; {g.scalar_reads} host "
            f"scalar reads. Unguarded: {unguarded} collective(s) (plain DDP: the collect "
            f"all-reduces only on divergence steps). The floor's all-reduce: "
            f"{g.packed_length} float64, as the packed vector. Steps the guards skipped "
            f"(timed or not): {_guard_skips(g)}.\n\n" + guard_table(g))


def _guard_skips(g: GuardResult) -> str:
    return ", ".join(f"{config} {g.skipped.get(mode, 0)}"
                     for mode, config in zip(GUARDED_MODES, GUARD_CONFIGS, strict=True))


def _fsdp1_section(results: list[Fsdp1Result] | Failure) -> str:
    layers = results[0].layers if isinstance(results, list) and results else "?"
    return f"Layers: {layers}.\n\n" + fsdp1_table(results)


def _cuda_section(run: RunResults) -> str:
    if run.cuda_device is None:
        return "skipped: `torch.cuda.is_available()` is False: no GPU figure is published."
    return (f"Device: {run.cuda_device}.\n\n" + norm_report.per_collect_table(run.cuda_cases)
            + "\n\nHost reads and ops per call on the device (each host read waits for it):\n\n"
            + norm_report.host_reads_table(run.cuda_cases))


def _spike_section(sc: SpikeCostResult | None) -> str:
    if sc is None:
        return "not measured"
    return (f"The global norm and {sc.groups} groups, windows of {sc.window} steps, "
            f"{sc.n_params:,} parameters.\n\n" + spike_cost_table(sc))


def _head(title: str, method: str | None = None) -> str:
    """A section's heading and its link to how it is measured (``method``: the methods page's
    heading, when it is not ``title``)."""
    return f"## {title}\n\n" + method_link(method or title)


def _shapes_section(run: RunResults) -> str:
    if not run.shapes:
        return "Not measured in this run."
    text = (f"Target: every shape {shapes.SHAPES_TARGET} torch's own norm read once, relative "
            "error <= 1e-6 against float64. Ratio of the best times of interleaved rounds.\n\n"
            + shapes.table(run.shapes) + "\n")
    if run.collect_call is not None:
        text += (f"\nHost time per `collect()` of a 1,000-parameter model, target "
                 f"{shapes.COLLECT_CALL_TARGET} one `get_total_norm` call:\n\n"
                 + shapes.collect_call_table(run.collect_call) + "\n")
    return text.removesuffix("\n")


def render(run: RunResults) -> str:
    """The whole of docs/performance.md: figures, targets and verdicts; each section links
    the part of docs/benchmarks.md that says how it is measured."""
    rate = scrape_rate()
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in run.section_seconds.items())
    mixed_rounds = run.mixed[0].case.rounds if run.mixed else "?"
    sizes = run.mixed[0].sizes if run.mixed else "48 x 1M + 200 small"
    scrape_params = run.scrape_latency[0].n_params if run.scrape_latency else "?"
    targets = " and ".join(f"{'fp32' if m.case.dtype == 'float32' else 'bf16'}: {GW} "
                           f"{m.target} {m.baseline.value}" for m in run.mixed)
    zero = zero_bench.text(run.zero)
    parts = [
        "# Performance\n",
        "<!-- Generated by `make bench` (benchmarks/run.py). Do not edit by hand: how each "
        f"section measures is written in docs/{METHODS_PAGE}. -->\n",
        f"The figures of one run. How each section measures, what its columns mean and the "
        f"known causes of the targets not met: [{METHODS_PAGE}]({METHODS_PAGE}).\n",
        f"Command: `{run.command}` (`make bench` runs `.venv/bin/python benchmarks/run.py --out "
        f"docs/performance.md`). Wall time of this run: {run.total_seconds:.0f} s ({sections}); "
        f"a full run's budget on a quiet 2-core machine: {WALL_TIME_BUDGET_S // 60} minutes.\n",
        "## Machine\n",
        run.machine + "\n",
        _head("Targets"),
        targets_table(run) + "\n",
        "### Targets not met\n",
        miss_notes(run) + "\n",
        _head("Shapes: collect() against torch's own norm (one process, one thread)", "Shapes"),
        _shapes_section(run) + "\n",
        _head("Per-collect cost (one process, one thread)"),
        f"Rounds per case: {run.rounds[0]}-{run.rounds[1]}.\n",
        norm_report.per_collect_table(run.norm_cases) + "\n",
        _head(f"Mixed sizes: {sizes} tensors (16-4,096 elements), one thread", "Mixed sizes"),
        f"Targets: {targets}. Rounds: {mixed_rounds}.\n",
        norm_report.mixed_table(run.mixed) + "\n",
        _head("Host reads and ops per collect (what a per-parameter loop costs on a GPU)",
              "Host reads and ops per collect"),
        f"Target: gradwatch {HOST_READS_TARGET} per collect()+result() whatever the number of "
        "parameters (rows from 1,000 tensors in the targets table). One untimed call of each "
        "method under a dispatch-mode counter.\n",
        norm_report.host_reads_table(run.norm_cases) + "\n",
        _head("Clipping (one process, one thread, CPU)"),
        f"Gradients: {sizes}.\n",
        norm_report.clipping_tables(run.clipping) + "\n",
        _head("Distributed (2 ranks, gloo, CPU, spawn, 1 thread per rank)"),
        f"Demo model: {run.demo_model}.\n",
        _skipped_or(run.distributed, lambda: distributed_table(run.distributed or [])),
        _head("Per-rank view and the DDP path (2 ranks, gloo, CPU)"),
        _skipped_or(run.rank_view, lambda: _rank_view_section(run)),
        _head("FSDP1: gradwatch against FSDP1's own norm (2 ranks, gloo, CPU)"),
        _skipped_or(run.fsdp1, lambda: _fsdp1_section(run.fsdp1)),  # type: ignore[arg-type]
        _head("DeepSpeed ZeRO-2: collect against DeepSpeed's own norm (2 ranks, gloo, CPU)"),
        zero,
        _head("The optimizer-step guard (2 ranks, gloo, CPU)"),
        _skipped_or(run.guard, lambda: _guard_section(run.guard)),  # type: ignore[arg-type]
        _head("Optimizer-update health (2 ranks, gloo, CPU)"),
        _skipped_or(run.updates, lambda: _update_stats_section(run.updates)),  # type: ignore[arg-type]
        _head("Which rank is slow: rank timing under plain DDP (2 ranks, gloo, CPU)",
              "Which rank is slow: rank timing"),
        ranktiming_bench.text(run.rank_timing),
        _head("Construction at scale (simulated ranks, one core)"),
        scale_table(run.scale) + "\n",
        _head("Scrapers during training"),
        f"Target: the step time with clients {SCRAPERS_TARGET} over the step without them. "
        f"Scrapes per second per client address: {rate:g}.\n",
        _skipped_or(run.scrapers, lambda: scrapers_table(run.scrapers or [])),
        _head("Scrape latency"),
        f"Parameters of 64 elements: {scrape_params}; GETs {SCRAPE_SPACING * 1000 / rate:.0f} "
        f"ms apart (bound: {rate:g}/s per client).\n",
        scrape_latency_table(run.scrape_latency) + "\n",
        _head("Spike detection"),
        _spike_section(run.spike_cost) + "\n",
        _head("Adaptive clipping: a divergence case (one process, CPU)"),
        divergence_bench.text(run.divergence),
        _head("CUDA"),
        _cuda_section(run) + "\n",
        f"Load average at end: {run.load_end[0]:.2f} {run.load_end[1]:.2f} "
        f"{run.load_end[2]:.2f} (start {run.load_start[0]:.2f}).\n",
    ]
    return "\n".join(parts)
