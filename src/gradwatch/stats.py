"""Local (per-rank) gradient math: exact squared L2 norms of many tensors, batched.

Given the gradients a rank holds (plain tensors, or the local shards of DTensors), this module
returns one float64 vector ``sq`` with ``sq[i] = ||g_i||_2^2``, computed without a float64 copy
of any gradient and with a number of dispatched ops that does not grow with the number of
tensors of up to :data:`WHOLE_NUMEL` elements (each larger one costs two ops: a view and a norm).

The math, per (device, dtype) bucket, like ``torch.nn.utils.get_total_norm`` groups tensors:

* **Accelerators** (CUDA and others), float32/bf16/fp16:
  ``torch._foreach_norm(tensors, 2, dtype=torch.float64)``,
  one fused kernel per bucket that accumulates in float64 (PyTorch's documented behaviour; not
  tested on this project's CPU-only machines). No host read.
* **Float64 on accelerators** (:func:`rescaled_norms`): a float64 square overflows above about
  1e154 and underflows below about 1e-154, and the CPU repair below needs a host read. So each
  float64 bucket is copied, one ``_foreach_copy_`` per fill, into row-aligned slots of one
  persistent scratch of :data:`RESCALE_SCRATCH` elements (larger tensors in chunks of their
  flat view); every row of :data:`ROW_NUMEL` is divided by its max-abs ``r`` and normed,
  ``row = r * ||row / r||``; per tensor, with ``M`` its largest row norm,
  ``norm = M * sqrt(sum((row / M)^2))``. No square exceeds 512, and those that underflow are
  negligible next to the largest. :func:`bands_of_norms_device` places the squares by
  ``where``. Branchless, no host read, a constant number of ops per fill, exact to float64
  rounding over the whole finite range. The same code runs on CPU with
  ``NormEngine(rescale_float64=True)`` (tests).
* **CPU float32/bf16/fp16, tensors of at most** :data:`WHOLE_NUMEL` **elements**: copied
  (widened) by one ``_foreach_copy_`` into zero-padded, row-aligned slots of one persistent
  float32 pack buffer (at most :data:`PACK_NUMEL` elements; beyond it, one float64-accumulating
  foreach op), normed there as rows of :data:`ROW_NUMEL`.
* **CPU float32/bf16/fp16, larger dense tensors**: read in place as rows of :data:`ROW_NUMEL`
  elements through one ``as_strided`` view (no copy); ``linalg.vector_norm(..., dim=1, out=)``
  writes one float32 norm per row into the plan's norms vector. The partial last row gets a
  pack slot. bf16/fp16 tensors are first widened to float32 :data:`CONVERT_CHUNK` elements at
  a time into one reused 4 MiB buffer (``vector_norm(..., dtype=torch.float32)`` would allocate
  a float32 copy of the whole tensor).
  A float32 partial sum over 512 elements keeps the relative error below 5e-7 even for
  constant gradients (measured: 4.7e-7 worst case over 47 constants at 2^24 elements; PyTorch's
  vectorized reduction keeps many partial sums per row), where one float32 sum over the whole
  tensor is off by up to 8e-4. Rows of 256 are slightly more exact (2.6e-7) but reduce more
  slowly (the trade-off and its timings: docs/design.md).
* **Per-tensor sums**: all row norms of a bucket are squared in float64 and summed per tensor
  by one sparse-CSR matrix-vector product built with the plan: three ops per bucket, whatever
  the number of tensors.
* **Repair (CPU only; accelerators accumulate float32/bf16/fp16 in float64 and rescale
  float64 as above)**: float32 squares overflow for |g| > 1.8e19 and underflow for
  |g| < 1e-19. A tensor whose fast squared norm is non-finite or below :data:`TINY_NORM`^2 is
  recomputed exactly in float64, in chunks of :data:`RECOMPUTE_CHUNK` elements (bounded
  temporaries). Finding those tensors costs one host read of a boolean vector, which on CPU is
  free; float64 gradients are recomputed by chunks rescaled by their max-abs (tensor ops),
  combined by ``math.hypot`` on norms, never by squaring a Python float.

**Bands.** A float64 gradient's squared norm may lie outside float64's range (norms above
about 1e154 or below about 1e-154) while its norm does not. So the engine's output has three
*bands* of ``n`` entries each, ``[plain | high | low]``: a tensor's squared norm ``s`` is in
exactly one of them (the others hold 0): ``plain`` holds ``s`` itself when the norm is within
``[2^-450, 2^450]`` (every float32/bf16/fp16 norm is), ``high`` holds ``s * 2^-1100`` above it
and ``low`` holds ``s * 2^1200`` below it. Every band value is a normal float64 no larger than
2^948, so band sums over many tensors and ranks (the all-reduce) neither overflow nor lose
precision, and NaN/Inf always sit in ``plain``. :func:`norm_from_bands` (host) and
:func:`norm_from_bands_device` turn band sums back into a norm, which float64 represents
whenever the true norm is finite; a norm that truly overflows float64 is +inf.

Non-finite detection comes from the norms themselves: a gradient holding NaN has a NaN norm, one
holding Inf (and no NaN) has an Inf norm. No ``isnan`` masks of gradient size are built.

**Combining squared norms** (:func:`sqrt_sum` on the host, for plain-band values only): a sum
of plain squares may exceed float64 (squares given directly, near 1e308), so the largest is
factored out: ``sqrt(sum(s)) = sqrt(m) * sqrt(sum(s / m))``. Every total gradwatch reports
(:func:`total_norm`, the clipping total, the group and global norms of a snapshot) is
:func:`sqrt_sum` of plain squares or a band combination (:func:`norm_from_bands`,
:func:`norm_from_bands_device`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: CPU tensors with at most this many elements are normed whole, with float64 accumulation.
WHOLE_NUMEL = 65536
#: Larger CPU tensors are normed in float32 over rows of this many elements.
ROW_NUMEL = 512
#: bf16/fp16 row-path tensors are widened to float32 this many elements at a time, into one
#: reused scratch buffer (4 MiB). ``vector_norm(t, dtype=torch.float32)`` would allocate a float32
#: copy of the whole tensor (twice its bytes, fresh memory each call). A multiple of ROW_NUMEL.
CONVERT_CHUNK = 1 << 20
#: CPU bf16/fp16/fp32 tensors of ROW_NUMEL+1 to WHOLE_NUMEL elements are copied (widened) by
#: one foreach op into zero-padded, row-aligned slots of one persistent float32 buffer per
#: (device, dtype), and normed there as rows: a float64-accumulating norm of them converts every
#: element to float64 and costs ~5x more. The buffer holds at most this many elements (16 MiB);
#: tensors that do not fit take the float64 path.
PACK_NUMEL = 1 << 22
#: Buckets with at least this many rows sum them per tensor by a sparse-CSR matrix-vector
#: product; fewer, by ``index_add_`` (cheaper below about 20K rows, see _segment_sum_matrix).
CSR_MIN_ROWS = 32768
#: Exact recomputation walks a tensor in chunks of this many elements (bounds temporaries).
RECOMPUTE_CHUNK = 65536
#: A row-path tensor whose fast norm is below this is recomputed exactly: below it, float32
#: squares of its elements may have flushed to zero or lost precision as subnormals.
TINY_NORM = 1e-11
#: Float64 tensors whose norm is below this (or non-finite) are recomputed with rescaling.
TINY_NORM_FLOAT64 = 1e-140
#: Float64 tensors whose squared norm is above this are recomputed too (into the high band):
#: plain-band values stay at most 2^900, so no sum of them can overflow.
HUGE_SQUARE_FLOAT64 = 2.0**900
#: Norms in ``[2^-BAND_EXPONENT, 2^BAND_EXPONENT]`` travel as plain squares.
BAND_EXPONENT = 450
#: The high band holds ``s * 2^-HIGH_SHIFT``, the low band ``s * 2^LOW_SHIFT`` (``s`` squared).
HIGH_SHIFT = 1100
LOW_SHIFT = 1200
#: The number of bands: the engine's output is ``BANDS * n`` long.
BANDS = 3

_LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def flat_view(t: Tensor) -> Tensor | None:
    """A 1-D view of every element of ``t`` (order irrelevant to a norm), or None.

    Contiguous tensors view directly; dense non-overlapping ones (channels_last, transposes)
    are permuted to contiguous order first. Anything else returns None (it is normed whole).
    """
    if t.is_contiguous():
        return t.view(-1)
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    permuted = t.permute(order)
    if permuted.is_contiguous():
        return permuted.view(-1)
    return None


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
    row_strides: list[tuple[int, ...]] = field(default_factory=list)  # as planned (checked)
    row_outs: list[Tensor] = field(default_factory=list)  # float32 tensors: its slice of norms
    row_chunks: list[list[_RowChunk]] = field(default_factory=list)  # bf16/fp16 tensors
    tails: list[int] = field(default_factory=list)  # rows positions with a partial last row
    packed: list[int] = field(default_factory=list)  # positions copied whole into the pack
    pack_used: int = 0  # elements of the pack buffer in use (row-aligned slots)
    pack_slots: list[Tensor] = field(default_factory=list)  # the slots of packed, then of tails
    pack_rows: Tensor | None = None  # the pack buffer as (rows, ROW_NUMEL)
    pack_out: Tensor | None = None  # pack_rows' slice of norms
    norms: Tensor | None = None  # float32 norm of every row of this bucket
    squares: Tensor | None = None  # float64, their squares (persistent: no per-step allocation)
    owner: Tensor | None = None  # for each row, its position (``index_add_`` path)
    sum_rows: Tensor | None = None  # or a sparse CSR (n x len(norms)) of ones: ``sum_rows @
    # squares`` is, per position, the sum of its rows' squares (many rows)

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
    scratch: dict[torch.device, Tensor] = field(default_factory=dict)  # widening buffers


class MetaGradientError(ValueError):
    """A gradient on the ``meta`` device: it has no values to norm (the model was built on
    ``meta`` and the gradient never materialized). ``position`` is its index."""

    def __init__(self, position: int) -> None:
        super().__init__(f"gradwatch: gradient {position} is on the meta device")
        self.position = position


class _StalePlan(Exception):
    """A row-path tensor's device or strides changed under an unchanged layout key."""


