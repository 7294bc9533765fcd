"""One history, four views, one answer: which steps were non-finite, exploding, AMP-skipped.

:class:`gradwatch.Snapshot` owns the classification of a step. This test writes one history
(with :class:`gradwatch.export.history.HistoryWriter`) holding a NaN step, an exploding step, an
AMP-skipped step and normal steps, then renders every view a user sees from it and checks that
they agree with each other and with ``Snapshot``:

* ``gradwatch plot``: the :class:`~gradwatch.cli.plot.PlotSummary` and the picture's title;
* ``gradwatch top``: the frame drawn from the exposition of an endpoint the snapshots were
  published to, on the NaN step and at the end;
* the demo's summary lines, from the demo job's summary of the same snapshots;
* the Prometheus counters ``gradwatch_*_steps_total`` of that exposition.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from gradwatch.cli.demo_protocol import DemoOptions, Summary
from gradwatch.cli.demo_view import summary_lines
from gradwatch.cli.endpoint import EndpointView, fetch, parse_exposition
from gradwatch.cli.render import Trends
from gradwatch.cli.top import render_frame
from gradwatch.config import WatchConfig
from gradwatch.export import MetricsServer
from gradwatch.export.history import HistoryWriter, read_history
from gradwatch.snapshot import GroupStats, Snapshot

NAN_AT = 3
EXPLODE_AT = 5
AMP_SKIPPED_AT = 7
STEPS = 10

#: The expected classes, by the definitions in docs/metrics.md: a non-finite step is exploding
#: too; an AMP-skipped step is not a non-finite step, but its Inf gradient is exploding.
NONFINITE = [NAN_AT]
EXPLODING = [NAN_AT, EXPLODE_AT, AMP_SKIPPED_AT]
AMP_SKIPPED = [AMP_SKIPPED_AT]


def snapshot(step: int) -> Snapshot:
    """What GradWatch would publish for ``step`` (a non-finite parameter counts as exploding)."""
    norm, exploding, nonfinite, amp = 1.0 + 0.1 * step, 0, (), False
    if step == NAN_AT:
        norm, exploding, nonfinite = math.nan, 1, ("host.w",)
    elif step == EXPLODE_AT:
        norm, exploding = 500.0, 1
    elif step == AMP_SKIPPED_AT:
        norm, exploding, nonfinite, amp = math.inf, 1, ("host.w",), True
    finite = not nonfinite
    return Snapshot(
        step=step,
        global_norm=norm,
        groups={
            "host": GroupStats(
                norm=norm, numel=100, tensors=2, exploding=exploding, nonfinite=len(nonfinite)
            ),
            "seed": GroupStats(norm=0.1, numel=10, tensors=1),
        },
        nonfinite_params=nonfinite,
        ratios={"seed/host": 0.3 if finite else math.nan},
        health=0.0 if not finite else (0.6 if exploding else 1.0),
        isolation_violated={},
        amp_skipped=amp,
        timestamp=time.time(),
    )


@pytest.fixture
def history(tmp_path: Path) -> list[Snapshot]:
    """The snapshots as read back from a history file (what ``gradwatch plot`` reads)."""
    path = tmp_path / "history.jsonl"
    with HistoryWriter(path) as writer:
        for step in range(STEPS):
            writer.write(snapshot(step))
    return [Snapshot.from_dict(r) for r in read_history(path)]


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    cfg = WatchConfig(
        port=0,
        bind_address="127.0.0.1",
        groups={"host": ["host.*"], "seed": ["seed.*"]},
        ratios=[("seed", "host")],
    )
    srv = MetricsServer(cfg, world_size=1, parallelism="single")
    yield srv
    srv.close()


def text_of(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(renderable)
    return out.getvalue()


def test_history_holds_the_cases(history: list[Snapshot]) -> None:
    """The fixture is what the test claims, by Snapshot's own classification."""
    assert [s.step for s in history] == list(range(STEPS))
    assert [s.step for s in history if s.nonfinite_step] == NONFINITE
    assert [s.step for s in history if s.exploding_step] == EXPLODING
    assert [s.step for s in history if s.amp_skipped] == AMP_SKIPPED


def test_plot_top_demo_and_counters_agree(
    history: list[Snapshot], server: MetricsServer, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import load_records, render_history

    # gradwatch plot
    records = load_records(tmp_path / "history.jsonl")
    plot = render_history(records, tmp_path / "plot.png", width=4, height=3, dpi=40)
    assert (plot.events.nonfinite, plot.events.exploding) == (NONFINITE, EXPLODING)
    assert plot.events.amp_skipped == AMP_SKIPPED
    assert (plot.nonfinite_steps, plot.exploding_steps, plot.amp_skipped_steps) == (1, 3, 1)
    assert plot.title.endswith(", 1 non-finite, 3 exploding, 1 AMP-skipped"), plot.title

    # gradwatch top, on the NaN step and at the end; and the counters of the same exposition
    trends = Trends()
    view_at_nan: EndpointView | None = None
    for snap in history:
        server.publish(snap)
        if snap.step == NAN_AT:
            view_at_nan = parse_exposition(fetch(server.url))
    assert view_at_nan is not None and view_at_nan.step == NAN_AT
    frame = text_of(render_frame(server.url, view_at_nan, None, trends, refresh=1, interval=1.0))
    assert f"step {NAN_AT}" in frame and "global norm nan" in frame, frame
    assert "non-finite steps 1" in frame and "exploding steps 1" in frame, frame

    exposition = fetch(server.url)
    final = parse_exposition(exposition)
    frame = text_of(render_frame(server.url, final, None, trends, refresh=2, interval=1.0))
    for expected in ("non-finite steps 1", "exploding steps 3", "AMP-skipped steps 1"):
        assert expected in frame, (expected, frame)
    counters = {
        s.name: s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
        if s.name.endswith("_steps_total") and not s.labels  # the whole-model counters
    }
    assert counters == {
        "gradwatch_nonfinite_steps_total": 1.0,
        "gradwatch_no_gradient_steps_total": 0.0,
        "gradwatch_amp_skipped_steps_total": 1.0,
        "gradwatch_exploding_steps_total": 3.0,
    }
    assert (final.nonfinite_steps, final.exploding_steps, final.amp_skipped_steps) == (1, 3, 1)

    # the demo's summary, from the job's record of the same snapshots
    summary = Summary()
    for snap in history:
        summary.add(snap)
    events = summary.events
    assert (events.nonfinite, events.exploding, events.amp_skipped) == (
        NONFINITE,
        EXPLODING,
        AMP_SKIPPED,
    )
    opts = DemoOptions(steps=STEPS, seed_at=2, blend_at=6)
    lines = summary_lines(opts, summary, final, server.url)
    assert f"non-finite steps: 1 (step {NAN_AT})" in lines
    assert (
        f"exploding steps: 3 (steps {NAN_AT}, {EXPLODE_AT}, {AMP_SKIPPED_AT}) "
        "(non-finite included)" in lines
    )
    assert f"AMP-skipped steps: 1 (step {AMP_SKIPPED_AT})" in lines
    assert any(
        "gradwatch_nonfinite_steps_total 1," in line
        and "gradwatch_exploding_steps_total 3," in line
        for line in lines
    ), lines
