"""What the one-process update-health tests share: the small model, the float64 copies of its
weights (in the tests only: the product copies nothing), their exact norms, the tolerances,
and the optimizers the stall tests run."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

GROUPS = {"first": ["0.*"]}
WEIGHT_TOL = 1e-6
UPDATE_TOL = 1e-4


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)


def copies(m: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.float64).clone() for n, p in m.named_parameters()}


def norm_of(parts: list[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in parts for x in t.reshape(-1).tolist()))


#: Optimizers of one weight ``p`` at learning rate ``lr``, by name.
STALLING_OPTIMIZERS: dict[str, Any] = {
    "adamw_foreach": lambda p, lr: torch.optim.AdamW([p], lr=lr, weight_decay=0.1,
                                                     foreach=True),
    "adamw_for_loop": lambda p, lr: torch.optim.AdamW([p], lr=lr, weight_decay=0.1,
                                                      foreach=False),
    "adamw_fused_tensor_lr": lambda p, lr: torch.optim.AdamW(
        [p], lr=torch.tensor(lr), weight_decay=0.1, fused=True),
    "adam_no_decay": lambda p, lr: torch.optim.Adam([p], lr=lr, foreach=True),
    "adam_fused": lambda p, lr: torch.optim.Adam([p], lr=lr, fused=True),
    "sgd": lambda p, lr: torch.optim.SGD([p], lr=lr),
    "sgd_decay_foreach": lambda p, lr: torch.optim.SGD([p], lr=lr, weight_decay=0.1,
                                                       foreach=True),
    "sgd_momentum_decay": lambda p, lr: torch.optim.SGD([p], lr=lr, momentum=0.9,
                                                        weight_decay=0.1),
}


#: Optimizers of a whole model, by name: every torch.optim implementation the meter reads.
MODEL_OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
    "sgd_momentum_foreach": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01, foreach=True),
    "sgd_nesterov_wd": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1, foreach=False),
    "sgd_fused_maximize": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.01, momentum=0.5, dampening=0.1, maximize=True, fused=True),
    "adamw_for_loop": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False),
    "adamw_foreach": lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-3, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True),
    "adam_l2_amsgrad": lambda m: torch.optim.Adam(
        m.parameters(), lr=1e-3, weight_decay=0.1, amsgrad=True),
    "adam_tensor_lr_fused": lambda m: torch.optim.Adam(
        m.parameters(), lr=torch.tensor(2e-3), fused=True),
}
