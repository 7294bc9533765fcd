"""The Prometheus endpoint: a custom Collector over one immutable published state.

Only global rank 0 builds a :class:`MetricsServer` (the facade decides). Three threads touch it:

* the **training thread** calls :meth:`MetricsServer.submit` (appends the pending result of a
  collect to a bounded queue, under a lock held for a few microseconds; never waits, never
  raises) and :meth:`MetricsServer.observe_collect_seconds` (one histogram update);
* the **publisher thread** (``gradwatch-publisher``, a daemon) takes pending results in order,
  materializes them (``pending.result()``: the wait for the all-reduce and the host-side
  summary) and publishes them: it builds a new immutable :class:`_State` (every sample of every
  snapshot-derived gauge and counter) and swaps it in under a lock; then it hands the snapshot
  to the extra sinks (the history file of ``WatchConfig.history_path``). Without an endpoint
  the same thread runs for the sinks alone (:class:`SnapshotPublisher`);
* **scrapes** (one thread per HTTP request) read the current state once, so a scrape never
  shows half of one step and half of another. Equal states render once (a cache keyed by the
  state's version), and at most ``MAX_SCRAPES_PER_SECOND`` scrapes are served, so scrapers
  cannot take more than a few percent of the training process's time (:class:`_ScrapeApp`).

If publishing falls behind, the oldest pending result is dropped (``MAX_PENDING`` are kept) and
counted in ``gradwatch_dropped_snapshots_total``. An exception while materializing or
publishing is logged once per kind, counted in ``gradwatch_publish_errors_total``, and the next
step is published as usual: nothing the exporter does can raise into the training loop.

The metric names are a contract (rules, dashboards and outside checks use them): they are all
declared in :data:`METRICS`, which both the Collector and the generated reference
(``python -m gradwatch.export --markdown > docs/metrics.md``) read.
"""

from __future__ import annotations

import argparse
import bisect
import errno
import ipaddress
import logging
import math
import socket
import ssl
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from socketserver import ThreadingMixIn
from types import MappingProxyType
from typing import Any, Literal, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from gradwatch.config import WatchConfig, ratio_key
from gradwatch.errors import GradWatchError, PortInUseError
from gradwatch.snapshot import Snapshot

log = logging.getLogger(__name__)

#: At most this many ``gradwatch_param_grad_norm`` series per scrape, whatever
#: ``param_metrics_top_k`` is and however many parameters are non-finite, so a 10,000-parameter
#: model can never create 10,000 series.
MAX_PARAM_SERIES = 200

#: Pending results waiting for the publisher; a submit beyond this drops the oldest one.
#: Small on purpose: a few steps absorb scheduling jitter, more would only publish stale steps.
MAX_PENDING = 4

#: Upper bounds (seconds) of the ``gradwatch_collect_seconds`` buckets: collect() queues work
#: and normally takes 0.1-10 ms; the upper buckets catch host syncs and pathological models.
COLLECT_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

#: How long interpreter exit waits for the publisher and the HTTP server of a server nobody
#: closed (a collective stuck on a dead peer must not hold the exit for minutes).
EXIT_CLOSE_TIMEOUT = 2.0

#: The endpoint serves at most this many scrapes per second (bursts of ``SCRAPE_BURST``); more
#: wait their turn. Prometheus scrapes every 15-60 s, an HA pair, Grafana and `gradwatch top`
#: stay far below this, so only a runaway client ever waits. A served scrape costs the training
#: process about 2 ms of Python under the GIL, plus its HTTP threads' wake-ups: measured on 2
#: cores with 20 back-to-back scrapers, a 2-rank DDP step was ~15% slower at 50/s and +3% to
#: +7% at 10/s over six `make bench` runs (the target is 5%); hence 5/s.
MAX_SCRAPES_PER_SECOND = 5.0
SCRAPE_BURST = 5
#: Requests whose User-Agent starts with this (Prometheus's own scrapes) bypass the bound.
PROMETHEUS_USER_AGENT = "Prometheus/"
# A request that would wait longer than this for its turn gets 503 at once instead of piling up
# threads (at 5/s that is 25 requests queued).
_MAX_SCRAPE_WAIT = 5.0

# A request thread that cannot read its request (a stalled client, a half-done TLS handshake)
# gives up after this long, so it cannot pile up threads forever.
_REQUEST_TIMEOUT = 30.0

