"""One exported metric's definition and the values it reads: the catalog's data model.

* :class:`MetricDef`: name, type, labels, HELP text, buckets and ``read``, the function giving
  the metric's samples from its :class:`MetricSource`'s object. :mod:`gradwatch.export.metrics`
  holds one per metric; everything else refers to those objects, never to a name string.
* The samples a ``read`` returns (:data:`MetricValue`), the objects it reads
  (:class:`PublishedStep`, :class:`JobInfo`; the running totals and the self-stats are
  :mod:`gradwatch.export.state`'s) and the small readers the definitions compose.
* The catalog's bounds: histogram buckets and series caps, so no label set grows without limit.

Like prometheus_client's ``metrics_core``, this module is the data model only: folding
snapshots into the sources is :mod:`gradwatch.export.state`'s job, rendering the exposition
:mod:`gradwatch.export.collector`'s. No threads, no HTTP, no torch.
"""

from __future__ import annotations

import enum
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from prometheus_client.utils import floatToGoString

from gradwatch.config import RatioSpec
from gradwatch.snapshot import Snapshot, ratio_defined

__all__ = [
    "COLLECT_SECONDS_BUCKETS",
    "MAX_AUDIT_SOURCES",
    "MAX_ORIGIN_SERIES",
    "MAX_PARAM_SERIES",
    "NORM_BUCKETS",
    "HistogramValue",
    "JobInfo",
    "LabelledHistograms",
    "MetricDef",
    "MetricSource",
    "MetricType",
    "MetricValue",
    "PublishedStep",
    "Sample",
    "select_param_series",
]

MetricType = Literal["gauge", "counter", "histogram", "info"]


class MetricSource(enum.Enum):
    """The object a metric's ``read`` is given (see :mod:`gradwatch.export.state`)."""

    #: The last published snapshot (a :class:`PublishedStep`); absent before the first one, so
    #: a gauge never shows a zero that was not measured.
    SNAPSHOT = "snapshot"
    #: Running totals over published snapshots (:class:`~gradwatch.export.state.Counts`),
    #: swapped together with the snapshot so a scrape never mixes two steps.
    COUNTS = "counts"
    #: The exporter's own counters (:class:`~gradwatch.export.state.SelfView`): errors,
    #: drops and the training thread's time in ``collect()``; not part of any step.
    SELF_STATS = "self_stats"
    #: Constant for the job's lifetime (a :class:`JobInfo`: versions, world size, parallelism).
    INFO = "info"


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


#: What a metric's ``read`` gives: its samples, or a histogram. ``None`` (or an empty value):
#: the metric is absent, never shown as zero.
MetricValue = tuple[Sample, ...] | HistogramValue | LabelledHistograms


@dataclass(frozen=True, eq=False)
class MetricDef:
    """One exported metric, whole: the Collector, the CLI's parse and docs/metrics.md all read
    this object. Compared and hashed by identity: samples are keyed by the object itself.

    Attributes:
        name: the exposed name (counters include ``_total``, info metrics ``_info``).
        type: Prometheus type.
        labels: label names, in order (histogram ``le`` not included).
        help: the HELP text, one sentence.
        notes: extra documentation for docs/metrics.md (when the series is absent, etc.).
        source: which object ``read`` is given.
        read: the metric's samples from that object; ``None`` when it is absent.
        buckets: a histogram's finite upper bounds (``+Inf`` implied); empty otherwise.
        exemplar: each series carries, in the OpenMetrics format, an exemplar of the step that
            last increased it (event counters only).
        absent: when the metric has no sample on the endpoint (and no value in the trackers'
            rows): the configurations and moments in which gradwatch cannot measure it.
            Every definition states it (docs/metrics.md's "absent when" column).
    """

    name: str
    type: MetricType
    labels: tuple[str, ...]
    help: str
    notes: str = ""
    source: MetricSource = field(kw_only=True)
    read: Callable[[Any], MetricValue | None] = field(kw_only=True, repr=False)
    buckets: tuple[float, ...] = field(default=(), kw_only=True)
    exemplar: bool = field(default=False, kw_only=True)
    absent: str = field(default="", kw_only=True)


# -- when a metric is absent (MetricDef.absent): the cases most metrics share ----------------

