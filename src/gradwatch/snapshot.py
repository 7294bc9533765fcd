"""The result types: immutable snapshots of one collected step.

A :class:`Snapshot` holds plain Python numbers only (no tensors), so it can be handed to the
exporter thread, pickled, logged as JSON and compared in tests without touching a device.

It also owns the *classification of a step*, the one definition every consumer uses (the
Prometheus counters, the demo's summary, ``gradwatch top`` and ``gradwatch plot``):

* :attr:`Snapshot.nonfinite_step`: some gradient held NaN/Inf, and AMP did not skip the step;
* :attr:`Snapshot.amp_skipped`: the GradScaler found NaN/Inf and skips the optimizer step;
* :attr:`Snapshot.exploding_step`: some parameter is exploding (non-finite ones included);
* :attr:`Snapshot.spike_step`: the global or a group norm spiked (:mod:`gradwatch.analysis.spikes`);
* :attr:`Snapshot.guard_skipped`: the optimizer-step guard skipped this step (its reason);
* :attr:`Snapshot.no_gradient`: no parameter had a gradient at all (``collect()`` before
  ``backward()``, or after ``zero_grad(set_to_none=True)``): its norms and health are NaN;
* :attr:`Snapshot.measured` False: gradwatch measured nothing (disabled or refused): every
  figure is NaN or None, the keys (groups, ratios) are those an enabled watcher would give.

History records are ``Snapshot.to_dict()`` lines: classify them with ``Snapshot.from_dict``.
This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class GroupStats:
    """Statistics of one group of parameters for one step.

    Attributes:
        norm: L2 norm of the concatenation of the group's gradients.
        numel: number of gradient elements in the group (parameters with a gradient only).
        tensors: number of parameters of the group that have a gradient.
        vanishing: parameters whose own gradient norm is below ``vanishing_threshold``.
        exploding: parameters whose own gradient norm is above ``exploding_threshold`` or
            non-finite.
        nonfinite: parameters whose gradient contains NaN or Inf.

    Optimizer-update health (``update_stats=True``; None without it, see :class:`Snapshot`):

    Attributes:
        weight_norm: L2 norm of the group's weights at this collect.
        update_norm: L2 norm of the update the last optimizer step before this collect
            applied to them (with ``every_n_steps > 1``: that one step's, not the sum since
            the previous collect).
        update_ratio: ``update_norm / weight_norm``.
        stalled_fraction: of the elements the step meant to change, the fraction it left
            unchanged (the intended update was under half an ulp of the weight); counted for
            every weight dtype (see :class:`Snapshot`).
    """

    norm: float = 0.0
    numel: int = 0
    tensors: int = 0
    vanishing: int = 0
    exploding: int = 0
    nonfinite: int = 0
    weight_norm: float | None = None
    update_norm: float | None = None
    update_ratio: float | None = None
    stalled_fraction: float | None = None


#: Added to the denominator of normalized ratios, and the floor under which a norm counts as 0.
RATIO_EPS = 1e-8

#: A straggler score (``Snapshot.straggler_score``) below this names a straggler: NVIDIA's
#: resiliency extension's default; the GradwatchSameRankSlowest alert's default threshold.
STRAGGLER_THRESHOLD = 0.7


def ratio_defined(denominator: GroupStats | None) -> bool:
    """Whether a normalized ratio over ``denominator`` means anything: the group had gradient
    elements and a finite norm of at least :data:`RATIO_EPS`. Otherwise the ratio is undefined:
    NaN in :attr:`Snapshot.ratios`, the history, the endpoint and the framework logs, drawn as
    a gap marked "undefined" by ``top`` and ``plot``; never a 0, which would read as a dormant
    numerator."""
    return (
        denominator is not None
        and denominator.numel > 0
        and math.isfinite(denominator.norm)
        and denominator.norm >= RATIO_EPS
    )


#: Added to the total norm in the clip coefficient, like ``torch.nn.utils.clip_grad_norm_``.
CLIP_EPS = 1e-6


def clip_coefficient(max_norm: float, total: float) -> float:
    """``min(1, max_norm / (total + 1e-6))`` on the host: :attr:`Snapshot.clip_coef`, by the
    same float64 formula as the device-side coefficient ``step.clip.clip_grads_`` applies."""
    return min(1.0, max_norm / (total + CLIP_EPS))


@dataclass(frozen=True)
class Snapshot:
    """Gradient statistics of the whole model for one step, as one process would see them.

    Attributes:
        step: the training step passed to ``collect``.
        global_norm: L2 norm over all parameters with a gradient (NaN/Inf if any is).
        groups: group name -> :class:`GroupStats`; ``"other"`` only when a parameter matched
            no pattern; configured groups always appear (norm 0 when they have no gradient
            while other groups have one; NaN on a step without any gradient, or unmeasured).
        param_norms: parameter name -> L2 norm of its gradient.
        nonfinite_params: sorted names of parameters whose gradient holds NaN or Inf.
        ratios: ``"num/den"`` -> normalized ratio
            ``(n_norm/sqrt(n_numel)) / (d_norm/sqrt(d_numel) + 1e-8)``; NaN when undefined
            (:func:`ratio_defined`: the denominator has no gradient, or a norm below 1e-8
            or non-finite); 0.0 when only the numerator has none (or a norm below 1e-8).
        raw_ratios: ``"num/den"`` -> ``n_norm / d_norm`` (NaN when ``d_norm`` is 0 or
            non-finite).
        health: ``clamp(1 - 0.5*vanishing/n - 0.8*exploding/n, 0, 1)`` over the n parameters
            with a gradient; 0.0 when ``global_norm`` is not finite; NaN with no gradient at
            all (nothing to judge) or when not measured.
        isolation_violated: isolated group -> its norm exceeds ``isolation_threshold`` (None
            when not measured).
        world_size: number of processes that contributed.
        parallelism: short description of the detected parallelism, e.g. ``"fsdp2x2+tp2"``.
        replica_divergence: relative spread ``(max - min) / max`` of the replicas' global norms
            at the last measurement (0.0 when identical); None when nothing measures it (no
            replicated piece: one process, FSDP without replicas, ``divergence_every=0``, or
            before the first measurement).
        clip_coef: the clip coefficient applied by ``GradWatch.clip_grad_norm_`` (None if the
            step was not clipped through gradwatch).
        amp_skipped: the AMP GradScaler found Inf/NaN and skips this optimizer step.
        timestamp: wall-clock time (seconds since the epoch) of the ``collect`` call.
        global_spike_score: robust deviations of the global log-norm above its recent median
            (:mod:`gradwatch.analysis.spikes`); NaN while undefined (warm-up, a non-finite or zero
            norm), None when spike detection is off (``spike_threshold=0``) or in a record
            written before it existed.
        spike_scores: group -> its score, likewise (empty when detection is off).
        global_spike: the global score exceeded ``spike_threshold``.
        spiking_groups: groups whose score exceeded ``spike_threshold``, in group order.

    The optimizer-step guard (``watch.guard``, :mod:`gradwatch.step.guard`; None/empty without it):

    Attributes:
        guard_skipped: ``"nonfinite"`` or ``"spike"`` when the guard skipped this step's
            optimizer update, None when it applied it (or there is no guard).
        consecutive_skipped_steps: steps skipped in a row up to this one (0: applied).
        guard_stopped: the guard would have skipped this step but had already skipped
            ``max_consecutive_skips`` in a row, so the update was applied.
        skipped_steps: reason -> steps the guard skipped so far (every guarded step,
            published or not).
        guard_score: the spike score the guard acted on at this step (NaN while undefined;
            None without spike skipping): it skipped for a spike exactly when this is above
            ``skip_spike_score`` (``guard_spike_statistic="ema"``: the EMA z-score).
        adaptive_clip_threshold: the adaptive clip threshold (None: warm-up, or no history).

    The per-rank view (DDP, docs/distributed.md; absent/None/empty when not available):

    Attributes:
        rank_view: the per-rank (pre-reduction) figures below were measured on this step.
        nonfinite_origin_ranks: ranks whose local gradients were already NaN/Inf before the
            reduction (at most one above the slot world size, see docs/distributed.md).
        nonfinite_origin_count: how many ranks that was (None without the view).
        nonfinite_origin_hosts: the host of each of those ranks (same order);
            nonfinite_origin_groups: the groups whose local gradients were non-finite there.
        replica_grad_norm_min, replica_grad_norm_median, replica_grad_norm_max: spread of the
            data-parallel replicas' local gradient norms (a replica's pipeline stages summed).
        replica_grad_norm_max_rank: lowest rank of the replica holding the max.
        replica_outlier_score: ``max |x_r - median| / median`` over the replica norms;
            replica_outlier_rank: lowest rank of that replica.
        slowest_rank: with ``rank_timing``, the rank whose working time (its own compute, not
            its waits on peers) was the longest by a bin (about 9%), None when two ranks or
            more share the top bin; slowest_host: its host.
        straggler_score: the fastest rank's working time over the slowest's, in ``(0, 1]``
            (below 0.7: a straggler); None when not measured.
        work_seconds_min, work_seconds_median, work_seconds_max: over the ranks, each rank's
            median working time since the previous carried step (see ``rank_timing``).
        rank_timing_step: the carried step those fields come from (None before the first).
        gradient_noise_scale: B_simple of the whole model (smoothed over the last
            ``NOISE_SCALE_WINDOW`` rank-view steps, :mod:`gradwatch.analysis.rankview`; unit: that
            of ``batch_size``, per-replica batches without it); NaN while undefined (either
            smoothed estimate not positive), never negative.
        group_noise_scale: group -> B_simple.

    Optimizer-update health (``WatchConfig(update_stats=True)``, :mod:`gradwatch.norms.updates`;
    None without it), whole-model figures (per group in :attr:`groups`):

    Attributes:
        weight_norm: L2 norm of every weight at this collect, combined exactly across shards.
        update_norm: L2 norm of ``theta_t - theta_{t-1}``, the update the last optimizer step
            before this collect applied (0.0: no step changed the weights); None on the
            first collect, or when a step could not be measured (an unsupported optimizer);
            with ``every_n_steps > 1`` that one step's, not the sum since the last collect.
        update_ratio: ``update_norm / weight_norm``; NaN when the weight norm is 0 or
            non-finite; None when ``update_norm`` is.
        stalled_fraction: of the elements whose intended update was non-zero, the fraction
            whose weight did not change (the update was under half an ulp of it), counted
            in every dtype (float32: an update below about 2^-24 of the weight).
            NaN when no element was meant to change; None when ``update_norm`` is.
        no_update_step: a *silent skip*: no optimizer step changed a weight since the
            previous collect (``update_norm == 0.0``) although that collect's gradients were
            finite and non-zero and neither AMP nor the guard skipped it.
        deepspeed_skipped_steps: under DeepSpeed, the optimizer steps the engine skipped on an
            overflow since the previous collect (its ``skipped_steps`` count); None otherwise
            and on the first collect.
        measured: False when gradwatch measured nothing (a disabled or refused watcher:
            :meth:`unmeasured`); True for every collected step.
        no_gradient: a measured step on which no parameter had a gradient at all
            (``collect()`` before ``backward()``, or after ``zero_grad(set_to_none=True)``):
            its norms, ratios and health are NaN, never the 0.0 and 1.0 of a healthy step.
    """

    step: int
    global_norm: float = 0.0
    groups: Mapping[str, GroupStats] = field(default_factory=dict)
    param_norms: Mapping[str, float] = field(default_factory=dict)
    nonfinite_params: tuple[str, ...] = ()
    ratios: Mapping[str, float] = field(default_factory=dict)
    raw_ratios: Mapping[str, float] = field(default_factory=dict)
    health: float = 1.0
    isolation_violated: Mapping[str, bool | None] = field(default_factory=dict)
    world_size: int = 1
    parallelism: str = "single"
    replica_divergence: float | None = None
    clip_coef: float | None = None
    amp_skipped: bool = False
    timestamp: float = 0.0
    # -- spike detection (gradwatch.analysis.spikes) --
    global_spike_score: float | None = None
    spike_scores: Mapping[str, float] = field(default_factory=dict)
    global_spike: bool = False
    spiking_groups: tuple[str, ...] = ()
    # -- the optimizer-step guard (gradwatch.step.guard) --
    guard_skipped: str | None = None
    consecutive_skipped_steps: int | None = None
    guard_stopped: bool = False
    skipped_steps: Mapping[str, int] = field(default_factory=dict)
    guard_score: float | None = None
    adaptive_clip_threshold: float | None = None
    # -- the per-rank view (DDP comm hook; see docs/distributed.md)
    rank_view: bool = False
    nonfinite_origin_ranks: tuple[int, ...] = ()
    nonfinite_origin_count: int | None = None
    nonfinite_origin_hosts: tuple[str, ...] = ()
    nonfinite_origin_groups: tuple[str, ...] = ()
    replica_grad_norm_min: float | None = None
    replica_grad_norm_median: float | None = None
    replica_grad_norm_max: float | None = None
    replica_grad_norm_max_rank: int | None = None
    replica_outlier_score: float | None = None
    replica_outlier_rank: int | None = None
    gradient_noise_scale: float | None = None
    group_noise_scale: Mapping[str, float] = field(default_factory=dict)
    # -- optimizer-update health (gradwatch.norms.updates)
    weight_norm: float | None = None
    update_norm: float | None = None
    update_ratio: float | None = None
    stalled_fraction: float | None = None
    no_update_step: bool = False
    deepspeed_skipped_steps: int | None = None
    measured: bool = True
    no_gradient: bool = False
    # -- which rank is slow (WatchConfig.rank_timing; gradwatch.reduce.ranktiming) --
    slowest_rank: int | None = None
    slowest_host: str | None = None
    straggler_score: float | None = None
    work_seconds_min: float | None = None
    work_seconds_median: float | None = None
    work_seconds_max: float | None = None
    rank_timing_step: int | None = None

    def __post_init__(self) -> None:
        for name in _MAPPINGS:
            object.__setattr__(self, name, _frozen(getattr(self, name)))
        for name in _TUPLES:
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def unmeasured(
        cls,
        step: int,
        *,
        groups: Sequence[str] = (),
        ratios: Sequence[str] = (),
        isolated: Sequence[str] = (),
        parallelism: str = "disabled",
        timestamp: float = 0.0,
    ) -> Snapshot:
        """What a watcher that measures nothing (disabled or refused) gives for ``step``: the
        keys an enabled one would give (``groups``, ``ratios`` keys ``"num/den"``,
        ``isolated``), every figure NaN or None, ``measured=False``; so a loop written for an
        enabled watcher runs unchanged, and nothing reads as healthy."""
        nan = math.nan
        return cls(
            step=step,
            global_norm=nan,
            groups={g: GroupStats(norm=nan) for g in groups},
            ratios=dict.fromkeys(ratios, nan),
            raw_ratios=dict.fromkeys(ratios, nan),
            health=nan,
            isolation_violated=dict.fromkeys(isolated),
            parallelism=parallelism,
            timestamp=timestamp,
            measured=False,
        )

    @property
    def is_finite(self) -> bool:
        """True when no gradient held NaN or Inf (vacuously on a step without any gradient,
        or not measured: its NaN norms say "nothing to measure", not "NaN gradient")."""
        if self.nonfinite_params:
            return False
        return math.isfinite(self.global_norm) or self.no_gradient or not self.measured

    @property
    def nonfinite_step(self) -> bool:
        """A *non-finite step*: some gradient held NaN or Inf and the step was not AMP-skipped
        (an AMP-skipped step is the scaler working as designed, counted apart)."""
        return not self.is_finite and not self.amp_skipped

    @property
    def exploding_step(self) -> bool:
        """An *exploding step*: some parameter's gradient norm exceeded
        ``exploding_threshold`` or was non-finite (so every non-finite step is exploding too)."""
        return self.exploding > 0

    @property
    def spike_step(self) -> bool:
        """A *spike step*: the global norm or some group's norm spiked (see
        :mod:`gradwatch.analysis.spikes`)."""
        return self.global_spike or bool(self.spiking_groups)

    @property
    def nonfinite_groups(self) -> tuple[str, ...]:
        """Groups whose gradients held NaN or Inf at this step (AMP-skipped or not)."""
        return tuple(
            g for g, s in self.groups.items() if s.nonfinite > 0 or not math.isfinite(s.norm)
        )

    @property
    def exploding(self) -> int:
        """Parameters counted as exploding (non-finite included), over all groups."""
        return sum(g.exploding for g in self.groups.values())

    @property
    def vanishing(self) -> int:
        return sum(g.vanishing for g in self.groups.values())

    def replace(self, **changes: Any) -> Snapshot:
        """A copy with some fields changed (snapshots are immutable).

        Unchanged mappings are shared, not copied again: they are this snapshot's own
        read-only copies, and ``param_norms`` of a large model holds one entry per parameter.
        """
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        _write(new, changes)
        return new

    def _fields(self) -> dict[str, Any]:
        """Field values with the read-only mappings as plain dicts (mappingproxy objects can
        be neither pickled nor deep-copied, so ``dataclasses.asdict`` cannot be used)."""
        return {
            f.name: dict(v) if isinstance(v, MappingProxyType) else v
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
        }

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_snapshot, (self._fields(),))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields; NaN/Inf stay floats (a history line spells them as strings,
        :mod:`gradwatch.export.history`)."""
        out = self._fields()
        for name in _MAPPINGS:
            value = getattr(self, name)
            out[name] = {
                k: dataclasses.asdict(v) if isinstance(v, GroupStats) else v
                for k, v in value.items()
            }
        for name in _TUPLES:
            out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Snapshot:
        """Inverse of :meth:`to_dict`."""
        kwargs = dict(data)
        kwargs["groups"] = {k: GroupStats(**v) for k, v in data.get("groups", {}).items()}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in known})


