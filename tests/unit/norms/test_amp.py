"""A collect after ``scaler.update()`` reads the gradients as they are (already unscaled by
``scaler.step``), never divided by the new scale; one before ``step`` still unscales."""

from __future__ import annotations

import math

import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig


def _norm(model: nn.Module) -> float:
    return math.sqrt(
        sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None)
    )


def test_collect_after_update_does_not_divide_by_the_new_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.Linear(30, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    with GradWatch(model, WatchConfig()) as watch:
        for it in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 20)).square().sum()).backward()
            scale = float(scaler.get_scale())
            before = watch.collect(2 * it, scaler=scaler).result()
            assert math.isclose(before.global_norm, _norm(model) / scale, rel_tol=1e-6)
            scaler.step(opt)
            scaler.update()  # growth_interval=1: the scale changes at every update
            assert float(scaler.get_scale()) != scale
            after = watch.collect(2 * it + 1, scaler=scaler).result()
            assert math.isclose(after.global_norm, _norm(model), rel_tol=1e-6), it
