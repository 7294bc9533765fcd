"""Per-step scalars of a snapshot, for the tracker sinks (TensorBoard, W&B, MLflow).

A tracker shows a run by training step, so each published snapshot becomes one row of scalars
``{tag: value}`` logged at ``snapshot.step``. The row holds exactly what the endpoint would
show for that step, with the same meaning (it is built by the endpoint's own
:class:`~gradwatch.export.state.PublishedState`):

* the step's gauges of the metric catalog: global and per-group norms, normalized ratios (NaN
  when undefined, never a 0 that reads as dormant), health, spike scores, vanishing, exploding
  and non-finite tensors, clip coefficient, replica divergence and the per-rank view's figures
  when they were measured (absent, not zero, when not);
* the running totals of the catalog's per-step counters: non-finite steps, AMP-skipped steps,
  exploding steps, spikes, non-finite group steps, isolation violations (and any counter the
  catalog gains), so a chart shows *when* they increased.

When the sink's worker tells it (``note_dropped``), the row also carries
``<prefix>/dropped_steps``: how many collected steps this sink never got so far (its
``gradwatch_sink_dropped_steps_total`` plus ``gradwatch_dropped_snapshots_total``, the steps
the publisher dropped before any sink saw them), so a gap in a chart is explained in the
tracker itself.

Tags are ``<prefix>/<metric name without gradwatch_>[/<label value>...]``, e.g.
``gradwatch/grad_norm/attn`` or ``gradwatch/grad_norm_ratio/seed/host``. Left out: the step and
timestamp gauges (the tracker's own x axes), the per-parameter norms (names of a changing set
of parameters) and the origin of the last non-finite step (an identity, not a quantity).

This module imports no tracker and no torch.
"""

from __future__ import annotations

from gradwatch.config import WatchConfig
from gradwatch.export import metrics
from gradwatch.export.metricdef import MetricDef, MetricSource
from gradwatch.export.state import PublishedState
from gradwatch.snapshot import Snapshot

__all__ = ["EXCLUDED_METRICS", "StepScalars", "scalar_metrics", "tag"]

#: Catalog metrics a tracker row never carries (see the module docstring).
_EXCLUDED: tuple[MetricDef, ...] = (
    metrics.STEP,
    metrics.LAST_COLLECT_TIMESTAMP_SECONDS,
    metrics.PARAM_GRAD_NORM,
    metrics.LAST_NONFINITE_ORIGIN,
)
#: Their names.
EXCLUDED_METRICS = frozenset(d.name for d in _EXCLUDED)


def scalar_metrics() -> tuple[MetricDef, ...]:
    """The catalog metrics a row may carry: per-step gauges and counters, in catalog order."""
    return tuple(
        d
        for d in metrics.METRICS
        if d.source in (MetricSource.SNAPSHOT, MetricSource.COUNTS)
        and d.type in ("gauge", "counter")
        and d not in _EXCLUDED
    )


def tag(prefix: str, name: str, labels: tuple[str, ...]) -> str:
    """``prefix/<name without gradwatch_>/<label values...>``."""
    return "/".join((prefix, name.removeprefix("gradwatch_"), *labels))


class StepScalars:
    """Turns each snapshot, in step order, into its row ``{tag: value}``.

    Stateful (the counters run over the snapshots it was given), so one instance serves one
    sink. Not thread-safe: the sink's thread is its only caller.

    Args:
        config: the watcher's configuration (ratio labels, groups whose counters start at 0);
            None: the defaults, which give the same row for every snapshot field.
        prefix: first component of every tag.
    """

    def __init__(self, config: WatchConfig | None = None, *, prefix: str = "gradwatch") -> None:
        if not prefix or prefix != prefix.strip("/"):
            raise ValueError(f"prefix {prefix!r} is empty or starts or ends with '/'")
        self.prefix = prefix
        cfg = config if config is not None else WatchConfig.model_construct()
        self._state = PublishedState(cfg)
        self._metrics = scalar_metrics()
        #: Collected steps the sink never got (set by its ``note_dropped``); None: no tag.
        self.dropped_steps: int | None = None
        self._last: Snapshot | None = None
        self._row: dict[str, float] = {}

    def __call__(self, snapshot: Snapshot) -> dict[str, float]:
        """The row of ``snapshot``; the same snapshot again (a retried write) gives the same
        row, its counters not counted twice."""
        if snapshot is not self._last:
            self._last, self._row = snapshot, self._fold(snapshot)
        row = dict(self._row)
        if self.dropped_steps is not None:
            row[tag(self.prefix, "dropped_steps", ())] = float(self.dropped_steps)
        return row

    def _fold(self, snapshot: Snapshot) -> dict[str, float]:
        self._state.write(snapshot)
        state = self._state.current()
        row: dict[str, float] = {}
        for d in self._metrics:
            source = state.samples if d.source is MetricSource.SNAPSHOT else state.count_samples
            value = source.get(d)
            if not isinstance(value, tuple):  # absent (no key), or a histogram
                continue
            for labels, v in value:
                row[tag(self.prefix, d.name, tuple(labels))] = float(v)
        return row
