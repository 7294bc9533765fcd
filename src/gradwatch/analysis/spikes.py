"""Adaptive spike detection: a gradient norm far above its own recent history.

A fixed ``exploding_threshold`` is arbitrary for most models (a norm of 20 can be a 10x spike,
150 can be normal). This module scores each step's norm against the recent history of the same
series (the global norm and every group), on the host, from the :class:`Snapshot` that
``result()`` builds: no device op, no host read, no collective, nothing in ``collect()``.

The math, per series (the global norm, each group):

* a *sample* is ``x = ln(norm)`` of a step whose gradients were all finite
  (:attr:`Snapshot.is_finite`) and whose norm is finite and positive. A non-finite step is not
  a sample of any series (it is already counted as non-finite) and a zero norm (a group without
  gradient) has no logarithm: neither enters the window, so neither poisons it;
* the *window* ``W`` holds the last ``spike_window`` samples *before* the scored step, in
  collection order;
* the typical level is the median ``m = median(W)`` and the spread the median absolute
  deviation ``MAD = median(|x_i - m|)``, scaled to a standard deviation of normal data,
  ``s = max(1.4826 * MAD, MIN_LOG_SPREAD)``;
* the *score* of a step is ``(x - m) / s``: how many robust deviations its log-norm lies above
  the typical one (negative below it). It is NaN while undefined: before ``W`` holds
  ``spike_warmup`` samples, or when the step's own norm is non-finite or zero;
* a *spike* is a score above ``spike_threshold`` (``0`` disables detection: no scores at all).
  The smallest norm flagged is ``exp(spike_threshold * s)`` times the typical norm ``exp(m)``,
  at least ``exp(6 * 0.05) = 1.35`` times it at the default threshold.

Why median and MAD of log-norms rather than an EMA of mean and variance: gradient norms are
positive and move by factors, so their logarithm is the scale on which "10x" is a fixed
distance; and a median and MAD are not dragged by the spikes they must detect (one 10x spike in
an EMA of the variance raises the bar for the next ones), and they need no decay constant. The
spikes themselves enter the window: at most half of it can be spikes before the median moves,
so isolated spikes never mask each other. ``MIN_LOG_SPREAD`` keeps a perfectly steady series
(MAD 0) from flagging a change of a few percent.

Changes of level re-base the window, so a spike after one is measured against the new level
(real runs change level: warmup ends, a module unfreezes, the learning rate steps):

* **an announced stage change**: when the set of isolated groups differs from the previous
  collect's (``GradWatch.set_isolated``, the snapshot's ``isolation_violated`` keys), every
  window is emptied before the step is scored. The new stage's first ``spike_warmup`` steps
  have no score (NaN, so no spike from the change itself) and become its baseline;
* **a sustained shift without one**: when the last :data:`SHIFT_RUN` samples of a series all
  scored beyond :data:`SHIFT_SCORE` robust deviations on the same side of the median, the
  window keeps those samples only: the shift is the new level. Scores resume once the window
  holds ``spike_warmup`` samples again, so at most ``spike_warmup`` steps after the shift
  began. A shift down flags nothing; a jump up is indistinguishable from a spike when it
  happens, so its first steps (at most :data:`SHIFT_RUN`) may be flagged. On a stationary
  series a run of :data:`SHIFT_RUN` such samples is vanishingly rare (each has a probability
  of 0.0013 for normal log-norms), so isolated spikes never trigger it.

With the defaults (window 128, warm-up 32) a 10x spike 50 steps after a 30x drop of level is
found, announced or not (tests/unit/analysis/test_spikes.py).

Cost: per series and step, one insertion and one removal in a sorted list (``bisect``) and a
selection of the median absolute deviation from the two sorted runs around the median
(O(log window) comparisons, :meth:`SpikeWindow.center_spread`); series that took the same
samples since their windows were made (the one group of a model is the global norm's series)
share one window, updated and read once, until their samples differ: host work on the
publisher thread, independent of the number of parameters.

Each spike logs a WARNING naming the series, the score, the norm and the typical norm, at most
once a minute per series (the counters of :mod:`gradwatch.export` count every one). Steps are
taken in the order of their collects: a result materialized after a later one (a
caller that keeps an old pending result) is scored against the window as it is, without
entering it. Steps the publisher dropped (it fell behind) never enter it either.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from gradwatch.analysis.anomalies import RateLimitedLog
from gradwatch.snapshot import Snapshot

__all__ = [
    "MAD_TO_SIGMA",
    "MIN_LOG_SPREAD",
    "SHIFT_RUN",
    "SHIFT_SCORE",
    "SpikeDetector",
    "SpikeWindow",
]

log = logging.getLogger("gradwatch")

#: Scales a MAD to the standard deviation of normally distributed data (1 / Phi^-1(3/4)).
MAD_TO_SIGMA = 1.4826
#: Floor of the spread ``s`` in natural-log units: a series whose log-norm does not move at all
#: still needs a factor of ``exp(threshold * MIN_LOG_SPREAD)`` to spike.
MIN_LOG_SPREAD = 0.05
#: Consecutive samples beyond :data:`SHIFT_SCORE`, on one side, that make a level shift.
SHIFT_RUN = 8
#: Robust deviations from the median beyond which a sample counts towards a level shift.
SHIFT_SCORE = 3.0


class SpikeWindow:
    """The last ``size`` log-norm samples of one series: arrival order and a sorted copy."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._run: list[float] = []  # the latest samples beyond SHIFT_SCORE, on one side
        self._run_side = 0.0

    def __len__(self) -> int:
        return len(self._fifo)

    def add(self, x: float) -> None:
        if len(self._fifo) == self.size:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._fifo.append(x)
        bisect.insort(self._sorted, x)

    def copy(self) -> SpikeWindow:
        """A window of the same size holding the same samples, in the same state."""
        twin = SpikeWindow(self.size)
        twin._fifo = deque(self._fifo)
        twin._sorted = list(self._sorted)
        twin._run = list(self._run)
        twin._run_side = self._run_side
        return twin

    def clear(self, keep: Sequence[float] = ()) -> None:
        """Empty the window, then add ``keep`` (oldest first): a new baseline."""
        self._fifo.clear()
        self._sorted.clear()
        self._run = []
        self._run_side = 0.0
        for x in keep:
            self.add(x)

    def track_shift(self, x: float, score: float) -> bool:
        """Count ``x`` (just added, scored ``score``) towards a level shift; on the
        :data:`SHIFT_RUN`-th consecutive sample beyond :data:`SHIFT_SCORE` on one side, re-base
        the window on those samples and return True."""
        side = math.copysign(1.0, score) if abs(score) > SHIFT_SCORE else 0.0
        if side == 0.0 or side != self._run_side:
            self._run = []
        self._run_side = side
        if side == 0.0:
            return False
        self._run.append(x)
        if len(self._run) < SHIFT_RUN:
            return False
        self.clear(self._run)
        return True

    def median(self) -> float:
        s = self._sorted
        n = len(s)
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def center_spread(self) -> tuple[float, float]:
        """``(m, s)``: the median and the floored, sigma-scaled MAD (window not empty).

        The deviations ``|v - m|`` of the sorted window are two sorted runs (below the median,
        read outwards, and from it on), so their median is a selection from two sorted
        sequences: O(log n) comparisons, no list built per collect."""
        m = self.median()
        s = self._sorted
        n = len(s)
        mid = n // 2
        if n % 2:
            mad = _kth_deviation(s, m, mid)
        else:
            upper, lower = _kth_deviations(s, m, mid)
            mad = 0.5 * (lower + upper)
        return m, max(MAD_TO_SIGMA * mad, MIN_LOG_SPREAD)


