"""Distributed combination: one agreed layout, at most one packed float64 all-reduce per collect.

**Per collect.** Each rank fills one float64 vector of length ``5N + R + 1``:
``[sq contributions (N) | high band (N) | low band (N) | non-finite flags (N) | has-gradient
flags (N) | replica sums (R) | step]``. The three squared-norm sections are the engine's bands
(:mod:`gradwatch.norms.stats`: a float64 squared norm outside float64's range travels scaled in the
high or low band), so sums of pieces stay exact whatever their magnitudes.
and all-reduces it once with SUM over gradwatch's own process group (created at construction
with ``collective_timeout_seconds``). Non-finite and has-gradient flags are *not* masked, so a
NaN on any replica is seen even though its squared norm is not counted. The replica slots hold,
for each piece with the maximal number of holders R, its squared norm at the slot of the holder's
position (at most ``layout.MAX_REPLICA_SLOTS`` slots: the lowest-ranked holders): identical
replicas give identical slot sums, and their relative spread is the replica divergence (filled
on divergence steps only). The step slot detects ranks that collected different steps.
Payload: O(parameters), never O(elements); never bf16/fp16. Replica sums compare plain-band
squares only (norms within [2^-450, 2^450]).

**Collects without the all-reduce.** When every rank holds every parameter whole and DDP
all-reduced their gradients over the world (:attr:`Layout.replicated_synced`, agreed in the
handshake), every rank's gradients are already the reduced ones: the all-reduce would only
repeat DDP's. Such a collect packs *every* piece (no contributor mask: this rank's vector is
the whole model's) and issues nothing (:meth:`Reducer.issues_collective`); divergence steps and
the rank view still all-reduce, and they carry the step check.

**The rank view** (when every rank declares ``rank_view_groups=G > 0`` in the handshake:
its DDP comm hook measures, see :mod:`gradwatch.stacks.ddp_hook`): after the step slot, each
rank's pre-reduction figures (from :mod:`gradwatch.stacks.ddp_hook`) in its own slot: ``G`` local
squared norms (one per group) and a "reported" flag, ``W x (G + 1)`` float64 in all; every
other rank adds zeros there, so the SUM leaves each slot exactly as its rank wrote it (a NaN
or Inf stays in its rank's slot). Above :data:`~gradwatch.reduce.layout.RANK_SLOTS_MAX_WORLD` ranks
the slots are replaced by bounded sums (``2G + 3``: finite local squares per group, non-finite
ranks per
group, the count and the sum of the ids of non-finite ranks, the count of reporting ranks):
never a second collective.

**The update section** (``update_stats=True``, agreed through the layout hash): after the rank
view, ``4G + 2`` float64 (:func:`~gradwatch.norms.updates.section_width`): per group the
weights' and the last optimizer step's update's squared norms, stalled and moving elements,
each rank adding the pieces it counts (:class:`gradwatch.norms.updates.UpdateMeter`), then the
ranks that could not measure the update and those without a previous collect. Summed like the
rest: no second collective.
**The rank timing** (``WatchConfig.rank_timing``): last, ``TIMING_WIDTH`` float64 whatever the
world size, each rank's working time as one entry in a SUM-able histogram
(:mod:`gradwatch.step.ranktiming`); it makes every collect all-reduce.

**Reading it.** Only this module and :mod:`gradwatch.reduce.layout` (which defines them:
:class:`~gradwatch.reduce.layout.Sections`) know those offsets. The rest of gradwatch reads a
:class:`ReducedVector` through named views: :meth:`ReducedVector.stats` (host side, a
:class:`ReducedStats` of Python floats, for the summary) and :meth:`ReducedVector.device_bands`
/ :meth:`ReducedVector.device_nonfinite` (device side, for clipping without a host read).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradwatch.errors import (
    GradWatchError,
    GradWatchTimeoutError,
    LayoutMismatchError,
    UnsupportedParallelismError,
)
from gradwatch.norms.rows import SegmentReduction, host_to_device
from gradwatch.reduce import handshake
from gradwatch.reduce.collective import (
    Collective,
    CollectiveTimeout,
    Pending,
    StandIn,
    bound_device,
    landed,
    record_event,
    reducer_device,
    wait_landed,
)
from gradwatch.reduce.layout import Layout, LocalPiece, derive_layout, sections
from gradwatch.reduce.ranktiming import RankTiming, pack_timing
from gradwatch.reduce.steps import device_step, step_residues, steps_differ

log = logging.getLogger("gradwatch")


#: has-gradient patterns kept on the device (oldest dropped first).
_FLAG_PATTERNS = 16


def gradient_device(tensors: Sequence[Tensor]) -> torch.device | None:
    """The accelerator the parameters live on (the first one not on the CPU or ``meta``), or
    None when they are all on the CPU: what the reducer's device follows."""
    for t in tensors:
        if t.device.type not in ("cpu", "meta"):
            return t.device
    return None


