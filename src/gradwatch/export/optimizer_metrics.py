"""The optimizer's side of the metric catalog: the steps skipped by reason and the
optimizer-update health gauges (``update_stats``, :mod:`gradwatch.norms.updates`).

Definitions only, as in :mod:`gradwatch.export.metrics`, which lists them in its ``METRICS``
(exposition order) beside every other metric; kept apart so each module stays readable.
"""

from __future__ import annotations

from gradwatch.export.metricdef import MetricDef, MetricSource, each, measured_group_field

SKIPPED_STEPS_TOTAL = MetricDef(
    "gradwatch_skipped_steps_total",
    "counter",
    ("reason",),
    "Optimizer steps skipped, by reason: the guard's nonfinite (a NaN/Inf gradient anywhere "
    "in the model, skip_nonfinite) and spike (the global spike score above "
    "skip_spike_score); amp_overflow (the AMP GradScaler skipped the step); "
    "deepspeed_overflow (DeepSpeed skipped it on an overflow); no_update (no weight changed "
    "although the gradients were finite and non-zero: a silent skip).",
    "The guard's reasons are counted on the device on every guarded step, published or not "
    "(the value of the last published step), start at 0 and are absent without "
    "`watch.guard()`. The others count published snapshots: amp_overflow from the first "
    "scrape (at 0), deepspeed_overflow under DeepSpeed only, no_update with `update_stats` "
    "only (it needs the measured update); each appears once it can be measured.",
    absent="Only when disabled (`amp_overflow` from the first scrape; the guard's reasons "
    "without `watch.guard()`, `no_update` without `update_stats`, `deepspeed_overflow` "
    "without DeepSpeed).",
    source=MetricSource.COUNTS,
    read=lambda c: each([*c.skipped_steps.items(), *c.step_skips.items()]),
    exemplar=True,
)


# -- optimizer-update health (update_stats=True, gradwatch.norms.updates) ------------------------
#: When the update gauges have no sample.
ABSENT_WITHOUT_UPDATE_STATS = (
    "Without `update_stats`; the update figures also on the first collect and when a step "
    "could not be read; and as the per-step gauges."
)
WEIGHT_NORM = MetricDef(
    "gradwatch_weight_norm",
    "gauge",
    ("group",),
    "L2 norm of the weights of one parameter group at the last published step.",
    "Exact across shards (each piece counted once). The weights as the last optimizer step "
    "left them, measured in the same pass as its update; read again at the collect when a "
    "piece changed in place or got new data since (a write through `.data` bumps no version "
    "counter and is seen at the next step). Absent without `update_stats`.",
    absent=ABSENT_WITHOUT_UPDATE_STATS,
    source=MetricSource.SNAPSHOT,
    read=measured_group_field("weight_norm"),
)
UPDATE_NORM = MetricDef(
    "gradwatch_update_norm",
    "gauge",
    ("group",),
    "L2 norm of the update the last optimizer step applied to one parameter group's weights "
    "(theta_t - theta_{t-1}).",
    "Recovered from the optimizer's state after its step, exact to the applied (rounded) "
    "update; with `every_n_steps` above 1 the update of the last optimizer step before the "
    "collect, not the sum since the previous one; 0 when no step changed the weights since "
    "the previous collect. Absent without "
    "`update_stats`, on the first collect, and when the optimizer's step could not be read "
    "(an optimizer other than torch.optim SGD, Adam, AdamW).",
    absent=ABSENT_WITHOUT_UPDATE_STATS,
    source=MetricSource.SNAPSHOT,
    read=measured_group_field("update_norm"),
)
UPDATE_RATIO = MetricDef(
    "gradwatch_update_ratio",
    "gauge",
    ("group",),
    "Update-to-weight ratio of one parameter group: gradwatch_update_norm / "
    "gradwatch_weight_norm.",
    "NaN when the group's weight norm is 0 or not finite; absent when the update is.",
    absent=ABSENT_WITHOUT_UPDATE_STATS,
    source=MetricSource.SNAPSHOT,
    read=measured_group_field("update_ratio"),
)
STALLED_UPDATE_FRACTION = MetricDef(
    "gradwatch_stalled_update_fraction",
    "gauge",
    ("group",),
    "Fraction of one group's elements whose intended update the last optimizer step rounded "
    "away (under half an ulp of the weight).",
    "Over the elements with a non-zero intended update, counted exactly for every weight "
    "dtype: bf16/fp16 weights at small learning rates approach 1; a float32 (float64) "
    "element stalls where its update is below about 2^-24 (2^-53) of the weight, e.g. Adam "
    "on an element whose gradient has long been 0. NaN when no element was meant to change; "
    "absent when the update is.",
    absent=ABSENT_WITHOUT_UPDATE_STATS,
    source=MetricSource.SNAPSHOT,
    read=measured_group_field("stalled_fraction"),
)
