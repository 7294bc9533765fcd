"""What each configuration cannot measure, walked over the whole metric catalog.

One short run per configuration (single process, DDP, DDP with the per-rank view, FSDP2,
disabled) records which catalog metrics the real endpoint shows, the last snapshot, the history
file's last record and a tracker row (:class:`gradwatch.sinks.StepScalars`); the tests compare
them with :data:`EXPECTED_ABSENT`. Workers for the distributed configurations are here too.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from logs import Capture
from prometheus_client.parser import text_string_to_metric_families
from promserver import http_get
from torch import nn

from gradwatch.export.metrics import METRICS

#: Absent in every configuration of these runs: no isolated group, nothing clipped through
#: gradwatch, no per-parameter series, no non-finite step, no guard, no audited norm, no
#: ``update_stats`` (``gradwatch_skipped_steps_total`` is present: its ``amp_overflow`` reason
#: counts every published snapshot).
ABSENT_IN_THESE_RUNS = frozenset({
    "gradwatch_isolation_violated",
    "gradwatch_isolation_violations_total",
    "gradwatch_clip_coef",
    "gradwatch_param_grad_norm",
    "gradwatch_last_nonfinite_origin",
    "gradwatch_consecutive_skipped_steps",
    "gradwatch_guard_stopped",
    "gradwatch_guard_score",
    "gradwatch_adaptive_clip_threshold",  # no clip_grad_norm_("auto")
    "gradwatch_reported_norm_ratio",
    "gradwatch_norm_audit_disagreements_total",
    "gradwatch_weight_norm",
    "gradwatch_update_norm",
    "gradwatch_update_ratio",
    "gradwatch_stalled_update_fraction",
})

#: Series of the sinks (``observe`` adds one, so they are present in its runs): absent without.
SINK_SERIES = frozenset({"gradwatch_sink_errors_total", "gradwatch_sink_dropped_steps_total"})

#: Measured by the per-rank view only.
RANK_VIEW = frozenset({
    "gradwatch_nonfinite_origin_ranks",
    "gradwatch_replica_grad_norm",
    "gradwatch_replica_grad_norm_max_rank",
    "gradwatch_replica_outlier_score",
    "gradwatch_gradient_noise_scale",
    "gradwatch_group_gradient_noise_scale",
})

DIVERGENCE = frozenset({"gradwatch_replica_divergence"})

#: Measured with rank timing only (off by default; see test_stragglers_distributed.py).
RANK_TIMING = frozenset({
    "gradwatch_slowest_rank",
    "gradwatch_straggler_score",
    "gradwatch_rank_work_seconds",
})

#: Configuration -> the catalog metrics its endpoint must not show.
EXPECTED_ABSENT: dict[str, frozenset[str]] = {
    "single": ABSENT_IN_THESE_RUNS | RANK_VIEW | DIVERGENCE | RANK_TIMING,
    "ddp": ABSENT_IN_THESE_RUNS | RANK_VIEW | RANK_TIMING,
    "ddp_rank_view": ABSENT_IN_THESE_RUNS | RANK_TIMING,
    "fsdp2": ABSENT_IN_THESE_RUNS | RANK_VIEW | DIVERGENCE | RANK_TIMING,
    "disabled": frozenset(m.name for m in METRICS),
}

#: Snapshot fields that are None where the endpoint has no sample, by metric.
SNAPSHOT_FIELD = {
    "gradwatch_replica_divergence": "replica_divergence",
    "gradwatch_gradient_noise_scale": "gradient_noise_scale",
    "gradwatch_replica_outlier_score": "replica_outlier_score",
    "gradwatch_replica_grad_norm_max_rank": "replica_grad_norm_max_rank",
    "gradwatch_slowest_rank": "slowest_rank",
    "gradwatch_straggler_score": "straggler_score",
    "gradwatch_rank_work_seconds": "work_seconds_max",
}

STEPS = 3


def catalog_names_with_samples(text: str) -> set[str]:
    """Catalog metrics with at least one sample in an exposition."""
    known = {m.name for m in METRICS}
    out: set[str] = set()
    for family in text_string_to_metric_families(text):
        name = family.name if family.name in known else f"{family.name}_total"
        if name in known and family.samples:
            out.add(name)
        elif family.name + "_info" in known and family.samples:
            out.add(family.name + "_info")
    return out


class RowSink:
    """A tracker stand-in: the row :class:`StepScalars` gives for every published snapshot."""

    action = "record the row of"

    def __init__(self, config: Any) -> None:
        from gradwatch.sinks import StepScalars

        self._scalars = StepScalars(config)
        self.rows: list[dict[str, float]] = []

    def write(self, snapshot: Any) -> None:
        self.rows.append(dict(self._scalars(snapshot)))


def observe(watch: Any, model: nn.Module, batch: torch.Tensor, history: Path | None) -> dict:
    """Train ``STEPS`` steps under ``watch``; what the endpoint, snapshot, history and a tracker
    row of the last step hold (rank 0; other ranks only train)."""
    sink = RowSink(watch.config)
    watch.add_sink(sink)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    snap = None
    for step in range(STEPS):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        snap = watch.collect(step).result()
        opt.step()
    assert snap is not None
    watch.flush(30)
    out: dict[str, Any] = {"fields": {f: getattr(snap, f) for f in SNAPSHOT_FIELD.values()}}
    url = watch.metrics_url
    out["present"] = sorted(_scrape_last(url, STEPS - 1)) if url else []
    out["row_tags"] = sorted(sink.rows[-1]) if sink.rows else []
    if history is not None and history.exists():
        lines = history.read_text().splitlines()
        out["history"] = json.loads(lines[-1]) if lines else {}
    return out


def _scrape_last(url: str, step: int, timeout: float = 30.0) -> set[str]:
    """The catalog metrics of the first scrape that shows ``step`` (renders lag by <= 0.1 s)."""
    deadline = time.monotonic() + timeout
    while True:
        text = http_get(url)
        for family in text_string_to_metric_families(text):
            shown = family.samples[0].value if family.samples else None
            if family.name == "gradwatch_step" and shown == step:
                return catalog_names_with_samples(text)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the endpoint never showed step {step}")
        time.sleep(0.1)


def scrape_catalog(url: str, timeout: float = 30.0) -> set[str]:
    """The catalog metrics of the first scrape that answers (a refused watcher's endpoint)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return catalog_names_with_samples(http_get(url))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def nan_or_none(value: Any) -> bool:
    """Not a measurement: None, or NaN."""
    return value is None or (isinstance(value, float) and math.isnan(value))


# -- the distributed configurations (2 gloo ranks) --------------------------------------------


def _dist_config(**overrides: Any) -> Any:
    from gradwatch import WatchConfig

    base: dict[str, Any] = {
        "groups": {"first": ["0.*"], "last": ["2.*"]},
        "ratios": [("last", "first")],
        "port": 0,
        "collective_timeout_seconds": 60,
    }
    base.update(overrides)
    return WatchConfig(**base)


def _dist_case(wrap: str, **cfg: Any) -> Any:
    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch

        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        if wrap == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        elif wrap == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            fully_shard(model[0])
            fully_shard(model[2])
            fully_shard(model)
        torch.manual_seed(100 + rank)  # different data per replica: a noise scale to measure
        with Capture() as logged, GradWatch(model, _dist_config(**cfg)) as watch:
            seen = observe(watch, model, torch.randn(8, 4), None)
            seen["parallelism"] = watch.parallelism
            if wrap == "ddp":  # then a step without gradient and a NaN step, built on every rank
                model.zero_grad(set_to_none=True)
                watch.collect(STEPS).result()
                model(torch.randn(8, 4)).sum().backward()
                for p in model.parameters():
                    p.grad.fill_(math.nan)
                watch.collect(STEPS + 1).result()
        seen["warnings"] = logged.lines
        return seen

    return run


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    from dist_cases import run_suite

    cases = [
        ("ddp", _dist_case("ddp")),
        ("ddp_rank_view", _dist_case("ddp", rank_view=True)),
        ("fsdp2", _dist_case("fsdp2")),
    ]
    run_suite(rank, world, port, out, cases)
