"""The per-rank view in ``gradwatch top`` (replica spread, outlier score, gradient noise scale)
and ``gradwatch plot`` (a panel of it, and the origin rank of a non-finite step): shown when
the endpoint or the history carries the view, and nothing at all (never zeros) when not."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from gradwatch import GroupStats, Snapshot, WatchConfig
from gradwatch.cli.endpoint import EndpointView, parse_exposition
from gradwatch.cli.render import Trends, noise_scale_text, replica_text
from gradwatch.cli.top import render_frame
from gradwatch.export.collector import SnapshotCollector
from gradwatch.export.state import PublishedState, SelfStats
from gradwatch.rankview import NOISE_SCALE_UNIT, REPLICA_OUTLIER_THRESHOLD

RULES = Path(__file__).parents[2] / "deploy" / "prometheus" / "gradwatch-rules.yml"


def snap(step: int, norm: float = 1.5, **view: Any) -> Snapshot:
    return Snapshot(
        step=step,
        global_norm=norm,
        groups={
            "w": GroupStats(norm=norm, numel=10, tensors=1),
            "b": GroupStats(norm=0.1, numel=2, tensors=1),
        },
        world_size=4,
        parallelism="ddp4",
        **view,
    )


#: What the per-rank view adds to a snapshot of 4 replicas, rank 3 fed a scaled batch.
VIEW: dict[str, Any] = {
    "rank_view": True,
    "nonfinite_origin_count": 0,
    "replica_grad_norm_min": 1.0,
    "replica_grad_norm_median": 1.1,
    "replica_grad_norm_max": 3.3,
    "replica_grad_norm_max_rank": 3,
    "replica_outlier_score": 2.0,
    "replica_outlier_rank": 3,
    "gradient_noise_scale": 1234.0,
    "group_noise_scale": {"w": 800.0, "b": math.nan},
}


def exposition(s: Snapshot) -> str:
    """The endpoint's text after publishing ``s`` (the real exporter's state and collector)."""
    state = PublishedState(WatchConfig(groups={"w": ["w*"], "b": ["b*"]}))
    state.write(s)
    stats = SelfStats()
    stats.set_collecting(True)
    registry = CollectorRegistry()
    registry.register(
        SnapshotCollector(
            state, stats, world_size=4, parallelism="ddp4", run_id="run", start_time=0.0
        )
    )
    return generate_latest(registry).decode()


def frame_text(view: EndpointView) -> str:
    trends = Trends()
    trends.add(view)
    out = io.StringIO()
    frame = render_frame("http://x/metrics", view, None, trends, refresh=1, interval=1.0, now=0.0)
    Console(file=out, width=220, color_system=None).print(frame)
    return out.getvalue()


# -- gradwatch top ------------------------------------------------------------------------------


def test_the_outlier_threshold_is_the_alert_rules() -> None:
    rules = {
        r["alert"]: r
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    expr = rules["GradwatchReplicaOutlier"]["expr"]
    assert expr == f"gradwatch_replica_outlier_score > {REPLICA_OUTLIER_THRESHOLD:g}"


def test_endpoint_view_reads_the_rank_view_gauges() -> None:
    view = parse_exposition(exposition(snap(7, **VIEW)))
    assert view.replica_norm == {"min": 1.0, "median": 1.1, "max": 3.3}
    assert view.replica_max_rank == 3 and view.replica_outlier_score == 2.0
    assert view.nonfinite_origin_ranks == 0
    assert view.noise_scale == 1234.0
    assert view.group_noise_scale["w"] == 800.0 and math.isnan(view.group_noise_scale["b"])
    assert set(view.groups) == {"w", "b"}  # the group noise scale makes no group of its own


def test_top_shows_the_replica_spread_outlier_and_noise_scale() -> None:
    text = frame_text(parse_exposition(exposition(snap(7, **VIEW))))
    for expected in (
        "replicas: local norm min 1 / median 1.1 / max 3.3, max at rank 3, outlier score 2 "
        f"(> {REPLICA_OUTLIER_THRESHOLD:g}: outlier replica)",
        f"gradient noise scale: model 1.23e+03, w 800, b nan  [{NOISE_SCALE_UNIT}]",
    ):
        assert expected in text, (expected, text)


def test_the_outlier_score_is_highlighted_above_the_threshold_only() -> None:
    def styles(score: float) -> set[str]:
        line = replica_text(EndpointView(step=1, replica_outlier_score=score))
        assert line is not None
        return {str(span.style) for span in line.spans}

    assert "bold red" in styles(REPLICA_OUTLIER_THRESHOLD * 1.5)
    assert "bold red" in styles(math.inf)  # a non-finite local norm
    assert "bold red" not in styles(REPLICA_OUTLIER_THRESHOLD)  # the rule is strictly above
    assert "bold red" not in styles(0.0)
    below = replica_text(EndpointView(step=1, replica_outlier_score=0.5))
    assert below is not None and below.plain == "replicas: outlier score 0.5"


def test_top_shows_nothing_of_the_view_without_it() -> None:
    """No per-rank view (FSDP2, rank_view off, one rank): the lines are absent, not zeros."""
    view = parse_exposition(exposition(snap(7)))
    assert view.replica_norm == {} and view.replica_max_rank is None
    assert view.replica_outlier_score is None and view.nonfinite_origin_ranks is None
    assert view.noise_scale is None and view.group_noise_scale == {}
    assert replica_text(view) is None and noise_scale_text(view) is None
    text = frame_text(view)
    assert "replicas" not in text and "outlier" not in text and "noise scale" not in text, text
    assert "step 7" in text  # the rest of the frame is drawn


def test_top_shows_the_part_of_the_view_the_endpoint_exports() -> None:
    """Above the slot world size the spread is absent while the noise scale is not."""
    partial = {**VIEW, "replica_grad_norm_min": None, "replica_grad_norm_median": None,
               "replica_grad_norm_max": None, "replica_grad_norm_max_rank": None,
               "replica_outlier_score": None, "group_noise_scale": {}}  # fmt: skip
    view = parse_exposition(exposition(snap(7, **partial)))
    assert replica_text(view) is None
    line = noise_scale_text(view)
    assert line is not None and line.plain.startswith("gradient noise scale: model 1.23e+03  [")
