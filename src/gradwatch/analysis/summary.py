"""Host-side summary: from the reduced per-parameter vector to a :class:`Snapshot`.

Runs off the training thread (in ``PendingSnapshot.result()``), on plain Python floats, with no
device work: group and global norms are :func:`gradwatch.norms.stats.sqrt_sum` of the parameters'
squared norms (an exact sum, scaled so a sum of squares beyond float64's range cannot overflow),
so the combination adds no error beyond rounding. When some float64 norm lies outside
``[2^-450, 2^450]`` its square travels in the high or low band (:mod:`gradwatch.norms.stats`): each
parameter's norm comes from its bands (:func:`gradwatch.norms.bands.norm_from_bands`) and totals
from those norms by ``math.hypot`` (scaled internally, so nothing overflows or underflows).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple, Protocol

from gradwatch.analysis.anomalies import AnomalyLog
from gradwatch.analysis.audit import LocalSquares, NormAuditor, parallel_factors
from gradwatch.analysis.rankview import NoiseScale, rank_view_fields
from gradwatch.analysis.reporter import Reporter
from gradwatch.analysis.spikes import SpikeDetector
from gradwatch.analysis.update_health import update_fields
from gradwatch.config import WatchConfig, ratio_key
from gradwatch.norms.bands import norm_from_bands
from gradwatch.norms.stats import sqrt_sum
from gradwatch.records import fast_init
from gradwatch.reduce.layout import Layout
from gradwatch.reduce.ranktiming import CarriedTiming
from gradwatch.reduce.reduced import ReducedStats
from gradwatch.snapshot import (
    RATIO_EPS,
    GroupStats,
    Snapshot,
    amend_fresh,
    clip_coefficient,
    ratio_defined,
    snapshot_of,
)


class ResolvedModel(Protocol):
    """What the summary reads of the model resolved at construction (``step.resolve``'s
    ``Resolved`` is one): where the job runs, the agreed layout and the groups. Declared here,
    by its reader, so the host side never imports the step's orchestration above it."""

    rank: int
    world_size: int
    parallelism: str
    layout: Layout
    groups_of: list[str]
    group_order: list[str]
    view_groups: tuple[str, ...]


class GuardReadingFields(Protocol):
    """A guard decision read to the host (``step.guard``'s ``GuardReading``)."""

    def snapshot_fields(self) -> dict[str, Any]: ...


class StepDecision(Protocol):
    """One step's optimizer-step guard decision (``step.guard``'s ``GuardDecision``)."""

    def reading(self) -> GuardReadingFields: ...


class AdaptiveFigures(Protocol):
    """One step's adaptive clip figures (``step.adaptive``'s ``AdaptiveStep``)."""

    def reading(self) -> Any: ...


class DecisionReporter(Protocol):
    """The guard that decided (``step.guard``'s ``StepGuard``): logs what a reading says."""

    def report(self, reading: Any, step: int, rank: int) -> None: ...


def normalized_ratio(n_norm: float, n_numel: int, d_norm: float, d_numel: int) -> float:
    """``(n/sqrt(n_numel)) / (d/sqrt(d_numel) + 1e-8)``.

    NaN when undefined: the denominator had no gradient element, or a norm below 1e-8 or
    non-finite (:func:`~gradwatch.snapshot.ratio_defined`); never a 0 that would read as a
    dormant numerator. 0.0 when the denominator is defined and the numerator had no gradient
    or a norm below 1e-8 (a dormant numerator, measured); NaN/Inf in the numerator propagate.
    """
    if not ratio_defined(GroupStats(norm=d_norm, numel=d_numel)):
        return math.nan
    if n_numel == 0 or n_norm < RATIO_EPS:
        return 0.0
    return (n_norm / math.sqrt(n_numel)) / (d_norm / math.sqrt(d_numel) + RATIO_EPS)


def raw_ratio(n_norm: float, d_norm: float) -> float:
    """``n / d``; NaN when undefined (``d`` is 0 or non-finite)."""
    return n_norm / d_norm if math.isfinite(d_norm) and d_norm != 0.0 else math.nan


