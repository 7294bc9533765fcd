"""The doctor's CUDA checks of the optimizer-step guard (``gradwatch doctor --device cuda
--checks cuda``): what the guard promises on the GPU and this project cannot test without one.

* ``cuda[guard-scaler]``: the guard with a GradScaler when collection has stopped (it has no
  decision): fused SGD and fused AdamW step bitwise as the bare optimizer with the bare
  scaler, an fp16-style overflow step included (skipped, the scale halved).
* ``cuda[deterministic]``: under ``torch.use_deterministic_algorithms(True)`` with
  ``skip_spike_score``: every step measured, the spike skipped, and no op PyTorch refuses or
  lists as nondeterministic on CUDA dispatched by the collect, the clip or the guard.
* ``cuda[first-skip]``: fused SGD with momentum whose first step the guard skips (a NaN
  gradient, the allocator's next block filled with NaN first): the next step equals, bit for
  bit, a fresh optimizer's first step.

Each figure is the measured one (bytes that differ, steps measured, ops found). The functions
run on any device (the unit tests run them on the CPU); :func:`guard_checks` makes each a
SKIP off CUDA.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gradwatch.config import WatchConfig
from gradwatch.doctor.options import FAIL, PASS, Check
from gradwatch.doctor.testing import NondeterministicOps
from gradwatch.errors import GradWatchError
from gradwatch.watcher import GradWatch

#: Steps of each guard check (a spike or an overflow among them).
STEPS = 12
#: The step whose gradients are scaled up 1e4 (a spike), or overflow (``inf``).
BAD_STEP = 9


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 4)).to(device)


def _loss(model: nn.Module, device: torch.device, step: int, factor: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(step)
    x, y = torch.randn(16, 32, generator=g).to(device), torch.randn(16, 4, generator=g).to(device)
    return (model(x) - y).pow(2).mean() * factor


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out.extend(v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor))
    return out


def _differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """Tensors of ``a`` and ``b`` whose bytes differ (NaN payloads compared as bits)."""
    if len(a) != len(b):
        return max(len(a), len(b))
    return sum(
        x.shape != y.shape or not torch.equal(x.view(-1).view(torch.uint8),
                                              y.view(-1).view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def _config(**fields: object) -> WatchConfig:
    return WatchConfig(port=None, history_path=None, every_n_steps=1, **fields)  # type: ignore[arg-type]


def check_guard_scaler(device: torch.device) -> Check:
    """Collection stopped: the guarded step with a GradScaler equals the bare scaler path."""
    threshold = (
        f"{STEPS} steps of fused SGD and fused AdamW with a GradScaler, collection stopped, an "
        f"overflow at step {BAD_STEP}: 0 tensors differ from the bare optimizer + scaler"
    )
    makers: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    }
    for name, make in makers.items():
        model, twin = _model(device), _model(device)
        opt, twin_opt = make(model.parameters()), make(twin.parameters())
        scalers = [torch.amp.GradScaler(device.type, init_scale=2.0**10) for _ in range(2)]
        with GradWatch(model, _config()) as watch:
            guarded = watch.guard(opt, scalers[0])
            # What a failed or timed-out collective leaves: no decision from now on.
            watch._collector.failures.broken = "stopped by gradwatch doctor"
            for step in range(STEPS):
                factor = math.inf if step == BAD_STEP else 1.0
                for m, s, o in ((model, scalers[0], guarded), (twin, scalers[1], twin_opt)):
                    s.scale(_loss(m, device, step, factor)).backward()
                    s.step(o)
                    s.update()
                    o.zero_grad()
                differ = _differing(_state(model, opt), _state(twin, twin_opt))
                if differ:
                    measured = f"{name}: {differ} tensors differ at step {step}"
                    return Check("cuda[guard-scaler]", FAIL, measured, threshold)
    return Check("cuda[guard-scaler]", PASS, "0 tensors differ (SGD, AdamW)", threshold)


def check_deterministic(device: torch.device) -> Check:
    """Deterministic mode with spike skipping: measured, the spike skipped, no listed op."""
    threshold = (
        f"use_deterministic_algorithms(True), skip_spike_score=6: {STEPS} steps measured, the "
        f"spike at step {BAD_STEP} skipped, 0 nondeterministic ops"
    )
    before = torch.are_deterministic_algorithms_enabled()
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, fused=True)
    ops = NondeterministicOps()
    measured: list[int] = []
    torch.use_deterministic_algorithms(True)
    try:
        with GradWatch(model, _config(skip_spike_score=6.0, spike_warmup=4)) as watch:
            guarded = watch.guard(opt)
            for step in range(STEPS):
                _loss(model, device, step, 1e4 if step == BAD_STEP else 1.0).backward()
                with ops:
                    watch.clip_grad_norm_(10.0**6, step=step)
                    guarded.step()
                guarded.zero_grad()
                latest = watch._collector.latest
                if latest is not None and latest.step == step:
                    snap = latest.result()  # raises for a step that was not measured
                    measured.append(snap.skipped_steps.get("spike", 0))
    except (RuntimeError, GradWatchError) as exc:  # a refused op; why a step was not measured
        return Check("cuda[deterministic]", FAIL, f"{type(exc).__name__}: {exc}"[:200],
                     threshold)
    finally:
        torch.use_deterministic_algorithms(before)
    if ops.found:
        return Check("cuda[deterministic]", FAIL, f"{len(ops.found)}: {ops.found[0]}", threshold)
    figure = f"{len(measured)} measured, {measured[-1] if measured else 0} spike skipped"
    ok = len(measured) == STEPS and measured[-1] == 1 and measured[BAD_STEP - 1] == 0
    return Check("cuda[deterministic]", PASS if ok else FAIL, f"{figure}, 0 ops", threshold)


def check_first_skip(device: torch.device) -> Check:
    """A skipped first fused-SGD step leaves the state of a fresh optimizer."""
    threshold = (
        "fused SGD (momentum 0.9), first step skipped: no momentum buffer, the next step "
        "bitwise a fresh optimizer's first"
    )
    model, fresh = _model(device), _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9, fused=True)
    junk = torch.full((1 << 16,), math.nan, device=device)  # the allocator's next block
    del junk
    with GradWatch(model, _config()) as watch:
        guarded = watch.guard(opt)
        _loss(model, device, 0, math.nan).backward()
        guarded.step()
        guarded.zero_grad()
        buffers = sum("momentum_buffer" in opt.state.get(p, {}) for p in model.parameters())
        _loss(model, device, 1).backward()
        guarded.step()
    _loss(fresh, device, 1).backward()
    fresh_opt.step()
    differ = _differing(_state(model, opt), _state(fresh, fresh_opt))
    measured = f"{buffers} buffers after the skip, {differ} tensors differ after the next step"
    ok = buffers == 0 and differ == 0
    return Check("cuda[first-skip]", PASS if ok else FAIL, measured, threshold)


def guard_checks() -> list[tuple[str, Callable[[torch.device], Check]]]:
    """The guard's CUDA checks, by name (:func:`gradwatch.doctor.cuda.cuda_checks` runs them
    on CUDA and makes each a SKIP elsewhere)."""
    return [
        ("cuda[guard-scaler]", check_guard_scaler),
        ("cuda[deterministic]", check_deterministic),
        ("cuda[first-skip]", check_first_skip),
    ]
