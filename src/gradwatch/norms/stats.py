"""Local (per-rank) gradient math: exact squared L2 norms of many tensors, batched.

Given the gradients a rank holds (plain tensors, or the local shards of DTensors),
:class:`NormEngine` returns one float64 vector of their squared norms in three bands
(:mod:`gradwatch.norms.bands`), computed without a float64 copy of any gradient and with a number of
dispatched ops that does not grow with the number of tensors of up to :data:`WHOLE_NUMEL`
elements (two per fill of the pack buffer, :data:`PACK_NUMEL` elements; each larger tensor
costs two ops: a view and a norm). Per (device, dtype) bucket, like
``torch.nn.utils.get_total_norm``:

* accelerators, float32/bf16/fp16: one ``torch._foreach_norm(..., dtype=torch.float64)``;
* float64 on accelerators: rescaled rows in one persistent scratch (:func:`rescaled_norms`);
* CPU float32/bf16/fp16: rows of :data:`ROW_NUMEL` elements normed in float32 (small tensors
  packed into one cache-sized buffer, fill after fill; large ones read in place), their
  squares summed per tensor in float64 (``index_add_``, or one sparse-CSR product);
* CPU repair: a tensor whose fast norm is non-finite or tiny is recomputed exactly in float64,
  chunk by chunk (:mod:`gradwatch.norms.repair`);
* CPU float32 row-path tensors, once compiled: a float64 kernel, exact, no repair (norms.fused).

Non-finite detection comes from the norms themselves (a NaN gives a NaN norm, an Inf an Inf
norm): no gradient-sized masks. Totals are :func:`sqrt_sum` of plain squares (the largest
factored out, so a sum beyond float64 cannot overflow) or a band combination. The math, its
exactness and its costs: docs/design.md, "The local math".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradwatch.norms.bands import BANDS, banded_total_device, bands_of_norms_device
from gradwatch.norms.fused import FusedNorms, NarrowRows, fusable
from gradwatch.norms.kernels import CompileMode, KernelCache, compiled_calls_allowed
from gradwatch.norms.layout import LayoutGuard, layout_key
from gradwatch.norms.repair import TINY_NORM_FLOAT64, repair_, suspicious
from gradwatch.norms.rescale import RESCALE_SCRATCH, RescalePlan, build_rescale_plan, rescaled_norms
from gradwatch.norms.rows import (
    ROW_NUMEL,
    FillLayout,
    RowSquares,
    StalePlan,
    aligned,
    flat_view,
    foreach_splits,
    host_to_device,
    pack_fills,
    pinned_to_device,
    row_length,
    to_device,
    written_by_other_fills,
)

#: CPU float32/bf16/fp16 tensors of at most this many elements are copied into the pack buffer;
#: larger dense ones are read in place as rows. Above it the copy costs more than the two ops
#: (a view, a norm) of reading in place (measured: 30,000-element tensors 8% faster in place,
#: 10,000-element ones 25% slower).
WHOLE_NUMEL = 16384
#: bf16/fp16 row-path tensors are widened to float32 this many elements at a time, into one
#: reused scratch buffer (4 MiB). ``vector_norm(t, dtype=torch.float32)`` would allocate a float32
#: copy of the whole tensor (twice its bytes, fresh memory each call). A multiple of ROW_NUMEL.
CONVERT_CHUNK = 1 << 20
#: CPU bf16/fp16/fp32 tensors of at most WHOLE_NUMEL elements, and the partial last rows of
#: row-path tensors, are copied (widened) into zero-padded, row-aligned slots of one persistent
#: float32 *pack buffer* of this many elements per (device, dtype) (2 MiB) and normed there as
#: rows, one *fill* after another: one ``_foreach_copy_`` and one ``vector_norm`` per fill,
#: whatever the number of tensors. A small buffer stays in the core's cache between the copy
#: and the norm (one large buffer costs a full write and re-read of memory), and no tensor ever
#: falls back to a float64-accumulating norm (~5x the cost per element). At least
#: ``aligned(WHOLE_NUMEL)``.
PACK_NUMEL = 1 << 19
#: Buckets with at least this many rows sum them per tensor by a sparse-CSR matrix-vector
#: product; fewer, by ``index_add_`` (cheaper below about 20K rows, see segment_sum_matrix).
CSR_MIN_ROWS = 32768
#: Plans of at most this many positions check their fast norms for a repair on the host (one
#: read of the plain band, compared in Python) instead of by four tensor ops.
HOST_CHECK_MAX = 64
#: A row-path tensor whose fast norm is below this is recomputed exactly: below it, float32
#: squares of its elements may have flushed to zero or lost precision as subnormals.
TINY_NORM = 1e-11
#: Float64 tensors whose squared norm is above this are recomputed too (into the high band):
#: plain-band values stay at most 2^900, so no sum of them can overflow.
HUGE_SQUARE_FLOAT64 = 2.0**900
_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def as_real_values(g: Tensor) -> Tensor:
    """The tensor whose L2 norm is the gradient's: sparse -> coalesced values, complex -> real
    view."""
    if g.layout != torch.strided:
        g = g.coalesce().values() if g.layout == torch.sparse_coo else g.values()
    if g.is_complex():
        g = torch.view_as_real(g)
    return g


@dataclass
class _RowChunk:
    """One conversion chunk of a bf16/fp16 row-path tensor: ``numel`` elements from ``start``
    are widened into ``scratch`` (a 1-D view of the plan's buffer) and normed as ``rows`` (the
    same memory as rows of ROW_NUMEL) into ``out``."""

    start: int
    numel: int
    scratch: Tensor
    rows: Tensor
    out: Tensor


@dataclass
class _Fill:
    """One fill of a bucket's pack buffer: ``slots[j]`` (a view of the buffer shaped like its
    source) receives ``sources[j]``: a position (the whole tensor) or ``~position`` (the partial
    last row of a row-path tensor); ``pads[k]`` receives ``zeros[k]`` (padding that another
    fill writes data into). Then ``rows`` (the used part of the buffer, as rows) are normed
    into ``out``, this fill's slice of the bucket's row norms."""

    slots: list[Tensor]
    sources: list[int]
    pads: list[Tensor]
    zeros: list[Tensor]
    rows: Tensor
    out: Tensor


@dataclass
class _Bucket:
    """Tensors of one (device, dtype) and how each is normed. Built once per gradient layout."""

    device: torch.device
    dtype: torch.dtype
    whole: list[int] = field(default_factory=list)  # positions normed by a float64 foreach op
    whole_index: Tensor | None = None  # ``whole``, on the output device
    whole_splits: list[slice] = field(default_factory=list)  # one foreach call per slice
    rescaled: list[int] = field(default_factory=list)  # float64 positions normed rescaled
    rescale: RescalePlan | None = None  # how (accelerators; see rescaled_norms)
    rescaled_index: Tensor | None = None  # their indices in all three bands, on out_device
    rows: list[int] = field(default_factory=list)  # positions normed in place as float32 rows
    row_counts: list[int] = field(default_factory=list)  # full rows of each, for as_strided
    row_lengths: list[int] = field(default_factory=list)  # elements per row of each
    row_shapes: list[tuple[int, int]] = field(default_factory=list)  # (rows, row length)
    tail_starts: dict[int, int] = field(default_factory=dict)  # position: its whole rows' numel
    row_strides: list[tuple[int, ...]] = field(default_factory=list)  # as planned (checked)
    row_outs: list[Tensor] = field(default_factory=list)  # float32 tensors: its slice of norms
    row_chunks: list[list[_RowChunk]] = field(default_factory=list)  # bf16/fp16 tensors
    narrow: NarrowRows | None = None  # or their rows by a compiled kernel (norms.fused)
    tails: list[int] = field(default_factory=list)  # rows positions with a partial last row
    packed: list[int] = field(default_factory=list)  # positions copied whole into the pack
    fills: list[_Fill] = field(default_factory=list)  # the pack buffer's fills, in order
    # The float32 norm of every row of this bucket (``row_sums.norms``), each row's position,
    # and how their squares are summed per position (a sparse CSR product for many rows)
    row_sums: RowSquares | None = None

    @property
    def positions(self) -> list[int]:
        """Every position of this bucket (any order)."""
        return [*self.packed, *self.rows, *self.whole, *self.rescaled]


@dataclass
class NormPlan:
    """How to norm one list of tensors; valid while shapes, dtypes, devices and strides hold."""

    n: int
    out_device: torch.device
    buckets: list[_Bucket]
    needs_repair: bool  # some bucket is on CPU: the fast path may need an exact repair
    repair_floor: Tensor | None  # per position: squared norms below this are recomputed
    repair_ceiling: Tensor | None = None  # and above this (float64 positions; else None)
    # The same bounds as host lists, for plans of at most HOST_CHECK_MAX positions: their
    # check reads the plain band once and compares on the host (no op but the read)
    host_bounds: list[tuple[float, float]] | None = None
    scratch: dict[torch.device, Tensor] = field(default_factory=dict)  # widening buffers
    # CPU float32/bf16/fp16 positions a compiled kernel norms once it is ready (norms.fused),
    # and the plan of every other position, built when the kernels first are
    fused: FusedNorms | None = None
    residual: NormPlan | None = None
    # The layout it was built for, checked in one call per step (None: the Python key only)
    guard: LayoutGuard | None = None

    @property
    def pack_fills(self) -> int:
        """Fills of the pack buffers, over every bucket: two ops each per call."""
        return sum(len(bucket.fills) for bucket in self.buckets)


class MetaGradientError(ValueError):
    """A gradient on the ``meta`` device: it has no values to norm (the model was built on
    ``meta`` and the gradient never materialized). ``position`` is its index."""

    def __init__(self, position: int) -> None:
        super().__init__(f"gradwatch: gradient {position} is on the meta device")
        self.position = position


def build_plan(
    tensors: Sequence[Tensor | None],
    out_device: torch.device,
    rescale_float64: bool = False,
    kernels: KernelCache | None = None,
) -> NormPlan:
    """Sorts tensors into buckets and paths; O(len(tensors)) Python and a few index tensors,
    so it is cached and rebuilt only when the gradient layout changes.

    CPU float32/bf16/fp16 tensors take the row path (larger than :data:`WHOLE_NUMEL` and
    dense) or the pack (the rest of those up to :data:`WHOLE_NUMEL`); anything else a float64
    path. Float64 tensors off the CPU take the rescaled path (:func:`rescaled_norms`); with
    ``rescale_float64`` CPU ones do too (instead of the repair), which is how tests exercise
    the accelerator path on a CPU. With ``kernels`` (a CPU output), the :func:`~gradwatch.
    norms.fused.fusable` tensors also get a :class:`~gradwatch.norms.fused.FusedNorms`
    (compiling starts here), used once every kernel of it is ready.
    """
    buckets: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
    floor = [0.0] * len(tensors)
    ceiling = [math.inf] * len(tensors)
    needs_repair = False
    for i, t in enumerate(tensors):
        if t is None or t.numel() == 0:
            continue
        if t.device.type == "meta":
            raise MetaGradientError(i)
        key = (t.device, t.dtype)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = _Bucket(device=t.device, dtype=t.dtype)
        on_cpu = t.device.type == "cpu"
        fast = on_cpu and t.dtype in _LOW_PRECISION
        if fast and t.numel() > WHOLE_NUMEL and flat_view(t) is not None:
            length = row_length(t.numel())
            bucket.rows.append(i)
            bucket.row_counts.append(t.numel() // length)
            bucket.row_lengths.append(length)
            bucket.row_strides.append(t.stride())
            bucket.row_shapes.append((t.numel() // length, length))
            if t.numel() % length != 0:
                bucket.tails.append(i)
                bucket.tail_starts[i] = t.numel() // length * length
            floor[i] = TINY_NORM * TINY_NORM
            needs_repair = True
            continue
        if fast and t.numel() <= WHOLE_NUMEL:
            bucket.packed.append(i)
            floor[i] = TINY_NORM * TINY_NORM
            needs_repair = True
            continue
        # Float64 off the CPU: rescaled. A huge non-dense one cannot be chunked by views and
        # takes the unrescaled foreach norm below (exact within about [1e-154, 1e154]).
        rescaled = t.dtype == torch.float64 and (rescale_float64 or not on_cpu)
        if rescaled and (t.numel() <= RESCALE_SCRATCH or flat_view(t) is not None):
            bucket.rescaled.append(i)
            continue
        bucket.whole.append(i)
        if on_cpu and t.dtype == torch.float64:
            floor[i] = TINY_NORM_FLOAT64 * TINY_NORM_FLOAT64
            ceiling[i] = HUGE_SQUARE_FLOAT64
            needs_repair = True
        elif on_cpu:
            needs_repair = True  # other float types: repair only non-finite results
    plan = NormPlan(
        n=len(tensors),
        out_device=out_device,
        buckets=list(buckets.values()),
        needs_repair=needs_repair,
        repair_floor=(
            host_to_device(floor, torch.float64, out_device) if needs_repair else None
        ),
        repair_ceiling=(
            host_to_device(ceiling, torch.float64, out_device)
            if any(c < math.inf for c in ceiling)
            else None
        ),
        host_bounds=(
            list(zip(floor, ceiling, strict=True))
            if needs_repair and out_device.type == "cpu" and len(tensors) <= HOST_CHECK_MAX
            else None
        ),
        guard=LayoutGuard.of(tensors),
    )
    for bucket in plan.buckets:
        if bucket.whole:
            bucket.whole_index = host_to_device(bucket.whole, torch.long, out_device)
            bucket.whole_splits = foreach_splits([tensors[i].numel() for i in bucket.whole])
        if bucket.rows or bucket.packed:
            _build_rows(bucket, tensors, plan)
            if bucket.row_chunks and kernels is not None and kernels.mode != "off":
                norms = bucket.row_sums.norms[: sum(bucket.row_counts)]  # type: ignore[union-attr]
                bucket.narrow = NarrowRows.build(bucket.row_shapes, bucket.row_strides,
                                                 bucket.dtype, norms, kernels)
        if bucket.rescaled:
            rescaled = [tensors[i] for i in bucket.rescaled]
            bucket.rescale = build_rescale_plan(rescaled)  # type: ignore[arg-type]
            index = host_to_device(bucket.rescaled, torch.long, out_device)
            bucket.rescaled_index = torch.cat([index + band * plan.n for band in range(BANDS)])
    if kernels is not None and kernels.mode != "off" and out_device.type == "cpu":
        fused = [i for i, t in enumerate(tensors) if t is not None and fusable(t)]
        if fused:
            plan.fused = FusedNorms.build(tensors, fused, kernels)
    return plan


def _residual_plan(plan: NormPlan, tensors: Sequence[Tensor | None], rescale_float64: bool,
                   kernels: KernelCache | None) -> NormPlan:
    """The plan of ``plan``'s positions but its fused ones (built once, when its kernels are
    ready): the same n positions, the fused ones left at 0 for the kernel to fill (``kernels``
    for its bf16/fp16 rows: :class:`~gradwatch.norms.fused.NarrowRows`)."""
    if plan.residual is None:
        assert plan.fused is not None
        skip = set(plan.fused.positions)
        rest = [None if i in skip else t for i, t in enumerate(tensors)]
        plan.residual = build_plan(rest, plan.out_device, rescale_float64, kernels)
    return plan.residual


def _build_rows(bucket: _Bucket, tensors: Sequence[Tensor | None], plan: NormPlan) -> None:
    """The float32 norms vector of ``bucket`` (row-path rows, then the rows of every fill),
    each row's owner, the output slice of every norm op, and the pack buffer's fills
    (:func:`_pack_fills`). Built with the plan, reused every step."""
    fills = _pack_fills(bucket, tensors)
    n_rows = sum(bucket.row_counts) + sum(used for _, used in fills) // ROW_NUMEL
    norms = torch.empty(n_rows, dtype=torch.float32, device=bucket.device)
    owner: list[int] = []
    at = 0
    widen = bucket.dtype != torch.float32
    if widen and bucket.rows:
        need = min(CONVERT_CHUNK, max(
            c * m for c, m in zip(bucket.row_counts, bucket.row_lengths, strict=True)))
        scratch = plan.scratch.get(bucket.device)
        if scratch is None or scratch.numel() < need:
            scratch = plan.scratch[bucket.device] = torch.empty(
                need, dtype=torch.float32, device=bucket.device
            )
    for i, count, length in zip(bucket.rows, bucket.row_counts, bucket.row_lengths, strict=True):
        out = norms[at : at + count]
        owner.extend([i] * count)
        at += count
        if not widen:
            bucket.row_outs.append(out)
            continue
        chunks = []
        full = count * length
        step = CONVERT_CHUNK // length * length  # whole rows per chunk
        for start in range(0, full, step):
            m = min(step, full - start)
            buf = scratch[:m]
            first = start // length
            rows = out[first : first + m // length]
            chunks.append(_RowChunk(start, m, buf, buf.view(-1, length), rows))
        bucket.row_chunks.append(chunks)
    if fills:
        length = max(used for _, used in fills)
        buffer = torch.zeros(length, dtype=torch.float32, device=bucket.device)
        zeros = torch.zeros(ROW_NUMEL, dtype=bucket.dtype, device=bucket.device)
        dirty = written_by_other_fills(fills, length)
        for items, used in fills:
            slots, sources, pads, pad_zeros = [], [], [], []
            for src, shape, offset in items:
                numel = math.prod(shape)
                slots.append(buffer[offset : offset + numel].view(shape))
                sources.append(src)
                pad = slice(offset + numel, offset + aligned(numel))
                if pad.stop > pad.start and dirty[pad.stop] > dirty[pad.start]:
                    pads.append(buffer[pad])
                    pad_zeros.append(zeros[: pad.stop - pad.start])
                owner.extend([src if src >= 0 else ~src] * (aligned(numel) // ROW_NUMEL))
            rows = used // ROW_NUMEL
            bucket.fills.append(
                _Fill(slots, sources, pads, pad_zeros, buffer[:used].view(-1, ROW_NUMEL),
                      norms[at : at + rows])
            )
            at += rows
    # Accelerators: always the CSR product, whose additions per output are in a fixed order
    # (index_add_ adds by atomics there: replicas could sum the same rows to different bits).
    csr = len(owner) >= CSR_MIN_ROWS or bucket.device.type != "cpu"
    bucket.row_sums = RowSquares.build(owner, plan.n, bucket.device, csr, norms)


def _pack_fills(bucket: _Bucket, tensors: Sequence[Tensor | None]) -> FillLayout:
    """The pack buffer's fills (:func:`~gradwatch.norms.rows.pack_fills`, at most
    :data:`PACK_NUMEL` elements each) of the bucket's packed tensors, then its partial rows."""
    items: list[tuple[int, tuple[int, ...]]] = [
        (i, tuple(tensors[i].shape)) for i in bucket.packed  # type: ignore[union-attr]
    ]
    items += [
        (~i, (tensors[i].numel() - bucket.tail_starts[i],))  # type: ignore[union-attr]
        for i in bucket.tails
    ]
    return pack_fills(items, PACK_NUMEL)