def health_score(n: int, vanishing: int, exploding: int, global_norm: float) -> float:
    """``clamp(1 - 0.5 v/n - 0.8 e/n, 0, 1)``; NaN if n == 0 (no parameter had a gradient:
    nothing to judge, which must not read as a healthy 1.0); 0.0 if the global norm is not
    finite."""
    if n == 0:
        return math.nan
    if not math.isfinite(global_norm):
        return 0.0
    return min(1.0, max(0.0, 1.0 - 0.5 * vanishing / n - 0.8 * exploding / n))


def summarize(
    *,
    step: int,
    cfg: WatchConfig,
    names: Sequence[str],
    groups_of: Sequence[str],
    numels: Sequence[int],
    squares: Sequence[float],
    nonfinite_flags: Sequence[float] | None,
    has_grad: Sequence[float] | None,
    group_order: Sequence[str],
    isolated: Sequence[str] | None = None,
    squares_high: Sequence[float] | None = None,
    squares_low: Sequence[float] | None = None,
    norms: Sequence[float] | None = None,
    extremes: tuple[float, float] | None = None,
    **extra: object,
) -> Snapshot:
    """Build the snapshot of one step from per-parameter squared norms (global layout order).

    ``group_order`` lists the groups that always appear: the configured ones, plus ``"other"``
    when some parameter of the model matched no pattern. ``isolated`` (default
    ``cfg.isolated``) lists the groups checked for isolation.

    A parameter counts (``tensors``, ``numel``, health's n) when some rank had a gradient for it.
    It is non-finite when its squared norm is NaN/Inf or any rank flagged its piece.
    ``squares_high`` / ``squares_low``: the high and low bands of the squared norms (the
    parameter's squared norm is ``squares[i] + squares_high[i] * 2^1100 + squares_low[i] *
    2^-1200``); None when empty. ``nonfinite_flags`` None: no flag is set; ``has_grad`` None:
    every parameter has a gradient. ``norms``: ``sqrt(squares[i])`` per parameter when already
    computed (used when no band is set); ``extremes``: their ``(min, max)``, read only by a
    group holding every parameter whose norms are all finite. These only save work: the
    snapshot is the same without them.
    """
    high = squares_high if squares_high is not None and any(squares_high) else None
    low = squares_low if squares_low is not None and any(squares_low) else None
    banded = high is not None or low is not None
    zeros = [0.0] * len(squares) if banded else []
    high_of = high if high is not None else zeros
    low_of = low if low is not None else zeros
    all_norms: list[float] = []  # the banded case
    members, single, ordered = _grouping_of(names, groups_of, group_order, numels, has_grad)
    # No flag anywhere (the common case): no group gathers its flags.
    flagged = nonfinite_flags is not None and any(nonfinite_flags)
    param_norms: dict[str, Any] = ordered.copy()  # every key in place: filled by update
    nonfinite_params: list[str] = []
    group_stats: dict[str, GroupStats] = {}
    all_squares: list[float] = []
    vt, et = cfg.vanishing_threshold, cfg.exploding_threshold
    total_v = total_e = total_n = 0
    # One group with members (the common case, ``single``): its norm is the global norm, the
    # very same values through the very same exact sum (or hypot), so nothing is gathered twice.
    global_norm = math.nan
    sqrt = math.sqrt
    plain = norms
    for group, (idx, take, numel) in members.items():
        sq = take(squares)
        group_names = take(names)
        if banded:
            norms = list(map(norm_from_bands, sq, take(high_of), take(low_of)))
            group_norm = _hypot(norms)
            if not single:
                all_norms.extend(norms)
        else:
            norms = take(plain) if plain is not None else list(map(sqrt, sq))
            group_norm = sqrt_sum(sq)
            if not single:
                all_squares.extend(sq)
        param_norms.update(zip(group_names, norms, strict=True))
        # The common case, all finite and unflagged, is settled by the group's norm and one
        # C-level pass over the flags: a NaN or Inf norm makes the group's exact sum (or hypot)
        # NaN or Inf (a sum of finite norms that overflows only sends us to the exact
        # per-parameter check). Only otherwise is each parameter looked at: ``not norm < inf``
        # is True for NaN and Inf; a replica's flag marks a finite copy too.
        flags = take(nonfinite_flags) if flagged else ()  # type: ignore[arg-type]
        lowest = highest = math.nan  # the extremes of ``finite``, when known
        if group_norm < math.inf and not any(flags):
            nonfinite = 0
            finite: Sequence[float] = norms
            if extremes is not None and take is _itself and not banded:
                lowest, highest = extremes
            elif norms:
                lowest, highest = min(norms), max(norms)
        else:
            bad = [k for k in range(len(idx)) if not norms[k] < math.inf or flags[k] > 0]
            ok = set(range(len(idx))).difference(bad)
            finite = [norms[k] for k in sorted(ok)]
            nonfinite = len(bad)
            nonfinite_params.extend(group_names[k] for k in bad)
            if finite:
                lowest, highest = min(finite), max(finite)
        # Counted only when the extreme says some norm is past the threshold (one C pass).
        exploding = nonfinite + (sum(map(et.__lt__, finite)) if highest > et else 0)
        vanishing = sum(map(vt.__gt__, finite)) if lowest < vt else 0
        count = len(idx)
        group_stats[group] = _group_stats(
            group_norm, numel, count, vanishing, exploding, nonfinite
        )
        total_v += vanishing
        total_e += exploding
        total_n += count
        if single and count:
            global_norm = group_norm
    if not single:
        global_norm = _hypot(all_norms) if banded else sqrt_sum(all_squares)
    if nonfinite_params and math.isfinite(global_norm):
        global_norm = math.nan  # a replica flagged NaN that the counted copy did not show
    empty = _EMPTY_GROUP
    checked = cfg.isolated if isolated is None else isolated
    isolation = {  # before a gradient-less step's NaN norms: no gradient violates nothing
        g: _violates(group_stats.get(g, empty).norm, cfg.isolation_threshold) for g in checked
    }
    if total_n == 0:  # no gradient at all: nothing was measured to be 0
        global_norm = math.nan
        group_stats = {g: dataclasses.replace(s, norm=math.nan) for g, s in group_stats.items()}
    ratios: dict[str, float] = {}
    raw: dict[str, float] = {}
    for num, den in cfg.ratios:
        n, d = group_stats.get(num, empty), group_stats.get(den, empty)
        key = ratio_key(num, den)
        ratios[key] = normalized_ratio(n.norm, n.numel, d.norm, d.numel)
        raw[key] = raw_ratio(n.norm, d.norm)
    # Every mapping is built here and handed over as its read-only view: not copied again.
    return snapshot_of(
        step=step,
        global_norm=global_norm,
        groups=MappingProxyType(group_stats),
        param_norms=MappingProxyType(param_norms),
        nonfinite_params=tuple(sorted(nonfinite_params)),
        ratios=MappingProxyType(ratios),
        raw_ratios=MappingProxyType(raw),
        health=health_score(total_n, total_v, total_e, global_norm),
        isolation_violated=MappingProxyType(isolation),
        no_gradient=total_n == 0,
        **extra,  # type: ignore[arg-type]
    )


