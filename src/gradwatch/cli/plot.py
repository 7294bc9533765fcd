"""``gradwatch plot HISTORY -o out.png``: a picture of a history file (``history_path``).

Three panels sharing the step axis:

1. gradient norms, global and per group, on a log scale (norms move by decades);
2. the normalized group ratios with each pair's configured healthy band and dormant level (the
   job's ``GRADWATCH_RATIOS`` entries, read from the environment; default 0.05-0.2, dormant
   below 0.01): one shared band is shaded, per-pair bands are dashed (low/high) and dotted
   (dormant) lines in the ratio's color (a ratio of exactly 0, i.e. a numerator without
   gradient, is drawn dotted on the floor of the log axis, a marker where each such run
   starts, instead of vanishing; an *undefined* ratio, whose denominator had no gradient, is a
   gap over a hatched span, neither 0 nor an incident);
3. the health score in [0, 1].

When the records carry the per-rank view (DDP, docs/distributed.md: ``replica_grad_norm_*`` or
``gradient_noise_scale`` set), panels are added above the health score: the data-parallel
replicas' local (pre-reduction) gradient norms, min / median / max with the band between min and
max shaded (log scale), and the gradient noise scale B_simple, whole model and per group (log
scale, in :data:`~gradwatch.analysis.rankview.NOISE_SCALE_UNIT`; a non-positive or undefined
estimate is a gap). Histories written with ``update_stats`` get two more panels above the health
score (:mod:`gradwatch.cli.plot_updates`): weight and update norms, update-to-weight ratios and
stalled fractions. Each panel is drawn only when some record has its figures, so a history without
the view or the update figures (or written before they existed) is drawn as three panels. A
non-finite step whose origin ranks are known (``nonfinite_origin_ranks``) is annotated with them
(``rank 1``) at the top of the norms panel. A value of the wrong type in a record is skipped (a
gap), never drawn as a number.
Every panel's legend sits outside it, to its right, so no label inside a panel hides under it.

Steps with a non-finite gradient (red), AMP-skipped steps (grey) and exploding steps (orange)
are vertical lines across every panel, so a spike in one panel lines up with the others. Spikes
found by adaptive spike detection (``Snapshot.spike_step``: the global norm or a group's norm far
above its recent median, see :mod:`gradwatch.analysis.spikes`) are magenta triangles on the spiking
norms in the first panel. Steps the optimizer-step guard skipped (``Snapshot.guard_skipped``,
``watch.guard``) are black downward triangles along the bottom of the norms panel. A
record is classified as :class:`gradwatch.Snapshot` classifies it (``Snapshot.from_dict``), the
definition the Prometheus counters use too: an exploding step includes every non-finite one, so
a NaN step is counted, and drawn, in both.
Non-finite values are masked (a gap in the line), never plotted or allowed to break the
scaling. The rotated backup ``HISTORY.1`` is read first, and torn lines are skipped
(:func:`gradwatch.export.history.read_history`).

matplotlib is an optional extra (``pip install 'torch-gradwatch[plot]'``); it is imported lazily and
drawn with the Agg canvas directly (no pyplot, no display, no global backend state). The PNG is
exactly ``width*dpi`` x ``height*dpi`` pixels (no tight bounding box).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import TypeAdapter, ValidationError

from gradwatch.analysis.rankview import NOISE_SCALE_UNIT
from gradwatch.cli.plot_updates import (
    UPDATE_PANEL_HEIGHTS,
    UPDATE_PANELS,
    draw_updates,
    draw_weights,
    update_series,
)
from gradwatch.cli.step_events import StepEvents
from gradwatch.config import (
    DEFAULT_RATIO_DORMANT,
    DEFAULT_RATIO_HIGH,
    DEFAULT_RATIO_LOW,
    RatioSpec,
    env_settings,
    env_var,
    ratio_key,
)
from gradwatch.export.history import malformed_record, read_history, rotated_path, where_in_history
from gradwatch.snapshot import GroupStats, Snapshot, ratio_defined

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Exit status for bad input (missing/empty history, missing matplotlib, bad options).
EXIT_INVALID = 2

#: The default healthy band of a normalized ratio and dormant level (see docs/runbook.md); a
#: ``ratios`` entry of the job's configuration may set its own.
HEALTHY_BAND = (DEFAULT_RATIO_LOW, DEFAULT_RATIO_HIGH)
DORMANT_BELOW = DEFAULT_RATIO_DORMANT

#: ``(low, high, dormant)`` of one ratio.
Band = tuple[float, float, float]

HELP = "\n\n".join(
    (
        "Plot a gradwatch history file (WatchConfig.history_path) to a PNG.",
        "Panels: global and group gradient norms (log scale), normalized ratios with each pair's "
        "healthy band and dormant line (from GRADWATCH_RATIOS; default 0.05-0.2 and 0.01), and "
        "the health score; with the per-rank view (DDP), the replicas' local norms (min/median/"
        "max) and the gradient noise scale. Non-finite (red), "
        "AMP-skipped (grey) and exploding (orange) steps are marked on every panel. HISTORY.1 "
        "(the rotated backup) is read first; torn lines are skipped.",
        "Needs matplotlib: pip install 'torch-gradwatch[plot]'. The image is width*dpi x "
        "height*dpi pixels.",
    )
)


class PlotError(Exception):
    """A problem with the input (shown as one line, exit status 2)."""


@dataclass(frozen=True)
class PlotSummary:
    """What was drawn: the steps of each class, and counts for the caller's one-line report."""

    records: int
    first_step: int
    last_step: int
    events: StepEvents
    restarts: int
    pixels: tuple[int, int]
    title: str
    #: The band drawn for each ratio, ``"num/den"`` -> ``(low, high, dormant)``.
    bands: dict[str, Band] | None = None
    #: The panels drawn, top to bottom (see :data:`PANELS`).
    panels: tuple[str, ...] = ()
    #: Non-finite steps annotated with the ranks their NaN/Inf started on (the per-rank view).
    origins: dict[int, tuple[int, ...]] | None = None

    @property
    def nonfinite_steps(self) -> int:
        return len(self.events.nonfinite)

    @property
    def amp_skipped_steps(self) -> int:
        return len(self.events.amp_skipped)

    @property
    def exploding_steps(self) -> int:
        return len(self.events.exploding)

    @property
    def spike_steps(self) -> int:
        return len(self.events.spikes)

    @property
    def skipped_steps(self) -> int:
        return len(self.events.skipped)


