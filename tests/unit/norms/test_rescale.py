"""The accelerators' float64 path (rescaled norms, bands placed on the device), run on CPU.

:func:`gradwatch.norms.rescale.rescaled_norms` and
:func:`gradwatch.norms.bands.bands_of_norms_device` are
what a CUDA float64 bucket runs; ``NormEngine(rescale_float64=True)`` routes CPU float64
tensors through them instead of the host repair, so the same code is checked here against
``math.hypot`` over the exact values.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.doctor.testing import (
    BlockingCopyCounter,
    OpCounter,
    count_host_reads,
    largest_allocation,
)
from gradwatch.norms.bands import (
    BAND_EXPONENT,
    BANDS,
    banded_total_device,
    bands_of_norm,
    bands_of_norms_device,
    norm_from_bands,
)
from gradwatch.norms.rescale import build_rescale_plan, rescaled_norms
from gradwatch.norms.rows import ROW_NUMEL
from gradwatch.norms.stats import NormEngine

REL = 1e-12
F64 = torch.float64


def exact(t: torch.Tensor) -> float:
    """Independent reference: ``math.hypot`` over the exact float64 values (NaN beats Inf)."""
    xs = t.detach().reshape(-1).tolist()
    if any(x != x for x in xs):
        return math.nan
    return math.hypot(*xs)


def same(got: float, want: float) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    if math.isinf(want) or want == 0.0:
        return got == want
    return abs(got - want) <= REL * want


def spread(numel: int, lo: int, hi: int, seed: int) -> torch.Tensor:
    """Signed float64 values whose base-2 exponents are uniform in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.empty(numel, dtype=F64).uniform_(lo, hi, generator=gen)
    sign = torch.randint(0, 2, (numel,), generator=gen, dtype=F64) * 2 - 1
    return sign * torch.exp2(e)


def engine_norms(ts: list[torch.Tensor]) -> tuple[list[float], torch.Tensor]:
    sq = NormEngine(rescale_float64=True).squared_norms(ts)
    n = len(ts)
    return [
        norm_from_bands(float(sq[i]), float(sq[n + i]), float(sq[2 * n + i])) for i in range(n)
    ], sq


