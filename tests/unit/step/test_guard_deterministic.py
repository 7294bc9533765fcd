"""Deterministic mode: the collect, the clip and the guard (spike skipping on) dispatch no op
PyTorch refuses under ``torch.use_deterministic_algorithms(True)`` on CUDA or lists as
nondeterministic there, on the route accelerators take; and the guard works in that mode."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.doctor.testing import NondeterministicOps
from gradwatch.norms import stats


@pytest.fixture
def deterministic() -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_recorder_flags_what_torch_lists() -> None:
    x = torch.arange(6.0).view(2, 3)
    distinct, repeated = torch.tensor([0, 2]), torch.tensor([1, 1])
    with NondeterministicOps() as rec:
        x.nanmedian(dim=1)
        x.median(dim=0)
        x.cumsum(0)
        torch.zeros(3).index_add_(0, distinct, torch.ones(2))
        torch.zeros(3).scatter_add_(0, distinct, torch.ones(2))
        torch.zeros(3).index_copy_(0, repeated, torch.ones(2))
        torch.zeros(3).index_put_((repeated,), torch.ones(2), accumulate=True)
    assert [f.split(":")[0] for f in rec.found] == [
        "aten.nanmedian", "aten.median", "aten.cumsum", "aten.index_add_",
        "aten.scatter_add_", "aten.index_copy_", "aten.index_put_",
    ]
    with NondeterministicOps() as rec:  # their deterministic relatives
        x.nanmedian()
        x.sort(dim=1)
        torch.arange(3).cumsum(0)
        torch.zeros(3).index_copy_(0, distinct, torch.ones(2))
        torch.zeros(3).index_put_((distinct,), torch.ones(2))
    assert rec.found == []


class _Mixed(nn.Module):
    """Parameters of several sizes and dtypes (row-path and whole-tensor norms, a float64 one
    for the rescaled path)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big = nn.Linear(64, 300)
        self.small = nn.Linear(300, 3)
        self.wide = nn.Parameter(torch.randn(5, 2, dtype=torch.float64))


def _grads(model: _Mixed, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    factor = {9: 1e4, 11: 1e20, 12: 1e-25}.get(step, 1.0)  # a spike, huge and tiny steps
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * factor
    if step == 10:
        model.small.weight.grad[0, 0] = math.nan


def test_collect_clip_and_guard_dispatch_no_nondeterministic_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every step clips and is guarded, spike skipping on; a spike, a NaN step, huge (1e20) and
    tiny (1e-25) gradients. The row sums take the accelerators' route (a CSR product: the CPU
    takes ``index_add_`` below ``CSR_MIN_ROWS`` rows, deterministic there)."""
    monkeypatch.setattr(stats, "CSR_MIN_ROWS", 1)
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    cfg = WatchConfig(skip_spike_score=6.0, spike_warmup=4, spike_window=8)
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        with NondeterministicOps() as rec:
            for step in range(14):
                _grads(model, step)
                watch.clip_grad_norm_(1.0)
                guarded.step()
                watch._collector.latest.result()  # the host read and the summary too
        assert rec.found == []
        last = watch._collector.latest.result()
        assert last.skipped_steps["spike"] >= 1 and last.skipped_steps["nonfinite"] == 1


def test_the_guard_skips_spikes_under_deterministic_algorithms(deterministic: None) -> None:
    model = _Mixed()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    cfg = WatchConfig(skip_spike_score=6.0, spike_warmup=4, spike_window=8)
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        for step in range(10):
            _grads(model, step)
            before = model.big.weight.detach().clone()
            guarded.step()
            assert torch.equal(before, model.big.weight) == (step == 9), step
            guarded.zero_grad()
        snap = watch._collector.latest.result()
        assert snap.skipped_steps == {"nonfinite": 0, "spike": 1}
        assert math.isfinite(snap.global_norm)
