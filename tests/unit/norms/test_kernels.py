"""The compile cache: eager until ready, compiled after, failures logged and never raised."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gradwatch.doctor.testing import OpCounter
from gradwatch.norms.kernels import (
    KernelCache,
    compile_traced,
    compile_traced_cpp,
    compiled_calls_allowed,
    tensor_layout,
)


def squares(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.double().square().sum() for t in ts])


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=g) for n in (1000, 3000)]


def _example(ts: list[torch.Tensor]):
    return lambda: ([torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in ts],)


def test_off_never_compiles() -> None:
    kc = KernelCache("off")
    ts = _grads()
    assert kc.get(squares, tensor_layout(ts), _example(ts)) is None
    assert (kc.ready, kc.pending, kc.failed) == (0, 0, 0)


def test_background_is_eager_until_ready_then_compiled() -> None:
    kc = KernelCache("background")
    ts = _grads()
    key = tensor_layout(ts)
    assert kc.get(squares, key, _example(ts)) is None  # never waits
    assert kc.wait(timeout=300)
    fn = kc.get(squares, key, _example(ts))
    assert fn is not None and kc.ready == 1
    with torch.no_grad():
        got = fn(ts)
    want = [sum(float(x) ** 2 for x in t.double().tolist()) for t in ts]
    assert got.dtype == torch.float64
    for g, w in zip(got.tolist(), want, strict=True):
        assert g == pytest.approx(w, rel=1e-12)


def test_failed_compile_is_logged_once_and_stays_eager(caplog: pytest.LogCaptureFixture) -> None:
    def broken(ts: list[torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("no compiler here")

    kc = KernelCache("wait")
    ts = _grads()
    with caplog.at_level(logging.WARNING, logger="gradwatch.norms.kernels"):
        assert kc.get(broken, tensor_layout(ts), _example(ts)) is None
        assert kc.get(broken, tensor_layout(ts), _example(ts)) is None
    assert kc.failed == 1
    assert sum("compiling" in r.message for r in caplog.records) == 1


def test_bad_mode_names_the_field() -> None:
    with pytest.raises(ValueError, match="compile_kernels"):
        KernelCache("sometimes")  # type: ignore[arg-type]


def test_dispatch_modes_see_the_eager_path() -> None:
    assert compiled_calls_allowed()
    with OpCounter():
        assert not compiled_calls_allowed()



def scaled_squares(ts: list[torch.Tensor], scale: torch.Tensor,
                   offset: torch.Tensor | None) -> torch.Tensor:
    out = torch.stack([t.double().square().sum() for t in ts]) * scale
    return out if offset is None else out + offset


def test_compile_traced_takes_live_scalars_and_never_recompiles() -> None:
    """Traced without dynamo: lists and None as arguments, a 0-dim tensor read on every call
    (a changing value never recompiles: no dynamo graph at all), results as eager's."""
    kc = KernelCache("wait", compile_traced)
    ts = _grads()
    args = (ts, torch.tensor(2.0, dtype=torch.float64), None)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def example() -> tuple:
        return ([torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_() for t in ts],
                torch.zeros((), dtype=torch.float64), None)

    fn = kc.get(scaled_squares, tensor_layout(ts), example)
    assert fn is not None
    with torch.no_grad():
        for scale in (2.0, 0.5, 3.0):
            args = (ts, torch.tensor(scale, dtype=torch.float64), None)
            got, want = fn(*args), scaled_squares(*args)
            assert torch.allclose(got, want, rtol=1e-12, atol=0.0)
    assert kc.ready == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_limit_keeps_new_layouts_eager(caplog: pytest.LogCaptureFixture) -> None:
    kc = KernelCache("wait", limit=1)
    ts = _grads()
    assert kc.get(squares, tensor_layout(ts), _example(ts)) is not None
    other = [torch.randn(7)]
    with caplog.at_level(logging.WARNING, logger="gradwatch.norms.kernels"):
        assert kc.get(squares, tensor_layout(other), _example(other)) is None
        assert kc.get(squares, tensor_layout(other), _example(other)) is None
    assert kc.ready == 1 and kc.pending == 0
    assert sum("limit" in r.message for r in caplog.records) == 1
    assert kc.get(squares, tensor_layout(ts), _example(ts)) is not None  # known: still used


_EXIT_MID_COMPILE = """
import time, torch
from gradwatch.norms import kernels
def sq(ts):
    return torch.stack([t.double().square().sum() for t in ts])
gs = [torch.randn(1000) for _ in range(3)]
example = lambda: ([torch.empty_like(t) for t in gs],)
kernels.KernelCache("background").get(sq, kernels.tensor_layout(gs), example)
deadline = time.monotonic() + 60
while not kernels._running and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(1.0)  # well inside the compile (a cold cache: several seconds)
print("in hand" if kernels._running else "not compiling", flush=True)
"""


def test_a_process_ending_mid_compile_waits_and_exits_cleanly(tmp_path) -> None:
    """A daemon thread ended inside torch's compiler aborts the process (exit status 134);
    the exit hook lets the compile in hand finish first, so the job's status is its own."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", _EXIT_MID_COMPILE], env=env, timeout=240,
                          capture_output=True, text=True)
    assert "in hand" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr
    assert "waiting up to" in done.stderr


def test_traced_calls_skip_inductors_entry_but_not_under_the_profiler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced kernel calls the generated code directly, with the bits of inductor's own
    entry; under the autograd profiler it goes through that entry (which labels the call)."""
    ts = _grads()
    kernel = compile_traced(squares, _example(ts))
    entries: list[int] = []
    compiled = kernel._compiled
    monkeypatch.setattr(kernel, "_compiled", lambda flat: entries.append(1) or compiled(flat))
    with torch.no_grad():
        direct = kernel(ts)
        assert entries == []
        assert torch.equal(direct, compiled(list(ts))[0])
        with torch.autograd.profiler.profile():
            profiled = kernel(ts)
    assert entries == [1]
    assert torch.equal(direct, profiled)


def _scaled_sum(ts: list[torch.Tensor], scale: torch.Tensor | None) -> torch.Tensor:
    total = torch.stack([t.double().square().sum() for t in ts]).sum()
    return total if scale is None else total * scale


def test_a_cpp_wrapped_kernel_matches_and_leaves_none_out() -> None:
    ts = _grads()
    scale = torch.tensor(3.0, dtype=torch.float64)
    example = lambda: ([torch.zeros_like(t) for t in ts], None)  # noqa: E731
    python = compile_traced(_scaled_sum, example)
    cpp = compile_traced_cpp(_scaled_sum, example)
    with torch.no_grad():
        assert torch.equal(cpp(ts, None), python(ts, None))
        expected = math.fsum(float(x) ** 2 for t in ts for x in t.tolist())
        assert float(cpp(ts, None)) == pytest.approx(expected, rel=1e-12)
        with_scale = compile_traced_cpp(_scaled_sum, lambda: ([torch.zeros_like(t) for t in ts],
                                                              torch.zeros((), dtype=torch.float64)))
        assert float(with_scale(ts, scale)) == pytest.approx(3 * expected, rel=1e-12)

