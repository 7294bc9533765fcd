"""The norm auditor (gradwatch.analysis.audit, GradWatch.audit_norm): verdicts, diagnoses, metrics,
bad input and the absence of host reads on the training thread."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch
from exposition import parse
from pydantic import ValidationError
from torch import nn

from gradwatch import GradWatch, NoOpWatch, WatchConfig
from gradwatch.analysis.audit import (
    MAX_PENDING,
    NormAuditor,
    bf16_round,
    diagnose,
    parallel_factors,
)
from gradwatch.doctor.testing import OpCounter, count_host_reads


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(__import__("os").environ):
        if key.startswith("GRADWATCH_"):
            monkeypatch.delenv(key)


def model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model(torch.randn(8, 16)).pow(2).mean().backward()
    return model


def ref_norm(model: nn.Module) -> float:
    """Independent float64 reference: fsum of exact squares."""
    squares = (
        float(x) ** 2 for p in model.parameters() for x in p.grad.double().flatten().tolist()
    )
    return math.sqrt(math.fsum(squares))


def scrape_until(url: str, name: str, labels: tuple, want: float, timeout: float = 10.0) -> dict:
    """Scrape until ``name{labels}`` shows ``want`` (relative 1e-6; NaN matches NaN); returns
    the samples."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(url, timeout=5) as response:
            samples = parse(response.read().decode())
        got = samples.get(name, {}).get(labels)
        if got is not None and (
            math.isclose(got, want, rel_tol=1e-6) or (math.isnan(want) and math.isnan(got))
        ):
            return samples
        assert time.monotonic() < deadline, f"{name}{labels} is {got}, expected {want}"
        time.sleep(0.05)


TRAINER = (("source", "trainer"),)


# -- pure verdicts and diagnoses ---------------------------------------------------------------


def test_parallel_factors_from_descriptions() -> None:
    assert parallel_factors("single", 1) == {}
    assert parallel_factors("ddp2", 2) == {"world": 2, "replicas": 2}
    assert parallel_factors("fsdp2x4", 4) == {"world": 4, "shards": 4}
    assert parallel_factors("hsdp2x2", 4) == {"world": 4, "replicas": 2, "shards": 2}
    assert parallel_factors("fsdp2x2+tp2", 4) == {"world": 4, "shards": 2, "tp": 2}
    assert parallel_factors("zero3x4", 4) == {"world": 4, "shards": 4}  # DeepSpeed ZeRO-3
    assert parallel_factors("zero0x2", 2) == {"world": 2, "replicas": 2}


@pytest.mark.parametrize(
    ("ratio", "factors", "expect"),
    [
        (1 / math.sqrt(4), {"world": 4, "shards": 4}, "1/sqrt(4)"),
        (1 / math.sqrt(2), {"world": 4, "replicas": 2, "shards": 2}, "1/sqrt(2)"),
        (math.sqrt(2), {"world": 4, "shards": 2, "tp": 2}, "sqrt(2) (tp=2)"),
        (4.0, {"world": 8, "shards": 2, "tp": 4}, "matches 4 (tp=4)"),
        (2.0, {"world": 2, "replicas": 2}, "reduced twice"),
        (math.sqrt(2), {"world": 2, "replicas": 2}, "sqrt(2) (2 replicas)"),
        (4.0, {"world": 4, "replicas": 4}, "reduced twice"),
        (1.37, {"world": 2, "replicas": 2}, None),
        (0.5, {}, None),
        # a single process has no ranks to reduce over: no cross-rank cause is named
        (2.0, {}, None),
        (math.sqrt(2), {}, None),
    ],
)
def test_diagnose_known_failures(ratio: float, factors: dict, expect: str | None) -> None:
    got = diagnose(ratio, 3.0 * ratio, 3.0, factors, None)
    if expect is None:
        assert got is None
    else:
        assert got is not None and expect in got, got


