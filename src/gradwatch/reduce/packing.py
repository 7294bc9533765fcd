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
(:mod:`gradwatch.reduce.ranktiming`). It rides only on collects that all-reduce anyway (a
collect that issues nothing leaves it empty and the rank's window keeps growing): it never
makes a collect all-reduce.

**Reading it.** Only this module and :mod:`gradwatch.reduce.reduced` know those offsets (which
:mod:`gradwatch.reduce.sections` defines: :class:`~gradwatch.reduce.sections.Sections`). The rest
of gradwatch reads a :class:`~gradwatch.reduce.reduced.ReducedVector` through named views:
:meth:`~gradwatch.reduce.reduced.ReducedVector.stats` (host side, a
:class:`~gradwatch.reduce.reduced.ReducedStats` of Python floats, for the summary) and its
``device_bands`` / ``device_nonfinite`` (device side, for clipping without a host read).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradwatch.errors import (
    GradWatchTimeoutError,
    LayoutMismatchError,
    UnsupportedParallelismError,
)
from gradwatch.norms.rows import SegmentReduction, host_to_device
from gradwatch.norms.updates import Section
from gradwatch.reduce import handshake
from gradwatch.reduce.collective import (
    Collective,
    Pending,
    bound_device,
    reducer_device,
)
from gradwatch.reduce.layout import Layout, LocalPiece, derive_layout
from gradwatch.reduce.ranktiming import WorkSource, pack_timing
from gradwatch.reduce.reduced import ReducedVector
from gradwatch.reduce.sections import sections
from gradwatch.reduce.steps import step_residues

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


def pack_rank_view(view: Tensor, layout: Layout, rank_local: Tensor, zero: Tensor) -> None:
    """Write this rank's pre-reduction group squares ``rank_local`` (``G`` float64, NaN/Inf as
    measured) into its slot of the rank view's section ``view``, with its "reported" flag; a
    rank whose hook did not run since the last collect writes nothing (zeros: the view is
    absent for the step). ``zero``: a 0-dim float64 zero on the vector's device. A constant
    number of ops."""
    g = layout.rank_view_groups
    local = rank_local.to(device=view.device, dtype=torch.float64)
    if layout.rank_view_slots:
        start = layout.rank * (g + 1)
        view[start : start + g].copy_(local)
        view[start + g].fill_(1.0)
        return
    bad = ~torch.isfinite(local)
    torch.where(bad, zero, local, out=view[:g])
    view[g : 2 * g].copy_(bad)
    any_bad = bad.any()
    view[2 * g].copy_(any_bad)
    view[2 * g + 1].copy_(any_bad * float(layout.rank))
    view[2 * g + 2].fill_(1.0)


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
        # Persistent staging vector [3 bands | non-finite flags | has-grad | step, residues | 0],
        # filled by out= ops; the fresh packed vector is one index_select of it (every slot the
        # staging does not fill reads the trailing zero).
        self._n_local = n_local
        self._staging = torch.zeros(5 * n_local + 4, dtype=torch.float64, device=dev)
        self._staged_squares = self._staging[: 3 * n_local]
        self._staged_plain = self._staging[:n_local]
        self._staged_flags = self._staging[3 * n_local : 4 * n_local]
        self._staged_has_grad = self._staging[4 * n_local : 5 * n_local]
        self._staged_step, self._staged_residue, self._staged_residue_sq = (
            self._staging[5 * n_local + k : 5 * n_local + k + 1] for k in range(3))
        self._host_tail = host_view(self._staging[5 * n_local : 5 * n_local + 3])
        # has-gradient patterns already on the device (which gradients are None changes rarely:
        # unused parameters, MoE experts); a new one costs one non-blocking copy, never a sync.
        self._has_grad_flags: dict[tuple[bool, ...], Tensor] = {}
        self._has_grad_seen: list[bool] | None = None  # the pattern staged last
        self._contributes = contrib.repeat(3).to(dev)
        self._all_contribute = all(lay.contributes)  # one process, or each rank its own pieces
        self._zero = torch.zeros((), dtype=torch.float64, device=dev)
        starts = (at.squares, at.squares_high, at.squares_low, at.nonfinite, at.has_grad)
        scatter = torch.cat([*(to_global + part.start for part in starts),
                             torch.tensor([at.step, at.residues.start, at.residues.start + 1])])
        self._gather = gather_index(scatter, lay.packed_length, 5 * n_local + 3).to(dev)
        self._slot_sums, self._slot_global = replica_slot_sums(lay, at.replicas.start, dev)
        self._host_packing = HostPacking.of(self._gather, n_local, dev)
        self.packs_on_host = self._host_packing is not None  # an update section as floats too

    def pack_and_reduce(
        self,
        sq_local: Tensor,
        has_grad: Sequence[bool],
        step: int,
        with_replicas: bool,
        rank_local: Tensor | None = None,
        device_collective: bool = True,
        updates: Section | None = None,
        work: WorkSource | None = None,
    ) -> ReducedVector:
        """Fill the packed vector from this rank's ``sq_local`` (the engine's banded float64
        squared norms: three entries per local piece, see :mod:`gradwatch.norms.stats`) and
        ``has_grad`` (one bool per local piece), and issue the all-reduce
        (asynchronously where the backend allows). Never waits on gloo.
        ``device_collective=False`` (a collect that does not clip): on backends of
        :data:`MONITOR_ON_HOST_BACKENDS` the all-reduce runs on the host gloo group instead,
        issued from a background thread.

        A constant number of ops (about 6), whatever the number of parameters: pieces this rank
        does not count (replicated copies owned by another rank) are zeroed by ``where`` (not
        multiplied: a NaN times 0 is NaN), and ``sq - sq`` is 0 where finite and NaN where NaN
        or Inf, which gives the non-finite flags in two ops. ``work``: this rank's working-time
        window (rank timing), drained into the timing section only when this collect
        all-reduces.
        """
        lay = self.layout
        alone = not self.issues_collective(with_replicas)
        if self._host_packing is not None and not device_collective and host_packs(
                lay, alone, sq_local, with_replicas and self._slot_sums is not None,
                rank_local, updates, work):
            return self._host_packing.reduce(self, sq_local, has_grad, step, alone, updates)
        sq_local = sq_local.to(self.device)
        if alone or self._all_contribute:  # every piece counts: the where would copy
            self._staged_squares.copy_(sq_local)
            plain = self._staged_plain  # that copy's plain band: a persistent view
        else:
            torch.where(self._contributes, sq_local, self._zero, out=self._staged_squares)
            plain = sq_local[: self._n_local]
        # NaN/Inf only ever sit in the plain band
        torch.sub(plain, plain, out=self._staged_flags).nan_to_num_(nan=1.0)
        self._stage_tail(has_grad, step)
        packed = self._staging.index_select(0, self._gather)  # a fresh vector, zeros elsewhere
        if with_replicas and self._slot_sums is not None:
            packed.index_copy_(0, self._slot_global, self._slot_sums(sq_local))
        if lay.rank_view_groups and rank_local is not None:
            pack_rank_view(packed[sections(lay).rank_view], lay, rank_local, self._zero)
        if updates is not None:  # a tensor, or a CPU meter's floats host_packs declined
            packed[sections(lay).updates].copy_(torch.as_tensor(updates, dtype=torch.float64))
        if lay.rank_timing and work is not None and not alone:
            pack_timing(packed[sections(lay).rank_timing], lay.rank, work.drain())
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
            or lay.rank_view_groups > 0
        )

    def _stage_tail(self, has_grad: Sequence[bool], step: int) -> None:
        """Write the has-gradient flags and the step into the staging vector by device-side
        ops only: the step by ``fill_`` (a kernel argument, no host memory), the flags from a
        persistent device tensor per pattern. A pattern seen for the first time is built on the
        host and sent by one ``non_blocking`` copy from pinned memory (the caching host
        allocator keeps that memory alive until the copy ran); a repeated pattern costs nothing,
        the current one not even a copy. ``torch.tensor(list)`` copied into a CUDA vector would
        be a blocking copy from pageable memory: the host would wait for the whole backward."""
        seen = has_grad if type(has_grad) is list else list(has_grad)
        if seen != self._has_grad_seen:  # lists compare in C without building a key
            key = tuple(seen)
            flags = self._has_grad_flags.get(key)
            if flags is None:
                flags = host_to_device(key, torch.float64, self.device)
                if len(self._has_grad_flags) >= _FLAG_PATTERNS:
                    self._has_grad_flags.pop(next(iter(self._has_grad_flags)))
                self._has_grad_flags[key] = flags
            self._staged_has_grad.copy_(flags)
            self._has_grad_seen = list(seen)  # a copy: the caller may reuse its list
        residue, square = step_residues(step)
        host = self._host_tail
        if host is not None:
            host[0], host[1], host[2] = float(step), residue, square
            return
        self._staged_step.fill_(float(step))
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


