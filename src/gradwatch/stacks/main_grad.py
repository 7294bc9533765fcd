"""Gradients kept in ``param.main_grad`` (Megatron-Core's DDP, NeMo) instead of ``param.grad``.

Megatron-Core's ``DistributedDataParallel`` allocates one contiguous gradient buffer per
dtype (``_ParamAndGradBuffer.grad_data``, float32 with ``grad_reduce_in_fp32``) and sets each
parameter's ``main_grad`` to a view of its slice; a backward hook adds ``param.grad`` into
``param.main_grad`` and sets ``param.grad = None``; ``finish_grad_sync()`` scales the buffer by
``1 / data-parallel size`` and all-reduces it (sum). Its optimizer then steps on
``main_grad``. So ``.grad`` is ``None`` exactly when the gradient is what the optimizer will
use, and reading ``.grad`` would measure nothing.

**Detection, not a switch**: a plain (non-DTensor) parameter that has a tensor ``main_grad``
attribute when :class:`~gradwatch.GradWatch` is constructed is read through ``main_grad`` on
every collect (``.grad`` is ignored for it; the reader finds them:
:func:`gradwatch.norms.gradients.main_grad_positions`); clipping scales ``main_grad`` in place,
the tensor the optimizer reads. Construct GradWatch after the Megatron-Core DDP wrapper (it sets
``main_grad``). A rank whose parameters have no ``main_grad`` reads ``.grad`` as always.

**Refused**: Megatron-Core's DDP with ``use_distributed_optimizer=True``. Its reduce-scatter
leaves the reduced gradient only in this rank's shard of each bucket; the rest of the buffer
keeps this rank's own unreduced gradient, so ``main_grad`` views mix reduced and local values
and no per-parameter read of them is the optimizer's gradient
(:func:`reject_distributed_optimizer`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gradwatch.errors import UnsupportedParallelismError


def reject_distributed_optimizer(model: nn.Module) -> None:
    """Raise :class:`UnsupportedParallelismError` when ``model`` holds a Megatron-Core DDP
    configured for the distributed optimizer (recognized by its ``ddp_config``)."""
    for module in model.modules():
        ddp_config = getattr(module, "ddp_config", None)
        if ddp_config is not None and getattr(ddp_config, "use_distributed_optimizer", False):
            raise UnsupportedParallelismError(
                "gradwatch: Megatron-Core DistributedDataParallel with "
                "use_distributed_optimizer=True is not supported: its reduce-scatter leaves the "
                "reduced gradient only in this rank's shard of each grad buffer, so param."
                "main_grad mixes reduced and local values. Use use_distributed_optimizer=False "
                "(all-reduced main_grad, measured exactly), or audit Megatron's own gradient "
                "norm with GradWatch.audit_norm"
            )


def gradients_for_fallback(params: Sequence[Tensor]) -> list[Tensor]:
    """The gradient each parameter's optimizer uses: ``main_grad`` where present, else
    ``.grad`` (None dropped). For the rank-local fallback clip only, never the hot path."""
    out: list[Tensor] = []
    for p in params:
        g = getattr(p, "main_grad", None)
        if not isinstance(g, Tensor) or hasattr(p, "_local_tensor"):
            g = p.grad
        if g is not None:
            out.append(g)
    return out


def clip_local_(
    grads: Sequence[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradient tensors rather than parameters (the
    rank-local fallback of :meth:`GradWatch.clip_grad_norm_` when some gradients live in
    ``main_grad``): ``get_total_norm``, then ``_foreach_mul_`` by ``clamp(max_norm / (total
    + 1e-6), max=1)`` per (device, dtype). Returns the total as a float64 tensor."""
    grads = list(grads)
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), tensors in by_kind.items():
        torch._foreach_mul_(tensors, coef.to(device, dtype))
    return total.to(torch.float64)
