"""The compiled norm kernel (norms/fused.py) inside the engine: exact against math.fsum of
exact float64 squares over the whole float32 range, taken when ready (no host read), never
waited for in "background" mode, and the eager figures when compiling fails; never called
with another layout than its own. And the bf16/fp16 row-norm kernel (NarrowRows) to the rows'
bound.

Each distinct layout compiles for seconds: the tests share a few lists."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from gradwatch.doctor.testing import OpCounter
from gradwatch.norms import fused, kernels
from gradwatch.norms.bands import BANDS
from gradwatch.norms.kernels import KernelCache
from gradwatch.norms.stats import NormEngine

N = fused.FUSED_MIN_NUMEL  # the smallest tensor the kernel norms


def fsum_square(t: torch.Tensor) -> float:
    """||t||^2 from the exact float64 square of every element, summed exactly."""
    return math.fsum(x * x for x in t.detach().double().reshape(-1).tolist())


def mixed_list() -> list[torch.Tensor]:
    """Every case in one layout: random, constant, values whose float32 squares overflow
    (1e20) and underflow (1e-25), subnormal float32 (1e-40), NaN and Inf at the start, middle
    and end, bf16, fp16, a transposed and a permuted tensor, and a small (packed) one."""
    g = torch.Generator().manual_seed(11)
    nan_mid = torch.randn(N, generator=g)
    nan_mid[N // 2] = math.nan
    inf_end = torch.randn(N, generator=g)
    inf_end[-1] = math.inf
    inf_first = torch.randn(N, generator=g)
    inf_first[0] = -math.inf
    nan_and_inf = torch.randn(N, generator=g)
    nan_and_inf[3], nan_and_inf[9] = math.inf, math.nan
    return [
        torch.randn(N + 1000, generator=g),
        torch.full((N,), 0.1),
        torch.full((N,), 1e20),
        torch.full((N,), 1e-25),
        torch.full((N,), 1e-40),  # subnormal float32
        torch.randn(N, generator=g) * 1e19,
        nan_mid,
        inf_end,
        inf_first,
        nan_and_inf,
        torch.randn(N + 7, generator=g).to(torch.bfloat16),
        torch.randn(N + 9, generator=g).to(torch.float16),
        torch.randn(160, 130, generator=g).t(),  # transposed
        torch.randn(4, 50, 100, generator=g).permute(2, 0, 1),  # permuted
        torch.randn(300, generator=g),  # packed: the eager path
    ]


@pytest.fixture
def every_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel for bf16/fp16 too (exact; off by default for speed on this hardware)."""
    monkeypatch.setattr(fused, "FUSED_DTYPES", (torch.float32, torch.bfloat16, torch.float16))


def test_compiled_path_exact_on_every_case(every_dtype: None) -> None:
    ts = mixed_list()
    engine = NormEngine(kernels=KernelCache("wait"))
    sq = engine.squared_norms(ts)
    plan = engine._plan
    assert plan is not None and plan.fused is not None and plan.residual is not None
    assert plan.fused.positions == list(range(len(ts) - 1))  # all but the packed one
    n = len(ts)
    high_low = sq[n:].tolist()
    assert high_low == [0.0] * ((BANDS - 1) * n)  # float32 squares: the plain band only
    for i, t in enumerate(ts):
        got, want = float(sq[i]), fsum_square(t)
        if math.isnan(want):
            assert math.isnan(got), i
        elif math.isinf(want):
            assert got == math.inf, i
        elif i in plan.fused.positions:
            assert abs(got - want) <= 1e-12 * want, (i, got, want)  # float64 accumulation
        else:
            assert abs(got - want) <= 2e-6 * want, (i, got, want)  # eager rows: 1e-6 on norms
    # The same figures as the eager engine (its repair included) to its 1e-6
    eager = NormEngine().squared_norms(ts)
    for i in range(n):
        a, b = float(sq[i]), float(eager[i])
        assert (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= 2e-6 * b, i


def test_compiled_path_is_taken_when_ready_and_reads_nothing() -> None:
    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(N, generator=g), torch.full((N,), 1e20), torch.randn(N + 3, generator=g)]
    want = [fsum_square(t) for t in ts]
    kc = KernelCache("wait")
    engine, eager = NormEngine(kernels=kc), NormEngine()
    for _ in range(2):
        got, ref = engine.squared_norms(ts), eager.squared_norms(ts)
        for i, w in enumerate(want):
            assert abs(float(got[i]) - w) <= 1e-12 * w
            assert abs(float(ref[i]) - w) <= 2e-6 * w  # the eager path (repaired 1e20)
    assert kc.ready == 1
    assert (engine.host_reads, eager.host_reads) == (0, 2)  # no repair check: no host read
    # Under a dispatch mode (gradwatch's op counters) the eager path runs, and is seen
    with OpCounter() as ops:
        engine.squared_norms(ts)
    assert engine.host_reads == 1 and sum(ops.ops.values()) > 0