def replica_slot_sums(lay: Layout, start: int,
                      device: torch.device) -> tuple[SegmentReduction | None, Tensor]:
    """What a divergence step writes at the replica slots (from ``start``): each slot's sum
    of this rank's pieces, in a fixed order (``index_add_`` adds by atomics on CUDA: replicas
    with equal gradients could sum to different bits), and the slots' positions, written by
    one ``index_copy_`` (distinct slots). None: the layout has no slot."""
    slots = sorted({s for s in lay.replica_slot if s >= 0})
    members = [[i for i, s in enumerate(lay.replica_slot) if s == k] for k in slots]
    sums = SegmentReduction(members, 3 * len(lay.local_to_global), device) if slots else None
    return sums, (torch.tensor(slots, dtype=torch.long) + start).to(device)


#: Local pieces up to which a CPU collect whose all-reduce changes nothing packs its vector
#: as Python floats (:class:`HostPacking`); above, tensor ops cost less than a float a slot.
HOST_PACK_PIECES = 64


def host_packs(lay: Layout, alone: bool, sq_local: Tensor, replica_sums: bool,
               rank_local: Tensor | None, updates: Section | None,
               work: WorkSource | None) -> bool:
    """Does a collect that clips nothing and is not guarded (no device view read at once)
    pack on the host (:class:`HostPacking`)? When no all-reduce changes its vector (none is
    issued, ``alone``, or one process: no group), its squares are on the CPU and it writes no
    section past the step's but an update section given as floats: no replica sums, rank
    view, update section as a tensor or rank timing."""
    return ((alone or lay.world_size == 1) and sq_local.device.type == "cpu"
            and not replica_sums and not isinstance(updates, Tensor)
            and not (lay.rank_view_groups and rank_local is not None)
            and not (lay.rank_timing and work is not None and not alone))