#: Every panel, top to bottom; the per-rank view's two and the update panels
#: (:mod:`gradwatch.cli.plot_updates`) are drawn only for records that carry them.
PANELS = ("norms", "ratios", "replicas", "noise scale", *UPDATE_PANELS, "health")
#: Origin ranks named in one annotation; more are counted (``ranks 0, 1, 2, 3 +4``).
ORIGIN_RANKS_SHOWN = 4

#: Color and marker of a spike in the norms panel.
SPIKE_COLOR = "magenta"
SPIKE_MARKER = "^"
#: Color and marker of a step the optimizer-step guard skipped, in the norms panel.
SKIPPED_COLOR = "black"
SKIPPED_MARKER = "v"


def counts_text(events: StepEvents) -> str:
    """``"1 non-finite, 3 exploding"``, plus ``", 1 AMP-skipped"`` when there are some."""
    text = f"{len(events.nonfinite)} non-finite, {len(events.exploding)} exploding"
    if events.amp_skipped:
        text += f", {len(events.amp_skipped)} AMP-skipped"
    if events.spikes:
        text += f", {len(events.spikes)} spike {_spike_steps(events)}"
    if events.skipped:
        text += f", {len(events.skipped)} guard-skipped"
    return text


def _spike_steps(events: StepEvents) -> str:
    return "step" if len(events.spikes) == 1 else "steps"


def spike_points(records: Sequence[dict[str, Any]]) -> list[tuple[int, str | None, float]]:
    """``(step, group or None for the global norm, norm)`` of every spike among ``records``,
    by ``Snapshot.from_dict`` (records without spike fields have none)."""
    points: list[tuple[int, str | None, float]] = []
    for record in records:
        try:
            snap = Snapshot.from_dict(record)
        except (TypeError, ValueError, AttributeError):
            continue
        if snap.global_spike:
            points.append((snap.step, None, snap.global_norm))
        for group in snap.spiking_groups:
            if group in snap.groups:
                points.append((snap.step, group, snap.groups[group].norm))
    return points


