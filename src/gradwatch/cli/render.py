"""Drawing an :class:`~gradwatch.cli.endpoint.EndpointView`: trends, sparklines and the rich
renderable ``gradwatch top`` and ``gradwatch demo`` display. Reading the endpoint is
:mod:`gradwatch.cli.endpoint`'s job; this module does no I/O.

* :class:`Trends` and :func:`sparkline`: recent values per series, drawn with the unicode blocks
  ``▁▂▃▄▅▆▇█``;
* :func:`render_view`: summary line, groups table, ratios, spike scores and the anomaly
  counters; :func:`anomalies_text` (with :func:`spikes_text`), :func:`spike_scores_text` and
  :func:`isolation_text` are its one-line parts, which the demo's plain progress lines reuse;
  :func:`replica_text` and :func:`noise_scale_text` draw the per-rank view (replica spread,
  outlier score, gradient noise scale) when the endpoint exports it, and nothing when not.

Sparklines of norms use a log scale: gradient norms move by decades (an exploding step is 1e6
times the others) and a linear scale would flatten everything but the spike. A non-finite value
is drawn ``!`` and an exact zero (a group without gradient) ``·``, so both stay visible; an
undefined ratio (its denominator had no gradient: NaN at the endpoint, expected in a stage where
that group is frozen) is a gap and reads ``undefined``, never the incident mark ``!`` nor 0. A trend
gains a point only when a scrape shows a new step: scraping a paused job does not draw a
plateau that never happened.

A point stands for every step published since the previous refresh, not only the last one
(:func:`interval_point`): when the non-finite counter of the series moved in between, the point
is non-finite (``!``); otherwise it is the last norm or, when the per-step norm histogram shows a
larger norm in between, that histogram bucket's lower bound (a norm at least that large was
published: never more than was measured). When the series' spike counter moved, the point is
drawn :data:`SPIKE_MARK`. So a one-step NaN or spike stays visible until it scrolls out.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gradwatch.analysis.rankview import NOISE_SCALE_UNIT, REPLICA_OUTLIER_THRESHOLD
from gradwatch.cli.endpoint import Buckets, EndpointView
from gradwatch.snapshot import STRAGGLER_THRESHOLD

#: The eight block characters of a sparkline, lowest first.
BLOCKS = "▁▂▃▄▅▆▇█"
#: Drawn for NaN/Inf in a sparkline.
NONFINITE_MARK = "!"
#: Drawn for an exact zero on a log-scale sparkline (e.g. a group that had no gradient).
ZERO_MARK = "·"
#: Points kept per trend (the width of the sparklines).
TREND_POINTS = 16
#: Drawn for a trend point whose interval held a spike (its spike counter moved).
SPIKE_MARK = "^"
#: Drawn for an undefined value (a ratio whose denominator had no gradient): a gap, neither a
#: measured 0 nor the non-finite incident mark.
UNDEFINED_MARK = " "
#: How a table cell spells an undefined value.
UNDEFINED = "undefined"


def ratio_undefined(view: EndpointView, key: str) -> bool:
    """The ratio ``key`` (``"num/den"``) is NaN because it is undefined (the denominator had
    no gradient, or a norm below 1e-8), not because a gradient was non-finite: NaN while both
    groups' norms are finite (docs/metrics.md, ``gradwatch_grad_norm_ratio``)."""
    value = view.ratios.get(key)
    if value is None or not math.isnan(value):
        return False
    norms = [view.groups[g].norm for g in key.split("/", 1) if g in view.groups]
    return all(n is not None and math.isfinite(n) for n in norms)