class HostPacking:
    """The packed vector of a collect whose all-reduce changes nothing (:func:`host_packs`),
    on the CPU, as Python floats: what :meth:`Reducer.pack_and_reduce` stages and gathers by
    about six tensor ops (each a microsecond's dispatch on a few dozen floats), the same
    values by the same rules, read from the engine's vector once (a CPU tensor: no sync).
    ``gather``: the staging vector's gather index (:func:`gather_index`), ``n_local``: the
    local pieces.

    Same bits, slot by slot: the squares are copied; a flag is ``x - x`` of the plain square
    (+0.0 where finite, NaN where NaN or Inf: IEEE's subtraction rounding to nearest, in C or
    in Python) with NaN made 1.0 (``nan_to_num_(nan=1.0)``; ``x - x`` is never infinite),
    so 0.0 exactly where ``x - x == 0``, else 1.0; the has-gradient flags
    are 1.0 or 0.0; the step and its residues as the staging's tail writes them; every other
    slot reads the staging's trailing zero."""

    __slots__ = ("_flags", "_gather", "_n_local", "_seen")

    def __init__(self, gather: Tensor, n_local: int) -> None:
        self._gather = operator.itemgetter(*gather.tolist())
        self._n_local = n_local
        self._seen: list[bool] | None = None  # the has-gradient pattern of ``_flags``
        self._flags: list[float] = []

    @classmethod
    def of(cls, gather: Tensor, n_local: int, device: torch.device) -> HostPacking | None:
        """The host packing of a CPU vector of at most :data:`HOST_PACK_PIECES` pieces."""
        if device.type != "cpu" or n_local > HOST_PACK_PIECES:
            return None
        return cls(gather, n_local)

    def values(self, sq_local: Tensor, has_grad: Sequence[bool], step: int) -> list[float]:
        """The packed vector of ``sq_local`` (the engine's banded squares on the CPU),
        ``has_grad`` and ``step``, as floats."""
        staged = sq_local.tolist()
        # x - x is +0.0 for every finite x (round to nearest), NaN otherwise
        staged += [0.0 if x - x == 0.0 else 1.0 for x in staged[: self._n_local]]
        seen = has_grad if type(has_grad) is list else list(has_grad)
        if seen != self._seen:  # the pattern changes rarely: its floats are kept
            self._flags = [1.0 if g else 0.0 for g in seen]
            self._seen = list(seen)  # a copy: the caller may reuse its list
        staged += self._flags
        residue, square = step_residues(step)
        staged += (float(step), residue, square, 0.0)
        return list(self._gather(staged))

    def reduce(self, reducer: Reducer, sq_local: Tensor, has_grad: Sequence[bool], step: int,
               alone: bool, updates: list[float] | None = None) -> ReducedVector:
        """The :class:`ReducedVector` ``reducer`` returns for this collect, its vector packed
        here: as the tensor route's, ``ranks`` 1 when ``alone``; else (one process) counted
        as an issued all-reduce, as :meth:`Collective.issue` counts one without a group.
        ``updates``: the update section's floats, written at its slots."""
        values = self.values(sq_local, has_grad, step)
        lay = reducer.layout
        if updates is not None:
            at = sections(lay).updates
            if len(updates) != at.stop - at.start:  # a slice assignment would shift the rest
                raise ValueError(f"update section of {len(updates)} values for a layout of "
                                 f"{at.stop - at.start}")
            values[at] = updates
        if alone:
            return ReducedVector.of_values(values, reducer.timeout, step, lay, ranks=1)
        reducer.collective.issued += 1
        return ReducedVector.of_values(values, reducer.timeout, step, lay,
                                       device_timeout=reducer.collective.group_timeout)


def gather_index(scatter: Tensor, length: int, zero_slot: int) -> Tensor:
    """The index that reads a vector of ``length`` from a staging vector whose element ``k``
    goes to position ``scatter[k]`` (distinct positions): every other position reads
    ``zero_slot``, a staging element that always holds 0."""
    gather = torch.full((length,), zero_slot, dtype=torch.long)
    gather[scatter] = torch.arange(len(scatter))
    return gather


def host_view(t: Tensor) -> Any:
    """A NumPy view of ``t``'s memory when it is on the CPU (None elsewhere): a few scalars
    written per collect become plain stores instead of dispatched ``fill_`` ops."""
    return t.numpy() if t.device.type == "cpu" else None