def test_background_never_blocks_on_a_new_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = kernels.compile_traced

    def slow_compile(fn, example):  # type: ignore[no-untyped-def]
        assert release.wait(timeout=120)
        return real(fn, example)

    monkeypatch.setattr(kernels, "compile_traced", slow_compile)
    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(N, generator=g), torch.full((N,), 1e20), torch.randn(N + 3, generator=g)]
    kc = KernelCache("background")
    engine = NormEngine(kernels=kc)
    first = engine.squared_norms(ts)  # returns while the compile is blocked: eager
    assert kc.pending == 1 and engine.host_reads == 1
    assert engine._plan is not None and engine._plan.residual is None
    release.set()
    assert kc.wait(timeout=300) and kc.ready == 1
    second = engine.squared_norms(ts)
    assert engine.host_reads == 1  # compiled now: no further host read
    for i, t in enumerate(ts):
        w = fsum_square(t)
        assert abs(float(first[i]) - w) <= 2e-6 * w
        assert abs(float(second[i]) - w) <= 1e-12 * w


def test_failed_compile_leaves_the_eager_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn, example):  # type: ignore[no-untyped-def]
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(kernels, "compile_traced", broken)
    g = torch.Generator().manual_seed(8)
    ts = [torch.randn(N, generator=g), torch.full((N,), 1e-25), torch.randn(50, generator=g)]
    kc = KernelCache("wait")
    engine = NormEngine(kernels=kc)
    for _ in range(2):
        got = engine.squared_norms(ts)
        assert torch.equal(got, NormEngine().squared_norms(ts))
    assert kc.failed == 1 and engine.host_reads == 2
    assert engine._plan is not None and engine._plan.residual is None


def test_strides_changed_under_the_plan_stay_exact_and_replan() -> None:
    """The traced kernel checks nothing: a tensor of the plan's dtype and shape but other
    strides (a column of a matrix, a transposed one) or another storage offset must never
    reach it. Strides are checked on every call (a replan, then the eager paths while the new
    layout compiles); a storage offset is in the pointer the kernel gets: exact."""
    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(N, generator=g), torch.full((N,), 1e20), torch.randn(N + 3, generator=g),
          torch.randn(130, 160, generator=g)]
    kc = KernelCache("wait")
    engine = NormEngine(kernels=kc)
    engine.squared_norms(ts)
    plan = engine._plan
    assert plan is not None and plan.fused is not None and engine.host_reads == 0
    kc.mode = "off"  # the new layouts are not compiled: their eager paths after the replan
    offset = [torch.randn(N + 1, generator=g)[1:], *ts[1:]]  # storage offset 1: not 16-aligned
    got = engine.squared_norms(offset)
    assert engine._plan is plan and engine.host_reads == 0  # the kernel, no replan
    for i, t in enumerate(offset):
        w = fsum_square(t)
        assert abs(float(got[i]) - w) <= 1e-12 * w
    column = torch.randn(N, 2, generator=g)[:, 0]  # same shape, stride 2
    transposed = torch.randn(160, 130, generator=g).t()  # same shape, strides (1, 130)
    for strided in ([column, *ts[1:]], [*ts[:3], transposed]):
        engine = NormEngine(kernels=kc)
        kc.mode = "wait"
        engine.squared_norms(ts)  # the kernel of ts's layout, ready
        kc.mode = "off"
        got = engine.squared_norms(strided)  # stale: planned again, eager (one host read)
        assert engine._plan is not None and engine._plan.fused is None
        assert engine.host_reads == 1
        for i, t in enumerate(strided):
            w = fsum_square(t)
            assert abs(float(got[i]) - w) <= 2e-6 * w, (i, float(got[i]), w)


def test_a_gradient_off_the_cpu_or_without_memory_never_reaches_the_kernel() -> None:
    g = torch.Generator().manual_seed(6)
    ts = [torch.randn(N, generator=g), torch.randn(N + 3, generator=g)]
    kc = KernelCache("wait")
    engine = NormEngine(kernels=kc)
    engine.squared_norms(ts)
    plan = engine._plan
    assert plan is not None and plan.fused is not None
    meta = [ts[0], torch.empty(N + 3, device="meta")]  # same dtype and shape, not in memory
    with pytest.raises(ValueError, match="meta"):
        engine.squared_norms(meta)  # the check raised StalePlan; the new plan names it
    # An autograd zero tensor (no memory: a null data pointer) of the same layout: the eager
    # paths after a replan, which norm it as 0 (the kernel would read address 0)
    zero = [ts[0], torch._efficientzerotensor(N + 3)]
    engine = NormEngine(kernels=kc)
    engine.squared_norms(ts)
    assert engine._plan is not None and engine._plan.fused is not None
    got = engine.squared_norms(zero)
    assert engine._plan is not None and engine._plan.fused is not None
    assert engine._plan.fused.positions == [0]  # the zero tensor is not the kernel's
    assert float(got[1]) == 0.0 and abs(float(got[0]) - fsum_square(ts[0])) <= 1e-12 * float(got[0])


