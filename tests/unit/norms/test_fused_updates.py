"""The compiled update figures (norms/fused_updates.py), in "wait" mode on small models: every
figure against float64 references computed here from copies of the weights (the product copies
nothing), the counts equal to the eager path's element for element, the compiled path the one
taken, no host read, nothing recompiled under a learning-rate schedule, and no compile on the
training thread in "background" mode."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from update_refs import (
    GROUPS,
    MODEL_OPTIMIZERS,
    STALLING_OPTIMIZERS,
    UPDATE_TOL,
    WEIGHT_TOL,
    copies,
    model,
    norm_of,
)

from gradwatch import GradWatch, WatchConfig
from gradwatch.doctor.testing import count_host_reads
from gradwatch.norms.updates import UpdateMeter


def reference(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
              names: Callable[[str], bool]) -> dict[str, float]:
    keys = [n for n in after if names(n)]
    return {"weight": norm_of([after[n] for n in keys]),
            "update": norm_of([after[n] - before[n] for n in keys])}



#: The compiled path's optimizers (a tensor learning rate keeps the eager path).
OPTIMIZERS = {name: make for name, make in MODEL_OPTIMIZERS.items() if "tensor_lr" not in name}


def meter_of(watch: GradWatch) -> UpdateMeter:
    meter = watch._resolved.updates
    assert meter is not None
    return meter


@pytest.mark.parametrize(("kind", "dtype"), [(k, torch.float32) for k in OPTIMIZERS]
                         + [("adamw_foreach", torch.float64)])
def test_compiled_figures_match_the_copies_under_a_schedule(kind: str,
                                                            dtype: torch.dtype) -> None:
    """A learning rate that changes every step (a schedule): the figures follow it (the rate
    is an input of the kernel, not a constant), nothing is compiled after the second step, and
    every step and collect went through the compiled kernels."""
    m = model(dtype)
    opt = OPTIMIZERS[kind](m)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    steps = 5
    pending: dict[str, dict[str, float]] | None = None
    with GradWatch(m, WatchConfig(update_stats=True, groups=GROUPS,
                                  compile_kernels="wait")) as watch:
        meter = meter_of(watch)
        for step in range(steps):
            m(torch.randn(16, 32, dtype=dtype)).pow(2).mean().backward()
            watch.collect(step)
            snap = watch.last
            if pending is not None:
                for figures, r in ((snap, pending["all"]), (snap.groups["first"],
                                                            pending["first"])):
                    assert figures.weight_norm == pytest.approx(r["weight"], rel=WEIGHT_TOL)
                    assert r["update"] > 0
                    assert figures.update_norm == pytest.approx(r["update"], rel=UPDATE_TOL)
                    assert figures.stalled_fraction == 0.0  # float32 at these rates: none
            before = copies(m)
            opt.step()
            schedule.step()
            opt.zero_grad()
            after = copies(m)
            pending = {"all": reference(before, after, lambda n: True),
                       "first": reference(before, after, lambda n: n.startswith("0."))}
            if step == 1:
                compiled = meter.fused.cache.ready
        cache = meter.fused.cache
        # a CPU meter of a few pieces sums its section as floats: no section kernel
        assert (meter.fused.calls, meter.fused.section_calls) == (steps, 0)
        # the step's kernel and the first collect's weights (no step before it); the later
        # collects read the weight squares the step's kernel left
        assert (cache.ready, cache.pending, cache.failed) == (compiled, 0, 0) == (2, 0, 0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no dynamo


#: Blocks of the stall test weight (weight, gradient, elements): at lr 1e-10 an element of
#: 1e4 or -3e3 is meant to move under half an ulp (stalls), one of 1e-4 moves, zeros with no
#: gradient are not meant to move, a decay alone stalls on 1e-4 (as in test_update_stalls).
BLOCKS = ((1e4, 1.0, 700), (1e-4, -1.0, 500), (0.0, 0.0, 300), (0.0, 2.0, 200),
          (1e-4, 0.0, 400), (-3e3, 0.5, 100))

STALLING: dict[str, Any] = {
    name: STALLING_OPTIMIZERS[name] for name in (
        "adamw_foreach", "adam_no_decay", "adam_fused", "sgd", "sgd_decay_foreach",
        "sgd_momentum_decay")}


def stalling_weight() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.cat([torch.full((n,), v) for v, _g, n in BLOCKS] * 3)
    g = torch.cat([torch.full((n,), gv) for _v, gv, n in BLOCKS] * 3)
    return w, g


@pytest.mark.parametrize("kind", list(STALLING))
def test_counts_equal_the_eager_paths_and_the_copies(kind: str) -> None:
    """Two meters on one parameter, the eager one and the compiled one: per step the stalled
    and moving counts are equal (exactly), and equal to those of the float64 copies (an
    element stalled when it was meant to move, its gradient or decay non-zero, and is
    unchanged); the squared update within 1e-6 of the eager path's float32-accumulated one; the
    compiled one's weight squares those of the weights after the step."""
    w, g = stalling_weight()
    p = nn.Parameter(w.clone())
    opt = STALLING[kind](p, 1e-10)
    eager = UpdateMeter([p], [0], 1, [True], torch.device("cpu"))
    fused = UpdateMeter([p], [0], 1, [True], torch.device("cpu"), compile_kernels="wait")
    decayed = kind in ("adamw_foreach", "sgd_decay_foreach", "sgd_momentum_decay")
    try:
        for step in range(3):
            before = p.detach().clone()
            p.grad = g.clone()
            opt.step()
            got, want = fused._updates.clone(), eager._updates.clone()
            assert torch.equal(got[2:], want[2:]), step
            assert float(got[1, 0]) == pytest.approx(float(want[1, 0]), rel=1e-6)
            meant = (g != 0) | ((before != 0) if decayed else torch.zeros_like(g, dtype=bool))
            stalled = meant & (p.detach() == before)
            assert (int(got[2, 0]), int(got[3, 0])) == (int(stalled.sum()), int(meant.sum()))
            update = norm_of([p.detach().double() - before.double()])
            assert math.sqrt(float(got[1, 0])) == pytest.approx(update, rel=UPDATE_TOL)
            # the compiled kernel also leaves the squares of the weights the step left
            weights = math.fsum(x * x for x in p.detach().double().tolist())
            assert float(got[0, 0]) == pytest.approx(weights, rel=1e-12)
            eager.figures(count_all=True)
            fused.figures(count_all=True)
        assert fused.fused.calls == 3 and eager.fused.calls == 0
    finally:
        eager.close()
        fused.close()


