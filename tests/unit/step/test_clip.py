"""Unit tests of clipping from the reduced statistics (gradwatch.step.clip) with an explicit
LocalGradients value (gradwatch.norms.gradients), on one process: no watcher, no hidden state."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from gradwatch.norms.gradients import GradientReader, LocalGradients
from gradwatch.norms.stats import NormEngine
from gradwatch.reduce.layout import piece_of
from gradwatch.reduce.packing import Reducer
from gradwatch.snapshot import CLIP_EPS, clip_coefficient
from gradwatch.step.clip import clip_grads_


def reduce_once(params: list[torch.Tensor], grads: LocalGradients):  # type: ignore[no-untyped-def]
    """The collect pipeline up to the all-reduce: norms (with their plan), packed, reduced."""
    reducer = Reducer(
        [piece_of(f"p{i}", p) for i, p in enumerate(params)],
        version="v",
        config_hash="c",
        timeout_seconds=5.0,
    )
    sq, plan = NormEngine().squared_norms_and_plan(grads.tensors, reducer.device)
    has_grad = [g is not None for g in grads.tensors]
    return reducer.pack_and_reduce(sq, has_grad, step=0, with_replicas=False), plan


def model_with_grads(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(30, 700), nn.Tanh(), nn.Linear(700, 3))
    model[0].bias.requires_grad_(False)  # frozen: no gradient read
    model(torch.randn(5, 30)).pow(2).sum().mul(100).backward()
    return model


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_equals_torch_clip_grad_norm(max_norm: float) -> None:
    model = model_with_grads(0)
    reference = copy.deepcopy(model)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        q.grad = None if p.grad is None else p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(
        [p for p in reference.parameters() if p.grad is not None], max_norm
    )
    assert float(expected) > 1.0
    params = list(model.parameters())
    grads = GradientReader(params).read()
    assert grads.tensors[1] is None and grads.sparse_positions == []
    reduced, plan = reduce_once(params, grads)
    total = clip_grads_(reduced, max_norm, grads, plan)
    assert total.dtype == torch.float64 and total.dim() == 0
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-12)
    coef = clip_coefficient(max_norm, float(total))
    assert coef == min(1.0, max_norm / (float(total) + CLIP_EPS))


def test_sparse_and_complex_gradients_are_scaled_in_place() -> None:
    dense = nn.Parameter(torch.zeros(3))
    dense.grad = torch.tensor([3.0, 0.0, 0.0])
    sparse = nn.Parameter(torch.zeros(4, 2))
    sparse.grad = torch.sparse_coo_tensor(  # uncoalesced: row 0 twice
        [[0, 2, 0]], torch.ones(3, 2), (4, 2), check_invariants=True
    )
    cplx = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    cplx.grad = torch.tensor([0j, 2 + 0j], dtype=torch.complex64)
    params = [dense, sparse, cplx]
    grads = GradientReader(params).read()
    assert grads.sparse_positions == [1] and grads.sparse_grads[0] is sparse.grad
    assert grads.tensors[2].dtype == torch.float32  # the real view of the complex gradient
    reduced, plan = reduce_once(params, grads)
    # ||dense||^2 = 9, sparse: rows 0 (twice, summed) and 2 -> 4 * 2 + 1 * 2 = 10, complex 4
    total = clip_grads_(reduced, 1.0, grads, plan)
    assert float(total) == pytest.approx(math.sqrt(23.0), rel=1e-12)
    coef = 1.0 / (math.sqrt(23.0) + CLIP_EPS)
    assert dense.grad[0].item() == pytest.approx(3.0 * coef, rel=1e-6)
    assert sparse.grad.to_dense()[0, 0].item() == pytest.approx(2.0 * coef, rel=1e-6)
    assert cplx.grad[1].real.item() == pytest.approx(2.0 * coef, rel=1e-6)


def test_nonfinite_flag_makes_the_total_nan() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, 1.0])
    b.grad = torch.tensor([math.inf, 0.0])
    grads = GradientReader([a, b]).read()
    reduced, plan = reduce_once([a, b], grads)
    total = clip_grads_(reduced, 1.0, grads, plan)
    assert math.isnan(float(total))
