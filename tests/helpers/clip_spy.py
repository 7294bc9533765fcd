"""The clip coefficients gradwatch multiplies the gradients by, as the tensors themselves (tests
only): every rank records what it applied, so a test compares the applied factors bit for bit
across ranks, not a recomputation of them."""

from __future__ import annotations

from typing import Any

import torch


class CoefficientSpy:
    """Within ``with``: every coefficient :func:`gradwatch.step.clip.clip_coefficient_device`
    returns (the one :func:`gradwatch.step.clip.scale_grads_` multiplies by) goes to
    :attr:`coefs`, in call order."""

    def __init__(self) -> None:
        self.coefs: list[torch.Tensor] = []

    def __enter__(self) -> CoefficientSpy:
        from gradwatch.step import clip

        self._clip, self._real = clip, clip.clip_coefficient_device

        def spy(*args: Any) -> torch.Tensor:
            coef = self._real(*args)
            self.coefs.append(coef)
            return coef

        clip.clip_coefficient_device = spy
        return self

    def __exit__(self, *exc: object) -> None:
        self._clip.clip_coefficient_device = self._real

    def hex(self) -> list[str]:
        """The recorded coefficients as exact float hex strings."""
        return [float(c).hex() for c in self.coefs]