def _fill_row_norms(bucket: _Bucket, tensors: Sequence[Tensor | None],
                    verified: bool = False) -> None:
    """Writes the float32 norm of every row of ``bucket`` into ``bucket.row_sums.norms``: packed
    tensors and partial last rows are copied (widened) into the pack buffer by one foreach op
    per fill (with the zeros of padding another fill wrote into) and normed as rows,
    row-path tensors are read in place through ``as_strided`` views of their memory (dense, so
    the first ``count * ROW_NUMEL`` elements in memory order are whole rows), bf16/fp16 ones
    by a compiled kernel once ready (``bucket.narrow``), else widened chunk by chunk into the
    plan's scratch. Every norm writes into its slice of ``bucket.row_sums.norms``.

    Raises :class:`StalePlan` when a row-path tensor's strides changed or it left the CPU,
    checked as each one is read unless ``verified`` (the plan's guard checked them all):
    nothing computed here is used then (the caller plans again and recomputes), and a view
    outside the storage raises too."""
    if bucket.narrow is not None and bucket.narrow.fill(bucket.rows, tensors, verified):
        pass
    elif bucket.row_chunks:
        for i, stride, chunks in zip(bucket.rows, bucket.row_strides, bucket.row_chunks,
                                     strict=True):
            t = tensors[i]
            if not verified and (t is None or t.stride() != stride or not t.is_cpu):
                raise StalePlan  # as_strided would read the wrong memory: plan again
            assert t is not None
            offset = t.storage_offset()
            for c in chunks:
                c.scratch.copy_(t.as_strided((c.numel,), (1,), offset + c.start))
                torch.linalg.vector_norm(c.rows, 2, dim=1, out=c.out)
    else:
        for i, shape, stride, out in zip(bucket.rows, bucket.row_shapes, bucket.row_strides,
                                         bucket.row_outs, strict=True):
            t = tensors[i]
            if not verified and (t is None or t.stride() != stride or not t.is_cpu):
                raise StalePlan
            assert t is not None
            rows = t.as_strided(shape, (shape[1], 1))
            torch.linalg.vector_norm(rows, 2, dim=1, out=out)
    for fill in bucket.fills:
        sources: list[Tensor] = [
            tensors[src] if src >= 0
            else _tail(tensors[~src], bucket.tail_starts[~src])  # type: ignore[arg-type]
            for src in fill.sources
        ]
        torch._foreach_copy_([*fill.slots, *fill.pads], [*sources, *fill.zeros])
        torch.linalg.vector_norm(fill.rows, 2, dim=1, out=fill.out)


