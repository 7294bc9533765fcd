"""The CPU repair of the norm engine: exact float64 recomputation of the few tensors whose fast
squared norm cannot be trusted.

The engine's CPU fast paths square in float32 (rows) or in float64 without rescaling (float64
tensors): a float32 square overflows above about 1.8e19 and underflows below about 1e-19, a
float64 one outside about ``[1e-154, 1e154]``. Each position of a plan has bounds (a floor, a
ceiling); :func:`suspicious` finds the positions whose fast square is NaN, infinite or out of
its bounds by one host read, and :func:`repair_` recomputes them by :func:`exact_norm` and
writes each into its band (:mod:`gradwatch.norms.bands`). docs/design.md, "The local math".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from gradwatch.norms.bands import bands_of_norm
from gradwatch.norms.rows import flat_view

#: Exact recomputation walks a tensor in chunks of this many elements (bounds temporaries).
RECOMPUTE_CHUNK = 65536
#: Float64 tensors whose norm is below this (or non-finite) are recomputed with rescaling.
TINY_NORM_FLOAT64 = 1e-140


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


def suspicious(
    plain: Tensor,
    host_bounds: Sequence[tuple[float, float]] | None,
    floor: Tensor | None,
    ceiling: Tensor | None,
) -> list[int]:
    """The positions whose fast squared norm (``plain``, on the CPU) is NaN, infinite, below
    its floor or above its ceiling: one host read. Few positions (``host_bounds`` given): the
    band itself is read and compared on the host (no other op); many: four ops against the
    ``floor``/``ceiling`` tensors and a read of the index list."""
    if host_bounds is not None:
        return [
            i for i, (v, (lo, hi)) in enumerate(zip(plain.tolist(), host_bounds, strict=True))
            if not lo <= v < math.inf or v > hi  # NaN fails every comparison
        ]
    assert floor is not None
    # NaN and +Inf become -1, below every floor: 3 ops instead of isfinite's 5 + 2.
    cleaned = plain.nan_to_num(nan=-1.0, posinf=-1.0, neginf=-1.0)
    flagged = cleaned < floor
    if ceiling is not None:
        flagged |= cleaned > ceiling
    return torch.nonzero(flagged).flatten().tolist()


def repair_(banded: Tensor, n: int, positions: Sequence[int],
            tensors: Sequence[Tensor | None]) -> None:
    """Recompute each of ``positions`` exactly (:func:`exact_norm`) and write it into its band
    of ``banded`` (``BANDS * n`` long; the plain entry zeroed when it goes to another band):
    one ``index_put_``."""
    where: list[int] = []
    fixed: list[float] = []
    for i in positions:
        band, value = bands_of_norm(exact_norm(tensors[i]))  # type: ignore[arg-type]
        where += [i, band * n + i] if band else [i]
        fixed += [0.0, value] if band else [value]
    banded.index_put_(
        (torch.tensor(where, dtype=torch.long, device=banded.device),),
        torch.tensor(fixed, dtype=torch.float64, device=banded.device),
    )
