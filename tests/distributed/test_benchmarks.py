"""The benchmark harness runs on tiny sizes and produces its tables (no timing assertions)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The harness is the `benchmarks` package at the repository root. Spawned distributed workers
# import it by name: the root must be on sys.path, which spawn passes to its children.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from benchmarks import (  # noqa: E402
    cases,
    distributed,
    guard_bench,
    norm_report,
    rankview_bench,
    report,
    shapes,
)
from benchmarks.results import (  # noqa: E402
    Counts,
    DistributedCase,
    MethodResult,
    NormCaseResult,
    NormMethod,
    RankViewMode,
    RankViewResult,
    RunResults,
    ScrapersResult,
    StepMode,
    Timing,
)


def _rows(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return header, rows


def test_quick_harness_produces_tables(tmp_path: Path) -> None:
    import torch

    # Imported here, not at collection: the CLI module sets torch's log levels for its process.
    from benchmarks import run

    threads = torch.get_num_threads()
    out = tmp_path / "perf.md"
    assert run.main(["--quick", "--no-distributed", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # restored
    text = out.read_text()
    for heading in ("## Machine", "## Targets", "## Shapes", "## Per-collect cost",
                    "## Mixed sizes", "## Host reads and ops per collect", "## Clipping",
                    "## Distributed", "## Scrapers during training", "## Scrape latency",
                    "## Spike detection", "## CUDA", "## Construction at scale",
                    "## Per-rank view and the DDP path", "## FSDP1",
                    "## Adaptive clipping: a divergence case"):
        assert heading in text
    header, rows = _rows(text, "| parameters | groups | window |")
    assert len(rows) == 1 and rows[0][1] == str(cases.SPIKE_GROUPS) and rows[0][5].endswith("%")
    _header, scale_rows = _rows(text, "| case | ranks | mesh |")
    assert {r[0] for r in scale_rows} == {"DDP", "FSDP2", "FSDP2 x TP", "HSDP",
                                          "PP x FSDP2 x TP", "HSDP, even shards"}
    paths = {r[0]: r[4] for r in scale_rows}
    for case in ("DDP", "FSDP2", "FSDP2 x TP", "HSDP", "HSDP, even shards"):
        assert paths[case] == "agreed (phase 0 only)", case  # uneven shards agree too
    assert paths["PP x FSDP2 x TP"] == "records"  # stages differ
    assert not re.search(r"\bissues?\b", text, re.IGNORECASE)  # targets stated as targets
    assert "Command: `python benchmarks/run.py --quick" in text
    # Numbers and verdicts only: every section links the hand-written page that says how it
    # is measured, and each link lands on one of its headings.
    links = re.findall(r"\]\(benchmarks\.md#([^)]+)\)", text)
    assert len(links) >= 14 and set(links) <= _methods_page_anchors()
    assert "this machine" not in text
    header, rows = _rows(text, "| case | method |")
    assert header == norm_report.PER_COLLECT_COLUMNS
    methods = {r[1].removeprefix("read limit: ").split(" (")[0] for r in rows}
    compared = {m.value for m in NormMethod if not m.is_read_limit}
    assert compared <= methods  # every compared method (bf16 cases add the float32 baseline)
    assert methods & {m.value for m in NormMethod if m.is_read_limit}  # and the read limit
    for r in rows:
        assert float(r[2]) > 0  # time ms
        assert float(r[3]) > 0 and float(r[4]) > 0
        if not r[1].startswith("read limit"):
            assert float(r[5]) < 1e-2  # relative error vs float64
        int(r[6]), int(r[7])  # host syncs, ops
    header, rows = _rows(text, "| dtype | method | median ms | p25-p75 ms | x target")
    assert header[:6] == ["dtype", "method", "median ms", "p25-p75 ms", "x target baseline",
                          "rel err vs float64"]
    assert {r[0] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert float(r[2]) > 0
        assert float(r[5]) < 1e-2
    header, rows = _rows(text, "| dtype | method | median ms | p25-p75 ms | extra vs torch")
    assert len(rows) == 6
    header, rows = _rows(text, "| dtype | tensors | torch clip_grad_norm_")
    for r in rows:  # gradwatch's clip norm is the more exact one
        assert float(r[3]) <= float(r[2])
    header, rows = _rows(text, "| area | target |")
    assert rows and all(r[3] in ("met", "**NOT MET**") for r in rows)
    # each states its bound: a ratio, extra time, or a count
    assert all(re.search(r"[<>]= \+?[\d.]+", r[1]) for r in rows)
    # No row holds gradwatch to a CPU `.item()` loop's time (on CPU the loop syncs nothing);
    # the loop appears as counts: host reads per collect, one per parameter.
    assert not any("faster than per-parameter" in r[1] for r in rows)
    reads = [r for r in rows if r[0] == "host reads" and "for the loop" in r[2]]
    assert [r[1].split(":")[0] for r in reads] == [
        c.label for c in cases.quick_plan().norm_cases if c.n_tensors >= 1000]
    assert re.fullmatch(r"\d+ vs 1,000 for the loop; ops [\d,]+ vs 2,000", reads[0][2])
    divergence = [r for r in rows if r[0] == "adaptive clipping"]
    assert len(divergence) == 1 and re.fullmatch(r"\d+ of 18", divergence[0][2])
    assert any(r[1].startswith("host time per `collect()` of a 1,000-parameter model")
               for r in rows)
    assert re.search(r"skipped: `torch\.cuda\.is_available\(\)` is False|Device: ", text)
    header, rows = _rows(text, "| parameters | top-k |")
    assert [r[1] for r in rows] == ["50", "200"]
    header, rows = _rows(text, "| case | tensors | gradwatch collect()+result(): host reads")
    assert [r[0] for r in rows] == [c.label for c in cases.quick_plan().norm_cases]
    for r in rows:  # host reads / ops of gradwatch, get_total_norm, the loop
        ours, torch_own, loop = ([int(x.replace(",", "")) for x in c.split(" / ")]
                                 for c in r[2:5])
        tensors = int(r[1].replace(",", ""))
        assert ours[0] >= 0 and torch_own[0] == 1 and loop == [tensors, 2 * tensors], r
        assert r[5] == ("met" if ours[0] <= 2 else "**NOT MET**")
    _header, rows = _rows(text, "| call (host time, nothing read) |")
    assert [r[0].split(",")[0] for r in rows] == ["`watch.collect(step)`",
                                                   "`torch.nn.utils.get_total_norm(grads)`"]
    assert float(rows[0][1]) > 0 and rows[0][3].endswith("x") and rows[1][3] == "1.00x"
    header, rows = _rows(text, "| shape (tensors x elements) |")
    assert [r[0] for r in rows] == [s.label for s in shapes.QUICK_SHAPES]
    for r in rows:  # best times, their ratio, gradwatch exact to 1e-6, the kernels' wait
        assert float(r[2]) > 0 and float(r[3]) > 0 and r[4].endswith("x")
        assert float(r[6]) <= 1e-6 and float(r[8]) >= 0 and r[9] in ("met", "**NOT MET**")


def _methods_page_anchors() -> set[str]:
    page = (ROOT / "docs" / report.METHODS_PAGE).read_text()
    return {report.anchor(line.lstrip("#")) for line in page.splitlines()
            if line.startswith("#")}


def test_every_known_cause_is_a_heading_of_the_methods_page() -> None:
    anchors = _methods_page_anchors()
    assert {report.anchor(c) for c in report.CAUSES} <= anchors
    assert report.anchor("Mixed sizes, fp32") == "mixed-sizes-fp32"  # GitHub's rule
    assert report.anchor("`.item()` loops and float64 copies on CPU") == (
        "item-loops-and-float64-copies-on-cpu")


def test_target_bounds() -> None:
    assert str(cases.MIXED_FP32_TARGET) == "<= 1.25x"
    assert str(shapes.SHAPES_TARGET) == "<= 1.25x"
    assert str(cases.DDP_OVERHEAD_TARGET) == "<= +3%"
    assert cases.MIXED_FP32_TARGET.met(1.25) and not cases.MIXED_FP32_TARGET.met(1.26)
    assert cases.FLOAT64_COPIES_TARGET.met(3) and not cases.FLOAT64_COPIES_TARGET.met(2.9)


def _counted_case(n_tensors: int, ours: int) -> NormCaseResult:
    """A per-collect case with made-up counts (gradwatch's host reads ``ours``)."""
    t = Timing.of([1e-3])
    counts = {NormMethod.GRADWATCH: Counts(ours, 20, 0),
              NormMethod.GET_TOTAL_NORM: Counts(1, 4, 0),
              NormMethod.ITEM_LOOP: Counts(n_tensors, 2 * n_tensors, 0)}
    methods = [MethodResult(m, t, 0.0, c) for m, c in counts.items()]
    methods.append(MethodResult(NormMethod.READ_FOREACH_MAX, t, None, Counts(0, 1, 0)))
    return NormCaseResult(f"{n_tensors} x, 1M float32", n_tensors, 10**6, "float32", 4 * 10**6,
                          tuple(methods), 1)


def test_host_reads_rows_judge_counts() -> None:
    """Each case of at least 1,000 tensors gets a targets row on gradwatch's host reads per
    collect, the loop's one per parameter beside it; a count above the bound is a miss with
    its known cause; smaller cases are in the section's table only."""
    few, ok, over = _counted_case(10, 2), _counted_case(1000, 2), _counted_case(10_000, 3)
    checks = [c for c in norm_report.norm_cost_checks([], [few, ok, over])
              if c.area == "host reads"]
    assert [c.subject.split(":")[0] for c in checks] == [ok.label, over.label]
    assert checks[0].met and checks[0].shown == "2 vs 1,000 for the loop; ops 20 vs 2,000"
    assert not checks[1].met and checks[1].shown.startswith("3 vs 10,000 for the loop")
    assert all("<= 2 host reads" in c.subject for c in checks)
    run = RunResults(command="x", rounds=(1, 1), norm_cases=[few, ok, over])
    notes = report.miss_notes(run)
    assert over.label in notes and "(benchmarks.md#host-reads-per-collect)" in notes
    assert ok.label not in notes
    _header, rows = _rows(norm_report.host_reads_table([few, over]), "| case |")
    assert rows[0][2:] == ["2 / 20", "1 / 4", "10 / 20", "met"]
    assert rows[1][2:] == ["3 / 20", "1 / 4", "10,000 / 20,000", "**NOT MET**"]


def test_cuda_section_counts_host_reads() -> None:
    """On a GPU run the CUDA section shows each method's host reads and ops per call beside
    its times; the targets rows stay the CPU cases' (none here)."""
    run = RunResults(command="x", rounds=(1, 1), cuda_device="a GPU",
                     cuda_cases=[_counted_case(1000, 1)])
    section = report.render(run).split("## CUDA")[1]
    _header, rows = _rows(section, "| case | tensors | gradwatch collect()+result(): host reads")
    assert rows == [["1000 x, 1M float32", "1,000", "1 / 20", "1 / 4", "1,000 / 2,000", "met"]]
    assert not [c for c in report.target_checks(run) if c.area == "host reads"]


def test_divergence_row_counts_the_arms_as_the_target_says() -> None:
    """The divergence case's targets row: every arm as its target says, else a miss naming
    the arms that are not."""
    from benchmarks import divergence_bench
    from benchmarks.divergence_bench import DivergenceResult, DivergenceRun

    def arm(every: int, mode: str, worst: float) -> DivergenceRun:
        return DivergenceRun(every, 0, mode, 1.0, 1.0, worst, 0.1)

    good = DivergenceResult([arm(0, "fixed 1", 1.0), arm(0, "auto", 1.0),
                             arm(10, "fixed 1", 50.0), arm(10, "auto", 1.0)])
    bad = DivergenceResult([*good.runs[:3], arm(10, "auto", float("nan"))])
    for result, met in ((good, True), (bad, False)):
        run = RunResults(command="x", rounds=(1, 1), divergence=result)
        row = [c for c in report.target_checks(run) if c.area == "adaptive clipping"]
        assert len(row) == 1 and row[0].met is met is result.met
        assert row[0].subject.endswith(">= 4 of 4 arms")
        assert divergence_bench.TARGET in row[0].subject
    assert row[0].shown == "3 of 4" and "auto, 1 in 10, seed 0" in row[0].figures
    assert "(benchmarks.md#adaptive-clipping-a-divergence-case)" in report.miss_notes(run)


def test_collect_call_row() -> None:
    """The host time per collect() row: ratio of the best times, judged against 1.25x; the
    shapes section renders its table."""
    r = shapes.CollectCallResult("1,000 x 10,000 float32", Timing.of([2.4e-3, 2.6e-3]),
                                 Timing.of([2.0e-3, 3.0e-3]))
    assert abs(r.ratio - 1.2) < 1e-12
    (check,) = shapes.collect_call_checks(r)
    assert check.met and check.subject.startswith(
        "host time per `collect()` of a 1,000-parameter model (1,000 x 10,000 float32): "
        "<= 1.25x")
    slow = shapes.CollectCallResult(r.label, Timing.of([2.6e-3]), Timing.of([2.0e-3]))
    assert not shapes.collect_call_checks(slow)[0].met
    assert shapes.collect_call_checks(None) == []


@pytest.mark.distributed
def test_quick_distributed_sections() -> None:
    found = distributed.overhead([cases.ModelSpec("demo", "demo")], {"ddp": 8, "fsdp2": 8})
    table = report.distributed_table(found)
    header, rows = _rows(table, "| wrapper |")
    assert header[0] == "wrapper" and any("overhead" in h for h in header)
    assert [r[0] for r in rows] == ["ddp", "fsdp2"]
    for r in rows:
        assert not r[1].startswith("failed"), r
        assert float(r[3].split()[0]) > 0 and float(r[4].split()[0]) > 0, r
        assert float(r[6].split()[0]) > 0 and float(r[7].split()[0]) > 0, r  # the floors
    # gradwatch's own collectives per ordinary collect: none under pure DDP replication (the
    # divergence step, every 100th collect, all-reduces once); one under FSDP2.
    assert re.fullmatch(r"0 / 0 B \(1 / [\d.]+ [KM]?B on each divergence step, 1 collect in "
                        r"100\)", rows[0][11]), rows[0]
    assert re.fullmatch(r"1 / [\d.]+ [KM]?B", rows[1][11]), rows[1]
    ddp = next(c for c in found if isinstance(c, DistributedCase) and c.wrapper == "ddp")
    fsdp2 = next(c for c in found if isinstance(c, DistributedCase) and c.wrapper == "fsdp2")
    assert ddp.gradwatch_counts.collectives == 0 and ddp.divergence_counts is not None
    assert ddp.divergence_counts.collectives == 1 and ddp.divergence_counts.bytes > 0
    assert fsdp2.gradwatch_counts.collectives == 1
    # The watched DDP step adds no collective to DDP's own (an ordinary collect); FSDP2's one.
    assert ddp.counts_watched.collectives == ddp.counts_plain.collectives
    assert fsdp2.counts_watched.collectives == fsdp2.counts_plain.collectives + 1
    for floor in (StepMode.FLOOR_ALL_REDUCE, StepMode.FLOOR_READ):  # measured in the same run
        assert len(ddp.timing(floor)) > 0 and ddp.overhead(floor) is not None
    scrapers = distributed.scrapers_during_training(cases.ScrapersPlan(2, 0.3, 1))
    assert isinstance(scrapers, ScrapersResult)
    header, rows = _rows(report.scrapers_table([scrapers]), "| scrapers |")
    assert rows[0][0] == "2" and int(rows[0][8].split()[0]) > 0  # scrapes were served
    assert rows[0][1] == "nice 19"  # the clients stand in for remote machines


@pytest.mark.distributed
def test_quick_fsdp1_section() -> None:
    """The FSDP1 section (gradwatch against FSDP1's own clip_grad_norm_) on tiny layers: every
    call timed for both use_orig_params settings, ratios over FSDP's own call."""
    from benchmarks import fsdp1_bench

    found = fsdp1_bench.fsdp1(2, width=16)
    assert isinstance(found, list), found
    assert [r.use_orig_params for r in found] == [False, True]
    for r in found:
        assert r.n_tensors == 2 * fsdp1_bench.LAYERS
        assert r.n_params == fsdp1_bench.LAYERS * (16 * 16 + 16)
        assert r.fsdp.median > 0 and r.ratio(r.collect) > 0 and r.ratio(r.clip) > 0
    _header, rows = _rows(report.fsdp1_table(found), "| FSDP1 |")
    assert len(rows) == 6 and rows[0][3] == "1.00x"


@pytest.mark.distributed
def test_quick_rank_view_section() -> None:
    """The per-rank view section (what `make bench` runs) on 2 blocks: every kind timed in
    every block, the comparisons rendered as ratios with their IQR, the target row judged."""
    found = rankview_bench.rank_view(2)
    assert isinstance(found, RankViewResult)
    assert all(len(found.timing(m)) == 4 for m in RankViewMode)  # two per block
    assert found.buckets >= 1 and found.hook_ops > 0
    _header, rows = _rows(report.rank_view_table(found), "| step |")
    assert len(rows) == 1 + len(report.RANK_VIEW_COMPARISONS)
    # Every kind's step time is in the table; the default's saving is measured against
    # `always_reduce=True`, the view's target against the default, and (context) the view
    # against `always_reduce=True` too.
    assert {r[0] for r in rows} == {m.value for m in RankViewMode}
    compared = {(r[0], r[2]) for r in rows[1:]}
    for mode, over in ((RankViewMode.WATCHED, RankViewMode.ALWAYS_REDUCE),
                       (RankViewMode.RANK_VIEW, RankViewMode.WATCHED),
                       (RankViewMode.RANK_VIEW, RankViewMode.ALWAYS_REDUCE)):
        assert (mode.value, over.value) in compared
    for r in rows[1:]:
        assert re.fullmatch(r"\d+\.\d{3}x \([+-][\d.]+%, IQR [+-][\d.]+% to [+-][\d.]+%\)", r[3]), r
        assert "beyond noise (95% CI of the median" in r[4], r
    run = RunResults(command="x", rounds=(1, 1), rank_view=found)
    row = [c for c in report.target_checks(run) if "per-rank view" in c.subject]
    assert len(row) == 1 and "within +2% of the step watched without it" in row[0].subject
    text = report.miss_notes(run)
    assert row[0].met or "DDP step with the per-rank view" in text
    # The documented collect-only loop: its own table (comparisons of the kinds it times) and
    # its own target row.
    kinds = rankview_bench.LOOP_KINDS
    loop = rankview_bench.rank_view(1, kinds, collect_only=True)
    assert loop.collect_only and set(loop.step_times) == set(kinds)
    assert all(len(loop.timing(m)) == 2 for m in kinds)
    _header, loop_rows = _rows(report.rank_view_table(loop), "| step |")
    timed = [c for c in report.RANK_VIEW_COMPARISONS if c[0] in kinds and c[1] in kinds]
    assert len(loop_rows) == 1 + len(timed) and len(timed) < len(report.RANK_VIEW_COMPARISONS)
    both = RunResults(command="x", rounds=(1, 1), rank_view=found, rank_view_loop=loop)
    rows = [c.subject for c in report.target_checks(both) if "per-rank view" in c.subject]
    assert len(rows) == 2
    assert "on the training thread" in rows[0] and "`collect` only" in rows[1]
    # The section links the page that says what is measured: the default makes no
    # all-reduce on an ordinary collect, `always_reduce=True` is the comparison.
    section = report.render(both).split("## Per-rank view and the DDP path")[1].split("\n## ")[0]
    assert "(benchmarks.md#per-rank-view-and-the-ddp-path-2-ranks-gloo-cpu)" in section
    page = (ROOT / "docs" / report.METHODS_PAGE).read_text().replace("\n", " ")
    assert "default under pure replication makes no all-reduce on an ordinary collect" in page
    assert "`always_reduce=True` restores one all-reduce per collect" in page


def test_rank_view_ratio_and_its_noise_verdict() -> None:
    """The paired ratio over blocks against a known answer: a kind 10% slower in every block
    is dearer beyond noise by exactly +10%; a kind equal to its comparison in distribution
    (same samples, shuffled within a noisy spread) is not."""
    import random

    rng = random.Random(1)
    base = [0.010 * (1 + 0.3 * rng.random()) for _ in range(200)]
    times = {m: tuple(base) for m in RankViewMode}
    times[RankViewMode.RANK_VIEW] = tuple(1.1 * t for t in base)
    shuffled = list(base)
    rng.shuffle(shuffled)
    times[RankViewMode.IN_CALLBACK] = tuple(shuffled)
    r = RankViewResult(model="m", n_params=1, blocks=100, step_times=times, buckets=1,
                       hook_ops=1)
    slower = r.ratio(RankViewMode.RANK_VIEW, RankViewMode.WATCHED)
    assert abs(slower.median_pct - 10) < 1e-9 and slower.beyond_noise == 1
    assert report.verdict_of(slower).startswith("dearer beyond noise")
    same = r.ratio(RankViewMode.IN_CALLBACK, RankViewMode.WATCHED)
    assert same.ci_low_pct < 0 < same.ci_high_pct and same.beyond_noise == 0
    assert report.verdict_of(same).startswith("no difference beyond noise")
    run = RunResults(command="x", rounds=(1, 1), rank_view=r)
    assert not next(c for c in report.target_checks(run) if "per-rank view" in c.subject).met


@pytest.mark.distributed
def test_divergence_section() -> None:
    """The adaptive clipping divergence case on one seed: the control trains at that learning
    rate with either clip, corrupt batches make fixed clipping at 1.0 diverge and not "auto";
    rendered with its verdict and its method link."""
    from benchmarks import divergence_bench

    found = divergence_bench.measure(seeds=1)
    assert len(found.runs) == 2 * len(divergence_bench.RATES)
    for r in found.runs:
        assert r.diverged == (r.every != 0 and r.mode != "auto"), r
    assert found.met
    text = report.render(RunResults(command="x", rounds=(1, 1), divergence=found))
    section = text.split("## Adaptive clipping: a divergence case")[1].split("\n## ")[0]
    assert "): met." in section and "benchmarks.md#adaptive-clipping-a-divergence-case" in section
    _header, rows = _rows(section, "| corrupt batches |")
    assert [r[0] for r in rows] == ["none", "none", "1 in 10", "1 in 10", "1 in 5", "1 in 5"]


def test_quick_deepspeed_zero_section() -> None:
    """The DeepSpeed ZeRO-2 section (what `make bench` runs) on 2 rounds: both methods timed in
    every round on one engine, rendered with their ratio and the target verdict."""
    from benchmarks import zero_bench

    found = zero_bench.measure(2)
    assert isinstance(found, zero_bench.ZeroNormResult), found
    assert len(found.gradwatch) == len(found.deepspeed) == 2
    assert found.ratio > 0
    _header, rows = _rows(zero_bench.text(found), "| method |")
    assert [r[0] for r in rows] == ["gradwatch collect + result", "DeepSpeed scaled_global_norm"]
    assert rows[0][4] in ("met", "not met")
    text = report.render(RunResults(command="x", rounds=(1, 1), zero=found))
    assert "## DeepSpeed ZeRO-2" in text and "| gradwatch collect + result |" in text
    (row,) = [c for c in report.target_checks(RunResults(command="x", rounds=(1, 1), zero=found))
              if "ZeRO" in c.subject]
    assert row.subject.startswith("DeepSpeed ZeRO-2, 2 ranks: ") and "<= 1.25x" in row.subject
    assert row.met == (found.ratio <= zero_bench.TARGET)


@pytest.mark.distributed
def test_quick_guard_section() -> None:
    """The guard section (what `make bench` runs) on 2 blocks: every kind timed in every block,
    the ratio rendered with its IQR and verdict (and over the bare all-reduce), the target rows
    judged, one collective per guarded step and per floor step, none unguarded, no host read."""
    from benchmarks.results import GuardMode, GuardResult

    found = guard_bench.guard(2)
    assert isinstance(found, GuardResult)
    assert all(len(found.timing(m)) == 4 for m in GuardMode)  # two per block
    assert found.scalar_reads == 0
    assert found.collectives == {GuardMode.WATCHED: 0, GuardMode.COLLECTIVE: 1,
                                 GuardMode.GUARDED_NONFINITE: 1, GuardMode.GUARDED: 1}
    assert found.packed_length > 0
    assert set(found.skipped) == {GuardMode.GUARDED_NONFINITE, GuardMode.GUARDED}
    assert found.skipped[GuardMode.GUARDED_NONFINITE] == 0  # finite gradients throughout
    modes = (GuardMode.GUARDED, GuardMode.GUARDED_NONFINITE)
    spike, nonfinite = (found.extra_ops(m) for m in modes)
    assert spike > nonfinite > 0
    _header, rows = _rows(report.guard_table(found), "| step |")
    assert [r[0] for r in rows] == [m.value for m in GuardMode]
    ratio = r"\d+\.\d{3}x \([+-][\d.]+%, IQR [+-][\d.]+% to [+-][\d.]+%\)"
    assert all(len(found.optimizer_times[m]) == 4 for m in GuardMode)
    assert all(0 < found.optimizer_times[m][k] < found.step_times[m][k]
               for m in GuardMode for k in range(4))
    for r in rows:
        assert re.fullmatch(r"\d+\.\d\d", r[2])
    for r in rows[1:]:
        assert re.fullmatch(ratio, r[3])
        assert "beyond noise (95% CI of the median" in r[4]
    assert rows[1][5] == "-" and all(re.fullmatch(ratio, r[5]) for r in rows[2:])
    run = RunResults(command="x", rounds=(1, 1), guard=found)
    checks = [c for c in report.target_checks(run) if "watch.guard" in c.subject]
    assert len(checks) == 2 and all("<= +2%" in c.subject for c in checks)
    assert "skip_spike_score" in checks[1].subject and "skip_spike_score" not in checks[0].subject
    assert '"ema"' in checks[1].subject
    assert all("the floor on gloo" in c.figures for c in checks)
    text = report.miss_notes(run)
    assert all(c.met or c.subject in text for c in checks)
    assert all(c.subject.startswith("2-rank DDP step of the demo model") for c in checks)
    reads = [c for c in report.target_checks(run) if c.area == "host reads"]
    assert len(reads) == 1 and "guarded optimizer step" in reads[0].subject
    assert reads[0].subject.endswith("<= 0 host reads") and reads[0].met


@pytest.mark.distributed
def test_quick_update_stats_section() -> None:
    """The update-stats section (what `make bench` runs) on 2 blocks: the four kinds (without,
    with update stats, the two floor hooks) timed in every block, the ratios rendered with their IQR
    and verdict, both target rows judged (time and persistent memory), no host read added, the
    fused kernels compiled before the blocks."""
    from benchmarks import update_bench
    from benchmarks.results import UpdateStatsMode, UpdateStatsResult

    found = update_bench.updates(2)
    assert isinstance(found, UpdateStatsResult)
    assert all(len(found.timing(m)) == 4 for m in UpdateStatsMode)  # two per block
    assert found.scalar_reads == 0
    assert 0 < found.persistent_bytes < found.parameter_bytes
    # the steady state was timed: the fused kernels (the step's, the first collect's weight
    # squares; the collect's section is summed on the host) compiled before the blocks
    assert (found.kernels_ready, found.kernels_failed) == (2, 0) and found.compile_seconds > 0
    assert found.profiled_scalar_reads == 0
    assert set(found.ops_per_step) == set(found.thread_ms) == set(UpdateStatsMode)
    assert "fused kernels: 2 compiled (0 failed)" in report._update_stats_section(found)
    # the floor arms: timed in the same blocks, their ratios and intervals in the section's text
    for name in ("the floor", "the arithmetic floor"):
        assert re.search(name + r" \([^)]*\): [+-][\d.]+% \(95% CI [+-][\d.]+% to [+-][\d.]+%\)",
                         report._update_stats_section(found)), name
    _header, rows = _rows(report.update_stats_table(found), "| step |")
    assert [r[0] for r in rows] == [m.value for m in UpdateStatsMode]
    for row in rows[1:]:  # with update stats, the floors
        assert re.fullmatch(r"\d+\.\d{3}x \([+-][\d.]+%, IQR [+-][\d.]+% to [+-][\d.]+%\)",
                            row[2])
    run = RunResults(command="x", rounds=(1, 1), updates=found)
    checks = [c for c in report.target_checks(run) if "update_stats" in c.subject]
    assert len(checks) == 2 and "<= +2%" in checks[0].subject and "<= +1%" in checks[1].subject
    assert checks[1].met  # 32 bytes per tensor, far under 1% of the parameters' bytes
    reads = [c for c in report.target_checks(run) if c.area == "host reads"]
    assert len(reads) == 1 and "update stats add to a warm step" in reads[0].subject
    assert reads[0].subject.endswith("<= 0 host reads") and reads[0].met
    text = report.miss_notes(run)
    assert all(c.met or c.subject in text for c in checks)


@pytest.mark.distributed
def test_quick_rank_timing_section() -> None:
    """The rank-timing section (what `make bench` runs) on 2 blocks: both kinds timed in every
    block, the added work measured from its parts, the counts (no collective on an ordinary
    collect, one on a carried one, no host read added) and the target rows judged."""
    from benchmarks import ranktiming_bench

    found = ranktiming_bench.measure(2)
    assert isinstance(found, ranktiming_bench.RankTimingResult)
    assert all(len(v) == 4 for v in found.step_times.values())  # two per block
    assert found.hook_calls > 0 and found.metered_seconds > 0 and found.added_pct > 0
    assert found.collectives_ordinary == found.collectives_ordinary_untimed == 0
    assert found.collectives_carried == 1
    assert found.host_reads == found.host_reads_untimed
    text = ranktiming_bench.text(found)
    _header, rows = _rows(text, "| step |")
    assert re.fullmatch(r"\d+\.\d{3}x \([+-][\d.]+%, IQR [+-][\d.]+% to [+-][\d.]+%\)",
                        rows[1][2])
    run = RunResults(command="x", rounds=(1, 1), rank_timing=found)
    checks = [c for c in report.target_checks(run) if "rank_timing" in c.subject]
    assert len(checks) == 3 and "<= +0.5%" in checks[0].subject
    assert checks[1].met and checks[2].met
    notes = report.miss_notes(run)
    assert all(c.met or c.subject in notes for c in checks)
    assert "which-rank-is-slow-rank-timing" in report.render(run)
