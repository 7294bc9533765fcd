"""What the optimizer-step guard costs per step, pinned by a dispatch-mode count: the device
ops of one warm decision (with and without spike skipping), the guarded step's ops over the
unguarded one, no host read; and the device reads it is built on."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.doctor.testing import OpCounter
from gradwatch.reduce.sections import sections
from gradwatch.step.guard import GuardDecision, GuardReading

#: The device ops of one warm decision: the norm, the non-finite test and the skip counters;
#: and with ``skip_spike_score`` the spike window's median, MAD, score and update too.
DECISION_OPS = {None: 11, 6.0: 58}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
    (model(x) - y).pow(2).mean().backward()


def _record_readings(watch: GradWatch) -> list[GuardReading]:
    """The reading of every decision the watcher's guard makes from now on, in order."""
    guard = watch._collector.guard
    assert guard is not None
    decide = guard.decide
    readings: list[GuardReading] = []

    def recorded(reduced, *history) -> GuardDecision:  # type: ignore[no-untyped-def]
        decision = decide(reduced, *history)
        readings.append(decision.reading())
        return decision

    guard.decide = recorded  # type: ignore[method-assign]
    return readings


def _warm_step_ops(spike: float | None, guarded: bool) -> tuple[OpCounter, OpCounter | None]:
    """Ops of the 6th optimizer step (collect included) and of its decision alone."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with GradWatch(model, WatchConfig(skip_spike_score=spike, spike_warmup=2)) as watch:
        stepper = watch.guard(opt) if guarded else opt
        decision_ops: list[OpCounter] = []
        if guarded:
            guard = watch._collector.guard
            assert guard is not None
            decide = guard.decide

            def counted(reduced):  # type: ignore[no-untyped-def]
                with OpCounter() as ops:
                    decision = decide(reduced)
                decision_ops.append(ops)
                return decision

            guard.decide = counted  # type: ignore[method-assign]
        for step in range(6):
            opt.zero_grad()
            _backward(model, step)
            with OpCounter() as ops:
                if not guarded:
                    watch.collect(step)
                stepper.step()
    return ops, decision_ops[-1] if decision_ops else None


@pytest.mark.parametrize("spike", [None, 6.0], ids=["nonfinite", "nonfinite+spike"])
def test_a_warm_decision_costs_a_fixed_handful_of_device_ops(
        spike: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A guarded collect packs by tensor ops (its vector is read on the device at once); an
    # unguarded one-process collect packs as host floats (HostPacking): compared on one route.
    monkeypatch.setattr("gradwatch.reduce.packing.HOST_PACK_PIECES", 0)
    guarded, decision = _warm_step_ops(spike, guarded=True)
    unguarded, _ = _warm_step_ops(spike, guarded=False)
    assert decision is not None
    assert decision.total == DECISION_OPS[spike], dict(decision.ops)
    assert decision.scalar_reads == 0 and guarded.scalar_reads == 0
    # Over the unguarded step: the decision, and the fused optimizer restoring its step
    # counters from found_inf (as after a GradScaler skip); nothing else.
    extra = guarded.ops - unguarded.ops
    assert sum(extra.values()) == DECISION_OPS[spike] + 1, dict(extra)
    assert extra["aten._foreach_sub_"] == 1


def test_the_guard_reads_bands_flags_and_step_as_one_view() -> None:
    """``device_bands_flags_and_step`` is the plain, high and low bands and the non-finite
    flags, in this order, and the step slot, of the reduced vector itself (views: no copy)."""
    model = _model()
    with GradWatch(model, WatchConfig(skip_spike_score=6.0)) as watch:
        watch.guard(torch.optim.SGD(model.parameters(), lr=0.1))
        guard = watch._collector.guard
        assert guard is not None
        seen = []
        decide = guard.decide
        guard.decide = lambda reduced: seen.append(reduced) or decide(reduced)  # type: ignore[method-assign]
        _backward(model, 0)
        watch.collect(7)
    reduced = seen[0]
    head, step = reduced.device_bands_flags_and_step()
    packed = reduced._device()
    s = sections(reduced._layout)
    n = reduced._layout.size
    assert head.shape == (4 * n,) and step.shape == ()
    assert torch.equal(head, torch.cat([packed[s.bands], packed[s.nonfinite]]))
    assert float(step) == float(packed[s.step]) == 7.0
    assert head.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()


def test_the_spike_window_skips_non_samples_and_wraps_against_a_float64_reference() -> None:
    """NaN steps, zero-gradient steps and a spike between normal ones, over more steps than the
    window holds: the score is (ln n - median) / max(1.4826 MAD, 0.05) of the previous samples
    only (finite, non-zero norms), NaN before the warm-up and on non-samples."""
    param = nn.Parameter(torch.zeros(4))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    cfg = WatchConfig(skip_spike_score=6.0, spike_window=8, spike_warmup=5)
    gen = torch.Generator().manual_seed(5)
    norms = [float(torch.exp(0.3 * torch.randn((), generator=gen))) for _ in range(40)]
    for k in (6, 13, 14, 27):
        norms[k] = math.nan
    for k in (9, 21):
        norms[k] = 0.0
    norms[33] *= 500.0
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        readings = _record_readings(watch)
        for k, n in enumerate(norms):
            param.grad = torch.full((4,), n / 2.0)
            if n == n:
                norms[k] = 2.0 * float(param.grad[0])  # the float32 gradient's exact norm
            guarded.step()
    samples: list[float] = []
    spikes = 0
    for k, (n, reading) in enumerate(zip(norms, readings, strict=True)):
        window = samples[-8:]
        sample = n == n and n > 0
        expected = math.nan
        if sample and len(window) >= 5:
            med = statistics.median(window)
            mad = statistics.median(abs(v - med) for v in window)
            expected = (math.log(n) - med) / max(1.4826 * mad, 0.05)
            assert reading.score == pytest.approx(expected, rel=0, abs=2e-5), k
        else:
            assert math.isnan(reading.score), k
        expected_skip = "nonfinite" if n != n else "spike" if expected > 6.0 else None
        assert reading.skipped == expected_skip, k
        if sample:
            samples.append(math.log(n))
        spikes += reading.skipped == "spike"
    assert readings[33].skipped == "spike"
    assert readings[-1].totals == {"nonfinite": 4, "spike": spikes}


def test_a_step_a_rank_stood_in_for_is_never_skipped() -> None:
    """A step slot of NaN (a failed local pass) or -inf (a closed watcher's stand-in) marks a
    vector that holds no measurement: the guard does not act on it, nor learn from it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    with GradWatch(model, WatchConfig(skip_spike_score=6.0)) as watch:
        watch.guard(opt)
        guard = watch._collector.guard
        assert guard is not None
        seen = []
        decide = guard.decide
        guard.decide = lambda reduced: seen.append(reduced) or decide(reduced)  # type: ignore[method-assign]
        model[0].weight.grad = torch.full_like(model[0].weight, math.nan)
        watch.collect(0)
        reduced = seen[0]
        for marker in (math.nan, -math.inf):
            reduced.device_bands_flags_and_step()[1].fill_(marker)
            reading = guard.decide(reduced).reading()
            assert reading.skipped is None and reading.consecutive == 0, marker
            assert not reading.stopped and math.isnan(reading.score), marker
        reduced.device_bands_flags_and_step()[1].fill_(1.0)
        assert guard.decide(reduced).reading().skipped == "nonfinite"


@pytest.mark.parametrize(
    ("spike", "statistic"), [(None, "median_mad"), (6.0, "median_mad"), (6.0, "ema")],
    ids=["nonfinite", "nonfinite+spike", "nonfinite+ema"],
)
def test_only_a_norm_beyond_float64_is_non_finite(spike: float | None, statistic: str) -> None:
    """Float64 gradients whose norm is huge, beyond float64 (each element finite), tiny,
    zero or NaN: only the second and the last are non-finite, with and without the spike
    window and with the EMA statistic (the decision's dot product, or the adaptive history's
    test of the whole-model norm, which the EMA guard takes instead)."""
    param = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.0)
    cfg = WatchConfig(skip_spike_score=spike, guard_spike_statistic=statistic)
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        readings = _record_readings(watch)
        for value in (1e200, 1.5e308, 1e-200, 0.0, 1.0, math.nan):
            param.grad = torch.full((2,), value, dtype=torch.float64)
            guarded.step()
    expected = [None, "nonfinite", None, None, None, "nonfinite"]
    assert [r.skipped for r in readings] == expected


def test_a_finite_norm_beyond_the_windows_range_is_a_spike_once_warm() -> None:
    """The window's ``ln(norm^2)`` is one float64 sum, exact up to norms of 2^550: a finite
    norm above (1e200, float64 gradients) scores +Inf and is skipped as a spike once the window
    is warm; a norm in the low band (1e-200: its square is below float64's range) has no score
    and is not skipped."""
    param = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.0)
    cfg = WatchConfig(skip_spike_score=6.0, spike_window=8, spike_warmup=4)
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        readings = _record_readings(watch)
        for value in (1.0, 1.1, 0.9, 1.05, 1e200, 1.0, 1e-200, 1.0):
            param.grad = torch.full((2,), value, dtype=torch.float64)
            guarded.step()
    assert [r.skipped for r in readings] == [None] * 4 + ["spike"] + [None] * 3
    assert readings[4].score == math.inf
    assert math.isnan(readings[6].score)
    assert all(math.isfinite(readings[k].score) for k in (5, 7))
