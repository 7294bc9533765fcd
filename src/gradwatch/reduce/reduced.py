"""The reduced vector of one collect, read through named views only.

:class:`ReducedVector` holds the packed vector once its all-reduce is issued
(:mod:`gradwatch.reduce.packing` builds it) and reads it by the offsets of
:mod:`gradwatch.reduce.sections`: :meth:`ReducedVector.stats` on the host (one host read, a
:class:`ReducedStats` of Python floats, for the summary, a large model's per-parameter sections
converted when first read; the rank view's section as a :class:`RankView`) and
:meth:`ReducedVector.device_bands` / :meth:`ReducedVector.device_nonfinite` on the device (for
clipping without a host read). Every wait is bounded: the collective's by
``collective_timeout_seconds`` (or, for the device views, the job's process-group timeout), an
accelerator copy's by the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch import Tensor

from gradwatch.errors import GradWatchError, GradWatchTimeoutError
from gradwatch.records import fast_init
from gradwatch.reduce.collective import (
    CollectiveTimeout,
    Pending,
    StandIn,
    landed,
    record_event,
    wait_landed,
)
from gradwatch.reduce.layout import Layout
from gradwatch.reduce.ranktiming import RankTiming
from gradwatch.reduce.sections import Sections, sections
from gradwatch.reduce.steps import device_step, steps_differ


@fast_init
@dataclass(frozen=True)
class ReducedStats:
    """The reduced vector of one collect as named host-side views (Python floats, in the
    global layout order of :attr:`Layout.names`).

    Attributes:
        squares: per parameter, the sum of its pieces' squared norms, each piece counted once
            (the plain band: pieces of norm in [2^-450, 2^450], and every NaN/Inf).
        squares_high: per parameter, the high band (``s * 2^-1100`` of larger pieces).
        squares_low: per parameter, the low band (``s * 2^1200`` of smaller pieces).
        nonfinite: per parameter, > 0 when some rank flagged NaN/Inf in its piece (replicas
            included: a NaN on a copy that is not counted is still seen).
        has_grad: per parameter, > 0 when some rank had a gradient for it.
        replica_squares: per replica slot, the squared norm its holders add (``R`` values;
            filled on divergence steps only).
        step_check: the sum of the steps the ranks collected.
        step_residues: the sums of the ranks' step residues and of their squares
            (:func:`~gradwatch.reduce.steps.steps_differ`).
        world_size: the number of ranks of the job.
        ranks: the number of ranks whose vectors were summed: ``world_size``, or 1 when the
            collect skipped the all-reduce
            (:meth:`~gradwatch.reduce.packing.Reducer.issues_collective`).
    """

    squares: list[float]
    squares_high: list[float]
    squares_low: list[float]
    nonfinite: list[float]
    has_grad: list[float]
    replica_squares: list[float]
    step_check: float
    world_size: int
    step_residues: tuple[float, float] = (0.0, 0.0)
    rank_view: RankView | None = None  # the pre-reduction view, when every rank reported
    ranks: int = 0  # 0: world_size
    updates: list[float] | None = None  # the update section (None: update_stats off)
    rank_timing: RankTiming | None = None  # the working times, when every rank measured

    @classmethod
    def from_values(
        cls, values: list[float], layout: Layout, ranks: int | None = None
    ) -> ReducedStats:
        """Split the host copy of a packed vector (pure; what :meth:`ReducedVector.stats`
        does after its one host read). ``ranks``: how many ranks' vectors it sums (default:
        all of them)."""
        at = _checked_sections(len(values), layout)
        # The trailing fields as _trailing_fields gives them, spelled out: every collect of
        # a small model takes this path, and a dict of keyword arguments costs a microsecond.
        return cls(
            squares=values[at.squares],
            squares_high=values[at.squares_high],
            squares_low=values[at.squares_low],
            nonfinite=values[at.nonfinite],
            has_grad=values[at.has_grad],
            replica_squares=values[at.replicas],
            step_check=values[at.step],
            world_size=layout.world_size,
            step_residues=(values[at.residues.start], values[at.residues.start + 1]),
            rank_view=RankView.from_section(values[at.rank_view], layout)
            if layout.rank_view_groups else None,
            ranks=layout.world_size if ranks is None else ranks,
            updates=values[at.updates] if layout.update_groups else None,
            # a vector that was not all-reduced carries no timing (it rides on all-reduces)
            rank_timing=RankTiming.from_section(values[at.rank_timing], layout.world_size)
            if layout.rank_timing and ranks != 1 else None,
        )

    @classmethod
    def from_host(cls, host: Tensor, layout: Layout, ranks: int | None = None) -> ReducedStats:
        """:meth:`from_values` of ``host.tolist()`` (``host``: the packed vector in host
        memory), equal field for field, by a cheaper route for a model of more than
        :data:`EAGER_PARAMETERS` parameters: only ``squares`` and the sections after the
        per-parameter ones become Python floats now; the bands, flags and has-gradient
        sections stay in ``host`` until first read (then as :meth:`from_values` gives them,
        kept), and :meth:`banded`, :meth:`flagged`, :meth:`all_have_grad` and
        :meth:`plain_norms` answer from ``host`` by one vectorized reduction each: what the
        summary asks of them on a step whose gradients are all finite and plain."""
        if len(layout.names) <= EAGER_PARAMETERS:  # a few floats: one tolist() is cheaper
            return cls.from_values(host.tolist(), layout, ranks)
        array = host.numpy()
        at = _checked_sections(len(array), layout)
        tail = at.replicas.start
        stats = object.__new__(cls)
        fields = vars(stats)
        fields["squares"] = array[at.squares].tolist()
        fields.update(_trailing_fields(array[tail:].tolist(), tail, layout, ranks))
        fields[_HOST] = (array, at)
        return stats

    def __getattr__(self, name: str) -> Any:
        """A per-parameter section :meth:`from_host` left in host memory, read on first use
        (only called for an attribute not in the instance dict)."""
        host = vars(self).get(_HOST)
        if host is None or name not in _LAZY_SECTIONS:
            raise AttributeError(name)
        array, at = host
        value = vars(self)[name] = array[getattr(at, name)].tolist()
        return value

    @property
    def vectorized(self) -> bool:
        """Built by :meth:`from_host` for many parameters: its per-parameter answers
        (:meth:`banded`, ...) are vectorized reductions, cheaper than reading the lists."""
        return _HOST in vars(self)

    def _section(self, name: str) -> Any:
        """The NumPy view of section ``name`` when it is still in host memory, else None."""
        host = vars(self).get(_HOST)
        if host is None:
            return None
        array, at = host
        return array[getattr(at, name)]

    def banded(self) -> bool:
        """Some parameter's squared norm has a non-zero high or low band (a norm outside
        ``[2^-450, 2^450]``, see :mod:`gradwatch.norms.stats`)."""
        host = vars(self).get(_HOST)
        if host is None:
            return any(self.squares_high) or any(self.squares_low)
        array, at = host
        return bool(array[at.squares_high.start : at.squares_low.stop].any())

    def flagged(self) -> bool:
        """Some non-finite flag is set (NaN counts as set, as in ``any``)."""
        flags = self._section("nonfinite")
        return any(self.nonfinite) if flags is None else bool(flags.any())

    def all_have_grad(self) -> bool:
        """Every parameter's has-gradient flag is ``> 0`` (a NaN flag is not)."""
        flags = self._section("has_grad")
        if flags is None:
            return all(map((0.0).__lt__, self.has_grad))
        return bool((flags > 0.0).all())

    def plain_norms(self) -> tuple[list[float], tuple[float, float] | None]:
        """Per parameter ``sqrt(squares[i])`` (its norm when no band is set: correctly
        rounded, the same float as ``math.sqrt``) and, when computed from host memory, their
        ``(min, max)`` (NaN when some norm is NaN: read only when all are finite), else None."""
        squares = self._section("squares")
        if squares is None:
            return list(map(math.sqrt, self.squares)), None
        norms = numpy.sqrt(squares)
        return norms.tolist(), (float(norms.min()), float(norms.max()))

    @property
    def steps_differ(self) -> bool:
        """The ranks collected different steps (:func:`~gradwatch.reduce.steps.steps_differ`)."""
        return steps_differ(self.ranks or self.world_size, *self.step_residues)

    def steps_agree(self, step: int) -> bool:
        """Did every rank collect ``step``? (A rank that collected another step changes the
        sum; a mismatch means the statistics mix steps. A rank whose local pass failed sends
        NaN: see :meth:`failed_rank`. A collect without the all-reduce checks only this
        rank's own step.)"""
        return self.step_check == step * (self.ranks or self.world_size)

    @property
    def closed_rank(self) -> bool:
        """Some rank's watcher was closed and stood in for this collect (step slot ``-inf``)."""
        return self.step_check == -math.inf

    @property
    def failed_rank(self) -> bool:
        """Some rank's local pass failed this collect
        (:meth:`~gradwatch.reduce.packing.Reducer.reduce_failed`): the vector holds no
        measurement."""
        return self.step_check != self.step_check

    @property
    def replica_norms(self) -> list[float]:
        """The global norm each replica position saw (replica slots only)."""
        return [math.sqrt(s) for s in self.replica_squares]

    def replica_divergence(self) -> float:
        """Relative spread ``(max - min) / max`` of :attr:`replica_norms`: 0.0 for identical
        replicas (or none), NaN when a replica's norm is NaN or Inf."""
        norms = self.replica_norms
        if any(math.isnan(x) for x in norms):
            return math.nan
        top = max(norms, default=0.0)
        if top == 0.0 or math.isinf(top):
            return 0.0 if top == 0.0 else math.nan
        return (top - min(norms)) / top


