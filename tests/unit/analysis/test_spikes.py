"""Adaptive spike detection (gradwatch.analysis.spikes): the score against an independent median/MAD
reference, the synthetic stream, non-finite steps, the watcher's cost, the exported counters and
histograms between scrapes, history records and bad settings."""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from exposition import exposition_text
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from rich.console import Console
from torch import nn

import gradwatch
from gradwatch import GradWatch, WatchConfig
from gradwatch.analysis.spikes import (
    MAD_TO_SIGMA,
    MIN_LOG_SPREAD,
    SHIFT_RUN,
    SHIFT_SCORE,
    SpikeDetector,
    _kth_deviation,
    _kth_deviations,
)
from gradwatch.cli.endpoint import EndpointView, parse_exposition
from gradwatch.cli.plot import counts_text, render_history, spike_points
from gradwatch.cli.render import (
    NONFINITE_MARK,
    SPIKE_MARK,
    Trends,
    interval_point,
    render_view,
)
from gradwatch.doctor.testing import OpCounter, count_host_reads
from gradwatch.export.collector import SnapshotCollector
from gradwatch.export.metricdef import NORM_BUCKETS
from gradwatch.export.state import PublishedState, SelfStats
from gradwatch.snapshot import GroupStats, Snapshot
from scripts.gen_metrics_docs import metrics_reference_markdown, series_count

pytestmark = pytest.mark.timeout(120)


def snap(step: int, norm: float, **groups: float) -> Snapshot:
    return Snapshot(
        step=step,
        global_norm=norm,
        groups={g: GroupStats(norm=v, numel=1, tensors=1) for g, v in groups.items()},
    )


def reference_score(history: list[float], norm: float, window: int, warmup: int) -> float:
    """(ln(norm) - median) / max(1.4826 MAD, floor) over the last ``window`` usable norms,
    written with ``statistics`` independently of gradwatch.analysis.spikes."""
    logs = [math.log(v) for v in history if math.isfinite(v) and v > 0][-window:]
    if len(logs) < warmup or not (math.isfinite(norm) and norm > 0):
        return math.nan
    m = statistics.median(logs)
    mad = statistics.median([abs(x - m) for x in logs])
    return (math.log(norm) - m) / max(1.4826 * mad, 0.05)


def test_constants_are_the_documented_ones() -> None:
    assert pytest.approx(1 / statistics.NormalDist().inv_cdf(0.75), rel=1e-4) == MAD_TO_SIGMA
    assert MIN_LOG_SPREAD == 0.05


def test_scores_match_an_independent_median_mad_reference() -> None:
    rng = random.Random(7)
    window, warmup = 16, 5
    det = SpikeDetector(window, 6.0, warmup)
    history: list[float] = []
    for step in range(80):
        norm = math.exp(rng.gauss(1.0, 0.4))
        if step == 40:
            norm = 0.0  # a group without gradient: no sample, no score
        out = det.score(snap(step, norm, a=norm), order=step + 1)
        want = reference_score(history, norm, window, warmup)
        for got in (out.global_spike_score, out.spike_scores["a"]):
            assert got is not None
            if math.isnan(want):
                assert math.isnan(got), (step, got)
            else:
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12), step
        assert out.global_spike == (want > 6.0)
        history.append(norm)