#: The stats of a group absent from a step (no parameter of it has a gradient).
_EMPTY_GROUP = GroupStats()

#: Every field of :class:`GroupStats` at its default: what :func:`_group_stats` starts from.
_GROUP_DEFAULTS = dict(vars(_EMPTY_GROUP))


def _group_stats(
    norm: float, numel: int, tensors: int, vanishing: int, exploding: int, nonfinite: int
) -> GroupStats:
    """``GroupStats(norm=..., ..., nonfinite=...)`` (the update-health fields at their
    default), with its instance dict filled at once rather than by one frozen-field
    assignment per field: every collect builds one per group."""
    stats = object.__new__(GroupStats)
    fields = stats.__dict__
    fields.update(_GROUP_DEFAULTS)
    fields["norm"] = norm
    fields["numel"] = numel
    fields["tensors"] = tensors
    fields["vanishing"] = vanishing
    fields["exploding"] = exploding
    fields["nonfinite"] = nonfinite
    return stats


#: Per group: the positions with a gradient, their taker (see :func:`_taker`) and their
#: number of gradient elements.
Members = dict[str, tuple[tuple[int, ...], Callable[[Sequence[Any]], Sequence[Any]], int]]


class Grouping(NamedTuple):
    """Which parameters each group counts on a step (see :func:`_grouping`)."""

    members: Members
    single: bool  # exactly one group has members
    names: dict[str, None]  # every member's name, in the order the summary lists them


