"""Optimizer-update health on one process: every figure against a float64 reference computed
here from copies of the parameters (the product never copies them), per optimizer and mode,
the stalled fraction of bf16 weights, the silent skip, and no host read in warm steps."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from update_refs import GROUPS, MODEL_OPTIMIZERS, UPDATE_TOL, WEIGHT_TOL, copies, model, norm_of

from gradwatch import GradWatch, WatchConfig
from gradwatch.analysis.update_health import stalled_fraction, update_fields, update_ratio
from gradwatch.doctor.testing import OpCounter, count_host_reads
from gradwatch.reduce.sections import sections


def reference(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], grads: dict[str, Any],
    names: Callable[[str], bool],
) -> dict[str, float]:
    """Weight norm after the step, applied update norm and stalled fraction from copies."""
    keys = [n for n in after if names(n)]
    moving = [grads[n] != 0 for n in keys]
    unchanged = [after[n] == before[n] for n in keys]
    eligible = sum(int(m.sum()) for m in moving)
    stalled = sum(int((m & u).sum()) for m, u in zip(moving, unchanged, strict=True))
    return {
        "weight": norm_of([after[n] for n in keys]),
        "update": norm_of([after[n] - before[n] for n in keys]),
        "stalled": stalled / eligible if eligible else math.nan,
    }


def train(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    steps: int = 4,
    dtype: torch.dtype = torch.float32,
    scale: float = 1.0,
    loss: str = "mean",
) -> list[tuple[Any, dict[str, dict[str, float]]]]:
    """Collect, step, and pair each snapshot from the second on with the reference of the
    step before it (whole model and group ``first``)."""
    m = model(dtype)
    opt = make_opt(m)
    out = []
    pending: dict[str, dict[str, float]] | None = None
    with GradWatch(m, WatchConfig(update_stats=True, groups=GROUPS)) as watch:
        for step in range(steps):
            x = torch.randn(16, 32, dtype=dtype) * scale
            getattr(m(x).pow(2), loss)().backward()
            watch.collect(step)
            snap = watch.last
            out.append((snap, pending))
            before = copies(m)
            grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
            after = copies(m)
            pending = {
                "all": reference(before, after, grads, lambda n: True),
                "first": reference(before, after, grads, lambda n: n.startswith("0.")),
            }
    return out


OPTIMIZERS = MODEL_OPTIMIZERS


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_figures_match_the_copies(kind: str) -> None:
    results = train(OPTIMIZERS[kind])
    first, none = results[0]
    assert none is None
    assert first.update_norm is None and first.update_ratio is None
    assert first.stalled_fraction is None and first.weight_norm is not None
    for snap, ref in results[1:]:
        for figures, r in ((snap, ref["all"]), (snap.groups["first"], ref["first"])):
            assert figures.weight_norm == pytest.approx(r["weight"], rel=WEIGHT_TOL)
            assert r["update"] > 0
            assert figures.update_norm == pytest.approx(r["update"], rel=UPDATE_TOL)
            assert figures.update_ratio == pytest.approx(r["update"] / r["weight"],
                                                         rel=UPDATE_TOL)
            assert figures.stalled_fraction == pytest.approx(r["stalled"], abs=1e-3)
        assert not snap.no_update_step


@pytest.mark.parametrize(("lr", "bound"), [(1e-7, "high"), (1e-1, "low")])
@pytest.mark.parametrize("foreach", [False, True])
def test_bf16_stalled_fraction(lr: float, bound: str, foreach: bool) -> None:
    results = train(lambda m: torch.optim.SGD(m.parameters(), lr=lr, foreach=foreach),
                    dtype=torch.bfloat16, loss="sum")
    for snap, ref in results[1:]:
        r = ref["all"]
        if bound == "high":
            assert snap.stalled_fraction >= 0.9
        else:
            assert snap.stalled_fraction <= 0.2
        assert abs(snap.stalled_fraction - r["stalled"]) <= 0.02
        assert snap.update_norm == pytest.approx(r["update"], rel=1e-2)
        assert snap.weight_norm == pytest.approx(r["weight"], rel=WEIGHT_TOL)


def test_float32_weights_at_an_ordinary_learning_rate_stall_nowhere() -> None:
    """At lr 1e-3 every float32 element meant to move moves: a counted 0 (the references
    count it too; test_update_stalls.py holds the counts where elements do stall)."""
    for snap, ref in train(OPTIMIZERS["adamw_foreach"])[1:]:
        assert snap.stalled_fraction == 0.0 == ref["all"]["stalled"]


def test_a_step_that_changed_nothing_is_a_silent_skip() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with GradWatch(m, WatchConfig(update_stats=True)) as watch:
        snaps = []
        for step in range(3):
            m(torch.randn(4, 32)).sum().backward()
            watch.collect(step)
            snaps.append(watch.last)  # built in collect order, as the publisher builds them
            if step == 0:
                opt.step()  # step 1 then sees an update; step 2 sees none (the step skipped)
            opt.zero_grad()
    assert snaps[1].update_norm > 0 and not snaps[1].no_update_step
    assert snaps[2].update_norm == 0.0
    assert math.isnan(snaps[2].stalled_fraction)  # no element was meant to move
    assert snaps[2].no_update_step


def test_unsupported_optimizer_is_unmeasured_not_guessed() -> None:
    m = model()
    opt = torch.optim.RMSprop(m.parameters(), lr=1e-3)
    with GradWatch(m, WatchConfig(update_stats=True)) as watch:
        for step in range(3):
            m(torch.randn(4, 32)).sum().backward()
            watch.collect(step)
            opt.step()
            opt.zero_grad()
        snap = watch.last
    assert snap.weight_norm is not None
    assert snap.update_norm is None and snap.update_ratio is None
    assert snap.stalled_fraction is None and not snap.no_update_step


def test_off_by_default_and_no_section() -> None:
    m = model()
    with GradWatch(m, WatchConfig()) as watch:
        m(torch.randn(4, 32)).sum().backward()
        watch.collect(0)
        snap = watch.last
    assert snap.weight_norm is None and snap.groups["other"].weight_norm is None


def test_warm_steps_read_nothing_from_the_host_and_add_no_collective(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the update section a one-process CPU collect reads its squares as floats at
    # once (HostPacking), not in result(): both compared on the tensor route.
    monkeypatch.setattr("gradwatch.reduce.packing.HOST_PACK_PIECES", 0)
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)

    def loop(watch: Any, step: int) -> None:
        m(torch.randn(4, 32)).sum().backward()
        watch.collect(step)
        opt.step()
        opt.zero_grad()

    counts = {}
    for on in (False, True):
        with GradWatch(m, WatchConfig(update_stats=on)) as watch:
            for step in range(3):
                loop(watch, step)
            with count_host_reads() as reads, OpCounter() as ops:
                loop(watch, 3)
            counts[on] = (sum(reads.values()), ops.scalar_reads, ops.collectives)
    assert counts[True] == counts[False]
    assert counts[True][1] == 0


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_the_scaler_skipped_applied_nothing(fused: bool) -> None:
    """A GradScaler skip: non-fused, the optimizer's step is never called; fused, it runs with
    ``found_inf`` set and changes nothing on the device. Either way the next collect reads an
    update of 0, the skipped step is AMP's (not a silent skip), and the steps either side of
    it match the copies."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    snaps, refs = [], []
    with GradWatch(m, WatchConfig(update_stats=True)) as watch:
        for step in range(4):
            loss = m(torch.randn(4, 32)).pow(2).mean()
            if step == 1:
                loss = loss * math.inf
            scaler.scale(loss).backward()
            watch.collect(step, scaler=scaler, optimizer=opt)
            snaps.append(watch.last)
            before = copies(m)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            after = copies(m)
            refs.append(norm_of([after[n] - before[n] for n in after]))
    assert snaps[1].amp_skipped
    assert refs[1] == 0.0 and snaps[2].update_norm == 0.0
    assert not snaps[2].no_update_step  # AMP's skip, counted as such
    assert snaps[3].update_norm == pytest.approx(refs[2], rel=UPDATE_TOL)


