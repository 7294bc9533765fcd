"""The norm engine and ``total_norm``: exactness vs an independent float64 reference, range,
non-contiguous layouts, op counts and temporaries."""

from __future__ import annotations

import math

import pytest
import torch
from allocations import OutputRecorder
from hypothesis import given, settings
from hypothesis import strategies as st
from references import EXP_RANGE, ref_norm, rel_err, values

from gradwatch import total_norm
from gradwatch.doctor.testing import OpCounter, count_host_reads, largest_allocation
from gradwatch.norms.rows import aligned
from gradwatch.norms.stats import PACK_NUMEL, NormEngine

REL = 1e-6

def engine_norm(sq: torch.Tensor, i: int) -> float:
    """Tensor ``i``'s norm from the engine's banded output (plain, high, low bands)."""
    from gradwatch.norms.bands import BANDS, norm_from_bands

    n = sq.numel() // BANDS
    return norm_from_bands(float(sq[i]), float(sq[n + i]), float(sq[2 * n + i]))


# -- exactness on fixed cases -------------------------------------------------------------------


def test_returns_zero_dim_float64_and_matches_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(7, generator=gen), torch.randn(300, 200, generator=gen)]
    got = total_norm(ts)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert rel_err(float(got), ref_norm(ts)) <= REL
    assert rel_err(float(got), float(torch.nn.utils.get_total_norm(ts))) <= 1e-5
    single = total_norm(ts[1])
    assert rel_err(float(single), ref_norm([ts[1]])) <= REL


def test_empty_inputs() -> None:
    assert float(total_norm([])) == 0.0
    assert float(total_norm([torch.zeros(0), torch.zeros(3, 0)])) == 0.0
    assert float(total_norm([torch.zeros(100_000)])) == 0.0


@pytest.mark.parametrize("value", [0.1, 1.0, 3.0e-3])
def test_constant_2_pow_24_fp32(value: float) -> None:
    t = torch.full((1 << 24,), value, dtype=torch.float32)
    exact = abs(float(t[0])) * math.sqrt(1 << 24)  # exactly 4096 * the stored value
    assert rel_err(float(total_norm(t)), exact) <= REL
    sq = NormEngine().squared_norms([t])
    assert rel_err(engine_norm(sq, 0), exact) <= REL


def test_random_2_pow_24_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(1 << 24, generator=gen) * 3 + 0.5
    assert rel_err(float(total_norm(t)), ref_norm([t])) <= REL


def test_2_pow_24_bf16_constant() -> None:
    t = torch.full((1 << 24,), 0.1, dtype=torch.bfloat16)
    exact = float(t[0].double()) * 4096.0
    assert rel_err(float(total_norm(t)), exact) <= REL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [3, 1000, 70_000, 300_000])
@pytest.mark.parametrize("magnitude", [1e30, 1e-30, 3e38, 1e-38, 1e-40])
def test_no_overflow_no_underflow(dtype: torch.dtype, numel: int, magnitude: float) -> None:
    t = torch.full((numel,), magnitude, dtype=torch.float32).to(dtype)
    stored = float(t[0].double())
    assert stored != 0.0 and math.isfinite(stored)
    exact = stored * math.sqrt(numel)
    assert rel_err(float(total_norm(t)), exact) <= REL


@pytest.mark.parametrize("numel", [3, 1000, 70_000])
@pytest.mark.parametrize("magnitude", [6.0e4, 1e-7, 6.1e-5])
def test_fp16_extremes(numel: int, magnitude: float) -> None:
    t = torch.full((numel,), magnitude, dtype=torch.float16)
    stored = float(t[0].double())
    assert stored != 0.0 and math.isfinite(stored)
    assert rel_err(float(total_norm(t)), stored * math.sqrt(numel)) <= REL


@pytest.mark.parametrize("magnitude", [1e150, 1e-150, 1.0])
@pytest.mark.parametrize("numel", [1, 5000, 100_000])
def test_fp64_range(magnitude: float, numel: int) -> None:
    t = torch.full((numel,), magnitude, dtype=torch.float64)
    assert rel_err(float(total_norm(t)), magnitude * math.sqrt(numel)) <= REL