def test_each_series_is_scored_by_its_own_window_when_norms_coincide() -> None:
    """Series scored together equal series scored alone, bit for bit, whether their windows
    are shared or not: ``b`` always has the global norm (one window for both), ``c`` until
    step 40 (shared, then its own copy), ``d`` but for a zero norm at step 25 (no sample:
    split there), ``a`` only on some steps and never at the first (its own window)."""
    rng = random.Random(11)
    window, warmup = 16, 5
    keys = ("g", "a", "b", "c", "d")
    together = SpikeDetector(window, 2.0, warmup)
    alone = {key: SpikeDetector(window, 2.0, warmup) for key in keys}
    shared = 0
    for step in range(90):
        g = math.exp(rng.gauss(1.0, 0.6))
        norms = {
            "g": g,
            "a": g if step % 3 else g * 1.7,
            "b": g,
            "c": g if step < 40 else g * math.exp(rng.gauss(0.0, 0.5)),
            "d": 0.0 if step == 25 else g,
        }
        if step == 30:
            norms = dict.fromkeys(keys, math.inf)  # a non-finite step: no sample for any
        groups = {k: v for k, v in norms.items() if k != "g"}
        out = together.score(snap(step, norms["g"], **groups), order=step + 1)
        for key in keys:
            got = out.global_spike_score if key == "g" else out.spike_scores[key]
            want = alone[key].score(snap(step, norms[key]), order=step + 1).global_spike_score
            assert got is not None and want is not None
            assert (math.isnan(got) and math.isnan(want)) or got == want, (step, key)
        shared += out.spike_scores["b"] == out.global_spike_score
    assert shared > 60  # the shared window was scored
    windows = together._windows
    assert windows["b"] is windows[None]  # still shared; the others split or never shared
    assert all(windows[k] is not windows[None] for k in ("a", "c", "d"))


def test_kth_deviations_are_the_sorted_absolute_deviations_exactly() -> None:
    """The selection of the MAD from the two sorted runs around the median, one order
    statistic or two adjacent ones, equals sorting ``|v - m|``, bit for bit (ties too)."""
    rng = random.Random(5)
    for _ in range(400):
        n = rng.choice([2, 3, 4, 7, 16, 127, 128])
        pool = [rng.gauss(0.0, 1.0) for _ in range(4)]
        s = sorted(rng.choice(pool) if rng.random() < 0.4 else rng.gauss(0.0, 1.0)
                   for _ in range(n))
        mid = n // 2
        m = s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
        want = sorted(abs(v - m) for v in s)
        for k in range(1, n):
            assert _kth_deviation(s, m, k) == want[k]
            assert _kth_deviations(s, m, k) == (want[k], want[k - 1])


def test_synthetic_stream_detects_every_injected_spike_with_few_false_alarms() -> None:
    """10,000 steps of log-normal norms with 20 injected 10x spikes: all 20 detected, no false
    alarm, with the defaults (window 128, threshold 6, warm-up 32), the level-shift rule on."""
    cfg = WatchConfig()
    rng = random.Random(20240611)
    spikes = set(rng.sample(range(cfg.spike_warmup, 10_000), 20))
    det = SpikeDetector(cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup)
    detected: set[int] = set()
    false_alarms = 0
    for step in range(10_000):
        norm = math.exp(rng.gauss(0.0, 0.3))  # sigma 0.3: a 10x spike is ~7.7 sigma
        group = math.exp(rng.gauss(-2.0, 0.3))
        if step in spikes:
            norm *= 10.0
            group *= 10.0
        out = det.score(snap(step, norm, body=group), order=step + 1)
        for flagged in (out.global_spike, "body" in out.spiking_groups):
            if flagged and step in spikes:
                detected.add(step)
            elif flagged:
                false_alarms += 1
    assert detected == spikes
    assert false_alarms == 0, false_alarms


@pytest.mark.parametrize(
    ("announced", "factor"), [(True, 1 / 30), (False, 1 / 30), (True, 30.0)]
)
def test_a_spike_after_a_level_change_is_found_without_false_spikes(
    announced: bool, factor: float
) -> None:
    """Defaults (window 128, threshold 6, warm-up 32): 200 steps at one level, then a 30x
    change of level at step 200 (announced: the isolated groups change, as set_isolated does
    at a stage boundary; or not announced), then a 10x spike 50 steps later. The spike is
    found, and the change itself flags nothing (a drop, or an announced rise)."""
    cfg = WatchConfig()
    for seed in range(5):
        rng = random.Random(seed)
        det = SpikeDetector(cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup)
        flagged: list[int] = []
        for step in range(400):
            level = 30.0 if step < 200 else 30.0 * factor
            norm = level * math.exp(rng.gauss(0.0, 0.2))
            if step == 250:
                norm *= 10.0
            isolated = ["stem"] if step < 200 or not announced else ["stem", "host"]
            one = snap(step, norm, body=norm).replace(
                isolation_violated=dict.fromkeys(isolated, False)
            )
            out = det.score(one, step + 1)
            if out.spike_step:
                flagged.append(step)
        assert flagged == [250], (seed, flagged)


