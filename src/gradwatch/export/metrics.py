"""The metric catalog: one :class:`~gradwatch.export.metricdef.MetricDef` per exported metric.

Each definition is the whole metric: name, type, labels, HELP text, buckets and ``read`` (its
samples from its source). The names are a contract (alert rules, the dashboard and outside checks
rely on them), written once, here or in ``rankmetrics``; everything else refers to the objects
(``metrics.GRAD_NORM.name``), never to a name string. Each object is named after its metric without
``gradwatch_``, upper case. The published state reads its samples through :func:`read_all`, the
Collector renders exactly :data:`METRICS` in order, ``gradwatch top`` parses an exposition by them
and ``scripts/gen_metrics_docs.py`` writes docs/metrics.md from them. Data only: no threads, no
HTTP, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from prometheus_client.utils import floatToGoString

from gradwatch.analysis.rankview import NOISE_SCALE_UNIT, NOISE_SCALE_WINDOW
from gradwatch.export import metricdef as md
from gradwatch.export.metricdef import (
    COLLECT_SECONDS_BUCKETS,
    MAX_AUDIT_SOURCES,
    MAX_ORIGIN_SERIES,
    MAX_PARAM_SERIES,
    MAX_PENDING,
    NORM_BUCKETS,
    NORM_BUCKETS_TEXT,
    LabelledHistograms,
    MetricDef,
    MetricSource,
    MetricValue,
    each,
    group_field,
    one,
    rank_view_field,
    select_param_series,
)
from gradwatch.export.optimizer_metrics import (
    SKIPPED_STEPS_TOTAL,
    STALLED_UPDATE_FRACTION,
    UPDATE_NORM,
    UPDATE_RATIO,
    WEIGHT_NORM,
)
from gradwatch.export.rankmetrics import RANK_WORK_SECONDS, SLOWEST_RANK, STRAGGLER_SCORE

__all__ = [
    "EXEMPLAR_COUNTERS", "METRICS", "METRICS_BY_NAME", "MetricDef", "MetricSource", "read_all",
]  # fmt: skip

# -- the definitions ----------------------------------------------------------------------------

# -- gauges of the last published snapshot (absent until the first one) --------------------
STEP = MetricDef(
    "gradwatch_step",
    "gauge",
    (),
    "Training step of the last published snapshot.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.step),
)
LAST_COLLECT_TIMESTAMP_SECONDS = MetricDef(
    "gradwatch_last_collect_timestamp_seconds",
    "gauge",
    (),
    "Wall-clock time (Unix seconds) of the collect() call of the last published snapshot.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.timestamp),
)
GLOBAL_GRAD_NORM = MetricDef(
    "gradwatch_global_grad_norm",
    "gauge",
    (),
    "L2 norm of all gradients of the whole model at the last published step.",
    "NaN or +Inf when a gradient holds NaN or Inf.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.global_norm),
)
GRAD_NORM = MetricDef(
    "gradwatch_grad_norm",
    "gauge",
    ("group",),
    "L2 norm of the gradients of one parameter group at the last published step.",
    "Configured groups always appear; `other` only when some parameter matched no pattern.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=group_field("norm"),
)
GRAD_NORM_RATIO = MetricDef(
    "gradwatch_grad_norm_ratio",
    "gauge",
    ("numerator", "denominator"),
    "Normalized gradient-norm ratio of two groups: (n_norm/sqrt(n_numel)) / "
    "(d_norm/sqrt(d_numel) + 1e-8).",
    "One series per configured `ratios` pair. Undefined, and exported as NaN, when the "
    "denominator group has no gradient or a norm below 1e-8 or non-finite (0 would read "
    "as dormant); 0 when only the numerator's norm is below 1e-8 or it has no gradient.",
    absent="Without configured `ratios`; and as the per-step gauges.",
    source=MetricSource.SNAPSHOT,
    read=md.ratio_samples,
)
GROUP_PARAMETERS = MetricDef(
    "gradwatch_group_parameters",
    "gauge",
    ("group",),
    "Number of gradient elements (numel) of the group's parameters that had a gradient.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=group_field("numel"),
)
VANISHING_TENSORS = MetricDef(
    "gradwatch_vanishing_tensors",
    "gauge",
    ("group",),
    "Parameters of the group whose gradient L2 norm is below vanishing_threshold.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=group_field("vanishing"),
)
EXPLODING_TENSORS = MetricDef(
    "gradwatch_exploding_tensors",
    "gauge",
    ("group",),
    "Parameters of the group whose gradient L2 norm is above exploding_threshold or non-finite.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=group_field("exploding"),
)
NONFINITE_TENSORS = MetricDef(
    "gradwatch_nonfinite_tensors",
    "gauge",
    ("group",),
    "Parameters of the group whose gradient holds NaN or Inf.",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=group_field("nonfinite"),
)
HEALTH_SCORE = MetricDef(
    "gradwatch_health_score",
    "gauge",
    (),
    "Gradient health in [0, 1]: clamp(1 - 0.5*vanishing/n - 0.8*exploding/n); 0 when the "
    "global norm is non-finite.",
    "n is the number of parameters with a gradient; NaN when no parameter has one (nothing "
    "to judge: `gradwatch_no_gradient_steps_total` counts such steps).",
    absent=md.ABSENT_UNTIL_MEASURED,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.health),
)
ISOLATION_VIOLATED = MetricDef(
    "gradwatch_isolation_violated",
    "gauge",
    ("group",),
    "1 when an isolated group's gradient norm exceeds isolation_threshold (or is "
    "non-finite) at the last published step, else 0.",
    "One series per `isolated` group.",
    absent="Without `isolated` groups; and as the per-step gauges.",
    source=MetricSource.SNAPSHOT,
    read=md.isolation_samples,
)
REPLICA_DIVERGENCE = MetricDef(
    "gradwatch_replica_divergence",
    "gauge",
    (),
    "Relative spread (max - min) / max of the data-parallel replicas' global norms at the "
    "last measurement.",
    "Measured every `divergence_every` collected steps; between measurements the last "
    "value is kept; 0 when the replicas' norms are identical.",
    absent="No replicas to compare (one process, FSDP, ZeRO 1-3) or `divergence_every` 0.",
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.replica_divergence),
)
CLIP_COEF = MetricDef(
    "gradwatch_clip_coef",
    "gauge",
    (),
    "Clip coefficient min(1, max_norm / (norm + 1e-6)) applied by "
    "GradWatch.clip_grad_norm_ at the last published step.",
    absent="When the last published step was not clipped through `clip_grad_norm_`.",
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.clip_coef),
)
ADAPTIVE_CLIP_THRESHOLD = MetricDef(
    "gradwatch_adaptive_clip_threshold", "gauge", (), *md.ADAPTIVE_CLIP_THRESHOLD_TEXT,
    absent=md.ADAPTIVE_CLIP_THRESHOLD_ABSENT, source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.adaptive_clip_threshold),
)
PARAM_GRAD_NORM = MetricDef(
    "gradwatch_param_grad_norm",
    "gauge",
    ("param",),
    "Gradient L2 norm of one parameter: the param_metrics_top_k largest finite norms plus "
    "every non-finite one.",
    f"Only when `param_metrics_top_k` > 0. At most {MAX_PARAM_SERIES} series "
    "(`MAX_PARAM_SERIES`): non-finite parameters first (by name), then the largest finite "
    "norms (ties by name). Series come and go as the ranking changes.",
    absent="With `param_metrics_top_k` 0 (the default); and as the per-step gauges.",
    source=MetricSource.SNAPSHOT,
    read=lambda s: each(select_param_series(s.snap, s.top_k)),
)
# -- the per-rank view (DDP comm hook; absent without it: FSDP2, no DDP, rank_view off) ----
NONFINITE_ORIGIN_RANKS = MetricDef(
    "gradwatch_nonfinite_origin_ranks",
    "gauge",
    (),
    "Ranks whose local gradients were already NaN or Inf before the data-parallel "
    "reduction, at the last published step.",
    "0 on a finite step.",
    absent=md.ABSENT_WITHOUT_RANK_VIEW,
    source=MetricSource.SNAPSHOT,
    read=rank_view_field("nonfinite_origin_count"),
)
REPLICA_GRAD_NORM = MetricDef(
    "gradwatch_replica_grad_norm",
    "gauge",
    ("stat",),
    "Spread of the data-parallel replicas' local gradient L2 norms before the reduction "
    "(stat: min, median, max) at the last published step.",
    "A replica's norm covers its pipeline stages. NaN (median) or NaN/+Inf (max) when "
    "some replica's local gradient was non-finite.",
    absent=md.ABSENT_WITHOUT_RANK_VIEW,
    source=MetricSource.SNAPSHOT,
    read=md.replica_spread,
)
REPLICA_GRAD_NORM_MAX_RANK = MetricDef(
    "gradwatch_replica_grad_norm_max_rank",
    "gauge",
    (),
    "Rank holding the largest local gradient norm (the lowest rank of that replica) at "
    "the last published step.",
    "A non-finite local norm counts as the largest.",
    absent=md.ABSENT_WITHOUT_RANK_VIEW,
    source=MetricSource.SNAPSHOT,
    read=rank_view_field("replica_grad_norm_max_rank"),
)
REPLICA_OUTLIER_SCORE = MetricDef(
    "gradwatch_replica_outlier_score",
    "gauge",
    (),
    "Largest relative deviation of a replica's local gradient norm from the replicas' "
    "median, max |x - median| / median, at the last published step.",
    "0 when all replicas agree; +Inf when a local norm is non-finite or the median is 0 "
    "while some norm is not. The GradwatchReplicaOutlier alert fires on a persistent "
    "outlier.",
    absent=md.ABSENT_WITHOUT_RANK_VIEW,
    source=MetricSource.SNAPSHOT,
    read=rank_view_field("replica_outlier_score"),
)
GRADIENT_NOISE_SCALE = MetricDef(
    "gradwatch_gradient_noise_scale",
    "gauge",
    (),
    "Gradient noise scale B_simple = tr(Sigma) / |G|^2 of the whole model, averaged over "
    f"the last {NOISE_SCALE_WINDOW} steps, in {NOISE_SCALE_UNIT}.",
    "McCandlish et al. 2018's unbiased estimators from the replicas' local and the reduced "
    "gradients (docs/distributed.md). NaN while undefined (either averaged estimate not "
    f"positive), never negative; one step leaves the average {NOISE_SCALE_WINDOW} steps later.",
    absent="Without the per-rank view or with fewer than 2 replicas.",
    source=MetricSource.SNAPSHOT,
    read=rank_view_field("gradient_noise_scale"),
)
GROUP_GRADIENT_NOISE_SCALE = MetricDef(
    "gradwatch_group_gradient_noise_scale",
    "gauge",
    ("group",),
    "Gradient noise scale B_simple of one parameter group, averaged over the last "
    f"{NOISE_SCALE_WINDOW} steps, in {NOISE_SCALE_UNIT}.",
    "As gradwatch_gradient_noise_scale, per group that had a gradient.",
    absent="As `gradwatch_gradient_noise_scale`; a group without a gradient has no series.",
    source=MetricSource.SNAPSHOT,
    read=lambda s: (each(s.snap.group_noise_scale.items()) or None) if s.snap.rank_view else None,
)
LAST_NONFINITE_ORIGIN = MetricDef(
    "gradwatch_last_nonfinite_origin",
    "gauge",
    ("rank", "host"),
    "Step of the last step whose non-finite gradients started on this rank before the reduction.",
    f"One series per origin rank of the last such step only (the lowest {MAX_ORIGIN_SERIES} "
    "ranks, `MAX_ORIGIN_SERIES`), kept until the next one: a bounded label set.",
    absent="Until a non-finite step whose origin the per-rank view measured.",
    source=MetricSource.COUNTS,
    read=lambda c: tuple((labels, float(c.last_origin_step)) for labels in c.last_origin),
)
# -- counters of published snapshots -------------------------------------------------------
COLLECTIONS_TOTAL = MetricDef(
    "gradwatch_collections_total",
    "counter",
    (),
    "Snapshots published (collected steps that reached the exporter).",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: one(c.collections),
)
NONFINITE_STEPS_TOTAL = MetricDef(
    "gradwatch_nonfinite_steps_total",
    "counter",
    (),
    "Published snapshots with a NaN or Inf gradient, except steps the AMP GradScaler skipped.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: one(c.nonfinite_steps),
    exemplar=True,
)
NO_GRADIENT_STEPS_TOTAL = MetricDef(
    "gradwatch_no_gradient_steps_total",
    "counter",
    (),
    "Published snapshots of steps on which no parameter had a gradient at all.",
    "collect() before backward(), or after zero_grad(set_to_none=True): its norms, ratios and "
    "health are NaN (not 0.0 and 1.0); logged once. The GradwatchNoGradient alert fires on it.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: one(c.no_gradient_steps),
)
AMP_SKIPPED_STEPS_TOTAL = MetricDef(
    "gradwatch_amp_skipped_steps_total",
    "counter",
    (),
    "Published snapshots of steps the AMP GradScaler skipped (non-finite gradients under "
    "loss scaling).",
    "Such a step is not counted in `gradwatch_nonfinite_steps_total`.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: one(c.amp_skipped_steps),
    exemplar=True,
)
EXPLODING_STEPS_TOTAL = MetricDef(
    "gradwatch_exploding_steps_total",
    "counter",
    (),
    "Published snapshots with at least one exploding parameter (non-finite ones included).",
    "AMP-skipped steps count here too: their non-finite parameters are exploding by definition.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: one(c.exploding_steps),
)
ISOLATION_VIOLATIONS_TOTAL = MetricDef(
    "gradwatch_isolation_violations_total",
    "counter",
    ("group",),
    "Published snapshots in which the isolated group violated isolation.",
    "Starts at 0 for every configured `isolated` group.",
    absent="Without `isolated` groups; otherwise as the counters.",
    source=MetricSource.COUNTS,
    read=lambda c: each(c.isolation_violations.items()),
)
# -- the optimizer-step guard (watch.guard, gradwatch.step.guard) ---------------------------------
CONSECUTIVE_SKIPPED_STEPS = MetricDef(
    "gradwatch_consecutive_skipped_steps",
    "gauge",
    (),
    "Optimizer steps the guard skipped in a row up to the last published step (0: that "
    "step was applied).",
    "At most `max_consecutive_skips`.",
    absent=md.ABSENT_WITHOUT_GUARD,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.consecutive_skipped_steps),
)
GUARD_STOPPED = MetricDef(
    "gradwatch_guard_stopped",
    "gauge",
    (),
    "1 when the guard applied the last published step although it would have skipped it, "
    "because max_consecutive_skips steps in a row were already skipped; else 0.",
    "The guard skips again after a step it would not skip.",
    absent=md.ABSENT_WITHOUT_GUARD,
    source=MetricSource.SNAPSHOT,
    read=lambda s: None if s.snap.consecutive_skipped_steps is None else one(s.snap.guard_stopped),
)
GUARD_SCORE = MetricDef(
    "gradwatch_guard_score",
    "gauge",
    (),
    "The spike score the optimizer-step guard acted on at the last published step: it "
    "skipped that step for a spike exactly when this is above skip_spike_score.",
    "The definition of `gradwatch_global_grad_norm_spike_score` (its window, warm-up and "
    "re-basing), on the device from the reduced vector; with guard_spike_statistic=ema the "
    "EMA z-score of the adaptive history. NaN while undefined.",
    absent="Without `watch.guard()` and `skip_spike_score`; and as the per-step gauges.",
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.guard_score),
)
# -- spikes and every step between scrapes (gradwatch.analysis.spikes, state.Counts)
GLOBAL_GRAD_NORM_SPIKE_SCORE = MetricDef(
    "gradwatch_global_grad_norm_spike_score",
    "gauge",
    (),
    "Robust deviations of the global log-norm above its recent median at the last "
    "published step: (ln(norm) - median) / max(1.4826 * MAD, 0.05) over the last "
    "spike_window collected steps.",
    "NaN while undefined (fewer than `spike_warmup` samples, a non-finite or zero norm). "
    "Negative below the median.",
    absent=md.ABSENT_SPIKES_OFF,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.global_spike_score),
)
GRAD_NORM_SPIKE_SCORE = MetricDef(
    "gradwatch_grad_norm_spike_score",
    "gauge",
    ("group",),
    "Robust deviations of one group's log-norm above its recent median at the last published step.",
    "As `gradwatch_global_grad_norm_spike_score`, per group.",
    absent=md.ABSENT_SPIKES_OFF,
    source=MetricSource.SNAPSHOT,
    read=lambda s: None if s.snap.global_spike_score is None else each(s.snap.spike_scores.items()),
)
GLOBAL_GRAD_NORM_SPIKES_TOTAL = MetricDef(
    "gradwatch_global_grad_norm_spikes_total",
    "counter",
    (),
    "Published steps whose global norm was a spike (spike score above spike_threshold).",
    "Counts every published step, also those between two scrapes.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: one(c.global_spikes),
    exemplar=True,
)
GRAD_NORM_SPIKES_TOTAL = MetricDef(
    "gradwatch_grad_norm_spikes_total",
    "counter",
    ("group",),
    "Published steps in which the group's norm was a spike (spike score above spike_threshold).",
    "Starts at 0 for every configured group; `other` from its first step.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: each(c.group_spikes.items()),
    exemplar=True,
)
NONFINITE_GROUP_STEPS_TOTAL = MetricDef(
    "gradwatch_nonfinite_group_steps_total",
    "counter",
    ("group",),
    "Published non-finite steps in which the group had a NaN or Inf gradient.",
    "Steps counted by `gradwatch_nonfinite_steps_total` (AMP-skipped steps are not), per "
    "group that held a NaN or Inf: names the groups of a non-finite step after the "
    "per-step gauges moved on. Starts at 0 for every configured group.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: each(c.nonfinite_group_steps.items()),
    exemplar=True,
)
GLOBAL_GRAD_NORM_PER_STEP = MetricDef(
    "gradwatch_global_grad_norm_per_step",
    "histogram",
    (),
    "Distribution of the global gradient norm over every published step.",
    f"Buckets (le): {NORM_BUCKETS_TEXT}. Only finite norms are observed (non-finite steps "
    "are counted by `gradwatch_nonfinite_steps_total`); norms below 1e-06 land in the "
    "first bucket, finite norms above 1e+06 in +Inf only.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: LabelledHistograms((((), md.norm_histogram(c.global_norms)),)),
    buckets=NORM_BUCKETS,
)
GRAD_NORM_PER_STEP = MetricDef(
    "gradwatch_grad_norm_per_step",
    "histogram",
    ("group",),
    "Distribution of one group's gradient norm over every published step.",
    "Buckets as `gradwatch_global_grad_norm_per_step`; non-finite norms are counted by "
    "`gradwatch_nonfinite_group_steps_total`.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.COUNTS,
    read=lambda c: LabelledHistograms(
        tuple(((g,), md.norm_histogram(h)) for g, h in c.group_norms.items())
    ),
    buckets=NORM_BUCKETS,
)
# -- the exporter itself -------------------------------------------------------------------
PUBLISH_ERRORS_TOTAL = MetricDef(
    "gradwatch_publish_errors_total",
    "counter",
    (),
    "Collected steps that failed to materialize or to publish on the endpoint (logged once "
    "per kind).",
    "For example a `GradWatchTimeoutError` when another rank stopped calling collect(). A "
    "sink's failures (the history file, a tracker, a sink you added) are counted per sink in "
    "`gradwatch_sink_errors_total`. Publishing continues with the next step.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.SELF_STATS,
    read=lambda v: one(v.publish_errors),
)
DROPPED_SNAPSHOTS_TOTAL = MetricDef(
    "gradwatch_dropped_snapshots_total",
    "counter",
    (),
    "Collected steps never published because publishing fell behind.",
    f"At most {MAX_PENDING} pending steps (`MAX_PENDING`) wait for the publisher; a newer "
    "one drops the oldest.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.SELF_STATS,
    read=lambda v: one(v.dropped),
)
_ABSENT_WITHOUT_SINKS = "Without a sink (history file, tracker, user sink); and when disabled."
SINK_ERRORS_TOTAL = MetricDef(
    "gradwatch_sink_errors_total", "counter", ("sink",),
    "Failed or stalled writes of one sink (the history file, a tracker, a sink you added).",
    "One series per sink (`history`, `tensorboard`, `wandb`, `mlflow`, or a user sink's "
    "`name`) from when it is added. Every write that raised (each retry) and, once per stall, "
    "one running past `sink_timeout_seconds`. The endpoint and the other sinks go on. The "
    "GradwatchSinkFailing alert fires on it.",
    absent=_ABSENT_WITHOUT_SINKS,
    source=MetricSource.SELF_STATS,
    read=lambda v: each(v.sink_errors) or None,
)
SINK_DROPPED_STEPS_TOTAL = MetricDef(
    "gradwatch_sink_dropped_steps_total", "counter", ("sink",),
    "Published steps one sink never received.",
    "Series as `gradwatch_sink_errors_total`. A sink keeps the newest `sink_queue_size` "
    "waiting steps; a write that failed three times is given up; close counts what was not "
    "written in time. Trackers also log `gradwatch/dropped_steps`. Alert: GradwatchSinkFailing.",
    absent=_ABSENT_WITHOUT_SINKS,
    source=MetricSource.SELF_STATS,
    read=lambda v: each(v.sink_dropped) or None,
)
COLLECT_SECONDS = MetricDef(
    "gradwatch_collect_seconds",
    "histogram",
    (),
    "Time the training thread spent in GradWatch.collect() (gradwatch's self-cost).",
    "Bucket upper bounds (s): "
    + ", ".join(floatToGoString(b) for b in COLLECT_SECONDS_BUCKETS)
    + ", +Inf. Observed for every collected step, published or not.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.SELF_STATS,
    read=md.collect_seconds_histogram,
    buckets=COLLECT_SECONDS_BUCKETS,
)
# -- norm auditing (GradWatch.audit_norm) ---------------------------------------------------
REPORTED_NORM_RATIO = MetricDef(
    "gradwatch_reported_norm_ratio",
    "gauge",
    ("source",),
    "Last audited ratio of a norm the training code reported to gradwatch's exact global "
    "norm of the same step.",
    "One series per `source` given to `GradWatch.audit_norm` (at most "
    f"{MAX_AUDIT_SOURCES}). 1 when they agree; "
    "NaN when undefined (a non-finite or unreadable reported value, or an exact norm of "
    "0). Known failures show as 1/sqrt(shards), sqrt(tp), tp or 2 (docs/integrations.md).",
    absent="Until a norm reported to `GradWatch.audit_norm` is audited; and when disabled.",
    source=MetricSource.SELF_STATS,
    read=lambda v: tuple(((source,), r) for source, r, _ in v.audits) or None,
)
NORM_AUDIT_DISAGREEMENTS_TOTAL = MetricDef(
    "gradwatch_norm_audit_disagreements_total",
    "counter",
    ("source",),
    "Audited norms that differed from gradwatch's exact norm by more than audit_tolerance.",
    "Relative tolerance `audit_tolerance` (default 1e-3). A non-finite or unreadable "
    "reported value counts unless the exact norm is non-finite too. The "
    "GradwatchNormAuditDisagreement alert pages on it.",
    absent="As `gradwatch_reported_norm_ratio`.",
    source=MetricSource.SELF_STATS,
    read=lambda v: tuple(((source,), float(n)) for source, _, n in v.audits) or None,
)
# -- constant info, restarts and ratio bands: constant for the run ---------------------------
COLLECTING = MetricDef(
    "gradwatch_collecting",
    "gauge",
    (),
    "1 while gradwatch measures every collected step, 0 when it stopped or its last "
    "collect failed.",
    "0 from a failed collect on, until "
    "a step is measured again (a transient error) or for the rest of the run (collection "
    "stopped; the log says why, once). While it is 0 every per-step gauge is absent: no "
    "snapshot that was not measured is shown. The "
    "GradwatchNotCollecting alert pages on it.",
    absent="Until the first step is measured or fails (a refused watcher: 0 at once).",
    source=MetricSource.SELF_STATS,
    read=lambda v: None if v.collecting is None else one(float(v.collecting)),
)
INTERNAL_ERRORS_TOTAL = MetricDef(
    "gradwatch_internal_errors_total",
    "counter",
    ("kind",),
    "Collects gradwatch could not measure, by kind of internal error.",
    "Kinds: collect (the local pass raised), meta_gradient (a gradient on the meta "
    "device), parameters_replaced (a parameter replaced after GradWatch was built), "
    "collective (a gradwatch collective failed: collection stops), other_rank (another "
    "rank's local pass failed), collective_timeout (an all-reduce still in flight after "
    "collective_timeout_seconds, a straggler: the step is not measured, collection goes "
    "on), step_mismatch (the ranks collected different steps: collection stops on every "
    "rank), other_rank_closed (another rank closed its watcher), host_copy (this rank's "
    "vector never reached its host thread). Every kind starts at 0, with gradwatch_collecting.",
    absent="As `gradwatch_collecting`.",
    source=MetricSource.SELF_STATS,
    read=lambda v: None if v.collecting is None else each(v.internal_errors),
)
BUILD_INFO = MetricDef(
    "gradwatch_build_info",
    "info",
    ("version", "torch_version"),
    "Versions of gradwatch and torch in the job (value 1).",
    "Present from the first scrape, before any collection.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.INFO,
    read=lambda j: ((j.build, 1.0),),
)
RUN_INFO = MetricDef(
    "gradwatch_run_info",
    "info",
    ("world_size", "parallelism", "run_id"),
    "World size, detected parallelism and run identity of the job (value 1).",
    "`parallelism` is a short description such as `replicated2` or `fsdp2x2+tp2`. "
    "`run_id` is `WatchConfig.run_id`, or generated when the endpoint starts (UTC start "
    "time and random digits): a restarted job on the same address is a new series. Present "
    "from the first scrape.",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.INFO,
    read=lambda j: (((str(j.world_size), j.parallelism, j.run_id), 1.0),),
)
START_TIME_SECONDS = MetricDef(
    "gradwatch_start_time_seconds",
    "gauge",
    (),
    "Wall-clock time (Unix seconds) at which this run's gradwatch started.",
    "Set once, when the endpoint starts; present from the first scrape. A new value on the "
    "same target is a restart: every counter started again from 0, so the alert rules "
    "treat a counter above 0 in a run that started recently as new events (a step counted "
    "before the new run's first scrape is not lost to `increase()`).",
    absent=md.ABSENT_WHEN_DISABLED,
    source=MetricSource.INFO,
    read=lambda j: one(j.start_time),
)
GRAD_NORM_RATIO_BAND = MetricDef(
    "gradwatch_grad_norm_ratio_band",
    "gauge",
    ("numerator", "denominator", "bound"),
    "Configured healthy band (bound low/high) and dormant level (bound dormant) of a "
    "normalized gradient-norm ratio.",
    "Three series per configured `ratios` pair, from its entry (defaults: low 0.05, high "
    "0.2, dormant 0.01); present from the first scrape. The dormant alert and the "
    "dashboard read them.",
    absent="Without configured `ratios`; and when disabled.",
    source=MetricSource.INFO,
    read=md.ratio_bands,
)

METRICS: tuple[MetricDef, ...] = (
    STEP, LAST_COLLECT_TIMESTAMP_SECONDS, GLOBAL_GRAD_NORM, GRAD_NORM, GRAD_NORM_RATIO,
    WEIGHT_NORM, UPDATE_NORM, UPDATE_RATIO, STALLED_UPDATE_FRACTION, GROUP_PARAMETERS,
    VANISHING_TENSORS, EXPLODING_TENSORS, NONFINITE_TENSORS, HEALTH_SCORE,
    ISOLATION_VIOLATED, REPLICA_DIVERGENCE, CLIP_COEF, ADAPTIVE_CLIP_THRESHOLD, PARAM_GRAD_NORM,
    NONFINITE_ORIGIN_RANKS,
    REPLICA_GRAD_NORM, REPLICA_GRAD_NORM_MAX_RANK, REPLICA_OUTLIER_SCORE, GRADIENT_NOISE_SCALE,
    GROUP_GRADIENT_NOISE_SCALE, LAST_NONFINITE_ORIGIN, SLOWEST_RANK, STRAGGLER_SCORE,
    RANK_WORK_SECONDS, COLLECTIONS_TOTAL, NONFINITE_STEPS_TOTAL,
    NO_GRADIENT_STEPS_TOTAL, AMP_SKIPPED_STEPS_TOTAL, EXPLODING_STEPS_TOTAL,
    ISOLATION_VIOLATIONS_TOTAL, SKIPPED_STEPS_TOTAL, CONSECUTIVE_SKIPPED_STEPS, GUARD_STOPPED,
    GUARD_SCORE, GLOBAL_GRAD_NORM_SPIKE_SCORE, GRAD_NORM_SPIKE_SCORE,
    GLOBAL_GRAD_NORM_SPIKES_TOTAL, GRAD_NORM_SPIKES_TOTAL, NONFINITE_GROUP_STEPS_TOTAL,
    GLOBAL_GRAD_NORM_PER_STEP, GRAD_NORM_PER_STEP, PUBLISH_ERRORS_TOTAL, DROPPED_SNAPSHOTS_TOTAL,
    SINK_ERRORS_TOTAL, SINK_DROPPED_STEPS_TOTAL, COLLECT_SECONDS, REPORTED_NORM_RATIO,
    NORM_AUDIT_DISAGREEMENTS_TOTAL, COLLECTING, INTERNAL_ERRORS_TOTAL, BUILD_INFO, RUN_INFO,
    START_TIME_SECONDS, GRAD_NORM_RATIO_BAND,
)  # fmt: skip

METRICS_BY_NAME: Mapping[str, MetricDef] = MappingProxyType({m.name: m for m in METRICS})

#: The names of the counters whose series carry an OpenMetrics exemplar ``{step,
#: origin_rank}`` of the step that last increased them (``MetricDef.exemplar``): the events
#: whose first question is "which step?".
EXEMPLAR_COUNTERS = frozenset(d.name for d in METRICS if d.exemplar)

_BY_SOURCE: Mapping[MetricSource, tuple[MetricDef, ...]] = MappingProxyType(
    {source: tuple(d for d in METRICS if d.source is source) for source in MetricSource}
)


def read_all(source: MetricSource, value: object) -> dict[MetricDef, MetricValue]:
    """The samples of every metric of ``source``, read from ``value`` (that source's object),
    keyed by definition; a metric absent from ``value`` has no key."""
    out: dict[MetricDef, MetricValue] = {}
    for d in _BY_SOURCE[source]:
        samples = d.read(value)
        if samples is not None:
            out[d] = samples
    return out