def _grouping_of(
    names: Sequence[str],
    groups_of: Sequence[str],
    group_order: Sequence[str],
    numels: Sequence[int],
    has_grad: Sequence[float] | None,
) -> Grouping:
    """:func:`_grouping` of these inputs (``has_grad`` None: every parameter has a gradient).
    Tuples (what :class:`Summarizer` passes: built once) are matched by identity against the
    last call, so a step whose every parameter has a gradient hashes nothing per parameter;
    any other input is cached on its value."""
    global _last_grouping
    key = None if has_grad is None else tuple(has_grad)
    last = _last_grouping
    if (
        last is not None and last[0] is names and last[1] is groups_of
        and last[2] is group_order and last[3] is numels and last[4] == key
    ):
        return last[5]
    given = (names, groups_of, group_order, numels)
    found = _grouping(*(tuple(x) for x in given), key)
    if all(type(x) is tuple for x in given):  # immutable: the same object, the same value
        _last_grouping = (*given, key, found)
    return found


#: The last :func:`_grouping_of` call's tuple inputs and answer (replaced whole: thread-safe).
_last_grouping: tuple[Any, ...] | None = None


@functools.lru_cache(maxsize=4)
def _grouping(
    names: tuple[str, ...],
    groups_of: tuple[str, ...],
    group_order: tuple[str, ...],
    numels: tuple[int, ...],
    has_grad: tuple[float, ...] | None,
) -> Grouping:
    """Per group, the positions that had a gradient (the always-shown groups first), a
    function taking those positions of any per-parameter sequence (a C-level gather) and their
    elements; whether exactly one group has such positions (``has_grad`` None: every
    position); and the members' names in that order, as the keys of a dict whose copy the
    summary fills (a copy of a dict is a block copy: no key is hashed or inserted again). The
    same from step to step in most jobs, so cached on the exact inputs (tuples: hashed and
    compared in C)."""
    positions: dict[str, list[int]] = {g: [] for g in group_order}
    for i, group in enumerate(groups_of):
        if has_grad is None or has_grad[i] > 0:
            positions.setdefault(group, []).append(i)
    n = len(groups_of)
    members: Members = {
        g: (tuple(idx), _taker(idx, n), sum(numels[i] for i in idx))
        for g, idx in positions.items()
    }
    ordered = dict.fromkeys(names[i] for idx in positions.values() for i in idx)
    return Grouping(members, sum(1 for idx in positions.values() if idx) == 1, ordered)


def _taker(idx: Sequence[int], n: int) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """``lambda seq: [seq[i] for i in idx]`` over sequences of ``n``: the sequence itself
    when ``idx`` is every position in order (one group holding every parameter with a
    gradient: nothing copied; the taken sequences are only read), else one C call
    (``itemgetter``), a tuple."""
    if len(idx) == n and all(map(operator.eq, idx, range(n))):
        return _itself
    if len(idx) > 1:
        return operator.itemgetter(*idx)
    if len(idx) == 1:
        only = idx[0]
        return lambda seq: (seq[only],)
    return lambda seq: ()


def _itself(seq: Sequence[Any]) -> Sequence[Any]:
    return seq


def _hypot(norms: list[float]) -> float:
    """The L2 norm of parameters given by their norms (the banded case): ``math.hypot``,
    which scales internally (nothing overflows or underflows), except that a NaN wins over an
    Inf, as in a plain sum of squares."""
    if any(x != x for x in norms):
        return math.nan
    return math.hypot(*norms)


def _violates(norm: float, threshold: float) -> bool:
    """An isolated group violates isolation when its norm exceeds the threshold; a NaN/Inf
    gradient in it is a gradient too, so it violates as well."""
    return not math.isfinite(norm) or norm > threshold


#: ``x > 0`` as one C call (``0 < x``): False for NaN, as the summary's ``has_grad[i] > 0``.
_POSITIVE = (0.0).__lt__