def test_the_window_is_rebased_by_a_sustained_shift_only() -> None:
    """Isolated spikes never re-base the window; SHIFT_RUN samples beyond SHIFT_SCORE on one side
    do: the window then holds those samples only."""
    det = SpikeDetector(64, 6.0, 4)
    rng = random.Random(1)
    for step in range(40):
        det.score(snap(step, math.exp(rng.gauss(0.0, 0.1))), step + 1)
    window = det._windows[None]
    for step in range(40, 40 + SHIFT_RUN - 1):  # one short of a run: spikes, no re-base
        assert det.score(snap(step, 100.0), step + 1).global_spike
    assert len(window) == 40 + SHIFT_RUN - 1
    det.score(snap(99, 1.0), 100)  # back to normal: the run is broken
    for step in range(100, 100 + SHIFT_RUN):
        det.score(snap(step, 0.001 * math.exp(rng.gauss(0.0, 0.1))), step + 1)
    assert len(window) == SHIFT_RUN  # a sustained drop: a new baseline of its samples
    assert SHIFT_SCORE == 3.0 and SHIFT_RUN == 8


def test_a_nonfinite_step_is_no_sample_and_does_not_poison_the_window() -> None:
    rng = random.Random(3)
    norms = [math.exp(rng.gauss(0.0, 0.2)) for _ in range(60)]
    clean = SpikeDetector(32, 6.0, 8)
    dirty = SpikeDetector(32, 6.0, 8)
    order = 0
    for i, norm in enumerate(norms):
        order += 1
        want = clean.score(snap(i, norm, a=norm, b=norm), order)
        if i % 10 == 5 and i > 10:  # a NaN, an Inf and an AMP-skipped step before this one
            bad = snap(i, math.nan, a=math.nan, b=norm * 1e6)
            out = dirty.score(bad, order)
            assert out.global_spike_score is not None and math.isnan(out.global_spike_score)
            assert math.isnan(out.spike_scores["a"])
            assert not out.global_spike and "a" not in out.spiking_groups
            # the finite group of a non-finite step is scored, but enters no window
            assert out.spike_scores["b"] > 6.0 and "b" in out.spiking_groups
            dirty.score(snap(i, math.inf, a=math.inf, b=norm), order + 1)
            dirty.score(
                snap(i, norm, a=norm, b=norm).replace(amp_skipped=True, nonfinite_params=("x",)),
                order + 2,
            )
            order += 2
        got = dirty.score(snap(i, norm, a=norm, b=norm), order + 1)
        order += 1
        for key in ("a", "b"):
            w, g = want.spike_scores[key], got.spike_scores[key]
            assert (math.isnan(w) and math.isnan(g)) or w == g, (i, key, w, g)
        assert want.global_spike_score == got.global_spike_score or (
            math.isnan(want.global_spike_score or 0.0) and math.isnan(got.global_spike_score or 0.0)
        )


def test_warmup_threshold_zero_and_collect_order() -> None:
    det = SpikeDetector(8, 6.0, 4)
    for i in range(4):
        out = det.score(snap(i, 1.0), i + 1)
        assert out.global_spike_score is not None and math.isnan(out.global_spike_score)
    out = det.score(snap(4, 100.0), 5)  # warm now: floor spread 0.05, ln(100)/0.05 = 92
    assert out.global_spike and out.global_spike_score == pytest.approx(math.log(100) / 0.05)
    # A result materialized after a later one is scored, but does not enter the window.
    late = det.score(snap(2, 1e6), 3)
    assert late.global_spike
    after = det.score(snap(5, 1.0), 6)
    assert after.global_spike_score == pytest.approx(0.0)  # median 1.0: the 1e6 never entered
    off = SpikeDetector(8, 0.0, 4).score(snap(0, 1.0, a=2.0), 1)
    assert off.global_spike_score is None and dict(off.spike_scores) == {}
    assert not off.spike_step


