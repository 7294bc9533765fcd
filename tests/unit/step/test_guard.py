"""The optimizer-step guard on one process: what it skips, what a skip leaves untouched, its
spike score against a float64 reference, the consecutive-skip limit, GradScaler composition
and the wrapper's pass-through (schedulers, state_dict)."""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, Snapshot, WatchConfig
from gradwatch.doctor.testing import OpCounter
from gradwatch.step.guard import GuardedOptimizer, GuardReading


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(model: nn.Module, step: int, scale: float = 1.0, nan: bool = False) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=gen)
    if nan:
        x[0, 0] = math.nan
    y = torch.randn(8, 2, generator=gen)
    ((model(x) - y).pow(2).mean() * scale).backward()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for s in opt.state.values():
        out.extend(v.detach().clone() for v in s.values() if isinstance(v, torch.Tensor))
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _recording(watch: GradWatch) -> list[GuardReading]:
    """Record every decision's host reading (tests only: a host read per step)."""
    guard = watch._collector.guard
    assert guard is not None
    readings: list[GuardReading] = []
    decide = guard.decide

    def recorded(reduced, *history):  # type: ignore[no-untyped-def]
        decision = decide(reduced, *history)
        readings.append(decision.reading())
        return decision

    guard.decide = recorded  # type: ignore[method-assign]
    return readings


def _guarded_steps_with_a_nan_at_step_1(
    config: WatchConfig, steps: int, attach: bool = False
) -> Snapshot | None:
    """Guarded fused-SGD steps of a one-parameter model whose gradient is 1 but NaN at step 1;
    asserts only step 1 leaves the parameter untouched and returns the last snapshot.
    ``attach``: the optimizer is also attached (its pre-step hook would collect too)."""
    param = nn.Parameter(torch.zeros(3))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    with GradWatch(model, config) as watch:
        if attach:
            watch.attach(opt)
        guarded = watch.guard(opt)
        for step in range(steps):
            param.grad = torch.full((3,), math.nan if step == 1 else 1.0)
            before = param.detach().clone()
            guarded.step()
            assert torch.equal(before, param) == (step == 1), step
        return watch.last


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2),
    ],
    ids=["adamw-fused", "adam-fused", "sgd-fused", "adamw-foreach", "sgd"],
)
def test_skips_nonfinite_and_otherwise_equals_the_bare_optimizer(
    make: Callable[..., torch.optim.Optimizer],
) -> None:
    model, twin = _model(), _model()
    opt, twin_opt = make(model.parameters()), make(twin.parameters())
    fused = getattr(opt, "_step_supports_amp_scaling", False)
    with GradWatch(model, WatchConfig(skip_spike_score=6.0, spike_warmup=2)) as watch:
        guarded = watch.guard(opt)
        reads, bare_reads = [], []
        for step in range(8):
            nan = step == 5
            _backward(model, step, nan=nan)
            before = _state(model, opt)
            with OpCounter() as ops:
                guarded.step()
            reads.append(ops.scalar_reads)
            guarded.zero_grad()
            if nan:
                assert _same(before, _state(model, opt)), "a skipped step changed something"
                continue
            _backward(twin, step)
            with OpCounter() as ops:
                twin_opt.step()
            bare_reads.append(ops.scalar_reads)
            twin_opt.zero_grad()
            assert _same(_state(model, opt), _state(twin, twin_opt)), step
        assert watch.last is not None and watch.last.skipped_steps["nonfinite"] == 1
    # Fused: the decision reaches the kernel as found_inf, no host read; others: one more
    # than the optimizer's own (warm steps: after the first two).
    applied = [r for k, r in enumerate(reads) if k != 5]
    extra = 0 if fused else 1
    assert applied[2:] == [b + extra for b in bare_reads[2:]]
    if fused:
        assert reads[5] == 0  # the skipped step too


