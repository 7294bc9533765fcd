"""The prepared replay of an Adam step's compiled update figures (norms/update_replay.py): taken
on the steps after the first compiled one (no batch rebuilt), its figures bit for bit those of
the full path on the same step, and dropped, the full path measuring, whenever what it was
built from changes (state loaded, a parameter without gradient, a parameter's data replaced, a
zero decay, ``found_inf``), with the figures still against float64 references."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from update_refs import UPDATE_TOL, copies, model, norm_of

from gradwatch import GradWatch, WatchConfig
from gradwatch.norms import updates as updates_module
from gradwatch.norms.updates import UpdateMeter


def meter_of(watch: GradWatch) -> UpdateMeter:
    meter = watch._resolved.updates
    assert meter is not None
    return meter


def full_path(meter: UpdateMeter, opt: torch.optim.Optimizer) -> torch.Tensor:
    """The step measured again by the full path (batches rebuilt), the replay dropped."""
    meter._replays.clear()
    meter._updates.zero_()
    meter.after_step(opt)
    return meter._updates.clone()


class Built:
    """Counts the full path's batch builds (``stepped_batches`` as the meter calls it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        real = updates_module._batches

        def counted(*args: Any) -> Any:
            self.n += 1
            return real(*args)

        monkeypatch.setattr(updates_module, "_batches", counted)


def run(changes: dict[int, Callable[[nn.Module, torch.optim.Optimizer], None]],
        steps: int, monkeypatch: pytest.MonkeyPatch, fused: bool = False
        ) -> tuple[list[bool], list[float]]:
    """``steps`` AdamW steps under a schedule, ``changes[k]`` applied before step ``k``; per
    step: whether it was replayed (no batch built), and the relative error of the update norm
    against the copies'. Each step's replayed figures are checked bit for bit against the full
    path on the same state."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.7 ** k)
    built = Built(monkeypatch)
    replayed, errors = [], []
    with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="wait")) as watch:
        meter = meter_of(watch)
        for step in range(steps):
            if step in changes:
                changes[step](m, opt)
            m(torch.randn(8, 32)).pow(2).mean().backward()
            before, n = copies(m), built.n
            meter._updates.zero_()  # as a collect does: a parameter not stepped adds nothing
            opt.step()
            replayed.append(built.n == n)
            figures = meter._updates.clone()
            assert torch.equal(figures, full_path(meter, opt))
            after = copies(m)
            exact = norm_of([after[k] - before[k] for k in after])
            measured = float(figures[1].sum().sqrt())
            errors.append(abs(measured - exact) / exact)
            schedule.step()
            opt.zero_grad()
    return replayed, errors


def test_steps_after_the_first_compiled_one_are_replayed(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    replayed, errors = run({}, 5, monkeypatch)
    assert replayed == [False, True, True, True, True]
    assert max(errors) < UPDATE_TOL


def _load_state(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    import copy

    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors


def _freeze_last(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    list(m.parameters())[-1].requires_grad_(False)  # no gradient: not stepped


def _replace_data(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    first = next(m.parameters())
    first.data = first.data.clone()  # another storage


def _new_state_dict(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    first = next(m.parameters())
    opt.state[first] = dict(opt.state[first])  # the same tensors in another dict


def _new_moment(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    first = next(m.parameters())
    opt.state[first]["exp_avg"] = opt.state[first]["exp_avg"].clone()  # equal values


def _found_inf(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.found_inf = torch.zeros(())  # type: ignore[attr-defined]


@pytest.mark.parametrize(("change", "fused"), [(_load_state, False), (_freeze_last, False),
                                               (_replace_data, False), (_new_state_dict, False),
                                               (_new_moment, False), (_found_inf, True)])
def test_a_change_drops_the_replay(change: Callable[..., None], fused: bool,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The step after the change is measured by the full path (its figures still exact), and
    the one after that is replayed again (fused AdamW for ``found_inf``)."""
    replayed, errors = run({3: change}, 5, monkeypatch, fused)
    assert replayed == [False, True, True, False, True]
    assert max(errors) < UPDATE_TOL


