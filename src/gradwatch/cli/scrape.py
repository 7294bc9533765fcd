"""Read a gradwatch endpoint and render it: shared by ``gradwatch top`` and ``gradwatch demo``.

Three layers, each usable alone:

* :func:`fetch` / :func:`scrape`: one HTTP GET (``urllib``, bounded by a timeout) and the parse
  of the exposition into an :class:`EndpointView`. Every failure (connection refused, timeout,
  HTTP error, a page without gradwatch metrics) is a :class:`ScrapeError` whose message is a
  short reason fit for a status line: callers never show a traceback for a dead endpoint.
* :func:`parse_exposition`: the pure part (text in, :class:`EndpointView` out), built on
  ``prometheus_client.parser.text_string_to_metric_families`` and the metric names of
  :data:`gradwatch.export.METRICS` (a contract: nothing here invents a name).
* :class:`Trends` and :func:`sparkline`: recent values per series, drawn with the unicode blocks
  ``▁▂▃▄▅▆▇█``; :func:`render_view` builds the rich renderable both commands display.

Sparklines of norms use a log scale: gradient norms move by decades (an exploding step is 1e6
times the others) and a linear scale would flatten everything but the spike. A non-finite value
is drawn ``!`` and an exact zero (a group without gradient) ``·``, so both stay visible. A trend
gains a point only when a scrape shows a new step: scraping a paused job does not draw a
plateau that never happened.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from gradwatch.export import METRICS_BY_NAME

#: The eight block characters of a sparkline, lowest first.
BLOCKS = "▁▂▃▄▅▆▇█"
#: Drawn for NaN/Inf in a sparkline.
NONFINITE_MARK = "!"
#: Drawn for an exact zero on a log-scale sparkline (e.g. a group that had no gradient).
ZERO_MARK = "·"
#: Points kept per trend (the width of the sparklines).
TREND_POINTS = 16

DEFAULT_TIMEOUT = 2.0


class ScrapeError(Exception):
    """The endpoint could not be read or is not a gradwatch endpoint; ``str()`` is the reason."""


def _name(metric: str) -> str:
    """``metric`` after checking it is one of gradwatch's exported names (the contract)."""
    if metric not in METRICS_BY_NAME:  # pragma: no cover - guards against typos in this module
        raise KeyError(f"not a gradwatch metric: {metric}")
    return metric


STEP = _name("gradwatch_step")
TIMESTAMP = _name("gradwatch_last_collect_timestamp_seconds")
GLOBAL_NORM = _name("gradwatch_global_grad_norm")
GROUP_NORM = _name("gradwatch_grad_norm")
RATIO = _name("gradwatch_grad_norm_ratio")
GROUP_NUMEL = _name("gradwatch_group_parameters")
VANISHING = _name("gradwatch_vanishing_tensors")
EXPLODING = _name("gradwatch_exploding_tensors")
NONFINITE = _name("gradwatch_nonfinite_tensors")
HEALTH = _name("gradwatch_health_score")
ISOLATION = _name("gradwatch_isolation_violated")
CLIP_COEF = _name("gradwatch_clip_coef")
COLLECTIONS = _name("gradwatch_collections_total")
NONFINITE_STEPS = _name("gradwatch_nonfinite_steps_total")
AMP_SKIPPED_STEPS = _name("gradwatch_amp_skipped_steps_total")
EXPLODING_STEPS = _name("gradwatch_exploding_steps_total")
ISOLATION_VIOLATIONS = _name("gradwatch_isolation_violations_total")
PUBLISH_ERRORS = _name("gradwatch_publish_errors_total")
DROPPED = _name("gradwatch_dropped_snapshots_total")
BUILD_INFO = _name("gradwatch_build_info")
RUN_INFO = _name("gradwatch_run_info")


@dataclass(frozen=True)
class GroupView:
    """One group's gauges at the published step (``gradwatch_*{group=...}``)."""

    norm: float = math.nan
    numel: float = 0.0
    vanishing: float = 0.0
    exploding: float = 0.0
    nonfinite: float = 0.0


@dataclass(frozen=True)
class EndpointView:
    """What one scrape of a gradwatch endpoint says.

    Per-step gauges are ``None`` (or empty) before the job published its first snapshot, as the
    endpoint leaves them absent then. Counters are always present (0 at start).
    """

    step: int | None = None
    timestamp: float | None = None
    global_norm: float | None = None
    health: float | None = None
    clip_coef: float | None = None
    groups: Mapping[str, GroupView] = field(default_factory=dict)
    ratios: Mapping[str, float] = field(default_factory=dict)
    isolation_violated: Mapping[str, bool] = field(default_factory=dict)
    isolation_violations: Mapping[str, int] = field(default_factory=dict)
    collections: int = 0
    nonfinite_steps: int = 0
    amp_skipped_steps: int = 0
    exploding_steps: int = 0
    publish_errors: int = 0
    dropped: int = 0
    version: str | None = None
    world_size: str | None = None
    parallelism: str | None = None

    def staleness(self, now: float | None = None) -> float | None:
        """Seconds since the job collected the published step (None before the first one)."""
        if self.timestamp is None:
            return None
        return (time.time() if now is None else now) - self.timestamp


def normalize_url(url: str) -> str:
    """``host:port`` -> ``http://host:port/metrics``; a full URL is kept as given."""
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/metrics")
    return urllib.parse.urlunsplit(parts)