CASES = {
    "1e160": [torch.full((1000,), 1e160, dtype=F64)],
    "1e-160": [torch.full((1000,), 1e-160, dtype=F64)],
    "subnormal": [torch.full((10,), 3e-320, dtype=F64)],
    "zero": [torch.zeros(700, dtype=F64), torch.full((3,), 2.0, dtype=F64)],
    "mixed tensors": [
        torch.full((70_000,), m, dtype=F64) for m in (1e200, 1e-200, 1e-300, 1.0, 1e154, 1e-154)
    ],
    "mixed within a tensor": [spread(5000, -1000, 1000, 1), spread(600, -1070, -900, 2)],
    "beyond float64": [torch.full((10,), 1e308, dtype=F64)],
    "row of 1e300 among tiny": [
        torch.cat([torch.full((513,), 1e-300, dtype=F64), torch.tensor([1e300], dtype=F64)])
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_rescaled_norms_exact(name: str) -> None:
    """Per-tensor norms (the function itself and through the engine's bands) and the total
    (band sums combined on the device) match math.hypot of the exact values to 1e-12."""
    ts = CASES[name]
    want = [exact(t) for t in ts]
    direct = rescaled_norms(build_rescale_plan(ts), ts)
    assert direct.dtype == F64
    got, sq = engine_norms(ts)
    for i, w in enumerate(want):
        assert same(float(direct[i]), w), (i, float(direct[i]), w)
        assert same(got[i], w), (i, got[i], w)
    total = float(banded_total_device(sq, len(ts)))
    assert same(total, math.hypot(*want)), (total, math.hypot(*want))


@pytest.mark.parametrize(
    ("values", "want"),
    [
        ([1.0, math.nan, 2.0], math.nan),
        ([1e200, math.inf, 1.0], math.inf),
        ([math.inf, math.nan], math.nan),
        ([-math.inf, 1e-300], math.inf),
        ([1e-300, math.nan], math.nan),
    ],
)
def test_nonfinite_in_the_plain_band(values: list[float], want: float) -> None:
    """NaN gives NaN, Inf (without NaN) Inf, in the plain band with the other bands 0:
    non-finite detection reads the plain band. Positions first, middle and last of a tensor
    spanning several rows."""
    for at in (0, 700, 1300 - len(values)):
        t = spread(1300, -200, 200, at)
        t[at : at + len(values)] = torch.tensor(values, dtype=F64)
        finite = torch.full((5,), 1e160, dtype=F64)
        _, sq = engine_norms([finite, t])
        n = 2
        plain, high, low = float(sq[1]), float(sq[n + 1]), float(sq[2 * n + 1])
        assert same(plain, want) and high == 0.0 and low == 0.0, (at, plain, high, low)
        assert same(norm_from_bands(float(sq[0]), float(sq[n]), float(sq[2 * n])), exact(finite))


def test_huge_tensors_split_across_chunks() -> None:
    """Tensors larger than the scratch are read in chunks of their flat view, batches refill
    the scratch (their padding zeroed), and a transposed tensor is read in memory order:
    every norm stays exact."""
    scratch = 8 * ROW_NUMEL
    ts = [
        torch.full((3, 2000), 1e160, dtype=F64),  # 6000 elements: two chunks
        spread(7, -900, 900, 3),  # partial rows: padding that later batches must not see
        spread(20_011, -1000, 1000, 4),  # several batches on its own
        spread(6000, -800, -700, 5).view(60, 100).t(),  # dense, not contiguous, chunked
        torch.full((1,), 3e-310, dtype=F64),
    ]
    plan = build_rescale_plan(ts, scratch_numel=scratch)
    assert len(plan.batches) > 3 and plan.scratch.numel() == scratch
    got = rescaled_norms(plan, ts)
    again = rescaled_norms(plan, ts)  # a second call through the same scratch
    for i, t in enumerate(ts):
        assert same(float(got[i]), exact(t)), i
        assert float(again[i]) == float(got[i])


def test_default_scratch_chunks_a_large_tensor_without_gradient_sized_temporary() -> None:
    """A float64 tensor of 3M elements (24 MB) among small ones, through the engine with the
    default 8 MiB scratch: exact, and no op output nor in-kernel allocation near its size."""
    big = spread(3_000_000, -600, 600, 6)
    ts = [big, torch.full((100,), 1e-250, dtype=F64), torch.full((64,), 1e250, dtype=F64)]
    engine = NormEngine(rescale_float64=True)
    engine.squared_norms(ts)  # the plan and its persistent scratch
    with OpCounter() as ops:
        sq = engine.squared_norms(ts)
    n = len(ts)
    for i, t in enumerate(ts):
        got = norm_from_bands(float(sq[i]), float(sq[n + i]), float(sq[2 * n + i]))
        assert same(got, exact(t)), i
    big_bytes = big.numel() * big.element_size()
    assert ops.largest_bytes <= big_bytes // 64, (ops.largest_op, ops.largest_bytes)
    assert largest_allocation(lambda: engine.squared_norms(ts)) <= big_bytes // 64


def test_no_host_read_and_ops_constant_in_tensor_count() -> None:
    """The warm per-step path reads nothing on the host, builds no tensor from Python data,
    makes no blocking copy, and dispatches the same ops for 20 or 400 tensors."""

    def ops(n: int) -> int:
        ts = [spread(100 if i % 2 else 900, -1000, 1000, i) for i in range(n)]
        engine = NormEngine(rescale_float64=True)
        engine.squared_norms(ts)
        with OpCounter() as counter, count_host_reads() as reads, BlockingCopyCounter() as copies:
            sq = engine.squared_norms(ts)
        assert counter.scalar_reads == 0 and sum(reads.values()) == 0 and engine.host_reads == 0
        assert copies.python_tensors == 0 and copies.blocking_copies == 0, copies.describe()
        for i in (0, 1, n - 1):
            got = norm_from_bands(float(sq[i]), float(sq[n + i]), float(sq[2 * n + i]))
            assert same(got, exact(ts[i])), i
        return counter.total

    assert ops(20) == ops(400)


def test_device_bands_match_host_bands() -> None:
    """bands_of_norms_device places every norm in the band bands_of_norm does, with the same
    value, at and around each band edge and over the whole float64 range."""
    edges = [2.0**BAND_EXPONENT, 2.0 ** -(BAND_EXPONENT + 1)]
    norms = [0.0, 5e-324, 1e-320, 1e-160, 1.0, 1e160, 1.7e308, math.inf, math.nan]
    for e in edges:
        norms += [e, math.nextafter(e, 0.0), math.nextafter(e, math.inf)]
    k = len(norms)
    device = bands_of_norms_device(torch.tensor(norms, dtype=F64)).tolist()
    assert len(device) == BANDS * k
    for i, norm in enumerate(norms):
        band, value = bands_of_norm(norm)
        for b in range(BANDS):
            got = device[b * k + i]
            if b != band:
                assert got == 0.0, (norm, b)
            elif math.isnan(value):
                assert math.isnan(got)
            else:
                assert got == value, (norm, got, value)


def test_plan_routes_float64_by_device_and_flag() -> None:
    """CPU float64 tensors keep the host repair by default; with the flag (and on any
    accelerator) they take the rescaled path, except a huge non-dense one, which keeps the
    foreach norm. Every tensor stays in exactly one bucket position (clipping relies on it)."""
    from gradwatch.norms.rescale import RESCALE_SCRATCH

    small = torch.full((10,), 1e160, dtype=F64)
    strided = torch.ones(2 * RESCALE_SCRATCH + 2, dtype=F64)[::2]  # not dense, > scratch
    ts = [small, strided, torch.ones(5)]
    _, default = NormEngine().squared_norms_and_plan(ts)
    assert not any(b.rescaled for b in default.buckets)
    sq, flagged = NormEngine(rescale_float64=True).squared_norms_and_plan(ts)
    (f64,) = [b for b in flagged.buckets if b.dtype == F64]
    assert f64.rescaled == [0] and f64.whole == [1]
    assert sorted(i for b in flagged.buckets for i in b.positions) == [0, 1, 2]
    n = len(ts)
    assert same(norm_from_bands(float(sq[0]), float(sq[n]), float(sq[2 * n])), exact(small))
    assert same(float(sq[1]), float(strided.numel()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float64_rescaled_without_sync() -> None:
    """On a GPU the default engine rescales float64 (no flag) and, warm, makes no
    synchronization (``set_sync_debug_mode("error")`` raises on any)."""
    ts = [t.cuda() for name, case in CASES.items() if name != "beyond float64" for t in case]
    engine = NormEngine()
    engine.squared_norms(ts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sq = engine.squared_norms(ts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    n = len(ts)
    host = sq.cpu()
    for i, t in enumerate(ts):
        got = norm_from_bands(float(host[i]), float(host[n + i]), float(host[2 * n + i]))
        assert same(got, exact(t.cpu())), i