def _layout_key(tensors: Sequence[Tensor | None]) -> list:
    # The cheap part of what a plan depends on, read for every tensor on every step: presence,
    # dtype and shape (pack slots are views of that shape). Devices and strides matter only for
    # row-path tensors, read in place through as_strided: _fill_row_norms checks those few and
    # raises _StalePlan. A packed or whole-path tensor on another device or with other strides
    # is still normed right (copy_ and foreach norms accept any), or raises, which replans.
    # Reading device and contiguity too would cost half as much again, per tensor per step.
    return [None if t is None else (t.dtype, t.shape) for t in tensors]


def build_plan(
    tensors: Sequence[Tensor | None], out_device: torch.device, rescale_float64: bool = False
) -> NormPlan:
    """Sorts tensors into buckets and paths; O(len(tensors)) Python and a few index tensors,
    so it is cached and rebuilt only when the gradient layout changes.

    Row-path tensors are placed first, so their partial last rows get pack slots before the
    mid-size tensors fill the buffer; whatever does not fit takes the float64 path.
    Float64 tensors off the CPU take the rescaled path (:func:`rescaled_norms`); with
    ``rescale_float64`` CPU ones do too (instead of the repair), which is how tests exercise
    the accelerator path on a CPU.
    """
    buckets: dict[tuple[torch.device, torch.dtype], _Bucket] = {}
    floor = [0.0] * len(tensors)
    ceiling = [math.inf] * len(tensors)
    needs_repair = False
    mid_size: list[int] = []
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
            has_tail = t.numel() % ROW_NUMEL != 0
            if not has_tail or bucket.pack_used + ROW_NUMEL <= PACK_NUMEL:
                bucket.rows.append(i)
                bucket.row_counts.append(t.numel() // ROW_NUMEL)
                bucket.row_strides.append(t.stride())
                if has_tail:
                    bucket.tails.append(i)
                    bucket.pack_used += ROW_NUMEL
                floor[i] = TINY_NORM * TINY_NORM
                needs_repair = True
                continue
        elif fast and t.numel() <= WHOLE_NUMEL:
            mid_size.append(i)
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
    for i in mid_size:
        t = tensors[i]
        assert t is not None
        bucket = buckets[(t.device, t.dtype)]
        if bucket.pack_used + _aligned(t.numel()) <= PACK_NUMEL:
            bucket.packed.append(i)
            bucket.pack_used += _aligned(t.numel())
        else:
            bucket.whole.append(i)
        floor[i] = TINY_NORM * TINY_NORM
        needs_repair = True
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
    )
    for bucket in plan.buckets:
        if bucket.whole:
            bucket.whole_index = host_to_device(bucket.whole, torch.long, out_device)
            bucket.whole_splits = foreach_splits([tensors[i].numel() for i in bucket.whole])
        if bucket.rows or bucket.packed:
            _build_rows(bucket, tensors, plan)
        if bucket.rescaled:
            rescaled = [tensors[i] for i in bucket.rescaled]
            bucket.rescale = build_rescale_plan(rescaled)  # type: ignore[arg-type]
            index = host_to_device(bucket.rescaled, torch.long, out_device)
            bucket.rescaled_index = torch.cat([index + band * plan.n for band in range(BANDS)])
    return plan


