"""Whether the gradients of this step still have the layout a cached norm plan was built for.

A :class:`~gradwatch.norms.stats.NormPlan` is valid while every gradient keeps its presence,
dtype, shape, device and strides: the paths that read memory in place (row views, compiled
kernels traced without guards) read the wrong memory otherwise. Checking that in Python costs
about a microsecond per gradient per step (a tuple of dtype and shape, the strides, the device):
the largest per-parameter cost of a collect. :class:`LayoutGuard` checks all of it in one C++
call, by the same tensor checks ``torch.compile``'s guards run (``TensorGuards``: type,
dispatch keys (so device, and no autograd zero tensor), dtype, requires_grad, sizes, strides),
about 40 ns per gradient.

When it holds, the plan is verified for this step and the in-place paths skip their own checks.
When it does not (a layout change; a ``TorchDispatchMode`` entered or left since the plan was
built: the mode's dispatch key is part of what is checked; a torch without that class), the
caller falls back to the Python key
(:func:`layout_key`) and the in-place paths check strides and devices as they read: slower,
never wrong. Sync behaviour: none (metadata only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor


def layout_key(tensors: Sequence[Tensor | None]) -> list:
    """What a plan depends on, read from every tensor: presence, dtype, shape. Devices and
    strides matter only where memory is read in place (row path, compiled kernels): those
    few are checked as they are read (:class:`~gradwatch.norms.rows.StalePlan`). Packed and
    whole-path tensors are normed right whatever their strides, or raise, which replans."""
    return [None if t is None else (t.dtype, t.shape) for t in tensors]


class LayoutGuard:
    """The layout of one list of tensors (None entries allowed), checked in one call.

    Built by :meth:`of` from the tensors a plan was built for; :meth:`holds` is True only when
    every entry is None where it was and otherwise a tensor of the same type, dispatch keys,
    dtype, requires_grad, sizes and strides (storage offsets may differ: every in-place path
    starts at the tensor's own data)."""

    __slots__ = ("_absent", "_checks", "_n", "_present")

    def __init__(self, checks: Any, n: int, present: list[int], absent: list[int]) -> None:
        self._checks = checks
        self._n = n
        self._present = present
        self._absent = absent

    @classmethod
    def of(cls, tensors: Sequence[Tensor | None]) -> LayoutGuard | None:
        """The guard of ``tensors``; None where it cannot be built (this torch has no
        ``TensorGuards``) or does not hold for the very tensors it was built from. A guard
        built under a dispatch mode holds under that mode only."""
        present = [i for i, t in enumerate(tensors) if t is not None]
        items: list[Tensor] = [tensors[i] for i in present]  # type: ignore[misc]
        try:
            from torch._C._dynamo.guards import TensorGuards

            checks = TensorGuards(*items, dynamic_dims_sizes=[list(t.size()) for t in items],
                                  dynamic_dims_strides=[list(t.stride()) for t in items])
            if not checks.check(*items):
                return None
        except (ImportError, TypeError, RuntimeError):  # a private API: else the Python key
            return None
        absent = [i for i, t in enumerate(tensors) if t is None]
        return cls(checks, len(tensors), present, absent)

    def holds(self, tensors: Sequence[Tensor | None]) -> bool:
        """Do ``tensors`` have this guard's layout? One C++ call over the present entries
        (and a Python check of the absent ones, if any)."""
        if len(tensors) != self._n:
            return False
        if self._absent:
            if any(tensors[i] is not None for i in self._absent):
                return False
            return bool(self._checks.check(*[tensors[i] for i in self._present]))
        return bool(self._checks.check(*tensors))