def test_diagnose_local_norm_and_bf16() -> None:
    exact, local = 5.0, 3.3  # this rank's shard holds a part of the squares
    got = diagnose(local / exact, local, exact, {"world": 2, "shards": 2}, local)
    assert got is not None and "local norm" in got and "1/sqrt(2)" in got
    exact = 1.2345678
    rounded = bf16_round(exact)
    assert rounded != exact and abs(rounded - exact) <= exact * 2**-8
    got = diagnose(rounded / exact, rounded, exact, {}, None)
    assert got is not None and "bfloat16" in got
    # A bf16-accumulated norm (bf16 sums, not only the final rounding) is recognized too.
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    exact = math.sqrt(math.fsum(float(x) ** 2 for x in g.double().tolist()))
    in_bf16 = float(g.bfloat16().norm())
    got = diagnose(in_bf16 / exact, in_bf16, exact, {}, None)
    assert in_bf16 != exact and got is not None and "bfloat16" in got, (in_bf16, exact)
    assert diagnose(1.003, 1.003 * exact, exact, {}, None) is None  # not a bf16 value


def test_auditor_judges_only_known_steps_and_bounds_pending() -> None:
    auditor = NormAuditor(1e-3, {})
    auditor.report(1, "trainer", 2.0)
    auditor.report(2, "trainer", torch.tensor(4.0))
    assert auditor.judge(1, 2.0005, None)[0].agrees  # 2.5e-4 relative: within 1e-3
    (v,) = auditor.judge(2, 2.0, None)
    assert not v.agrees and v.ratio == 2.0 and v.kind == "unexplained"  # single process
    ddp = NormAuditor(1e-3, parallel_factors("ddp2", 2))
    ddp.report(2, "trainer", 4.0)
    (v,) = ddp.judge(2, 2.0, None)
    assert v.diagnosis is not None and "reduced twice" in v.diagnosis
    assert auditor.judge() == []
    for step in range(MAX_PENDING + 10):
        auditor.report(1000 + step, "trainer", 1.0)
    assert len(auditor._pending) == MAX_PENDING  # the oldest were dropped


@pytest.mark.parametrize(
    ("reported", "exact", "agrees"),
    [(math.nan, 1.0, False), (math.inf, 1.0, False), (math.nan, math.nan, True), (0.0, 0.0, True)],
)
def test_auditor_nonfinite_and_zero(reported: float, exact: float, agrees: bool) -> None:
    auditor = NormAuditor(1e-3, {})
    auditor.report(0, "trainer", reported)
    (v,) = auditor.judge(0, exact, None)
    assert v.agrees is agrees and math.isnan(v.ratio)


def test_an_inf_norm_from_a_float32_sum_of_squares_is_diagnosed_not_restated() -> None:
    """DeepSpeed's norm is inf where the exact one is 5.1e19: the float32 sum of squares
    overflowed (5.1e19^2 = 2.6e39 > float32's 3.4e38). The message names that cause instead
    of restating the two values it already prints."""
    grads = torch.full((4,), 2.55e19, dtype=torch.float32)  # finite float32 values
    exact = math.sqrt(math.fsum(float(x) ** 2 for x in grads.double()))
    in_fp32 = float(grads.pow(2).sum().sqrt())  # the reporter's float32 arithmetic
    assert math.isinf(in_fp32) and 5e19 < exact < 5.2e19
    auditor = NormAuditor(1e-3, parallel_factors("zero2x2", 2))
    auditor.report(0, "deepspeed", in_fp32)
    (v,) = auditor.judge(0, exact, None)
    message = v.message(1e-3)
    assert not v.agrees and v.diagnosis is not None
    assert "float32" in v.diagnosis and "the reported norm is inf while" not in message
    assert message.count("5.1") == 1  # the exact norm is stated once, in the values
    # below float32's square limit no such cause is claimed, but no restatement either
    auditor.report(1, "trainer", math.inf)
    (w,) = auditor.judge(1, 3.0, None)
    assert w.diagnosis is not None and "float32" not in w.diagnosis
    assert "inf while" not in w.diagnosis


# -- GradWatch.audit_norm ------------------------------------------------------------------------


def test_negative_tolerance_rejected_at_construction() -> None:
    with pytest.raises(ValidationError, match="audit_tolerance"):
        WatchConfig(audit_tolerance=-1e-3)
    with pytest.raises(ValidationError, match="audit_tolerance"):
        WatchConfig(audit_tolerance=math.nan)
    assert WatchConfig().audit_tolerance == 1e-3


