"""This rank's working time per step, on the host clock: the measurement of
:mod:`gradwatch.reduce.ranktiming` (what a step's working time is, how the all-reduce carries it).

The clock starts at the end of each ``collect`` and stops at the rank's *arrival*: the last
gradient accumulated in this step's backward (a ``post_accumulate_grad`` hook per plain leaf
parameter; under FSDP2 per unsharded parameter, whose gradient autograd accumulates before
FSDP2's reduce-scatter). Without such a hook (FSDP1's flat shards, DeepSpeed's partitions) the
arrival is the next ``collect``. Hooks store a ``time.perf_counter()`` reading: no device op,
no host read, no synchronization. GPU note (untested, no GPU here): the host clock measures
when the host *queued* the backward; on an accelerator the arrival is when the host reaches
the hook, which under a host that runs ahead is earlier than the device's work (see
docs/gpu.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


class RankTimer:
    """This rank's working time per step (see the module docstring); training thread only.

    :meth:`start` at the end of each collect, :meth:`take` at the next collect's pack. The
    arrival hooks (one ``post_accumulate_grad`` hook per plain leaf parameter, and under FSDP2
    per unsharded parameter, whose gradient autograd accumulates before FSDP2's
    reduce-scatter) store a host timestamp: no device op, no host read.
    """

    def __init__(self, params: Sequence[Any], model: Any = None) -> None:
        self._started: float | None = None
        self._arrived: float | None = None
        self._handles = [
            p.register_post_accumulate_grad_hook(self._arrive)
            for p in params
            if getattr(p, "is_leaf", False) and p.requires_grad
            and not hasattr(p, "_local_tensor")
        ]
        self._fsdp2 = fsdp2_params(model) if model is not None else []
        self._hooked: set[int] = set()

    def _hook_unsharded(self) -> None:
        """Hook the FSDP2 unsharded parameters that exist by now (FSDP2 creates each at its
        first all-gather and reuses it for the rest of the run)."""
        for fsdp_param in self._fsdp2:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and id(fsdp_param) not in self._hooked:
                self._hooked.add(id(fsdp_param))
                self._handles.append(unsharded.register_post_accumulate_grad_hook(self._arrive))
        if len(self._hooked) == len(self._fsdp2):
            self._fsdp2 = []

    def _arrive(self, _param: Any) -> None:
        self._arrived = time.perf_counter()

    def start(self) -> None:
        """The step's work starts now (the end of a collect)."""
        if self._fsdp2:
            self._hook_unsharded()
        self._started = time.perf_counter()
        self._arrived = None

    def take(self) -> float | None:
        """The working time since :meth:`start` (None before the first): up to the last
        gradient hook of this step, else up to now."""
        if self._started is None:
            return None
        end = self._arrived if self._arrived is not None else time.perf_counter()
        return max(end - self._started, 0.0)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def close_timer(timer: RankTimer | None) -> None:
    """Remove ``timer``'s hooks (nothing without one)."""
    if timer is not None:
        timer.close()


def fsdp2_params(model: Any) -> list[Any]:
    """The FSDP2 parameter records (``FSDPParam``) of ``model``'s ``fully_shard`` modules;
    empty without FSDP2. Reads FSDP2's private state (``_get_fsdp_state``), guarded: an
    unknown layout gives no records (the arrival is then the collect)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out: list[Any] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            group = module._get_fsdp_state()._fsdp_param_group
        except AttributeError:
            return []
        if group is not None:
            out.extend(getattr(group, "fsdp_params", ()))
    return out
