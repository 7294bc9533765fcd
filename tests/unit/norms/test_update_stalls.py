"""Stalled elements of float32/float64 weights, measured: counts against a float64 reference
computed here from copies of the weights and of the optimizer's state (the product copies
neither), on a weight whose elements are built to stall, to move, or to be left alone."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from update_refs import STALLING_OPTIMIZERS

from gradwatch import GradWatch, WatchConfig
from gradwatch.norms.updates import BATCH, UpdateMeter

#: Blocks of the test weight: (weight, gradient, elements). At lr 1e-10 an Adam or SGD step
#: moves an element by about 1e-10 (SGD: lr times a gradient of 0.5 to 2): under half an ulp
#: of 1e4 (4.9e-4: stalls), far above one of 1e-4 (7e-12: moves). A decay of 0.1 (decoupled,
#: or SGD's L2) moves 1e-4 by 1e-15, under its half ulp.
BLOCKS = (
    (1e4, 1.0, 700),     # meant to move, rounded away
    (1e-4, -1.0, 500),   # moves
    (0.0, 0.0, 300),     # nothing meant: no gradient, no weight to decay
    (0.0, 2.0, 200),     # a zero weight that moves
    (1e-4, 0.0, 400),    # no gradient: only the decay means to move it (stalls under it)
    (-3e3, 0.5, 100),    # stalls
)


def weight(repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The test weight and its (fixed) gradient, ``repeat`` times the blocks."""
    w = torch.cat([torch.full((n,), v) for v, _g, n in BLOCKS] * repeat)
    g = torch.cat([torch.full((n,), gv) for _v, gv, n in BLOCKS] * repeat)
    return w, g


def intended_change(opt: torch.optim.Optimizer, p: torch.Tensor, before: torch.Tensor,
                    grad: torch.Tensor | None = None) -> torch.Tensor:
    """The step's intended change in float64 from copies of the state after the step (the
    reference's own arithmetic): Adam/AdamW's ``lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) (+
    lr*wd*p_old)``; SGD's ``lr * buf`` (momentum: the buffer holds the decay) or ``lr * (g +
    wd * p_old)``."""
    group = opt.param_groups[0]
    state = opt.state[p]
    if isinstance(opt, torch.optim.SGD):
        lr, wd = float(group["lr"]), group["weight_decay"]
        if state.get("momentum_buffer") is not None:
            return lr * state["momentum_buffer"].double()
        assert grad is not None
        return lr * (grad.double() + wd * before)
    lr, (b1, b2), eps = float(group["lr"]), group["betas"], group["eps"]
    t = float(state["step"])
    m = state["exp_avg"].double()
    v = state["exp_avg_sq"].double()
    u = lr / (1 - b1**t) * m / (v.sqrt() / math.sqrt(1 - b2**t) + eps)
    if isinstance(opt, torch.optim.AdamW):
        u = u + lr * group["weight_decay"] * before
    return u


def counts_of(meter: UpdateMeter) -> tuple[int, int]:
    """The meter's stalled and moving elements of its one group (then cleared)."""
    figures = meter.figures(count_all=True)
    stalled, moving = float(figures[2]), float(figures[3])
    assert stalled == int(stalled) and moving == int(moving)
    return int(stalled), int(moving)


OPTIMIZERS: dict[str, Any] = STALLING_OPTIMIZERS


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("repeat", [1, BATCH // 2200 + 1])  # one view; several views
def test_float32_stalls_are_counted_exactly(kind: str, repeat: int) -> None:
    w, g = weight(repeat)
    p = torch.nn.Parameter(w.clone())
    opt = OPTIMIZERS[kind](p, 1e-10)
    meter = UpdateMeter([p], [0], 1, [True], torch.device("cpu"))
    try:
        counts_of(meter)
        for step in range(3):
            before = p.detach().double().clone()
            p.grad = g.clone()
            opt.step()
            after = p.detach().double()
            moving = intended_change(opt, p, before, g) != 0
            stalled = moving & (after == before)
            expected = (int(stalled.sum()), int(moving.sum()))
            decayed = kind.startswith("adamw") or kind.startswith("sgd_")
            # what the blocks make of it, known without the reference
            known_stalled = (700 + 100 + (400 if decayed else 0)) * repeat
            known_moving = known_stalled + (500 + 200) * repeat
            assert expected == (known_stalled, known_moving), step
            assert counts_of(meter) == expected, step
    finally:
        meter.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_mix_of_stalled_and_moving_elements_against_the_copies(dtype: torch.dtype) -> None:
    """End to end: random weights spanning 1e-6 to 1e6, random gradients with zeros, AdamW at
    lr 1e-7 (float64: 1e-16; either way the decay alone moves no weight): the published
    stalled fraction within 0.02 of the float64 reference (and in fact equal to its counts),
    which is neither near 0 nor near 1."""
    torch.manual_seed(11)
    n = 20_000
    lr = 1e-7 if dtype == torch.float32 else 1e-16
    magnitude = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(-6, 6))
    w = (magnitude * torch.randn(n, dtype=torch.float64).sign()).to(dtype)
    w[:500] = 0.0
    model = torch.nn.Linear(1, 1, bias=False)
    model.weight = torch.nn.Parameter(w.reshape(-1, 1).clone())
    p = model.weight
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.1, foreach=True)
    fractions, references = [], []
    with GradWatch(model, WatchConfig(update_stats=True)) as watch:
        for step in range(4):
            watch.collect(step)
            fractions.append(watch.last.stalled_fraction)
            before = p.detach().double().clone()
            grad = torch.randn(n, 1, dtype=dtype)
            grad[torch.rand(n, 1) < 0.3] = 0.0
            p.grad = grad
            opt.step()
            moving = intended_change(opt, p, before) != 0
            stalled = moving & (p.detach().double() == before)
            references.append(int(stalled.sum()) / int(moving.sum()))
    for k in range(1, 4):
        assert 0.05 < references[k - 1] < 0.95
        assert abs(fractions[k] - references[k - 1]) <= 0.02
        assert fractions[k] == pytest.approx(references[k - 1], abs=1e-12)


def test_a_skipped_fused_step_meant_nothing_to_move() -> None:
    """A fused AdamW step with ``found_inf`` set changes nothing and meant nothing: no element
    is moving (the stalled fraction is NaN, not 1)."""
    w, g = weight()
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=1e-10, weight_decay=0.1, fused=True)
    meter = UpdateMeter([p], [0], 1, [True], torch.device("cpu"))
    try:
        p.grad = g.clone()
        opt.step()
        assert counts_of(meter)[1] > 0
        p.grad = g.clone()
        before = p.detach().clone()
        opt.found_inf = torch.ones(())  # as a GradScaler sets it for a fused step
        opt.step()
        assert torch.equal(p.detach(), before)
        assert counts_of(meter) == (0, 0)
    finally:
        meter.close()