MetricType = Literal["gauge", "counter", "histogram", "info"]


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: the single source of the Collector and of docs/metrics.md.

    Attributes:
        name: the exposed name (counters include ``_total``, info metrics ``_info``).
        type: Prometheus type.
        labels: label names, in order (histogram ``le`` not included).
        help: the HELP text, one sentence.
        notes: extra documentation for docs/metrics.md (when the series is absent, etc.).
    """

    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str
    notes: str = ""


METRICS: tuple[MetricDef, ...] = (
    # -- gauges of the last published snapshot (absent until the first one) --------------------
    MetricDef(
        "gradwatch_step",
        "gauge",
        (),
        "Training step of the last published snapshot.",
        "Absent until the first snapshot is published: gauges never show zeros that were "
        "not measured.",
    ),
    MetricDef(
        "gradwatch_last_collect_timestamp_seconds",
        "gauge",
        (),
        "Wall-clock time (Unix seconds) of the collect() call of the last published snapshot.",
    ),
    MetricDef(
        "gradwatch_global_grad_norm",
        "gauge",
        (),
        "L2 norm of all gradients of the whole model at the last published step.",
        "NaN or +Inf when a gradient holds NaN or Inf.",
    ),
    MetricDef(
        "gradwatch_grad_norm",
        "gauge",
        ("group",),
        "L2 norm of the gradients of one parameter group at the last published step.",
        "Configured groups always appear; `other` only when some parameter matched no pattern.",
    ),
    MetricDef(
        "gradwatch_grad_norm_ratio",
        "gauge",
        ("numerator", "denominator"),
        "Normalized gradient-norm ratio of two groups: (n_norm/sqrt(n_numel)) / "
        "(d_norm/sqrt(d_numel) + 1e-8).",
        "One series per configured `ratios` pair; 0 when either norm is below 1e-8 or either "
        "group has no gradient.",
    ),
    MetricDef(
        "gradwatch_group_parameters",
        "gauge",
        ("group",),
        "Number of gradient elements (numel) of the group's parameters that had a gradient.",
    ),
    MetricDef(
        "gradwatch_vanishing_tensors",
        "gauge",
        ("group",),
        "Parameters of the group whose gradient L2 norm is below vanishing_threshold.",
    ),
    MetricDef(
        "gradwatch_exploding_tensors",
        "gauge",
        ("group",),
        "Parameters of the group whose gradient L2 norm is above exploding_threshold or "
        "non-finite.",
    ),
    MetricDef(
        "gradwatch_nonfinite_tensors",
        "gauge",
        ("group",),
        "Parameters of the group whose gradient holds NaN or Inf.",
    ),
    MetricDef(
        "gradwatch_health_score",
        "gauge",
        (),
        "Gradient health in [0, 1]: clamp(1 - 0.5*vanishing/n - 0.8*exploding/n); 0 when the "
        "global norm is non-finite.",
        "n is the number of parameters with a gradient; 1 when no parameter has one.",
    ),
    MetricDef(
        "gradwatch_isolation_violated",
        "gauge",
        ("group",),
        "1 when an isolated group's gradient norm exceeds isolation_threshold (or is "
        "non-finite) at the last published step, else 0.",
        "One series per `isolated` group.",
    ),
    MetricDef(
        "gradwatch_replica_divergence",
        "gauge",
        (),
        "Relative spread (max - min) / max of the data-parallel replicas' global norms at the "
        "last measurement.",
        "Measured every `divergence_every` collected steps; between measurements the last "
        "value is kept; 0 when identical or never measured.",
    ),
    MetricDef(
        "gradwatch_clip_coef",
        "gauge",
        (),
        "Clip coefficient min(1, max_norm / (norm + 1e-6)) applied by "
        "GradWatch.clip_grad_norm_ at the last published step.",
        "Absent when the last published step was not clipped through gradwatch.",
    ),
    MetricDef(
        "gradwatch_param_grad_norm",
        "gauge",
        ("param",),
        "Gradient L2 norm of one parameter: the param_metrics_top_k largest finite norms plus "
        "every non-finite one.",
        f"Only when `param_metrics_top_k` > 0. At most {MAX_PARAM_SERIES} series "
        "(`MAX_PARAM_SERIES`): non-finite parameters first (by name), then the largest finite "
        "norms (ties by name). Series come and go as the ranking changes.",
    ),
    # -- counters of published snapshots -------------------------------------------------------
    MetricDef(
        "gradwatch_collections_total",
        "counter",
        (),
        "Snapshots published (collected steps that reached the exporter).",
    ),
    MetricDef(
        "gradwatch_nonfinite_steps_total",
        "counter",
        (),
        "Published snapshots with a NaN or Inf gradient, except steps the AMP GradScaler skipped.",
    ),
    MetricDef(
        "gradwatch_amp_skipped_steps_total",
        "counter",
        (),
        "Published snapshots of steps the AMP GradScaler skipped (non-finite gradients under "
        "loss scaling).",
        "Such a step is not counted in `gradwatch_nonfinite_steps_total`.",
    ),
    MetricDef(
        "gradwatch_exploding_steps_total",
        "counter",
        (),
        "Published snapshots with at least one exploding parameter (non-finite ones included).",
        "AMP-skipped steps count here too: their non-finite parameters are exploding by "
        "definition.",
    ),
    MetricDef(
        "gradwatch_isolation_violations_total",
        "counter",
        ("group",),
        "Published snapshots in which the isolated group violated isolation.",
        "Starts at 0 for every configured `isolated` group.",
    ),
    # -- the exporter itself -------------------------------------------------------------------
    MetricDef(
        "gradwatch_publish_errors_total",
        "counter",
        (),
        "Collected steps that failed to materialize or publish (logged once per kind).",
        "For example a `GradWatchTimeoutError` when another rank stopped calling collect(), "
        "or a failed write to the history file (`history_path`). Publishing continues with the "
        "next step.",
    ),
    MetricDef(
        "gradwatch_dropped_snapshots_total",
        "counter",
        (),
        "Collected steps never published because publishing fell behind.",
        f"At most {MAX_PENDING} pending steps (`MAX_PENDING`) wait for the publisher; a newer "
        "one drops the oldest.",
    ),
    MetricDef(
        "gradwatch_collect_seconds",
        "histogram",
        (),
        "Time the training thread spent in GradWatch.collect() (gradwatch's self-cost).",
        "Bucket upper bounds (s): "
        + ", ".join(floatToGoString(b) for b in COLLECT_SECONDS_BUCKETS)
        + ", +Inf. Observed for every collected step, published or not.",
    ),
    # -- constant info -------------------------------------------------------------------------
    MetricDef(
        "gradwatch_build_info",
        "info",
        ("version", "torch_version"),
        "Versions of gradwatch and torch in the job (value 1).",
        "Present from the first scrape, before any collection.",
    ),
    MetricDef(
        "gradwatch_run_info",
        "info",
        ("world_size", "parallelism"),
        "World size and detected parallelism of the job (value 1).",
        "`parallelism` is a short description such as `replicated2` or `fsdp2x2+tp2`. Present "
        "from the first scrape.",
    ),
)

METRICS_BY_NAME: Mapping[str, MetricDef] = MappingProxyType({m.name: m for m in METRICS})

# Metrics whose samples come from published snapshots (the rest are the exporter's own).
_SNAPSHOT_METRICS = frozenset(
    m.name
    for m in METRICS
    if m.type in ("gauge", "counter")
    and m.name not in ("gradwatch_publish_errors_total", "gradwatch_dropped_snapshots_total")
)

#: One sample: label values (in the order of :attr:`MetricDef.labels`) and the value.
Sample = tuple[tuple[str, ...], float]


class PendingLike(Protocol):
    """What :meth:`MetricsServer.submit` accepts (``gradwatch.PendingSnapshot``)."""

    step: int

    def result(self) -> Snapshot: ...


#: A consumer of materialized snapshots run by the publisher thread: ``(action, callable)``,
#: where ``action`` completes "could not ... a collected step" in the log (e.g. ``"publish"``,
#: ``"write the history of"``).
Sink = tuple[str, Callable[[Snapshot], None]]


# -- published state ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Counts:
    """Running totals over published snapshots (immutable: a new one per publish)."""

    collections: int = 0
    nonfinite_steps: int = 0
    amp_skipped_steps: int = 0
    exploding_steps: int = 0
    isolation_violations: Mapping[str, int] = field(default_factory=dict)

    def after(self, snap: Snapshot) -> _Counts:
        violations = dict(self.isolation_violations)
        for group, violated in snap.isolation_violated.items():
            violations[group] = violations.get(group, 0) + int(bool(violated))
        return _Counts(
            collections=self.collections + 1,
            nonfinite_steps=self.nonfinite_steps + int(not snap.is_finite and not snap.amp_skipped),
            amp_skipped_steps=self.amp_skipped_steps + int(snap.amp_skipped),
            exploding_steps=self.exploding_steps + int(snap.exploding > 0),
            isolation_violations=MappingProxyType(violations),
        )

    def samples(self) -> dict[str, tuple[Sample, ...]]:
        return {
            "gradwatch_collections_total": (((), float(self.collections)),),
            "gradwatch_nonfinite_steps_total": (((), float(self.nonfinite_steps)),),
            "gradwatch_amp_skipped_steps_total": (((), float(self.amp_skipped_steps)),),
            "gradwatch_exploding_steps_total": (((), float(self.exploding_steps)),),
            "gradwatch_isolation_violations_total": tuple(
                ((group,), float(n)) for group, n in self.isolation_violations.items()
            ),
        }


@dataclass(frozen=True)
class _State:
    """Everything one scrape shows about published snapshots. Never mutated: swapped whole."""

    counts: _Counts
    samples: Mapping[str, tuple[Sample, ...]]
    step: int | None = None
    version: int = 0  # publishes so far: the key of the rendered-exposition cache


def select_param_series(
    snap: Snapshot, top_k: int, cap: int = MAX_PARAM_SERIES
) -> list[tuple[str, float]]:
    """The ``gradwatch_param_grad_norm`` series of ``snap``: ``(param, norm)`` pairs.

    Every non-finite parameter (sorted by name) then the ``top_k`` largest finite norms (ties
    by name), at most ``cap`` in all. ``top_k == 0`` disables the series entirely.
    """
    if top_k <= 0 or cap <= 0:
        return []
    norms = snap.param_norms
    bad = set(snap.nonfinite_params) | {n for n, v in norms.items() if not math.isfinite(v)}
    chosen = [(name, norms.get(name, math.nan)) for name in sorted(bad)][:cap]
    room = min(top_k, cap - len(chosen))
    if room > 0:
        finite = [(n, v) for n, v in norms.items() if n not in bad]
        finite.sort(key=lambda item: (-item[1], item[0]))
        chosen.extend(finite[:room])
    return chosen


def _snapshot_samples(
    snap: Snapshot, ratio_labels: Mapping[str, tuple[str, str]], top_k: int
) -> dict[str, tuple[Sample, ...]]:
    groups = snap.groups.items()
    ratios = tuple(
        (ratio_labels.get(key) or tuple(key.split("/", 1)), value)
        for key, value in snap.ratios.items()
    )
    out: dict[str, tuple[Sample, ...]] = {
        "gradwatch_step": (((), float(snap.step)),),
        "gradwatch_last_collect_timestamp_seconds": (((), float(snap.timestamp)),),
        "gradwatch_global_grad_norm": (((), float(snap.global_norm)),),
        "gradwatch_grad_norm": tuple(((g,), float(s.norm)) for g, s in groups),
        "gradwatch_grad_norm_ratio": tuple((labels, float(v)) for labels, v in ratios),
        "gradwatch_group_parameters": tuple(((g,), float(s.numel)) for g, s in groups),
        "gradwatch_vanishing_tensors": tuple(((g,), float(s.vanishing)) for g, s in groups),
        "gradwatch_exploding_tensors": tuple(((g,), float(s.exploding)) for g, s in groups),
        "gradwatch_nonfinite_tensors": tuple(((g,), float(s.nonfinite)) for g, s in groups),
        "gradwatch_health_score": (((), float(snap.health)),),
        "gradwatch_isolation_violated": tuple(
            ((g,), 1.0 if v else 0.0) for g, v in snap.isolation_violated.items()
        ),
        "gradwatch_replica_divergence": (((), float(snap.replica_divergence)),),
        "gradwatch_param_grad_norm": tuple(
            ((name,), float(v)) for name, v in select_param_series(snap, top_k)
        ),
    }
    if snap.clip_coef is not None:
        out["gradwatch_clip_coef"] = (((), float(snap.clip_coef)),)
    return out


# -- the exporter's own counters --------------------------------------------------------------


@dataclass(frozen=True)
class _SelfView:
    publish_errors: int
    dropped: int
    bucket_counts: tuple[int, ...]  # per bucket, not cumulative; last one is +Inf
    seconds_sum: float


class _SelfStats:
    """Counters about the exporter itself, updated from the training and publisher threads.

    They are not part of a step, so they live outside the published state and are read under
    their own lock (each scrape sees them mutually consistent: the histogram's count equals its
    +Inf bucket). The histogram is a hand-kept bucket array rather than a prometheus_client
    ``Histogram`` so that the Collector emits it from the same table of definitions, and one
    observation is one lock and one ``bisect`` on the training thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._publish_errors = 0
        self._dropped = 0
        self._buckets = [0] * (len(COLLECT_SECONDS_BUCKETS) + 1)
        self._sum = 0.0
        self.version = 0  # bumped by every change; read without the lock (an int load)

    def observe(self, seconds: float) -> None:
        if not seconds >= 0.0:  # NaN or negative: a clock oddity, not a measurement
            return
        # bisect_left: a value equal to a bound belongs to that bucket (le = "less or equal").
        i = bisect.bisect_left(COLLECT_SECONDS_BUCKETS, seconds)
        with self._lock:
            self._buckets[i] += 1
            self._sum += seconds
            self.version += 1

    def add_error(self) -> None:
        with self._lock:
            self._publish_errors += 1
            self.version += 1

    def add_dropped(self) -> None:
        with self._lock:
            self._dropped += 1
            self.version += 1

    def view(self) -> _SelfView:
        with self._lock:
            return _SelfView(self._publish_errors, self._dropped, tuple(self._buckets), self._sum)


