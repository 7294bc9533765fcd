"""AMP GradScaler awareness: see gradients as unscaled, without a host sync.

``torch.amp.GradScaler`` multiplies the loss by a scale (~65536) so fp16 gradients do not
underflow; until ``scaler.unscale_(optimizer)`` (explicit, or inside ``scaler.step``) the
gradients are multiplied by it. gradwatch divides squared norms by ``scale**2`` on the device
(the scale is a device tensor: no sync), unless the optimizer's gradients were already
unscaled, so a user who calls ``scaler.unscale_`` before clipping is not unscaled twice.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def pending_scale(scaler: Any, optimizer: Any = None) -> Tensor | None:
    """The scale still applied to the gradients, as a device tensor, or None if there is none.

    ``optimizer``: the optimizer whose gradients are watched; when None, gradients count as
    unscaled if any optimizer of the scaler was unscaled this iteration.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    if scale is None:  # scaler.scale() never ran: nothing was scaled
        return None
    states = getattr(scaler, "_per_optimizer_states", {})
    try:
        from torch.amp.grad_scaler import OptState
    except ImportError:  # pragma: no cover - older torch
        from torch.cuda.amp.grad_scaler import OptState  # type: ignore[no-redef]
    if optimizer is not None:
        stages = [states[id(optimizer)]["stage"]] if id(optimizer) in states else []
    else:
        stages = [s["stage"] for s in states.values()]
    if any(stage is not OptState.READY for stage in stages):
        return None  # unscale_ already divided the gradients in place
    return scale
