"""Absent, not zero: what a configuration cannot measure has no sample on the endpoint, no value
in a tracker row, and is NaN or None in the snapshot and the history file; a step without any
gradient is its own state. The catalog walk of the distributed configurations is in
tests/distributed/test_absent_distributed.py (same expectations, tests/helpers/absent_cases.py).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from absent_cases import (
    EXPECTED_ABSENT,
    SNAPSHOT_FIELD,
    catalog_names_with_samples,
    nan_or_none,
    observe,
)
from promserver import http_get, wait_for
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.export.metrics import METRICS


def _config(**overrides: object) -> WatchConfig:
    base: dict[str, object] = {
        "groups": {"first": ["0.*"], "last": ["2.*"]},
        "ratios": [("last", "first")],
        "isolated": [],
        "port": 0,
    }
    base.update(overrides)
    return WatchConfig(**base)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def test_every_metric_states_when_it_is_absent() -> None:
    for d in METRICS:
        assert d.absent.strip(), f"{d.name}: MetricDef.absent is empty"


@pytest.mark.parametrize("name", ["single", "disabled"])
def test_catalog_walk_single_process_and_disabled(name: str, tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    cfg = _config(history_path=history, enabled=name != "disabled")
    model = _model()
    with GradWatch(model, cfg) as watch:
        seen = observe(watch, model, torch.randn(8, 4), history)
    catalog = {m.name for m in METRICS}
    absent = catalog - set(seen["present"])
    assert absent == EXPECTED_ABSENT[name]
    for metric, field in SNAPSHOT_FIELD.items():
        if metric in absent:
            assert nan_or_none(seen["fields"][field]), (metric, seen["fields"][field])
            if "history" in seen:
                assert seen["history"][field] is None, field
            tag = "gradwatch/" + metric.removeprefix("gradwatch_")
            assert tag not in seen["row_tags"], tag
    if name == "single":
        assert seen["history"]["replica_divergence"] is None
        assert "gradwatch/replica_divergence" not in seen["row_tags"]
        assert "gradwatch/global_grad_norm" in seen["row_tags"]  # the row is not empty
    else:
        assert not seen["row_tags"] and "history" not in seen  # disabled: nothing written


def test_step_without_any_gradient_is_its_own_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """collect() before backward() after zero_grad(set_to_none=True): NaN norms and health,
    logged once, counted on the endpoint; a step with gradients afterwards is measured."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    history = tmp_path / "h.jsonl"
    cfg = _config(history_path=history, isolated=["first"])
    with caplog.at_level(logging.WARNING, logger="gradwatch"), GradWatch(model, cfg) as watch:
        empty = []
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            empty.append(watch.collect(step).result())  # before backward
        model(torch.randn(8, 4)).sum().backward()
        measured = watch.collect(2).result()
        watch.flush(30)
        url = watch.metrics_url
        assert url is not None

        def scraped() -> str | None:
            text = http_get(url)
            return text if "gradwatch_step 2.0" in text else None

        text = wait_for(scraped, 30, "step 2 on the endpoint")
    for snap in empty:
        assert snap.no_gradient and snap.measured
        assert math.isnan(snap.global_norm) and math.isnan(snap.health)
        assert all(math.isnan(g.norm) for g in snap.groups.values())
        assert math.isnan(snap.ratios["last/first"])
        assert snap.isolation_violated == {"first": False}  # measured: no gradient arrived
        assert not snap.nonfinite_step  # no NaN gradient: nothing was there
    assert not measured.no_gradient and measured.global_norm > 0 and 0 <= measured.health <= 1
    warnings = [r for r in caplog.records if "no parameter has a gradient" in r.getMessage()]
    assert len(warnings) == 1 and "step 0" in warnings[0].getMessage()
    assert "gradwatch_no_gradient_steps_total 2.0" in text
    assert "gradwatch_nonfinite_steps_total 0.0" in text  # not counted as a NaN gradient
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert [r["no_gradient"] for r in records] == [True, True, False]
    assert records[0]["health"] == "NaN" and records[0]["global_norm"] == "NaN"


def test_catalog_names_parse_counters_and_info() -> None:
    text = (
        "# TYPE gradwatch_collections counter\ngradwatch_collections_total 1.0\n"
        "# TYPE gradwatch_build info\ngradwatch_build_info{version=\"1\"} 1.0\n"
        "# TYPE gradwatch_step gauge\n"
    )
    assert catalog_names_with_samples(text) == {
        "gradwatch_collections_total",
        "gradwatch_build_info",
    }


def test_catalog_walk_refused_watcher() -> None:
    """A refused setup serves no per-step figure (nothing measured) but the counters at 0, the
    exporter's own series, gradwatch_collecting 0 and the info metrics."""
    from absent_cases import ABSENT_IN_THESE_RUNS, SINK_SERIES, scrape_catalog

    from gradwatch.export.metricdef import MetricSource
    from gradwatch.watcher import RefusedWatch

    refused = RefusedWatch(_model(), _config(), RuntimeError("unsupported parallelism"))
    try:
        assert refused.metrics_url is not None
        present = scrape_catalog(refused.metrics_url)
    finally:
        refused.close()
    per_step = {m.name for m in METRICS if m.source is MetricSource.SNAPSHOT}
    assert {m.name for m in METRICS} - present == per_step | ABSENT_IN_THESE_RUNS | SINK_SERIES
    assert "gradwatch_collecting" in present and "gradwatch_collections_total" in present