def test_spike_score_matches_a_float64_median_mad_reference() -> None:
    """Norms set by hand: the device score is (ln n - median) / max(1.4826 MAD, 0.05) over the
    previous samples, defined after spike_warmup of them; the 200x step is skipped."""
    param = nn.Parameter(torch.zeros(4))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    cfg = WatchConfig(skip_spike_score=6.0, spike_window=16, spike_warmup=8)
    gen = torch.Generator().manual_seed(3)
    norms = [float(torch.exp(0.2 * torch.randn((), generator=gen))) for _ in range(30)]
    norms[24] *= 200.0
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        readings = _recording(watch)
        for k, n in enumerate(norms):
            param.grad = torch.full((4,), n / 2.0)
            norms[k] = 2.0 * float(param.grad[0])  # the float32 gradient's exact L2 norm
            guarded.step()
    logs: list[float] = []
    for k, (n, reading) in enumerate(zip(norms, readings, strict=True)):
        window = logs[-16:]
        if len(window) < 8:
            assert math.isnan(reading.score), k
        else:
            med = statistics.median(window)
            mad = statistics.median(abs(v - med) for v in window)
            expected = (math.log(n) - med) / max(1.4826 * mad, 0.05)
            # gradwatch norms are exact to 1e-6 relative: ln moves by 1e-6, the score by at
            # most 1e-6 / 0.05 (the floor of the spread)
            assert reading.score == pytest.approx(expected, rel=0, abs=2e-5), k
        assert (reading.skipped == "spike") == (k == 24), k
        logs.append(math.log(n))


def test_consecutive_limit_stops_skipping_until_a_healthy_step() -> None:
    param = nn.Parameter(torch.zeros(3))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    bad = [True] * 5 + [False, True, False]
    with GradWatch(model, WatchConfig(max_consecutive_skips=3)) as watch:
        guarded = watch.guard(opt)
        readings = _recording(watch)
        for is_bad in bad:
            param.grad = torch.full((3,), math.nan if is_bad else 1.0)
            guarded.step()
        last = watch.last
    assert [r.skipped for r in readings] == ["nonfinite"] * 3 + [None] * 3 + ["nonfinite", None]
    assert [r.stopped for r in readings] == [False] * 3 + [True, True] + [False] * 3
    assert [r.consecutive for r in readings] == [1, 2, 3, 3, 3, 0, 1, 0]
    assert readings[-1].totals == {"nonfinite": 4, "spike": 0}
    assert last is not None and last.consecutive_skipped_steps == 0
    assert last.skipped_steps == {"nonfinite": 4, "spike": 0}


@pytest.mark.parametrize("fused", [True, False])
def test_composes_with_a_grad_scaler(fused: bool) -> None:
    """An overflow is the scaler's skip (one skip, AMP-skipped, not the guard's), a spike the
    guard's (the scaler's scale is not cut), and applied steps equal the bare ones."""
    model, twin = _model(), _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    twin_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    cfg = WatchConfig(skip_spike_score=6.0, spike_warmup=8)
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt, scaler=scaler)
        for step in range(14):
            spike = 200.0 if step == 12 else 1.0
            before = _state(model, opt)
            _backward_scaled(model, scaler, step, spike, inf=step == 10)
            scale_before = float(scaler.get_scale())
            scaler.step(guarded)
            scaler.update()
            guarded.zero_grad()
            if step in (10, 12):
                assert _same(before, _state(model, opt)), step
                expected_scale = scale_before / 2 if step == 10 else scale_before
                assert float(scaler.get_scale()) == expected_scale, step
                continue
            _backward_scaled(twin, twin_scaler, step, 1.0)
            twin_scaler.step(twin_opt)
            twin_scaler.update()
            twin_opt.zero_grad()
            assert _same(_state(model, opt), _state(twin, twin_opt)), step
        assert watch.last is not None
        assert watch.last.skipped_steps == {"nonfinite": 0, "spike": 1}


def _backward_scaled(
    model: nn.Module, scaler: torch.amp.GradScaler, step: int, spike: float, inf: bool = False
) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
    loss = (model(x) - y).pow(2).mean() * spike
    if inf:
        loss = loss * math.inf
    scaler.scale(loss).backward()


def test_the_wrapper_passes_everything_through() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    with GradWatch(model, WatchConfig()) as watch:
        guarded = watch.guard(opt)
        assert isinstance(guarded, GuardedOptimizer) and isinstance(guarded, torch.optim.Optimizer)
        sched = torch.optim.lr_scheduler.StepLR(guarded, step_size=1, gamma=0.5)
        assert guarded.param_groups is opt.param_groups and guarded.defaults is opt.defaults
        _backward(model, 0)
        guarded.step()
        sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        assert guarded.state_dict() == opt.state_dict()
        saved = copy.deepcopy(guarded.state_dict())
        guarded.load_state_dict(saved)
        guarded.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        # A closure (Lightning's) is evaluated once, before the decision; its loss returned.
        calls: list[int] = []

        def closure() -> torch.Tensor:
            calls.append(1)
            _backward(model, 1, nan=True)
            return torch.tensor(2.5)

        before = _state(model, opt)
        assert float(guarded.step(closure)) == 2.5 and calls == [1]
        assert _same(before, _state(model, opt))  # the closure's NaN gradients: skipped