def test_fp64_sum_of_squares_beyond_float64() -> None:
    # 11 tensors of 2^24 elements of 1e150: each squared norm (1.7e307) fits float64, their
    # sum does not; the total norm (1.36e154) does.
    ts = [torch.tensor(1e150, dtype=torch.float64).expand(1 << 24) for _ in range(11)]
    exact = 1e150 * math.sqrt(11 * (1 << 24))
    assert rel_err(float(total_norm(ts)), exact) <= REL


def test_mixed_magnitudes_in_one_tensor() -> None:
    t = torch.full((100_000,), 1e-30, dtype=torch.float32)
    t[17] = 1e30
    assert rel_err(float(total_norm(t)), ref_norm([t])) <= REL
    u = torch.full((100_000,), 1e-20, dtype=torch.float32)  # squares underflow float32
    assert rel_err(float(total_norm(u)), 1e-20 * math.sqrt(100_000) * (float(u[0]) / 1e-20)) <= REL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_norm_not_rounded_to_dtype(dtype: torch.dtype) -> None:
    small = torch.ones(3, dtype=dtype)
    assert rel_err(float(total_norm(small)), math.sqrt(3)) <= REL
    mid = torch.full((1000,), 0.1, dtype=dtype)
    assert rel_err(float(total_norm(mid)), float(mid[0].double()) * math.sqrt(1000)) <= REL
    big = torch.full((70_001,), 0.1, dtype=dtype)
    assert rel_err(float(total_norm(big)), float(big[0].double()) * math.sqrt(70_001)) <= REL
    # the result is not representable in the gradient dtype, and we did not round to it
    assert float(total_norm(small)) != float(torch.tensor(math.sqrt(3)).to(dtype))


def test_mixed_dtypes() -> None:
    gen = torch.Generator().manual_seed(3)
    ts = [
        torch.randn(100, generator=gen),
        torch.randn(100_000, generator=gen).to(torch.bfloat16),
        torch.randn(70_000, generator=gen).to(torch.float16),
        torch.randn(300, generator=gen, dtype=torch.float64) * 1e-100,
        torch.randn(9, generator=gen, dtype=torch.float64),
    ]
    assert rel_err(float(total_norm(ts)), ref_norm(ts)) <= REL
    sq = NormEngine().squared_norms(ts)
    for i, t in enumerate(ts):
        assert rel_err(engine_norm(sq, i), ref_norm([t])) <= REL


def test_sparse_and_complex() -> None:
    i = torch.tensor([[0, 2, 2, 5]])
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    sparse = torch.sparse_coo_tensor(i, v, (8, 2))  # uncoalesced: row 2 appears twice
    exact = math.sqrt(1 + 4 + 8**2 + 10**2 + 49 + 64)
    assert rel_err(float(total_norm(sparse)), exact) <= REL
    z = torch.tensor([3 + 4j, 1 - 1j], dtype=torch.complex64)
    assert rel_err(float(total_norm(z)), math.sqrt(25 + 2)) <= REL
    zbig = torch.full((100_000,), 0.6 - 0.8j, dtype=torch.complex64)
    assert rel_err(float(total_norm(zbig)), ref_norm([zbig])) <= REL


def test_nonfinite_inputs_like_torch() -> None:
    a = torch.ones(100_000)
    a[5] = float("inf")
    assert math.isinf(float(total_norm([a, torch.ones(3)])))
    b = torch.ones(10)
    b[2] = float("nan")
    assert math.isnan(float(total_norm([a, b])))
    assert math.isnan(float(total_norm([b])))


# -- non-contiguous layouts -----------------------------------------------------------------------


def test_transposed_large() -> None:
    gen = torch.Generator().manual_seed(4)
    t = torch.randn(600, 500, generator=gen).t()
    assert not t.is_contiguous()
    assert rel_err(float(total_norm(t)), ref_norm([t])) <= REL


def test_channels_last_large() -> None:
    gen = torch.Generator().manual_seed(5)
    t = torch.randn(8, 64, 32, 32, generator=gen).to(memory_format=torch.channels_last)
    t = t.to(torch.bfloat16)
    assert not t.is_contiguous()
    assert rel_err(float(total_norm(t)), ref_norm([t])) <= REL


def test_non_dense_strided_view() -> None:
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(900, 700, generator=gen)
    view = base[::2, 1::3]
    expected = ref_norm([view.contiguous()])
    assert rel_err(float(total_norm(view)), expected) <= REL
    tiny = (torch.full((900, 700), 1e-30))[::3, ::2]  # strided and needing the repair path
    assert rel_err(float(total_norm(tiny)), ref_norm([tiny.contiguous()])) <= REL