def test_jobs_of_many_ranks_never_compile() -> None:
    assert NormEngine.for_job("background", 1).kernels.mode == "background"  # type: ignore[union-attr]
    assert NormEngine.for_job("wait", 2).kernels.mode == "off"  # type: ignore[union-attr]


def test_watch_collects_and_clips_by_the_kernel() -> None:
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(200, 100)  # a 20,000-element weight (the kernel) and a bias
    model(torch.randn(8, 200)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    want = math.sqrt(math.fsum(fsum_square(g) for g in grads))
    with GradWatch(model, WatchConfig(compile_kernels="wait")) as watch:
        total = float(watch.clip_grad_norm_(want / 4, step=0))
        engine = watch._collector.engine
        assert engine._plan is not None and engine._plan.residual is not None
        assert engine._plan.fused is not None and engine._plan.fused.positions != []
    assert abs(total - want) <= 1e-6 * want  # the bias is packed: rows, 1e-6
    coef = (want / 4) / (total + 1e-6)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-6, atol=0)


def narrow_list() -> list[torch.Tensor]:
    """bf16/fp16 row-path tensors (above the pack's 16,384 elements): random, a partial last
    row (the pack's), squares that overflow (1e20) and underflow (1e-25) float32 (the repair's),
    NaN, a permuted dense one, and a small (packed) one."""
    g = torch.Generator().manual_seed(12)
    nan = torch.randn(N, generator=g).to(torch.bfloat16)
    nan[7] = math.nan
    return [
        torch.randn(70_000, generator=g).to(torch.bfloat16),
        torch.randn(N + 100, generator=g).to(torch.bfloat16),
        torch.full((40_960,), 1e20).to(torch.bfloat16),
        torch.full((40_960,), 1e-25).to(torch.bfloat16),
        nan,
        torch.randn(4, 90, 100, generator=g).to(torch.bfloat16).permute(2, 0, 1),
        torch.randn(300, generator=g).to(torch.bfloat16),
        torch.randn(30_000, generator=g).to(torch.float16),
    ]


def test_narrow_rows_by_the_kernel_match_the_rows_bound() -> None:
    ts = narrow_list()
    kc = KernelCache("wait")
    engine = NormEngine(kernels=kc)
    engine.squared_norms(ts)
    narrow = [b.narrow for b in engine._plan.buckets]  # type: ignore[union-attr]
    assert all(r is not None for r in narrow) and len(narrow) == 2  # bf16 and fp16
    calls = []
    for r in narrow:
        real = r.kernel  # type: ignore[union-attr]
        assert real is not None
        r.kernel = lambda views, real=real: calls.append(1) or real(views)  # type: ignore[union-attr]
    sq = engine.squared_norms(ts)
    assert len(calls) == 2  # each bucket's row-path tensors: one compiled call
    for i, t in enumerate(ts):
        got, want = float(sq[i]), fsum_square(t)
        if math.isnan(want):
            assert math.isnan(got), i
        else:
            assert abs(got - want) <= 2e-6 * want, (i, got, want)  # rows: 1e-6 on norms
    with OpCounter():  # a dispatch mode: the eager rows, seen by it
        engine.squared_norms(ts)
    assert len(calls) == 2


def test_narrow_rows_with_other_strides_take_the_eager_rows_and_replan() -> None:
    ts = narrow_list()[:2]
    kc = KernelCache("wait")
    engine = NormEngine(kernels=kc)
    engine.squared_norms(ts)
    bucket = engine._plan.buckets[0]  # type: ignore[union-attr]
    assert bucket.narrow is not None and bucket.narrow.kernel is not None
    kc.mode = "off"
    g = torch.Generator().manual_seed(13)
    column = torch.randn(70_000, 2, generator=g).to(torch.bfloat16)[:, 0]  # stride 2
    strided = [column, ts[1]]
    got = engine.squared_norms(strided)
    assert engine._plan.buckets[0] is not bucket  # type: ignore[union-attr]
    for i, t in enumerate(strided):
        want = fsum_square(t)
        assert abs(float(got[i]) - want) <= 2e-6 * want, i
