"""clip_grad_norm_("auto"): the EMA threshold against a float64 reference, its warm-up, non-finite
norms, resuming from state_dict() bit for bit, no host read in the call, the guard's EMA score."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.doctor.testing import OpCounter, count_host_reads
from gradwatch.step.adaptive import MIN_RELATIVE_STD, AdaptiveHistory


def reference(
    norms: list[float], z: float, alpha: float, warmup: int
) -> list[tuple[float, float] | None]:
    """The threshold and the limit of each step by the module's math, in Python floats."""
    mean = var = 0.0
    count = 0
    out: list[tuple[float, float] | None] = []
    for g in norms:
        warm = count >= warmup
        sd = max(math.sqrt(var), mean * MIN_RELATIVE_STD)
        t = mean + z * sd if warm else math.inf
        limit = mean + z * z * sd / ((g - mean) / sd) if g > t else t
        out.append((t, limit) if warm else None)
        if not math.isfinite(g):
            continue
        x = min(g, limit)
        w = (1.0 - alpha) if warm else 1.0 / (count + 1)
        d = x - mean
        mean += w * d
        var = (1.0 - w) * (var + w * d * d)
        count += 1
    return out


NORMS = [1.0 + 0.1 * math.sin(i * 1.3) for i in range(40)]
NORMS[30] = 40.0  # a spike after warm-up
NORMS[33] = math.nan  # a non-finite step: no sample


def test_history_matches_a_float64_reference() -> None:
    h = AdaptiveHistory(2.5, 0.97, 25, torch.device("cpu"), 10.0)
    expected = reference(NORMS, 2.5, 0.97, 25)
    for g, want in zip(NORMS, expected, strict=True):
        got = h.observe(torch.tensor(g, dtype=torch.float64)).reading()
        if want is None:
            assert got.threshold is None and got.limit is None and got.coef == 1.0
        else:
            assert got.threshold == pytest.approx(want[0], rel=1e-12, abs=0.0)
            assert got.limit == pytest.approx(want[1], rel=1e-12, abs=0.0)
    spike = expected[30]
    assert spike is not None and spike[1] < spike[0] < 1.5  # cut below the threshold
    assert abs(spike[1] - 1.0) < 0.1  # a 40x spike is cut to about the usual norm


def test_nonfinite_norm_is_no_sample() -> None:
    h = AdaptiveHistory(2.5, 0.97, 3, torch.device("cpu"), 10.0)
    for g in (1.0, 1.1, 0.9, 1.05):
        h.observe(torch.tensor(g, dtype=torch.float64))
    before = [t.clone() for t in h.state()]
    for bad in (math.nan, math.inf):
        step = h.observe(torch.tensor(bad, dtype=torch.float64))
        assert step.reading().score is None
    assert all(torch.equal(a, b) for a, b in zip(before, h.state(), strict=True))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _train(watch: GradWatch, model: nn.Module, steps: range, opt: torch.optim.Optimizer) -> list:
    out = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=g)
        loss = model(x).pow(2).mean() * (40.0 if step in (30, 37) else 1.0)
        loss.backward()
        total = watch.clip_grad_norm_("auto", step=step)
        post = math.sqrt(math.fsum(float(v) ** 2 for p in model.parameters()
                                   for v in p.grad.double().flatten()))
        history = watch._collector.history
        assert history is not None and history.last is not None
        out.append((float(total), post, history.last.reading()))
        opt.step()
        opt.zero_grad()
    return out