def test_plan_rebuilt_when_layout_changes() -> None:
    engine = NormEngine()
    a = torch.randn(600, 500)
    first = engine.squared_norms([a])
    assert rel_err(math.sqrt(float(first[0])), ref_norm([a])) <= REL
    b = torch.randn(600, 500).t()
    second = engine.squared_norms([b])
    assert rel_err(math.sqrt(float(second[0])), ref_norm([b])) <= REL
    c = torch.randn(10, dtype=torch.float64)
    third = engine.squared_norms([c, None, b])
    assert float(third[1]) == 0.0
    assert rel_err(math.sqrt(float(third[0])), ref_norm([c])) <= REL


# -- cost ------------------------------------------------------------------------------------


def test_engine_makes_no_gradient_sized_temporary() -> None:
    """Per step, no op allocates anything near a gradient's size: not as an output (dispatch
    mode) and not inside a kernel (profiler; e.g. ``vector_norm(bf16, dtype=float32)`` widens a
    whole-tensor float32 copy). The one persistent widening buffer is allocated on the first
    call and bounded by CONVERT_CHUNK float32 elements, whatever the gradient size."""
    from gradwatch.norms.stats import CONVERT_CHUNK

    gen = torch.Generator().manual_seed(7)
    ts = [
        torch.randn(1 << 20, generator=gen),
        torch.randn(3000, 1000, generator=gen).to(torch.bfloat16),  # 3 widening chunks
        torch.randn(1100, 1000, generator=gen).to(torch.float16).t(),
    ]
    engine = NormEngine()
    # First call: the plan and the persistent widening buffer.
    _, plan = engine.squared_norms_and_plan(ts)
    assert plan.scratch
    assert max(s.numel() for s in plan.scratch.values()) <= CONVERT_CHUNK
    with OutputRecorder() as rec:
        sq = engine.squared_norms(ts)
    assert rel_err(math.sqrt(math.fsum(sq.tolist())), ref_norm(ts)) <= REL
    smallest = min(t.numel() for t in ts)
    largest_out = max(n for _, n, _ in rec.outputs)
    assert largest_out <= smallest // 64, sorted(rec.outputs, key=lambda x: -x[1])[:3]
    assert not [o for o in rec.outputs if o[2] == torch.float64 and o[1] >= smallest]
    smallest_bytes = min(t.numel() * t.element_size() for t in ts)
    assert largest_allocation(lambda: engine.squared_norms(ts)) <= smallest_bytes // 64


def test_engine_ops_constant_in_tensor_count() -> None:
    def ops(n: int) -> tuple[int, int]:
        gen = torch.Generator().manual_seed(n)
        ts = [torch.randn(100 if i % 2 else 5000, generator=gen) for i in range(n)]
        engine = NormEngine()
        engine.squared_norms(ts)  # builds the plan
        with OpCounter() as counter, count_host_reads() as reads:
            sq = engine.squared_norms(ts)
        for i in (0, 1, n - 1):
            assert rel_err(engine_norm(sq, i), ref_norm([ts[i]])) <= REL
        assert counter.scalar_reads == 0
        fills = engine.plan_for(ts, torch.device("cpu")).pack_fills
        assert fills == -(-sum(aligned(t.numel()) for t in ts) // PACK_NUMEL)  # no gaps
        return counter.total - 2 * fills, sum(reads.values())

    # Two ops per fill of the pack buffer (a copy, a norm), none per tensor; plans of at most
    # HOST_CHECK_MAX positions check for a repair on the host, four ops fewer.
    from gradwatch.norms.stats import HOST_CHECK_MAX

    few, small, large = ops(20), ops(HOST_CHECK_MAX + 1), ops(400)
    assert small == large
    assert few == (small[0] - 4, small[1])
    assert small[1] <= 1


# -- properties -----------------------------------------------------------------------------------

NUMELS = [1, 2, 255, 256, 257, 511, 512, 513, 1000, 65536, 65537, 70_001, 150_000]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def tensor_specs(draw):  # type: ignore[no-untyped-def]
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.sampled_from(NUMELS))
    lo, hi = EXP_RANGE[dtype]
    center = draw(st.integers(lo, hi))
    spread = draw(st.integers(0, 12))
    return dtype, numel, max(lo, center - spread), min(hi, center + 1), draw(st.booleans())