def host_to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A plan's index or bound list on ``device`` without a host wait: built on the host, then
    (accelerators) one ``non_blocking`` copy from pinned memory. ``torch.tensor(list,
    device=cuda)`` copies from pageable memory, which blocks until the device is idle: on a plan
    change (which gradients are None changed) the host would wait for the whole backward."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    # Accelerator path (untested on this project's CPU machines): the caching host allocator
    # keeps the pinned block alive until the copy has run.
    return host.pin_memory().to(device, non_blocking=True)


#: Elements of one foreach-norm scratch (float64s): 8 MiB. CUDA's ``_foreach_norm(dtype=...)``
#: allocates ``tensors x ceil(largest numel / 65536)`` partial sums per call (multi-tensor
#: apply chunks of 65,536 elements): one 1B-element tensor among 1,000 would cost 128 MB.
FOREACH_SCRATCH = 1 << 20
_FOREACH_CHUNK = 65536


def foreach_splits(numels: Sequence[int], cap: int = FOREACH_SCRATCH) -> list[slice]:
    """Consecutive slices of ``numels`` whose foreach-norm scratch, ``len(slice) x
    ceil(max numel / 65536)``, stays within ``cap`` (a single tensor always forms a slice).
    The norms are per tensor, so splitting changes no value, only the peak memory."""
    splits: list[slice] = []
    start, widest = 0, 0
    for i, numel in enumerate(numels):
        chunks = max(1, -(-numel // _FOREACH_CHUNK))
        wider = max(widest, chunks)
        if i > start and (i - start + 1) * wider > cap:
            splits.append(slice(start, i))
            start, wider = i, chunks
        widest = wider
    if numels:
        splits.append(slice(start, len(numels)))
    return splits


#: Float64 tensors on accelerators are normed through one persistent scratch of at most this
#: many float64s (8 MiB, as the foreach scratch bound above): larger tensors are read in chunks.
RESCALE_SCRATCH = FOREACH_SCRATCH


@dataclass
class _RescaleBatch:
    """One fill of the rescale scratch: ``slots[j]`` (a view of the scratch shaped like its
    source) receives ``sources[j]``: a tensor's position in the plan's list (the whole tensor),
    or ``(position, start, numel)``, a chunk of its flat view. Its rows are ``rows`` of the
    plan's row vectors; ``zero`` when other batches leave data in its padding."""

    slots: list[Tensor]
    sources: list[int | tuple[int, int, int]]
    used: int
    rows: slice
    zero: bool = False


@dataclass
class RescalePlan:
    """How :func:`rescaled_norms` reads ``k`` float64 tensors: batches of row-aligned slots in
    one scratch, and the owner (0..k-1) of every row. Built once per layout."""

    k: int
    scratch: Tensor
    batches: list[_RescaleBatch]
    owner: Tensor  # int64, one per row
    row_norms: Tensor  # float64, one per row (persistent: no per-step allocation)


def build_rescale_plan(
    tensors: Sequence[Tensor], scratch_numel: int = RESCALE_SCRATCH
) -> RescalePlan:
    """Lays ``tensors`` (float64, one device, each dense or of at most ``scratch_numel``
    elements) into row-aligned slots of a scratch of at most ``scratch_numel`` elements (a
    multiple of :data:`ROW_NUMEL`), batch after batch; a tensor larger than the scratch is cut
    into chunks of its flat view. O(len(tensors)) Python, once per layout."""
    assert scratch_numel % ROW_NUMEL == 0 and tensors
    device = tensors[0].device
    need = sum(_aligned(t.numel()) for t in tensors)
    scratch = torch.zeros(min(scratch_numel, need), dtype=torch.float64, device=device)
    batches: list[_RescaleBatch] = []
    owner: list[int] = []
    slots: list[Tensor] = []
    sources: list[int | tuple[int, int, int]] = []
    used = 0
    gaps = False

    def close() -> None:
        nonlocal slots, sources, used, gaps
        if slots:
            first = batches[-1].rows.stop if batches else 0
            rows = slice(first, first + used // ROW_NUMEL)
            batches.append(_RescaleBatch(slots, sources, used, rows, gaps))
        slots, sources, used, gaps = [], [], 0, False

    for pos, t in enumerate(tensors):
        numel = t.numel()
        pieces = (
            [(0, numel)]
            if numel <= scratch_numel
            else [(a, min(scratch_numel, numel - a)) for a in range(0, numel, scratch_numel)]
        )
        for start, m in pieces:
            if used + _aligned(m) > scratch_numel:
                close()
            view = scratch[used : used + m]
            slots.append(view.view(t.shape) if len(pieces) == 1 else view)
            sources.append(pos if len(pieces) == 1 else (pos, start, m))
            gaps = gaps or m % ROW_NUMEL != 0
            owner.extend([pos] * (_aligned(m) // ROW_NUMEL))
            used += _aligned(m)
    close()
    if len(batches) == 1:
        batches[0].zero = False  # one layout: its padding is never written, stays zero
    return RescalePlan(
        k=len(tensors),
        scratch=scratch,
        batches=batches,
        owner=host_to_device(owner, torch.long, device),
        row_norms=torch.empty(len(owner), dtype=torch.float64, device=device),
    )


def _scale_of(maxima: Tensor) -> Tensor:
    """``maxima`` where they are finite and positive, else 1: the divisor that brings values
    into [-1, 1] without creating a NaN, and leaves NaN/Inf and zeros as they are."""
    return torch.where((maxima > 0) & (maxima < math.inf), maxima, 1.0)


def rescaled_norms(plan: RescalePlan, tensors: Sequence[Tensor]) -> Tensor:
    """The float64 L2 norm of each of ``tensors`` (float64, laid out by ``plan``), exact over
    float64's whole range, on their device, with no host read and no gradient-sized
    temporary (the accelerator path for float64; on CPU, tests call it directly).

    Per batch, one ``_foreach_copy_`` fills the scratch; each row of :data:`ROW_NUMEL` elements
    is divided by its max-abs ``r`` and normed, ``row = r * ||row / r||``: every square is at
    most 1 (a row's sum at most 512), and those that underflow are below 2^-1022 of the row's
    largest, so nothing overflows and nothing that matters is lost. Per tensor, the largest
    row norm ``M`` (``scatter_reduce``) scales again: ``norm = M * sqrt(sum((row / M)^2))``.
    A constant number of ops per batch and per call, whatever the number of tensors (tensors
    larger than the scratch add one view per chunk). A zero tensor gives 0; NaN gives NaN and
    Inf (without NaN) Inf, as the divisors of non-finite or zero maxima are 1
    (:func:`_scale_of`).
    """
    flats: dict[int, Tensor] = {}
    for batch in plan.batches:
        if batch.zero:
            plan.scratch[: batch.used].zero_()  # padding the previous batch wrote into
        sources: list[Tensor] = []
        for src in batch.sources:
            if isinstance(src, int):
                sources.append(tensors[src])
                continue
            pos, start, numel = src
            flat = flats.get(pos)
            if flat is None:
                flat = flats[pos] = flat_view(tensors[pos])  # type: ignore[assignment]
                if flat is None:
                    raise _StalePlan  # no longer dense: plan again
            sources.append(flat[start : start + numel])
        torch._foreach_copy_(batch.slots, sources)
        rows = plan.scratch[: batch.used].view(-1, ROW_NUMEL)
        scale = _scale_of(torch.linalg.vector_norm(rows, math.inf, dim=1))
        rows.div_(scale.unsqueeze(1))
        out = plan.row_norms[batch.rows]
        torch.linalg.vector_norm(rows, 2, dim=1, out=out)
        out.mul_(scale)
    row_norms = plan.row_norms
    zeros = torch.zeros(plan.k, dtype=torch.float64, device=row_norms.device)
    top = _scale_of(zeros.scatter_reduce(0, plan.owner, row_norms, "amax"))
    ratios = (row_norms / top.index_select(0, plan.owner)).square_()
    return zeros.index_add_(0, plan.owner, ratios).sqrt_().mul_(top)


def bands_of_norms_device(norms: Tensor) -> Tensor:
    """:func:`bands_of_norm` of a float64 vector of ``k`` norms, on its device, branchless:
    ``[plain | high | low]`` (``3 * k`` values, each tensor's square in exactly one band; NaN,
    Inf and 0 in ``plain``). ``norm >= 2^450`` is ``frexp`` exponent ``> 450``, ``norm <
    2^-451`` exponent ``< -450``: the same bands as the host form."""
    finite = norms < math.inf  # False for NaN and Inf
    high = finite & (norms >= 2.0**BAND_EXPONENT)
    low = norms < 2.0 ** -(BAND_EXPONENT + 1)
    zero = torch.zeros((), dtype=norms.dtype, device=norms.device)
    return torch.cat(
        [
            torch.where(high | low, zero, norms.square()),
            torch.where(high, (norms * 2.0 ** -(HIGH_SHIFT // 2)).square(), zero),
            torch.where(low, (norms * 2.0 ** (LOW_SHIFT // 2)).square(), zero),
        ]
    )


def _aligned(numel: int) -> int:
    """``numel`` rounded up to whole rows."""
    return -(-numel // ROW_NUMEL) * ROW_NUMEL


def _build_rows(bucket: _Bucket, tensors: Sequence[Tensor | None], plan: NormPlan) -> None:
    """The float32 norms vector of ``bucket`` (row-path rows, then pack rows), each row's
    owner, the output slice of every norm op, and the pack buffer (zeros: padding never changes
    a norm) with one slot per packed tensor and per partial last row, shaped like its source so
    one ``_foreach_copy_`` fills every slot. Built with the plan, reused every step."""
    n_rows = sum(bucket.row_counts) + bucket.pack_used // ROW_NUMEL
    bucket.norms = torch.empty(n_rows, dtype=torch.float32, device=bucket.device)
    bucket.squares = torch.empty(n_rows, dtype=torch.float64, device=bucket.device)
    owner: list[int] = []
    at = 0
    widen = bucket.dtype != torch.float32
    if widen and bucket.rows:
        need = min(CONVERT_CHUNK, max(bucket.row_counts) * ROW_NUMEL)
        scratch = plan.scratch.get(bucket.device)
        if scratch is None or scratch.numel() < need:
            scratch = plan.scratch[bucket.device] = torch.empty(
                need, dtype=torch.float32, device=bucket.device
            )
    for i, count in zip(bucket.rows, bucket.row_counts, strict=True):
        out = bucket.norms[at : at + count]
        owner.extend([i] * count)
        at += count
        if not widen:
            bucket.row_outs.append(out)
            continue
        chunks = []
        full = count * ROW_NUMEL
        for start in range(0, full, CONVERT_CHUNK):
            m = min(CONVERT_CHUNK, full - start)
            buf = scratch[:m]
            first = start // ROW_NUMEL
            rows = out[first : first + m // ROW_NUMEL]
            chunks.append(_RowChunk(start, m, buf, buf.view(-1, ROW_NUMEL), rows))
        bucket.row_chunks.append(chunks)
    if bucket.pack_used:
        buffer = torch.zeros(bucket.pack_used, dtype=torch.float32, device=bucket.device)
        offset = 0
        sources = [(i, tensors[i].shape) for i in bucket.packed]  # type: ignore[union-attr]
        sources += [(i, (tensors[i].numel() % ROW_NUMEL,)) for i in bucket.tails]  # type: ignore[union-attr]
        for i, shape in sources:
            numel = math.prod(shape)
            bucket.pack_slots.append(buffer[offset : offset + numel].view(shape))
            owner.extend([i] * (_aligned(numel) // ROW_NUMEL))
            offset += _aligned(numel)
        bucket.pack_rows = buffer.view(-1, ROW_NUMEL)
        bucket.pack_out = bucket.norms[at:]
    if len(owner) >= CSR_MIN_ROWS:
        bucket.sum_rows = _segment_sum_matrix(owner, plan.n, bucket.device)
    else:
        bucket.owner = host_to_device(owner, torch.long, bucket.device)


def _segment_sum_matrix(owner: list[int], n: int, device: torch.device) -> Tensor:
    """Sparse CSR ``M`` (n x len(owner)) with ``M[owner[j], j] = 1``: ``M @ v`` sums ``v``'s
    entries per owner in float64, one op. On many rows it is several times faster than
    ``index_add_`` or ``segment_reduce``; its fixed cost (cold caches inside a training step)
    makes ``index_add_`` the faster under :data:`CSR_MIN_ROWS` rows (measurements:
    docs/design.md)."""
    owners = torch.tensor(owner, dtype=torch.long)
    # 32-bit indices when they fit: half the index memory (the matrix is persistent, one entry
    # per row of 512 elements) and a faster product.
    index = torch.int32 if len(owner) < 2**31 else torch.long
    columns = torch.argsort(owners, stable=True).to(index)
    crow = torch.zeros(n + 1, dtype=index)
    crow[1:] = torch.cumsum(torch.bincount(owners, minlength=n), 0)
    ones = torch.ones(len(owner), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta": we use mv only
        matrix = torch.sparse_csr_tensor(crow, columns, ones, size=(n, len(owner)))
    return matrix.to(device)


def _fill_row_norms(bucket: _Bucket, tensors: Sequence[Tensor | None]) -> None:
    """Writes the float32 norm of every row of ``bucket`` into ``bucket.norms``: packed
    tensors and partial last rows are copied (widened) into the pack buffer by one foreach op,
    row-path tensors are read in place through ``as_strided`` views of their memory (dense, so
    the first ``count * ROW_NUMEL`` elements in memory order are whole rows), bf16/fp16 ones
    widened chunk by chunk into the plan's scratch. Every norm writes into its slice of
    ``bucket.norms`` (``out=``): no per-step allocation but the views."""
    if bucket.pack_slots:
        sources: list[Tensor] = [tensors[i] for i in bucket.packed]  # type: ignore[misc]
        for i in bucket.tails:
            t = tensors[i]
            assert t is not None
            full = t.numel() // ROW_NUMEL * ROW_NUMEL
            sources.append(t.as_strided((t.numel() - full,), (1,), t.storage_offset() + full))
        torch._foreach_copy_(bucket.pack_slots, sources)
        torch.linalg.vector_norm(bucket.pack_rows, 2, dim=1, out=bucket.pack_out)
    for i, stride in zip(bucket.rows, bucket.row_strides, strict=True):
        t = tensors[i]
        assert t is not None
        if t.stride() != stride or t.device != bucket.device:
            raise _StalePlan  # as_strided would read the wrong memory: plan again
    if bucket.row_chunks:
        for i, chunks in zip(bucket.rows, bucket.row_chunks, strict=True):
            t = tensors[i]
            assert t is not None
            offset = t.storage_offset()
            for c in chunks:
                c.scratch.copy_(t.as_strided((c.numel,), (1,), offset + c.start))
                torch.linalg.vector_norm(c.rows, 2, dim=1, out=c.out)
    else:
        for i, count, out in zip(bucket.rows, bucket.row_counts, bucket.row_outs, strict=True):
            t = tensors[i]
            assert t is not None
            rows = t.as_strided((count, ROW_NUMEL), (ROW_NUMEL, 1))
            torch.linalg.vector_norm(rows, 2, dim=1, out=out)


def exact_norm(t: Tensor) -> float:
    """``||t||`` computed in float64 chunk by chunk (rare path: repair and references).

    Low-precision inputs accumulate in float64, which cannot overflow or underflow for them.
    A float64 chunk whose plain norm is non-finite or tiny is rescaled by its max-abs (tensor
    ops); chunk norms combine by ``math.hypot``, so no square of a Python float is ever formed.
    Returns a Python float: NaN when ``t`` holds NaN, Inf when it holds Inf (and no NaN) or
    its norm exceeds float64.
    """
    flat = flat_view(t)
    if flat is None:
        flat = t.reshape(-1)  # copies; only for overlapping/exotic strides
    chunks = list(flat.split(RECOMPUTE_CHUNK))
    if not chunks:
        return 0.0
    norms = torch.stack(torch._foreach_norm(chunks, 2, dtype=torch.float64)).cpu().tolist()
    if t.dtype == torch.float64:
        for k, (chunk, norm) in enumerate(zip(chunks, norms, strict=True)):
            if math.isfinite(norm) and norm >= TINY_NORM_FLOAT64:
                continue
            amax = chunk.abs().max()
            if not bool(torch.isfinite(amax)) or float(amax) == 0.0:
                continue  # NaN/Inf (the plain norm says which) or all zeros
            norms[k] = float(amax) * float(torch.linalg.vector_norm(chunk / amax, 2))
    if any(x != x for x in norms):
        return math.nan  # hypot would let an Inf hide a NaN
    return math.hypot(*norms)


def bands_of_norm(norm: float) -> tuple[int, float]:
    """The band (0 plain, 1 high, 2 low) of a tensor of norm ``norm`` and the value it holds
    there (see the module docstring). NaN and Inf go to the plain band."""
    if not math.isfinite(norm) or norm == 0.0:
        return 0, norm * norm
    exponent = math.frexp(norm)[1]
    if exponent > BAND_EXPONENT:
        scaled = math.ldexp(norm, -HIGH_SHIFT // 2)
        return 1, scaled * scaled
    if exponent < -BAND_EXPONENT:
        scaled = math.ldexp(norm, LOW_SHIFT // 2)
        return 2, scaled * scaled
    return 0, norm * norm


def norm_from_bands(plain: float, high: float, low: float) -> float:
    """``sqrt(plain + high * 2^HIGH_SHIFT + low * 2^-LOW_SHIFT)`` without forming a value
    outside float64: the largest non-zero band sets the scale. +Inf when the norm exceeds
    float64; NaN/Inf in ``plain`` propagate."""
    if high != 0.0:
        inner = high + math.ldexp(plain, -HIGH_SHIFT) + math.ldexp(low, -HIGH_SHIFT - LOW_SHIFT)
        # A product overflows to +inf (math.ldexp would raise): a norm beyond float64 is inf.
        return math.sqrt(inner) * 2.0 ** (HIGH_SHIFT // 2)
    if plain != 0.0:
        return math.sqrt(plain + math.ldexp(low, -LOW_SHIFT))
    return math.ldexp(math.sqrt(low), -LOW_SHIFT // 2)


def norm_from_bands_device(plain: Tensor, high: Tensor, low: Tensor) -> Tensor:
    """:func:`norm_from_bands` of 0-dim float64 tensors (band sums), on their device, no host
    read: a constant number of ops. Powers of two beyond float64 are applied in two halves."""
    half_high = 2.0 ** -(HIGH_SHIFT // 2)
    half_low = 2.0 ** -(LOW_SHIFT // 2)
    from_high = high + plain * half_high * half_high + low * half_low * half_high * half_high
    from_high = from_high.sqrt() * (1.0 / half_high)
    from_plain = (plain + low * half_low * half_low).sqrt()
    from_low = low.sqrt() * half_low
    return torch.where(high != 0, from_high, torch.where(plain != 0, from_plain, from_low))


def banded_total_device(bands: Tensor, n: int) -> Tensor:
    """The L2 norm of every tensor together from a banded vector (``BANDS * n`` long) of
    squared norms, a 0-dim float64 tensor on its device, no host read."""
    sums = bands.view(BANDS, n).sum(dim=1)
    return norm_from_bands_device(sums[0], sums[1], sums[2])


def _fast_squared_norms(plan: NormPlan, tensors: Sequence[Tensor | None]) -> Tensor:
    """The fast path of :meth:`NormEngine.squared_norms`, before any repair."""
    out_device = plan.out_device
    banded = torch.zeros(BANDS * plan.n, dtype=torch.float64, device=out_device)
    sq = banded[: plan.n]  # the plain band: the fast path never leaves it
    for bucket in plan.buckets:
        if bucket.norms is not None:
            _fill_row_norms(bucket, tensors)
            # Float32 row norms, squared and summed per tensor in float64: 3 ops for all
            # the rows of the bucket, whatever the number of tensors, into buffers of the
            # plan. n scalars cross devices (if at all), never gradient data.
            assert bucket.squares is not None
            # One op: squared in float32 (the norms' dtype; rounding 6e-8 relative), written
            # as float64. A finite float32 row norm is sqrt of a float32 sum, so its square
            # fits float32; rows too tiny to square were already tiny inside the kernel, and
            # such tensors are repaired below.
            row_sq = torch.mul(bucket.norms, bucket.norms, out=bucket.squares)
            if bucket.sum_rows is not None:
                summed = (bucket.sum_rows @ row_sq).to(out_device)
            else:
                assert bucket.owner is not None
                summed = torch.zeros(plan.n, dtype=torch.float64, device=bucket.device)
                summed = summed.index_add_(0, bucket.owner, row_sq).to(out_device)
            sq.add_(summed)
        if bucket.whole:
            items = [tensors[i] for i in bucket.whole]
            norms = torch.stack(
                [
                    norm
                    for part in bucket.whole_splits
                    for norm in torch._foreach_norm(items[part], 2, dtype=torch.float64)
                ]
            )
            assert bucket.whole_index is not None
            sq.index_copy_(0, bucket.whole_index, norms.to(out_device).square())
        if bucket.rescale is not None:
            items = [tensors[i] for i in bucket.rescaled]
            bands = bands_of_norms_device(rescaled_norms(bucket.rescale, items))  # type: ignore[arg-type]
            assert bucket.rescaled_index is not None
            banded.index_copy_(0, bucket.rescaled_index, bands.to(out_device))
    return banded


class NormEngine:
    """Computes per-tensor squared L2 norms into one float64 vector, caching the plan.

    Sync behaviour: on accelerators no host read at all; on CPU at most one host read per call
    (the repair mask), counted in :attr:`host_reads`. Not thread-safe: use from one thread.
    ``rescale_float64``: CPU float64 tensors take the accelerator's rescaled path instead of
    the repair (for tests of that path on a CPU; see :func:`build_plan`).
    """

    def __init__(self, rescale_float64: bool = False) -> None:
        self._plan: NormPlan | None = None
        self._key: tuple | None = None
        self._rescale_float64 = rescale_float64
        self.host_reads = 0

    def plan_for(
        self, tensors: Sequence[Tensor | None], out_device: torch.device, replan: bool = False
    ) -> NormPlan:
        key = (out_device, _layout_key(tensors))
        if replan or self._plan is None or key != self._key:
            self._plan = None  # free the old plan's buffers before allocating the new ones
            self._plan = build_plan(tensors, out_device, self._rescale_float64)
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

    @torch.no_grad()
    def squared_norms_and_plan(
        self, tensors: Sequence[Tensor | None], out_device: torch.device | None = None
    ) -> tuple[Tensor, NormPlan]:
        """:meth:`squared_norms`, and the plan that computed them: its buckets group these
        very tensors by (device, dtype), which clipping reuses (:mod:`gradwatch.clip`)."""
        if out_device is None:
            out_device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        if out_device.type != "cpu" and all(t is None or t.device.type == "cpu" for t in tensors):
            # Gradients on the CPU, output on an accelerator (FSDP2 CPU offload): norm and
            # repair on the host, then one non-blocking copy from pinned memory. Normed with a
            # CUDA output, each bucket's result would cross by a blocking pageable copy and the
            # repair check would read its index list back from the device. (CUDA path:
            # untested on this project's machines.)
            sq, plan = self.squared_norms_and_plan(tensors, torch.device("cpu"))
            staged = torch.empty(sq.shape, dtype=sq.dtype, pin_memory=True)
            staged.copy_(sq)
            return staged.to(out_device, non_blocking=True), plan
        plan = self.plan_for(tensors, out_device)
        try:
            sq = _fast_squared_norms(plan, tensors)
        except (_StalePlan, RuntimeError):
            # A device or stride the cheap layout key does not read changed: plan again, once
            # (a second failure is a real error and propagates).
            plan = self.plan_for(tensors, out_device, replan=True)
            sq = _fast_squared_norms(plan, tensors)
        if plan.needs_repair:
            assert plan.repair_floor is not None
            plain = sq[: plan.n]
            # NaN and +Inf become -1, below every floor: 3 ops instead of isfinite's 5 + 2.
            cleaned = plain.nan_to_num(nan=-1.0, posinf=-1.0, neginf=-1.0)
            suspicious = cleaned < plan.repair_floor
            if plan.repair_ceiling is not None:
                suspicious |= cleaned > plan.repair_ceiling
            bad = torch.nonzero(suspicious).flatten().tolist()
            self.host_reads += 1
            if bad:
                where: list[int] = []
                fixed: list[float] = []
                for i in bad:
                    band, value = bands_of_norm(exact_norm(tensors[i]))  # type: ignore[arg-type]
                    where += [i, band * plan.n + i] if band else [i]
                    fixed += [0.0, value] if band else [value]
                sq.index_put_(
                    (torch.tensor(where, dtype=torch.long, device=out_device),),
                    torch.tensor(fixed, dtype=torch.float64, device=out_device),
                )
        return sq, plan


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