def test_guard_needs_something_to_skip_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        GradWatch(model, WatchConfig(skip_nonfinite=False)) as watch,
        pytest.raises(ValueError, match=r"skip_nonfinite.*skip_spike_score"),
    ):
        watch.guard(opt)
    monkeypatch.setenv("GRADWATCH_SKIP_NONFINITE", "0")
    monkeypatch.setenv("GRADWATCH_SKIP_SPIKE_SCORE", "4.5")
    monkeypatch.setenv("GRADWATCH_MAX_CONSECUTIVE_SKIPS", "2")
    cfg = WatchConfig()
    assert (cfg.skip_nonfinite, cfg.skip_spike_score, cfg.max_consecutive_skips) == (
        False,
        4.5,
        2,
    )
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        WatchConfig(max_consecutive_skips=0)
    with pytest.raises(ValueError, match="skip_spike_score"):
        WatchConfig(skip_spike_score=-1.0)


def test_a_disabled_watch_guards_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    with GradWatch(model, WatchConfig(enabled=False)) as watch:
        guarded = watch.guard(opt)
        _backward(model, 0, nan=True)
        guarded.step()
    assert all(torch.isnan(p).any() for p in model.parameters())


def test_steps_the_schedule_skips_are_guarded_too() -> None:
    """``every_n_steps=3``: collects 1 and 2 publish nothing, yet the guard decides on every
    step (a pass without snapshot), and the next snapshot counts the skip between them."""
    last = _guarded_steps_with_a_nan_at_step_1(WatchConfig(every_n_steps=3), steps=4)
    assert last is not None and last.step == 3
    assert last.skipped_steps == {"nonfinite": 1, "spike": 0}


def test_top_shows_the_guard_counters() -> None:
    from gradwatch.cli.endpoint import parse_exposition
    from gradwatch.cli.render import skipped_text

    text = (
        "gradwatch_step 7\n"
        'gradwatch_skipped_steps_total{reason="nonfinite"} 2\n'
        'gradwatch_skipped_steps_total{reason="spike"} 1\n'
        "gradwatch_consecutive_skipped_steps 2\n"
        "gradwatch_guard_stopped 1\n"
    )
    view = parse_exposition(text)
    assert view.skipped_steps == {"nonfinite": 2, "spike": 1}
    assert (view.consecutive_skipped_steps, view.guard_stopped) == (2, True)
    shown = skipped_text(view).plain
    assert "guard-skipped steps 3 (nonfinite 2, spike 1)" in shown
    assert "2 in a row" in shown and "GUARD STOPPED" in shown
    unguarded = parse_exposition("gradwatch_step 7\n")
    assert unguarded.guard_stopped is None and skipped_text(unguarded).plain == ""


def test_attach_and_guard_collect_once_per_step() -> None:
    """An attached optimizer's pre-step hook would collect inside the guarded step, after the
    decision: with a guard it leaves the collect to the guard (one per step, on time)."""
    last = _guarded_steps_with_a_nan_at_step_1(WatchConfig(), steps=3, attach=True)
    assert last is not None and last.step == 2
    assert last.skipped_steps == {"nonfinite": 1, "spike": 0}


def test_a_noop_watch_returns_the_optimizer_itself() -> None:
    import gradwatch

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert gradwatch.NoOpWatch(model).guard(opt) is opt
    assert gradwatch.GuardedOptimizer is GuardedOptimizer


def test_a_failed_collect_is_not_retried_and_the_step_is_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A collect that fails leaves no decision: the guarded step applies the update (a guard
    that cannot see does not act) and does not collect again (another collective would be one
    the other ranks do not issue)."""
    param = nn.Parameter(torch.zeros(3))
    model = nn.Module()
    model.p = param
    opt = torch.optim.SGD([param], lr=0.1, fused=True)
    with GradWatch(model, WatchConfig()) as watch:
        guarded = watch.guard(opt)
        param.grad = torch.full((3,), math.nan)
        engine = watch._collector.engine

        def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, "squared_norms_and_plan", broken)
        watch.collect(0)  # fails (logged, counted), no decision
        calls: list[tuple] = []
        real_collect = watch._collector.collect

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(args)
            return real_collect(*args, **kwargs)

        monkeypatch.setattr(watch._collector, "collect", counted)
        guarded.step()
        assert calls == []  # not collected again
        assert torch.isnan(param).all()  # applied: nothing was measured
        monkeypatch.undo()
        param.data.zero_()
        guarded.step()  # the next step collects (it works again) and skips the NaN
        assert torch.equal(param, torch.zeros(3))