#: The mapping fields, frozen on construction and written as plain dicts.
_MAPPINGS = (
    "groups",
    "param_norms",
    "ratios",
    "raw_ratios",
    "isolation_violated",
    "spike_scores",
    "group_noise_scale",
    "skipped_steps",
)

#: The tuple fields, made tuples on construction and written as JSON lists.
_TUPLES = (
    "nonfinite_params",
    "spiking_groups",
    "nonfinite_origin_ranks",
    "nonfinite_origin_hosts",
    "nonfinite_origin_groups",
)


def _rebuild_snapshot(fields: dict[str, Any]) -> Snapshot:
    """Unpickling helper of :class:`Snapshot`."""
    return Snapshot(**fields)


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    """The field names of a snapshot class, read once (``replace`` runs on every collect)."""
    return frozenset(f.name for f in dataclasses.fields(cls))


def snapshot_of(**values: Any) -> Snapshot:
    """``Snapshot(**values)``, built for the warm path (every collect's result): the instance
    dict is filled from the defaults precomputed once (an empty mapping is one shared
    read-only proxy) instead of one frozen-field assignment per field; the given mappings and
    sequences are frozen as the constructor freezes them (a read-only proxy is taken as given,
    not copied: the caller hands over the dict it wraps, which is how a per-parameter mapping
    is built once), and a missing or unknown field raises ``TypeError`` as the constructor
    does."""
    defaults = _defaults(Snapshot)[0]
    mappings, tuples = _complete(tuple(values))
    new = object.__new__(Snapshot)
    fields = new.__dict__
    fields.update(defaults)
    fields.update(values)
    for name in mappings:
        if type(values[name]) is not MappingProxyType:
            fields[name] = _frozen(values[name])
    for name in tuples:
        fields[name] = tuple(values[name])
    return new