#: Nothing is served by a disabled watcher, so every metric is absent there; these say when
#: an enabled (or refused: it serves the info metrics and ``gradwatch_collecting 0``) one has
#: no sample.
ABSENT_UNTIL_MEASURED = (
    "Before the first measured step is published, while `gradwatch_collecting` is 0 "
    "(a refused watcher), and when disabled."
)
ABSENT_WHEN_DISABLED = "Only when disabled (present from the first scrape otherwise, refused too)."
ABSENT_WITHOUT_RANK_VIEW = (
    "Without the per-rank view: one process, DDP without `rank_view`, FSDP, ZeRO, pipeline "
    "stages without DDP, above the slot world size (docs/distributed.md); and as the per-step "
    "gauges."
)
ABSENT_WITHOUT_RANK_TIMING = (
    "Without `rank_timing` (the default) or with one process; on a step some rank did not "
    "time (its first collect, a failed pass); and as the per-step gauges."
)
ABSENT_WITHOUT_GUARD = "Without `watch.guard()`; and as the per-step gauges."
ABSENT_SPIKES_OFF = (
    "When spike detection is off (`spike_threshold` = 0); and as the per-step gauges."
)


# -- what the sources are ---------------------------------------------------------------------


@dataclass(frozen=True)
class PublishedStep:
    """What the per-step gauges read: the published snapshot and the export settings that
    shape its series (the ratios' label pairs by ``Snapshot.ratios`` key, the per-parameter
    top-k)."""

    snap: Snapshot
    ratio_labels: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    top_k: int = 0


@dataclass(frozen=True)
class JobInfo:
    """What the info metrics read: constant for the job's lifetime."""

    build: tuple[str, str]  # (gradwatch version, torch version)
    world_size: int
    parallelism: str
    run_id: str
    start_time: float
    ratios: Sequence[RatioSpec] = ()


class CollectTimes(Protocol):
    """What ``gradwatch_collect_seconds`` reads of the exporter's self-stats (``state``'s
    ``SelfView``): the count per bucket (not cumulative; the last is ``+Inf``) and the sum."""

    @property
    def bucket_counts(self) -> tuple[int, ...]: ...

    @property
    def seconds_sum(self) -> float: ...


# -- bounds: buckets and series caps ----------------------------------------------------------

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

#: Upper bounds (seconds) of the ``gradwatch_collect_seconds`` buckets: collect() queues work
#: and normally takes 0.1-10 ms; the upper buckets catch host syncs and pathological models.
COLLECT_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

#: At most this many ``gradwatch_param_grad_norm`` series per scrape, whatever
#: ``param_metrics_top_k`` is and however many parameters are non-finite, so a 10,000-parameter
#: model can never create 10,000 series.
MAX_PARAM_SERIES = 200

#: At most this many ``gradwatch_last_nonfinite_origin{rank,host}`` series (the lowest ranks of
#: the last event), however many ranks went non-finite at once.
MAX_ORIGIN_SERIES = 8

#: At most this many ``source`` label values of the norm-audit series (user-given strings).
MAX_AUDIT_SOURCES = 16

#: Pending results waiting for the publisher; a submit beyond this drops the oldest one.
#: Small on purpose: a few steps absorb scheduling jitter, more would only publish stale steps.
MAX_PENDING = 4


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


# -- readers the definitions compose ----------------------------------------------------------


def one(value: float | None) -> tuple[Sample, ...] | None:
    """The one unlabelled sample of ``value``; absent when it is None (not measured)."""
    return None if value is None else (((), float(value)),)


def each(items: Iterable[tuple[str, float]]) -> tuple[Sample, ...]:
    """One sample per ``(label value, value)`` pair, in order."""
    return tuple(((key,), float(value)) for key, value in items)


def group_field(name: str) -> Callable[[PublishedStep], tuple[Sample, ...]]:
    """A per-group gauge: ``GroupStats.<name>`` of every group of the published snapshot."""
    get = operator.attrgetter(name)
    return lambda s: tuple(((g,), float(get(stats))) for g, stats in s.snap.groups.items())


def measured_group_field(name: str) -> Callable[[PublishedStep], tuple[Sample, ...] | None]:
    """A per-group gauge of a figure that may be unmeasured: ``GroupStats.<name>`` of every
    group where it is not None; absent when no group has it."""
    get = operator.attrgetter(name)

    def read(s: PublishedStep) -> tuple[Sample, ...] | None:
        samples = tuple(
            ((g,), float(value)) for g, stats in s.snap.groups.items()
            for value in (get(stats),) if value is not None
        )
        return samples or None

    return read


def rank_view_field(name: str) -> Callable[[PublishedStep], tuple[Sample, ...] | None]:
    """A gauge of the per-rank view: ``Snapshot.<name>``, absent without the view or when the
    view did not measure it."""
    get = operator.attrgetter(name)
    return lambda s: one(get(s.snap)) if s.snap.rank_view else None


