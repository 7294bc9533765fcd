"""Float64 norms on accelerators, rescaled: exact over float64's whole finite range.

A float64 square overflows above about 1e154 and underflows below about 1e-154, and the CPU
repair of :mod:`gradwatch.norms.stats` needs a host read. So each float64 bucket is copied, one
``_foreach_copy_`` per fill, into row-aligned slots of one persistent scratch of
:data:`RESCALE_SCRATCH` elements (larger tensors in chunks of their flat view); every row of
:data:`~gradwatch.norms.rows.ROW_NUMEL` is divided by its max-abs ``r`` and normed,
``row = r * ||row / r||``; per tensor, with ``M`` its largest row norm,
``norm = M * sqrt(sum((row / M)^2))``. Branchless, no host read, a constant number of ops per
fill. The same code runs on CPU with ``NormEngine(rescale_float64=True)`` (tests).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.norms.rows import (
    FOREACH_SCRATCH,
    ROW_NUMEL,
    SegmentReduction,
    StalePlan,
    aligned,
    flat_view,
    host_to_device,
)

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
    # Per-tensor maxima and sums of the rows, in a fixed order of operations on every device
    # (index_add_ and scatter_reduce add by atomics on CUDA: replicas could disagree in the
    # last bits)
    per_tensor: SegmentReduction


def build_rescale_plan(
    tensors: Sequence[Tensor], scratch_numel: int = RESCALE_SCRATCH
) -> RescalePlan:
    """Lays ``tensors`` (float64, one device, each dense or of at most ``scratch_numel``
    elements) into row-aligned slots of a scratch of at most ``scratch_numel`` elements (a
    multiple of :data:`ROW_NUMEL`), batch after batch; a tensor larger than the scratch is cut
    into chunks of its flat view. O(len(tensors)) Python, once per layout."""
    assert scratch_numel % ROW_NUMEL == 0 and tensors
    device = tensors[0].device
    need = sum(aligned(t.numel()) for t in tensors)
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
            if used + aligned(m) > scratch_numel:
                close()
            view = scratch[used : used + m]
            slots.append(view.view(t.shape) if len(pieces) == 1 else view)
            sources.append(pos if len(pieces) == 1 else (pos, start, m))
            gaps = gaps or m % ROW_NUMEL != 0
            owner.extend([pos] * (aligned(m) // ROW_NUMEL))
            used += aligned(m)
    close()
    if len(batches) == 1:
        batches[0].zero = False  # one layout: its padding is never written, stays zero
    return RescalePlan(
        k=len(tensors),
        scratch=scratch,
        batches=batches,
        owner=host_to_device(owner, torch.long, device),
        row_norms=torch.empty(len(owner), dtype=torch.float64, device=device),
        per_tensor=SegmentReduction(_runs(owner, len(tensors)), len(owner), device),
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
    row norm ``M`` scales again: ``norm = M * sqrt(sum((row / M)^2))`` (maxima and sums per
    tensor in a fixed order: :class:`~gradwatch.norms.rows.SegmentReduction`).
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
                    raise StalePlan  # no longer dense: plan again
            sources.append(flat[start : start + numel])
        torch._foreach_copy_(batch.slots, sources)
        rows = plan.scratch[: batch.used].view(-1, ROW_NUMEL)
        scale = _scale_of(torch.linalg.vector_norm(rows, math.inf, dim=1))
        rows.div_(scale.unsqueeze(1))
        out = plan.row_norms[batch.rows]
        torch.linalg.vector_norm(rows, 2, dim=1, out=out)
        out.mul_(scale)
    row_norms = plan.row_norms
    top = _scale_of(plan.per_tensor(row_norms, "amax"))
    ratios = (row_norms / top.index_select(0, plan.owner)).square_()
    return plan.per_tensor(ratios, "sum").sqrt_().mul_(top)


def _runs(owner: list[int], k: int) -> list[list[int]]:
    """The rows of each of ``k`` tensors, from every row's owner."""
    rows: list[list[int]] = [[] for _ in range(k)]
    for j, pos in enumerate(owner):
        rows[pos].append(j)
    return rows