def amend_fresh(snap: Snapshot, changes: Mapping[str, Any]) -> Snapshot:
    """``snap.replace(**changes)`` for a snapshot its builder still holds alone (just built
    by :func:`snapshot_of`, handed to no one yet): the changes are written into ``snap``
    itself, frozen as :meth:`Snapshot.replace` freezes them, and ``snap`` is returned; no
    second snapshot is built. Raises ``TypeError`` on an unknown field, as ``replace``."""
    _write(snap, changes)
    return snap


def _write(snap: Snapshot, changes: Mapping[str, Any]) -> None:
    """``changes`` written into ``snap``'s fields, mappings frozen and sequences made tuples
    as the constructor does. Raises ``TypeError`` on an unknown field."""
    mappings, tuples = _given(type(snap), tuple(changes))
    fields = snap.__dict__
    fields.update(changes)
    for name in mappings:
        fields[name] = _frozen(changes[name])
    for name in tuples:
        fields[name] = tuple(changes[name])


@functools.lru_cache(maxsize=64)
def _complete(names: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """:func:`_given` for a whole :class:`Snapshot`: also raises ``TypeError`` when a field
    without a default is not among ``names``."""
    given = _given(Snapshot, names)
    missing = _defaults(Snapshot)[1].difference(names)
    if missing:
        raise TypeError(f"Snapshot: missing field(s) {sorted(missing)}")
    return given


@functools.lru_cache(maxsize=256)
def _given(cls: type, names: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of the field names ``names`` (in the order given), the mapping fields and the tuple
    fields: what a construction or :meth:`Snapshot.replace` freezes. Raises ``TypeError`` on
    a name that is no field of ``cls``. Cached on the names: a collect builds its snapshot
    with the same names every step (a tuple of interned strings, hashed once)."""
    unknown = sorted(set(names) - _field_names(cls))
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    return (
        tuple(n for n in names if n in _MAPPINGS),
        tuple(n for n in names if n in _TUPLES),
    )


@functools.cache
def _defaults(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """The default of every defaulted field of a snapshot class (its mappings frozen as
    ``__post_init__`` freezes them) and the names of the fields without one."""
    defaults: dict[str, Any] = {}
    required: set[str] = set()
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
            defaults[f.name] = _frozen(value) if f.name in _MAPPINGS else value
        else:
            required.add(f.name)
    for name in _TUPLES:
        if name in defaults:
            defaults[name] = tuple(defaults[name])
    return defaults, frozenset(required)
