"""The per-rank view in ``gradwatch top`` (replica spread, outlier score, gradient noise scale)
and ``gradwatch plot`` (a panel of it, and the origin rank of a non-finite step): shown when
the endpoint or the history carries the view, and nothing at all (never zeros) when not."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from exposition import exposition_text
from rich.console import Console

from gradwatch import GroupStats, Snapshot, WatchConfig
from gradwatch.analysis.rankview import NOISE_SCALE_UNIT, REPLICA_OUTLIER_THRESHOLD
from gradwatch.cli.endpoint import EndpointView, parse_exposition
from gradwatch.cli.render import Trends, noise_scale_text, replica_text
from gradwatch.cli.top import render_frame
from gradwatch.export.state import PublishedState

RULES = Path(__file__).parents[3] / "deploy" / "prometheus" / "gradwatch-rules.yml"


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
    return exposition_text(state, world_size=4, parallelism="ddp4")


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
        f"gradient noise scale: model 1.23e+03, w 800, b undefined  [{NOISE_SCALE_UNIT}]",
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


# -- gradwatch plot -----------------------------------------------------------------------------

NAN_AT = 12
STEPS = 30


def median_at(step: int) -> float:
    return 1.0 + 0.05 * step


def view_records() -> list[dict[str, Any]]:
    """A DDP history with the view: rank 1 fed a NaN at NAN_AT (the view names it), rank 3 an
    outlier from step 20; as read back from a history file (through JSON)."""
    out = []
    for i in range(STEPS):
        bad = i == NAN_AT
        s = snap(i, math.nan if bad else 1.5, **{
            **VIEW,
            "nonfinite_params": ("w",) if bad else (),
            "nonfinite_origin_ranks": (1,) if bad else (),
            "nonfinite_origin_count": 1 if bad else 0,
            "replica_grad_norm_min": 0.9 * median_at(i),
            "replica_grad_norm_median": median_at(i),
            "replica_grad_norm_max": (3.0 if i >= 20 else 1.1) * median_at(i),
            "gradient_noise_scale": 100.0 + i,
            "group_noise_scale": {"w": 50.0 + i, "b": math.nan},
        })  # fmt: skip
        out.append(json.loads(json.dumps(s.to_dict())))
    return out


def labelled(ax: Any) -> dict[str, list[float]]:
    """The y data of each labelled line of ``ax``."""
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
            if not line.get_label().startswith("_")}  # fmt: skip


def test_plot_draws_the_rank_view_panels_and_names_the_origin(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import PANELS, draw_history, render_history
    from gradwatch.cli.plot_updates import UPDATE_PANELS

    panels = tuple(p for p in PANELS if p not in UPDATE_PANELS)  # no update_stats here
    records = view_records()
    fig, summary = draw_history(records, width=8, height=8, dpi=40)
    assert summary.panels == panels
    norms, _, replicas, noise, health = fig.axes[: len(panels)]
    assert [ax.get_ylabel() for ax in (replicas, noise, health)] == [
        "replica local norm", "noise scale", "health",
    ]  # fmt: skip
    lines = labelled(replicas)
    assert lines["median"] == pytest.approx([median_at(i) for i in range(STEPS)])
    assert lines["max"][25] == pytest.approx(3.0 * median_at(25))
    assert replicas.get_yscale() == "log" and noise.get_yscale() == "log"
    scales = labelled(noise)
    assert set(scales) == {"model", "w"}  # b is NaN (undefined) throughout: nothing to draw
    assert scales["model"] == pytest.approx([100.0 + i for i in range(STEPS)])
    assert NOISE_SCALE_UNIT in noise.get_title(loc="left")
    assert summary.origins == {NAN_AT: (1,)}
    notes = [(t.get_text(), t.xy[0]) for t in norms.texts if t.get_text().startswith("rank")]
    assert notes == [("rank 1", NAN_AT)]
    # and the file
    out = render_history(records, tmp_path / "p.png", width=8, height=8, dpi=40)
    assert out.panels == panels and (tmp_path / "p.png").stat().st_size > 0


def test_plot_without_the_view_draws_as_before() -> None:
    """Records without the view, and records written before it existed (no such keys): the
    three panels, no annotation."""
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import draw_history

    plain = [json.loads(json.dumps(snap(i).to_dict())) for i in range(5)]
    old = [{k: v for k, v in r.items() if "replica" not in k and "noise" not in k
            and "origin" not in k and k != "rank_view"} for r in plain]  # fmt: skip
    for records in (plain, old):
        fig, summary = draw_history(records, width=6, height=4, dpi=40)
        assert summary.panels == ("norms", "ratios", "health")
        assert [ax.get_ylabel() for ax in fig.axes] == [
            "gradient L2 norm", "normalized ratio", "health",
        ]  # fmt: skip
        assert summary.origins == {}
        assert not [t for t in fig.axes[0].texts if t.get_text().startswith("rank")]


def test_plot_skips_malformed_view_values() -> None:
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import draw_history

    records = view_records()
    for step, value in ((2, "1.5"), (3, True), (4, None), (5, [1.0])):
        records[step]["replica_grad_norm_median"] = value
    records[6]["gradient_noise_scale"] = {"x": 1.0}
    records[7]["group_noise_scale"] = [1.0, 2.0]
    records[8]["group_noise_scale"] = {"w": "800"}
    records[NAN_AT]["nonfinite_origin_ranks"] = [1, "a"]  # not ranks: no annotation
    records[14]["nonfinite_origin_ranks"] = [2]  # a finite step names no origin
    fig, summary = draw_history(records, width=8, height=8, dpi=40)
    assert summary.panels[2:4] == ("replicas", "noise scale")
    median = labelled(fig.axes[2])["median"]
    assert all(math.isnan(median[s]) for s in (2, 3, 4, 5))
    assert median[1] == pytest.approx(median_at(1)) and median[9] == pytest.approx(median_at(9))
    scales = labelled(fig.axes[3])
    assert math.isnan(scales["model"][6]) and scales["model"][9] == pytest.approx(109.0)
    assert math.isnan(scales["w"][7]) and math.isnan(scales["w"][8])
    assert scales["w"][9] == pytest.approx(59.0)
    assert summary.origins == {}
    assert not [t for t in fig.axes[0].texts if t.get_text().startswith("rank")]
    # a view whose every figure is absent draws no panel for it
    for r in records:
        for key in ("replica_grad_norm_min", "replica_grad_norm_median", "replica_grad_norm_max",
                    "gradient_noise_scale"):  # fmt: skip
            r[key] = None
        r["group_noise_scale"] = {}
    assert draw_history(records, width=6, height=4, dpi=40)[1].panels == (
        "norms", "ratios", "health",
    )  # fmt: skip


def test_origin_label_names_a_few_ranks_and_counts_the_rest() -> None:
    from gradwatch.cli.plot import ORIGIN_RANKS_SHOWN, origin_label

    assert origin_label([3]) == "rank 3"
    assert origin_label([0, 2]) == "ranks 0, 2"
    many = list(range(ORIGIN_RANKS_SHOWN + 3))
    assert origin_label(many).endswith(f"{ORIGIN_RANKS_SHOWN - 1} +3")
