"""An Adam step's compiled update figures, repeated without rebuilding their batches.

The update meter's post-hook (:class:`gradwatch.norms.updates.UpdateMeter`) gathers, on every
step, the stepped parameters and their state into batches of views
(:mod:`gradwatch.norms.update_batches`), keys each batch's compiled kernel by its layout
(:mod:`gradwatch.norms.fused_updates`) and writes the figures per parameter: Python per
parameter and per view that costs more than the compiled kernel's own wrapper. Between two
steps of a training loop none of it changes but the learning rate (a schedule) and which
parameters have gradients (rarely). An :class:`AdamReplay` keeps one optimizer's prepared
calls (the kernels, their argument lists, the owners' index) from a step whose every batch ran
a compiled kernel, and repeats them while what they were built from is what the step holds:

* the optimizer's ``state`` dict and ``param_groups`` (the same objects, the same lengths:
  ``load_state_dict`` and ``add_param_group`` replace or grow them);
* per parameter the meter watches in the optimizer: whether it has a gradient, its storage
  (``data_ptr``: a parameter whose data was replaced gets new views), the identity of the
  state tensors the kernel reads (``exp_avg``, ``exp_avg_sq`` or ``max_exp_avg_sq``, ``step``);
* per batch its group's ``decoupled_weight_decay`` and ``amsgrad`` (which kernel and which
  state), whether the decay is non-zero, and that the hyperparameters are Python numbers; a
  changed learning rate, beta, eps or decay only rebuilds the small ``hyper`` tensor;
* whether the optimizer carries a ``found_inf`` (a skipped fused step).

Anything else, or a difference, drops the replay and the meter's full path runs (and may record
a new one). Every figure is the full path's: the same kernel on the same tensors with the same
hyperparameters; the owners' writes are an ``index_copy_`` where each parameter has one view
(``index_fill_`` with 0 then ``index_add_`` of one value is that value) and the full path's
two ops otherwise. The check is a few attribute reads per parameter; no op per view.

Sync behaviour: none (CPU tensors; no value is read on the host). Memory: the replay holds
references to the parameters and state tensors it reads (no copy), dropped with the optimizer
(a weak reference), when the optimizer loads a state (a ``load_state_dict`` pre-hook: the old
tensors are freed as they would be without it), at the first step it no longer holds, or with
the meter.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from gradwatch.norms.fused_updates import FusedUpdates, hyper_tensor
from gradwatch.norms.kernels import compiled_calls_allowed
from gradwatch.norms.update_batches import local_part


def _values(group: dict[str, Any]) -> tuple[Any, ...]:
    """Adam's hyperparameters in ``hyper``'s order: ``[lr, beta1, beta2, eps, weight_decay]``."""
    return (group["lr"], *group["betas"], group["eps"], group["weight_decay"])


def _raw(group: dict[str, Any]) -> tuple[Any, ...]:
    """The group's entries :func:`_values` and :func:`_flags` read, as they are: the same
    objects mean the same call (identity: a tensor entry is never compared by value)."""
    return (group["lr"], group["betas"], group["eps"], group["weight_decay"],
            group.get("decoupled_weight_decay"), group.get("amsgrad"))


def _flags(group: dict[str, Any]) -> tuple[bool, bool, bool]:
    """What selects a batch's kernel and the state it reads: decoupled decay, a non-zero decay,
    ``amsgrad``."""
    return (bool(group.get("decoupled_weight_decay", False)),
            float(group["weight_decay"]) != 0.0, bool(group.get("amsgrad", False)))


#: The state entries whose tensors an Adam kernel reads (their identities are checked).
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


class _Held:
    """What a replay's calls were built from, per watched parameter (in order): whether it
    had a gradient, its state dict (None: the step did not initialise it), that dict's
    tensors the kernel reads, its local storage. The replay holds these references (so the
    identities compared stay meaningful)."""

    __slots__ = ("no_grad", "params", "ptrs", "states", "tensors")

    def __init__(self, optimizer: Any, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.no_grad = self._no_grad()
        self.states = list(map(optimizer.state.get, self.params))
        self.tensors = self._tensors(self.states)
        self.ptrs = self._ptrs()

    def _no_grad(self) -> list[bool]:
        return [p.grad is None for p in self.params]

    @staticmethod
    def _tensors(states: list[Any]) -> list[Any]:
        return [t for st in states if st is not None for t in map(st.get, _STATE_KEYS)]

    def _ptrs(self) -> list[int]:
        return [local_part(p).data_ptr() for p in self.params]

    def unchanged(self, optimizer: Any) -> bool:
        """Are the gradients' presence, the state dicts, their tensors and the storages the
        ones held? Objects compared by identity only (``is``: no dict or tensor is ever
        compared by value), the flags and storages as plain values."""
        if self._no_grad() != self.no_grad:
            return False
        states = list(map(optimizer.state.get, self.params))
        if not all(map(operator.is_, states, self.states)):
            return False
        tensors = self._tensors(states)
        return (len(tensors) == len(self.tensors)
                and all(map(operator.is_, tensors, self.tensors)) and self._ptrs() == self.ptrs)


class _Call:
    """One batch's prepared compiled call: ``kernel(params, ms, vs, steps, hyper, keep)``,
    its tensors kept flat in the kernel's input order (``leaves``: the lists' tensors, then
    ``hyper``, then ``keep`` when there is one), so a repeated call flattens nothing."""

    __slots__ = ("flags", "group", "hyper_at", "kernel", "leaves", "owners", "raw", "unique",
                 "values")

    def __init__(self, kernel: Callable[..., Tensor], group: dict[str, Any], args: tuple,
                 owners: Tensor, unique: bool) -> None:
        self.kernel = kernel
        self.group = group
        self.values = _values(group)
        self.flags = _flags(group)
        self.raw = _raw(group)
        params, ms, vs, steps, hyper, _keep = args
        self.leaves: list[Tensor] = [*params, *ms, *vs, *steps, hyper]
        self.hyper_at = len(self.leaves) - 1
        self.owners = owners
        self.unique = unique

    def run(self, keep: Tensor | None) -> Tensor:
        """The kernel's figures for this step (``keep``: ``1 - found_inf``, or None)."""
        if keep is None:
            return self.kernel.call_leaves(self.leaves)
        return self.kernel.call_leaves([*self.leaves, keep])

    def refresh(self) -> bool:
        """The ``hyper`` tensor for the group's current values (rebuilt only when one changed);
        False when the group now needs another kernel or a hyperparameter is not a number."""
        group = self.group
        raw = _raw(group)
        if all(a is b for a, b in zip(raw, self.raw, strict=True)):
            return True
        if _flags(group) != self.flags:
            return False
        self.raw = raw
        values = _values(group)
        if values != self.values:
            hyper = hyper_tensor(values)
            if hyper is None:
                return False
            self.values, self.leaves[self.hyper_at] = values, hyper
        return True