def _tail(t: Tensor, full: int) -> Tensor:
    """The partial last row of a dense row-path tensor: its elements past the first ``full``
    (its whole rows), in memory order."""
    return t.as_strided((t.numel() - full,), (1,), t.storage_offset() + full)


def foreach_norms(tensors: Sequence[Tensor], splits: Sequence[slice]) -> Tensor:
    """The L2 norm of each of ``tensors`` accumulated in float64 (their dtype on input: no
    float64 copy), stacked into one float64 vector: one ``_foreach_norm`` per slice of
    ``splits`` (:func:`gradwatch.norms.rows.foreach_splits`, which bounds the kernel's scratch),
    then one ``stack``. No host read. Float64 inputs square to 0 or Inf outside about ``[1e-154,
    1e154]``: the engine repairs or rescales those, the comm hook documents the limit."""
    return torch.stack([norm for part in splits
                        for norm in torch._foreach_norm(tensors[part], 2, dtype=torch.float64)])


def _fast_squared_norms(plan: NormPlan, tensors: Sequence[Tensor | None],
                        verified: bool = False) -> Tensor:
    """The fast path of :meth:`NormEngine.squared_norms`, before any repair (``verified``: the
    layout was checked by the plan's guard, see :func:`_fill_row_norms`)."""
    out_device = plan.out_device
    banded = torch.zeros(BANDS * plan.n, dtype=torch.float64, device=out_device)
    sq = banded[: plan.n]  # the plain band: the fast path never leaves it
    for bucket in plan.buckets:
        if bucket.row_sums is not None:
            _fill_row_norms(bucket, tensors, verified)
            # Float32 row norms, squared and summed per tensor in float64: two ops for all
            # the rows of the bucket, whatever the number of tensors, into buffers of the
            # plan. n scalars cross devices (if at all), never gradient data. Rows too tiny
            # to square in float32 were already tiny inside the kernel: such tensors are
            # repaired below. (sq's entries of this bucket's positions are still 0 here.)
            bucket.row_sums.add_to(sq)
        if bucket.whole:
            items = [tensors[i] for i in bucket.whole]
            norms = foreach_norms(items, bucket.whole_splits)
            assert bucket.whole_index is not None
            sq.index_copy_(0, bucket.whole_index, to_device(norms, out_device).square())
        if bucket.rescale is not None:
            items = [tensors[i] for i in bucket.rescaled]
            bands = bands_of_norms_device(rescaled_norms(bucket.rescale, items))  # type: ignore[arg-type]
            assert bucket.rescaled_index is not None
            banded.index_copy_(0, bucket.rescaled_index, to_device(bands, out_device))
    return banded