def test_the_warning_names_group_score_norm_and_typical(caplog: pytest.LogCaptureFixture) -> None:
    det = SpikeDetector(16, 6.0, 4, rank=0)
    for i in range(8):
        det.score(snap(i, 2.0, seed=0.5), i + 1)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        out = det.score(snap(8, 2.0, seed=5.0), 9)
    assert out.spiking_groups == ("seed",) and not out.global_spike
    (record,) = [r for r in caplog.records if "spike" in r.getMessage()]
    text = record.getMessage()
    score = out.spike_scores["seed"]
    assert record.levelno == logging.WARNING
    assert "'seed'" in text and f"{score:.1f}" in text and "norm 5 " in text
    assert "typical norm 0.5 " in text and "step 8" in text


# -- the watcher: host-side only --------------------------------------------------------------


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


GROUPS = {"body": ["body.*"], "head": ["head.*"]}


def _grads(model: nn.Module, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 0.1 * scale


def test_collect_and_result_cost_no_op_or_host_read_for_spike_detection() -> None:
    """The same ops, host reads and collectives with spike detection on and off."""
    costs = []
    for threshold in (6.0, 0.0):
        torch.manual_seed(0)
        model = Two()
        cfg = WatchConfig(groups=GROUPS, spike_threshold=threshold, spike_warmup=2)
        with GradWatch(model, cfg) as watch:
            per_step = []
            for step in range(6):
                _grads(model, 10.0 if step == 5 else 1.0, step)
                with OpCounter() as collect_ops, count_host_reads() as collect_reads:
                    pending = watch.collect(step)
                with OpCounter() as result_ops, count_host_reads() as result_reads:
                    out = pending.result()
                per_step.append(
                    (
                        dict(collect_ops.ops),
                        sum(collect_reads.values()),
                        dict(result_ops.ops),
                        sum(result_reads.values()),
                    )
                )
            assert (out.global_spike_score is None) == (threshold == 0.0)
            if threshold:
                assert out.global_spike and set(out.spiking_groups) == {"body", "head"}
        costs.append(per_step)
    assert costs[0] == costs[1]


def test_watcher_snapshot_carries_scores_and_spiking_groups() -> None:
    torch.manual_seed(0)
    model = Two()
    cfg = WatchConfig(groups=GROUPS, spike_warmup=4, spike_window=16)
    history = []
    with GradWatch(model, cfg) as watch:
        for step in range(12):
            _grads(model, 1.0, step % 3)
            if step == 10:
                for p in model.head.parameters():
                    assert p.grad is not None
                    p.grad *= 10.0
            out = watch.collect(step).result()
            history.append(out)
    spike = history[10]
    assert spike.spiking_groups == ("head",)
    want = reference_score(
        [s.groups["head"].norm for s in history[:10]], spike.groups["head"].norm, 16, 4
    )
    assert spike.spike_scores["head"] == pytest.approx(want, rel=1e-9)
    assert [s.step for s in history if s.spike_step] == [10]


# -- the exporter: every published step counts ------------------------------------------------


def _scrape(state: PublishedState) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = exposition_text(state)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_counters_and_histograms_count_every_step_between_two_scrapes() -> None:
    cfg = WatchConfig(groups={"host": ["h.*"], "seed": ["s.*"]}, spike_warmup=4, spike_window=16)
    state = PublishedState(cfg)
    before = _scrape(state)
    # Counters and histograms are there, at 0, before the first step (increase() sees step 1).
    assert before["gradwatch_grad_norm_spikes_total"] == {
        (("group", "host"),): 0.0,
        (("group", "seed"),): 0.0,
    }
    assert before["gradwatch_global_grad_norm_spikes_total"] == {(): 0.0}
    assert before["gradwatch_nonfinite_group_steps_total"][(("group", "seed"),)] == 0.0
    assert before["gradwatch_grad_norm_per_step_count"][(("group", "host"),)] == 0.0
    assert "gradwatch_grad_norm_spike_score" not in before  # a gauge: absent until a step

    det = SpikeDetector(cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup)
    rng = random.Random(11)
    published: list[Snapshot] = []
    for step in range(40):
        host = math.exp(rng.gauss(0.0, 0.1))
        seed = math.exp(rng.gauss(-3.0, 0.1))
        if step in (20, 31):
            seed *= 10.0  # spikes between scrapes
        s = snap(step, math.hypot(host, seed), host=host, seed=seed)
        if step == 25:  # a NaN step in the seed group
            s = snap(step, math.nan, host=host, seed=math.nan).replace(nonfinite_params=("s.w",))
        if step == 27:  # an AMP-skipped step: not a non-finite step
            s = snap(step, math.inf, host=host, seed=math.inf).replace(
                nonfinite_params=("s.w",), amp_skipped=True
            )
        s = det.score(s, step + 1)
        published.append(s)
        state.write(s)
    after = _scrape(state)  # one scrape after 40 steps

    seed_spikes = sum("seed" in s.spiking_groups for s in published)
    assert seed_spikes == 2  # both injected spikes, nothing else
    assert after["gradwatch_grad_norm_spikes_total"][(("group", "seed"),)] == 2.0
    assert after["gradwatch_grad_norm_spikes_total"][(("group", "host"),)] == sum(
        "host" in s.spiking_groups for s in published
    )
    assert after["gradwatch_global_grad_norm_spikes_total"][()] == sum(
        s.global_spike for s in published
    )
    assert after["gradwatch_nonfinite_group_steps_total"] == {
        (("group", "host"),): 0.0,
        (("group", "seed"),): 1.0,  # step 25; the AMP-skipped step 27 is not counted
    }
    last = published[-1]
    assert after["gradwatch_grad_norm_spike_score"][(("group", "seed"),)] == pytest.approx(
        last.spike_scores["seed"]
    )
    # Histograms: every finite norm of every published step, cumulative, independently binned.
    for name, labels, norms in (
        (
            "gradwatch_grad_norm_per_step",
            (("group", "seed"),),
            [s.groups["seed"].norm for s in published],
        ),
        ("gradwatch_global_grad_norm_per_step", (), [s.global_norm for s in published]),
    ):
        finite = [v for v in norms if math.isfinite(v)]
        assert after[name + "_count"][labels] == len(finite) == 38
        assert after[name + "_sum"][labels] == pytest.approx(math.fsum(finite), rel=1e-12)
        buckets = {
            float(dict(k)["le"]): v
            for k, v in after[name + "_bucket"].items()
            if tuple(x for x in k if x[0] != "le") == labels
        }
        assert len(buckets) == len(NORM_BUCKETS) + 1
        for le, count in buckets.items():
            assert count == sum(v <= le for v in finite), (name, le)


def test_histogram_range_and_series_bound() -> None:
    assert NORM_BUCKETS[0] == 1e-6 and NORM_BUCKETS[-1] == 1e6
    ratios = [b / a for a, b in itertools.pairwise(NORM_BUCKETS)]
    assert all(2.9 < r < 3.4 for r in ratios), ratios  # two per decade, log-spaced
    assert series_count(10) < 500
    text = metrics_reference_markdown()
    assert f"holds {series_count(10)} series" in text


# -- history ------------------------------------------------------------------------------------


def test_history_records_keep_the_scores_and_old_records_still_load() -> None:
    s = snap(3, 2.0, a=1.0, b=math.nan).replace(
        global_spike_score=7.5,
        spike_scores={"a": 8.0, "b": math.nan},
        global_spike=True,
        spiking_groups=("a",),
    )
    back = Snapshot.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.global_spike_score == 7.5 and back.spiking_groups == ("a",)
    assert back.spike_scores["a"] == 8.0 and math.isnan(back.spike_scores["b"])
    assert back.global_spike and back.spike_step
    old = s.to_dict()
    for key in ("global_spike_score", "spike_scores", "global_spike", "spiking_groups"):
        del old[key]
    loaded = Snapshot.from_dict(old)
    assert loaded.global_spike_score is None and not loaded.spike_step
    assert dict(loaded.spike_scores) == {}


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"spike_threshold": -1.0}, "spike_threshold"),
        ({"spike_threshold": math.nan}, "spike_threshold"),
        ({"spike_threshold": math.inf}, "spike_threshold"),
        ({"spike_threshold": "abc"}, "spike_threshold"),
        ({"spike_window": 1}, "spike_window"),
        ({"spike_window": 10**6}, "spike_window"),
        ({"spike_window": 2.5}, "spike_window"),
        ({"spike_warmup": 0}, "spike_warmup"),
        ({"spike_warmup": 200}, "spike_warmup"),  # more than the default window of 128
        ({"spike_window": 16, "spike_warmup": 17}, "spike_warmup"),
    ],
)
def test_bad_spike_settings_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        WatchConfig(**kwargs)
    assert field in str(info.value)


