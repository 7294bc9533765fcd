"""What the one-process update-health tests share: the small model, the float64 copies of its
weights (in the tests only: the product copies nothing), their exact norms, the tolerances,
and the optimizers the stall tests run."""

from __future__ import annotations

import math
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