def test_auto_clips_to_the_threshold_after_warmup() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradWatch(model, WatchConfig(adaptive_clip_warmup=10)) as watch:
        rows = _train(watch, model, range(40), opt)
        snap = watch.last
    for step, (total, post, reading) in enumerate(rows):
        assert reading.norm == total
        if step < 10:  # warm-up: no threshold, nothing clipped
            assert reading.threshold is None and reading.coef == 1.0
            assert post == pytest.approx(total, rel=1e-6)
        else:
            assert reading.threshold is not None and reading.limit is not None
            assert post == pytest.approx(min(total, reading.limit), rel=1e-6)
            assert (reading.limit < reading.threshold) == (total > reading.threshold)
    typical = sorted(r[0] for r in rows)[len(rows) // 2]
    for spike in (30, 37):
        assert rows[spike][0] > 20 * typical and rows[spike][1] < 3 * typical
    assert snap is not None and snap.adaptive_clip_threshold == rows[-1][2].threshold
    assert snap.clip_coef == rows[-1][2].coef


def test_resume_equals_uninterrupted_bitwise() -> None:
    cfg = WatchConfig(adaptive_clip_warmup=10)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradWatch(model, cfg) as watch:
        straight = _train(watch, model, range(40), opt)
        final = [p.detach().clone() for p in model.parameters()]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradWatch(model, cfg) as watch:
        first = _train(watch, model, range(20), opt)
        state = watch.state_dict()
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = _model()
    model.load_state_dict(saved)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with GradWatch(model, cfg) as watch:
        watch.load_state_dict(state)
        second = _train(watch, model, range(20, 40), opt)
    resumed = first + second
    for a, b in zip(straight, resumed, strict=True):
        assert a[2] == b[2]  # norm, threshold, coefficient, score, samples: the same floats
    assert all(torch.equal(a, b) for a, b in zip(final, model.parameters(), strict=True))


def test_no_host_read_in_the_auto_call() -> None:
    model = _model()
    with GradWatch(model, WatchConfig(adaptive_clip_warmup=3)) as watch:
        reads = {}
        for step in range(8):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if step >= 5:
                for mode in ("auto", 1.0):
                    with OpCounter() as ops, count_host_reads() as bulk:
                        watch.clip_grad_norm_(mode, step=step)
                    assert ops.scalar_reads == 0, mode
                    reads[mode] = dict(bulk)
            else:
                watch.clip_grad_norm_("auto", step=step)
            model.zero_grad()
    assert reads["auto"] == reads[1.0]  # no host read beyond the fixed clip's collect


@pytest.mark.parametrize(
    ("field", "value"),
    [("adaptive_clip_z", 0.0), ("adaptive_clip_alpha", 1.0), ("adaptive_clip_alpha", 0.0),
     ("adaptive_clip_warmup", 0), ("adaptive_clip_z", math.inf),
     ("guard_spike_statistic", "mean"), ("on_max_consecutive_skips", "halt"),
     ("incident_path", " ")],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        WatchConfig(**{field: value})


def test_bad_max_norm_and_state_are_refused() -> None:
    model = _model()
    with GradWatch(model, WatchConfig()) as watch:
        model(torch.randn(4, 8)).sum().backward()
        with pytest.raises(ValueError, match="max_norm"):
            watch.clip_grad_norm_("adaptive")
        with pytest.raises(ValueError, match="load_state_dict"):
            watch.load_state_dict({"adaptive": 1})
        assert watch.state_dict() == {"version": 1, "adaptive_clip": None}


def test_guard_skips_on_the_ema_score() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    cfg = WatchConfig(
        guard_spike_statistic="ema", skip_spike_score=6.0, adaptive_clip_warmup=10,
        adaptive_clip_z=2.5,
    )
    skipped, scores = [], []
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        for step in range(40):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            (model(x).pow(2).mean() * (50.0 if step == 30 else 1.0)).backward()
            before = [p.detach().clone() for p in model.parameters()]
            if step == 35:
                with OpCounter() as ops:
                    guarded.step()
                assert ops.scalar_reads == 0
            else:
                guarded.step()
            guarded.zero_grad()
            if all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)):
                skipped.append(step)
            snap = watch.last
            assert snap is not None
            scores.append(snap.guard_score)
            history = watch._collector.history
            assert history is not None and history.last is not None
            ema_score = history.last.reading().score
            assert snap.guard_score == ema_score or (ema_score is None and math.isnan(
                snap.guard_score))
    assert 30 in skipped and len(skipped) <= 2, skipped
    assert all(math.isnan(s) for s in scores[:10]) and scores[30] > 6
    assert snap.skipped_steps == {"nonfinite": 0, "spike": len(skipped)}



def _warm_guarded_ops(statistic: str | None, clip: bool) -> OpCounter:
    """Ops of the 6th optimizer step: the collect (``clip_grad_norm_("auto")`` when ``clip``)
    then the fused step, guarded with spike skips by ``statistic`` (None: unguarded)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    cfg = WatchConfig(
        skip_spike_score=6.0, spike_warmup=2, adaptive_clip_warmup=2,
        guard_spike_statistic=statistic or "median_mad",
    )
    with GradWatch(model, cfg) as watch:
        stepper = watch.guard(opt) if statistic else opt
        for step in range(6):
            opt.zero_grad()
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
            model(x).pow(2).mean().backward()
            with OpCounter() as ops:
                if clip:
                    watch.clip_grad_norm_("auto", step=step)
                elif statistic is None:
                    watch.collect(step)
                stepper.step()
    return ops


#: Device ops of a warm guarded step over the unguarded one (pinned, as tests/unit/
#: test_guard_cost.py pins the guard's): (statistic, with clip_grad_norm_("auto")).
GUARD_EXTRA_OPS = {("ema", True): 11, ("median_mad", True): 56, ("ema", False): 58,
                   ("median_mad", False): 59}


@pytest.mark.parametrize("clip", [True, False], ids=["auto-clip", "no-clip"])
def test_what_the_ema_statistic_costs(clip: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With clip_grad_norm_("auto") the EMA statistic only compares the history's score (the
    clip keeps the history), far fewer ops than the median/MAD window; without it, the guard
    pays the whole-model norm and the history's update itself, still fewer than the window
    (no sort among them). No host
    read either way."""
    # Guarded collects pack by tensor ops (their vector is read on the device at once), an
    # unguarded one-process collect as host floats (HostPacking): compared on one route.
    monkeypatch.setattr("gradwatch.reduce.packing.HOST_PACK_PIECES", 0)
    plain = _warm_guarded_ops(None, clip)
    for statistic in ("ema", "median_mad"):
        ops = _warm_guarded_ops(statistic, clip)
        assert ops.scalar_reads == 0
        extra = ops.ops - plain.ops
        assert ("aten.sort" in extra) == (statistic == "median_mad"), dict(extra)
        assert sum(extra.values()) == GUARD_EXTRA_OPS[statistic, clip], dict(extra)
