"""What the endpoint shows: the published state (one step and the counts) and the self-stats.

* :class:`PublishedState` is the endpoint's :class:`~gradwatch.export.publisher.Sink`: every
  published snapshot is folded into a new immutable :class:`State` (every sample of every
  snapshot-derived gauge and counter) that replaces the old one whole, so a scrape that reads
  the state once never shows half of one step and half of another.
* :class:`SelfStats` are the exporter's own counters (errors, drops, the training thread's time
  in ``collect()``): not part of a step, so they live outside the state, under their own lock.

Samples are keyed by the metric names of :data:`gradwatch.export.metrics.METRICS`, whose
:class:`~gradwatch.export.metrics.MetricSource` says which of the two a metric reads. Steps are
classified by :class:`~gradwatch.snapshot.Snapshot` (``nonfinite_step``, ``amp_skipped``,
``exploding_step``), the one definition every consumer shares.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.utils import floatToGoString

from gradwatch.config import WatchConfig, ratio_key
from gradwatch.snapshot import Snapshot, ratio_defined

#: At most this many ``gradwatch_param_grad_norm`` series per scrape, whatever
#: ``param_metrics_top_k`` is and however many parameters are non-finite, so a 10,000-parameter
#: model can never create 10,000 series.
MAX_PARAM_SERIES = 200

#: At most this many ``gradwatch_last_nonfinite_origin{rank,host}`` series (the lowest ranks of
#: the last event), however many ranks went non-finite at once.
MAX_ORIGIN_SERIES = 8

#: Upper bounds (seconds) of the ``gradwatch_collect_seconds`` buckets: collect() queues work
#: and normally takes 0.1-10 ms; the upper buckets catch host syncs and pathological models.
COLLECT_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

#: The ``kind`` label values of ``gradwatch_internal_errors_total`` (each starts at 0): a local
#: pass that raised (``collect``), a gradient on the ``meta`` device (``meta_gradient``), a
#: parameter replaced after construction (``parameters_replaced``), a gradwatch collective that
#: failed (``collective``: collection stops), another rank's failed local pass
#: (``other_rank``), an all-reduce still in flight after ``collective_timeout_seconds``
#: (``collective_timeout``: a straggler, collection goes on), ranks that collected different
#: steps (``step_mismatch``), another rank's closed watcher (``other_rank_closed``), this rank's
#: vector that never reached the host thread (``host_copy``).
INTERNAL_ERROR_KINDS = (
    "collect",
    "meta_gradient",
    "parameters_replaced",
    "collective",
    "other_rank",
    "collective_timeout",
    "step_mismatch",
    "other_rank_closed",
    "host_copy",
)

#: At most this many ``source`` label values of the norm-audit series (user-given strings).
MAX_AUDIT_SOURCES = 16

#: One sample: label values (in the order of ``MetricDef.labels``) and the value.
Sample = tuple[tuple[str, ...], float]


@dataclass(frozen=True)
class HistogramValue:
    """One unlabelled histogram: ``(le, cumulative count)`` per bucket (``+Inf`` last), sum."""

    buckets: tuple[tuple[str, float], ...]
    sum: float


@dataclass(frozen=True)
class LabelledHistograms:
    """The series of one histogram metric: ``(label values, histogram)`` pairs; falsy
    (the metric absent) without a series."""

    series: tuple[tuple[tuple[str, ...], HistogramValue], ...]

    def __bool__(self) -> bool:
        return bool(self.series)


#: What a source holds for one metric: its samples, or a histogram.
MetricValue = tuple[Sample, ...] | HistogramValue | LabelledHistograms


# -- published state ------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """Running totals over published snapshots (immutable: a new one per publish)."""

    collections: int = 0
    nonfinite_steps: int = 0
    amp_skipped_steps: int = 0
    exploding_steps: int = 0
    isolation_violations: Mapping[str, int] = field(default_factory=dict)
    # the per-rank view: the origin (rank, host) of the last non-finite step, and its step
    last_origin: tuple[tuple[str, str], ...] = ()
    last_origin_step: int = 0
    # the guard's running totals by reason, as of the last guarded snapshot
    skipped_steps: Mapping[str, int] = field(default_factory=dict)

    def after(self, snap: Snapshot) -> Counts:
        violations = dict(self.isolation_violations)
        for group, violated in snap.isolation_violated.items():
            violations[group] = violations.get(group, 0) + int(bool(violated))
        origin, origin_step = self.last_origin, self.last_origin_step
        if snap.nonfinite_origin_ranks:
            hosts = (*snap.nonfinite_origin_hosts, *[""] * len(snap.nonfinite_origin_ranks))
            pairs = sorted(zip(snap.nonfinite_origin_ranks, hosts, strict=False))
            pairs = pairs[:MAX_ORIGIN_SERIES]
            origin = tuple((str(r), h) for r, h in pairs)
            origin_step = snap.step
        return Counts(
            last_origin=origin,
            last_origin_step=origin_step,
            collections=self.collections + 1,
            nonfinite_steps=self.nonfinite_steps + int(snap.nonfinite_step),
            amp_skipped_steps=self.amp_skipped_steps + int(snap.amp_skipped),
            exploding_steps=self.exploding_steps + int(snap.exploding_step),
            isolation_violations=MappingProxyType(violations),
            skipped_steps=MappingProxyType(dict(snap.skipped_steps))
            if snap.skipped_steps
            else self.skipped_steps,
        )

    def samples(self) -> dict[str, tuple[Sample, ...]]:
        return {
            "gradwatch_last_nonfinite_origin": tuple(
                (labels, float(self.last_origin_step)) for labels in self.last_origin
            ),
            "gradwatch_collections_total": (((), float(self.collections)),),
            "gradwatch_nonfinite_steps_total": (((), float(self.nonfinite_steps)),),
            "gradwatch_amp_skipped_steps_total": (((), float(self.amp_skipped_steps)),),
            "gradwatch_exploding_steps_total": (((), float(self.exploding_steps)),),
            "gradwatch_isolation_violations_total": tuple(
                ((group,), float(n)) for group, n in self.isolation_violations.items()
            ),
            "gradwatch_skipped_steps_total": tuple(
                ((reason,), float(n)) for reason, n in self.skipped_steps.items()
            ),
        }


@dataclass(frozen=True)
class State:
    """Everything one scrape shows about published snapshots. Never mutated: swapped whole.

    Attributes:
        counts: the running totals, and ``count_samples`` their samples.
        samples: the samples of the last published snapshot (empty before the first).
        step: its step (None before the first).
        version: publishes so far: the key of the rendered-exposition cache.
    """

    counts: Counts
    count_samples: Mapping[str, MetricValue]
    samples: Mapping[str, tuple[Sample, ...]] = field(default_factory=dict)
    step: int | None = None
    version: int = 0
    series: SeriesCounts = field(default_factory=lambda: SeriesCounts())
    exemplars: Mapping[tuple[str, tuple[str, ...]], StepExemplar] = field(default_factory=dict)


@dataclass(frozen=True)
class StepExemplar:
    """The published step that last increased one counter series: its OpenMetrics exemplar.

    Attributes:
        step: that step.
        increase: how much the counter grew at it (the exemplar's value).
        timestamp: its ``collect`` wall time (Unix seconds), None when unknown.
        origin_rank: the lowest rank whose local gradients were non-finite before the
            reduction at that step (the per-rank view), None when not known.
    """

    step: int
    increase: float
    timestamp: float | None = None
    origin_rank: int | None = None

    def labels(self) -> dict[str, str]:
        """The exemplar's label set: ``step``, and ``origin_rank`` when known."""
        out = {"step": str(self.step)}
        if self.origin_rank is not None:
            out["origin_rank"] = str(self.origin_rank)
        return out


def counter_exemplars(
    before: Mapping[str, MetricValue],
    after: Mapping[str, MetricValue],
    snap: Snapshot,
    kept: Mapping[tuple[str, tuple[str, ...]], StepExemplar],
) -> dict[tuple[str, tuple[str, ...]], StepExemplar]:
    """``kept`` with an exemplar of ``snap`` for every counter series (``*_total``) that
    ``snap`` increased from ``before`` to ``after``: generic over the counters, so every
    counter of the counts has one; the Collector attaches those the catalog asks for."""
    out = dict(kept)
    origin = min(snap.nonfinite_origin_ranks) if snap.nonfinite_origin_ranks else None
    timestamp = float(snap.timestamp) if snap.timestamp > 0 else None
    for name, value in after.items():
        if not name.endswith("_total") or not isinstance(value, tuple):
            continue
        old = before.get(name)
        previous = dict(old) if isinstance(old, tuple) else {}
        for labels, v in value:
            grew = v - previous.get(labels, 0.0)
            if grew > 0:
                out[(name, labels)] = StepExemplar(snap.step, grew, timestamp, origin)
    return out


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


def snapshot_samples(
    snap: Snapshot, ratio_labels: Mapping[str, tuple[str, str]], top_k: int
) -> dict[str, tuple[Sample, ...]]:
    """The samples of every ``MetricSource.SNAPSHOT`` metric for ``snap`` (absent: no key)."""
    groups = snap.groups.items()
    ratios: list[Sample] = []
    for key, value in snap.ratios.items():
        labels = ratio_labels.get(key) or tuple(key.split("/", 1))
        # Undefined (denominator without a usable norm): NaN, not the 0 the snapshot holds,
        # which would read as "dormant".
        defined = ratio_defined(snap.groups.get(labels[-1]))
        ratios.append((labels, float(value) if defined else math.nan))
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
    # Spike scores: absent when detection is off (gradwatch.spikes), NaN while undefined.
    if snap.global_spike_score is not None:
        out["gradwatch_global_grad_norm_spike_score"] = (((), float(snap.global_spike_score)),)
        out["gradwatch_grad_norm_spike_score"] = tuple(
            ((g,), float(v)) for g, v in snap.spike_scores.items()
        )
    if snap.consecutive_skipped_steps is not None:  # a guarded step
        out["gradwatch_consecutive_skipped_steps"] = (
            ((), float(snap.consecutive_skipped_steps)),
        )
        out["gradwatch_guard_stopped"] = (((), 1.0 if snap.guard_stopped else 0.0),)
    out.update(rank_view_samples(snap))
    return out


def rank_view_samples(snap: Snapshot) -> dict[str, tuple[Sample, ...]]:
    """The per-rank view's gauges: absent (no key) when the snapshot has no view."""
    if not snap.rank_view:
        return {}
    out: dict[str, tuple[Sample, ...]] = {}
    if snap.nonfinite_origin_count is not None:
        out["gradwatch_nonfinite_origin_ranks"] = (((), float(snap.nonfinite_origin_count)),)
    if snap.replica_grad_norm_max is not None:
        out["gradwatch_replica_grad_norm"] = tuple(
            ((stat,), float(v))
            for stat, v in (
                ("min", snap.replica_grad_norm_min),
                ("median", snap.replica_grad_norm_median),
                ("max", snap.replica_grad_norm_max),
            )
            if v is not None
        )
    if snap.replica_grad_norm_max_rank is not None:
        out["gradwatch_replica_grad_norm_max_rank"] = (
            ((), float(snap.replica_grad_norm_max_rank)),
        )
    if snap.replica_outlier_score is not None:
        out["gradwatch_replica_outlier_score"] = (((), float(snap.replica_outlier_score)),)
    if snap.gradient_noise_scale is not None:
        out["gradwatch_gradient_noise_scale"] = (((), float(snap.gradient_noise_scale)),)
    if snap.group_noise_scale:
        out["gradwatch_group_gradient_noise_scale"] = tuple(
            ((g,), float(v)) for g, v in snap.group_noise_scale.items()
        )
    return out


class PublishedState:
    """The endpoint's sink: holds the current :class:`State`, replaced whole by :meth:`write`.

    Thread-safe: :meth:`write` may run concurrently with any number of :meth:`current` calls;
    a reader gets one immutable object and works on it only.
    """

    #: Completes "could not ... a collected step" in the publisher's error log.
    action = "publish"

    def __init__(self, cfg: WatchConfig) -> None:
        self._ratio_labels = MappingProxyType(
            {ratio_key(num, den): (num, den) for num, den in cfg.ratios}
        )
        self._top_k = cfg.param_metrics_top_k
        # Counters start at 0 for every isolated group, so that increase() sees the first event.
        counts = Counts(isolation_violations=MappingProxyType(dict.fromkeys(cfg.isolated, 0)))
        series = SeriesCounts.start(cfg.groups)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._state = State(
            counts=counts,
            count_samples=MappingProxyType({**counts.samples(), **series.samples()}),
            series=series,
        )

    def current(self) -> State:
        with self._lock:
            return self._state

    @property
    def published_step(self) -> int | None:
        """Step of the last published snapshot (None before the first)."""
        return self.current().step

    def write(self, snapshot: Snapshot) -> None:
        """Fold ``snapshot`` into the counts and make it the state every later scrape sees.

        The new state is built outside the readers' lock (sorting the top-k parameters of a
        large model takes a while); writers are serialized so no count is lost. Raises what
        building the state raises (e.g. for a malformed snapshot), leaving the state as it was.
        """
        with self._write_lock:
            old = self._state
            counts = old.counts.after(snapshot)
            series = old.series.after(snapshot)
            count_samples = {**counts.samples(), **series.samples()}
            state = State(
                counts=counts,
                count_samples=MappingProxyType(count_samples),
                exemplars=MappingProxyType(
                    counter_exemplars(old.count_samples, count_samples, snapshot, old.exemplars)
                ),
                samples=MappingProxyType(
                    snapshot_samples(snapshot, self._ratio_labels, self._top_k)
                ),
                step=snapshot.step,
                version=old.version + 1,
                series=series,
            )
            with self._lock:
                self._state = state


# -- every published step, per series: spikes, non-finite groups, the norm distribution ------

#: Upper bounds of the ``gradwatch_*grad_norm_per_step`` buckets: 1 and 3 times each power of
#: ten from 1e-6 to 1e6 (two per decade, a factor of about 3 apart), so a 10x spike always moves
#: up at least two buckets, and 11 histograms (10 groups and the global norm) stay under 310
#: series. Norms below 1e-6 (vanishing or absent gradients) land in the first bucket, finite
#: norms above 1e6 (far beyond any exploding threshold) in ``+Inf`` only. NaN and Inf norms are
#: not observed: the non-finite counters count them, and an Inf would make the sum Inf forever.
NORM_BUCKETS: tuple[float, ...] = (
    *(float(f"{m}e{e}") for e in range(-6, 6) for m in (1, 3)),
    1e6,
)
_NORM_LE = tuple(floatToGoString(b) for b in (*NORM_BUCKETS, math.inf))
#: One series' histogram: counts per bucket (floats, not cumulative, ``+Inf`` last) and the sum.
_Hist = tuple[tuple[float, ...], float]
_NO_OBSERVATION: _Hist = ((0.0,) * (len(NORM_BUCKETS) + 1), 0.0)


def _observe(hist: _Hist, norm: float) -> _Hist:
    """``hist`` after observing ``norm`` (finite norms only)."""
    if not math.isfinite(norm):
        return hist
    counts, total = hist
    i = bisect.bisect_left(NORM_BUCKETS, norm)  # le: a norm equal to a bound is in its bucket
    return (*counts[:i], counts[i] + 1.0, *counts[i + 1 :]), total + norm


def _histogram(hist: _Hist) -> HistogramValue:
    counts, total = hist
    return HistogramValue(tuple(zip(_NORM_LE, itertools.accumulate(counts), strict=True)), total)


@dataclass(frozen=True)
class SeriesCounts:
    """Running totals per series (the global norm and each group) over published snapshots,
    so that what happened between two scrapes is never lost: spikes
    (:attr:`Snapshot.spike_step`'s parts), non-finite groups of non-finite steps
    (:attr:`Snapshot.nonfinite_step`, :attr:`Snapshot.nonfinite_groups`) and the distribution
    of the per-step norms. Immutable: a new one per publish."""

    global_spikes: int = 0
    group_spikes: Mapping[str, int] = field(default_factory=dict)
    nonfinite_group_steps: Mapping[str, int] = field(default_factory=dict)
    global_norms: _Hist = _NO_OBSERVATION
    group_norms: Mapping[str, _Hist] = field(default_factory=dict)

    @classmethod
    def start(cls, groups: Mapping[str, object]) -> SeriesCounts:
        """Every configured group at 0 from the first scrape, so that increase() sees the
        first event; ``other`` joins when it first appears."""
        zeros = MappingProxyType(dict.fromkeys(groups, 0))
        return cls(
            group_spikes=zeros,
            nonfinite_group_steps=zeros,
            group_norms=MappingProxyType(dict.fromkeys(groups, _NO_OBSERVATION)),
        )

    def after(self, snap: Snapshot) -> SeriesCounts:
        spiking = set(snap.spiking_groups)
        bad = set(snap.nonfinite_groups) if snap.nonfinite_step else set()
        spikes = dict(self.group_spikes)
        nonfinite = dict(self.nonfinite_group_steps)
        norms = dict(self.group_norms)
        for g, stats in snap.groups.items():
            spikes[g] = spikes.get(g, 0) + int(g in spiking)
            nonfinite[g] = nonfinite.get(g, 0) + int(g in bad)
            norms[g] = _observe(norms.get(g, _NO_OBSERVATION), stats.norm)
        return SeriesCounts(
            global_spikes=self.global_spikes + int(snap.global_spike),
            group_spikes=MappingProxyType(spikes),
            nonfinite_group_steps=MappingProxyType(nonfinite),
            global_norms=_observe(self.global_norms, snap.global_norm),
            group_norms=MappingProxyType(norms),
        )

    def samples(self) -> dict[str, MetricValue]:
        return {
            "gradwatch_global_grad_norm_spikes_total": (((), float(self.global_spikes)),),
            "gradwatch_grad_norm_spikes_total": tuple(
                ((g,), float(n)) for g, n in self.group_spikes.items()
            ),
            "gradwatch_nonfinite_group_steps_total": tuple(
                ((g,), float(n)) for g, n in self.nonfinite_group_steps.items()
            ),
            "gradwatch_global_grad_norm_per_step": LabelledHistograms(
                (((), _histogram(self.global_norms)),)
            ),
            "gradwatch_grad_norm_per_step": LabelledHistograms(
                tuple(((g,), _histogram(h)) for g, h in self.group_norms.items())
            ),
        }


# -- the exporter's own counters --------------------------------------------------------------


@dataclass(frozen=True)
class SelfView:
    """A consistent reading of :class:`SelfStats`."""

    publish_errors: int
    dropped: int
    bucket_counts: tuple[int, ...]  # per bucket, not cumulative; last one is +Inf
    seconds_sum: float
    collecting: bool | None = None  # None: no watcher reported yet (both series absent)
    internal_errors: tuple[tuple[str, int], ...] = ()
    audits: tuple[tuple[str, float, int], ...] = ()  # (source, last ratio, disagreements)

    def samples(self) -> dict[str, MetricValue]:
        """The samples of every ``MetricSource.SELF_STATS`` metric."""
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip((*COLLECT_SECONDS_BUCKETS, math.inf), self.bucket_counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), float(cumulative)))
        out: dict[str, MetricValue] = {
            "gradwatch_publish_errors_total": (((), float(self.publish_errors)),),
            "gradwatch_dropped_snapshots_total": (((), float(self.dropped)),),
            "gradwatch_collect_seconds": HistogramValue(tuple(buckets), self.seconds_sum),
        }
        if self.collecting is not None:
            out["gradwatch_collecting"] = (((), 1.0 if self.collecting else 0.0),)
            out["gradwatch_internal_errors_total"] = tuple(
                ((kind,), float(n)) for kind, n in self.internal_errors
            )
        if self.audits:
            out["gradwatch_reported_norm_ratio"] = tuple(((s,), r) for s, r, _ in self.audits)
            out["gradwatch_norm_audit_disagreements_total"] = tuple(
                ((s,), float(n)) for s, _, n in self.audits
            )
        return out