class NormEngine:
    """Computes per-tensor squared L2 norms into one float64 vector, caching the plan.

    Sync behaviour: on accelerators no host read at all; on CPU at most one host read per call
    (the repair mask), counted in :attr:`host_reads`. Not thread-safe: use from one thread.
    ``rescale_float64``: CPU float64 tensors take the accelerator's rescaled path instead of
    the repair (for tests of that path on a CPU; see :func:`build_plan`). ``kernels``: where
    compiled kernels come from (:mod:`gradwatch.norms.fused`; None: never compiled). Buckets
    normed by a ready kernel take no host read.
    """

    def __init__(
        self, rescale_float64: bool = False, kernels: KernelCache | None = None
    ) -> None:
        self.kernels = kernels
        self._plan: NormPlan | None = None
        self._key: tuple | None = None
        self._rescale_float64 = rescale_float64
        self.host_reads = 0
        self._split: _SplitEngines | None = None  # gradients on the host and on a device
        self._split_key: tuple | None = None
        self._split_layout = False

    @classmethod
    def for_job(cls, compile_kernels: CompileMode, world_size: int) -> NormEngine:
        """A watcher's engine: compiled kernels (``compile_kernels``) in one-process jobs only.
        Ranks finish compiling at different steps and the kernel rounds differently from the
        eager paths, so replicas' local norms (compared on divergence steps, used alone under
        pure replication) would differ in their last bits."""
        return cls(kernels=KernelCache(compile_kernels if world_size == 1 else "off"))

    def plan_for(
        self,
        tensors: Sequence[Tensor | None],
        out_device: torch.device,
        replan: bool = False,
        key: tuple | None = None,
    ) -> NormPlan:
        if key is None:
            key = (out_device, layout_key(tensors))
        if replan or self._plan is None or key != self._key:
            self._plan = None  # free the old plan's buffers before allocating the new ones
            self._plan = build_plan(tensors, out_device, self._rescale_float64, self.kernels)
            self._key = key
        return self._plan

    @torch.no_grad()
    def squared_norms(
        self, tensors: Sequence[Tensor | None], out_device: torch.device | None = None
    ) -> Tensor:
        """The banded float64 vector of squared norms (``BANDS * n`` long, see the module
        docstring): ``sq[i] = ||tensors[i]||^2`` (0 where None or empty) whenever that norm is
        in ``[2^-450, 2^450]``, else ``sq[i]`` is 0 and the high or low band holds it, scaled.

        ``tensors`` must be strided real tensors (see :func:`as_real_values`).
        """
        return self.squared_norms_and_plan(tensors, out_device)[0]

    def squared_norms_and_plan(
        self, tensors: Sequence[Tensor | None], out_device: torch.device | None = None
    ) -> tuple[Tensor, NormPlan]:
        """:meth:`squared_norms`, and the plan that computed them: its buckets group these
        very tensors by (device, dtype), which clipping reuses (:mod:`gradwatch.step.clip`)."""
        if torch.is_grad_enabled():  # no autograd; no decorator object per call when it is off
            with torch.no_grad():
                return self.squared_norms_and_plan(tensors, out_device)
        if out_device is None:
            out_device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        if out_device.type != "cpu" and all(t is None or t.device.type == "cpu" for t in tensors):
            # Gradients on the CPU, output on an accelerator (FSDP2 CPU offload): norm and
            # repair on the host, then one non-blocking copy from pinned memory (a CUDA output
            # would cross each bucket by a blocking pageable copy). (No CUDA device in CI.)
            sq, plan = self.squared_norms_and_plan(tensors, torch.device("cpu"))
            return pinned_to_device(sq, out_device), plan
        plan = self._plan
        # The cached plan, checked in one call (LayoutGuard); else by the Python key, and then
        # the in-place paths check strides and devices as they read.
        verified = (plan is not None and plan.guard is not None and not self._split_layout
                    and plan.out_device == out_device and plan.guard.holds(tensors))
        if not verified:
            key = (out_device, layout_key(tensors))
            if out_device.type != "cpu":
                if key != self._split_key:  # once per layout: which devices hold the gradients
                    self._split_key = key
                    self._split_layout = _split_between_host_and_device(tensors)
                if self._split_layout:
                    return self._mixed(tensors, out_device)
            plan = self.plan_for(tensors, out_device, key=key)
        assert plan is not None
        try:
            sq = self._compute(plan, tensors, verified)
        except (StalePlan, RuntimeError):
            # A device or stride the cheap layout key does not read changed: plan again, once
            # (a second failure is a real error and propagates).
            plan = self.plan_for(tensors, out_device, replan=True)
            sq = self._compute(plan, tensors, False)
        return sq, plan

    def _compute(self, plan: NormPlan, tensors: Sequence[Tensor | None],
                 verified: bool) -> Tensor:
        """The banded vector by ``plan``: its eager paths (all, or its residual's when the
        compiled kernels of its fused positions are ready and may be called), the repair of
        what they computed (one host read), then the kernels' exact squares. ``verified``:
        the plan's guard held for ``tensors`` (no stride or device check is repeated)."""
        fused = plan.fused
        compiled = (fused is not None and self.kernels is not None and compiled_calls_allowed()
                    and fused.ready(self.kernels))
        if compiled and fused.whole:  # type: ignore[union-attr]
            return fused.banded(tensors, verified)  # type: ignore[union-attr]
        eager = (_residual_plan(plan, tensors, self._rescale_float64, self.kernels)
                 if compiled else plan)
        sq = _fast_squared_norms(eager, tensors, verified)
        if eager.needs_repair:
            bad = suspicious(sq[: plan.n], eager.host_bounds, eager.repair_floor,
                             eager.repair_ceiling)
            self.host_reads += 1
            if bad:
                repair_(sq, plan.n, bad, tensors)
        if compiled:  # raises StalePlan on strides or a device the kernels were not built for
            fused.add_to(sq[: plan.n], tensors, verified)  # type: ignore[union-attr]
        return sq

    def _mixed(
        self, tensors: Sequence[Tensor | None], out_device: torch.device
    ) -> tuple[Tensor, NormPlan] | None:
        """Gradients partly in host memory, partly on a device (CPU offload of some
        parameters, CPU embedding tables): None when they are not. Else the host ones are
        normed (and repaired: a read of host memory) by a host engine, the device ones by a
        device engine that never repairs (no host read), each with its own cached plan in the
        same positions, and the host vector joins the device one by one non-blocking copy
        from pinned memory: the repair mask is never computed from a device tensor. Whether a
        layout is split is decided once per layout; each call sorts the tensors into the two
        lists (O(len(tensors)) Python), the sub-plans are cached per layout."""
        on_host = [t if t is not None and is_host_resident(t) else None for t in tensors]
        on_device = [t if t is not None and not is_host_resident(t) else None for t in tensors]
        if all(t is None for t in on_host) or all(t is None for t in on_device):
            self._split = None
            return None
        if self._split is None:
            self._split = _SplitEngines(NormEngine(self._rescale_float64, self.kernels),
                                        NormEngine(self._rescale_float64))
        split = self._split
        reads = split.host.host_reads + split.device.host_reads
        host_sq, host_plan = split.host.squared_norms_and_plan(on_host, torch.device("cpu"))
        sq, device_plan = split.device.squared_norms_and_plan(on_device, out_device)
        self.host_reads += split.host.host_reads + split.device.host_reads - reads
        # Disjoint positions: every entry of one vector is 0 where the other's is set.
        sq.add_(pinned_to_device(host_sq, out_device))
        return sq, split.plan(host_plan, device_plan, out_device)