def _per_parameter_inputs(stats: ReducedStats) -> tuple[
    Sequence[float] | None, Sequence[float] | None, Sequence[float] | None,
    Sequence[float] | None, Sequence[float] | None, tuple[float, float] | None,
]:
    """The :func:`summarize` arguments ``squares_high, squares_low, nonfinite_flags, has_grad,
    norms, extremes`` of ``stats``. A vectorized :class:`ReducedStats` (many parameters) gives
    its precomputed norms and extremes and a section only when some entry of it is set; a
    small one its lists, as they are (a few Python floats: nothing to save)."""
    if not stats.vectorized:  # has_grad None when every flag is > 0: what summarize reads
        has_grad = None if all(map(_POSITIVE, stats.has_grad)) else stats.has_grad
        return stats.squares_high, stats.squares_low, stats.nonfinite, has_grad, None, None
    banded = stats.banded()
    norms, extremes = (None, None) if banded else stats.plain_norms()
    return (
        stats.squares_high if banded else None,
        stats.squares_low if banded else None,
        stats.nonfinite if stats.flagged() else None,
        None if stats.all_have_grad() else stats.has_grad,
        norms,
        extremes,
    )


@fast_init
@dataclass(frozen=True)
class CollectedStep:
    """What a collect knew that the reduced figures do not: its step, when it ran, and what
    it was asked (clip, AMP, batch size), held until its snapshot is built."""

    step: int
    timestamp: float
    attempt: int  # numbers the collects: orders spike windows
    measure_divergence: bool
    isolated: tuple[str, ...]  # the expectation at collect time, not at build time
    max_norm: float | None = None
    amp: bool = False
    batch_size: int | None = None
    local_sq: LocalSquares | None = None  # this rank's squares: the audit's local diagnosis
    guard: DecisionReporter | None = None  # GradWatch.guard(): its decision on this step
    decision: StepDecision | None = None
    deepspeed_skipped_steps: int | None = None  # DeepSpeed's overflow skips since the last
    adaptive: AdaptiveFigures | None = None  # the adaptive history's figures of this step
    adaptive_clip: bool = False  # clipped by the adaptive threshold (clip_grad_norm_("auto"))