def test_host_formulas() -> None:
    assert update_ratio(1.0, 4.0) == 0.25
    assert math.isnan(update_ratio(1.0, 0.0)) and math.isnan(update_ratio(1.0, math.inf))
    assert stalled_fraction(3.0, 4.0) == 0.75 and math.isnan(stalled_fraction(0.0, 0.0))
    from gradwatch.snapshot import GroupStats

    groups = {"a": GroupStats(), "other": GroupStats()}
    # two groups: w, u, stalled, moving per group, then unmeasured ranks, first-collect ranks
    values = [9.0, 16.0, 1.0, 0.0, 2.0, 0.0, 4.0, 0.0, 0.0, 0.0]
    fields = update_fields(values, ("a", "other"), groups, None)
    assert fields["weight_norm"] == 5.0 and fields["update_norm"] == 1.0
    assert fields["update_ratio"] == 0.2 and fields["stalled_fraction"] == 0.5
    assert fields["groups"]["other"].weight_norm == 4.0
    assert math.isnan(fields["groups"]["other"].stalled_fraction)
    first = update_fields([*values[:8], 0.0, 2.0], ("a", "other"), groups, None)
    assert "update_norm" not in first and first["weight_norm"] == 5.0  # stays None
    assert first["groups"]["a"].update_norm is None


