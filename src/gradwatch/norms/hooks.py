"""Running a callback before every optimizer step (``GradWatch.attach``).

Without an AMP scaler, a step pre-hook on the optimizer. With an enabled scaler, its ``step`` is
wrapped instead, so steps the scaler skips (Inf/NaN gradients: ``optimizer.step`` never runs)
are seen too. Either way the caller gets a handle whose ``remove()`` undoes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Removable(Protocol):
    def remove(self) -> None: ...


def before_optimizer_step(
    optimizer: Any, scaler: Any, callback: Callable[[Any, Any], None]
) -> Removable:
    """Call ``callback(scaler or None, optimizer)`` before every step of ``optimizer``."""
    if scaler is not None and scaler.is_enabled():
        original = scaler.step

        def step_and_collect(opt: Any, *args: Any, **kwargs: Any) -> Any:
            if opt is optimizer:
                callback(scaler, optimizer)
            return original(opt, *args, **kwargs)

        scaler.step = step_and_collect
        return _Restore(scaler, "step")

    def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:
        callback(None, optimizer)

    return optimizer.register_step_pre_hook(pre_hook)


class _Restore:
    """Undo an instance attribute override (the wrapped ``scaler.step``)."""

    def __init__(self, obj: Any, attr: str) -> None:
        self.obj, self.attr = obj, attr

    def remove(self) -> None:
        self.obj.__dict__.pop(self.attr, None)