# -- the Collector ------------------------------------------------------------------------------


class SnapshotCollector:
    """prometheus_client Collector over the last published state.

    Thread-safe: :meth:`publish` may run concurrently with any number of :meth:`collect` calls;
    each ``collect`` reads the state reference once under the lock and works on that immutable
    object only.
    """

    def __init__(self, cfg: WatchConfig, *, world_size: int, parallelism: str) -> None:
        self._ratio_labels = MappingProxyType(
            {ratio_key(num, den): (num, den) for num, den in cfg.ratios}
        )
        self._top_k = cfg.param_metrics_top_k
        self._build = _build_labels()
        self._run = {"world_size": str(world_size), "parallelism": str(parallelism)}
        self.self_stats = _SelfStats()
        counts = _Counts(isolation_violations=MappingProxyType(dict.fromkeys(cfg.isolated, 0)))
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._state = _State(counts=counts, samples=MappingProxyType(counts.samples()))

    @property
    def published_step(self) -> int | None:
        """Step of the last published snapshot (None before the first)."""
        with self._lock:
            return self._state.step

    def publish(self, snap: Snapshot) -> None:
        """Fold ``snap`` into the counters and make it the state every later scrape sees.

        The new state is built outside the scrape lock (sorting the top-k parameters of a large
        model takes a while); publishers are serialized so no count is lost.
        """
        with self._publish_lock:
            counts = self._state.counts.after(snap)
            samples = _snapshot_samples(snap, self._ratio_labels, self._top_k)
            samples.update(counts.samples())
            unknown = set(samples) - _SNAPSHOT_METRICS
            if unknown:  # a programming error; keeps the table the single source of names
                raise AssertionError(f"metrics missing from METRICS: {sorted(unknown)}")
            state = _State(
                counts=counts,
                samples=MappingProxyType(samples),
                step=snap.step,
                version=self._state.version + 1,
            )
            with self._lock:
                self._state = state

    def version(self) -> tuple[int, int]:
        """Changes whenever a scrape would show something new (a publish, a counter, a
        histogram observation); equal versions render the same exposition."""
        return self._state.version, self.self_stats.version

    def describe(self) -> Iterator[Metric]:
        """Names only, so a registry can refuse a second collector exporting the same ones."""
        for d in METRICS:
            yield _family(d)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            state = self._state
        own = self.self_stats.view()
        for d in METRICS:
            if d.name in _SNAPSHOT_METRICS:
                samples = state.samples.get(d.name, ())
                if not samples:
                    continue  # absent, not zero: nothing measured
                family = _family(d)
                for labels, value in samples:
                    family.add_metric(labels, value)
                yield family
            elif d.name == "gradwatch_publish_errors_total":
                yield _family(d, value=float(own.publish_errors))
            elif d.name == "gradwatch_dropped_snapshots_total":
                yield _family(d, value=float(own.dropped))
            elif d.name == "gradwatch_collect_seconds":
                yield _histogram(d, own)
            elif d.name == "gradwatch_build_info":
                yield InfoMetricFamily(_base(d), d.help, value=self._build)
            elif d.name == "gradwatch_run_info":
                yield InfoMetricFamily(_base(d), d.help, value=self._run)
            else:  # pragma: no cover - guarded by the tests over METRICS
                raise AssertionError(f"no source for {d.name}")


