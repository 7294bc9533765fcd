"""The single-process norm sections of docs/performance.md (per-collect cost, mixed sizes,
clipping, host reads and ops per collect) and their rows of the targets table."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.cases import (
    FLOAT64_COPIES_ELEMENTS,
    FLOAT64_COPIES_TARGET,
    HOST_READS_TARGET,
    HOST_READS_TENSORS,
)
from benchmarks.page import fmt_bytes, fmt_ms, fmt_spread, fmt_timing, table, verdict
from benchmarks.results import (
    ClipResult,
    Counts,
    MixedSizesResult,
    NormCaseResult,
    NormMethod,
    TargetCheck,
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
    compiled = ", ".join(f"{r.dtype} {r.compile_s:.1f} s" for r in results)
    return (table(["dtype", "method", "median ms", "p25-p75 ms", "extra vs torch", "target"],
                  rows) + f"\n\nCompiling the norm kernels before the timed rounds: {compiled}."
            "\n\nAccuracy of the returned total norm (relative error vs a float64 "
            "reference), tensors above 64K elements:\n\n"
            + table(["dtype", "tensors", "torch clip_grad_norm_", "watch.clip_grad_norm_",
                     "gradwatch more exact by"], acc_rows))



#: The methods whose counts the host-reads table sets side by side.
COUNTED = (NormMethod.GRADWATCH, NormMethod.GET_TOTAL_NORM, NormMethod.ITEM_LOOP)


def _counts(case: NormCaseResult, method: NormMethod) -> Counts:
    counts = case.get(method).counts
    assert counts is not None, f"{case.label}: {method.value} was not counted"
    return counts


def host_reads_table(cases: Sequence[NormCaseResult]) -> str:
    """Per case, the host reads and aten ops of one call of each counted method (what a call
    costs on an accelerator, where each host read waits for the device), and gradwatch's
    verdict against :data:`HOST_READS_TARGET`."""
    rows: list[list[object]] = []
    for case in cases:
        counted = [_counts(case, m) for m in COUNTED]
        rows.append([case.label, f"{case.n_tensors:,}",
                     *(f"{c.host_syncs:,} / {c.ops:,}" for c in counted),
                     verdict(HOST_READS_TARGET.met(counted[0].host_syncs))])
    return table(["case", "tensors", *(f"{m.value}: host reads / ops" for m in COUNTED),
                  f"gradwatch {HOST_READS_TARGET}"], rows)


def _host_reads_check(case: NormCaseResult) -> TargetCheck:
    ours, loop = _counts(case, NormMethod.GRADWATCH), _counts(case, NormMethod.ITEM_LOOP)
    torch_own = _counts(case, NormMethod.GET_TOTAL_NORM)
    return TargetCheck(
        "host reads", f"{case.label}: host reads per {GW} {HOST_READS_TARGET} (the "
        f"{NormMethod.ITEM_LOOP.value}: one per parameter)", HOST_READS_TARGET,
        ours.host_syncs, f"{ours.host_syncs} vs {loop.host_syncs:,} for the loop; ops "
        f"{ours.ops:,} vs {loop.ops:,}", f"{NormMethod.GET_TOTAL_NORM.value}: "
        f"{torch_own.host_syncs} host read, {torch_own.ops} ops", "Host reads per collect")


def norm_cost_checks(mixed: Sequence[MixedSizesResult],
                     cases: Sequence[NormCaseResult]) -> list[TargetCheck]:
    """The mixed sizes against their baselines, gradwatch against float64 copies on the
    largest cases, and the host reads per collect of the cases with a model's many
    parameters."""
    checks: list[TargetCheck] = []
    for m in mixed:
        short = "fp32" if m.case.dtype == "float32" else "bf16"
        checks.append(TargetCheck(
            "norm cost", f"{short} {m.sizes}: {GW} {m.target} {m.baseline.value}",
            m.target, m.ratio, f"{m.ratio:.3f}x", _mixed_figures(m), f"Mixed sizes, {short}"))
    for case in cases:
        if case.total_elements >= FLOAT64_COPIES_ELEMENTS:
            s = case.speedup(NormMethod.FLOAT64_COPIES)
            checks.append(TargetCheck(
                "norm cost", f"{case.label}: {GW} {FLOAT64_COPIES_TARGET} faster than "
                f"{NormMethod.FLOAT64_COPIES.value}", FLOAT64_COPIES_TARGET, s, f"{s:.1f}x",
                f"float64 copies {fmt_timing(case.get(NormMethod.FLOAT64_COPIES).timing)} ms",
                "Float64 copies"))
    checks += [_host_reads_check(c) for c in cases if c.n_tensors >= HOST_READS_TENSORS]
    return checks


def clipping_checks(results: Sequence[ClipResult]) -> list[TargetCheck]:
    checks = []
    for c in results:
        a = c.accuracy
        for v in c.variants:
            extra = c.extra_pct(v)
            checks.append(TargetCheck(
                "clipping", f"{c.dtype} {v.name}: {c.target} over torch's clip", c.target,
                extra, f"{extra:+.1f}%", f"rel err {a.gradwatch_error:.0e} against torch's "
                f"{a.torch_error:.0e}",
                "Clipping, bf16" if c.dtype == "bfloat16" else "Clipping, fp32"))
    return checks


def _mixed_figures(m: MixedSizesResult) -> str:
    ours, base = m.case.get(NormMethod.GRADWATCH), m.case.get(m.baseline)
    return (f"p25-p75: gradwatch {fmt_spread(ours.timing)} ms, {m.baseline.value} "
            f"{fmt_spread(base.timing)} ms; rel err {ours.rel_error:.0e} against "
            f"{base.rel_error:.0e}")