def test_framework_callbacks_switch_it_on_and_log_the_measured_figures_only() -> None:
    from gradwatch.integrations.common import log_figures
    from gradwatch.integrations.huggingface import GradWatchCallback as HuggingFaceCallback
    from gradwatch.integrations.lightning import GradWatchCallback as LightningCallback
    from gradwatch.snapshot import GroupStats, Snapshot

    assert HuggingFaceCallback(update_stats=True).config.update_stats
    assert LightningCallback(update_stats=True).config.update_stats
    first = Snapshot(step=0, weight_norm=3.0, groups={"a": GroupStats(weight_norm=3.0)})
    logged = log_figures(first)
    assert logged["gradwatch/weight_norm"] == 3.0 and logged["gradwatch/weight_norm/a"] == 3.0
    assert not any("update" in k or "stalled" in k for k in logged)  # unmeasured: left out
    later = first.replace(update_norm=0.3, update_ratio=0.1, stalled_fraction=0.0)
    assert log_figures(later)["gradwatch/update_ratio"] == 0.1


def test_top_shows_update_ratio_stalled_updates_and_skips_outside_the_guard() -> None:
    from gradwatch.cli.endpoint import parse_exposition
    from gradwatch.cli.render import skipped_text, updates_text

    view = parse_exposition(
        "gradwatch_step 7\n"
        'gradwatch_update_ratio{group="host"} 0.001\n'
        'gradwatch_update_ratio{group="seed"} NaN\n'
        'gradwatch_stalled_update_fraction{group="host"} 0.95\n'
        'gradwatch_skipped_steps_total{reason="amp_overflow"} 0\n'
        'gradwatch_skipped_steps_total{reason="no_update"} 3\n'
    )
    assert view.update_ratio["host"] == 0.001 and math.isnan(view.update_ratio["seed"])
    shown = updates_text(view)
    assert shown is not None
    assert shown.plain == "updates: ratio host 0.001, seed undefined; stalled host 95%"
    skips = skipped_text(view).plain
    assert skips == ", optimizer skips: no_update 3"  # no guard: no guard-skipped part
    assert updates_text(parse_exposition("gradwatch_step 7\n")) is None


def test_the_environment_switches_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_UPDATE_STATS", "1")
    assert WatchConfig().update_stats
    monkeypatch.setenv("GRADWATCH_UPDATE_STATS", "0")
    assert not WatchConfig().update_stats


def test_mixed_dtype_weights_are_exact() -> None:
    """float64, float32 and bf16 parameters in one model (a group each): every weight norm to
    1e-6; the float64 and float32 groups' updates to 1e-4 of the copies, the bf16 group's to
    its rounding (a recovered weight one ulp off where a step crossed a power of two)."""
    torch.manual_seed(5)
    m = nn.Sequential(nn.Linear(8, 16).double(), nn.Linear(16, 16), nn.Linear(16, 4).bfloat16())
    groups = {"f64": ["0.*"], "f32": ["1.*"], "b16": ["2.*"]}
    tolerance = {"f64": UPDATE_TOL, "f32": UPDATE_TOL, "b16": 1e-2}

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = m[0](x.double()).float()
        return m[2](m[1](h).bfloat16()).float()

    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    snaps, refs = [], []
    with GradWatch(m, WatchConfig(update_stats=True, groups=groups)) as watch:
        for step in range(3):
            forward(torch.randn(4, 8)).pow(2).sum().backward()
            watch.collect(step)
            snaps.append(watch.last)
            before = copies(m)
            opt.step()
            opt.zero_grad()
            after = copies(m)
            refs.append({
                g: (norm_of([before[n] for n in before if n[0] == pat[0][0]]),
                    norm_of([after[n] - before[n] for n in after if n[0] == pat[0][0]]))
                for g, pat in groups.items()
            })
    for k, snap in enumerate(snaps):
        for g in groups:
            stats = snap.groups[g]
            assert stats.weight_norm == pytest.approx(refs[k][g][0], rel=WEIGHT_TOL), g
            if k:
                assert stats.update_norm == pytest.approx(refs[k - 1][g][1], rel=tolerance[g]), g