def _base(d: MetricDef) -> str:
    """Family name as prometheus_client wants it (it appends _total / _info itself)."""
    for suffix in ("_total", "_info"):
        if d.name.endswith(suffix) and d.type in ("counter", "info"):
            return d.name[: -len(suffix)]
    return d.name


def _family(d: MetricDef, value: float | None = None) -> Metric:
    labels = list(d.labels) if value is None else None
    if d.type == "gauge":
        return GaugeMetricFamily(d.name, d.help, value=value, labels=labels)
    if d.type == "counter":
        return CounterMetricFamily(_base(d), d.help, value=value, labels=labels)
    if d.type == "histogram":
        return HistogramMetricFamily(d.name, d.help, labels=list(d.labels))
    return InfoMetricFamily(_base(d), d.help, labels=list(d.labels))


def _histogram(d: MetricDef, own: _SelfView) -> Metric:
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    bounds = (*COLLECT_SECONDS_BUCKETS, math.inf)
    for bound, n in zip(bounds, own.bucket_counts, strict=True):
        cumulative += n
        buckets.append((floatToGoString(bound), float(cumulative)))
    return HistogramMetricFamily(d.name, d.help, buckets=buckets, sum_value=own.seconds_sum)


def _build_labels() -> dict[str, str]:
    try:  # lazily: gradwatch/__init__ defines __version__ before importing anything heavy
        from gradwatch import __version__ as version
    except ImportError:  # pragma: no cover - partial installs
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("gradwatch")
        except PackageNotFoundError:
            version = "unknown"
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:  # pragma: no cover - gradwatch requires torch
        torch_version = "unknown"
    return {"version": str(version), "torch_version": torch_version}