@settings(max_examples=80, deadline=None)
@given(specs=st.lists(tensor_specs(), min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1))
def test_property_total_norm_exact(specs, seed: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    ts = []
    for dtype, numel, lo, hi, transpose in specs:
        t = values((numel,), dtype, lo, hi, gen)
        if transpose and numel % 2 == 0:
            t = t.view(2, numel // 2).t()
        ts.append(t)
    want = ref_norm(ts)
    got = float(total_norm(ts))
    assert rel_err(got, want) <= REL, (got, want)
    sq = NormEngine().squared_norms(ts)
    for i, t in enumerate(ts):
        want_i = ref_norm([t])
        assert rel_err(engine_norm(sq, i), want_i) <= REL


def test_output_recorder_sees_full_size_copies() -> None:
    # The temporaries check above can fail: a float64 copy or a cat of gradients is recorded.
    t = torch.randn(1 << 16)
    with OutputRecorder() as rec:
        t.double()
        torch.cat([t, t])
        t.view(-1)
    assert (1 << 16, torch.float64) in [(n, d) for _, n, d in rec.outputs]
    assert max(n for _, n, _ in rec.outputs) == 1 << 17


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [2, 255, 256, 257, 511, 512, 513, 4097, 65536, 65537])
@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7])
def test_constant_tensors_at_path_boundaries(dtype: torch.dtype, numel: int, value: float) -> None:
    # Constant values are the worst case of float32 accumulation.
    t = torch.full((numel,), value, dtype=dtype)
    exact = float(t[0].double()) * math.sqrt(numel)
    assert rel_err(float(total_norm(t)), exact) <= REL


def test_plan_follows_shape_changes_at_equal_numel() -> None:
    """Mid-size tensors are copied into slots shaped like them: a tensor at the same position
    with another shape but the same numel gets a new plan, not a shape error."""
    engine = NormEngine()
    a = torch.randn(40, 50)
    b = torch.randn(50, 40)
    for t in (a, b, a.t(), b.reshape(-1)):
        sq = engine.squared_norms([t])
        assert rel_err(engine_norm(sq, 0), ref_norm([t])) <= REL


def test_plan_follows_stride_changes_at_equal_shape() -> None:
    """The per-step layout key reads only dtype and shape; a large tensor read in place whose
    strides change under the same shape (transposed, or not dense at all) is replanned, not
    read through stale strides."""
    engine = NormEngine()
    gen = torch.Generator().manual_seed(21)
    contiguous = torch.randn(600, 500, generator=gen)
    transposed = torch.randn(500, 600, generator=gen).t()
    strided = torch.randn(600, 1000, generator=gen)[:, ::2]
    for t in (contiguous, transposed, strided, contiguous, strided, transposed):
        assert t.shape == (600, 500)
        sq = engine.squared_norms([t, torch.randn(300, generator=gen)])
        assert rel_err(engine_norm(sq, 0), ref_norm([t])) <= REL


@pytest.mark.parametrize("csr_min_rows", [1, 1 << 30])
def test_row_sums_by_csr_and_by_index_add(
    monkeypatch: pytest.MonkeyPatch, csr_min_rows: int
) -> None:
    """Both ways of summing row norms per tensor (sparse CSR matvec for many rows, index_add_
    for few) give the exact norms, across buckets and with partial rows."""
    import gradwatch.norms.stats as stats

    monkeypatch.setattr(stats, "CSR_MIN_ROWS", csr_min_rows)
    gen = torch.Generator().manual_seed(22)
    ts = [
        torch.randn(300_001, generator=gen),
        torch.randn(70, generator=gen),
        torch.randn(700, 300, generator=gen).to(torch.bfloat16),
        torch.randn(5000, generator=gen).to(torch.float16),
    ]
    engine = NormEngine()
    sq, plan = engine.squared_norms_and_plan(ts)
    assert all((b.row_sums.sum_rows is not None) == (csr_min_rows == 1) for b in plan.buckets)
    for i, t in enumerate(ts):
        assert rel_err(engine_norm(sq, i), ref_norm([t])) <= REL


