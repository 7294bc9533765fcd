"""A divergence case: fixed clipping at max_norm 1.0 against ``clip_grad_norm_("auto")``.

One process, CPU, seeded. A 3-layer tanh MLP (32-64-64-1, SGD lr ``LR``, momentum 0.9) fits
``0.1 * sin(3 x.t)`` for a fixed random ``t``; its ordinary gradient norm is about 0.1. From
step ``FIRST_BAD`` on, every ``every``-th batch is corrupt (its targets times ``BAD_SCALE``: a
gradient spike of about three orders of magnitude, as a bad shard or a loss-scale slip gives).
Both arms see the same batches and differ only in the clip: ``watch.clip_grad_norm_(1.0)`` (the
Hugging Face Trainer's default ``max_grad_norm``) or ``watch.clip_grad_norm_("auto")`` (the
defaults: z 2.5, alpha 0.97, 25 warm-up steps). The loss is the mean squared error on a fixed
held-out set of 512 points, every ``EVAL_EVERY`` steps; an arm *diverges* when that loss turns
NaN or exceeds ``DIVERGED_RATIO`` times its value before the first step.

Three rates, ``SEEDS`` seeds each: no corrupt batch (the control: neither arm may diverge, so
the learning rate alone is not the cause), one in ``SPARSE_EVERY`` and one in ``DENSE_EVERY``
steps. The target: on every seed with corrupt batches fixed clipping diverges and "auto" does
not, and no arm of the control diverges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Target: with corrupt batches fixed diverges and "auto" does not; without, neither does.
TARGET = "every seed: fixed diverges, auto does not; neither in the control"
LR = 0.3
#: The targets' amplitude: sets the ordinary gradient norm.
AMPLITUDE = 0.1
STEPS = 300
FIRST_BAD = 50
BAD_SCALE = 1000.0
EVAL_EVERY = 10
DIVERGED_RATIO = 10.0
SPARSE_EVERY = 10
DENSE_EVERY = 5
RATES = (0, SPARSE_EVERY, DENSE_EVERY)  # 0: the control, no corrupt batch
SEEDS = 3
FIXED_MAX_NORM = 1.0


@dataclass(frozen=True)
class DivergenceRun:
    """One arm of one seed: held-out losses and the clip's figures."""

    every: int  # one corrupt batch in this many steps (0: none)
    seed: int
    mode: str  # "fixed 1.0" or "auto"
    start_loss: float
    end_loss: float
    worst_loss: float  # the largest held-out loss (inf once NaN)
    ordinary_norm: float  # median pre-clip norm of the steps before the first corrupt batch

    @property
    def worst_ratio(self) -> float:
        return self.worst_loss / self.start_loss

    @property
    def diverged(self) -> bool:
        return not math.isfinite(self.worst_loss) or self.worst_ratio > DIVERGED_RATIO


@dataclass(frozen=True)
class DivergenceResult:
    runs: list[DivergenceRun]

    @property
    def met(self) -> bool:
        """See :data:`TARGET`."""
        return bool(self.runs) and all(
            r.diverged == (r.every != 0 and r.mode != "auto") for r in self.runs
        )


def run_arm(every: int, seed: int, auto: bool, steps: int = STEPS) -> DivergenceRun:
    """Train one arm (see the module docstring)."""
    import torch
    from torch import nn

    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(seed)
    d_in = 32
    model = nn.Sequential(nn.Linear(d_in, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 1))
    teacher = torch.randn(d_in, 1) / math.sqrt(d_in)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1)
    held_x = torch.randn(512, d_in, generator=gen)
    held_y = AMPLITUDE * torch.sin(3 * held_x @ teacher)

    def held_out() -> float:
        with torch.no_grad():
            loss = float((model(held_x) - held_y).pow(2).mean())
        return loss if math.isfinite(loss) else math.inf

    start = worst = held_out()
    norms: list[float] = []
    limit: float | str = "auto" if auto else FIXED_MAX_NORM
    with GradWatch(model, WatchConfig()) as watch:
        for step in range(steps):
            x = torch.randn(32, d_in, generator=gen)
            y = AMPLITUDE * torch.sin(3 * x @ teacher)
            if every and step >= FIRST_BAD and step % every == 0:
                y = y * BAD_SCALE  # a corrupt batch
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            total = watch.clip_grad_norm_(limit, step=step)
            if step < FIRST_BAD:
                norms.append(float(total))
            opt.step()
            if step % EVAL_EVERY == EVAL_EVERY - 1 or step == steps - 1:
                worst = max(worst, held_out())
                if math.isinf(worst):
                    break
    end = held_out()
    return DivergenceRun(every, seed, "auto" if auto else f"fixed {FIXED_MAX_NORM:g}", start,
                         end, max(worst, end), sorted(norms)[len(norms) // 2])


def measure(seeds: int = SEEDS) -> DivergenceResult:
    """Both arms of ``seeds`` seeds at every rate of :data:`RATES`."""
    runs = [
        run_arm(every, seed, auto)
        for every in RATES for seed in range(seeds) for auto in (False, True)
    ]
    return DivergenceResult(runs)


def _loss(v: float) -> str:
    return "NaN/inf" if not math.isfinite(v) else f"{v:.4g}"


def text(result: DivergenceResult | None) -> str:
    """The section's markdown."""
    if result is None:
        return "skipped\n"
    rows = [
        "| corrupt batches | seed | clip | ordinary norm | held-out loss at start | worst "
        "| end | worst / start | diverged |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result.runs:
        rate = f"1 in {r.every}" if r.every else "none"
        rows.append(
            f"| {rate} | {r.seed} | {r.mode} | {r.ordinary_norm:.3f} | "
            f"{_loss(r.start_loss)} | {_loss(r.worst_loss)} | {_loss(r.end_loss)} | "
            f"{r.worst_ratio:.3g}x | {'yes' if r.diverged else 'no'} |"
        )
    verdict = "met" if result.met else "NOT met"
    return (
        f"SGD lr {LR} momentum 0.9, {STEPS} steps, corrupt batches (targets x{BAD_SCALE:g}) "
        f"from step {FIRST_BAD}; diverged: held-out loss NaN or above {DIVERGED_RATIO:g}x its "
        f"start. Target ({TARGET}): {verdict}.\n\n"
        + "\n".join(rows) + "\n"
    )