def test_spike_threshold_zero_is_valid_and_disables() -> None:
    assert WatchConfig(spike_threshold=0).spike_threshold == 0.0


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [
        ("GRADWATCH_SPIKE_THRESHOLD", "abc", "spike_threshold"),
        ("GRADWATCH_SPIKE_THRESHOLD", "-2", "spike_threshold"),
        ("GRADWATCH_SPIKE_WINDOW", "1", "spike_window"),
        ("GRADWATCH_SPIKE_WARMUP", "500", "spike_warmup"),
    ],
)
def test_watch_reports_a_bad_spike_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(gradwatch.GradWatchError) as info:
        gradwatch.watch(nn.Linear(2, 2))
    message = str(info.value)
    assert message.count("\n") == 0, message
    assert field in message and f"{variable}={value!r}" in message, message
    assert "pydantic" not in message


def test_gradwatch_config_exits_2_on_a_bad_spike_threshold() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")}
    env["GRADWATCH_SPIKE_THRESHOLD"] = "abc"
    proc = subprocess.run(
        [sys.executable, "-m", "gradwatch.cli.main", "config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "spike_threshold" in proc.stderr and "GRADWATCH_SPIKE_THRESHOLD" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# -- gradwatch top and gradwatch plot -------------------------------------------------------------


def _view(state: PublishedState) -> EndpointView:
    stats = SelfStats()
    stats.set_collecting(True)
    registry = CollectorRegistry()
    registry.register(
        SnapshotCollector(
            state, stats, world_size=1, parallelism="single", run_id="run", start_time=0.0
        )
    )
    return parse_exposition(generate_latest(registry).decode())


def test_top_keeps_a_nan_and_a_spike_between_two_refreshes_in_the_trend() -> None:
    """Refreshes see steps 9, 19, 29: a NaN at 12 and a spike at 25 were never the last step,
    yet their points show them: ``!`` for the NaN interval, the spike's height and ``^``."""
    cfg = WatchConfig(groups={"host": ["h.*"], "seed": ["s.*"]}, spike_warmup=4, spike_window=16)
    state = PublishedState(cfg)
    det = SpikeDetector(cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup)
    trends = Trends()
    rng = random.Random(5)
    for step in range(30):
        host, seed = math.exp(rng.gauss(0.0, 0.05)), math.exp(rng.gauss(-3.0, 0.05))
        s = snap(step, math.hypot(host, seed), host=host, seed=seed)
        if step == 12:
            s = snap(step, math.nan, host=host, seed=math.nan).replace(nonfinite_params=("s.w",))
        if step == 25:
            s = snap(step, math.hypot(host, 10 * seed), host=host, seed=10 * seed)
        state.write(det.score(s, step + 1))
        if step % 10 == 9:
            trends.add(_view(state))
    seed_points = trends.get("group:seed")
    assert math.isfinite(seed_points[0]) and math.isnan(seed_points[1])  # the NaN at 12
    # the spike's norm, 10 * e^-3 ~ 0.5, lies in the (0.3, 1] bucket: at least 0.3 was seen,
    # while the last norm of that interval (step 29) is ~0.05
    assert seed_points[2] == 0.3
    assert trends.spikes("group:seed") == [False, False, True]
    assert trends.line("group:seed")[1:] == f"{NONFINITE_MARK}{SPIKE_MARK}"
    host_points = trends.get("group:host")
    assert all(math.isfinite(v) for v in host_points) and trends.spikes("group:host") == [
        False,
        False,
        False,
    ]
    assert math.isnan(trends.get("global")[1])  # the global norm was NaN at 12 too
    view = _view(state)
    assert view.groups["seed"].spikes == 1 and view.groups["seed"].nonfinite_steps == 1
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render_view(view, trends, now=0.0))
    text = out.getvalue()
    assert "spike steps: global 0, seed 1" in text and "spike score: global" in text


def test_interval_point_is_a_measured_lower_bound() -> None:
    before = ((1.0, 3.0), (3.0, 5.0), (10.0, 5.0), (math.inf, 5.0))
    after = ((1.0, 4.0), (3.0, 6.0), (10.0, 7.0), (math.inf, 7.0))  # one norm in (3, 10]
    assert interval_point(0.5, after, before, 0) == 3.0  # at least 3 was published
    assert interval_point(7.0, after, before, 0) == 7.0  # the last norm is larger: exact
    assert math.isnan(interval_point(0.5, after, before, 1) or 0.0)  # a NaN step in between
    assert interval_point(0.5, before, before, 0) == 0.5  # nothing new
    restarted = ((1.0, 1.0), (3.0, 1.0), (10.0, 1.0), (math.inf, 1.0))  # counts went down
    assert interval_point(0.5, restarted, before, 0) == 0.5  # only the first bucket: no floor


def test_plot_marks_spikes_on_the_norms(tmp_path: Path) -> None:
    det = SpikeDetector(16, 6.0, 4)
    records = []
    for step in range(30):
        seed = 0.1 * (10.0 if step == 20 else 1.0) * (1 + 0.01 * (step % 3))
        records.append(det.score(snap(step, 1.0, host=1.0, seed=seed), step + 1).to_dict())
    assert spike_points(records) == [(20, "seed", records[20]["groups"]["seed"]["norm"])]
    summary = render_history(json.loads(json.dumps(records)), tmp_path / "p.png")
    assert summary.events.spikes == [20] and summary.spike_steps == 1
    assert "1 spike step" in counts_text(summary.events)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_window_spread_is_the_sorted_deviations_median() -> None:
    """The MAD found by selection from the two sorted runs equals the median of the sorted
    deviations ``|v - m|`` (the textbook definition), bit for bit, on windows of every size
    with ties, repeats and evictions."""
    from gradwatch.analysis.spikes import MAD_TO_SIGMA, MIN_LOG_SPREAD, SpikeWindow

    rng = random.Random(11)
    for _ in range(3000):
        window = SpikeWindow(rng.randint(1, 40))
        for _ in range(rng.randint(1, 60)):
            window.add(rng.choice([rng.gauss(0.0, 1.0), float(rng.randint(-3, 3)), 0.5]))
            m = statistics.median(window._sorted)
            mad = statistics.median(sorted(abs(v - m) for v in window._sorted))
            assert window.center_spread() == (m, max(MAD_TO_SIGMA * mad, MIN_LOG_SPREAD))


def test_series_sharing_one_window_score_as_each_on_its_own() -> None:
    """The shared-window shortcut (every series the same norm, one window: a model whose one
    group is the whole model) gives the fields of the general scoring, step for step, through
    warm-up, spikes, level shifts, non-finite and zero norms, and a second group joining."""
    rng = random.Random(5)
    norms = [math.exp(rng.gauss(0.0, 0.05)) for _ in range(300)]
    norms[60] *= 40.0
    norms[90:] = [n * 30.0 for n in norms[90:]]
    norms[120], norms[121], norms[150] = math.nan, math.inf, 0.0
    shared, general = SpikeDetector(64, 6.0, 8), SpikeDetector(64, 6.0, 8)
    general._score_shared = lambda series, enters: None  # type: ignore[method-assign]
    taken: list[bool] = []
    score_shared = shared._score_shared

    def counted(series, enters):  # type: ignore[no-untyped-def]
        result = score_shared(series, enters)
        taken.append(result is not None)
        return result

    shared._score_shared = counted  # type: ignore[method-assign]
    spikes = 0
    for order, norm in enumerate(norms, start=1):
        groups = {"all": norm} if order < 200 else {"all": norm, "head": norm * 0.5}
        s = snap(order, norm, **groups)
        got = shared.fields(s, order)
        assert repr(got) == repr(general.fields(s, order)), order
        spikes += got["global_spike"]
    assert spikes >= 1
    assert sum(taken) > 150 and not all(taken)  # the shortcut, and the general scoring
