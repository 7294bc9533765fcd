"""How the catalog reads which rank is slow (``WatchConfig.rank_timing``): the samples of
``gradwatch_slowest_rank`` and ``gradwatch_rank_work_seconds``, whose definitions live in
:mod:`gradwatch.export.metrics` with every other metric's.

Series count is independent of the world size: one ``gradwatch_slowest_rank`` series (its
``host`` label names the one slowest rank's host), one score, three quantities. Absent when
not measured (``rank_timing`` off, a single rank, a step some rank did not time); the slowest
rank is absent too on a step where no rank stands out (two ranks share the top bin).
"""

from __future__ import annotations

from gradwatch.export.metricdef import PublishedStep, Sample


def slowest_rank_samples(s: PublishedStep) -> tuple[Sample, ...] | None:
    """The slowest rank, its host as the one label value."""
    rank = s.snap.slowest_rank
    if rank is None:
        return None
    return (((s.snap.slowest_host or ""),), float(rank)),


def work_seconds_samples(s: PublishedStep) -> tuple[Sample, ...] | None:
    """The working time's min, median and max over the ranks."""
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
