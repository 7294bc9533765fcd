"""The row geometry every norm engine shares, and the small helpers around it.

Gradients are normed as rows of :data:`ROW_NUMEL` elements (:mod:`gradwatch.norms.stats`, and
the per-rank view's comm hook in :mod:`gradwatch.stacks.ddp_hook`): this module holds that one
row length, each row-path tensor's row length (:func:`row_length`), row-aligned slot sizes and
the pack buffer's fills (:func:`pack_fills`), flat views of dense tensors, the foreach-norm
split that bounds its scratch, and the one non-blocking host-to-device copy; and the two row
paths' shared parts: :class:`RowSquares` (float32 row norms squared into float64 and summed
per owner, the end of every row path) and :class:`FlatRows` (one flat buffer of many tensors
read in place as rows, the comm hook's layout).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Larger CPU tensors are normed in float32 over rows of this many elements.
ROW_NUMEL = 512
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


class StalePlan(Exception):
    """A row-path tensor's device or strides changed under an unchanged layout key."""


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


def pinned_to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` by one non-blocking copy from pinned memory (as is on the
    CPU): the host engine's vector joining a device one, never a blocking pageable copy."""
    if device.type == "cpu":
        return host
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device`` without a host wait: mixed CPU and accelerator gradients send
    their CPU bucket's O(parameters) figures by one ``non_blocking`` copy from pinned memory (a
    pageable copy would block until the device is idle). The packed vector follows the
    accelerator (:meth:`gradwatch.reduce.packing.Reducer.follow`), so nothing here reads a device
    back."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type != "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)  # untested: no GPU in CI
    return tensor.to(device, non_blocking=True)


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


def aligned(numel: int) -> int:
    """``numel`` rounded up to whole rows."""
    return -(-numel // ROW_NUMEL) * ROW_NUMEL


#: Row-path tensors whose numel has a divisor in ``[MIN_ROW_NUMEL, ROW_NUMEL]`` are read as
#: rows of that divisor (:func:`row_length`): CPU row norms of 256 elements and more run at
#: the speed of 512 (shorter rows cost more per element).
MIN_ROW_NUMEL = 256
#: Above this many elements a tensor keeps rows of ROW_NUMEL and its partial last row: rows of
#: 500 cost 3-5% more per element than 512 (measured), which beyond it outweighs the two ops
#: and the copy a partial row costs.
DIVISOR_ROWS_MAX_NUMEL = 1 << 19


def row_length(numel: int) -> int:
    """The row length of a row-path tensor of ``numel`` elements: :data:`ROW_NUMEL`, or, up to
    :data:`DIVISOR_ROWS_MAX_NUMEL` elements, the largest divisor of ``numel`` in
    ``[MIN_ROW_NUMEL, ROW_NUMEL]`` when there is one, so the tensor is whole rows (no partial
    last row to copy into the pack: two fewer ops and a copy). Shorter rows stay within the
    bound (docs/design.md, "Exactness of the rows": the measured worst case per path)."""
    if numel % ROW_NUMEL == 0 or numel > DIVISOR_ROWS_MAX_NUMEL:
        return ROW_NUMEL
    for length in range(ROW_NUMEL - 1, MIN_ROW_NUMEL - 1, -1):
        if numel % length == 0:
            return length
    return ROW_NUMEL


#: Per fill of a pack buffer: ``(source, shape, offset)`` of each slot, and the elements used.
FillLayout = list[tuple[list[tuple[int, tuple[int, ...], int]], int]]


def pack_fills(items: Sequence[tuple[int, tuple[int, ...]]], cap: int) -> FillLayout:
    """A pack buffer's fills for ``items`` (``(source, shape)`` each, in order): per fill,
    ``(source, shape, offset)`` of every slot and the elements it uses; slots are row-aligned
    and a fill uses at most ``cap`` elements."""
    fills: FillLayout = []
    current: list[tuple[int, tuple[int, ...], int]] = []
    used = 0
    for src, shape in items:
        size = aligned(math.prod(shape))
        if current and used + size > cap:
            fills.append((current, used))
            current, used = [], 0
        current.append((src, shape, used))
        used += size
    if current:
        fills.append((current, used))
    return fills


def written_by_other_fills(fills: FillLayout, length: int) -> list[int]:
    """Prefix counts of the buffer's elements some fill writes data into: a slot's padding
    ``[a, b)`` must be zeroed by its own fill when ``counts[b] > counts[a]`` (padding never
    holds its own fill's data, so any data there is another fill's, left over). One fill:
    nothing to zero."""
    if len(fills) < 2:
        return [0] * (length + 1)
    delta = [0] * (length + 1)
    for items, _ in fills:
        for _, shape, offset in items:
            delta[offset] += 1
            delta[offset + math.prod(shape)] -= 1
    written = (depth > 0 for depth in itertools.accumulate(delta[:length]))
    return [0, *itertools.accumulate(written)]


def segment_sum_matrix(owner: list[int], n: int, device: torch.device) -> Tensor:
    """Sparse CSR ``M`` (n x len(owner)) with ``M[owner[j], j] = 1``: ``M @ v`` sums ``v``'s
    entries per owner in float64, one op, each output's additions in a fixed order (unlike
    ``index_add_``, which adds by atomics on CUDA). On many rows it is several times faster than
    ``index_add_`` or ``segment_reduce``; its fixed cost (cold caches inside a training step)
    makes ``index_add_`` the faster on the CPU under ``CSR_MIN_ROWS`` rows (measurements:
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


#: Values a :class:`SegmentReduction` combines per step of its tree (one row of a 2-D reduce).
SEGMENT_WIDTH = 32


class SegmentReduction:
    """Per-segment sums (or maxima) of a vector in a fixed order, by dense ops only.

    ``segments[s]`` lists the positions of the input that segment ``s`` combines (any order,
    possibly none). Built once on the host: the members are cut into blocks of
    :data:`SEGMENT_WIDTH` (the last one padded with a zero), each block reduced along a row
    of one 2-D ``sum``/``amax``, and the block results reduced the same way until one value per
    segment is left: ``ceil(log_32(longest segment))`` rounds of three ops (append the zero,
    ``index_select``, reduce), whatever the number of segments. A row reduction adds its
    elements in an order fixed by the shape alone, so the result is the same bit for bit on
    every run and every rank holding the same values; no atomics (``index_add_``,
    ``scatter_add_``, ``scatter_reduce`` add in arrival order on CUDA) and no sparse product
    (torch documents no determinism for sparse-dense products on CUDA but under
    ``torch.use_deterministic_algorithms``). Values must be non-negative, NaN or +Inf (squares
    and norms): the zero padding changes no sum or maximum of such values.
    """

    def __init__(
        self, segments: Sequence[Sequence[int]], length: int, device: torch.device
    ) -> None:
        self.n = len(segments)
        self.length = length  # of the input vector
        rounds: list[list[int]] = []
        members = [list(s) for s in segments]
        width = length  # the current round's input length: the zero is appended at its end
        while True:
            blocks: list[list[int]] = []
            nxt: list[list[int]] = []
            for seg in members:
                cut = [seg[i : i + SEGMENT_WIDTH] for i in range(0, len(seg), SEGMENT_WIDTH)]
                cut = cut or [[]]
                nxt.append(list(range(len(blocks), len(blocks) + len(cut))))
                blocks.extend(cut)
            rounds.append(
                [b[k] if k < len(b) else width for b in blocks for k in range(SEGMENT_WIDTH)]
            )
            members, width = nxt, len(blocks)
            if all(len(seg) == 1 for seg in members):
                break
        self.rounds = [torch.tensor(r, dtype=torch.long).to(device) for r in rounds]

    def __call__(self, values: Tensor, op: str = "sum") -> Tensor:
        """Per segment, the sum (``op="sum"``) or the maximum (``"amax"``; 0 for an empty
        segment) of ``values`` (:attr:`length` long) at its positions: :attr:`n` values."""
        out = values
        for index in self.rounds:
            extended = torch.cat([out, out.new_zeros(1)])
            rows = extended.index_select(0, index).view(-1, SEGMENT_WIDTH)
            out = rows.sum(dim=1) if op == "sum" else rows.amax(dim=1)
        return out


@dataclass
class RowSquares:
    """Float32 row norms, squared into float64 and added per owner: the last step of every row
    path (the engine's buckets in :mod:`gradwatch.norms.stats`, the comm hook's buffers through
    :class:`FlatRows`). Built once per layout; ``norms`` is where the norm ops write (``out=``).

    Squared in float32 and written as float64, one op: a finite float32 row norm is the square
    root of a float32 sum, so its square fits float32 (rounding 6e-8 relative), and a row too
    tiny to square was already as tiny inside the norm's kernel. Summed per owner by
    ``index_add_``, or by a sparse-CSR product (``sum_rows``; a fixed order of additions,
    which accelerators need: ``index_add_`` adds by atomics there)."""

    norms: Tensor  # float32, one per row
    squares: Tensor  # float64, one per row (persistent: no per-step allocation)
    owner: Tensor | None = None  # for each row, its output slot (``index_add_`` path)
    sum_rows: Tensor | None = None  # or the CSR (outputs x rows) of ones

    @classmethod
    def build(
        cls,
        owner: Sequence[int],
        outputs: int,
        device: torch.device,
        csr: bool,
        norms: Tensor | None = None,
    ) -> RowSquares:
        """Rows owned by ``owner`` (one output slot in ``[0, outputs)`` per row) on
        ``device``, summed by the CSR product when ``csr``; ``norms``: the float32 row-norm
        vector the norm ops already write into (views of it), else a new one."""
        if norms is None:
            norms = torch.empty(len(owner), dtype=torch.float32, device=device)
        return cls(
            norms=norms,
            squares=torch.empty(len(owner), dtype=torch.float64, device=device),
            owner=None if csr else host_to_device(owner, torch.long, device),
            sum_rows=segment_sum_matrix(list(owner), outputs, device) if csr else None,
        )

    def add_to(self, into: Tensor) -> None:
        """``into[owner[j]] += norms[j]**2`` for every row ``j``, in float64 (``into`` may sit
        on another device: then the per-owner sums cross by one non-blocking copy)."""
        squares = torch.mul(self.norms, self.norms, out=self.squares)
        if self.sum_rows is not None:
            into.add_(to_device(self.sum_rows @ squares, into.device))
        elif into.device == squares.device:
            assert self.owner is not None
            into.index_add_(0, self.owner, squares)
        else:
            assert self.owner is not None
            summed = torch.zeros(into.shape, dtype=torch.float64, device=squares.device)
            into.add_(to_device(summed.index_add_(0, self.owner, squares), into.device))


class FlatRows:
    """One flat float32 buffer holding tensors back to back (a DDP bucket), read in place as
    rows of :data:`ROW_NUMEL`: the squared norm of every owner's elements, in a constant
    number of ops whatever the number of tensors.

    A *pure* row (every element one owner's) is normed whole in float32 (one
    ``vector_norm(rows, dim=1)`` for all of them, then :class:`RowSquares`); the elements of
    the few rows that straddle two owners, and of the partial last row, are *loose*: read by
    one ``index_select``, squared in float64 and added to their owners by one ``index_add_``
    (their rows go to the discard slot). Seven ops per buffer; the whole-row view is made once,
    here, and reads the buffer's current values.
    """

    def __init__(
        self, buffer: Tensor, spans: Sequence[tuple[int, int, int]], discard: int
    ) -> None:
        """``spans``: ``(start, numel, owner)`` of each tensor within ``buffer`` (contiguous,
        float32), owners in ``[0, discard)``; elements of no span belong to ``discard``."""
        n = buffer.numel()
        owner = torch.full((n,), discard, dtype=torch.long)
        for start, numel, slot in spans:
            owner[start : start + numel] = slot
        rows = n // ROW_NUMEL
        by_row = owner[: rows * ROW_NUMEL].view(rows, ROW_NUMEL)
        pure = (by_row == by_row[:, :1]).all(dim=1)
        mixed = torch.nonzero(~pure).flatten()[:, None] * ROW_NUMEL + torch.arange(ROW_NUMEL)
        self.loose = torch.cat([mixed.flatten(), torch.arange(rows * ROW_NUMEL, n)])
        self.loose_owner = owner[self.loose]
        self.row_view = buffer[: rows * ROW_NUMEL].view(rows, ROW_NUMEL)
        row_owner = torch.where(pure, by_row[:, 0], discard).tolist()
        self.rows = RowSquares.build(row_owner, discard + 1, buffer.device, csr=False)

    def add_squares(self, buffer: Tensor, into: Tensor) -> None:
        """Add each owner's squared norm over ``buffer`` (the buffer this was built for: its
        rows are read through the view made then) into ``into`` (float64, ``discard + 1``)."""
        if self.row_view.numel():
            torch.linalg.vector_norm(self.row_view, 2, dim=1, out=self.rows.norms)
            self.rows.add_to(into)
        if self.loose.numel():
            values = buffer.index_select(0, self.loose).to(torch.float64)
            into.index_add_(0, self.loose_owner, values.square_())