#: Models up to this many parameters build every :class:`ReducedStats` field at once
#: (:meth:`ReducedStats.from_host`): below it, the vectorized reductions cost more than they save.
EAGER_PARAMETERS = 64

#: The per-parameter sections :meth:`ReducedStats.from_host` reads on first use.
_LAZY_SECTIONS = frozenset({"squares_high", "squares_low", "nonfinite", "has_grad"})

#: The instance-dict key of the host array (and its sections) those sections are read from.
_HOST = "_host"


def _checked_sections(length: int, layout: Layout) -> Sections:
    """``layout``'s sections, after checking that a packed vector of ``length`` fits them."""
    at = sections(layout)
    if length != at.length:
        raise ValueError(f"gradwatch: a packed vector of {length} values, expected {at.length}")
    return at


def _trailing_fields(
    values: list[float], offset: int, layout: Layout, ranks: int | None
) -> dict[str, Any]:
    """The :class:`ReducedStats` fields after the per-parameter sections, from ``values``
    holding the packed vector from position ``offset`` on."""
    at = sections(layout)

    def part(s: slice) -> list[float]:
        return values[s.start - offset : s.stop - offset]

    return {
        "replica_squares": part(at.replicas),
        "step_check": values[at.step - offset],
        "world_size": layout.world_size,
        "step_residues": tuple(part(at.residues)),
        "rank_view": RankView.from_section(part(at.rank_view), layout)
        if layout.rank_view_groups else None,
        "ranks": layout.world_size if ranks is None else ranks,
        "updates": part(at.updates) if layout.update_groups else None,
        # a vector that was not all-reduced carries no timing (it rides on all-reduces)
        "rank_timing": RankTiming.from_section(part(at.rank_timing), layout.world_size)
        if layout.rank_timing and ranks != 1 else None,
    }