def _kth_deviation(s: Sequence[float], m: float, k: int) -> float:
    """The ``k``-th smallest (from 0) of ``|v - m|`` over the sorted ``s`` (see
    :func:`_split`)."""
    p, i, j = _split(s, m, k)
    last_below = m - s[p - i] if i > 0 else -math.inf
    last_above = s[p + j - 1] - m if j > 0 else -math.inf
    return max(last_below, last_above)


def _kth_deviations(s: Sequence[float], m: float, k: int) -> tuple[float, float]:
    """The ``k``-th and ``(k - 1)``-th smallest (from 0, ``k >= 1``) of ``|v - m|`` over the
    sorted ``s``, from one :func:`_split`: the largest and the second largest of the ``k + 1``
    smallest, which are the last two taken from the run below or the run above (each run
    increases outwards). The values :func:`_kth_deviation` gives for ``k`` and ``k - 1``: an
    order statistic's value does not depend on which equal deviations are taken."""
    p, i, j = _split(s, m, k)
    below = m - s[p - i] if i > 0 else -math.inf  # the last taken below, and the one before
    below_before = m - s[p - i + 1] if i > 1 else -math.inf
    above = s[p + j - 1] - m if j > 0 else -math.inf
    above_before = s[p + j - 2] - m if j > 1 else -math.inf
    if below >= above:
        return below, max(below_before, above)
    return above, max(above_before, below)


