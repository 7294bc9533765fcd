"""The band codec: squared norms that float64 cannot hold, carried exactly as three bands.

A float64 gradient's squared norm may lie outside float64's range (norms above
about 1e154 or below about 1e-154) while its norm does not. So the engine's output has three
*bands* of ``n`` entries each, ``[plain | high | low]``: a tensor's squared norm ``s`` is in
exactly one of them (the others hold 0): ``plain`` holds ``s`` itself when the norm is within
``[2^-450, 2^450]`` (every float32/bf16/fp16 norm is), ``high`` holds ``s * 2^-1100`` above it
and ``low`` holds ``s * 2^1200`` below it. Every band value is a normal float64 no larger than
2^948, so band sums over many tensors and ranks (the all-reduce) neither overflow nor lose
precision, and NaN/Inf always sit in ``plain``. :func:`norm_from_bands` (host) and
:func:`norm_from_bands_device` turn band sums back into a norm, which float64 represents
whenever the true norm is finite; a norm that truly overflows float64 is +inf.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Norms in ``[2^-BAND_EXPONENT, 2^BAND_EXPONENT]`` travel as plain squares.
BAND_EXPONENT = 450
#: The high band holds ``s * 2^-HIGH_SHIFT``, the low band ``s * 2^LOW_SHIFT`` (``s`` squared).
HIGH_SHIFT = 1100
LOW_SHIFT = 1200
#: The number of bands: the engine's output is ``BANDS * n`` long.
BANDS = 3


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
    squared norms, a 0-dim float64 tensor on its device, no host read: the band sums
    combined by :func:`norm_from_band_sums_device`."""
    return norm_from_band_sums_device(bands.view(BANDS, n).sum(dim=1))


#: Per device: the constant vectors of :func:`norm_from_band_sums_device`.
_COMBINE: dict[torch.device, tuple[Tensor, Tensor, Tensor, Tensor]] = {}


def _combine_constants(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    constants = _COMBINE.get(device)
    if constants is None:
        hh, hl = 2.0 ** -(HIGH_SHIFT // 2), 2.0 ** -(LOW_SHIFT // 2)
        rows = ([hh, 0.0, hl], [hl, hh, 0.0], [1.0, 1.0 / hh, hl], [2.0, 4.0, 1.0])
        constants = _COMBINE[device] = tuple(  # type: ignore[assignment]
            torch.tensor(r, dtype=torch.float64).to(device) for r in rows
        )
    return constants  # type: ignore[return-value]


def norm_from_band_sums_device(sums: Tensor) -> Tensor:
    """:func:`norm_from_bands_device` of the band sums ``[plain, high, low]`` (a float64
    3-vector), in nine small ops instead of some twenty: the three candidates at once,
    ``c = [plain + low 2^-1200, high + plain 2^-1100, low]`` (each power of two applied in two
    halves, as there), ``sqrt(c) * [1, 2^550, 2^-600]``, and the one of the largest non-zero
    band (high, then plain, then low: the first maximum of ``(sums != 0) * [2, 4, 1]``).
    The high candidate leaves out ``low * 2^-2300``: at most ``2^-1400`` per entry against a
    high band sum of at least ``2^-200``, below half an ulp of it. Deterministic ops only
    (``argmax`` returns the first maximum on every device), no host read."""
    first, second, scale, priority = _combine_constants(sums.device)
    halves = torch.roll(sums * first, 1)  # [low 2^-600, plain 2^-550, 0]
    candidates = torch.addcmul(sums, halves, second).sqrt_().mul_(scale)
    return torch.take(candidates, torch.argmax((sums != 0) * priority))