def test_views_with_storage_offsets() -> None:
    """Large tensors are read in place through ``as_strided`` from their own storage offset
    (e.g. DDP's ``gradient_as_bucket_view`` gradients are slices of one flat bucket)."""
    gen = torch.Generator().manual_seed(23)
    flat = torch.randn(2_000_003, generator=gen)
    ts = [flat[100_001:900_000], flat[900_000:900_100], flat[900_100:1_700_333].view(-1, 7)]
    engine = NormEngine()
    for _ in range(2):
        sq = engine.squared_norms(ts)
        for i, t in enumerate(ts):
            assert rel_err(engine_norm(sq, i), ref_norm([t])) <= REL


@pytest.mark.parametrize(
    ("squares", "expected"),
    [
        ([], 0.0),
        ([0.0, 0.0], 0.0),
        ([4.0, 9.0, 36.0], 7.0),
        ([1e308, 1e308, 5e307], math.sqrt(2.5) * 1e154),  # each fits float64, the sum not
        ([1e-320, 4e-320], math.sqrt(5e-320)),  # subnormal squares
        ([1.0, math.inf], math.inf),
        ([1.0, math.nan, math.inf], math.nan),
    ],
)
def test_sqrt_sum_host(squares: list[float], expected: float) -> None:
    """The overflow-safe sqrt(sum of plain squares) on the host (Python floats, exact sum):
    NaN and Inf kept."""
    from gradwatch.norms.stats import sqrt_sum

    host = sqrt_sum(squares)
    if math.isnan(expected):
        assert math.isnan(host)
    elif math.isinf(expected) or expected == 0.0:
        assert host == expected
    else:
        assert host == pytest.approx(expected, rel=1e-12, abs=0)


def test_vector_band_combine_equals_the_elementwise_one_bitwise() -> None:
    """:func:`norm_from_band_sums_device` (nine ops on the 3-vector of band sums) gives the very
    bits of :func:`norm_from_bands_device` (one op per term) for seeded sets of norms over the
    whole float64 range, band edges, zeros, NaN and Inf included; and the whole-model norm
    from a banded vector dispatches eleven ops, none a host read."""
    import random

    from gradwatch.doctor.testing import OpCounter
    from gradwatch.norms.bands import (
        BANDS,
        banded_total_device,
        bands_of_norm,
        norm_from_band_sums_device,
        norm_from_bands_device,
    )

    rng = random.Random(7)
    exponents = ((-1074.0, 1023.0), (-5.0, 5.0), (440.0, 460.0), (-460.0, -440.0))
    for _ in range(3000):
        k = rng.randint(1, 5)
        norms = [
            rng.choice((0.0, math.inf, math.nan)) if rng.random() < 0.05
            else rng.random() * 2.0 ** rng.uniform(*rng.choice(exponents))
            for _ in range(k)
        ]
        bands = [0.0] * (BANDS * k)
        for i, norm in enumerate(norms):
            band, value = bands_of_norm(norm)
            bands[band * k + i] = value
        sums = torch.tensor(bands, dtype=torch.float64).view(BANDS, k).sum(dim=1)
        vector = norm_from_band_sums_device(sums)
        elementwise = norm_from_bands_device(sums[0], sums[1], sums[2])
        assert vector.shape == ()
        assert torch.equal(vector, elementwise) or (vector.isnan() & elementwise.isnan()), norms
    ones = torch.ones(BANDS * 4, dtype=torch.float64)
    banded_total_device(ones, 4)  # the constants, made once per device
    with OpCounter() as ops:
        banded_total_device(ones, 4)
    assert ops.total == 11 and ops.scalar_reads == 0, dict(ops.ops)


