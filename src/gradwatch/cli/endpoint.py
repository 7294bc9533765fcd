"""Reading a gradwatch endpoint: URL completion, one bounded HTTP GET, and the parse of its
exposition into an :class:`EndpointView`. Shared by ``gradwatch top`` and ``gradwatch demo``;
drawing the view is :mod:`gradwatch.cli.render`'s job.

* :func:`fetch` / :func:`scrape`: one HTTP GET (``urllib``, bounded by a timeout) and the parse.
  Every failure (connection refused, timeout, HTTP error, a page without gradwatch metrics) is a
  :class:`ScrapeError` whose message is a short reason fit for a status line: callers never
  show a traceback for a dead endpoint.
* :func:`parse_exposition`: the pure part (text in, :class:`EndpointView` out), built on
  ``prometheus_client.parser.text_string_to_metric_families`` and the catalog's definitions
  (:mod:`gradwatch.export.metrics`): each sample is matched to its ``MetricDef`` and read by
  that definition's labels and type, so nothing here restates a name or a label.

The counters (``gradwatch_nonfinite_steps_total`` and friends) are read as the exporter counts
them, with :class:`gradwatch.Snapshot`'s step classification; nothing here re-classifies a step.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from gradwatch.config import ratio_key
from gradwatch.export import metrics as catalog
from gradwatch.export import rankmetrics as ranks
from gradwatch.export.metricdef import MetricDef

#: Seconds a scrape may take unless the caller says otherwise.
DEFAULT_TIMEOUT = 2.0


class ScrapeError(Exception):
    """The endpoint could not be read (:attr:`kind` :data:`UNREACHABLE`) or answered with
    something that is not a gradwatch exposition (:data:`NOT_GRADWATCH`); ``str()`` is the
    reason, short enough for a status line."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


#: No answer: refused, timed out, an HTTP error, a malformed URL.
UNREACHABLE = "unreachable"
#: An answer, but not a gradwatch endpoint (another exporter, a web page).
NOT_GRADWATCH = "not a gradwatch endpoint"


#: A histogram as scraped: ``(upper bound, cumulative count)`` per bucket, ``+Inf`` last.
Buckets = tuple[tuple[float, float], ...]

#: Each exposed sample name of the catalog -> its definition. A histogram is read from its
#: ``_bucket`` samples (its ``_sum`` and ``_count`` add nothing the view shows).
_BY_SAMPLE: Mapping[str, MetricDef] = {
    (d.name + "_bucket" if d.type == "histogram" else d.name): d for d in catalog.METRICS
}

#: The per-group metrics a :class:`GroupView` shows; a group appears when one of them names it.
_GROUP_METRICS = (
    catalog.GRAD_NORM,
    catalog.GROUP_PARAMETERS,
    catalog.VANISHING_TENSORS,
    catalog.EXPLODING_TENSORS,
    catalog.NONFINITE_TENSORS,
    catalog.GRAD_NORM_SPIKE_SCORE,
    catalog.GRAD_NORM_SPIKES_TOTAL,
    catalog.NONFINITE_GROUP_STEPS_TOTAL,
)


@dataclass(frozen=True)
class GroupView:
    """One group's gauges at the published step (``gradwatch_*{group=...}``)."""

    norm: float = math.nan
    numel: float = 0.0
    vanishing: float = 0.0
    exploding: float = 0.0
    nonfinite: float = 0.0
    # every published step (counters and the norm histogram), for what happened between scrapes
    spike_score: float | None = None
    spikes: int = 0
    nonfinite_steps: int = 0
    norm_buckets: Buckets = ()