class ReducedVector:
    """The packed vector of one collect, once the all-reduce completes.

    Read through named views only: :meth:`stats` on the host, :meth:`device_bands` and
    :meth:`device_nonfinite` on the device.
    """

    def __init__(
        self,
        packed: Tensor,
        pending: Pending,
        timeout: float,
        step: int,
        layout: Layout,
        ranks: int | None = None,
        device_timeout: float | None = None,
    ) -> None:
        self._packed = packed
        self._values: list[float] | None = None  # the packed vector as floats (of_values)
        # The device views (a clip) wait as the job's own collectives would: the group's
        # timeout, so no rank gives up on a clip's all-reduce that another rank completes.
        self._device_timeout = timeout if device_timeout is None else device_timeout
        self._ranks = ranks  # None: every rank's vector (see ReducedStats.ranks)
        self._pending: Pending | None = pending
        self._timeout = timeout
        self._step = step
        self._layout = layout
        self._stats: ReducedStats | None = None
        self._device_step: Tensor | None = None
        self.step, self.ranks = step, ranks  # this rank's step; summed ranks (None: all)
        self.on_cpu = packed.device.type == "cpu"  # read without a device sync
        if not self.on_cpu:
            # NCCL: make the compute stream wait for the collective (no host wait), then start
            # a non-blocking copy to pinned memory; stats() waits on the event, once.
            pending.order_on_stream()
            # CUDA path, untested on this project's CPU machines. The event is recorded on the
            # stream of the vector's own device (Event.record() alone uses the *current*
            # device's stream, which may be another GPU's).
            self._pinned = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._pinned.copy_(packed, non_blocking=True)
            self._landed = landed(record_event(packed.device))

    @classmethod
    def of_values(cls, values: list[float], timeout: float, step: int, layout: Layout,
                  ranks: int | None = None,
                  device_timeout: float | None = None) -> ReducedVector:
        """The vector of a collect whose all-reduce changes nothing (none issued, or one
        process), given as the Python floats of its CPU packed vector
        (:class:`~gradwatch.reduce.packing.HostPacking`): :meth:`stats` splits them with no
        host read, and the CPU tensor the device views read is built from them (the same
        bits) when one is first asked for. The other arguments as the constructor's."""
        reduced = cls(_NO_VECTOR, Pending(), timeout, step, layout, ranks, device_timeout)
        reduced._values = values
        return reduced

    def _wait_collective(self, timeout: float | None = None) -> None:
        """Wait for the all-reduce. A wait that times out leaves it in flight (a retry may
        succeed): :class:`GradWatchTimeoutError` with ``in_flight`` True; a failed one:
        ``in_flight`` False; this rank's stand-in (:class:`gradwatch.reduce.collective.StandIn`): a
        plain :class:`GradWatchError`."""
        pending = self._pending  # read once: the publisher and the training thread may race
        if pending is not None:
            timeout = self._timeout if timeout is None else timeout
            try:
                pending.wait(timeout)
            except StandIn as exc:
                raise GradWatchError(
                    f"gradwatch: step {self._step} was not measured: {exc}"
                ) from exc
            except RuntimeError as exc:
                err = GradWatchTimeoutError(
                    f"gradwatch: the all-reduce of step {self._step} failed or did not "
                    f"complete within {timeout:g}s ({self._timeout_setting(timeout)}): another "
                    f"rank failed, skipped collect() or is stuck ({exc})"
                )
                err.in_flight = isinstance(exc, CollectiveTimeout)  # type: ignore[attr-defined]
                raise err from exc
            self._pending = None

    def _timeout_setting(self, timeout: float) -> str:
        """The setting that bounded a wait of ``timeout`` seconds, for its error message."""
        if timeout == self._timeout:
            return "collective_timeout_seconds"
        return (
            "the job's process-group timeout, init_process_group(timeout=...), which a clip's "
            "all-reduce waits for when longer than collective_timeout_seconds"
        )

    def _device(self) -> Tensor:
        # On accelerators the collective was already ordered before later kernels (no host
        # wait); on gloo this waits for the all-reduce, which CPU work would wait for anyway,
        # bounded by the group's timeout (a clip never gives up before the others do).
        self._wait_collective(self._device_timeout)
        if self._packed is _NO_VECTOR:  # of_values: built once (a race builds equal ones)
            self._packed = torch.tensor(self._values, dtype=torch.float64)
        return self._packed

    def device_bands(self) -> Tensor:
        """The reduced squared norms as the engine's three bands (``3N``: plain, high, low;
        see :mod:`gradwatch.norms.stats`), on the device (a view: no copy)."""
        return self._device()[sections(self._layout).bands]

    def device_unmeasured(self) -> Tensor:
        """A 0-dim bool on the device: some rank stood in for this collect (its step slot is
        NaN or ``-inf``, see :meth:`~gradwatch.reduce.packing.Reducer.reduce_failed`) or the
        ranks collected different steps (:func:`~gradwatch.reduce.steps.steps_differ`): the
        vector holds no measurement, and every rank reading it knows so without a host read.
        The step slot is finite, NaN or ``-inf`` (never ``+inf``): two ops, not ``isfinite``'s."""
        return torch.logical_not(self.device_step() > -math.inf)

    def device_step(self) -> Tensor:
        """The reduced step slot on the device, NaN where the ranks' steps differ
        (:func:`gradwatch.reduce.steps.device_step`; none for this rank's own vector), once."""
        if self._device_step is None:
            packed = self._device()
            s = sections(self._layout)
            step, ranks = packed[s.step], self.ranks or self._layout.world_size
            self._device_step = step if ranks == 1 else device_step(
                step, packed.narrow(0, s.residues.start, 2), ranks)
        return self._device_step

    def _wait_landed(self, timeout: float) -> None:
        """Wait at most ``timeout`` for an accelerator vector's pinned copy; one not landed is
        *in flight* (behind the all-reduce on the stream, done when a late rank arrives):
        ``in_flight`` True, never a reason to stop on this rank alone."""
        try:
            wait_landed(self._landed, timeout, f"the vector of step {self._step}")
        except GradWatchTimeoutError as exc:
            exc.in_flight = True  # type: ignore[attr-defined]
            raise

    def step_sums(self, timeout: float) -> tuple[float, float, float]:
        """The reduced step slot and residue sums on the host, after waiting at most
        ``timeout`` (``in_flight`` :class:`GradWatchTimeoutError` when still in flight)."""
        s = sections(self._layout)
        if self._values is not None:
            return self._values[s.step], self._values[s.step + 1], self._values[s.step + 2]
        if self._packed.device.type != "cpu":
            self._wait_landed(timeout)
            host = self._pinned
        else:
            self._wait_collective(timeout)
            host = self._packed
        step, residue, square = host.narrow(0, s.step, 3).tolist()
        return step, residue, square

    def device_nonfinite(self) -> Tensor:
        """Per parameter, the reduced non-finite flags (> 0: some rank saw NaN/Inf), on the
        device (a view: no copy)."""
        return self._device()[sections(self._layout).nonfinite]

    def device_bands_flags_and_step(self) -> tuple[Tensor, Tensor]:
        """The three bands and the non-finite flags as one ``4N`` view (plain, high, low,
        flags: adjacent in the layout) and the step slot (:meth:`device_step`: NaN where the
        ranks' steps differ), on the device, no copy (what the optimizer-step guard reads each
        step)."""
        packed = self._device()
        s = sections(self._layout)
        return packed.narrow(0, s.bands.start, s.nonfinite.stop), self.device_step()

    def stats(self) -> ReducedStats:
        """Wait (at most once), read the vector to the host once, return its named views."""
        if self._stats is None:
            if self._values is not None:  # of_values: nothing to wait for, nothing to read
                self._stats = ReducedStats.from_values(self._values, self._layout, self._ranks)
                return self._stats
            if self._packed.device.type != "cpu":
                self._wait_landed(self._timeout)
                host = self._pinned
            else:
                self._wait_collective()
                host = self._packed
            if len(self._layout.names) <= EAGER_PARAMETERS:  # as from_host, one call less
                self._stats = ReducedStats.from_values(host.tolist(), self._layout, self._ranks)
            else:
                self._stats = ReducedStats.from_host(host, self._layout, self._ranks)
        return self._stats