def test_a_changed_decay_keeps_the_replay_a_zero_decay_drops_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new weight decay only rebuilds the hyperparameters; a decay of 0 needs the kernel
    without decay."""

    def halve(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[0]["weight_decay"] /= 2

    def zero(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.param_groups[0]["weight_decay"] = 0.0

    replayed, errors = run({2: halve, 4: zero}, 6, monkeypatch)
    assert replayed == [False, True, True, True, False, True]
    assert max(errors) < UPDATE_TOL


def test_the_section_follows_a_weight_whose_strides_changed() -> None:
    """The collect's compiled section repeats its last call while the weights' layout is the
    same; a weight replaced by one of other strides (same shape) is read again at the collect
    (new data since the step) through the keyed path (its own kernel), and every weight norm
    is the copies'."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="wait")) as watch:
        meter = meter_of(watch)
        for step in range(4):
            if step == 2:
                first = next(m.parameters())
                first.data = first.data.t().contiguous().t()  # column-major, same values
                opt.load_state_dict(opt.state_dict())
            m(torch.randn(8, 32)).pow(2).mean().backward()
            watch.collect(step)
            exact = norm_of(list(copies(m).values()))
            assert watch.last.weight_norm == pytest.approx(exact, rel=1e-6)
            opt.step()
            opt.zero_grad()
        assert meter.fused.section_calls == 0  # a few CPU pieces: the section as floats
        # the batch and the weights' kernel, each in both layouts (the first collect and the
        # one after the data changed read the weights)
        assert meter.fused.cache.ready == 4


def test_a_loaded_state_is_let_go_at_once() -> None:
    """``load_state_dict`` drops the replay (and the old state tensors it held) before the next
    step; closing the meter drops the rest and removes the hook."""
    import copy
    import gc
    import weakref

    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="wait")) as watch:
        meter = meter_of(watch)
        for step in range(2):
            m(torch.randn(8, 32)).pow(2).mean().backward()
            watch.collect(step)
            opt.step()
            opt.zero_grad()
        assert len(meter._replays._by_id) == 1
        old = weakref.ref(opt.state[next(m.parameters())]["exp_avg"])
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new tensors
        gc.collect()
        assert not meter._replays._by_id and old() is None
        m(torch.randn(8, 32)).pow(2).mean().backward()
        watch.collect(2)
        opt.step()
        assert len(meter._replays._by_id) == 1
        assert len(opt._optimizer_load_state_dict_pre_hooks) == 1
    assert not meter._replays._by_id and not opt._optimizer_load_state_dict_pre_hooks


def test_the_collect_reads_the_weights_only_when_the_step_did_not_leave_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a compiled step the collect's weight norm comes from the squares the step's kernel
    left (the weights not read again), and so does a collect with nothing changed since the
    previous one read them; an in-place change after the step (a version bump) or replaced
    data make the collect read the weights; every weight norm is the copies'."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    with GradWatch(m, WatchConfig(update_stats=True, compile_kernels="wait")) as watch:
        meter = meter_of(watch)
        read: list[bool] = []
        real = meter.fused.weights

        def weights(*args: Any) -> Any:
            read.append(True)
            return real(*args)

        monkeypatch.setattr(meter.fused, "weights", weights)

        def collect(step: int) -> bool:
            n = len(read)
            watch.collect(step)
            exact = norm_of(list(copies(m).values()))
            assert watch.last.weight_norm == pytest.approx(exact, rel=1e-6)
            return len(read) > n

        def train() -> None:
            m(torch.randn(8, 32)).pow(2).mean().backward()

        train()
        assert collect(0)  # no step before it
        for step in range(1, 3):
            opt.step()
            opt.zero_grad()
            train()
            assert not collect(step)  # the step's squares
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            next(m.parameters()).mul_(2.0)  # in place after the step
        train()
        assert collect(3)
        assert not collect(4)  # no step and no change since the previous collect read them
        opt.step()
        opt.zero_grad()
        first = next(m.parameters())
        first.data = first.data * 0.5  # new data after the step
        train()
        assert collect(5)
        opt.step()
        opt.zero_grad()
        train()
        assert not collect(6)
