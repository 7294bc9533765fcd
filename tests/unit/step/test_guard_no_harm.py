"""First, do no harm: whatever happens to gradwatch (it cannot see, its pass failed, a
collective failed or timed out, it is closed or disabled), the guarded optimizer step is bitwise
the bare optimizer's with the user's GradScaler; a skip the guard takes leaves optimizer state
as a fresh optimizer's."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.errors import GradWatchTimeoutError

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(model: nn.Module, scaler: torch.amp.GradScaler, step: int, inf: bool) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
    loss = (model(x) - y).pow(2).mean()
    if inf:
        loss = loss * math.inf
    scaler.scale(loss).backward()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out.extend(v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor))
    return out


def _bits(tensors: list[torch.Tensor]) -> list[bytes]:
    """Each tensor's bytes: equal lists are bitwise equal states (NaN payloads included)."""
    return [t.numpy().tobytes() for t in tensors]


def _raise(exc: Exception) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


def _inject(fault: str, watch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make gradwatch unable to decide from now on, the way ``fault`` does in a real run."""
    if fault == "closed":
        watch.close()
        return
    collector = watch._collector
    if fault == "failed-pass":  # every local pass raises: no decision, collection goes on
        monkeypatch.setattr(
            collector.engine, "squared_norms_and_plan", _raise(RuntimeError("boom"))
        )
    elif fault == "timed-out-collective":  # a timed-out clip/guard wait stops collection
        monkeypatch.setattr(
            collector.engine, "squared_norms_and_plan", _raise(GradWatchTimeoutError("late"))
        )
    elif fault == "failed-collective":  # an earlier all-reduce failed: stopped at check
        monkeypatch.setattr(
            collector.resolved.reducer.collective, "failure", lambda: "peer reset"
        )
    else:
        raise AssertionError(fault)


FAULTS = ["failed-pass", "timed-out-collective", "failed-collective", "closed", "disabled"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_guard_that_cannot_decide_steps_bitwise_as_the_bare_scaler_path(
    name: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 0-1 guarded normally, then the fault; steps 2-6 (an fp16-style overflow at step
    4, which the scaler skips and halves its scale for) must equal the bare optimizer + the
    bare GradScaler bit for bit: parameters, optimizer state and the scale."""
    make = OPTIMIZERS[name]
    model, twin = _model(), _model()
    opt, twin_opt = make(model.parameters()), make(twin.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    cfg = WatchConfig(skip_nonfinite=True, enabled=fault != "disabled")
    watch = GradWatch(model, cfg)
    try:
        guarded = watch.guard(opt, scaler=scaler)
        for step in range(7):
            if step == 2 and fault != "disabled":
                _inject(fault, watch, monkeypatch)
            for m, s, o in ((model, scaler, guarded), (twin, twin_scaler, twin_opt)):
                _backward(m, s, step, inf=step == 4)
                s.step(o)
                s.update()
                o.zero_grad()
            assert _bits(_state(model, opt)) == _bits(_state(twin, twin_opt)), step
            assert float(scaler.get_scale()) == float(twin_scaler.get_scale()), step
        assert float(scaler.get_scale()) == 2.0**9  # the overflow was the scaler's skip
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if fault in ("timed-out-collective", "failed-collective"):
            assert watch._collector.broken is not None  # collection stopped, visibly
    finally:
        watch.close()


@pytest.mark.parametrize("scaled", [False, True], ids=["guard-skip", "scaler-overflow"])
def test_a_skipped_first_fused_sgd_step_leaves_a_fresh_optimizer(scaled: bool) -> None:
    """Fused SGD with momentum makes its first buffers with ``empty_like`` and its kernel
    returns early on ``found_inf``: a skipped first step (the guard's NaN skip, or under the
    guard the scaler's overflow) must leave no buffer, and the next step must equal, bit for
    bit, a fresh optimizer's first step on the same gradients."""
    model, twin = _model(), _model()
    opt = OPTIMIZERS["sgd-fused"](model.parameters())
    twin_opt = OPTIMIZERS["sgd-fused"](twin.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**9, enabled=scaled)
    junk = torch.full((4096,), math.nan)  # the allocator hands this block out next: garbage
    del junk
    with GradWatch(model, WatchConfig(skip_nonfinite=True)) as watch:
        guarded = watch.guard(opt, scaler=scaler if scaled else None)
        before = _bits(_state(model, opt))
        _backward(model, scaler, 0, inf=True)
        scaler.step(guarded)
        scaler.update()
        guarded.zero_grad()
        assert _bits(_state(model, opt)) == before  # parameters untouched, no state
        assert all("momentum_buffer" not in opt.state.get(p, {}) for p in model.parameters())
        for step in (1, 2):
            for m, s, o in ((model, scaler, guarded), (twin, twin_scaler, twin_opt)):
                _backward(m, s, step, inf=False)
                s.step(o)
                s.update()
                o.zero_grad()
            assert _bits(_state(model, opt)) == _bits(_state(twin, twin_opt)), step


class _TwoGroups(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.Parameter(torch.zeros(5))
        self.s = nn.Parameter(torch.zeros(3))


def test_the_guard_acts_on_the_spike_score_it_publishes_across_stage_changes() -> None:
    """A run with an announced stage change (``set_isolated``) that moves the level 30x up, a
    sustained 20x shift down without one, and spikes after each: on every step the guard
    skipped for a spike exactly when its published ``guard_score`` is above
    ``skip_spike_score``, that score is the published global spike score (the same NaN
    steps, equal to rounding), and both spikes are skipped, neither change of level."""
    threshold = 6.0
    model = _TwoGroups()
    opt = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)
    cfg = WatchConfig(
        groups={"host": ["h"], "seed": ["s"]}, spike_window=16, spike_warmup=4,
        spike_threshold=threshold, skip_spike_score=threshold,
    )
    gen = torch.Generator().manual_seed(3)
    stage_at, shift_at, spikes = 30, 70, (45, 100)
    snaps = []
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        for step in range(120):
            if step == stage_at:
                watch.set_isolated(["seed"])
            level = 30.0 if stage_at <= step < shift_at else 1.0 if step < stage_at else 1.5
            level *= 10.0 if step in spikes else 1.0
            for p in model.parameters():
                p.grad = level * (1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            guarded.step()
            snaps.append(watch._collector.latest.result())
    skipped = [s.step for s in snaps if s.guard_skipped == "spike"]
    assert skipped == list(spikes), skipped
    for s in snaps:
        assert s.guard_score is not None and s.global_spike_score is not None
        assert (s.guard_skipped == "spike") == (s.guard_score > threshold), s.step
        assert math.isnan(s.guard_score) == math.isnan(s.global_spike_score), s.step
        if not math.isnan(s.guard_score):
            assert s.guard_score == pytest.approx(s.global_spike_score, rel=1e-9, abs=1e-9)
    # the stage change and the shift re-based both windows: undefined for the warm-up
    assert math.isnan(snaps[stage_at].guard_score)
