"""The optimizer's stepped parameters in batches, for :mod:`gradwatch.norms.updates`.

After an optimizer step, the parameters it stepped (with a gradient; Adam: with state) and the
state tensors the step's inversion reads, grouped by optimizer parameter group, device and
dtype, in batches of at most :data:`BATCH` elements as flat views (no copy): what the update
meter's eager passes and its compiled kernels (:mod:`gradwatch.norms.fused_updates`) read.

Sync behaviour: none (views and Python lists; no op reads a value).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

#: Elements of one batch of the hook's foreach ops: bounds its temporaries (at most three of
#: this size, in the parameters' dtype: 12 MiB for float32), and is large enough that a small
#: model is one batch (each batch costs a dozen small ops besides its passes).
BATCH = 1 << 20


def local_part(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise): no copy, no dispatched op
    (the callers run under ``torch.no_grad``, so nothing they compute records a graph)."""
    return getattr(t, "_local_tensor", t)


def flat_views(t: Tensor, size: int = BATCH) -> list[Tensor]:
    """``t``'s elements as flat views of at most ``size`` (``t`` itself when it holds at most
    ``size`` elements, no op dispatched, or has no flat view: not contiguous)."""
    if t.numel() <= size or not t.is_contiguous():
        return [t]
    return list(t.view(-1).split(size))


class Kind:
    """The optimizers whose step this module inverts."""

    SGD = "sgd"
    ADAM = "adam"


class Batch:
    """Views of stepped parameters of one optimizer parameter group (one device and dtype),
    at most :data:`BATCH` elements in all unless one tensor alone is larger than that: the
    parameters' views, the same views of the state tensors the inversion reads, and the
    owner (local position) and step count of each view."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.owners: list[int] = []
        self.tensors: dict[str, list[Tensor]] = {}
        self.steps: list[Tensor] = []
        self.numel = 0

    def add(self, position: int, param: Tensor, state: dict[str, Tensor],
            step: Tensor | None) -> None:
        views = flat_views(param)
        split = {name: flat_views(t) for name, t in state.items()}
        if any(len(v) != len(views) for v in split.values()):  # a non-contiguous state
            views, split = [param], {name: [t] for name, t in state.items()}
        self.params += views
        self.owners += [position] * len(views)
        for name, vs in split.items():
            self.tensors.setdefault(name, []).extend(vs)
        if step is not None:
            self.steps += [step] * len(views)
        self.numel += param.numel()


def stepped_batches(
    kind: str, optimizer: Any, held: list[tuple[dict[str, Any], Tensor, int]]
) -> list[tuple[dict[str, Any], Batch]]:
    """The stepped parameters (a gradient, and Adam's state) grouped by optimizer parameter
    group, device and dtype, in batches of at most :data:`BATCH` elements."""
    out: list[tuple[dict[str, Any], Batch]] = []
    open_: dict[tuple[int, torch.device, torch.dtype], Batch] = {}
    for group, param, position in held:
        if param.grad is None:  # the optimizer left it alone this step
            continue
        state = optimizer.state.get(param, {})
        here = local_part(param)
        if kind == Kind.ADAM:
            if not state:
                continue
            v = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
            reads = {"m": local_part(state["exp_avg"]), "v": local_part(state[v])}
            step = state["step"]
        else:
            reads = {"g": local_part(param.grad)}
            if state.get("momentum_buffer") is not None:
                reads["buf"] = local_part(state["momentum_buffer"])
            step = None
        key = (id(group), here.device, here.dtype)
        batch = open_.get(key)
        if batch is None or (batch.numel and batch.numel + here.numel() > BATCH):
            batch = open_[key] = Batch()
            out.append((group, batch))
        batch.add(position, here, reads, step)
    return out


def fragment_batches(
    kind: str, optimizer: Any, parts: list[tuple[dict[str, Any], Tensor, tuple[int, int, int]]]
) -> list[tuple[dict[str, Any], Batch]]:
    """:func:`stepped_batches` for fragments of flat partitions (DeepSpeed ZeRO 1-3): each piece's
    slice of the partition, of its gradient and of its optimizer state."""
    out: list[tuple[dict[str, Any], Batch]] = []
    open_: dict[int, Batch] = {}
    for group, flat, (position, start, numel) in parts:
        state = optimizer.state.get(flat, {})
        if kind == Kind.ADAM:
            if not state:
                continue
            v = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
            reads = {"m": state["exp_avg"], "v": state[v]}
            step = state["step"]
        else:
            if flat.grad is None:
                continue
            reads = {"g": flat.grad}
            if state.get("momentum_buffer") is not None:
                reads["buf"] = state["momentum_buffer"]
            step = None
        batch = open_.get(id(flat))
        if batch is None or (batch.numel and batch.numel + numel > BATCH):
            batch = open_[id(flat)] = Batch()
            out.append((group, batch))
        batch.add(position, flat.narrow(0, start, numel),
                  {k: t.narrow(0, start, numel) for k, t in reads.items()}, step)
    return out