@pytest.mark.parametrize(
    "norms",
    [
        [],
        [0.0, 0.0],
        [2.0, 3.0, 6.0],
        [1e154, 1e154, 7e153],  # squares fit float64, their sum does not
        [1e160, 3e160],  # squares beyond float64
        [1e300, 1e300, 1e-300],
        [1e-160, 2e-160, 1e-170],  # squares below float64's normal range
        [1e-300, 1e-300, 1e-300, 1e-300],
        [4e-320, 3e-320],  # subnormal norms
        [1e200, 1e-200, 1.0],
        [1e308, 1e308],  # the norm itself overflows: inf
        [1.0, math.inf],
        [1.0, math.nan, math.inf],
    ],
)
def test_band_combination_host_and_device_agree(norms: list[float]) -> None:
    """Squared norms as the engine's bands, summed per band and combined back: on the host
    (:func:`norm_from_bands`) and on the device (:func:`banded_total_device`, no host read),
    equal to ``math.hypot`` of the norms over the whole float64 range (NaN beats Inf)."""
    from gradwatch.norms.bands import BANDS, banded_total_device, bands_of_norm, norm_from_bands

    n = len(norms)
    bands = [0.0] * (BANDS * n)
    for i, norm in enumerate(norms):
        band, value = bands_of_norm(norm)
        bands[band * n + i] = value
    expected = math.nan if any(x != x for x in norms) else math.hypot(*norms)
    host = norm_from_bands(*(math.fsum(bands[b * n : (b + 1) * n]) for b in range(BANDS)))
    device = float(banded_total_device(torch.tensor(bands, dtype=torch.float64), n))
    if math.isnan(expected):
        assert math.isnan(host) and math.isnan(device)
    elif math.isinf(expected) or expected == 0.0:
        assert host == device == expected
    else:
        assert host == pytest.approx(expected, rel=1e-14, abs=0)
        assert device == pytest.approx(expected, rel=1e-14, abs=0)


@pytest.mark.parametrize(
    ("magnitudes", "numel"),
    [
        ([1e160], 1000),
        ([1e-160], 1000),
        ([1e-300], 1000),
        ([1e300], 100),
        ([1e200, 1e-200, 1e-300, 1.0], 70_000),
        ([1e154, 1e152, 1e-160], 5000),
        ([3e-320], 10),
    ],
)
def test_float64_exact_over_the_whole_range(magnitudes: list[float], numel: int) -> None:
    """Float64 gradients of any finite magnitude: total_norm, the engine's per-tensor norms
    and a GradWatch snapshot are exact to 1e-12 against math.hypot of the exact values."""
    from gradwatch import GradWatch, WatchConfig

    ts = [torch.full((numel,), m, dtype=torch.float64) for m in magnitudes]
    per = [math.hypot(*([m] * numel)) for m in magnitudes]
    want = math.hypot(*per)
    assert rel_err(float(total_norm(ts)), want) <= 1e-12
    sq = NormEngine().squared_norms(ts)
    for i, w in enumerate(per):
        assert rel_err(engine_norm(sq, i), w) <= 1e-12
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros_like(t)) for t in ts])
    for p, t in zip(model, ts, strict=True):
        p.grad = t.clone()
    with GradWatch(model, WatchConfig()) as watch:
        snap = watch.collect(0).result()
    assert rel_err(snap.global_norm, want) <= 1e-12
    for name, w in zip(sorted(snap.param_norms), per, strict=True):
        assert rel_err(snap.param_norms[name], w) <= 1e-12
    assert snap.is_finite