class AdamReplay:
    """One Adam/AdamW optimizer's compiled update figures, prepared (module docstring).

    Args:
        optimizer: the optimizer whose step was measured.
        params: the watched parameters it holds, in its groups' order.
        calls: per batch ``(kernel, group, args, owners, unique)``: the compiled kernel and the
            arguments it was called with, the owners' device index and whether each owner
            has one view.
        positions: the meter's positions of every piece the calls write.
    """

    def __init__(self, optimizer: Any, params: Sequence[Tensor],
                 calls: Sequence[tuple[Callable[..., Tensor], dict[str, Any], tuple, Tensor,
                                       bool]],
                 positions: Sequence[int], on_drop: Callable[[], None]) -> None:
        self._optimizer = weakref.ref(optimizer, lambda _ref: on_drop())
        # a loaded state replaces the tensors held here: drop them at once, not at the next step
        self._loading = optimizer.register_load_state_dict_pre_hook(
            lambda _opt, _state: on_drop())
        self._state = optimizer.state
        self._groups = list(optimizer.param_groups)
        self._sizes = [len(g["params"]) for g in self._groups]
        self._params = list(params)
        self._held = _Held(optimizer, self._params)
        self._found_inf = getattr(optimizer, "found_inf", None) is not None
        self._calls = [_Call(*c) for c in calls]
        self.batches = len(self._calls)
        #: the meter's positions of the pieces the calls write (their weight squares included)
        self.positions = frozenset(positions)

    def close(self) -> None:
        """Stop watching the optimizer's ``load_state_dict``."""
        self._loading.remove()

    def holds(self, optimizer: Any) -> bool:
        """Whether the prepared calls read what ``optimizer``'s step just updated."""
        groups = optimizer.param_groups
        return (self._optimizer() is optimizer and optimizer.state is self._state
                and len(groups) == len(self._groups)
                and all(a is b and len(a["params"]) == n
                        for a, b, n in zip(groups, self._groups, self._sizes, strict=True))
                and (getattr(optimizer, "found_inf", None) is not None) == self._found_inf
                and self._held.unchanged(optimizer))

    def run(self, optimizer: Any, updates: Tensor) -> bool:
        """The step's figures into ``updates`` (``4 x P``: each batch's owners overwritten), or
        False, with nothing written, when the replay no longer holds (the caller measures the
        step its full way and drops this replay)."""
        if not compiled_calls_allowed() or not self.holds(optimizer):
            return False
        if not all(call.refresh() for call in self._calls):
            return False
        keep = None
        if self._found_inf:
            keep = 1 - optimizer.found_inf.to(device="cpu", dtype=torch.float64)
        on_cpu = updates.device.type == "cpu"  # the kernels' figures are CPU tensors
        with torch.no_grad():
            for call in self._calls:
                figures = call.run(keep)
                if not on_cpu:
                    figures = figures.to(updates.device)
                if call.unique:
                    updates.index_copy_(1, call.owners, figures)
                else:
                    updates.index_fill_(1, call.owners, 0.0)
                    updates.index_add_(1, call.owners, figures)
        return True