def _split_between_host_and_device(tensors: Sequence[Tensor | None]) -> bool:
    """Some gradients in host memory and some on a device (O(len(tensors)), once a layout)."""
    present = [t for t in tensors if t is not None]
    host = sum(1 for t in present if is_host_resident(t))
    return 0 < host < len(present)


def is_host_resident(t: Tensor) -> bool:
    """A tensor in host memory (the split of :meth:`NormEngine._mixed`)."""
    return t.device.type == "cpu"


@dataclass
class _SplitEngines:
    """The engines of gradients split between host memory and a device, and their joint plan
    (every bucket of both, in the same positions: what a clip scales)."""

    host: NormEngine
    device: NormEngine
    _joint: tuple[int, int, NormPlan] | None = None

    def plan(self, host: NormPlan, device: NormPlan, out_device: torch.device) -> NormPlan:
        if self._joint is None or self._joint[:2] != (id(host), id(device)):
            joint = NormPlan(n=host.n, out_device=out_device,
                             buckets=[*host.buckets, *device.buckets],
                             needs_repair=False, repair_floor=None)
            self._joint = (id(host), id(device), joint)
        return self._joint[2]


def sqrt_sum(squares: Sequence[float]) -> float:
    """``sqrt(sum(squares))`` of Python floats, with an exact sum (``math.fsum``) that cannot
    overflow: NaN if any square is NaN, Inf if any is Inf (and none NaN). Host side (the
    snapshot's group and global norms); device-side totals combine bands instead
    (:func:`banded_total_device`)."""
    try:
        return math.sqrt(math.fsum(squares))
    except OverflowError:
        pass
    # Each square fits float64 but their exact sum does not (fsum raises even when a NaN or an
    # Inf is present too): settle the special values, then factor out the largest square.
    if any(s != s for s in squares):
        return math.nan
    top = max(squares)
    if math.isinf(top):
        return math.inf
    return math.sqrt(top) * math.sqrt(math.fsum(s / top for s in squares))


def total_norm(tensors: Tensor | Sequence[Tensor]) -> Tensor:
    """L2 norm of all ``tensors`` together, as a 0-dim float64 tensor.

    A drop-in for ``torch.nn.utils.get_total_norm(tensors)`` (norm_type 2) that never overflows
    or underflows: exact to about 3e-7 relative for float32/bf16/fp16 inputs (see the module
    docstring) and to float64 rounding for float64 inputs over the whole finite range (CPU by
    a repair, accelerators by :func:`rescaled_norms`). A norm beyond float64 is +inf, like
    torch's. Non-finite inputs give NaN/Inf like torch's. Sparse gradients
    use their values; complex ones their absolute values. On CPU it reads the host once.
    """
    if isinstance(tensors, Tensor):
        tensors = [tensors]
    values = [as_real_values(t) for t in tensors]
    if not values:
        return torch.tensor(0.0, dtype=torch.float64)
    return banded_total_device(NormEngine().squared_norms(values), len(values))
