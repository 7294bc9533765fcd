"""Which rank is slow in ``gradwatch top``: read from the endpoint through the catalog, drawn
with the alert's threshold, and nothing at all (never zeros) without ``rank_timing``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from exposition import exposition_text
from rich.console import Console

from gradwatch import Snapshot, WatchConfig
from gradwatch.cli.endpoint import parse_exposition
from gradwatch.cli.render import straggler_text
from gradwatch.export.state import PublishedState
from gradwatch.snapshot import STRAGGLER_THRESHOLD

RULES = Path(__file__).parents[3] / "deploy" / "prometheus" / "gradwatch-rules.yml"

TIMED: dict[str, Any] = {
    "slowest_rank": 1, "slowest_host": "node-b", "straggler_score": 0.05,
    "work_seconds_min": 0.01, "work_seconds_median": 0.011, "work_seconds_max": 0.21,
}  # fmt: skip


def exposition(s: Snapshot) -> str:
    """The endpoint's text after publishing ``s`` (the real exporter's state and collector)."""
    state = PublishedState(WatchConfig())
    state.write(s)
    return exposition_text(state, world_size=4, parallelism="ddp4")


def _plain(text: Any) -> str:
    console = Console(width=200, no_color=True)
    with console.capture() as cap:
        console.print(text)
    return cap.get()


def test_top_reads_and_shows_the_slowest_rank() -> None:
    view = parse_exposition(exposition(Snapshot(step=3, world_size=4, **TIMED)))
    assert view.slowest_rank == 1 and view.slowest_host == "node-b"
    assert view.straggler_score == 0.05
    assert view.work_seconds == {"min": 0.01, "median": 0.011, "max": 0.21}
    line = _plain(straggler_text(view))
    assert "slowest rank 1 (node-b)" in line and "straggler" in line and "max 0.21" in line


def test_top_shows_nothing_without_rank_timing() -> None:
    view = parse_exposition(exposition(Snapshot(step=3, world_size=4)))
    assert view.slowest_rank is None and view.straggler_score is None and not view.work_seconds
    assert straggler_text(view) is None


def test_the_alert_uses_the_same_threshold() -> None:
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"]
             for r in g["rules"] if "alert" in r}  # fmt: skip
    expr = rules["GradwatchSameRankSlowest"]["expr"]
    assert expr.startswith(f"gradwatch_straggler_score < {STRAGGLER_THRESHOLD:g} and ")