@dataclass(frozen=True)
class EndpointView:
    """What one scrape of a gradwatch endpoint says: each field is one catalog metric's
    series as :func:`parse_exposition` read them (the figures ``top`` and the demo draw).

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
    # per sink (history, trackers, user sinks): failed or stalled writes, steps never received
    sink_errors: Mapping[str, int] = field(default_factory=dict)
    sink_dropped: Mapping[str, int] = field(default_factory=dict)
    version: str | None = None
    world_size: str | None = None
    parallelism: str | None = None
    global_spike_score: float | None = None
    global_spikes: int = 0
    global_norm_buckets: Buckets = ()
    # the per-rank view: ranks (and hosts) where the last non-finite step started, its step
    nonfinite_origin: tuple[tuple[str, str], ...] = ()
    nonfinite_origin_step: int | None = None
    # the per-rank view at the published step: None/empty when the endpoint does not export it
    nonfinite_origin_ranks: int | None = None
    replica_norm: Mapping[str, float] = field(default_factory=dict)  # stat -> local norm
    replica_max_rank: int | None = None
    replica_outlier_score: float | None = None
    noise_scale: float | None = None
    group_noise_scale: Mapping[str, float] = field(default_factory=dict)
    # which rank is slow (rank_timing): None/empty when the endpoint does not export it
    slowest_rank: int | None = None
    slowest_host: str | None = None
    straggler_score: float | None = None
    work_seconds: Mapping[str, float] = field(default_factory=dict)  # quantity -> seconds
    # the optimizer-step guard: reason -> skipped steps; empty/None without a guard
    skipped_steps: Mapping[str, int] = field(default_factory=dict)
    consecutive_skipped_steps: int | None = None
    guard_stopped: bool | None = None
    # update_stats: group -> figure at the published step; empty where not measured
    update_ratio: Mapping[str, float] = field(default_factory=dict)
    stalled_fraction: Mapping[str, float] = field(default_factory=dict)

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
        # gradwatch answers every path: a 404 or 405 is some other server on that port
        kind = NOT_GRADWATCH if exc.code in (404, 405) else UNREACHABLE
        raise ScrapeError(f"HTTP {exc.code} {exc.reason}", kind) from exc
    except urllib.error.URLError as exc:
        reason = exc.reason
        text = getattr(reason, "strerror", None) or str(reason)
        raise ScrapeError(text, UNREACHABLE) from exc
    except TimeoutError as exc:
        raise ScrapeError(f"timed out after {timeout:g}s", UNREACHABLE) from exc
    except (OSError, ValueError) as exc:  # reset connections, malformed URLs, ...
        raise ScrapeError(str(exc) or type(exc).__name__, UNREACHABLE) from exc


def _opener(url: str) -> urllib.request.OpenerDirector:
    """urllib's default opener, except that loopback URLs never go through an HTTP proxy
    (a ``http_proxy`` set without ``no_proxy`` would otherwise send local scrapes away)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("localhost", "127.0.0.1", "::1"):
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


#: What a scrape holds per metric: ``(label values in the definition's order, value)``.
_Found = Mapping[MetricDef, list[tuple[tuple[str, ...], float]]]


