"""Which rank is slow: each rank's working time, carried by the all-reduces gradwatch runs anyway.

**What a rank measures** (:mod:`gradwatch.step.ranktimer`; host clock, or CUDA events on a
CUDA device): per step its *working time*, from the end of its previous ``collect`` to its
*arrival*, the last gradient accumulated in this step's backward; the time it waits on peers
is excluded (docs/design.md, "Which rank is slow"). It keeps the times of the steps since the
last *carried* step, and a carried step (a collect that all-reduces anyway: every collect on
FSDP1/2, ZeRO, TP or with the guard, the rank view or ``always_reduce``; under plain DDP the
divergence step, every ``divergence_every`` collects) packs their median, the one ``t`` below.
No collect all-reduces for timing; rank 0's snapshots carry the latest carried step's
attribution and that step (:class:`CarriedTiming`).

**What the all-reduce carries** (:func:`pack_timing`): ``3 x TIMING_BINS`` float64 per rank,
whatever the world size. The time ``t`` falls in a log-spaced bin ``k`` (:func:`bin_of`:
``TIMING_BINS_PER_OCTAVE`` bins per octave from :data:`TIMING_FLOOR` seconds, clamped at both
ends); the rank adds 1 to ``count[k]``, its rank id to ``ranks[k]`` and ``t`` to
``seconds[k]``. The SUM of every rank's section is the histogram of the step, and for every
bin the sum of its ranks' ids and times: exact (integers below 2^53, one ``t`` when a bin
holds one rank). A SUM cannot carry a maximum or its rank; a histogram can when the top bin
holds one rank, and that is what :class:`RankTiming` reads:

* the slowest rank: the one rank alone in the highest occupied bin (``ranks[k]``, exact), its
  working time exact (``seconds[k]``); None when two ranks or more share the top bin (no rank
  is slower than another by a bin, ``2^(1/8)``: about 9%);
* min and max: exact when their bin holds one rank, else the mean of their bin's ranks (within
  the bin's width); the median: the mean of the bin holding the middle rank (likewise);
* the straggler score: the fastest rank's time over the slowest's, in ``(0, 1]``, as
  NVIDIA's resiliency extension scores a rank against the fastest (1: no straggler; below
  :data:`~gradwatch.snapshot.STRAGGLER_THRESHOLD` a straggler).

A rank that measured nothing this step (its first collect, a failed pass) adds nothing: the
counts then sum to less than the world and the step's timing is absent, never guessed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

#: Log-spaced bins per octave of working time (bin width ``2^(1/8)``, about 9%).
TIMING_BINS_PER_OCTAVE = 8
#: The lower edge of the first bin, seconds (2^-13: about 122 us); shorter times land in it.
TIMING_FLOOR = 2.0**-13
#: Bins: 24 octaves, up to 2^11 s (about 34 minutes); longer times land in the last one.
TIMING_BINS = 24 * TIMING_BINS_PER_OCTAVE
#: Width of the packed vector's timing section: counts, rank-id sums, time sums per bin.
TIMING_WIDTH = 3 * TIMING_BINS


class WorkSource(Protocol):
    """A rank's working times since the last carried step
    (:class:`gradwatch.step.ranktimer.WorkWindow`)."""

    def drain(self) -> float | None:
        """The one time this rank packs (None: nothing measured), and a new window."""
        ...


def bin_of(seconds: float) -> int:
    """The bin of a working time: ``floor(8 * log2(t / TIMING_FLOOR))`` clamped to the bins."""
    if not seconds > TIMING_FLOOR:  # also NaN
        return 0
    k = math.floor(TIMING_BINS_PER_OCTAVE * math.log2(seconds / TIMING_FLOOR))
    return min(k, TIMING_BINS - 1)


def pack_timing(section: Tensor, rank: int, seconds: float | None) -> None:
    """Write this rank's share of the timing section (three ``fill_``: kernel arguments, no
    host-to-device copy); ``None`` leaves zeros (this rank measured nothing)."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return
    k = bin_of(seconds)
    section.narrow(0, k, 1).fill_(1.0)
    section.narrow(0, TIMING_BINS + k, 1).fill_(float(rank))
    section.narrow(0, 2 * TIMING_BINS + k, 1).fill_(seconds)


@dataclass(frozen=True)
class RankTiming:
    """The step's working times, read from the reduced section (host side, pure).

    Attributes:
        slowest_rank: the one rank alone in the highest occupied bin, else None.
        slowest_seconds: its working time (exact), None with it.
        min_seconds, median_seconds, max_seconds: see the module docstring.
        straggler_score: ``min_seconds / max_seconds`` (1.0 when every time is 0).
    """

    slowest_rank: int | None
    slowest_seconds: float | None
    min_seconds: float
    median_seconds: float
    max_seconds: float
    straggler_score: float

    @classmethod
    def from_section(cls, values: Sequence[float], world_size: int) -> RankTiming | None:
        """None unless every rank measured (the counts sum to the world size)."""
        b = TIMING_BINS
        counts, ranks, secs = values[:b], values[b : 2 * b], values[2 * b : 3 * b]
        if world_size < 1 or sum(counts) != world_size:
            return None
        occupied = [k for k in range(b) if counts[k] > 0]
        low, high = occupied[0], occupied[-1]

        def mean(k: int) -> float:
            return secs[k] / counts[k]

        middle, seen, median_bin = (world_size - 1) // 2, 0.0, high
        for k in occupied:
            seen += counts[k]
            if seen > middle:
                median_bin = k
                break
        alone = counts[high] == 1 and world_size > 1
        fastest, slowest = mean(low), mean(high)
        return cls(
            slowest_rank=int(ranks[high]) if alone else None,
            slowest_seconds=secs[high] if alone else None,
            min_seconds=fastest,
            median_seconds=mean(median_bin),
            max_seconds=slowest,
            straggler_score=fastest / slowest if slowest > 0 else 1.0,
        )


def timing_fields(timing: RankTiming, hosts: Sequence[str], step: int) -> dict[str, Any]:
    """The :class:`~gradwatch.snapshot.Snapshot` fields of the timing carried at ``step``."""
    rank = timing.slowest_rank
    return {
        "rank_timing_step": step,
        "slowest_rank": rank,
        "slowest_host": hosts[rank] if rank is not None and rank < len(hosts) else None,
        "straggler_score": timing.straggler_score,
        "work_seconds_min": timing.min_seconds,
        "work_seconds_median": timing.median_seconds,
        "work_seconds_max": timing.max_seconds,
    }


class CarriedTiming:
    """The latest carried step's timing, for the snapshots of the steps after it (host side).

    A snapshot gets the timing its own vector carried, else the latest carried step's with
    that step (``Snapshot.rank_timing_step``) when that step is not after its own; nothing
    before the first carried step: never a guess. The latest is one tuple replaced whole
    (snapshots may be built on the publisher's thread).
    """

    def __init__(self) -> None:
        self._latest: tuple[int, RankTiming] | None = None

    def fields(
        self, step: int, timing: RankTiming | None, hosts: Sequence[str]
    ) -> dict[str, Any]:
        """The snapshot fields for ``step``, whose vector carried ``timing`` (or None)."""
        if timing is not None:
            latest = self._latest
            if latest is None or latest[0] <= step:
                self._latest = (step, timing)
            return timing_fields(timing, hosts, step)
        latest = self._latest
        if latest is None or latest[0] > step:
            return {}
        return timing_fields(latest[1], hosts, latest[0])