#: Optimizers one meter keeps a replay for (a job has one or a few).
REPLAYS = 4


class Replays:
    """A meter's :class:`AdamReplay` per optimizer (by ``id``; dropped with the optimizer),
    prepared from the compiled calls :class:`~gradwatch.norms.fused_updates.FusedUpdates`
    recorded in ``ran`` while the meter measured a step batch by batch."""

    def __init__(self, fused: FusedUpdates) -> None:
        self._fused = fused
        self._by_id: dict[int, AdamReplay] = {}

    def run(self, optimizer: Any, updates: Tensor) -> frozenset[int] | None:
        """``optimizer``'s step measured by its replay (the positions it wrote), or None: no
        replay, or it no longer holds (then dropped)."""
        key = id(optimizer)
        replay = self._by_id.get(key)
        if replay is None:
            return None
        if not replay.run(optimizer, updates):
            self._drop(key)
            return None
        self._fused.calls += replay.batches
        return replay.positions

    def record(self, optimizer: Any, params: Sequence[Tensor],
               batches: Sequence[tuple[dict[str, Any], Tensor, bool]],
               positions: Sequence[int]) -> None:
        """Prepare ``optimizer``'s replay from the step just measured: ``params`` the watched
        parameters it holds, per batch ``(group, owners index, each owner one view)``,
        ``positions`` the pieces the batches wrote; nothing when some batch did not run a
        compiled kernel. Clears ``ran``."""
        ran, self._fused.ran = self._fused.ran, []
        if not batches or len(ran) != len(batches) or len(self._by_id) >= REPLAYS:
            return
        key = id(optimizer)
        self._drop(key)
        calls = [(kernel, group, args, owners, unique)
                 for (kernel, args), (group, owners, unique) in zip(ran, batches, strict=True)]
        self._by_id[key] = AdamReplay(optimizer, params, calls, positions,
                                      lambda: self._drop(key))

    def _drop(self, key: int) -> None:
        replay = self._by_id.pop(key, None)
        if replay is not None:
            replay.close()

    def clear(self) -> None:
        for key in list(self._by_id):
            self._drop(key)