def test_audit_of_a_correct_clip_agrees_and_exports_ratio_one() -> None:
    model = model_with_grads()
    ref = ref_norm(model)
    with GradWatch(model, WatchConfig(port=0)) as watch:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # torch's own, float32
        watch.collect(0)
        watch.audit_norm(total, step=0)
        assert watch.flush()
        samples = scrape_until(watch.metrics_url, "gradwatch_reported_norm_ratio", TRAINER, 1.0)
    ratio = samples["gradwatch_reported_norm_ratio"][TRAINER]
    assert abs(ratio - float(total) / ref) <= 1e-6
    assert samples["gradwatch_norm_audit_disagreements_total"][TRAINER] == 0.0


def test_audit_counts_a_2x_norm_and_logs_it_once_without_a_cross_rank_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = model_with_grads()
    ref = ref_norm(model)
    with (
        caplog.at_level(logging.WARNING, logger="gradwatch"),
        GradWatch(model, WatchConfig(port=0)) as watch,
    ):
        for step in range(3):
            watch.collect(step)
            watch.audit_norm(2.0 * ref, step=step, source="my_clip")  # a float
        assert watch.flush()
        labels = (("source", "my_clip"),)
        samples = scrape_until(watch.metrics_url, "gradwatch_norm_audit_disagreements_total",
                               labels, 3.0)  # fmt: skip
        assert samples["gradwatch_reported_norm_ratio"][labels] == pytest.approx(2.0, rel=1e-6)
    logs = [r.getMessage() for r in caplog.records if "my_clip" in r.getMessage()]
    # One process: nothing was reduced, so no "reduced twice" (nor any cross-rank) diagnosis.
    assert len(logs) == 1 and "ratio 2" in logs[0], logs
    assert "likely cause" not in logs[0], logs


def test_audit_nonfinite_and_unreadable_values_count_and_never_raise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = model_with_grads()
    with (
        caplog.at_level(logging.WARNING, logger="gradwatch"),
        GradWatch(model, WatchConfig(port=0)) as watch,
    ):
        watch.collect(0)
        watch.audit_norm(math.nan, step=0)
        watch.audit_norm(torch.tensor(math.inf), step=0)
        # A tensor on another device: held, never read on the training thread (a meta tensor
        # cannot be read at all: counted as an unreadable report).
        watch.audit_norm(torch.empty((), device="meta"), step=0, source="meta")
        watch.audit_norm(torch.ones(3), step=0, source="vector")
        assert watch.flush()
        scrape_until(watch.metrics_url, "gradwatch_norm_audit_disagreements_total", TRAINER, 2.0)
        samples = scrape_until(watch.metrics_url, "gradwatch_norm_audit_disagreements_total",
                               (("source", "vector"),), 1.0)  # fmt: skip
        assert math.isnan(samples["gradwatch_reported_norm_ratio"][TRAINER])
        assert samples["gradwatch_norm_audit_disagreements_total"][(("source", "meta"),)] == 1.0
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "reported nan" in text and "could not be read" in text and "3 elements" in text


def test_audit_norm_reads_nothing_on_the_training_thread() -> None:
    """audit_norm queues the value: no dispatched op, no host read, no collective."""
    model = model_with_grads()
    with GradWatch(model, WatchConfig()) as watch:
        pending = watch.collect(0)
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        elsewhere = torch.empty((), device="meta")  # stands for a tensor on another device
        with OpCounter() as counter, count_host_reads() as reads:
            watch.audit_norm(total, step=0)
            watch.audit_norm(elsewhere, step=0, source="meta")
            watch.audit_norm(1.0, source="default_step")
        assert counter.total == 0 and counter.collectives == 0 and sum(reads.values()) == 0
        pending.result()  # judged here, where the step materializes


