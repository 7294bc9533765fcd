"""What the endpoint shows: the published state (one step and the counts) and the self-stats.

* :class:`PublishedState` is the endpoint's :class:`~gradwatch.export.publisher.Sink`: every
  published snapshot is folded into a new immutable :class:`State` (every sample of every
  snapshot-derived gauge and counter) that replaces the old one whole, so a scrape that reads
  the state once never shows half of one step and half of another.
* :class:`SelfStats` are the exporter's own counters (errors, drops, the training thread's time
  in ``collect()``): not part of a step, so they live outside the state, under their own lock.

The samples are read through the catalog's definitions (:func:`gradwatch.export.metrics.
read_all`) and keyed by them; each definition's :class:`~gradwatch.export.metricdef.
MetricSource` says which object it reads. Steps are classified by
:class:`~gradwatch.snapshot.Snapshot` (``nonfinite_step``, ``amp_skipped``, ``exploding_step``),
the one definition every consumer shares.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gradwatch.config import WatchConfig, ratio_key
from gradwatch.export import metrics
from gradwatch.export.metricdef import (
    MAX_AUDIT_SOURCES,
    MAX_ORIGIN_SERIES,
    MetricDef,
    MetricSource,
    MetricValue,
    PublishedStep,
)
from gradwatch.snapshot import Snapshot

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

#: Samples keyed by their metric's definition (the catalog object, never its name).
Samples = Mapping[MetricDef, MetricValue]

# -- published state ------------------------------------------------------------------------

#: The per-step norm histograms' bounds (the catalog's), for observing a norm.
_NORM_BOUNDS = metrics.GRAD_NORM_PER_STEP.buckets
#: One series' histogram: counts per bucket (floats, not cumulative, ``+Inf`` last) and the sum.
_Hist = tuple[tuple[float, ...], float]
_NO_OBSERVATION: _Hist = ((0.0,) * (len(_NORM_BOUNDS) + 1), 0.0)


def _observe(hist: _Hist, norm: float) -> _Hist:
    """``hist`` after observing ``norm`` (finite norms only)."""
    if not math.isfinite(norm):
        return hist
    counts, total = hist
    i = bisect.bisect_left(_NORM_BOUNDS, norm)  # le: a norm equal to a bound is in its bucket
    return (*counts[:i], counts[i] + 1.0, *counts[i + 1 :]), total + norm


@dataclass(frozen=True)
class Counts:
    """Running totals over published snapshots (immutable: a new one per publish): the step
    counters, the guard's skips, the origin of the last non-finite step, and per series (the
    global norm and each group) what happened between two scrapes so it is never lost: spikes
    (:attr:`Snapshot.spike_step`'s parts), non-finite groups of non-finite steps
    (:attr:`Snapshot.nonfinite_step`, :attr:`Snapshot.nonfinite_groups`) and the distribution
    of the per-step norms."""

    collections: int = 0
    nonfinite_steps: int = 0
    no_gradient_steps: int = 0
    amp_skipped_steps: int = 0
    exploding_steps: int = 0
    isolation_violations: Mapping[str, int] = field(default_factory=dict)
    # the per-rank view: the origin (rank, host) of the last non-finite step, and its step
    last_origin: tuple[tuple[str, str], ...] = ()
    last_origin_step: int = 0
    # the guard's running totals by reason, as of the last guarded snapshot
    skipped_steps: Mapping[str, int] = field(default_factory=dict)
    # every published step, per series
    global_spikes: int = 0
    group_spikes: Mapping[str, int] = field(default_factory=dict)
    nonfinite_group_steps: Mapping[str, int] = field(default_factory=dict)
    global_norms: _Hist = _NO_OBSERVATION
    group_norms: Mapping[str, _Hist] = field(default_factory=dict)

    @classmethod
    def start(cls, groups: Mapping[str, object], isolated: tuple[str, ...] = ()) -> Counts:
        """Every configured group (and isolated group) at 0 from the first scrape, so that
        increase() sees the first event; ``other`` joins when it first appears."""
        zeros = MappingProxyType(dict.fromkeys(groups, 0))
        return cls(
            isolation_violations=MappingProxyType(dict.fromkeys(isolated, 0)),
            group_spikes=zeros,
            nonfinite_group_steps=zeros,
            group_norms=MappingProxyType(dict.fromkeys(groups, _NO_OBSERVATION)),
        )

    def after(self, snap: Snapshot) -> Counts:
        violations = dict(self.isolation_violations)
        for group, violated in snap.isolation_violated.items():
            violations[group] = violations.get(group, 0) + int(violated is True)
        origin, origin_step = self.last_origin, self.last_origin_step
        if snap.nonfinite_origin_ranks:
            hosts = (*snap.nonfinite_origin_hosts, *[""] * len(snap.nonfinite_origin_ranks))
            pairs = sorted(zip(snap.nonfinite_origin_ranks, hosts, strict=False))
            pairs = pairs[:MAX_ORIGIN_SERIES]
            origin = tuple((str(r), h) for r, h in pairs)
            origin_step = snap.step
        spiking = set(snap.spiking_groups)
        bad = set(snap.nonfinite_groups) if snap.nonfinite_step else set()
        spikes = dict(self.group_spikes)
        nonfinite = dict(self.nonfinite_group_steps)
        norms = dict(self.group_norms)
        for g, stats in snap.groups.items():
            spikes[g] = spikes.get(g, 0) + int(g in spiking)
            nonfinite[g] = nonfinite.get(g, 0) + int(g in bad)
            norms[g] = _observe(norms.get(g, _NO_OBSERVATION), stats.norm)
        return Counts(
            last_origin=origin,
            last_origin_step=origin_step,
            collections=self.collections + 1,
            nonfinite_steps=self.nonfinite_steps + int(snap.nonfinite_step),
            no_gradient_steps=self.no_gradient_steps + int(snap.no_gradient),
            amp_skipped_steps=self.amp_skipped_steps + int(snap.amp_skipped),
            exploding_steps=self.exploding_steps + int(snap.exploding_step),
            isolation_violations=MappingProxyType(violations),
            skipped_steps=MappingProxyType(dict(snap.skipped_steps))
            if snap.skipped_steps
            else self.skipped_steps,
            global_spikes=self.global_spikes + int(snap.global_spike),
            group_spikes=MappingProxyType(spikes),
            nonfinite_group_steps=MappingProxyType(nonfinite),
            global_norms=_observe(self.global_norms, snap.global_norm),
            group_norms=MappingProxyType(norms),
        )

    def samples(self) -> dict[MetricDef, MetricValue]:
        """The samples of every ``MetricSource.COUNTS`` metric."""
        return metrics.read_all(MetricSource.COUNTS, self)


@dataclass(frozen=True)
class State:
    """Everything one scrape shows about published snapshots. Never mutated: swapped whole.

    Attributes:
        counts: the running totals, and ``count_samples`` their samples.
        samples: the samples of the last published snapshot (empty before the first).
        step: its step (None before the first).
        version: publishes so far: the key of the rendered-exposition cache.
        exemplars: per counter series ``(definition, label values)``, the step that last
            increased it.
    """

    counts: Counts
    count_samples: Samples
    samples: Samples = field(default_factory=dict)
    step: int | None = None
    version: int = 0
    exemplars: Mapping[tuple[MetricDef, tuple[str, ...]], StepExemplar] = field(
        default_factory=dict
    )


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
    before: Samples,
    after: Samples,
    snap: Snapshot,
    kept: Mapping[tuple[MetricDef, tuple[str, ...]], StepExemplar],
) -> dict[tuple[MetricDef, tuple[str, ...]], StepExemplar]:
    """``kept`` with an exemplar of ``snap`` for every counter series that ``snap`` increased
    from ``before`` to ``after``: generic over the counters, so every counter of the counts has
    one; the Collector attaches those the catalog marks (``MetricDef.exemplar``)."""
    out = dict(kept)
    origin = min(snap.nonfinite_origin_ranks) if snap.nonfinite_origin_ranks else None
    timestamp = float(snap.timestamp) if snap.timestamp > 0 else None
    for d, value in after.items():
        if d.type != "counter" or not isinstance(value, tuple):
            continue
        old = before.get(d)
        previous = dict(old) if isinstance(old, tuple) else {}
        for labels, v in value:
            grew = v - previous.get(labels, 0.0)
            if grew > 0:
                out[(d, labels)] = StepExemplar(snap.step, grew, timestamp, origin)
    return out


def snapshot_samples(
    snap: Snapshot, ratio_labels: Mapping[str, tuple[str, str]], top_k: int
) -> dict[MetricDef, MetricValue]:
    """The samples of every ``MetricSource.SNAPSHOT`` metric for ``snap`` (absent: no key)."""
    return metrics.read_all(MetricSource.SNAPSHOT, PublishedStep(snap, ratio_labels, top_k))


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
        # Counters start at 0 for every group, so that increase() sees the first event.
        counts = Counts.start(cfg.groups, tuple(cfg.isolated))
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._state = State(counts=counts, count_samples=MappingProxyType(counts.samples()))

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
            count_samples = counts.samples()
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
            )
            with self._lock:
                self._state = state


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
    sink_errors: tuple[tuple[str, int], ...] = ()  # per sink, in the order they were added
    sink_dropped: tuple[tuple[str, int], ...] = ()

    def samples(self) -> dict[MetricDef, MetricValue]:
        """The samples of every ``MetricSource.SELF_STATS`` metric."""
        return metrics.read_all(MetricSource.SELF_STATS, self)


#: ``gradwatch_collect_seconds``' bounds (the catalog's), for observing a collect.
_COLLECT_BOUNDS = metrics.COLLECT_SECONDS.buckets


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
        self._buckets = [0] * (len(_COLLECT_BOUNDS) + 1)
        self._sum = 0.0
        self._collecting: bool | None = None  # until the watcher's first measurement or error
        self._internal_errors = dict.fromkeys(INTERNAL_ERROR_KINDS, 0)
        self._audits: dict[str, tuple[float, int]] = {}  # source -> (last ratio, disagreements)
        self._sink_errors: dict[str, int] = {}
        self._sink_dropped: dict[str, int] = {}
        self.version = 0  # bumped by every change; read without the lock (an int load)

    def observe(self, seconds: float) -> None:
        if not seconds >= 0.0:  # NaN or negative: a clock oddity, not a measurement
            return
        # bisect_left: a value equal to a bound belongs to that bucket (le = "less or equal").
        i = bisect.bisect_left(_COLLECT_BOUNDS, seconds)
        with self._lock:
            self._buckets[i] += 1
            self._sum += seconds
            self.version += 1

    def add_error(self) -> None:
        with self._lock:
            self._publish_errors += 1
            self.version += 1

    @property
    def dropped(self) -> int:
        """``gradwatch_dropped_snapshots_total`` so far."""
        with self._lock:
            return self._dropped

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
        """One audited norm of ``source`` (:mod:`gradwatch.analysis.audit`): its ``reported /
        exact`` ratio (NaN when undefined) and whether it agreed. At most
        :data:`MAX_AUDIT_SOURCES` sources; later new ones are ignored (bounded series)."""
        with self._lock:
            if source not in self._audits and len(self._audits) >= MAX_AUDIT_SOURCES:
                return
            disagreements = self._audits.get(source, (0.0, 0))[1] + (not agrees)
            self._audits[source] = (ratio, disagreements)
            self.version += 1

    def add_sink(self, sink: str) -> None:
        """Start the ``sink`` series of both sink counters at 0 (a sink was added)."""
        with self._lock:
            self._sink_errors.setdefault(sink, 0)
            self._sink_dropped.setdefault(sink, 0)
            self.version += 1

    def add_sink_error(self, sink: str) -> None:
        """Count one ``gradwatch_sink_errors_total{sink}``: a failed or stalled write."""
        with self._lock:
            self._sink_errors[sink] = self._sink_errors.get(sink, 0) + 1
            self.version += 1

    def add_sink_dropped(self, sink: str, steps: int = 1) -> None:
        """Count ``steps`` in ``gradwatch_sink_dropped_steps_total{sink}``."""
        with self._lock:
            self._sink_dropped[sink] = self._sink_dropped.get(sink, 0) + steps
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
                tuple(self._sink_errors.items()),
                tuple(self._sink_dropped.items()),
            )