class Summarizer:
    """Builds each measured step's :class:`Snapshot`, once, from its reduced figures, and owns
    the host-side state that reads a series of snapshots: spike windows, the anomaly warnings,
    the noise scale, the last replica divergence and the norm auditor.

    Runs where results are materialized (the publisher thread, or whoever calls
    ``result()``); never issues device work nor reads a device tensor (the audit's local
    squares reach the host by their own copy: :class:`~gradwatch.analysis.audit.LocalSquares`).

    Args:
        cfg: the watcher's configuration.
        resolved: the model as resolved at construction (names, groups, layout).
        reporter: where counters and once-logged warnings go.
    """

    def __init__(self, cfg: WatchConfig, resolved: ResolvedModel, reporter: Reporter) -> None:
        self.cfg = cfg
        self._resolved = resolved
        self._reporter = reporter
        self._last_divergence: float | None = None  # None until something measures it
        self._anomalies = AnomalyLog(resolved.rank, cfg.isolation_threshold)
        self._spikes = SpikeDetector(
            cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup, resolved.rank
        )
        self._noise = NoiseScale()
        self._timing = CarriedTiming()  # which rank is slow, as the latest carried step said
        self._auditor = NormAuditor(
            cfg.audit_tolerance, parallel_factors(resolved.parallelism, resolved.world_size)
        )
        self.last: Snapshot | None = None  # the newest measured step
        # The last snapshot built and its collect: a silent skip is judged against the collect
        # just before (the publisher builds every step in order; otherwise when built so).
        self._previous: Snapshot | None = None
        self._previous_attempt = -1
        # Built once: the summary's grouping cache matches them by identity each step.
        self._groups_of = tuple(resolved.groups_of)
        self._group_order = tuple(resolved.group_order)

    def build(self, stats: ReducedStats, step: CollectedStep) -> Snapshot:
        """The snapshot of ``step`` from its reduced ``stats``: the summary, the clip
        coefficient, AMP, the per-rank view and the spike scores; then anomalies are
        warned, the audit judged and :attr:`last` advanced."""
        r = self._resolved
        if step.measure_divergence:
            self._last_divergence = stats.replica_divergence()
        high, low, flags, has_grad, norms, extremes = _per_parameter_inputs(stats)
        snap = summarize(
            step=step.step,
            cfg=self.cfg,
            names=r.layout.names,
            groups_of=self._groups_of,
            numels=r.layout.numels,
            squares=stats.squares,
            group_order=self._group_order,
            isolated=step.isolated,
            world_size=stats.world_size,
            parallelism=r.parallelism,
            replica_divergence=self._last_divergence,
            timestamp=step.timestamp,
            squares_high=high,
            squares_low=low,
            nonfinite_flags=flags,
            has_grad=has_grad,
            norms=norms,
            extremes=extremes,
        )
        changes: dict[str, Any] = {}
        if step.adaptive is not None:
            adaptive = step.adaptive.reading()
            changes["adaptive_clip_threshold"] = adaptive.threshold
            if step.adaptive_clip:
                changes["clip_coef"] = adaptive.coef  # the device's figure, read
        if step.max_norm is not None:
            changes["clip_coef"] = clip_coefficient(step.max_norm, snap.global_norm)
        if step.amp and not snap.is_finite:
            changes["amp_skipped"] = True
        if step.decision is not None and step.guard is not None:
            reading = step.decision.reading()
            spikes = step.guard.policy.skip_spike_score is not None
            changes.update(reading.snapshot_fields(spikes))
            step.guard.report(reading, step.step, r.rank)
        if stats.rank_view is not None:
            changes.update(
                rank_view_fields(
                    stats.rank_view, snap, r.view_groups, self._noise, step.batch_size or 1
                )
            )
        if step.deepspeed_skipped_steps is not None:
            changes["deepspeed_skipped_steps"] = step.deepspeed_skipped_steps
        if stats.updates is not None:
            previous = self._previous if self._previous_attempt == step.attempt - 1 else None
            changes.update(update_fields(stats.updates, r.view_groups, snap.groups, previous))
        if r.layout.rank_timing:
            changes.update(self._timing.fields(step.step, stats.rank_timing, r.layout.hosts))
        # Host-side, after the one read: scored in collect order, see gradwatch.analysis.spikes.
        changes.update(self._spikes.fields(snap, step.attempt))
        if changes:  # snap is this call's own until returned: amended, not copied
            snap = amend_fresh(snap, changes)
        self._previous, self._previous_attempt = snap, step.attempt
        if r.rank == 0:  # the same figures on every rank: one rank speaks
            self._anomalies.report(snap)
            if snap.no_gradient:
                self._reporter.log_once(
                    "no-gradient",
                    "gradwatch: step %d: no parameter has a gradient (collect() before "
                    "backward(), or after zero_grad(set_to_none=True)?): its norms and health "
                    "are NaN and it counts in gradwatch_no_gradient_steps_total; logged once",
                    snap.step,
                )
        if self.last is None or snap.step >= self.last.step:
            self.last = snap
        self.audit(snap, step.local_sq)
        return snap

    def report_norm(self, step: int, source: str, reported: Any) -> None:
        """Hold a norm the training code reported for ``step`` until that step is built."""
        self._auditor.report(step, source, reported)

    @property
    def auditing(self) -> bool:
        """Some norm was reported: collects keep this rank's local squares from now on."""
        return self._auditor.active

    def audit(self, snap: Snapshot | None = None, local_sq: LocalSquares | None = None) -> None:
        """Judge the reported norms waiting for ``snap`` (or any built step when None)."""
        auditor = self._auditor
        try:
            if snap is None:
                verdicts = auditor.judge()
            else:
                local = None
                if local_sq is not None and auditor.active:
                    local = local_sq.norm()  # host memory only (LocalSquares)
                verdicts = auditor.judge(snap.step, snap.global_norm, local)
            for v in verdicts:
                self._reporter.audit(v.source, v.ratio, v.agrees)
                if not v.agrees and self._resolved.rank == 0:  # one rank speaks
                    self._reporter.log_once(
                        f"audit:{v.source}:{v.kind}", "%s", v.message(self.cfg.audit_tolerance)
                    )
        except Exception as exc:  # never-crash boundary: an audit never breaks its step
            self._reporter.log_once("audit-error", "gradwatch: a norm audit failed: %s", exc)