class Reducer:
    """Packs local squared norms into the agreed vector and all-reduces it once.

    Single-process (or no initialized process group): no collective, same packing.
    Thread-safety: :meth:`pack_and_reduce` runs on the training thread (it issues the
    collective); the returned :class:`ReducedVector` may be waited on from another thread.
    """

    def __init__(
        self,
        pieces: Sequence[LocalPiece],
        *,
        version: str,
        config_hash: str,
        timeout_seconds: float,
        stage_group: Any = None,
        rank_view_groups: int = 0,
        synced: bool = False,
        device: torch.device | None = None,
        experts: Sequence[str] = (),
        update_groups: int = 0,
        rank_timing: bool = False,
    ) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.timeout = timeout_seconds
        self.collective = Collective()
        self.unchecked: ReducedVector | None = None  # see Failures.check_steps
        # Set on every rank by the optimizer-step guard: every collect all-reduces, so the
        # guard decides from inputs the ranks agreed on (issues_collective).
        self.guarded = False
        multi = self.distributed and dist.get_world_size() > 1
        stage_ranks = None
        if multi and stage_group is not None:
            stage_ranks = dist.get_process_group_ranks(stage_group)
        desc, record = handshake.describe(
            pieces, version=version, config_hash=config_hash, stage_ranks=stage_ranks,
            rank_view=rank_view_groups, synced=synced,
        )
        backend = str(dist.get_backend()) if multi else None
        self._backend = backend
        self._bound = bound_device() if multi else None
        self.device = reducer_device(device, backend, self._bound)
        if multi:
            self.layout = self._agree(desc, record, pieces, str(backend), experts, rank_timing)
        else:
            self.layout = derive_layout(handshake.local(desc, record), 0)
        # Every rank has the same update section: update_stats is in the layout hash the
        # handshake compared, and the groups come from the same configuration.
        self.layout = dataclasses.replace(self.layout, update_groups=update_groups)
        if rank_timing:  # every rank alike: the configuration hash covers it
            self.layout = dataclasses.replace(self.layout, rank_timing=True)
        self._plan_packing(self.layout)

    def _agree(
        self,
        desc: handshake.Description,
        record: handshake.RankRecord,
        pieces: Sequence[LocalPiece],
        backend: str,
        experts: Sequence[str] = (),
        hosts: bool = False,
    ) -> Layout:
        """Open gradwatch's groups, run the handshake on them and derive the layout: the same
        on every rank, or the same error raised on every rank."""
        try:
            self.collective = Collective.open(self.timeout, backend, self.device)
            # The handshake runs once, on the host group when there is one (CPU tensors), on
            # the device NCCL needs otherwise.
            on_device = "nccl" in backend and self.collective.host_group is None
            handshake_device = self.device if on_device else torch.device("cpu")
            self.collective.handshake_device = handshake_device
            gathered = handshake.exchange(desc, record, self.collective.handshake_group,
                                          handshake_device, meshes=handshake.mesh_slots(pieces),
                                          gather_hosts=hosts)
            self.collective.settle()
        except RuntimeError as exc:
            self.close()
            raise GradWatchTimeoutError(
                f"gradwatch: construction handshake failed or timed out after "
                f"{self.timeout}s: every rank must construct GradWatch ({exc})"
            ) from exc
        try:
            return derive_layout(gathered, dist.get_rank(), experts)
        except (LayoutMismatchError, UnsupportedParallelismError):
            self.close()  # every rank raises the same error: release the group everywhere
            raise

    def follow(self, gradients: torch.device | None) -> bool:
        """Move the packed vector to where the gradients are now (``GradWatch(model)`` then
        ``model.cuda()`` keeps the same Parameters on another device), by the rule of
        :func:`~gradwatch.reduce.collective.reducer_device`; True when it moved. Every rank's
        gradients move alike, so the vector's route stays the same on every rank. The move
        rebuilds the packing's index tensors once (a host copy then, never per collect); a move
        to an accelerator on a backend that opened no host group (gloo) opens one
        (:meth:`Collective.open_host_route`), so collects keep off the training thread."""
        wanted = reducer_device(gradients, self._backend, self._bound)
        if wanted == self.device:
            return False
        log.info("gradwatch: the gradients moved; the packed vector follows them to %s", wanted)
        self.device = wanted
        self._plan_packing(self.layout)
        if wanted.type != "cpu" and self.collective.open_host_route():
            log.info(
                "gradwatch: the vector moved to %s after construction on %s: monitoring "
                "collects now all-reduce a host copy on their own gloo group (constructing "
                "GradWatch after moving the model avoids this new group)", wanted, self._backend,
            )
        return True

    @property
    def issued(self) -> int:
        """All-reduces issued: tells whether a failed collect issued its own."""
        return self.collective.issued

    @property
    def group(self) -> Any:
        return self.collective.group

    @property
    def host_group(self) -> Any:
        """The gloo group of the monitoring-only collects (None: they take ``group``)."""
        return self.collective.host_group

    def _plan_packing(self, lay: Layout) -> None:
        """The persistent buffers and indices that pack a collect in a constant number of
        ops."""
        to_global = torch.tensor(lay.local_to_global, dtype=torch.long)
        contrib = torch.tensor(lay.contributes, dtype=torch.bool)
        at = sections(lay)
        dev = self.device
        n_local = len(lay.local_to_global)
        # Persistent staging vector [3 bands | non-finite flags | has-grad | step, residues],
        # filled by out= ops and scattered into the fresh packed vector by one index_copy_.
        self._n_local = n_local
        self._staging = torch.zeros(5 * n_local + 3, dtype=torch.float64, device=dev)
        self._staged_squares = self._staging[: 3 * n_local]
        self._staged_flags = self._staging[3 * n_local : 4 * n_local]
        self._staged_has_grad = self._staging[4 * n_local : 5 * n_local]
        self._staged_step, self._staged_residue, self._staged_residue_sq = (
            self._staging[5 * n_local + k : 5 * n_local + k + 1] for k in range(3))
        # has-gradient patterns already on the device (which gradients are None changes rarely:
        # unused parameters, MoE experts); a new one costs one non-blocking copy, never a sync.
        self._has_grad_flags: dict[tuple[bool, ...], Tensor] = {}
        self._has_grad_key: tuple[bool, ...] | None = None
        self._contributes = contrib.repeat(3).to(dev)
        self._zero = torch.zeros((), dtype=torch.float64, device=dev)
        self._scatter = torch.cat(
            [
                to_global + at.squares.start,
                to_global + at.squares_high.start,
                to_global + at.squares_low.start,
                to_global + at.nonfinite.start,
                to_global + at.has_grad.start,
                torch.tensor([at.step, at.residues.start, at.residues.start + 1]),
            ]
        ).to(dev)
        # Divergence steps: each replica slot's sum of this rank's pieces, in a fixed order
        # (index_add_ adds by atomics on CUDA: replicas with equal gradients could sum to
        # different bits), written by one index_copy_ (distinct slots).
        slots = sorted({s for s in lay.replica_slot if s >= 0})
        members = [[i for i, s in enumerate(lay.replica_slot) if s == k] for k in slots]
        self._slot_sums = SegmentReduction(members, 3 * n_local, dev) if slots else None
        self._slot_global = (torch.tensor(slots, dtype=torch.long) + at.replicas.start).to(dev)

    def _pack_rank_view(self, packed: Tensor, rank_local: Tensor | None) -> None:
        """Write this rank's pre-reduction group squares (``G`` float64, NaN/Inf as measured)
        into its slot, with its "reported" flag; ``None`` (no hook ran since the last collect)
        leaves zeros, so the view is absent for the step. A constant number of ops."""
        lay = self.layout
        g = lay.rank_view_groups
        if g == 0 or rank_local is None:
            return
        view = packed[sections(lay).rank_view]
        local = rank_local.to(device=packed.device, dtype=torch.float64)
        if lay.rank_view_slots:
            start = lay.rank * (g + 1)
            view[start : start + g].copy_(local)
            view[start + g].fill_(1.0)
            return
        bad = ~torch.isfinite(local)
        torch.where(bad, self._zero, local, out=view[:g])
        view[g : 2 * g].copy_(bad)
        any_bad = bad.any()
        view[2 * g].copy_(any_bad)
        view[2 * g + 1].copy_(any_bad * float(lay.rank))
        view[2 * g + 2].fill_(1.0)

    def pack_and_reduce(
        self,
        sq_local: Tensor,
        has_grad: Sequence[bool],
        step: int,
        with_replicas: bool,
        rank_local: Tensor | None = None,
        device_collective: bool = True,
        updates: Tensor | None = None,
        work_seconds: float | None = None,
    ) -> ReducedVector:
        """Fill the packed vector from this rank's ``sq_local`` (the engine's banded float64
        squared norms: three entries per local piece, see :mod:`gradwatch.norms.stats`) and
        ``has_grad`` (one bool per local piece), and issue the all-reduce
        (asynchronously where the backend allows). Never waits on gloo.
        ``device_collective=False`` (a collect that does not clip): on backends of
        :data:`MONITOR_ON_HOST_BACKENDS` the all-reduce runs on the host gloo group instead,
        issued from a background thread.

        A constant number of ops (about 7), whatever the number of parameters: pieces this rank
        does not count (replicated copies owned by another rank) are zeroed by ``where`` (not
        multiplied: a NaN times 0 is NaN), and ``sq - sq`` is 0 where finite and NaN where NaN
        or Inf, which gives the non-finite flags in two ops.
        """
        lay = self.layout
        packed = torch.zeros(lay.packed_length, dtype=torch.float64, device=self.device)
        sq_local = sq_local.to(self.device)
        alone = not self.issues_collective(with_replicas)
        if alone:  # this rank's vector is the whole model's: every piece counts
            self._staged_squares.copy_(sq_local)
        else:
            torch.where(self._contributes, sq_local, self._zero, out=self._staged_squares)
        plain = sq_local[: self._n_local]  # NaN/Inf only ever sit in the plain band
        torch.sub(plain, plain, out=self._staged_flags).nan_to_num_(nan=1.0)
        self._stage_tail(has_grad, step)
        packed.index_copy_(0, self._scatter, self._staging)
        if with_replicas and self._slot_sums is not None:
            packed.index_copy_(0, self._slot_global, self._slot_sums(sq_local))
        self._pack_rank_view(packed, rank_local)
        if updates is not None:
            packed[sections(lay).updates].copy_(updates)
        if lay.rank_timing:
            pack_timing(packed[sections(lay).rank_timing], lay.rank, work_seconds)
        if alone:
            return ReducedVector(packed, Pending(), self.timeout, step, lay, ranks=1)
        return self._issue(packed, step, on_host=not device_collective)

    def issues_collective(self, with_replicas: bool) -> bool:
        """Does a collect all-reduce? Always, except when every rank holds every parameter
        whole and DDP already all-reduced their gradients (:attr:`Layout.replicated_synced`),
        the rank view is off and no guard acts on the steps (:attr:`guarded`): then only on
        divergence steps (``with_replicas``), which also check that the ranks collected the
        same step. Identical on every rank.

        Why a guard needs the all-reduce: a gradient that changes on one rank after DDP's
        reduction (a post-backward hook, a custom reduction, corrupted memory) would make that
        rank's own figures differ from the others', and a decision taken from them would
        split the replicas. The one all-reduce of the packed vector is the smallest collective
        that agrees the decision *and* what is published (the non-finite parameters, the
        norm): a NaN on one rank is every rank's non-finite step."""
        lay = self.layout
        return (
            with_replicas or self.guarded or not lay.replicated_synced
            or lay.rank_view_groups > 0 or lay.rank_timing
        )

    def _stage_tail(self, has_grad: Sequence[bool], step: int) -> None:
        """Write the has-gradient flags and the step into the staging vector by device-side
        ops only: the step by ``fill_`` (a kernel argument, no host memory), the flags from a
        persistent device tensor per pattern. A pattern seen for the first time is built on the
        host and sent by one ``non_blocking`` copy from pinned memory (the caching host
        allocator keeps that memory alive until the copy ran); a repeated pattern costs nothing,
        the current one not even a copy. ``torch.tensor(list)`` copied into a CUDA vector would
        be a blocking copy from pageable memory: the host would wait for the whole backward."""
        key = tuple(has_grad)
        if key != self._has_grad_key:
            flags = self._has_grad_flags.get(key)
            if flags is None:
                flags = host_to_device(key, torch.float64, self.device)
                if len(self._has_grad_flags) >= _FLAG_PATTERNS:
                    self._has_grad_flags.pop(next(iter(self._has_grad_flags)))
                self._has_grad_flags[key] = flags
            self._staged_has_grad.copy_(flags)
            self._has_grad_key = key
        self._staged_step.fill_(float(step))
        residue, square = step_residues(step)
        self._staged_residue.fill_(residue)
        self._staged_residue_sq.fill_(square)

    def reduce_failed(
        self,
        step: int,
        device_collective: bool = True,
        with_replicas: bool = False,
        marker: float = math.nan,
    ) -> ReducedVector:
        """Issue this collect's all-reduce for a rank whose local pass failed: zeros but a NaN
        step slot, so the ranks' collective sequences stay aligned and every rank's
        :meth:`ReducedStats.failed_rank` is True for this step (nothing is published).
        ``device_collective``: the route the failed collect would have taken (a clip's is the
        job's backend, a monitoring collect's the host group), so the sequences match. A
        collect that would not have all-reduced (:meth:`issues_collective`) issues nothing:
        the other ranks measured the same gradients alone. ``marker``: the step slot's value,
        NaN for a failed pass, ``-inf`` for a closed watcher (:attr:`ReducedStats.closed_rank`);
        written by ``fill_`` (a kernel argument: no blocking copy on an accelerator). Built on
        the host when it goes by the host route: its values are known, so no device copy has
        to land before the host all-reduce."""
        on_host = not device_collective and self.collective.host_group is not None
        device = torch.device("cpu") if on_host else self.device
        packed = torch.zeros(self.layout.packed_length, dtype=torch.float64, device=device)
        at = sections(self.layout)  # the step's residues too: its agreement stays readable
        for offset, value in enumerate((marker, *step_residues(step))):
            packed.narrow(0, at.step + offset, 1).fill_(value)
        if not self.issues_collective(with_replicas):
            return ReducedVector(packed, Pending(), self.timeout, step, self.layout, ranks=1)
        return self._issue(packed, step, on_host=not device_collective)

    def _issue(self, packed: Tensor, step: int, on_host: bool = False) -> ReducedVector:
        result, pending = self.collective.issue(packed, on_host=on_host)
        reduced = ReducedVector(result, pending, self.timeout, step, self.layout,
                                device_timeout=self.collective.group_timeout)
        if self.layout.world_size > 1:
            self.unchecked = reduced
        return reduced

    def close(self, drain: bool = True) -> None:
        """Stop using gradwatch's process groups (see :meth:`Collective.close`)."""
        self.collective.close(drain)


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
            collect skipped the all-reduce (:meth:`Reducer.issues_collective`).
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
        at = sections(layout)
        if len(values) != at.length:
            raise ValueError(
                f"gradwatch: a packed vector of {len(values)} values, expected {at.length}"
            )
        return cls(
            squares=values[at.squares],
            squares_high=values[at.squares_high],
            squares_low=values[at.squares_low],
            nonfinite=values[at.nonfinite],
            has_grad=values[at.has_grad],
            replica_squares=values[at.replicas],
            step_check=values[at.step],
            step_residues=(values[at.residues.start], values[at.residues.start + 1]),
            world_size=layout.world_size,
            rank_view=RankView.from_section(values[at.rank_view], layout),
            ranks=layout.world_size if ranks is None else ranks,
            updates=values[at.updates] if layout.update_groups else None,
            rank_timing=RankTiming.from_section(values[at.rank_timing], layout.world_size)
            if layout.rank_timing else None,
        )

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
        """Some rank's local pass failed this collect (:meth:`Reducer.reduce_failed`): the
        vector holds no measurement."""
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
        if packed.device.type != "cpu":
            # NCCL: make the compute stream wait for the collective (no host wait), then start
            # a non-blocking copy to pinned memory; stats() waits on the event, once.
            pending.order_on_stream()
            # CUDA path, untested on this project's CPU machines. The event is recorded on the
            # stream of the vector's own device (Event.record() alone uses the *current*
            # device's stream, which may be another GPU's).
            self._pinned = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._pinned.copy_(packed, non_blocking=True)
            self._landed = landed(record_event(packed.device))

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
        return self._packed

    def device_bands(self) -> Tensor:
        """The reduced squared norms as the engine's three bands (``3N``: plain, high, low;
        see :mod:`gradwatch.norms.stats`), on the device (a view: no copy)."""
        return self._device()[sections(self._layout).bands]

    def device_unmeasured(self) -> Tensor:
        """A 0-dim bool on the device: some rank stood in for this collect (its step slot is
        NaN or ``-inf``, see :meth:`Reducer.reduce_failed`) or the ranks collected different
        steps (:func:`~gradwatch.reduce.steps.steps_differ`): the vector holds no measurement, and
        every rank reading it knows so without a host read."""
        return ~torch.isfinite(self.device_step())

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
            if self._packed.device.type != "cpu":
                self._wait_landed(self._timeout)
                values = self._pinned.tolist()
            else:
                self._wait_collective()
                values = self._packed.tolist()
            self._stats = ReducedStats.from_values(values, self._layout, self._ranks)
        return self._stats


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
