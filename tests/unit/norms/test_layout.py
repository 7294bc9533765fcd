"""The per-step layout check of a cached norm plan (norms/layout.py) and the engine's use of it:
a plan is reused without per-tensor Python checks only while every gradient keeps its layout,
and any change (presence, dtype, shape, strides, device, an autograd zero tensor) is seen."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.doctor.testing import OpCounter
from gradwatch.norms.layout import LayoutGuard, layout_key
from gradwatch.norms.stats import NormEngine


def _grads() -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(20_000, generator=g), None, torch.randn(30, 40, generator=g),
            torch.randn(7, generator=g).to(torch.bfloat16)]


def _reference(tensors: list[torch.Tensor | None]) -> list[float]:
    return [0.0 if t is None else math.fsum(float(x) ** 2 for x in t.double().reshape(-1))
            for t in tensors]


def test_holds_for_the_same_layout_and_new_tensors() -> None:
    grads = _grads()
    guard = LayoutGuard.of(grads)
    assert guard is not None
    assert guard.holds(grads)
    assert guard.holds([None if t is None else t.clone() for t in grads])
    # a view at another storage offset with the same sizes and strides still fits
    shifted = torch.randn(20_001)[1:]
    assert guard.holds([shifted, *grads[1:]])


@pytest.mark.parametrize("change", ["absent", "present", "dtype", "shape", "strides", "meta",
                                    "zero", "length", "requires_grad"])
def test_any_layout_change_fails_the_guard(change: str) -> None:
    grads = _grads()
    guard = LayoutGuard.of(grads)
    assert guard is not None
    changed = list(grads)
    if change == "absent":
        changed[0] = None
    elif change == "present":
        changed[1] = torch.randn(3)
    elif change == "dtype":
        changed[0] = grads[0].double()  # type: ignore[union-attr]
    elif change == "shape":
        changed[2] = torch.randn(40, 30)
    elif change == "strides":
        changed[2] = torch.randn(40, 30).t()
    elif change == "meta":
        changed[2] = torch.empty(30, 40, device="meta")
    elif change == "zero":
        changed[2] = torch._efficientzerotensor(30, 40)
    elif change == "length":
        changed = changed[:3]
    else:
        changed[2] = torch.randn(30, 40, requires_grad=True)
    assert not guard.holds(changed)


def test_a_dispatch_mode_fails_the_guard_then_the_python_key_decides() -> None:
    """A mode's dispatch key is part of what the guard checks: a plan built outside is checked
    by the Python key inside (and its in-place paths check strides), still reused."""
    grads = _grads()
    guard = LayoutGuard.of(grads)
    assert guard is not None
    engine = NormEngine()
    engine.squared_norms(grads)
    plan = engine._plan
    with OpCounter():
        assert not guard.holds(grads)
        sq = engine.squared_norms(grads)
    assert engine._plan is plan
    assert sq[:4].tolist() == pytest.approx(_reference(grads), rel=1e-6)


def test_layout_key_reads_presence_dtype_and_shape() -> None:
    grads = _grads()
    assert layout_key(grads)[1] is None
    assert layout_key(grads)[2] == (torch.float32, torch.Size([30, 40]))


def test_engine_reuses_the_plan_and_sees_every_change() -> None:
    """Norms stay exact through the guarded reuse, a stride change (same shape: the Python key
    alone would not see it) and a dtype change; the plan is rebuilt exactly on the changes."""
    engine = NormEngine()
    grads = _grads()
    sq = engine.squared_norms(grads)
    first = engine._plan
    assert first is not None and first.guard is not None
    assert sq[:4].tolist() == pytest.approx(_reference(grads), rel=1e-6)
    fresh = [None if t is None else t * 2 for t in grads]
    sq = engine.squared_norms(fresh)
    assert engine._plan is first
    assert sq[:4].tolist() == pytest.approx(_reference(fresh), rel=1e-6)
    transposed = list(fresh)
    transposed[0] = torch.randn(20_000 * 2)[::2]  # same shape, other strides: a row-path read
    sq = engine.squared_norms(transposed)
    assert engine._plan is not first
    assert sq[:4].tolist() == pytest.approx(_reference(transposed), rel=1e-6)
    widened = [None if t is None else t.double() for t in transposed]
    sq = engine.squared_norms(widened)
    assert sq[:4].tolist() == pytest.approx(_reference(widened), rel=1e-12)