def parse_exposition(text: str) -> EndpointView:
    """The gradwatch figures of a Prometheus text exposition.

    Raises :class:`ScrapeError` when the text does not parse or holds no gradwatch metric
    (a URL pointing at some other exporter).
    """
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as exc:  # the parser raises ValueError and friends on malformed input
        raise ScrapeError(f"not a Prometheus exposition: {exc}", NOT_GRADWATCH) from exc
    found: dict[MetricDef, list[tuple[tuple[str, ...], float]]] = {}
    buckets: dict[MetricDef, dict[tuple[str, ...], list[tuple[float, float]]]] = {}
    for s in samples:
        d = _BY_SAMPLE.get(s.name)
        if d is None:
            continue
        labels = tuple(s.labels.get(name, "") for name in d.labels)
        if d.type == "histogram":
            le = float(s.labels.get("le", "nan"))
            buckets.setdefault(d, {}).setdefault(labels, []).append((le, s.value))
        else:
            found.setdefault(d, []).append((labels, s.value))
    if not found and not buckets:
        raise ScrapeError("no gradwatch metrics at this URL", NOT_GRADWATCH)
    single = {d: v for d, series in found.items() if not d.labels for _, v in series}
    per_group: dict[str, dict[MetricDef, float]] = {}
    for d in _GROUP_METRICS:
        for (group,), v in found.get(d, ()):
            per_group.setdefault(group, {})[d] = v
    norm_buckets = buckets.get(catalog.GRAD_NORM_PER_STEP, {})
    groups = {
        g: GroupView(
            norm=v.get(catalog.GRAD_NORM, math.nan),
            numel=v.get(catalog.GROUP_PARAMETERS, 0.0),
            vanishing=v.get(catalog.VANISHING_TENSORS, 0.0),
            exploding=v.get(catalog.EXPLODING_TENSORS, 0.0),
            nonfinite=v.get(catalog.NONFINITE_TENSORS, 0.0),
            spike_score=v.get(catalog.GRAD_NORM_SPIKE_SCORE),
            spikes=_int(v.get(catalog.GRAD_NORM_SPIKES_TOTAL, 0.0)),
            nonfinite_steps=_int(v.get(catalog.NONFINITE_GROUP_STEPS_TOTAL, 0.0)),
            norm_buckets=tuple(sorted(norm_buckets.get((g,), ()))),
        )
        for g, v in per_group.items()
    }

    def count(d: MetricDef) -> int:
        return _int(single.get(d, 0.0))

    origin = found.get(catalog.LAST_NONFINITE_ORIGIN, [])
    version = _info(found, catalog.BUILD_INFO)[0]
    world_size, parallelism, _ = _info(found, catalog.RUN_INFO)
    return EndpointView(
        step=_opt_int(single.get(catalog.STEP)),
        timestamp=single.get(catalog.LAST_COLLECT_TIMESTAMP_SECONDS),
        global_norm=single.get(catalog.GLOBAL_GRAD_NORM),
        health=single.get(catalog.HEALTH_SCORE),
        clip_coef=single.get(catalog.CLIP_COEF),
        groups=groups,
        ratios={ratio_key(*pair): v for pair, v in found.get(catalog.GRAD_NORM_RATIO, ())},
        isolation_violated={g: v >= 0.5 for (g,), v in found.get(catalog.ISOLATION_VIOLATED, ())},
        isolation_violations={
            g: int(v) for (g,), v in found.get(catalog.ISOLATION_VIOLATIONS_TOTAL, ())
        },
        collections=count(catalog.COLLECTIONS_TOTAL),
        nonfinite_steps=count(catalog.NONFINITE_STEPS_TOTAL),
        amp_skipped_steps=count(catalog.AMP_SKIPPED_STEPS_TOTAL),
        exploding_steps=count(catalog.EXPLODING_STEPS_TOTAL),
        publish_errors=count(catalog.PUBLISH_ERRORS_TOTAL),
        dropped=count(catalog.DROPPED_SNAPSHOTS_TOTAL),
        sink_errors={k: _int(v) for (k,), v in found.get(catalog.SINK_ERRORS_TOTAL, ())},
        sink_dropped={k: _int(v) for (k,), v in found.get(catalog.SINK_DROPPED_STEPS_TOTAL, ())},
        version=version,
        world_size=world_size,
        parallelism=parallelism,
        global_spike_score=single.get(catalog.GLOBAL_GRAD_NORM_SPIKE_SCORE),
        global_spikes=count(catalog.GLOBAL_GRAD_NORM_SPIKES_TOTAL),
        global_norm_buckets=tuple(
            sorted(buckets.get(catalog.GLOBAL_GRAD_NORM_PER_STEP, {}).get((), ()))
        ),
        nonfinite_origin=tuple(sorted((o for o, _ in origin), key=lambda o: (len(o[0]), o[0]))),
        nonfinite_origin_step=_opt_int(origin[-1][1]) if origin else None,
        nonfinite_origin_ranks=_opt_int(single.get(catalog.NONFINITE_ORIGIN_RANKS)),
        replica_norm={stat: v for (stat,), v in found.get(catalog.REPLICA_GRAD_NORM, ())},
        replica_max_rank=_opt_int(single.get(catalog.REPLICA_GRAD_NORM_MAX_RANK)),
        replica_outlier_score=single.get(catalog.REPLICA_OUTLIER_SCORE),
        noise_scale=single.get(catalog.GRADIENT_NOISE_SCALE),
        group_noise_scale={g: v for (g,), v in found.get(catalog.GROUP_GRADIENT_NOISE_SCALE, ())},
        slowest_rank=next((_opt_int(v) for _, v in found.get(ranks.SLOWEST_RANK, ())), None),
        slowest_host=next((h for (h,), _ in found.get(ranks.SLOWEST_RANK, ())), None),
        straggler_score=single.get(ranks.STRAGGLER_SCORE),
        work_seconds={q: v for (q,), v in found.get(ranks.RANK_WORK_SECONDS, ())},
        skipped_steps={r: _int(v) for (r,), v in found.get(catalog.SKIPPED_STEPS_TOTAL, ())},
        consecutive_skipped_steps=_opt_int(single.get(catalog.CONSECUTIVE_SKIPPED_STEPS)),
        guard_stopped=None
        if catalog.GUARD_STOPPED not in single
        else single[catalog.GUARD_STOPPED] >= 0.5,
        update_ratio={g: v for (g,), v in found.get(catalog.UPDATE_RATIO, ())},
        stalled_fraction={g: v for (g,), v in found.get(catalog.STALLED_UPDATE_FRACTION, ())},
    )


def _info(found: _Found, d: MetricDef) -> tuple[str | None, ...]:
    """The label values of an info metric, in the definition's order (None when absent)."""
    series = found.get(d)
    return series[-1][0] if series else (None,) * len(d.labels)


def _int(value: float) -> int:
    """A counter's value as an int (0 when not finite)."""
    return int(value) if math.isfinite(value) else 0


def _opt_int(value: float | None) -> int | None:
    """A gauge holding a count or a rank as an int (None when absent or not finite)."""
    return int(value) if value is not None and math.isfinite(value) else None


def scrape(url: str, timeout: float = DEFAULT_TIMEOUT) -> EndpointView:
    """:func:`fetch` then :func:`parse_exposition`; raises :class:`ScrapeError` only."""
    return parse_exposition(fetch(url, timeout))