def test_audit_reported_after_the_step_was_built_is_judged_at_flush() -> None:
    model = model_with_grads()
    ref = ref_norm(model)
    with GradWatch(model, WatchConfig(port=0)) as watch:
        watch.collect(5).result()
        watch.audit_norm(ref * (1 + 1e-2), step=5)  # beyond the 1e-3 tolerance
        assert watch.flush()
        samples = scrape_until(watch.metrics_url, "gradwatch_norm_audit_disagreements_total",
                               TRAINER, 1.0)  # fmt: skip
        assert samples["gradwatch_reported_norm_ratio"][TRAINER] == pytest.approx(1.01, rel=1e-6)


def test_audit_tolerance_is_configurable() -> None:
    model = model_with_grads()
    ref = ref_norm(model)
    with GradWatch(model, WatchConfig(port=0, audit_tolerance=0.05)) as watch:
        watch.collect(0)
        watch.audit_norm(ref * 1.01, step=0)
        assert watch.flush()
        samples = scrape_until(watch.metrics_url, "gradwatch_reported_norm_ratio", TRAINER,
                               float(ref * 1.01 / watch.last.global_norm))  # fmt: skip
        assert samples["gradwatch_norm_audit_disagreements_total"][TRAINER] == 0.0


def test_noop_and_disabled_watchers_accept_audit_norm() -> None:
    model = model_with_grads()
    NoOpWatch(model).audit_norm(1.0, step=0, source="trainer")
    watch = GradWatch(model, WatchConfig(enabled=False))
    watch.audit_norm(torch.tensor(1.0), step=0)
    watch.close()


def test_audit_sources_are_bounded() -> None:
    """User-given source labels cannot grow the series without bound."""
    from gradwatch.export.metricdef import MAX_AUDIT_SOURCES
    from gradwatch.export.metrics import NORM_AUDIT_DISAGREEMENTS_TOTAL, REPORTED_NORM_RATIO
    from gradwatch.export.state import SelfStats

    stats = SelfStats()
    for i in range(MAX_AUDIT_SOURCES + 5):
        stats.add_audit(f"s{i}", 1.0, i % 2 == 0)
    samples = stats.view().samples()
    assert len(samples[REPORTED_NORM_RATIO]) == MAX_AUDIT_SOURCES
    counts = dict(samples[NORM_AUDIT_DISAGREEMENTS_TOTAL])
    assert counts[("s1",)] == 1.0 and counts[("s0",)] == 0.0


def test_collect_costs_the_same_with_auditing() -> None:
    """Auditing adds no op, host read or collective to collect(): the same dispatched ops
    before and after the first audit_norm."""
    model = model_with_grads()
    with GradWatch(model, WatchConfig()) as watch:
        watch.collect(0).result()  # warm-up: the norm plan is built once
        counts = []
        for step in (1, 2):
            with OpCounter() as counter, count_host_reads() as reads:
                watch.collect(step)
                if step == 1:
                    watch.audit_norm(1.0, step=step)
            counts.append((dict(counter.ops), counter.scalar_reads, sum(reads.values())))
        # (collect's own host reads are its CPU repair check, the same with or without audits)
        assert counts[0] == counts[1] and counts[0][1] == 0


# -- this rank's local squares: read on the host only ------------------------------------------


def test_local_squares_on_the_cpu_are_held_and_read_when_judged() -> None:
    from gradwatch.analysis.audit import LocalSquares
    from gradwatch.reduce.collective import LandedFlag

    sq = torch.tensor([9.0, 16.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    held = LocalSquares.of(sq, auditing=False)
    assert held is not None and held.norm() == 5.0  # no op at collect time, read when judged
    # An accelerator copy not landed yet: no local diagnosis, and nothing waits for it.
    pending = LandedFlag()
    copy = LocalSquares(torch.tensor([25.0, 0.0, 0.0], dtype=torch.float64), pending)
    assert copy.norm() is None
    pending.set()
    assert math.isclose(copy.norm() or 0.0, 5.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_local_squares_reach_pinned_memory_without_a_sync() -> None:
    from gradwatch.analysis.audit import LocalSquares

    sq = torch.tensor([9.0, 16.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, device="cuda")
    assert LocalSquares.of(sq, auditing=False) is None  # nothing reported: no copy at all
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        local = LocalSquares.of(sq, auditing=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert local is not None and local._host.is_pinned()
    local._landed.wait(10.0)  # type: ignore[union-attr]
    assert local.norm() == 5.0