# -- the publisher thread ---------------------------------------------------------------------


class _Publisher:
    """Bounded FIFO of pending results and the daemon thread that hands them to the sinks.

    Thread-safe. ``submit`` and ``flush`` may be called from any thread; ``_run`` is the only
    consumer. Items carry a sequence number; ``_done`` is the highest one handled (published,
    failed or dropped), which makes ``flush`` exact. Each materialized snapshot goes to every
    sink in order; a sink that raises is counted in ``stats`` and logged once per kind, and the
    other sinks still get the snapshot.
    """

    def __init__(self, sinks: Sequence[Sink], stats: _SelfStats) -> None:
        self._sinks = tuple(sinks)
        self._stats = stats
        self._cond = threading.Condition()
        self._queue: deque[tuple[int, PendingLike]] = deque()
        self._submitted = 0
        self._done = 0
        self._stopping = False
        self._logged_kinds: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="gradwatch-publisher", daemon=True)
        self.thread.start()

    def submit(self, pending: PendingLike) -> bool:
        with self._cond:
            if self._stopping:
                return False
            self._submitted += 1
            if len(self._queue) >= MAX_PENDING:
                self._queue.popleft()
                self._stats.add_dropped()
            self._queue.append((self._submitted, pending))
            self._cond.notify_all()
        return True

    def flush(self, timeout: float) -> bool:
        with self._cond:
            if self._stopping:
                return False
            target = self._submitted
            return (
                self._cond.wait_for(
                    lambda: self._done >= target or not self.thread.is_alive(), timeout
                )
                and self._done >= target
            )

    def stop(self, timeout: float) -> bool:
        """Stop after the item in hand (later ones are discarded); True if the thread ended."""
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join(max(timeout, 0.0))
        return not self.thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                seq, pending = self._queue.popleft()
            try:
                self._handle(pending)
            finally:
                with self._cond:
                    self._done = max(self._done, seq)
                    self._cond.notify_all()

    def _handle(self, pending: PendingLike) -> None:
        try:
            snap = pending.result()
        except Exception as exc:  # e.g. GradWatchTimeoutError: a peer stopped collecting
            self._error("materialize", exc)
            return
        for action, sink in self._sinks:
            try:
                sink(snap)
            except Exception as exc:
                self._error(action, exc)

    def _error(self, action: str, exc: Exception) -> None:
        self._stats.add_error()
        kind = f"{action}:{type(exc).__name__}"
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            log.warning(
                "gradwatch: could not %s a collected step (%s: %s); counted in "
                "gradwatch_publish_errors_total, later errors of this kind are not logged",
                action,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )


# -- the HTTP server ----------------------------------------------------------------------------


class _RateLimit:
    """At most ``rate`` grants per second on average, bursts of ``burst`` (GCRA).

    Thread-safe. :meth:`reserve` books the next free slot and says how long to wait for it;
    callers sleep outside the lock, so waiting requests cost no CPU and are served in order.
    """

    def __init__(self, rate: float, burst: int, max_wait: float) -> None:
        self._interval = 1.0 / rate
        self._tolerance = self._interval * max(burst - 1, 0)
        self._max_wait = max_wait
        self._lock = threading.Lock()
        self._due = time.monotonic()

    def reserve(self) -> float | None:
        """Seconds to wait before serving, or None when that would exceed ``max_wait``."""
        with self._lock:
            now = time.monotonic()
            due = max(self._due, now)  # theoretical time of this grant without bursts
            wait = max(due - self._tolerance - now, 0.0)
            if wait > self._max_wait:
                return None
            self._due = due + self._interval
            return wait


