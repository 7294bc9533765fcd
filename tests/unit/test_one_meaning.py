"""One meaning per figure: an undefined ratio (its denominator had no gradient) and an undefined
gradient noise scale read the same in the Snapshot (and ``watch.last``), the history file, the
endpoint, ``gradwatch top``, ``gradwatch plot`` and the framework logs: NaN, drawn as a gap
marked "undefined", never a 0, a negative number or the non-finite incident marker."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from exposition import exposition_text
from rich.console import Console
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.analysis.rankview import NOISE_SCALE_WINDOW, NoiseScale
from gradwatch.cli.endpoint import EndpointView, parse_exposition
from gradwatch.cli.plot import draw_history, ratio_value
from gradwatch.cli.render import (
    NONFINITE_MARK,
    UNDEFINED_MARK,
    Trends,
    render_view,
)
from gradwatch.export.history import HistoryWriter, read_history
from gradwatch.export.state import PublishedState
from gradwatch.integrations.common import log_figures
from gradwatch.snapshot import Snapshot

pytestmark = pytest.mark.timeout(120)

RATIO = "seed/host"
GROUPS = {"host": ["host.*"], "seed": ["seed.*"]}


class HostSeed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.host = nn.Linear(4, 4)
        self.seed = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, frozen_host: bool) -> torch.Tensor:
        h = self.host(x)
        return self.seed(h.detach() if frozen_host else h)


def _run(tmp_path: Path) -> tuple[list[Snapshot], Snapshot | None]:
    """Three steps where both groups train, then three with the host frozen (no gradient:
    the seed/host ratio is undefined). Returns the snapshots and ``watch.last``."""
    torch.manual_seed(0)
    model = HostSeed()
    cfg = WatchConfig(groups=GROUPS, ratios=[("seed", "host")])
    snaps = []
    with GradWatch(model, cfg) as watch:
        for step in range(6):
            model.zero_grad(set_to_none=True)
            model(torch.randn(8, 4), frozen_host=step >= 3).square().sum().backward()
            snaps.append(watch.collect(step).result())
        last = watch.last
    return snaps, last


def _with_noise(snaps: list[Snapshot]) -> list[Snapshot]:
    """The gradient noise scale of 2 replicas, b = 4: consistent estimates, then one step whose
    gradients were scaled after the reduction (|G_B|^2 far above |G_b|^2: a negative trace
    estimate), the case that used to publish a negative noise scale."""
    noise = NoiseScale()
    g2, trace, b, n = 3.0, 96.0, 4.0, 2
    out = []
    for snap in snaps:
        small, big = g2 + trace / b, g2 + trace / (b * n)
        if snap.step == 4:
            big *= 1e6
        scale = noise.update("", small, big, b, n)
        noise_fields = {"gradient_noise_scale": scale, "group_noise_scale": {"seed": scale}}
        out.append(snap.replace(rank_view=True, **noise_fields))
    return out


def _no_bare_constants(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"the history line holds the bare JSON-invalid token {name}")

    return json.loads(text, parse_constant=refuse)


def _view(snap: Snapshot, cfg: WatchConfig) -> EndpointView:
    state = PublishedState(cfg)
    state.write(snap)
    return parse_exposition(exposition_text(state))


def _top_text(views: list[EndpointView]) -> tuple[str, Trends]:
    trends = Trends()
    for view in views:
        trends.add(view)
    buf = io.StringIO()
    Console(file=buf, width=160, color_system=None).print(render_view(views[-1], trends))
    return buf.getvalue(), trends


def test_an_undefined_ratio_and_noise_scale_mean_the_same_everywhere(tmp_path: Path) -> None:
    snaps, last = _run(tmp_path)
    snaps = _with_noise(snaps)
    defined, undefined = snaps[2], snaps[4]
    cfg = WatchConfig(groups=GROUPS, ratios=[("seed", "host")])

    # Snapshot and watch.last: NaN, not 0 (the seed trains: it is not dormant)
    assert defined.ratios[RATIO] > 0
    assert undefined.groups["host"].numel == 0 and undefined.groups["seed"].norm > 0
    assert math.isnan(undefined.ratios[RATIO]) and math.isnan(undefined.raw_ratios[RATIO])
    assert last is not None and last.step == 5 and math.isnan(last.ratios[RATIO])
    # the noise scale: positive when defined, NaN (not negative) after the inconsistent step
    assert defined.gradient_noise_scale == pytest.approx(96.0 / 3.0)
    assert undefined.gradient_noise_scale is not None
    assert math.isnan(undefined.gradient_noise_scale)
    assert math.isnan(undefined.group_noise_scale["seed"])

    # the history file: standard JSON, read back as the same NaN; None stays "not measured"
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as writer:
        for snap in snaps:
            writer.write(snap)
    lines = path.read_text().splitlines()
    raw = _no_bare_constants(lines[4])
    assert raw["ratios"][RATIO] == "NaN" and raw["gradient_noise_scale"] == "NaN"
    assert raw["clip_coef"] is None  # not clipped through gradwatch: null, not NaN
    records = read_history(path)
    back = Snapshot.from_dict(records[4])
    assert math.isnan(back.ratios[RATIO]) and math.isnan(back.gradient_noise_scale or 0.0)
    assert back.clip_coef is None and back.global_spike_score is not None
    assert records[2]["ratios"][RATIO] == defined.ratios[RATIO]

    # the endpoint
    view = _view(undefined, cfg)
    assert math.isnan(view.ratios[RATIO]) and math.isnan(view.noise_scale or 0.0)

    # top: the ratio reads "undefined" and its trend has a gap, never "0" nor "!"
    text, trends = _top_text([_view(s, cfg) for s in snaps])
    assert f"ratio {RATIO} undefined (host has no gradient)" in text, text
    assert "gradient noise scale: model undefined, seed undefined" in text, text
    line = trends.line(f"ratio:{RATIO}")
    assert line.endswith(UNDEFINED_MARK * 3) and NONFINITE_MARK not in line, repr(line)
    assert f"ratio {RATIO} nan" not in text and f"ratio {RATIO} 0 " not in text

    # plot: a gap (NaN y) over a span marked undefined, never on the "0" floor
    fig, _ = draw_history(records)
    ratio_ax = fig.axes[1]
    (ratio_line,) = [ln for ln in ratio_ax.get_lines() if ln.get_label() == RATIO]
    ys = list(ratio_line.get_ydata())
    assert all(math.isfinite(y) for y in ys[:3]) and all(math.isnan(y) for y in ys[3:])
    floor = [ln for ln in ratio_ax.get_lines() if ln.get_linestyle() == ":"]
    assert not floor, "an undefined ratio is drawn on the 0 floor"
    labels = [t.get_text() for t in ratio_ax.get_legend().get_texts()]
    assert "undefined (denominator: no gradient)" in labels, labels
    noise_ax = fig.axes[2]
    (noise_line,) = [ln for ln in noise_ax.get_lines() if ln.get_label() == "model"]
    noise_ys = list(noise_line.get_ydata())
    assert math.isnan(noise_ys[4]) and all(y > 0 for y in noise_ys[:4])

    # the framework logs (HF Trainer, Lightning)
    figures = log_figures(undefined)
    assert math.isnan(figures[f"gradwatch/ratio/{RATIO}"])


def test_an_old_history_reads_the_same(tmp_path: Path) -> None:
    """A history written before NaN was the rule: bare NaN tokens, and 0.0 for an undefined
    ratio. The reader gives the NaN back; the plot takes the 0.0 over a denominator without
    gradient for what it was, undefined."""
    path = tmp_path / "old.jsonl"
    groups = {"host": {"norm": 0.0, "numel": 0, "tensors": 0}, "seed": {"norm": 2.0, "numel": 4}}
    path.write_text(
        json.dumps({"step": 1, "global_norm": float("nan"), "groups": groups,
                    "ratios": {RATIO: 0.0}, "health": 0.0}) + "\n"
    )  # fmt: skip
    (record,) = read_history(path)
    assert math.isnan(record["global_norm"])
    assert math.isnan(ratio_value(record, RATIO))
    defined = {**record, "groups": {**groups, "host": {"norm": 1.0, "numel": 4}}}
    assert ratio_value(defined, RATIO) == 0.0  # a dormant seed over a training host: 0


def test_one_bad_step_leaves_the_noise_scale_after_the_window() -> None:
    """A 1e6x step (consistent: before the reduction) dominates the average while it is in the
    window and leaves it exactly NOISE_SCALE_WINDOW steps later; an inconsistent one makes it
    NaN meanwhile, never negative. An exponential average would carry either for hundreds of
    steps."""
    g2, trace, b, n = 3.0, 96.0, 4.0, 2
    small, big = g2 + trace / b, g2 + trace / (b * n)
    for bad in ((small * 1e6, big * 1e6 * 0.5), (small, big * 1e6)):
        noise = NoiseScale()
        for _ in range(10):
            noise.update("", small, big, b, n)
        values = [noise.update("", *bad, b, n)]
        values += [noise.update("", small, big, b, n) for _ in range(NOISE_SCALE_WINDOW)]
        assert all(math.isnan(v) or v > 0 for v in values)
        assert values[NOISE_SCALE_WINDOW - 1] != pytest.approx(trace / g2, rel=1e-9)
        assert values[NOISE_SCALE_WINDOW] == pytest.approx(trace / g2, rel=1e-9)


def test_no_plot_label_hides_under_a_legend() -> None:
    """The origin ranks of a NaN are written at the top of the norms panel, where a legend in
    the panel's upper left corner used to cover them: every legend sits outside its panel."""
    from gradwatch.snapshot import GroupStats

    records = []
    for step in range(60):
        norm = math.nan if step == 0 else 1.0 + 0.01 * step
        snap = Snapshot(
            step=step, global_norm=norm,
            groups={"host": GroupStats(norm=norm, numel=4, tensors=1),
                    "seed": GroupStats(norm=0.5, numel=4, tensors=1)},
            ratios={RATIO: 0.1}, nonfinite_params=("host.w",) if step == 0 else (),
            rank_view=True, nonfinite_origin_ranks=(1,) if step == 0 else (),
            gradient_noise_scale=10.0, replica_grad_norm_min=1.0, replica_grad_norm_median=1.0,
            replica_grad_norm_max=1.1,
        )  # fmt: skip
        records.append(json.loads(json.dumps(snap.to_dict())))
    fig, summary = draw_history(records)
    assert summary.origins == {0: (1,)}
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    legends = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes if ax.get_legend()]
    labels = [t.get_window_extent(renderer) for ax in fig.axes for t in ax.texts]
    assert len(legends) >= 4 and labels
    for label in labels:
        for legend in legends:
            assert not label.overlaps(legend), (label, legend)