def test_every_n_steps_publishes_the_last_optimizer_steps_update() -> None:
    """With ``every_n_steps=2`` a collect's update figures are those of the last optimizer
    step before it (theta_t - theta_{t-1}), not the update summed since the previous collect:
    documented, and held against copies of both."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    snaps: dict[int, Any] = {}
    befores, afters = [], []
    with GradWatch(m, WatchConfig(update_stats=True, every_n_steps=2)) as watch:
        for step in range(5):
            m(torch.randn(8, 32)).pow(2).mean().backward()
            watch.collect(step)
            if step % 2 == 0:
                snaps[step] = watch.last
            befores.append(copies(m))
            opt.step()
            opt.zero_grad()
            afters.append(copies(m))
    for step in (2, 4):
        last = norm_of([afters[step - 1][n] - befores[step - 1][n] for n in afters[0]])
        since_collect = norm_of([afters[step - 1][n] - befores[step - 2][n] for n in afters[0]])
        assert abs(since_collect - last) > 10 * UPDATE_TOL * last  # the two differ here
        assert snaps[step].update_norm == pytest.approx(last, rel=UPDATE_TOL)
        weight = norm_of(list(afters[step - 1].values()))
        assert snaps[step].weight_norm == pytest.approx(weight, rel=WEIGHT_TOL)


@pytest.mark.parametrize("count_all", [True, False])
def test_the_host_section_is_the_tensor_routes_bit_for_bit(count_all: bool) -> None:
    """A CPU meter of a few pieces sums its section as Python floats: the same float64
    additions in the same order as the tensor route's ``where`` and ``index_add_``, so the same
    bits, pieces another rank counts left out, the tail's flags included."""
    from gradwatch.norms.updates import UpdateMeter

    params = [nn.Parameter(torch.randn(3)) for _ in range(7)]
    groups, contributes = [0, 1, 0, 2, 1, 0, 2], [True, False, True, True, True, False, True]
    on_host = UpdateMeter(params, groups, 3, contributes, torch.device("cpu"))
    on_device = UpdateMeter(params, groups, 3, contributes, torch.device("cpu"),
                            host_section=False)
    try:
        figures = torch.rand(4, 7, dtype=torch.float64) * torch.tensor(
            [[1e3], [1e-9], [1.0], [1.0]], dtype=torch.float64)
        figures[2:] = (figures[2:] * 1000).round()
        for meter in (on_host, on_device):
            meter._updates.copy_(figures)
            meter._weighed = meter._stamps()  # the weights as measured: not read again
        got, want = on_host.figures(count_all), on_device.figures(count_all)
        assert isinstance(got, list) and isinstance(want, torch.Tensor)
        assert got == want.tolist()
        assert got[-2:] == [0.0, 1.0]  # measured; no previous collect
        # cleared, as the tensor route's
        assert torch.equal(on_host._updates, on_device._updates)
        assert on_host._updates[1:].abs().sum() == 0
    finally:
        on_host.close()
        on_device.close()


def test_a_host_packed_collect_publishes_the_tensor_routes_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps watched with the host packing (the section as floats), on the tensor
    route, and clipped (a clip packs by tensor ops: the meter's floats become the section's
    tensor) publish the same update figures, bit for bit, and none dispatches a scalar read
    in a collect."""
    def run(host: bool, clip: bool = False) -> tuple[list[tuple[Any, ...]], int]:
        torch.manual_seed(0)
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
        out = []
        with GradWatch(m, WatchConfig(update_stats=True, groups=GROUPS)) as watch:
            assert (watch._resolved.updates._section.host_pairs is not None) == host
            for step in range(4):
                m(torch.randn(4, 32)).pow(2).mean().backward()
                with OpCounter() as ops:
                    if clip:  # a bound no gradient reaches: the gradients keep their bits
                        watch.clip_grad_norm_(1e30, step=step)
                    else:
                        watch.collect(step)
                snap = watch.last
                out.append((snap.weight_norm, snap.update_norm, snap.stalled_fraction,
                            snap.groups["first"].update_norm))
                opt.step()
                opt.zero_grad()
        return out, ops.scalar_reads

    on_host, host_reads = run(True)
    clipped, clip_reads = run(True, clip=True)
    monkeypatch.setattr("gradwatch.reduce.packing.HOST_PACK_PIECES", 0)
    on_device, device_reads = run(False)
    assert on_host == on_device == clipped and on_host[1][1] is not None
    assert host_reads == device_reads == clip_reads == 0


def test_a_host_packed_section_of_the_wrong_length_is_refused() -> None:
    """The host packing writes the section's floats at its slots; a section of another length
    would shift every later slot, so it is refused, naming both lengths."""
    m = model()
    with GradWatch(m, WatchConfig(update_stats=True, groups=GROUPS)) as watch:
        m(torch.randn(4, 32)).pow(2).mean().backward()
        reducer = watch._resolved.reducer
        sq = torch.zeros(3 * len(reducer.layout.local_to_global), dtype=torch.float64)
        has_grad = [True] * len(reducer.layout.local_to_global)
        width = sections(reducer.layout).updates
        good = reducer._host_packing.reduce(reducer, sq, has_grad, 0, True,
                                            [0.0] * (width.stop - width.start))
        assert good is not None
        with pytest.raises(ValueError, match="update section of 1 values"):
            reducer._host_packing.reduce(reducer, sq, has_grad, 0, True, [0.0])
