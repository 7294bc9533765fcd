"""Independent float64 references the unit tests compare gradwatch's figures with: norms from
the exact values (numpy float64, scaled, ``math.fsum``), and the documented health and ratio
formulas re-implemented (gradwatch's own helpers are never the reference)."""

from __future__ import annotations

import math

import numpy as np
import torch

#: Exponent ranges (base 2) of finite values each dtype covers in the contract.
EXP_RANGE = {
    torch.float64: (-498, 498),  # [1e-150, 1e150]
    torch.float32: (-149, 127),
    torch.bfloat16: (-133, 127),
    torch.float16: (-24, 15),
}


def ref_norm(tensors: list[torch.Tensor]) -> float:
    """Independent float64 reference: exact values as float64 (numpy), scaled by the max-abs so
    no square can overflow or underflow, pairwise-summed squares, fsum across tensors."""
    arrays = []
    for t in tensors:
        t = t.detach()
        if t.is_sparse:
            t = t.to_dense()
        a = t.to(torch.complex128).numpy() if t.is_complex() else t.double().numpy()
        arrays.append(np.abs(a).ravel())
    top = max((float(a.max()) for a in arrays if a.size), default=0.0)
    if top == 0.0:
        return 0.0
    if not math.isfinite(top):
        return top
    return top * math.sqrt(math.fsum(float(np.sum(np.square(a / top))) for a in arrays))


def rel_err(got: float, want: float) -> float:
    if want == 0.0:
        return abs(got)
    return abs(got - want) / want


def values(shape, dtype, lo, hi, gen) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Random signed values with base-2 exponents uniform in [lo, hi], exactly representable."""
    e = torch.empty(shape, dtype=torch.float64).uniform_(lo, hi, generator=gen)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1
    return (sign * torch.exp2(e)).to(dtype)


def ref_health(n: int, v: int, e: int, global_norm: float) -> float:
    if n == 0:
        return math.nan  # no gradient at all: nothing to judge
    if not math.isfinite(global_norm):
        return 0.0
    x = 1.0 - 0.5 * v / n - 0.8 * e / n
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def ref_ratio(nn: float, nnumel: int, dn: float, dnumel: int) -> float:
    """NaN when undefined (the denominator has no gradient, a norm below 1e-8 or non-finite);
    0 for a numerator without gradient (or a norm below 1e-8) over a defined denominator."""
    if dnumel == 0 or not math.isfinite(dn) or dn < 1e-8:
        return math.nan
    if nnumel == 0 or nn < 1e-8:
        return 0.0
    return (nn / math.sqrt(nnumel)) / (dn / math.sqrt(dnumel) + 1e-8)


def ref_raw(nn: float, dn: float) -> float:
    return math.nan if dn == 0.0 or not math.isfinite(dn) else nn / dn