class SelfStats:
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
        self._collecting: bool | None = None  # until the watcher's first measurement or error
        self._internal_errors = dict.fromkeys(INTERNAL_ERROR_KINDS, 0)
        self._audits: dict[str, tuple[float, int]] = {}  # source -> (last ratio, disagreements)
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

    def set_collecting(self, collecting: bool) -> None:
        """Whether the watcher is measuring (``gradwatch_collecting``); while it is not, the
        Collector shows no per-step gauge. Both watcher series are absent until the first
        call (or :meth:`add_internal_error`): before it nothing was measured either way."""
        with self._lock:
            if self._collecting != collecting:
                self._collecting = collecting
                self.version += 1

    def add_internal_error(self, kind: str) -> None:
        """Count one ``gradwatch_internal_errors_total{kind}`` (a kind of
        :data:`INTERNAL_ERROR_KINDS`) and mark the watcher as not collecting."""
        with self._lock:
            self._internal_errors[kind] = self._internal_errors.get(kind, 0) + 1
            self._collecting = False
            self.version += 1

    def add_audit(self, source: str, ratio: float, agrees: bool) -> None:
        """One audited norm of ``source`` (:mod:`gradwatch.audit`): its ``reported / exact``
        ratio (NaN when undefined) and whether it agreed. At most
        :data:`MAX_AUDIT_SOURCES` sources; later new ones are ignored (bounded series)."""
        with self._lock:
            if source not in self._audits and len(self._audits) >= MAX_AUDIT_SOURCES:
                return
            disagreements = self._audits.get(source, (0.0, 0))[1] + (not agrees)
            self._audits[source] = (ratio, disagreements)
            self.version += 1

    def view(self) -> SelfView:
        with self._lock:
            return SelfView(
                self._publish_errors,
                self._dropped,
                tuple(self._buckets),
                self._sum,
                self._collecting,
                tuple(self._internal_errors.items()),
                tuple((s, r, n) for s, (r, n) in self._audits.items()),
            )
