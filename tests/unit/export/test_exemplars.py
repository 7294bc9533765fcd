"""OpenMetrics exemplars on the counters the catalog marks (``EXEMPLAR_COUNTERS``): each series
carries the step that last increased it (and the non-finite origin rank when the per-rank view
knows it); the Prometheus text format shows none. The live check against a real Prometheus
with exemplar storage is tests/e2e/test_discovery_e2e.py."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as generate_text
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from gradwatch.config import WatchConfig
from gradwatch.export.collector import SnapshotCollector
from gradwatch.export.metrics import EXEMPLAR_COUNTERS, METRICS, MetricSource
from gradwatch.export.state import PublishedState, SelfStats
from gradwatch.snapshot import GroupStats, Snapshot

MARKED = {
    "gradwatch_nonfinite_steps_total",
    "gradwatch_amp_skipped_steps_total",
    "gradwatch_global_grad_norm_spikes_total",
    "gradwatch_grad_norm_spikes_total",
    "gradwatch_nonfinite_group_steps_total",
}


def registry(state: PublishedState) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(
        SnapshotCollector(
            state, SelfStats(), world_size=4, parallelism="ddp4", run_id="r", start_time=0.0
        )
    )
    return reg


def exemplars(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], object]:
    text = generate_openmetrics(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.exemplar
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.exemplar is not None
    }


def finite(step: int, **kw: object) -> Snapshot:
    return Snapshot(
        step=step,
        global_norm=1.0,
        groups={"a": GroupStats(1.0, 1, 1)},
        timestamp=100.0 + step,
        **kw,
    )


def nonfinite(step: int, **kw: object) -> Snapshot:
    return Snapshot(
        step=step,
        global_norm=math.nan,
        groups={"a": GroupStats(math.nan, 1, 1, 0, 1, 1), "b": GroupStats(1.0, 1, 1)},
        nonfinite_params=("a.w",),
        timestamp=100.0 + step,
        **kw,
    )


def test_the_catalog_marks_the_event_counters_only() -> None:
    names = {d.name for d in METRICS}
    marked = {d.name for d in METRICS if d.exemplar}
    # the guard's skipped-step counter, where the optimizer-step guard exists
    assert marked == MARKED | (EXEMPLAR_COUNTERS & names & {"gradwatch_skipped_steps_total"})
    assert EXEMPLAR_COUNTERS - names <= {"gradwatch_skipped_steps_total"}
    for d in METRICS:
        if d.exemplar:
            assert d.type == "counter" and d.source is MetricSource.COUNTS, d.name


def test_a_nonfinite_step_names_its_step_and_origin_rank() -> None:
    state = PublishedState(WatchConfig(groups={"a": ["a*"], "b": ["b*"]}))
    state.write(finite(3))
    reg = registry(state)
    assert exemplars(reg) == {}  # nothing happened yet: no exemplar
    state.write(
        nonfinite(7, rank_view=True, nonfinite_origin_ranks=(3, 1), nonfinite_origin_count=2)
    )
    state.write(finite(8))  # a later quiet step keeps the exemplar of the event
    got = exemplars(reg)
    assert set(got) == {
        ("gradwatch_nonfinite_steps_total", ()),
        ("gradwatch_nonfinite_group_steps_total", (("group", "a"),)),
    }
    for ex in got.values():
        assert ex.labels == {"step": "7", "origin_rank": "1"}
        assert ex.value == 1.0 and float(ex.timestamp) == 107.0
    # The text format (0.0.4) has no exemplars.
    assert "# {" not in generate_text(reg).decode()


def test_every_marked_counter_gets_the_step_that_increased_it() -> None:
    state = PublishedState(WatchConfig(groups={"a": ["a*"], "b": ["b*"]}))
    state.write(nonfinite(1))  # no per-rank view: no origin_rank
    state.write(finite(2, amp_skipped=True))
    state.write(finite(4, global_spike=True, spiking_groups=("a",)))
    got = exemplars(registry(state))
    labels = {key: ex.labels for key, ex in got.items()}
    assert labels == {
        ("gradwatch_nonfinite_steps_total", ()): {"step": "1"},
        ("gradwatch_nonfinite_group_steps_total", (("group", "a"),)): {"step": "1"},
        ("gradwatch_amp_skipped_steps_total", ()): {"step": "2"},
        ("gradwatch_global_grad_norm_spikes_total", ()): {"step": "4"},
        ("gradwatch_grad_norm_spikes_total", (("group", "a"),)): {"step": "4"},
    }
