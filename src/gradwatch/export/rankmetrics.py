"""The catalog's definitions of which rank is slow (``WatchConfig.rank_timing``), part of
:data:`gradwatch.export.metrics.METRICS` (in its order there) and written here only: the one
other module the catalog's names live in.

Series count is independent of the world size: one ``gradwatch_slowest_rank`` series (its
``host`` label names the one slowest rank's host), one score, three quantities.
"""

from __future__ import annotations

from gradwatch.export import metricdef as md
from gradwatch.export.metricdef import MetricDef, MetricSource, one

SLOWEST_RANK = MetricDef(
    "gradwatch_slowest_rank",
    "gauge",
    ("host",),
    "Rank whose working time (its own compute up to its gradient collective, not its waits "
    "on peers; each rank's median since the previous carried step) was the longest at the "
    "latest carried step; host: that rank's host.",
    "One series whatever the world size. Carried by the collects gradwatch all-reduces anyway "
    "(under plain DDP every divergence_every collects) and held in between. Also absent when "
    "no rank is slower than the others by a timing bin (about 9%). The "
    "GradwatchSameRankSlowest alert fires when the same rank stays the straggler.",
    absent=md.ABSENT_WITHOUT_RANK_TIMING,
    source=MetricSource.SNAPSHOT,
    read=md.slowest_rank_samples,
)
STRAGGLER_SCORE = MetricDef(
    "gradwatch_straggler_score",
    "gauge",
    (),
    "The fastest rank's working time over the slowest rank's at the latest carried step, "
    "in (0, 1]: 1 without a straggler, below 0.7 a straggler.",
    "1 when every rank worked as long (within a timing bin).",
    absent=md.ABSENT_WITHOUT_RANK_TIMING,
    source=MetricSource.SNAPSHOT,
    read=lambda s: one(s.snap.straggler_score),
)
RANK_WORK_SECONDS = MetricDef(
    "gradwatch_rank_work_seconds",
    "gauge",
    ("quantity",),
    "Working time per step over the ranks (quantity: min, median, max) at the latest carried "
    "step, in seconds.",
    "Exact when the quantity's timing bin holds one rank, else the mean of its bin's ranks "
    "(within about 9%).",
    absent=md.ABSENT_WITHOUT_RANK_TIMING,
    source=MetricSource.SNAPSHOT,
    read=md.work_seconds_samples,
)