def le_values(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` label values of a histogram with ``bounds``, ``+Inf`` last, as the exposition
    writes them."""
    return tuple(floatToGoString(b) for b in (*bounds, math.inf))


def cumulative_histogram(
    le: tuple[str, ...], counts: Iterable[float], total: float
) -> HistogramValue:
    """A histogram from its ``le`` values (:func:`le_values`), its per-bucket counts (floats,
    not cumulative, ``+Inf`` last) and its sum."""
    return HistogramValue(tuple(zip(le, itertools.accumulate(counts), strict=True)), total)


#: HELP and description of ``gradwatch_adaptive_clip_threshold`` (:mod:`gradwatch.export.metrics`).
ADAPTIVE_CLIP_THRESHOLD_TEXT = (
    "Adaptive clip threshold of the last published step: the EMA mean plus adaptive_clip_z "
    "EMA standard deviations of the whole-model norms of earlier steps, on the device.",
    "`clip_grad_norm_(\"auto\")` clips a step whose gradwatch_global_grad_norm exceeds it.",
)
ADAPTIVE_CLIP_THRESHOLD_ABSENT = (
    "During the first `adaptive_clip_warmup` measured steps, and without an adaptive history "
    "(no `clip_grad_norm_(\"auto\")`, no guard with `guard_spike_statistic=\"ema\"`); and as "
    "the per-step gauges."
)

#: The per-step norm histograms' bucket bounds, as documented.
NORM_BUCKETS_TEXT = (
    "1e-06, 3e-06, 1e-05, ... (1 and 3 times each power of ten) up to 1e+06, then +Inf "
    f"({len(NORM_BUCKETS)} bounds)"
)


# -- readers of one metric each (the catalog, gradwatch.export.metrics, uses them) ----------


def ratio_samples(s: PublishedStep) -> tuple[Sample, ...]:
    """``gradwatch_grad_norm_ratio``: NaN where undefined (the denominator without a usable
    norm), not the 0 the snapshot holds, which would read as "dormant"."""
    out: list[Sample] = []
    for key, value in s.snap.ratios.items():
        labels = s.ratio_labels.get(key) or tuple(key.split("/", 1))
        defined = ratio_defined(s.snap.groups.get(labels[-1]))
        out.append((labels, float(value) if defined else float("nan")))
    return tuple(out)


def isolation_samples(s: PublishedStep) -> tuple[Sample, ...]:
    """``gradwatch_isolation_violated``: 1 or 0 per isolated group; a group whose isolation
    was not measured (None) has no sample."""
    return each((g, float(v)) for g, v in s.snap.isolation_violated.items() if v is not None)


def replica_spread(s: PublishedStep) -> tuple[Sample, ...] | None:
    """``gradwatch_replica_grad_norm{stat}``: the replicas' min, median and max local norms."""
    snap = s.snap
    if not snap.rank_view or snap.replica_grad_norm_max is None:
        return None
    stats = (
        ("min", snap.replica_grad_norm_min),
        ("median", snap.replica_grad_norm_median),
        ("max", snap.replica_grad_norm_max),
    )
    return each((stat, v) for stat, v in stats if v is not None)


def slowest_rank_samples(s: PublishedStep) -> tuple[Sample, ...] | None:
    """``gradwatch_slowest_rank{host}``: one series whatever the world size, the slowest
    rank's host as its label value."""
    rank = s.snap.slowest_rank
    if rank is None:
        return None
    return (((s.snap.slowest_host or ""),), float(rank)),


def work_seconds_samples(s: PublishedStep) -> tuple[Sample, ...] | None:
    """``gradwatch_rank_work_seconds{quantity}``: min, median and max over the ranks."""
    snap = s.snap
    if snap.work_seconds_max is None:
        return None
    return tuple(
        ((quantity,), float(value))
        for quantity, value in (
            ("min", snap.work_seconds_min),
            ("median", snap.work_seconds_median),
            ("max", snap.work_seconds_max),
        )
        if value is not None
    )


NORM_LE = le_values(NORM_BUCKETS)
COLLECT_SECONDS_LE = le_values(COLLECT_SECONDS_BUCKETS)


def norm_histogram(hist: tuple[tuple[float, ...], float]) -> HistogramValue:
    """One series of the per-step norm histograms from its counts per bucket and sum."""
    return cumulative_histogram(NORM_LE, *hist)


def collect_seconds_histogram(v: CollectTimes) -> HistogramValue:
    """``gradwatch_collect_seconds`` from the self-stats' bucket counts and sum."""
    return cumulative_histogram(COLLECT_SECONDS_LE, map(float, v.bucket_counts), v.seconds_sum)


def ratio_bands(j: JobInfo) -> tuple[Sample, ...]:
    """``gradwatch_grad_norm_ratio_band``: three levels per configured ratio."""
    return tuple(
        ((r.numerator, r.denominator, bound), float(level))
        for r in j.ratios
        for bound, level in (("low", r.low), ("high", r.high), ("dormant", r.dormant))
    )