def test_float64_norm_beyond_float64_is_inf_and_exploding() -> None:
    """A norm that truly overflows float64 is +inf, like torch's get_total_norm, and the
    step counts as exploding."""
    from gradwatch import GradWatch, WatchConfig

    t = torch.full((10,), 1e308, dtype=torch.float64)
    assert float(total_norm(t)) == math.inf == float(torch.nn.utils.get_total_norm([t]))
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float64))
    p.grad = t
    with GradWatch(torch.nn.ParameterList([p]), WatchConfig()) as watch:
        snap = watch.collect(0).result()
    assert snap.global_norm == math.inf and snap.exploding_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_fills_zero_padding_other_fills_wrote(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mid-size tensors and partial last rows go through many fills of one small pack buffer
    whose layouts differ: padding one fill leaves is data another wrote (this call's or the
    previous call's). Every norm stays exact call after call, with values that change."""
    import gradwatch.norms.stats as stats

    monkeypatch.setattr(stats, "PACK_NUMEL", 4096)
    gen = torch.Generator().manual_seed(33)
    sizes = [3, 1500, 700, 4096, 513, 2049, 70_001, 1, 3000, 65_537, 511, 2500]
    engine = NormEngine()
    for scale in (1.0, 1e3, 1e-2):
        ts = [(torch.randn(n, generator=gen) * scale).to(dtype) for n in sizes]
        sq = engine.squared_norms(ts)
        plan = engine.plan_for(ts, torch.device("cpu"))
        assert plan.pack_fills > 3
        assert any(fill.pads for b in plan.buckets for fill in b.fills)
        for i, t in enumerate(ts):
            assert rel_err(engine_norm(sq, i), ref_norm([t])) <= REL, (i, scale)


@pytest.mark.parametrize("value", [1e-30, 1e30, 0.1])
def test_pack_fills_constant_tensors_and_extremes(value: float) -> None:
    """Many constant (worst-case) mid-size tensors across several fills, at magnitudes whose
    float32 squares underflow or overflow: the repair keeps every norm exact."""
    sizes = [16_384, 10_000, 7_001, 513] * 40  # about 1.4M elements: three fills
    ts = [torch.full((n,), value) for n in sizes]
    engine = NormEngine()
    sq = engine.squared_norms(ts)
    assert engine.plan_for(ts, torch.device("cpu")).pack_fills >= 3
    for i, t in enumerate(ts):
        exact = float(t[0].double()) * math.sqrt(t.numel())
        assert rel_err(engine_norm(sq, i), exact) <= REL, i

def test_gradients_split_between_host_and_device_repair_only_in_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Some gradients in host memory, some on a device (CPU offload of a few parameters, CPU
    embeddings): the host ones are normed and repaired by a host engine (its mask a host
    tensor), the device ones by an engine that never repairs, joined by one copy; the joint
    plan carries every bucket (what a clip scales) and no repair of the device vector. No
    CUDA here: CPU float64 tensors stand in for the device's (they take the accelerator's
    rescaled float64 path), the rest are host-resident; every norm against the float64
    reference, extremes that need the repair included."""
    from gradwatch.norms import stats

    monkeypatch.setattr(stats, "is_host_resident", lambda t: t.dtype != torch.float64)
    gen = torch.Generator().manual_seed(3)
    tensors = [
        values((300,), torch.float32, -4, 4, gen),
        torch.full((50,), 1e-30, dtype=torch.float32),  # squares underflow float32: repaired
        values((700,), torch.float64, -300, 300, gen),  # the "device" part, extreme
        None,
        torch.full((9,), 1e-200, dtype=torch.float64),
        values((4100,), torch.float32, -2, 2, gen),  # the row path
    ]
    from gradwatch.doctor.testing import count_blocking_copies

    engine = NormEngine(rescale_float64=True)
    for call in range(2):  # cold, then warm with the cached plans
        with OpCounter() as ops, count_host_reads() as reads, count_blocking_copies() as copies:
            sq, plan = engine._mixed(tensors, torch.device("cpu"))
        if call:  # warm: the host engine's mask and its exact repair of the 1e-30 tensor
            assert ops.scalar_reads == 0 and sum(reads.values()) == 2, reads  # host memory
            # The repair's index and values: built in host memory by the host engine, never
            # on the device (the host vector reaches it by one non-blocking copy).
            assert copies.blocking_copies == 0 and copies.python_tensors == 2, copies.describe()
        for i, t in enumerate(tensors):
            want = 0.0 if t is None else ref_norm([t])
            assert rel_err(engine_norm(sq, i), want) <= REL, i
        assert not plan.needs_repair and plan.repair_floor is None
        positions = sorted(p for b in plan.buckets for p in b.positions)
        assert positions == [0, 1, 2, 4, 5]
        assert engine._split is not None and engine._split.device.host_reads == 0
    assert engine._split.host.host_reads == 2 == engine.host_reads  # one mask read a call
    plain = NormEngine(rescale_float64=True)  # not split: nothing to join
    assert plain._mixed([tensors[0], tensors[5]], torch.device("cpu")) is None


# -- every CPU low-precision path keeps the bound ----------------------------------------------

#: One numel per CPU float32/bf16/fp16 path: packed whole (at most WHOLE_NUMEL), rows of 512
#: read in place, rows of a shorter divisor read in place (no partial row), rows of 512 with
#: the partial last row packed, and a large one (rows of 512 and a packed partial row; bf16
#: and fp16 widened in two chunks).
PATH_NUMELS = {
    "packed": 10_000,
    "rows of 512": 32_768,
    "rows of a divisor": 30_000,
    "rows and a packed tail": 16_411,
    "large: rows of 512, a packed tail, two widening chunks": 1_500_000,
}


def _path_of(plan, numel: int, dtype: torch.dtype) -> str:  # type: ignore[no-untyped-def]
    """Which path the plan gave the tensor at position 0."""
    from gradwatch.norms.stats import CONVERT_CHUNK

    (bucket,) = [b for b in plan.buckets if 0 in b.positions]
    if 0 in bucket.packed:
        return "packed"
    assert bucket.rows[0] == 0
    length = bucket.row_lengths[0]
    if numel > CONVERT_CHUNK:
        assert dtype == torch.float32 or len(bucket.row_chunks[0]) == 2
        assert length == 512 and 0 in bucket.tails
        return "large: rows of 512, a packed tail, two widening chunks"
    if 0 in bucket.tails:
        assert length == 512
        return "rows and a packed tail"
    return "rows of 512" if length == 512 else "rows of a divisor"


@pytest.mark.parametrize("many", [False, True], ids=["host check", "tensor check"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", list(PATH_NUMELS))
def test_every_path_exact_on_constants_and_extremes(
    path: str, dtype: torch.dtype, many: bool
) -> None:
    """Constant tensors (the worst case of float32 accumulation: no rounding cancels) on each
    path, at ordinary magnitudes and (fp32, bf16) at 1e20 and 1e-25, whose float32 squares
    overflow and underflow: within 1e-6 of the exact value, alone (the repair check on the
    host) and among 64 more tensors (the check by tensor ops). Fails if a path loses rows'
    exactness, reads the wrong elements, or a check misses a tensor to repair."""
    numel = PATH_NUMELS[path]
    extremes = [1e20, 1e-25] if dtype != torch.float16 else [6.0e4, 1e-7]
    others = [torch.full((300,), 0.5, dtype=dtype) for _ in range(64 if many else 0)]
    engine = NormEngine()
    for value in [0.1, 1 / 3, 0.7, *extremes]:
        t = torch.full((numel,), value, dtype=dtype)
        stored = float(t[0].double())
        assert stored != 0.0 and math.isfinite(stored)
        sq, plan = engine.squared_norms_and_plan([t, *others])
        assert _path_of(plan, numel, dtype) == path
        assert (plan.host_bounds is None) == many
        assert rel_err(engine_norm(sq, 0), stored * math.sqrt(numel)) <= REL, value
        if others:
            assert rel_err(engine_norm(sq, len(others)), 0.5 * math.sqrt(300)) <= REL


@pytest.mark.parametrize("path", list(PATH_NUMELS))
def test_every_path_one_overflowing_element(path: str) -> None:
    """One float32 element of 1e20 (its square overflows float32) or 1e-25 among ordinary
    values, on each path, at the start, in the middle and in the last (possibly partial)
    row: the repair recomputes the tensor exactly."""
    numel = PATH_NUMELS[path]
    gen = torch.Generator().manual_seed(numel)
    for where in (0, numel // 2, numel - 1):
        for value in (1e20, 1e-25):
            t = torch.randn(numel, generator=gen) * (1e-20 if value < 1 else 1.0)
            t[where] = value
            sq, plan = NormEngine().squared_norms_and_plan([t])
            assert _path_of(plan, numel, torch.float32) == path
            assert rel_err(engine_norm(sq, 0), ref_norm([t])) <= REL, (where, value)


def test_row_length_divides_or_is_a_full_row() -> None:
    """Row-path tensors up to DIVISOR_ROWS_MAX_NUMEL are whole rows of a divisor in
    [MIN_ROW_NUMEL, ROW_NUMEL] when their numel has one, else (and larger ones) rows of
    ROW_NUMEL and a partial last row."""
    from gradwatch.norms.rows import DIVISOR_ROWS_MAX_NUMEL, MIN_ROW_NUMEL, ROW_NUMEL, row_length

    for numel in [16_385, 16_411, 30_000, 32_768, 70_001, 100_000, 1_500_000, 2**21 + 3]:
        length = row_length(numel)
        assert MIN_ROW_NUMEL <= length <= ROW_NUMEL
        divisors = [d for d in range(MIN_ROW_NUMEL, ROW_NUMEL + 1) if numel % d == 0]
        if numel > DIVISOR_ROWS_MAX_NUMEL:
            divisors = []
        assert length == (max(divisors) if divisors else ROW_NUMEL)