def classify(records: Sequence[dict[str, Any]]) -> StepEvents:
    """The steps of each class among ``records`` (history dicts), by ``Snapshot.from_dict``.

    A record gradwatch did not write (a field of the wrong type) is drawn but not classified:
    a foreign line must not abort the picture of a long run.
    """
    events = StepEvents()
    for record in records:
        try:
            events.add(Snapshot.from_dict(record))
        except (TypeError, ValueError, AttributeError):
            continue
    return events


def configured_bands() -> dict[str, Band]:
    """Each ratio's band from ``GRADWATCH_RATIOS`` (the job's setting, read as the job reads
    it), keyed ``"num/den"``; empty when unset. Raises :class:`PlotError` naming the variable
    when it is invalid."""
    raw = env_settings().get("ratios")
    if raw is None:
        return {}
    try:
        specs = TypeAdapter(list[RatioSpec]).validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise PlotError(
            f"{env_var('ratios')}: invalid ratio band at {where or 'top level'}: {first['msg']}"
        ) from None
    return {ratio_key(s.numerator, s.denominator): (s.low, s.high, s.dormant) for s in specs}


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _number(value: Any) -> float:
    """A record's numeric field, or NaN when it is absent or of another type (a bool, a string
    or a list is not a figure gradwatch wrote: skipped, not parsed)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _group_noise(record: dict[str, Any]) -> dict[str, float]:
    """``group_noise_scale`` of a record (empty when absent or not a mapping)."""
    value = record.get("group_noise_scale")
    if not isinstance(value, dict):
        return {}
    return {str(g): _number(v) for g, v in value.items()}


#: The per-rank view's replica spread fields of a history record, in drawing order.
REPLICA_FIELDS = ("replica_grad_norm_min", "replica_grad_norm_median", "replica_grad_norm_max")


def origin_ranks(records: Sequence[dict[str, Any]]) -> dict[int, tuple[int, ...]]:
    """Step -> the ranks where its NaN/Inf started, for every non-finite step (by
    ``Snapshot.nonfinite_step``) whose record names them; a malformed list is skipped."""
    out: dict[int, tuple[int, ...]] = {}
    for record in records:
        ranks = record.get("nonfinite_origin_ranks")
        if not isinstance(ranks, list) or not ranks:
            continue
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            continue
        try:
            snap = Snapshot.from_dict(record)
        except (TypeError, ValueError, AttributeError):
            continue
        if snap.nonfinite_step:
            out[snap.step] = tuple(ranks)
    return out


def origin_label(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0, 2``, ``ranks 0, 1, 2, 3 +4``."""
    shown = ", ".join(str(r) for r in ranks[:ORIGIN_RANKS_SHOWN])
    more = f" +{len(ranks) - ORIGIN_RANKS_SHOWN}" if len(ranks) > ORIGIN_RANKS_SHOWN else ""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {shown}{more}"


def _positive(values: Sequence[float]) -> list[float]:
    """Mask for a log axis: non-finite and non-positive values become NaN (a gap)."""
    return [v if math.isfinite(v) and v > 0 else math.nan for v in values]


#: Malformed records named one by one on stderr; more are only counted.
MALFORMED_SHOWN = 5

