"""Reading this rank's gradients, every collect, as the real strided tensors the norms need.

:class:`GradientReader` is built once from the resolved parameters (which of them are DTensors
or complex is known from the parameters); :meth:`GradientReader.read` returns one
:class:`LocalGradients` per collect, the explicit value that the norms and clipping of that
collect share. Per-parameter Python is kept to a few attribute reads: this runs on the training
thread every collected step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gradwatch.errors import UnsupportedParallelismError
from gradwatch.norms.stats import as_real_values
from gradwatch.records import fast_init


def main_grad_positions(params: Sequence[Tensor]) -> list[int]:
    """Positions of the plain parameters holding a tensor ``main_grad`` (read in place of
    ``.grad``): Megatron-Core's DDP and NeMo keep gradients there
    (:mod:`gradwatch.stacks.main_grad`). DTensor parameters keep ``.grad``: no stack pairs them
    with ``main_grad``."""
    return [
        i
        for i, p in enumerate(params)
        if isinstance(getattr(p, "main_grad", None), Tensor) and not hasattr(p, "_local_tensor")
    ]


@fast_init
@dataclass(frozen=True)
class LocalGradients:
    """This rank's gradients of one collect, one entry per local parameter.

    Attributes:
        tensors: real strided tensors whose L2 norms are the gradients' (None: no gradient, or
            frozen): local shards of DTensors, real views of complex gradients (sharing their
            storage), values of sparse gradients (possibly coalesced copies).
        sparse_positions: the positions whose ``tensors`` entry may be a copy (sparse).
        sparse_grads: the sparse gradients themselves (local tensors), in
            ``sparse_positions`` order: what clipping scales in place.
    """

    tensors: list[Tensor | None]
    sparse_positions: Sequence[int] = ()
    sparse_grads: Sequence[Tensor] = ()


class GradientReader:
    """Reads the ``.grad`` of fixed parameters into a :class:`LocalGradients`."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._params = list(params)
        #: positions of DTensor parameters (FSDP2, TP): their gradients are read as local shards
        self._dtensor_positions = [i for i, p in enumerate(params) if hasattr(p, "_local_tensor")]
        # A gradient has its parameter's dtype (autograd and the .grad setter enforce it), so
        # complex positions are known from the parameters.
        self._complex_positions = [i for i, p in enumerate(params) if p.is_complex()]
        #: positions whose gradient lives in ``param.main_grad`` (Megatron-Core, NeMo):
        #: :mod:`gradwatch.stacks.main_grad`
        self._main_grad_positions = main_grad_positions(params)

    def read(self) -> LocalGradients:
        """One list comprehension for all parameters; DTensor positions become their local
        shards; sparse and complex gradients (rare) become their values / real views.

        Raises :class:`UnsupportedParallelismError` for a DTensor gradient placed otherwise
        than its parameter (identical on every rank: all stop together).
        """
        params = self._params
        grads = [p.grad if p.requires_grad else None for p in params]
        for i in self._main_grad_positions:
            if params[i].requires_grad:
                grads[i] = params[i].main_grad
        for i in self._dtensor_positions:
            g = grads[i]
            if g is None:
                continue
            p = params[i]
            if g.placements != p.placements:
                # The layout (who counts which piece) was agreed from the parameter's
                # placements; a gradient placed otherwise (e.g. Partial) cannot be counted
                # exactly without a collective.
                raise UnsupportedParallelismError(
                    f"gradwatch: a gradient has placements {g.placements} but its parameter "
                    f"{p.placements}; gradwatch measures gradients placed like their "
                    "parameters (FSDP2, parallelize_module) only"
                )
            grads[i] = g._local_tensor
        strided = torch.strided
        sparse = [i for i, g in enumerate(grads) if g is not None and g.layout is not strided]
        sparse_grads: list[Tensor] = [grads[i] for i in sparse]  # type: ignore[misc]
        if sparse or self._complex_positions:  # rare: a sorted set only then
            for i in sorted({*sparse, *self._complex_positions}):
                g = grads[i]
                if g is not None:
                    grads[i] = as_real_values(g)
        return LocalGradients(grads, sparse, sparse_grads)