def sparkline(
    values: Iterable[float],
    *,
    log: bool = False,
    lo: float | None = None,
    hi: float | None = None,
) -> str:
    """One character per value: ``▁`` (lowest) .. ``█`` (highest).

    The range is ``[lo, hi]`` when given, else the finite values' min and max; values outside
    it are clamped. ``log=True`` scales ``log10(value)`` (zeros and negatives are drawn
    :data:`ZERO_MARK`). NaN and infinities are drawn :data:`NONFINITE_MARK`. A flat series is
    drawn at mid height.
    """
    vals = list(values)
    scaled: list[float | None] = []
    for v in vals:
        if not math.isfinite(v):
            scaled.append(None)
        elif log:
            scaled.append(math.log10(v) if v > 0 else -math.inf)
        else:
            scaled.append(v)
    finite = [v for v in scaled if v is not None and math.isfinite(v)]
    if log:
        lo = math.log10(lo) if lo is not None and lo > 0 else None
        hi = math.log10(hi) if hi is not None and hi > 0 else None
    low = lo if lo is not None else min(finite, default=0.0)
    high = hi if hi is not None else max(finite, default=0.0)
    top = len(BLOCKS) - 1
    out = []
    for v in scaled:
        if v is None:
            out.append(NONFINITE_MARK)
        elif v == -math.inf:
            out.append(ZERO_MARK)
        elif high <= low:
            out.append(BLOCKS[top // 2])
        else:
            frac = (min(max(v, low), high) - low) / (high - low)
            out.append(BLOCKS[round(frac * top)])
    return "".join(out)


def counter_delta(now: int, before: int) -> int:
    """Events between two readings of a counter (a counter that went down restarted at 0)."""
    return now - before if now >= before else now


def _new_norm_floor(now: Buckets, before: Buckets) -> float | None:
    """The lower bound of the highest histogram bucket that gained observations between the two
    readings (None when none did, or when the first bucket is the highest)."""
    if len(now) != len(before) or not now:
        before = tuple((le, 0.0) for le, _ in now)  # no comparable reading: since the start
    deltas = [c - b for (_, c), (_, b) in zip(now, before, strict=True)]
    if any(d < 0 for d in deltas):  # counts went down: the job restarted; count from zero
        deltas = [c for _, c in now]
    below = 0.0
    highest: int | None = None
    for i, d in enumerate(deltas):  # cumulative counts: a bucket gained when its delta rose
        if d > below:
            highest = i
        below = d
    if highest is None or highest == 0:
        return None
    return now[highest - 1][0]


def interval_point(
    last: float | None,
    buckets: Buckets,
    before: Buckets,
    nonfinite: int,
) -> float | None:
    """One series' trend point for the steps published between two refreshes: non-finite
    (NaN) when ``nonfinite`` of them were, else the larger of the last norm and the lower bound
    of the highest histogram bucket that gained a norm (a norm at least that large was seen)."""
    if nonfinite > 0:
        return math.nan
    floor = _new_norm_floor(buckets, before) if buckets else None
    if floor is None:
        return last
    if last is None or not math.isfinite(last) or last < floor:
        return floor
    return last


class Trends:
    """The last :data:`TREND_POINTS` points of every displayed series, one point per new step
    (see :func:`interval_point`), and where a spike happened."""

    def __init__(self, points: int = TREND_POINTS) -> None:
        self.points = points
        self._series: dict[str, deque[float]] = {}
        self._spikes: dict[str, deque[bool]] = {}
        self._gaps: dict[str, deque[bool]] = {}  # points of an undefined value
        self._last_step: int | None = None
        self._previous: EndpointView | None = None

    def add(self, view: EndpointView) -> bool:
        """Record ``view`` if it shows a step not recorded yet; returns whether it did."""
        if view.step is None or view.step == self._last_step:
            return False
        self._last_step = view.step
        prev = self._previous
        self._previous = view
        values: dict[str, float | None] = {
            "global": view.global_norm,
            "health": view.health,
            **{f"group:{g}": s.norm for g, s in view.groups.items()},
            **{f"ratio:{k}": v for k, v in view.ratios.items()},
        }
        spiked: dict[str, bool] = {}
        if prev is not None:  # the steps in between: counters and histograms since prev
            values["global"] = interval_point(
                view.global_norm,
                view.global_norm_buckets,
                prev.global_norm_buckets,
                counter_delta(view.nonfinite_steps, prev.nonfinite_steps),
            )
            spiked["global"] = counter_delta(view.global_spikes, prev.global_spikes) > 0
            for g, s in view.groups.items():
                p = prev.groups.get(g)
                if p is None:
                    continue
                values[f"group:{g}"] = interval_point(
                    s.norm,
                    s.norm_buckets,
                    p.norm_buckets,
                    counter_delta(s.nonfinite_steps, p.nonfinite_steps),
                )
                spiked[f"group:{g}"] = counter_delta(s.spikes, p.spikes) > 0
        undefined = {f"ratio:{k}" for k in view.ratios if ratio_undefined(view, k)}
        for key, value in values.items():
            if value is not None:
                self._series.setdefault(key, deque(maxlen=self.points)).append(value)
                for flags, flag in (
                    (self._spikes, spiked.get(key, False)),
                    (self._gaps, key in undefined),
                ):
                    marks = flags.setdefault(key, deque(maxlen=self.points))
                    while len(marks) < len(self._series[key]) - 1:
                        marks.appendleft(False)
                    marks.append(flag)
        return True

    def get(self, key: str) -> list[float]:
        return list(self._series.get(key, ()))

    def spikes(self, key: str) -> list[bool]:
        """Per point of :meth:`get`: whether its interval held a spike of the series."""
        return list(self._spikes.get(key, ()))

    def line(self, key: str, *, log: bool = True) -> str:
        if key == "health":
            return sparkline(self.get(key), lo=0.0, hi=1.0)
        chars = list(sparkline(self.get(key), log=log))
        for i, spike in enumerate(self.spikes(key)):
            if spike and chars[i] != NONFINITE_MARK:
                chars[i] = SPIKE_MARK
        for i, gap in enumerate(self._gaps.get(key, ())):
            if gap:
                chars[i] = UNDEFINED_MARK
        return "".join(chars)


# -- rendering ------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 4) -> str:
    """A number for a table cell: ``-`` when absent, ``nan``/``inf`` spelled out."""
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "no snapshot yet"
    if seconds < 0:  # clocks of two machines
        return "just now"
    if seconds < 120:
        return f"{seconds:.1f}s ago"
    return f"{seconds / 60:.1f}min ago"


def anomalies_text(view: EndpointView) -> Text:
    """The counters line: non-finite/exploding/AMP-skipped steps (and exporter trouble)."""
    text = Text("anomalies: ")
    text.append(
        f"non-finite steps {view.nonfinite_steps}",
        style="bold red" if view.nonfinite_steps else "green",
    )
    if view.nonfinite_origin:  # the per-rank view named where the last one started
        ranks = ", ".join(r for r, _ in view.nonfinite_origin)
        text.append(
            f" (last at step {view.nonfinite_origin_step} from rank {ranks})", style="bold red"
        )
    text.append(", ")
    text.append(
        f"exploding steps {view.exploding_steps}",
        style="bold red" if view.exploding_steps else "green",
    )
    text.append_text(spikes_text(view))
    if view.amp_skipped_steps:
        text.append(f", AMP-skipped steps {view.amp_skipped_steps}", style="yellow")
    text.append_text(skipped_text(view))
    if view.publish_errors or view.dropped:
        text.append(
            f", publish errors {view.publish_errors}, dropped {view.dropped}", style="yellow"
        )
    text.append_text(sinks_text(view))
    return text


def sinks_text(view: EndpointView) -> Text:
    """``, sink mlflow: errors 6, dropped 2`` for each sink that failed or lost steps; empty
    while every sink keeps up."""
    text = Text()
    for sink in sorted(set(view.sink_errors) | set(view.sink_dropped)):
        errors, dropped = view.sink_errors.get(sink, 0), view.sink_dropped.get(sink, 0)
        if errors or dropped:
            text.append(f", sink {sink}: errors {errors}, dropped {dropped}", style="yellow")
    return text


#: The optimizer-step guard's reasons of ``gradwatch_skipped_steps_total`` (the others are
#: skips outside the guard: AMP, DeepSpeed, silent ones).
GUARD_REASONS = ("nonfinite", "spike")


def skipped_text(view: EndpointView) -> Text:
    """``, guard-skipped steps 2 (nonfinite 1, spike 1)``, the run of skips in a row and a
    stopped guard (empty without a guard), then ``, optimizer skips: no_update 3`` for the
    other reasons that counted a skip."""
    text = Text()
    others = {r: n for r, n in view.skipped_steps.items() if r not in GUARD_REASONS and n}
    if others:
        listed = ", ".join(f"{r} {n}" for r, n in others.items())
        text.append(f", optimizer skips: {listed}", style="bold yellow")
    guarded = {r: n for r, n in view.skipped_steps.items() if r in GUARD_REASONS}
    if not guarded:
        return text
    total = sum(guarded.values())
    reasons = ", ".join(f"{r} {n}" for r, n in guarded.items())
    text.append(
        f", guard-skipped steps {total} ({reasons})", style="bold yellow" if total else "green"
    )
    if view.consecutive_skipped_steps:
        text.append(f", {view.consecutive_skipped_steps} in a row", style="bold yellow")
    if view.guard_stopped:
        text.append(", GUARD STOPPED (max_consecutive_skips)", style="bold red")
    return text


def spikes_text(view: EndpointView) -> Text:
    """``, spike steps: global 1, seed 1``: the spike counters (groups only when above 0)."""
    parts = [f"global {view.global_spikes}"]
    parts += [f"{g} {s.spikes}" for g, s in view.groups.items() if s.spikes]
    any_spike = view.global_spikes > 0 or len(parts) > 1
    text = Text(", ")
    text.append("spike steps: " + ", ".join(parts), style="bold magenta" if any_spike else "green")
    return text


def spike_scores_text(view: EndpointView) -> Text | None:
    """``spike score: global 0.4, host -0.2, seed 8.1`` (robust deviations above the recent
    median at the last step; see gradwatch.analysis.spikes); None when the endpoint exports none."""
    scores = [("global", view.global_spike_score)]
    scores += [(g, s.spike_score) for g, s in view.groups.items()]
    if all(v is None for _, v in scores):
        return None
    text = Text("spike score: ")
    for i, (name, value) in enumerate(scores):
        text.append(", " if i else "")
        text.append(f"{name} {fmt(value, 3)}")
    return text


def isolation_text(view: EndpointView) -> Text | None:
    """``isolation violations: stem 0, host 0`` (steps counted per group); None if none."""
    if not view.isolation_violations:
        return None
    text = Text("isolation violations: ")
    for i, (group, n) in enumerate(view.isolation_violations.items()):
        text.append(", " if i else "")
        text.append(f"{group} {n}", style="bold red" if n else "green")
    return text


def replica_text(view: EndpointView) -> Text | None:
    """``replicas: local norm min 0.98 / median 1 / max 3.1 (rank 3), outlier score 2.1``: the
    spread of the data-parallel replicas' pre-reduction norms (the per-rank view); the score is
    highlighted above :data:`~gradwatch.analysis.rankview.REPLICA_OUTLIER_THRESHOLD`, the alert's
    threshold. None when the endpoint exports none of it (no per-rank view): never zeros."""
    stats = [(k, view.replica_norm[k]) for k in ("min", "median", "max") if k in view.replica_norm]
    score = view.replica_outlier_score
    if not stats and score is None and view.replica_max_rank is None:
        return None
    text = Text("replicas: ")
    parts: list[Text] = []
    if stats:
        spread = Text("local norm " + " / ".join(f"{k} {fmt(v)}" for k, v in stats))
        if any(not math.isfinite(v) for _, v in stats):
            spread.stylize("bold red")
        parts.append(spread)
    if view.replica_max_rank is not None:
        parts.append(Text(f"max at rank {view.replica_max_rank}"))
    if score is not None:
        outlier = score > REPLICA_OUTLIER_THRESHOLD  # +Inf (a non-finite local norm) too
        part = Text(f"outlier score {fmt(score, 3)}", style="bold red" if outlier else "green")
        if outlier:
            part.append(f" (> {REPLICA_OUTLIER_THRESHOLD:g}: outlier replica)")
        parts.append(part)
    text.append_text(Text(", ").join(parts))
    return text


def straggler_text(view: EndpointView) -> Text | None:
    """``slowest rank 1 (node-b), straggler score 0.05, work s min 0.01 / median 0.011 / max
    0.21`` (``rank_timing``); the score highlighted below :data:`STRAGGLER_THRESHOLD`, the
    alert's threshold. None when the endpoint exports none of it: never zeros."""
    score = view.straggler_score
    if score is None and view.slowest_rank is None and not view.work_seconds:
        return None
    parts: list[Text] = []
    if view.slowest_rank is not None:
        parts.append(Text(f"slowest rank {view.slowest_rank} ({view.slowest_host or '?'})"))
    if score is not None:
        slow = score < STRAGGLER_THRESHOLD
        part = Text(f"straggler score {fmt(score, 3)}", style="bold red" if slow else "green")
        if slow:
            part.append(f" (< {STRAGGLER_THRESHOLD:g}: straggler)")
        parts.append(part)
    quantities = [(k, view.work_seconds[k]) for k in ("min", "median", "max")
                  if k in view.work_seconds]
    if quantities:
        parts.append(Text("work s " + " / ".join(f"{k} {fmt(v)}" for k, v in quantities)))
    return Text("ranks: ").append_text(Text(", ").join(parts))


def ratio_text(view: EndpointView, trends: Trends, key: str) -> Text:
    """``ratio seed/host 0.12 ▃▄▅``; an undefined ratio reads ``undefined (host has no
    gradient)``, dim: expected in a stage where the denominator is frozen, not an incident
    (a NaN from a non-finite gradient stays ``nan`` in bold red)."""
    value = view.ratios.get(key)
    if ratio_undefined(view, key):
        den = key.split("/", 1)[-1]
        line = Text(f"ratio {key} {UNDEFINED} ({den} has no gradient) ", style="dim")
    else:
        line = Text(f"ratio {key} {fmt(value)} ", style=_norm_style(value))
    line.append(trends.line(f"ratio:{key}"))
    return line


def fmt_ratio(view: EndpointView, key: str) -> str:
    """A ratio's value for a one-line summary: ``undefined`` when it is (see
    :func:`ratio_undefined`), else :func:`fmt`."""
    return UNDEFINED if ratio_undefined(view, key) else fmt(view.ratios.get(key))


def noise_scale_text(view: EndpointView) -> Text | None:
    """``gradient noise scale: model 1.2e+03, stem 850 [unit]``: B_simple of the whole model and
    per group (the per-rank view; ``undefined`` while it is, NaN at the endpoint), with the
    unit its metrics' HELP states. None when the endpoint exports none."""
    scales = [("model", view.noise_scale)] if view.noise_scale is not None else []
    scales += list(view.group_noise_scale.items())
    if not scales:
        return None
    text = Text("gradient noise scale: ")
    for i, (name, value) in enumerate(scales):  # NaN: undefined (noise dominates), no incident
        text.append(", " if i else "")
        if value is not None and math.isnan(value):
            text.append(f"{name} {UNDEFINED}", style="dim")
        else:
            text.append(f"{name} {fmt(value, 3)}")
    text.append(f"  [{NOISE_SCALE_UNIT}]", style="dim")
    return text


def updates_text(view: EndpointView) -> Text | None:
    """``updates: ratio host 1.2e-03, seed 4.1e-02; stalled seed 95%``: each group's
    update-to-weight ratio and stalled fraction (``update_stats``; NaN reads undefined). None
    when the endpoint exports neither."""
    if not view.update_ratio and not view.stalled_fraction:
        return None
    text = Text("updates: ratio ")
    text.append(", ".join(f"{g} {_or_undefined(v, 3)}" for g, v in view.update_ratio.items()))
    if view.stalled_fraction:
        text.append("; stalled ")
        for i, (g, v) in enumerate(view.stalled_fraction.items()):
            text.append(", " if i else "")
            shown = UNDEFINED if math.isnan(v) else f"{100 * v:.0f}%"
            text.append(f"{g} {shown}", style="bold yellow" if v > 0.5 else "")
    return text


def _or_undefined(value: float, digits: int) -> str:
    return UNDEFINED if math.isnan(value) else fmt(value, digits)


def _norm_style(value: float | None) -> str:
    if value is None:
        return ""
    return "bold red" if not math.isfinite(value) else ""


def _health_style(value: float | None) -> str:
    if value is None:
        return ""
    if value >= 0.9:
        return "green"
    return "yellow" if value >= 0.5 else "bold red"


def render_view(view: EndpointView, trends: Trends, *, now: float | None = None) -> RenderableType:
    """The endpoint's state as a rich renderable: summary line, groups table, ratios, counters.

    Plain enough to read when printed to a file (no color, box drawn with spaces).
    """
    head = Text()
    head.append(f"step {view.step if view.step is not None else '-'}", style="bold")
    head.append(f"   global norm {fmt(view.global_norm)} ", style=_norm_style(view.global_norm))
    head.append(trends.line("global"))
    head.append("   health ")
    head.append(fmt(view.health, 3), style=_health_style(view.health))
    head.append(" " + trends.line("health"))
    info = Text(
        f"world {view.world_size or '-'} ({view.parallelism or '-'})   "
        f"last collect {fmt_age(view.staleness(now))}",
        style="dim",
    )
    if view.clip_coef is not None:
        info.append(f"   clip coef {fmt(view.clip_coef, 3)}")

    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    table.add_column("group")
    table.add_column("norm", justify="right")
    table.add_column("trend (log)")
    table.add_column("numel", justify="right")
    table.add_column("vanish", justify="right")
    table.add_column("explode", justify="right")
    table.add_column("nonfinite", justify="right")
    for name, g in view.groups.items():
        isolated = view.isolation_violated.get(name)
        label = Text(name)
        if isolated is not None:
            label.append(
                " (isolated)" if not isolated else " (isolation violated)",
                style="dim" if not isolated else "bold red",
            )
        table.add_row(
            label,
            Text(fmt(g.norm), style=_norm_style(g.norm)),
            trends.line(f"group:{name}"),
            f"{int(g.numel)}",
            f"{int(g.vanishing)}",
            Text(f"{int(g.exploding)}", style="bold red" if g.exploding else ""),
            Text(f"{int(g.nonfinite)}", style="bold red" if g.nonfinite else ""),
        )
    parts: list[RenderableType] = [head, info, table]
    parts += [ratio_text(view, trends, key) for key in view.ratios]
    scores = spike_scores_text(view)
    if scores is not None:
        parts.append(scores)
    for line in (replica_text(view), noise_scale_text(view), updates_text(view),
                 straggler_text(view)):
        if line is not None:
            parts.append(line)
    parts.append(anomalies_text(view))
    isolation = isolation_text(view)
    if isolation is not None:
        parts.append(isolation)
    return Group(*parts)