class _ScrapeApp:
    """WSGI app: prometheus_client's, behind a rate bound and a rendered-exposition cache.

    Thread-safe (one thread per request). Why both: a scrape costs the serving process about
    1 ms of Python (half rendering, half HTTP), taken under the GIL from the training thread.
    Equal collector versions render equal bytes, so between two steps any number of scrapes
    render once; and at most ``MAX_SCRAPES_PER_SECOND`` are served, so even clients scraping
    back to back cannot take more than a few percent of the training thread's time. Requests
    with a query string (``name[]`` filters) bypass the cache.
    """

    def __init__(self, registry: CollectorRegistry, version: Callable[[], tuple[int, int]]) -> None:
        self._inner = make_wsgi_app(registry)
        self._version = version
        self._limit = _RateLimit(MAX_SCRAPES_PER_SECOND, SCRAPE_BURST, _MAX_SCRAPE_WAIT)
        self._lock = threading.Lock()
        self._cache_version: tuple[int, int] | None = None
        self._cache: dict[tuple[str, str], tuple[str, list[tuple[str, str]], bytes]] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        # Prometheus itself (its User-Agent) is never queued behind other clients: its scrapes
        # are already paced by its scrape_interval, and a queue filled by a runaway client must
        # not push them past their scrape_timeout (the series would go stale and page).
        if not environ.get("HTTP_USER_AGENT", "").startswith(PROMETHEUS_USER_AGENT):
            wait = self._limit.reserve()
            if wait is None:
                start_response("503 Service Unavailable", [("Retry-After", "1")])
                return [b"gradwatch: too many scrapes, retry later\n"]
            if wait > 0:
                time.sleep(wait)
        if environ.get("REQUEST_METHOD") != "GET" or environ.get("QUERY_STRING"):
            return self._inner(environ, start_response)
        # The version is read before rendering: a body rendered later is never older than its key.
        version = self._version()
        key = (environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""))
        with self._lock:
            hit = self._cache.get(key) if self._cache_version == version else None
        if hit is None:
            captured: list[Any] = []

            def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                captured[:] = [status, list(headers)]
                return lambda data: None  # make_wsgi_app returns its body, never writes

            body = b"".join(self._inner(environ, capture))
            hit = (captured[0], captured[1], body)
            if hit[0].startswith("200"):
                with self._lock:
                    if self._cache_version != version:
                        self._cache_version, self._cache = version, {}
                    if len(self._cache) < 16:  # distinct Accept headers: a handful in practice
                        self._cache[key] = hit
        status, headers, body = hit
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return [body]


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (one line per scrape would flood the training log)."""

    timeout = _REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HTTPServer(ThreadingMixIn, WSGIServer):
    """One daemon thread per request: a slow scrape never queues the others, nor holds exit."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up or fails the TLS handshake is its own problem: never print a
        # traceback into the training log (socketserver's default).
        log.debug("gradwatch: scrape from %s failed", client_address, exc_info=True)


def _tls_context(cfg: WatchConfig) -> ssl.SSLContext | None:
    """Load the TLS files before binding, so a bad certificate holds no port."""
    if cfg.certfile is None or cfg.keyfile is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile=str(cfg.certfile), keyfile=str(cfg.keyfile))
        if cfg.client_cafile is not None:
            ctx.load_verify_locations(cafile=str(cfg.client_cafile))
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: no client certificate, no scrape
    except (ssl.SSLError, OSError) as exc:
        raise GradWatchError(
            f"gradwatch: cannot load the TLS files of the metrics endpoint (certfile="
            f"{cfg.certfile}, keyfile={cfg.keyfile}, client_cafile={cfg.client_cafile}): {exc}"
        ) from exc
    return ctx