def test_a_skipped_fused_step_is_read_by_the_compiled_kernel() -> None:
    """``found_inf`` set (a GradScaler's skip of a fused step): the compiled kernel reads it
    as an input, nothing moved and nothing was meant to."""
    w, g = stalling_weight()
    p = nn.Parameter(w.clone())
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
    meter = UpdateMeter([p], [0], 1, [True], torch.device("cpu"), compile_kernels="wait")
    try:
        p.grad = g.clone()
        opt.found_inf = torch.zeros(())
        opt.step()
        assert float(meter._updates[3, 0]) > 0
        opt.found_inf = torch.ones(())
        p.grad = g.clone()
        opt.step()
        assert meter._updates[1:, 0].tolist() == [0.0, 0.0, 0.0]
        weights = math.fsum(x * x for x in p.detach().double().tolist())
        assert float(meter._updates[0, 0]) == pytest.approx(weights, rel=1e-12)
        assert meter.fused.calls == 2 and meter.fused.cache.ready == 1
    finally:
        meter.close()


def test_warm_compiled_steps_read_nothing_from_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler sees every op dispatched (the compiled kernels' wrappers included): warm
    steps with compiled update stats dispatch no scalar read that the same steps without
    update stats do not (AdamW's own step reads its CPU step counts), and no eager inversion
    (no more ``_foreach_sqrt`` than AdamW's own)."""
    from collections import Counter

    # Without the update section a one-process CPU collect reads its squares as floats at
    # once (HostPacking), not in result(): both compared on the tensor route.
    monkeypatch.setattr("gradwatch.reduce.packing.HOST_PACK_PIECES", 0)

    def profiled(on: bool) -> tuple[Counter[str], int, int]:
        m = model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9 ** k)

        def loop(watch: GradWatch, step: int) -> None:
            m(torch.randn(4, 32)).sum().backward()
            watch.collect(step)
            opt.step()
            schedule.step()
            opt.zero_grad()

        with GradWatch(m, WatchConfig(update_stats=on, compile_kernels="wait")) as watch:
            for step in range(2):
                loop(watch, step)
            with count_host_reads() as reads, torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for step in range(2, 5):
                    loop(watch, step)
            calls = meter_of(watch).fused.section_calls if on else 0
        return Counter(e.name for e in prof.events()), sum(reads.values()), calls

    (on, on_reads, sections), (off, off_reads, _) = profiled(True), profiled(False)
    assert sections == 5  # "wait": every collect, the first included
    assert on["aten::_local_scalar_dense"] == off["aten::_local_scalar_dense"]
    assert on["aten::item"] == off["aten::item"] and on_reads == off_reads
    assert on["aten::_foreach_sqrt"] == off["aten::_foreach_sqrt"]
    assert on["aten::sqrt"] == off["aten::sqrt"]


def test_background_mode_compiles_off_the_training_thread() -> None:
    """"background": the first steps are measured eagerly (the same figures), the compiles run
    on the compile thread, and once ready the kernels are used."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    threads: list[str] = []
    with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="background")) as watch:
        meter = meter_of(watch)
        cache = meter.fused.cache
        compiler = cache._compiler

        def recording(fn: Any, example: Any) -> Any:
            threads.append(threading.current_thread().name)
            return compiler(fn, example)

        cache._compiler = recording
        for step in range(2):
            m(torch.randn(4, 32)).sum().backward()
            watch.collect(step)
            opt.step()
            opt.zero_grad()
            if step == 0:  # the first sight of each layout never waits for its compile
                assert meter.fused.calls == 0 and meter.fused.section_calls == 0
        assert cache.wait(timeout=600)
        # the first collects after compiled steps read the weight squares those steps left
        for step in range(2, 4):
            m(torch.randn(4, 32)).sum().backward()
            watch.collect(step)
            opt.step()
            opt.zero_grad()
        assert cache.wait(timeout=600)
        calls, sections = meter.fused.calls, meter.fused.section_calls
        for step in range(4, 6):
            m(torch.randn(4, 32)).sum().backward()
            watch.collect(step)
            opt.step()
            opt.zero_grad()
        assert (meter.fused.calls, meter.fused.section_calls) == (calls + 2, sections)
        assert watch.last.update_norm is not None and watch.last.update_norm > 0
    assert threads and all(t == "gradwatch-compile" for t in threads)
    assert threading.current_thread().name not in threads


@pytest.mark.parametrize("lr", [1e-7, 1e-1])
@pytest.mark.parametrize("kind", ["sgd", "sgd_foreach", "adamw"])
def test_bf16_stalled_fraction_against_the_copies(kind: str, lr: float) -> None:
    """bf16 weights through the compiled kernels (each op rounded to bf16 as eager's is):
    SGD's stalled fraction at least 0.9 at lr 1e-7, at most 0.2 at lr 1e-1, within 0.02 of the
    copies' (an element stalled when its gradient is non-zero and its weight unchanged); for
    AdamW (moving also where only the decay meant to move) within 0.02 of the eager path's;
    the update norm within 1e-2 of the copies' (bf16: one ulp where a step crossed a power of
    two), the weight norm within 1e-6."""
    m = model(torch.bfloat16)
    if kind == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=lr, foreach=kind == "sgd_foreach")
    ps = list(m.parameters())
    eager = UpdateMeter(ps, [0] * len(ps), 1, [True] * len(ps), torch.device("cpu"))
    pending: tuple[float, float, float] | None = None
    try:
        with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="wait")) as watch:
            for step in range(4):
                m(torch.randn(16, 32, dtype=torch.bfloat16)).sum().backward()
                watch.collect(step)
                snap = watch.last
                if pending is not None:
                    weight, update, stalled = pending
                    assert snap.weight_norm == pytest.approx(weight, rel=WEIGHT_TOL)
                    assert snap.update_norm == pytest.approx(update, rel=1e-2)
                    assert abs(snap.stalled_fraction - stalled) <= 0.02
                    if kind != "adamw":
                        assert snap.stalled_fraction >= 0.9 if lr < 1e-3 else (
                            snap.stalled_fraction <= 0.2)
                before = copies(m)
                grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
                opt.step()
                opt.zero_grad()
                after = copies(m)
                figures = eager.figures(count_all=True)
                if kind == "adamw":
                    fraction = float(figures[2]) / float(figures[3])
                else:
                    moving = [grads[n] != 0 for n in after]
                    unchanged = [after[n] == before[n] for n in after]
                    fraction = (sum(int((mv & u).sum()) for mv, u in zip(moving, unchanged,
                                                                            strict=True))
                                / sum(int(mv.sum()) for mv in moving))
                pending = (norm_of(list(after.values())),
                           norm_of([after[n] - before[n] for n in after]), fraction)
            assert meter_of(watch).fused.calls == 4
    finally:
        eager.close()


def test_what_stays_eager() -> None:
    """A tensor learning rate keeps the eager path (and its figures)."""
    cases: list[tuple[torch.dtype, Callable[[nn.Module], torch.optim.Optimizer]]] = [
        (torch.float32, lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3),
                                                   fused=True)),
    ]
    for dtype, make in cases:
        m = model(dtype)
        opt = make(m)
        with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="wait")) as watch:
            for step in range(2):
                m(torch.randn(4, 32, dtype=dtype)).sum().backward()
                watch.collect(step)
                opt.step()
                opt.zero_grad()
            m(torch.randn(4, 32, dtype=dtype)).sum().backward()
            watch.collect(2)
            assert meter_of(watch).fused.calls == 0
            assert watch.last.update_norm is not None and watch.last.update_norm > 0