def fetch(url: str, timeout: float = DEFAULT_TIMEOUT) -> str:
    """GET ``url`` and return the body; any failure is a :class:`ScrapeError` with a reason."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    try:
        with _opener(url).open(request, timeout=timeout) as response:
            return response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"HTTP {exc.code} {exc.reason}") from exc
    except urllib.error.URLError as exc:
        reason = exc.reason
        text = getattr(reason, "strerror", None) or str(reason)
        raise ScrapeError(text) from exc
    except TimeoutError as exc:
        raise ScrapeError(f"timed out after {timeout:g}s") from exc
    except (OSError, ValueError) as exc:  # reset connections, malformed URLs, ...
        raise ScrapeError(str(exc) or type(exc).__name__) from exc


def _opener(url: str) -> urllib.request.OpenerDirector:
    """urllib's default opener, except that loopback URLs never go through an HTTP proxy
    (a ``http_proxy`` set without ``no_proxy`` would otherwise send local scrapes away)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("localhost", "127.0.0.1", "::1"):
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def parse_exposition(text: str) -> EndpointView:
    """The gradwatch figures of a Prometheus text exposition.

    Raises :class:`ScrapeError` when the text does not parse or holds no gradwatch metric
    (a URL pointing at some other exporter).
    """
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as exc:  # the parser raises ValueError and friends on malformed input
        raise ScrapeError(f"not a Prometheus exposition: {exc}") from exc
    single: dict[str, float] = {}
    by_group: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    violations: dict[str, int] = {}
    violated: dict[str, bool] = {}
    build: dict[str, str] = {}
    run: dict[str, str] = {}
    for s in samples:
        if not s.name.startswith("gradwatch_"):
            continue
        if s.name == RATIO:
            ratios[f"{s.labels.get('numerator')}/{s.labels.get('denominator')}"] = s.value
        elif s.name == ISOLATION:
            violated[s.labels.get("group", "")] = s.value >= 0.5
        elif s.name == ISOLATION_VIOLATIONS:
            violations[s.labels.get("group", "")] = int(s.value)
        elif s.name == BUILD_INFO:
            build = dict(s.labels)
        elif s.name == RUN_INFO:
            run = dict(s.labels)
        elif "group" in s.labels:
            by_group.setdefault(s.labels["group"], {})[s.name] = s.value
        elif not s.labels:
            single[s.name] = s.value
    if not single and not by_group and not build:
        raise ScrapeError("no gradwatch metrics at this URL")
    groups = {
        g: GroupView(
            norm=m.get(GROUP_NORM, math.nan),
            numel=m.get(GROUP_NUMEL, 0.0),
            vanishing=m.get(VANISHING, 0.0),
            exploding=m.get(EXPLODING, 0.0),
            nonfinite=m.get(NONFINITE, 0.0),
        )
        for g, m in by_group.items()
    }

    def count(name: str) -> int:
        value = single.get(name, 0.0)
        return int(value) if math.isfinite(value) else 0

    step = single.get(STEP)
    return EndpointView(
        step=int(step) if step is not None and math.isfinite(step) else None,
        timestamp=single.get(TIMESTAMP),
        global_norm=single.get(GLOBAL_NORM),
        health=single.get(HEALTH),
        clip_coef=single.get(CLIP_COEF),
        groups=groups,
        ratios=ratios,
        isolation_violated=violated,
        isolation_violations=violations,
        collections=count(COLLECTIONS),
        nonfinite_steps=count(NONFINITE_STEPS),
        amp_skipped_steps=count(AMP_SKIPPED_STEPS),
        exploding_steps=count(EXPLODING_STEPS),
        publish_errors=count(PUBLISH_ERRORS),
        dropped=count(DROPPED),
        version=build.get("version"),
        world_size=run.get("world_size"),
        parallelism=run.get("parallelism"),
    )


def scrape(url: str, timeout: float = DEFAULT_TIMEOUT) -> EndpointView:
    """:func:`fetch` then :func:`parse_exposition`; raises :class:`ScrapeError` only."""
    return parse_exposition(fetch(url, timeout))


# -- trends and sparklines ------------------------------------------------------------------


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


class Trends:
    """The last :data:`TREND_POINTS` values of every displayed series, one point per new step."""

    def __init__(self, points: int = TREND_POINTS) -> None:
        self.points = points
        self._series: dict[str, deque[float]] = {}
        self._last_step: int | None = None

    def add(self, view: EndpointView) -> bool:
        """Record ``view`` if it shows a step not recorded yet; returns whether it did."""
        if view.step is None or view.step == self._last_step:
            return False
        self._last_step = view.step
        values: dict[str, float | None] = {
            "global": view.global_norm,
            "health": view.health,
            **{f"group:{g}": s.norm for g, s in view.groups.items()},
            **{f"ratio:{k}": v for k, v in view.ratios.items()},
        }
        for key, value in values.items():
            if value is not None:
                self._series.setdefault(key, deque(maxlen=self.points)).append(value)
        return True

    def get(self, key: str) -> list[float]:
        return list(self._series.get(key, ()))

    def line(self, key: str, *, log: bool = True) -> str:
        if key == "health":
            return sparkline(self.get(key), lo=0.0, hi=1.0)
        return sparkline(self.get(key), log=log)


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
    text.append(", ")
    text.append(
        f"exploding steps {view.exploding_steps}",
        style="bold red" if view.exploding_steps else "green",
    )
    if view.amp_skipped_steps:
        text.append(f", AMP-skipped steps {view.amp_skipped_steps}", style="yellow")
    if view.publish_errors or view.dropped:
        text.append(
            f", publish errors {view.publish_errors}, dropped {view.dropped}", style="yellow"
        )
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
    for key, value in view.ratios.items():
        line = Text(f"ratio {key} {fmt(value)} ", style=_norm_style(value))
        line.append(trends.line(f"ratio:{key}"))
        parts.append(line)
    parts.append(anomalies_text(view))
    isolation = isolation_text(view)
    if isolation is not None:
        parts.append(isolation)
    return Group(*parts)