def _bind(cfg: WatchConfig, app: Callable[..., Any], tls: ssl.SSLContext | None) -> _HTTPServer:
    """Bind in the caller's thread; a taken port raises :class:`PortInUseError`.

    Built from ``make_wsgi_app`` and wsgiref rather than ``prometheus_client.start_http_server``
    for two reasons: the TLS context is loaded before the port is taken, and the TLS handshake
    runs in the request's thread (``do_handshake_on_connect=False``), whereas wrapping the
    listening socket makes ``accept()`` do the handshake, so one silent client would stall
    every scrape.
    """
    port = int(cfg.port or 0)
    infos = socket.getaddrinfo(
        cfg.bind_address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, sockaddr = infos[0]
    server_class = type("_BoundHTTPServer", (_HTTPServer,), {"address_family": family})
    try:
        httpd = server_class((sockaddr[0], port), _QuietHandler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            err = PortInUseError(
                f"gradwatch: cannot serve metrics on {cfg.bind_address}:{port}: port {port} is "
                "already in use (another job or a GradWatch that was not closed?). Choose "
                "another port with GRADWATCH_PORT (or WatchConfig(port=...)), or 0 for an "
                "ephemeral one."
            )
            err.errno = errno.EADDRINUSE
            raise err from exc
        raise OSError(
            exc.errno,
            f"gradwatch: cannot serve metrics on {cfg.bind_address}:{port} "
            f"(GRADWATCH_BIND_ADDRESS / GRADWATCH_PORT): {exc.strerror}",
        ) from exc
    httpd.set_app(app)
    if tls is not None:
        httpd.socket = tls.wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    return httpd


def _url(httpd: _HTTPServer, tls: bool) -> tuple[str, int]:
    host, port = httpd.server_address[:2]
    address = ipaddress.ip_address(host)
    if address.is_unspecified:  # 0.0.0.0 / ::: reachable locally through the loopback
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    shown = f"[{address}]" if address.version == 6 else str(address)
    return f"{'https' if tls else 'http'}://{shown}:{port}/metrics", int(port)


def _stop_publisher(publisher: _Publisher, timeout: float) -> None:
    """Flush what was submitted, then stop the publisher thread, within ``timeout`` in all."""
    deadline = time.monotonic() + max(timeout, 0.0)
    publisher.flush(max(deadline - time.monotonic(), 0.0))
    if not publisher.stop(max(deadline - time.monotonic(), 0.1)):
        log.warning(
            "gradwatch: the metrics publisher did not stop within %.1fs (a collective still "
            "pending?); it is a daemon thread and is abandoned",
            timeout,
        )


def _shutdown(
    publisher: _Publisher,
    httpd: _HTTPServer,
    http_thread: threading.Thread,
    timeout: float,
) -> None:
    """Flush, stop the publisher, stop serving and release the port, within ``timeout``.

    Flushing first means no publisher thread is still inside ``pending.result()`` when the
    caller tears the process group down right after.
    """
    deadline = time.monotonic() + max(timeout, 0.0)
    try:
        _stop_publisher(publisher, timeout)
    finally:
        # shutdown() waits for serve_forever() to notice; do it in a helper thread so a
        # wedged server cannot hold close() (or interpreter exit) longer than the deadline.
        stopper = threading.Thread(target=httpd.shutdown, name="gradwatch-http-stop", daemon=True)
        stopper.start()
        stopper.join(max(deadline - time.monotonic(), 1.0))
        httpd.server_close()  # releases the port even if serve_forever() is still unwinding
        http_thread.join(max(deadline - time.monotonic(), 0.1))


class MetricsServer:
    """The metrics endpoint of the serving rank: HTTP(S) server, Collector and publisher.

    Construction binds the port in the caller's thread (``cfg.port``; 0 = ephemeral) and starts
    two daemon threads (HTTP and publisher). All public methods are thread-safe. ``submit`` and
    ``observe_collect_seconds`` never block on the network or the device and never raise.
    ``sinks`` are extra consumers the publisher thread calls with every published snapshot
    after the Collector (the history file); their errors count in
    ``gradwatch_publish_errors_total``.

    Unclosed servers are closed when collected and at interpreter exit (``weakref.finalize``,
    which holds no reference to the server itself), within ``EXIT_CLOSE_TIMEOUT`` seconds.

    Attributes:
        url: ``http(s)://host:port/metrics``; ``host`` is the bound address (loopback when
            bound to all interfaces).
        port: the bound TCP port (an ephemeral one resolved).
        registry: the dedicated registry (no process/gc collectors), holding only gradwatch's
            Collector.
    """

    def __init__(
        self,
        cfg: WatchConfig,
        *,
        world_size: int,
        parallelism: str,
        sinks: Sequence[Sink] = (),
    ) -> None:
        if cfg.port is None:
            raise ValueError("gradwatch: MetricsServer needs a port (WatchConfig.port is None)")
        tls = _tls_context(cfg)
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = SnapshotCollector(cfg, world_size=world_size, parallelism=parallelism)
        self.registry.register(self._collector)
        self._httpd = _bind(cfg, _ScrapeApp(self.registry, self._collector.version), tls)
        try:
            self.url, self.port = _url(self._httpd, tls is not None)
            self._publisher = _Publisher(
                [("publish", self._collector.publish), *sinks], self._collector.self_stats
            )
        except BaseException:
            self._httpd.server_close()  # a failed construction holds no port
            raise
        self._http_thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.25},  # bounds how long close() waits for the loop
            name="gradwatch-http",
            daemon=True,
        )
        self._http_thread.start()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._publisher, self._httpd, self._http_thread, EXIT_CLOSE_TIMEOUT
        )
        log.info("gradwatch: serving metrics at %s", self.url)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def submit(self, pending: PendingLike) -> None:
        """Queue a pending result for publication. Never blocks on it, never raises.

        Beyond ``MAX_PENDING`` waiting results the oldest is dropped and counted. Ignored after
        :meth:`close`.
        """
        try:
            self._publisher.submit(pending)
        except Exception:  # pragma: no cover - defensive: monitoring must not break training
            log.debug("gradwatch: submit failed", exc_info=True)

    def observe_collect_seconds(self, seconds: float) -> None:
        """Record the training thread's time in one ``collect()`` call. Never raises."""
        try:
            self._collector.self_stats.observe(float(seconds))
        except Exception:  # pragma: no cover - defensive
            log.debug("gradwatch: observe failed", exc_info=True)

    def publish(self, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` now, in the caller's thread (the publisher uses this too).

        Raises what building the state raises (e.g. for a malformed snapshot).
        """
        self._collector.publish(snapshot)

    @property
    def published_step(self) -> int | None:
        """Step of the last published snapshot, None before the first."""
        return self._collector.published_step

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is published, failed or dropped.

        Returns False on timeout, or at once when the server is closed.
        """
        return self._publisher.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush (bounded), stop the publisher, stop serving, release the port. Idempotent."""
        if self._finalizer.detach() is not None:
            _shutdown(self._publisher, self._httpd, self._http_thread, timeout)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving"
        return f"MetricsServer({self.url!r}, {state})"


class SnapshotPublisher:
    """The publisher thread without an endpoint: sinks only (``history_path`` with no ``port``).

    Same contract as :meth:`MetricsServer.submit`/:meth:`~MetricsServer.flush`/
    :meth:`~MetricsServer.close`: the training thread only queues pending results; the
    ``gradwatch-publisher`` daemon thread materializes them and calls each sink; errors are
    logged once per kind and counted in :attr:`errors` (there is no endpoint to export them).
    Closed when collected or at interpreter exit, within ``EXIT_CLOSE_TIMEOUT`` seconds.
    """

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._stats = _SelfStats()
        self._publisher = _Publisher(sinks, self._stats)
        self._finalizer = weakref.finalize(
            self, _stop_publisher, self._publisher, EXIT_CLOSE_TIMEOUT
        )

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def errors(self) -> int:
        """Steps that failed to materialize, plus sink calls that raised."""
        return self._stats.view().publish_errors

    @property
    def dropped(self) -> int:
        """Steps dropped because the publisher fell behind (``MAX_PENDING``)."""
        return self._stats.view().dropped

    def submit(self, pending: PendingLike) -> None:
        """Queue a pending result. Never blocks on it, never raises; ignored after close."""
        try:
            self._publisher.submit(pending)
        except Exception:  # pragma: no cover - defensive: monitoring must not break training
            log.debug("gradwatch: submit failed", exc_info=True)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far is handled; False on timeout or when closed."""
        return self._publisher.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush (bounded) and stop the thread. Idempotent."""
        if self._finalizer.detach() is not None:
            _stop_publisher(self._publisher, timeout)


# -- generated reference ----------------------------------------------------------------------

_DOC_HEADER = """\
# Metrics reference

<!-- Generated by `python -m gradwatch.export --markdown > docs/metrics.md` from
     gradwatch.export.METRICS; tests/test_export.py fails when this file is out of date. -->

Global rank 0 serves these metrics (`WatchConfig.port`, `GRADWATCH_PORT`) from a dedicated
registry: no process or GC metrics, no sample timestamps, HELP text on every metric. Their names
and labels are a contract: the alert rules, the dashboard and outside checks rely on them.

* **One step per scrape.** Every snapshot-derived gauge and counter of a scrape comes from the
  same published state, so a scrape never mixes two steps.
* **Absent, not zero.** Before the first snapshot is published a scrape shows only the info
  metrics, the counters (at 0) and `gradwatch_collect_seconds`; the per-step gauges
  (`gradwatch_step` included) are absent. `gradwatch_clip_coef` is absent when the last step was
  not clipped through gradwatch.
* **Non-finite values are exported** as `NaN`, `+Inf` or `-Inf`, never dropped. PromQL
  comparisons with NaN are false: alert on the counters.
* **Counters count published snapshots.** Publishing happens in a background thread; when it
  falls behind, at most {max_pending} collected steps wait and a newer one drops the oldest
  (`gradwatch_dropped_snapshots_total`). A dropped step, or one that failed to materialize
  (`gradwatch_publish_errors_total`), is not counted in any other counter. Counters restart at
  0 with the job.
* **Exploding includes non-finite**: a parameter whose gradient holds NaN/Inf counts in
  `gradwatch_exploding_tensors` and makes its step count in `gradwatch_exploding_steps_total`.
* **Bounded cost.** The endpoint serves at most {max_scrapes:g} scrapes per second (bursts of
  {burst}); more wait their turn, and one that would wait over {max_wait:g} s gets HTTP 503.
  Prometheus's own scrapes (User-Agent `Prometheus/...`) skip that queue: they are paced by
  the scrape interval, and other clients must not push them past their scrape timeout. Between
  two changes any number of scrapes render the exposition once. So no client, however eager,
  can take more than a few percent of the training process's time.
* **Per-parameter series** (`gradwatch_param_grad_norm`) are off by default; with
  `param_metrics_top_k = k > 0` they are every non-finite parameter plus the k largest finite
  norms, capped at {max_series} series (`MAX_PARAM_SERIES`) in all.
"""


def metrics_reference_markdown() -> str:
    """docs/metrics.md, generated from :data:`METRICS` (the table the Collector uses)."""
    lines = [
        _DOC_HEADER.format(
            max_pending=MAX_PENDING,
            max_series=MAX_PARAM_SERIES,
            max_scrapes=MAX_SCRAPES_PER_SECOND,
            burst=SCRAPE_BURST,
            max_wait=_MAX_SCRAPE_WAIT,
        ),
        "| metric | type | labels | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for d in METRICS:
        labels = ", ".join(f"`{label}`" for label in d.labels) or "-"
        meaning = (d.help + (f" {d.notes}" if d.notes else "")).replace("|", "\\|")
        lines.append(f"| `{d.name}` | {d.type} | {labels} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradwatch.export", description="gradwatch metrics reference"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print docs/metrics.md (the metrics reference)"
    )
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(metrics_reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