#: The vector of :meth:`ReducedVector.of_values` until a device view builds it (a CPU tensor).
_NO_VECTOR = torch.empty(0, dtype=torch.float64)


@dataclass(frozen=True)
class RankView:
    """The pre-reduction figures of one collect (host side), in group order.

    Attributes:
        per_rank: ``[rank][group]`` each rank's local squared norm of the group before the
            reduction (NaN/Inf as measured); None in bounded mode (more than
            :data:`~gradwatch.reduce.layout.RANK_SLOTS_MAX_WORLD` ranks).
        finite_sums: per group, the sum over ranks of the finite local squares.
        nonfinite_ranks: per group, how many ranks' local squares were NaN/Inf.
        nonfinite_count: how many ranks had some non-finite local square.
        nonfinite_rank: bounded mode: the one non-finite rank when ``nonfinite_count`` is 1
            (the sum of the ids of non-finite ranks); slot mode: None (see ``per_rank``).
        replica_groups, hosts: from the layout handshake.
    """

    per_rank: tuple[tuple[float, ...], ...] | None
    finite_sums: tuple[float, ...]
    nonfinite_ranks: tuple[int, ...]
    nonfinite_count: int
    nonfinite_rank: int | None
    replica_groups: tuple[tuple[int, ...], ...]
    hosts: tuple[str, ...]

    @classmethod
    def from_section(cls, values: list[float], layout: Layout) -> RankView | None:
        """The view from its section of the host copy; None when there is no section or some
        rank did not report (no hook ran there since its last collect)."""
        g, world = layout.rank_view_groups, layout.world_size
        if g == 0:
            return None
        if layout.rank_view_slots:
            slots = [values[r * (g + 1) : (r + 1) * (g + 1)] for r in range(world)]
            if any(s[g] != 1.0 for s in slots):
                return None
            per_rank = tuple(tuple(s[:g]) for s in slots)
            bad = [[not math.isfinite(x) for x in row] for row in per_rank]
            return cls(
                per_rank=per_rank,
                finite_sums=tuple(
                    math.fsum(row[k] for row, b in zip(per_rank, bad, strict=True) if not b[k])
                    for k in range(g)
                ),
                nonfinite_ranks=tuple(sum(b[k] for b in bad) for k in range(g)),
                nonfinite_count=sum(any(b) for b in bad),
                nonfinite_rank=None,
                replica_groups=layout.replica_groups,
                hosts=layout.hosts,
            )
        if values[2 * g + 2] != world:
            return None
        count = int(values[2 * g])
        return cls(
            per_rank=None,
            finite_sums=tuple(values[:g]),
            nonfinite_ranks=tuple(int(x) for x in values[g : 2 * g]),
            nonfinite_count=count,
            nonfinite_rank=int(values[2 * g + 1]) if count == 1 else None,
            replica_groups=layout.replica_groups,
            hosts=layout.hosts,
        )
