"""Reading a gradwatch endpoint: URL completion, one bounded HTTP GET, and the parse of its
exposition into an :class:`EndpointView`. Shared by ``gradwatch top`` and ``gradwatch demo``;
drawing the view is :mod:`gradwatch.cli.render`'s job.

* :func:`fetch` / :func:`scrape`: one HTTP GET (``urllib``, bounded by a timeout) and the parse.
  Every failure (connection refused, timeout, HTTP error, a page without gradwatch metrics) is a
  :class:`ScrapeError` whose message is a short reason fit for a status line: callers never
  show a traceback for a dead endpoint.
* :func:`parse_exposition`: the pure part (text in, :class:`EndpointView` out), built on
  ``prometheus_client.parser.text_string_to_metric_families`` and the metric names of
  :data:`gradwatch.export.METRICS` (a contract: nothing here invents a name).

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

from gradwatch.export import METRICS_BY_NAME

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
GLOBAL_SPIKE_SCORE = _name("gradwatch_global_grad_norm_spike_score")
SPIKE_SCORE = _name("gradwatch_grad_norm_spike_score")
GLOBAL_SPIKES = _name("gradwatch_global_grad_norm_spikes_total")
GROUP_SPIKES = _name("gradwatch_grad_norm_spikes_total")
NONFINITE_GROUP_STEPS = _name("gradwatch_nonfinite_group_steps_total")
GLOBAL_NORM_HIST = _name("gradwatch_global_grad_norm_per_step")
GROUP_NORM_HIST = _name("gradwatch_grad_norm_per_step")

#: A histogram as scraped: ``(upper bound, cumulative count)`` per bucket, ``+Inf`` last.
Buckets = tuple[tuple[float, float], ...]
LAST_ORIGIN = _name("gradwatch_last_nonfinite_origin")
# the per-rank view's gauges (absent without it: read as None/empty, never as zeros)
ORIGIN_RANKS = _name("gradwatch_nonfinite_origin_ranks")
REPLICA_NORM = _name("gradwatch_replica_grad_norm")
REPLICA_MAX_RANK = _name("gradwatch_replica_grad_norm_max_rank")
OUTLIER_SCORE = _name("gradwatch_replica_outlier_score")
NOISE_SCALE = _name("gradwatch_gradient_noise_scale")
GROUP_NOISE_SCALE = _name("gradwatch_group_gradient_noise_scale")
# the optimizer-step guard (absent without watch.guard())
SKIPPED_STEPS = _name("gradwatch_skipped_steps_total")
CONSECUTIVE_SKIPPED = _name("gradwatch_consecutive_skipped_steps")
GUARD_STOPPED = _name("gradwatch_guard_stopped")


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
    # the optimizer-step guard: reason -> skipped steps; empty/None without a guard
    skipped_steps: Mapping[str, int] = field(default_factory=dict)
    consecutive_skipped_steps: int | None = None
    guard_stopped: bool | None = None

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
        raise ScrapeError(f"HTTP {exc.code} {exc.reason}", UNREACHABLE) from exc
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


def parse_exposition(text: str) -> EndpointView:
    """The gradwatch figures of a Prometheus text exposition.

    Raises :class:`ScrapeError` when the text does not parse or holds no gradwatch metric
    (a URL pointing at some other exporter).
    """
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except Exception as exc:  # the parser raises ValueError and friends on malformed input
        raise ScrapeError(f"not a Prometheus exposition: {exc}", NOT_GRADWATCH) from exc
    single: dict[str, float] = {}
    by_group: dict[str, dict[str, float]] = {}
    ratios: dict[str, float] = {}
    violations: dict[str, int] = {}
    violated: dict[str, bool] = {}
    build: dict[str, str] = {}
    run: dict[str, str] = {}
    buckets: dict[str | None, list[tuple[float, float]]] = {}  # None: the global histogram
    origin: list[tuple[str, str]] = []
    origin_step: int | None = None
    replica_norm: dict[str, float] = {}
    group_noise: dict[str, float] = {}
    skipped: dict[str, int] = {}
    for s in samples:
        if not s.name.startswith("gradwatch_"):
            continue
        if s.name in (GLOBAL_NORM_HIST + "_bucket", GROUP_NORM_HIST + "_bucket"):
            key = s.labels.get("group") if s.name.startswith(GROUP_NORM_HIST) else None
            buckets.setdefault(key, []).append((float(s.labels.get("le", "nan")), s.value))
        elif s.name.startswith((GLOBAL_NORM_HIST + "_", GROUP_NORM_HIST + "_")):
            continue  # _count and _sum: the buckets say it all
        elif s.name == LAST_ORIGIN:
            origin.append((s.labels.get("rank", ""), s.labels.get("host", "")))
            origin_step = int(s.value) if math.isfinite(s.value) else None
        elif s.name == REPLICA_NORM:
            replica_norm[s.labels.get("stat", "")] = s.value
        elif s.name == SKIPPED_STEPS:
            skipped[s.labels.get("reason", "")] = _int(s.value)
        elif s.name == GROUP_NOISE_SCALE:  # labelled by group, but not a group's own gauge
            group_noise[s.labels.get("group", "")] = s.value
        elif s.name == RATIO:
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
        raise ScrapeError("no gradwatch metrics at this URL", NOT_GRADWATCH)
    groups = {
        g: GroupView(
            norm=m.get(GROUP_NORM, math.nan),
            numel=m.get(GROUP_NUMEL, 0.0),
            vanishing=m.get(VANISHING, 0.0),
            exploding=m.get(EXPLODING, 0.0),
            nonfinite=m.get(NONFINITE, 0.0),
            spike_score=m.get(SPIKE_SCORE),
            spikes=_int(m.get(GROUP_SPIKES, 0.0)),
            nonfinite_steps=_int(m.get(NONFINITE_GROUP_STEPS, 0.0)),
            norm_buckets=tuple(sorted(buckets.get(g, ()))),
        )
        for g, m in by_group.items()
    }

    def count(name: str) -> int:
        return _int(single.get(name, 0.0))

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
        global_spike_score=single.get(GLOBAL_SPIKE_SCORE),
        global_spikes=count(GLOBAL_SPIKES),
        global_norm_buckets=tuple(sorted(buckets.get(None, ()))),
        nonfinite_origin=tuple(sorted(origin, key=lambda o: (len(o[0]), o[0]))),
        nonfinite_origin_step=origin_step,
        nonfinite_origin_ranks=_opt_int(single.get(ORIGIN_RANKS)),
        replica_norm=replica_norm,
        replica_max_rank=_opt_int(single.get(REPLICA_MAX_RANK)),
        replica_outlier_score=single.get(OUTLIER_SCORE),
        noise_scale=single.get(NOISE_SCALE),
        group_noise_scale=group_noise,
        skipped_steps=skipped,
        consecutive_skipped_steps=_opt_int(single.get(CONSECUTIVE_SKIPPED)),
        guard_stopped=None if GUARD_STOPPED not in single else single[GUARD_STOPPED] >= 0.5,
    )


def _int(value: float) -> int:
    """A counter's value as an int (0 when not finite)."""
    return int(value) if math.isfinite(value) else 0


def _opt_int(value: float | None) -> int | None:
    """A gauge holding a count or a rank as an int (None when absent or not finite)."""
    return int(value) if value is not None and math.isfinite(value) else None


def scrape(url: str, timeout: float = DEFAULT_TIMEOUT) -> EndpointView:
    """:func:`fetch` then :func:`parse_exposition`; raises :class:`ScrapeError` only."""
    return parse_exposition(fetch(url, timeout))
