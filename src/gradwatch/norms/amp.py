"""AMP GradScaler awareness: see gradients as unscaled, without a host sync.

``torch.amp.GradScaler`` multiplies the loss by a scale (~65536) so fp16 gradients do not
underflow; until ``scaler.unscale_(optimizer)`` (explicit, or inside ``scaler.step``) the
gradients are multiplied by it. gradwatch divides squared norms by ``scale**2`` on the device
(the scale is a device tensor: no sync), unless the optimizer's gradients were already
unscaled, so a user who calls ``scaler.unscale_`` before clipping is not unscaled twice.

After ``scaler.update()`` the gradients are unscaled too, but the scaler's per-optimizer state
is reset exactly as at the start of an iteration, so its state cannot tell the two apart (a
collect there would divide unscaled gradients by the new scale squared). The first time
gradwatch sees a scaler it therefore wraps the instance's ``update`` and ``scale`` (instance
attributes, like the ``step`` wrapper of :mod:`gradwatch.norms.hooks`): from ``update()`` to the
next ``scale()`` the gradients count as unscaled. A collect between the very first ``update()`` and
the first ``scale()`` after it, before gradwatch ever saw the scaler, is not recognized.
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
    track_updates(scaler)
    if scaler.__dict__.get(_UNSCALED, False):
        return None  # update() ran and no scale() since: these gradients were unscaled
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


_UNSCALED = "_gradwatch_unscaled"  # instance flag: update() ran, no scale() since


def track_updates(scaler: Any) -> None:
    """Wrap ``scaler.update`` and ``scaler.scale`` once (idempotent) to maintain the flag
    :func:`pending_scale` reads. ``state_dict()`` is unaffected (it reads named fields)."""
    if "_gradwatch_tracked" in scaler.__dict__:
        return
    update, scale = scaler.update, scaler.scale

    def update_and_mark(*args: Any, **kwargs: Any) -> Any:
        out = update(*args, **kwargs)
        scaler.__dict__[_UNSCALED] = True
        return out

    def scale_and_mark(*args: Any, **kwargs: Any) -> Any:
        scaler.__dict__[_UNSCALED] = False
        return scale(*args, **kwargs)

    scaler.update = update_and_mark
    scaler.scale = scale_and_mark
    scaler.__dict__["_gradwatch_tracked"] = True