def load_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` (and ``path.1`` first); :class:`PlotError` when there are none."""
    if not path.exists() and not rotated_path(path).exists():
        raise PlotError(f"no history file at {path} (nor {rotated_path(path).name})")
    if path.is_dir():
        raise PlotError(f"{path} is a directory, not a history file")
    try:
        records = read_history(path)
    except OSError as exc:
        raise PlotError(f"cannot read {path}: {exc.strerror or exc}") from exc
    bad = [(r, problem) for r in records if (problem := malformed_record(r)) is not None]
    if bad:
        for record, problem in bad[:MALFORMED_SHOWN]:
            sys.stderr.write(
                f"gradwatch plot: warning: {where_in_history(path, record)}: malformed record "
                f"({problem}); skipped\n"
            )
        if len(bad) > MALFORMED_SHOWN:
            sys.stderr.write(
                f"gradwatch plot: warning: {len(bad) - MALFORMED_SHOWN} more malformed records "
                "skipped\n"
            )
        skipped = {id(r) for r, _ in bad}
        records = [r for r in records if id(r) not in skipped]
    if not records:
        raise PlotError(
            f"{path} holds no history records (empty, or not a gradwatch history: one JSON "
            "object with a 'step' per line)"
        )
    return records


def ratio_undefined(record: dict[str, Any], key: str) -> bool:
    """The ratio ``key`` (``"num/den"``) of ``record`` is undefined: its denominator group had
    no gradient, or a norm below 1e-8 (:func:`gradwatch.snapshot.ratio_defined`). Also true of
    the 0.0 that histories written before NaN was the rule hold for it."""
    stats = (record.get("groups") or {}).get(key.split("/", 1)[-1])
    if not isinstance(stats, dict):
        return False
    norm, numel = _number(stats.get("norm")), stats.get("numel")
    if not isinstance(numel, int) or isinstance(numel, bool) or not math.isfinite(norm):
        return False  # malformed, or non-finite: an incident, drawn as such
    return not ratio_defined(GroupStats(norm=norm, numel=numel))


def ratio_value(record: dict[str, Any], key: str) -> float:
    """The ratio ``key`` of ``record``: NaN when undefined (:func:`ratio_undefined`)."""
    if ratio_undefined(record, key):
        return math.nan
    return _float((record.get("ratios") or {}).get(key))


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """``(first, last)`` indices of each run of True in ``flags``."""
    out: list[tuple[int, int]] = []
    start: int | None = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i - 1))
            start = None
    return out


def _legend(ax: Any, **kwargs: Any) -> None:
    """The panel's legend outside it, to its right: no label drawn inside a panel (the origin
    ranks of a NaN at its top, a line) can be hidden under it (the constrained layout makes
    room)."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              fontsize="small", **kwargs)  # fmt: skip


def render_history(
    records: Sequence[dict[str, Any]],
    output: Path,
    *,
    width: float = 12.0,
    height: float = 8.0,
    dpi: int = 100,
    title: str | None = None,
    bands: dict[str, Band] | None = None,
) -> PlotSummary:
    """Draw ``records`` (history dicts) to the PNG ``output``; see the module docstring.

    ``bands`` (``"num/den"`` -> ``(low, high, dormant)``, e.g. :func:`configured_bands`) gives
    each ratio's band; a ratio without one gets the defaults.
    Records are ordered by step (stable); a history where steps go backward (a restarted job
    appending to the same file) is still drawn, and counted in :attr:`PlotSummary.restarts`.
    Raises ``ImportError`` without matplotlib and ``OSError`` when the file cannot be written.
    """
    fig, summary = draw_history(
        records, width=width, height=height, dpi=dpi, title=title, bands=bands
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=dpi, format="png")
    return summary


def draw_history(
    records: Sequence[dict[str, Any]],
    *,
    width: float = 12.0,
    height: float = 8.0,
    dpi: int = 100,
    title: str | None = None,
    bands: dict[str, Band] | None = None,
) -> tuple[Figure, PlotSummary]:
    """The figure :func:`render_history` saves, and what it drew (no file written)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    restarts = sum(1 for a, b in itertools.pairwise(records) if int(b["step"]) < int(a["step"]))
    recs = sorted(records, key=lambda r: int(r["step"]))
    steps = [int(r["step"]) for r in recs]
    global_norm = [_float(r.get("global_norm")) for r in recs]
    groups: list[str] = []
    ratios: list[str] = []
    for r in recs:
        groups.extend(g for g in (r.get("groups") or {}) if g not in groups)
        ratios.extend(k for k in (r.get("ratios") or {}) if k not in ratios)

    def group_norm(r: dict[str, Any], g: str) -> float:
        stats = (r.get("groups") or {}).get(g)
        return _float(stats.get("norm")) if isinstance(stats, dict) else math.nan

    classes = classify(recs)
    # the per-rank view, when some record carries it (a panel per kind of figure present)
    replica = {f: [_number(r.get(f)) for r in recs] for f in REPLICA_FIELDS}
    noise = [_number(r.get("gradient_noise_scale")) for r in recs]
    group_noise = [_group_noise(r) for r in recs]
    noise_groups: list[str] = []
    for scales in group_noise:
        noise_groups.extend(g for g, v in scales.items() if g not in noise_groups and v == v)
    updates = update_series(recs)
    drawn = {
        "replicas": any(v == v for values in replica.values() for v in values),
        "noise scale": any(v == v for v in noise) or bool(noise_groups),
        **dict.fromkeys(UPDATE_PANELS, updates is not None),
    }
    panels = tuple(p for p in PANELS if drawn.get(p, True))
    heights = {"norms": 3, "ratios": 2, "replicas": 2, "noise scale": 2, "health": 1.2,
               **UPDATE_PANEL_HEIGHTS}  # fmt: skip

    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = dict(
        zip(
            panels,
            fig.subplots(
                len(panels), 1, sharex=True,
                gridspec_kw={"height_ratios": [heights[p] for p in panels]},
            ),
            strict=True,
        )
    )  # fmt: skip
    ax_norm, ax_ratio, ax_health = axes["norms"], axes["ratios"], axes["health"]

    # 1. norms
    ax_norm.plot(steps, _positive(global_norm), color="black", lw=1.8, label="global")
    for g in groups:
        ax_norm.plot(steps, _positive([group_norm(r, g) for r in recs]), lw=1.1, label=g)
    spikes = [(step, norm) for step, _, norm in spike_points(recs) if norm > 0]
    if spikes:
        ax_norm.plot(
            [p[0] for p in spikes], [p[1] for p in spikes], SPIKE_MARKER, color=SPIKE_COLOR,
            ms=9, mec="black", mew=0.6, zorder=5,
            label=f"spike ({len(classes.spikes)} {_spike_steps(classes)})",
        )  # fmt: skip
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("gradient L2 norm")
    _legend(ax_norm)

    # 2. ratios, with each pair's band (one shared band shaded, per-pair bands as lines)
    default: Band = (*HEALTHY_BAND, DORMANT_BELOW)
    levels = {key: (bands or {}).get(key, default) for key in ratios}
    distinct = sorted(set(levels.values())) or [default]
    band_handles: list[Any] = []
    if len(distinct) == 1:
        ((low_band, high_band, dormant),) = distinct
        ax_ratio.axhspan(low_band, high_band, color="tab:green", alpha=0.15, lw=0)
        if dormant > 0:
            ax_ratio.axhline(dormant, color="tab:red", ls="--", lw=1)
        band_handles = [
            Patch(color="tab:green", alpha=0.3, label=f"healthy {low_band:g}-{high_band:g}")
        ]
        if dormant > 0:
            band_handles.append(
                Line2D([], [], color="tab:red", ls="--", lw=1, label=f"dormant < {dormant:g}")
            )
    else:
        for i, key in enumerate(ratios):
            low_band, high_band, dormant = levels[key]
            for level, style in ((low_band, "--"), (high_band, "--"), (dormant, ":")):
                if level > 0:
                    ax_ratio.axhline(level, color=f"C{i % 10}", ls=style, lw=0.9, alpha=0.7)
        band_handles = [
            Line2D([], [], color="grey", ls="--", lw=0.9, label="healthy band (per pair)"),
            Line2D([], [], color="grey", ls=":", lw=0.9, label="dormant below (per pair)"),
        ]
    ax_ratio.set_yscale("log")
    ax_ratio.set_ylabel("normalized ratio")
    finite_ratios = [
        v
        for r in recs
        for v in (_float(x) for x in (r.get("ratios") or {}).values())
        if math.isfinite(v) and v > 0
    ]
    drawn_levels = [v for band in distinct for v in band if v > 0]
    low = min([*finite_ratios, *drawn_levels]) / 3
    high = max([*finite_ratios, *drawn_levels]) * 3
    ax_ratio.set_ylim(low, high)
    any_zero = any_undefined = False
    for i, key in enumerate(ratios):
        color = f"C{i % 10}"
        values = [ratio_value(r, key) for r in recs]
        ax_ratio.plot(steps, _positive(values), lw=1.1, color=color, label=key)
        undefined = [ratio_undefined(r, key) for r in recs]
        for first_i, last_i in _runs(undefined):  # a gap, shaded: expected, not an incident
            any_undefined = True
            ax_ratio.axvspan(
                steps[first_i] - 0.5, steps[last_i] + 0.5, color="grey", alpha=0.12, lw=0,
                hatch="//", fill=False, ec=color,
            )  # fmt: skip
        if any(v == 0.0 for v in values):  # a group without gradient: on the floor, not gone
            any_zero = True
            floor = low * 1.15
            ax_ratio.plot(steps, [floor if v == 0.0 else math.nan for v in values], ls=":",
                          lw=2, color=color)  # fmt: skip
            starts = [
                s for i, (s, v) in enumerate(zip(steps, values, strict=True))
                if v == 0.0 and (i == 0 or values[i - 1] != 0.0)
            ]  # fmt: skip
            ax_ratio.plot(starts, [floor] * len(starts), "v", ms=5, color=color)
    if not ratios:
        ax_ratio.text(
            0.5, 0.5, "no ratios in this history (WatchConfig.ratios)",
            transform=ax_ratio.transAxes, ha="center", va="center", color="grey",
        )  # fmt: skip
    handles = [*ax_ratio.get_legend_handles_labels()[0], *band_handles]
    if any_zero:
        label = "0 (numerator: no gradient)"
        handles.append(Line2D([], [], ls=":", lw=2, marker="v", color="grey", label=label))
    if any_undefined:
        handles.append(
            Patch(hatch="//", fill=False, ec="grey", label="undefined (denominator: no gradient)")
        )
    _legend(ax_ratio, handles=handles)

    # the per-rank view: the replicas' local norms, and the gradient noise scale
    if "replicas" in axes:
        ax = axes["replicas"]
        low_r, mid_r, high_r = (_positive(replica[f]) for f in REPLICA_FIELDS)
        ax.fill_between(steps, low_r, high_r, color="tab:purple", alpha=0.15, lw=0)
        ax.plot(steps, high_r, color="tab:purple", lw=1.1, label="max")
        ax.plot(steps, mid_r, color="black", lw=1.3, label="median")
        ax.plot(steps, low_r, color="tab:purple", lw=1.1, ls="--", label="min")
        ax.set_yscale("log")
        ax.set_ylabel("replica local norm")
        _legend(ax)
    if "noise scale" in axes:
        ax = axes["noise scale"]
        if any(v == v for v in noise):
            ax.plot(steps, _positive(noise), color="black", lw=1.5, label="model")
        for g in noise_groups:
            values = [scales.get(g, math.nan) for scales in group_noise]
            ax.plot(steps, _positive(values), lw=1.1, label=g)
        ax.set_yscale("log")
        ax.set_ylabel("noise scale")
        ax.set_title(f"gradient noise scale B_simple, in {NOISE_SCALE_UNIT}", loc="left",
                     fontsize="small")  # fmt: skip
        _legend(ax)

    if updates is not None:  # update_stats: weights and update, update ratio and stalled
        draw_weights(axes["weights"], steps, updates)
        draw_updates(axes["updates"], steps, updates)

    # 3. health
    ax_health.plot(steps, [_float(r.get("health")) for r in recs], color="tab:blue", lw=1.2)
    ax_health.set_ylim(-0.05, 1.05)
    ax_health.set_ylabel("health")
    ax_health.set_xlabel("step")

    # events, on every panel; exploding first, so the non-finite steps it includes stay red
    nonfinite = (classes.nonfinite, "tab:red", "-", f"non-finite ({len(classes.nonfinite)})")
    amp_skipped = (classes.amp_skipped, "grey", "-", f"AMP-skipped ({len(classes.amp_skipped)})")
    exploding = (classes.exploding, "tab:orange", ":", f"exploding ({len(classes.exploding)})")
    events = (nonfinite, amp_skipped, exploding)
    for ax in axes.values():
        for at, color, style, _ in (exploding, nonfinite, amp_skipped):
            if at:
                ax.vlines(
                    at, 0, 1, transform=ax.get_xaxis_transform(), colors=color, linestyles=style,
                    lw=1.2, alpha=0.8, zorder=0,
                )  # fmt: skip
        ax.grid(True, which="major", alpha=0.3)
    for at, color, _, _ in (nonfinite, amp_skipped):  # where the norm is missing, say why
        if at:
            ax_norm.plot(at, [1.0] * len(at), "x", color=color, ms=7, mew=2,
                         transform=ax_norm.get_xaxis_transform(), clip_on=False)  # fmt: skip
    origins = origin_ranks(recs)
    for step, ranks in origins.items():  # where a NaN/Inf started, when the view knows it
        ax_norm.annotate(
            origin_label(ranks), xy=(step, 1.0), xycoords=ax_norm.get_xaxis_transform(),
            xytext=(4, -4), textcoords="offset points", rotation=90, ha="left", va="top",
            color="tab:red", fontsize="small",
        )  # fmt: skip
    legend_events = [
        Line2D([], [], color=c, ls=ls, lw=1.5, label=label) for at, c, ls, label in events if at
    ]
    if classes.skipped:  # the guard skipped these optimizer steps: along the norms' floor
        skipped_label = f"guard-skipped ({len(classes.skipped)})"
        ax_norm.plot(classes.skipped, [0.0] * len(classes.skipped), SKIPPED_MARKER,
                     color=SKIPPED_COLOR, ms=7, transform=ax_norm.get_xaxis_transform(),
                     clip_on=False)  # fmt: skip
        legend_events.append(
            Line2D([], [], color=SKIPPED_COLOR, marker=SKIPPED_MARKER, ls="", label=skipped_label)
        )
    if legend_events:
        fig.legend(handles=legend_events, loc="outside lower center", ncols=3, fontsize="small")

    first, last = steps[0], steps[-1]
    title = title or (
        f"gradwatch history: {len(recs)} snapshots, steps {first}-{last}, {counts_text(classes)}"
    )
    fig.suptitle(title)
    return fig, PlotSummary(
        records=len(recs),
        first_step=first,
        last_step=last,
        events=classes,
        restarts=restarts,
        pixels=(round(width * dpi), round(height * dpi)),
        title=title,
        bands=levels,
        panels=panels,
        origins=origins,
    )


def _fail(message: str) -> typer.Exit:
    sys.stderr.write(f"gradwatch plot: {message}\n")
    return typer.Exit(EXIT_INVALID)


def plot_command(
    history: Annotated[
        Path, typer.Argument(help="History file (JSON lines) written by history_path.")
    ],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="PNG to write [default: HISTORY with .png suffix]"),
    ] = None,
    width: Annotated[
        float, typer.Option(help="Width in inches.", min=1.0, max=100.0)
    ] = 12.0,
    height: Annotated[
        float, typer.Option(help="Height in inches.", min=1.0, max=100.0)
    ] = 8.0,
    dpi: Annotated[int, typer.Option(help="Pixels per inch.", min=20, max=1200)] = 100,
    title: Annotated[str | None, typer.Option(help="Title [default: a summary].")] = None,
) -> None:
    try:
        import matplotlib  # noqa: F401 - only checks that the extra is installed
    except ImportError:
        raise _fail(
            "needs matplotlib, which is not installed: pip install 'torch-gradwatch[plot]'"
        ) from None
    try:
        records = load_records(history)
        bands = configured_bands()
    except PlotError as exc:
        raise _fail(str(exc)) from None
    out = output if output is not None else history.with_suffix(".png")
    try:
        summary = render_history(
            records, out, width=width, height=height, dpi=dpi, title=title, bands=bands
        )
    except OSError as exc:
        sys.stderr.write(f"gradwatch plot: cannot write {out}: {exc.strerror or exc}\n")
        raise typer.Exit(1) from None
    if summary.restarts:
        sys.stderr.write(
            f"gradwatch plot: warning: steps go backward {summary.restarts} time(s) in {history} "
            "(a restarted job appending to the same file); records are drawn by step\n"
        )
    sys.stdout.write(
        f"wrote {out} ({summary.pixels[0]}x{summary.pixels[1]} px): {summary.records} snapshots, "
        f"steps {summary.first_step}-{summary.last_step}, {counts_text(summary.events)}\n"
    )


def register(app: typer.Typer) -> None:
    """Add the ``plot`` command to ``app``."""
    app.command("plot", help=HELP)(plot_command)