def _split(s: Sequence[float], m: float, k: int) -> tuple[int, int, int]:
    """``(p, i, j)``: the ``k + 1`` smallest of ``|v - m|`` over the sorted ``s`` take ``i``
    from the run below ``m`` (``m - s[p - 1 - x]``, increasing in ``x``; ``p`` its length)
    and ``j = k + 1 - i`` from the run above (``s[p + y] - m``), ``i`` found by bisection
    (``m - v`` is ``abs(v - m)`` exactly: rounding is sign-symmetric)."""
    p = bisect.bisect_left(s, m)
    below, above = p, len(s) - p
    lo, hi = max(0, k + 1 - above), min(k + 1, below)
    while True:
        i = (lo + hi) // 2
        j = k + 1 - i
        if i > 0 and j < above and m - s[p - i] > s[p + j] - m:
            hi = i - 1  # too many from below
        elif j > 0 and i < below and s[p + j - 1] - m > m - s[p - 1 - i]:
            lo = i + 1  # too few from below
        else:
            return p, i, j


class SpikeDetector:
    """Scores every snapshot against the rolling window of each series (see the module docs).

    Thread-safe: results may be materialized on any thread; scoring and updating a window is
    one critical section per snapshot.

    Args:
        window: ``spike_window``, samples per series.
        threshold: ``spike_threshold``; ``0`` disables detection (:meth:`score` returns the
            snapshot unchanged).
        warmup: ``spike_warmup``, samples a window needs before a score is defined.
        rank: named in the warnings.
    """

    def __init__(self, window: int, threshold: float, warmup: int, rank: int = 0) -> None:
        self.window = window
        self.threshold = threshold
        self.warmup = warmup
        self.rank = rank
        self._windows: dict[str | None, SpikeWindow] = {}  # None: the global norm
        self._last_order = 0
        self._stage: frozenset[str] | None = None  # the isolated groups of the last collect
        self._lock = threading.Lock()
        self._log = RateLimitedLog(60.0)

    @property
    def enabled(self) -> bool:
        return self.threshold > 0

    def score(self, snap: Snapshot, order: int) -> Snapshot:
        """``snap`` with its :meth:`fields` set."""
        return snap.replace(**self.fields(snap, order)) if self.enabled else snap

    def fields(self, snap: Snapshot, order: int) -> dict[str, Any]:
        """``global_spike_score``, ``spike_scores``, ``global_spike`` and ``spiking_groups`` of
        ``snap`` (keyword arguments of :meth:`Snapshot.replace`; empty when disabled); ``order``
        numbers the collects (a later collect has a larger one). Logs one rate-limited WARNING
        per spiking series."""
        if not self.enabled:
            return {}
        series: dict[str | None, float] = {None: snap.global_norm}
        groups = snap.groups
        for g, stats in groups.items():
            series[g] = stats.norm
        threshold = self.threshold
        with self._lock:
            enters = snap.is_finite and order > self._last_order
            if order > self._last_order:
                self._last_order = order
                isolated = snap.isolation_violated.keys()
                if self._stage is None or isolated != self._stage:  # as sets: no set built
                    if self._stage is not None:
                        for w in self._windows.values():  # a new stage: a new baseline
                            w.clear()
                    self._stage = frozenset(isolated)
            shared = self._score_shared(series, enters)
            if shared is not None:
                scores, centers = shared
            else:
                scores, samples, centers = self._score(series)
                if enters:  # every series scored first: a window enters only its own sample
                    self._enter(series, scores, samples)
        spiking = tuple([g for g in groups if scores[g] > threshold])
        global_spike = scores[None] > threshold
        for key in ((None,) if global_spike else ()) + spiking:
            m, n = centers[key]
            self._warn(snap.step, key, scores[key], series[key], math.exp(m), n)
        group_scores: Mapping[str, float] = {g: scores[g] for g in groups}
        return {
            "global_spike_score": scores[None],
            "spike_scores": group_scores,
            "global_spike": global_spike,
            "spiking_groups": spiking,
        }

    def _score(
        self, series: Mapping[str | None, float]
    ) -> tuple[
        dict[str | None, float], dict[str | None, float], dict[str | None, tuple[float, int]]
    ]:
        """Each series' score against its window as it is (NaN while undefined), its sample
        ``ln(norm)`` (absent for a norm not finite and positive) and, where scored, its
        window's median and size. A window one series has is made here, empty: series whose
        windows are made by the same call with the same first sample share one (see
        :meth:`_enter`); the median and spread of a shared window are computed once. Caller
        holds the lock."""
        windows, warmup = self._windows, self.warmup
        scores: dict[str | None, float] = {}
        samples: dict[str | None, float] = {}
        centers: dict[str | None, tuple[float, int]] = {}
        made: dict[float, SpikeWindow] = {}  # windows made by this call, by first sample
        spread: dict[int, tuple[float, float]] = {}  # id(window) -> its (m, s)
        for key, norm in series.items():
            sample = 0.0 < norm < math.inf  # NaN, Inf, zero: no sample, no score
            x = math.log(norm) if sample else math.nan
            w = windows.get(key)
            if w is None:
                w = made.get(x) if sample else None
                if w is None:
                    w = SpikeWindow(self.window)
                    if sample:
                        made[x] = w
                windows[key] = w
            if not sample:
                scores[key] = math.nan
                continue
            samples[key] = x
            n = len(w._fifo)
            if n < warmup or n == 0:
                scores[key] = math.nan
                continue
            ms = spread.get(id(w))
            if ms is None:
                ms = spread[id(w)] = w.center_spread()
            m, s = ms
            scores[key] = (x - m) / s
            centers[key] = (m, n)
        return scores, samples, centers

    def _score_shared(
        self, series: Mapping[str | None, float], enters: bool
    ) -> tuple[dict[str | None, float], dict[str | None, tuple[float, int]]] | None:
        """:meth:`_score` then :meth:`_enter` (when ``enters``) of series that all share one
        window and have the same finite positive norm (a model whose one group is the whole
        model): the one sample scored and entered once, what those two do for such series
        (every series scored alike from the same window, which takes the sample once). None,
        with nothing done, for any other series. Caller holds the lock."""
        norms = list(series.values())
        norm = norms[0]
        # C-level counts (a window compares by identity): no generator per collect
        if not 0.0 < norm < math.inf or norms.count(norm) != len(norms):
            return None
        windows = self._windows
        w = windows.get(None)
        if w is None or list(map(windows.get, series)).count(w) != len(norms):
            return None
        x = math.log(norm)
        n = len(w._fifo)
        center: tuple[float, int] | None = None
        score = math.nan
        if n >= self.warmup and n > 0:
            m, s = w.center_spread()
            score = (x - m) / s
            center = (m, n)
        if enters:
            w.add(x)
            if score == score:
                w.track_shift(x, score)  # the sample's run towards a level shift
        scores = dict.fromkeys(series, score)
        return scores, ({} if center is None else dict.fromkeys(series, center))

    def _enter(
        self,
        series: Mapping[str | None, float],
        scores: Mapping[str | None, float],
        samples: Mapping[str | None, float],
    ) -> None:
        """Every window takes its series' sample (none without one) and counts it towards a
        level shift, once per window: series sharing a window took the same samples so far,
        and keep sharing it while they take the same one (a model whose one group is the
        whole model: its norm is the global norm). A series whose sample differs from its
        sharer's gets a copy of the window as it is (the history it took) before any sample
        enters, so each window holds exactly its own series' samples, as if never shared.
        Caller holds the lock."""
        windows = self._windows
        taking: dict[int, tuple[SpikeWindow, float | None, float]] = {}
        for key in series:
            w = windows[key]
            x = samples.get(key)
            first = taking.get(id(w))
            if first is not None and first[1] == x:
                continue  # the sharer's sample: taken once, for both
            if first is not None:
                w = windows[key] = w.copy()
            taking[id(w)] = (w, x, scores[key])
        for w, x, score in taking.values():
            if x is not None:
                w.add(x)
                if score == score:
                    w.track_shift(x, score)

    def _warn(
        self, step: int, group: str | None, score: float, norm: float, typical: float, n: int
    ) -> None:
        what = "the global norm" if group is None else f"group {group!r}"
        self._log.warning(
            "spike" if group is None else f"spike:{group}",
            "gradwatch: step %d: gradient-norm spike in %s (rank %d): norm %.4g is %.1f robust "
            "deviations above the recent typical norm %.4g (median of the last %d steps)",
            step,
            what,
            self.rank,
            norm,
            score,
            typical,
            n,
        )
