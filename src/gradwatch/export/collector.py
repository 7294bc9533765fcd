"""The prometheus_client Collector: :data:`~gradwatch.export.metrics.METRICS` rendered from
the published state, the self-stats and the job's constant info.

A scrape reads the published :class:`~gradwatch.export.state.State` once (one immutable
object: one step) and the self-stats once, then renders every metric of the catalog in order
from the samples its :class:`~gradwatch.export.metricdef.MetricDef` read from its source. A
metric whose source holds no sample is absent, not zero. This module is the encoding only:
what a metric is and how its samples are read is the catalog's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.samples import Exemplar

from gradwatch.config import RatioSpec
from gradwatch.export.metricdef import (
    HistogramValue,
    JobInfo,
    LabelledHistograms,
    MetricDef,
    MetricSource,
    MetricValue,
)
from gradwatch.export.metrics import METRICS, read_all
from gradwatch.export.state import PublishedState, Samples, SelfStats, StepExemplar

__all__ = ["SnapshotCollector"]


class SnapshotCollector:
    """prometheus_client Collector over a :class:`PublishedState` and :class:`SelfStats`.

    Thread-safe: the state may be replaced and the stats updated concurrently with any number
    of :meth:`collect` calls; each works on one reading of each.
    """

    def __init__(
        self,
        state: PublishedState,
        stats: SelfStats,
        *,
        world_size: int,
        parallelism: str,
        run_id: str,
        start_time: float,
        ratios: Sequence[RatioSpec] = (),
    ) -> None:
        self._state = state
        self._stats = stats
        job = JobInfo(_build_labels(), world_size, str(parallelism), run_id, start_time, ratios)
        self._info: Samples = read_all(MetricSource.INFO, job)

    def version(self) -> tuple[int, int]:
        """Changes whenever a scrape would show something new (a publish, a counter, a
        histogram observation); equal versions render the same exposition."""
        return self._state.current().version, self._stats.version

    def describe(self) -> Iterator[Metric]:
        """Names only, so a registry can refuse a second collector exporting the same ones."""
        for d in METRICS:
            yield _family(d)

    def collect(self) -> Iterator[Metric]:
        state = self._state.current()
        view = self._stats.view()
        sources: dict[MetricSource, Samples] = {
            # Not collecting: the last snapshot is no longer a measurement of the job's present.
            MetricSource.SNAPSHOT: {} if view.collecting is False else state.samples,
            MetricSource.COUNTS: state.count_samples,
            MetricSource.SELF_STATS: view.samples(),
            MetricSource.INFO: self._info,
        }
        for d in METRICS:
            value = sources[d.source].get(d)
            if value:  # absent, not zero: nothing measured
                yield _render(d, value, state.exemplars if d.exemplar else None)


def _base(d: MetricDef) -> str:
    """Family name as prometheus_client wants it (it appends _total / _info itself)."""
    for suffix in ("_total", "_info"):
        if d.name.endswith(suffix) and d.type in ("counter", "info"):
            return d.name[: -len(suffix)]
    return d.name


def _family(d: MetricDef) -> Metric:
    labels = list(d.labels)
    if d.type == "gauge":
        return GaugeMetricFamily(d.name, d.help, labels=labels)
    if d.type == "counter":
        return CounterMetricFamily(_base(d), d.help, labels=labels)
    if d.type == "histogram":
        return HistogramMetricFamily(d.name, d.help, labels=labels)
    return InfoMetricFamily(_base(d), d.help, labels=labels)


def _render(
    d: MetricDef,
    value: MetricValue,
    exemplars: Mapping[tuple[MetricDef, tuple[str, ...]], StepExemplar] | None = None,
) -> Metric:
    """The family of ``d`` with its samples; a counter's series carry their exemplar when
    ``exemplars`` has one (only the OpenMetrics format shows them)."""
    if isinstance(value, HistogramValue):
        return HistogramMetricFamily(
            d.name, d.help, buckets=list(value.buckets), sum_value=value.sum
        )
    if isinstance(value, LabelledHistograms):
        family = HistogramMetricFamily(d.name, d.help, labels=list(d.labels))
        for labels, h in value.series:
            family.add_metric(list(labels), list(h.buckets), sum_value=h.sum)
        return family
    if d.type == "info":  # prometheus_client takes info labels as the value
        family = InfoMetricFamily(_base(d), d.help)
        for labels, _ in value:
            family.add_metric([], dict(zip(d.labels, labels, strict=True)))
        return family
    family = _family(d)
    for labels, v in value:
        ex = exemplars.get((d, tuple(labels))) if exemplars else None
        if ex is not None and isinstance(family, CounterMetricFamily):
            exemplar = Exemplar(ex.labels(), ex.increase, ex.timestamp)
            family.add_metric(labels, v, exemplar=exemplar)
        else:
            family.add_metric(labels, v)
    return family


def _build_labels() -> tuple[str, str]:
    """``(version, torch_version)``, the labels of ``gradwatch_build_info``."""
    try:
        from gradwatch.version import __version__ as version
    except ImportError:  # pragma: no cover - partial installs
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("torch-gradwatch")
        except PackageNotFoundError:
            version = "unknown"
    try:
        import torch

        torch_version = str(torch.__version__)
    except ImportError:  # pragma: no cover - gradwatch requires torch
        torch_version = "unknown"
    return str(version), torch_version
