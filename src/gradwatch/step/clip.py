"""Clipping by the whole-model norm, from the reduced statistics of the same collect.

``GradWatch.clip_grad_norm_`` clips with the total norm carried by the collect's all-reduce, so
the norm is the whole model's under DDP, FSDP2, TP and pipeline stages (where
``torch.nn.utils.clip_grad_norm_`` returns a rank-local one), at no extra collective. Everything
a clip needs is passed in: the :class:`~gradwatch.reduce.reduced.ReducedVector`, this collect's
:class:`~gradwatch.norms.gradients.LocalGradients` and the
:class:`~gradwatch.norms.stats.NormPlan` that normed them. Device side only: no host read (the
host's figure of the same coefficient: :func:`gradwatch.snapshot.clip_coefficient`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gradwatch.norms.bands import BANDS, banded_total_device
from gradwatch.norms.gradients import LocalGradients
from gradwatch.norms.stats import NormPlan
from gradwatch.reduce.reduced import ReducedVector
from gradwatch.snapshot import CLIP_EPS


def clip_grads_(
    reduced: ReducedVector, max_norm: float, grads: LocalGradients, plan: NormPlan
) -> Tensor:
    """Multiply every local gradient by ``clamp(max_norm / (total + 1e-6), max=1)``, in place;
    return ``total``, the whole-model L2 norm, a 0-dim float64 tensor on the reduce device.

    ``grads`` and ``plan``: this collect's gradients as read for the norms, and the plan that
    normed them (its buckets group them by (device, dtype), one ``_foreach_mul_`` each). Sparse
    gradients are scaled themselves (their values may be a coalesced copy). A replica that
    flagged NaN/Inf makes the total NaN, so every rank clips identically. Still-scaled (AMP)
    gradients clip correctly too: the coefficient is scale-free.

    A collect some rank stood in for (its local pass failed: :meth:`ReducedVector.
    device_unmeasured`) holds no norm: every rank, the failed one included (see
    :func:`unmeasured_total`), leaves its gradients as they are (coefficient 1) and returns
    NaN, decided on the device from the same reduced vector, so no two ranks clip differently.
    """
    total, unmeasured = whole_norm(reduced)
    scale_grads_(total, unmeasured, max_norm, grads, plan)
    return total


def whole_norm(reduced: ReducedVector) -> tuple[Tensor, Tensor]:
    """``(total, unmeasured)`` of a reduced vector, on its device: the whole-model L2 norm
    (0-dim float64; NaN when some replica flagged NaN/Inf or some rank stood in) and whether
    some rank stood in (0-dim bool). Device ops only."""
    bands = reduced.device_bands()
    total = banded_total_device(bands, bands.numel() // BANDS)
    unmeasured = reduced.device_unmeasured()
    total = total.masked_fill((reduced.device_nonfinite().sum() > 0) | unmeasured, math.nan)
    return total, unmeasured


def scale_grads_(
    total: Tensor,
    unmeasured: Tensor,
    max_norm: float | Tensor,
    grads: LocalGradients,
    plan: NormPlan,
) -> None:
    """Multiply the local gradients by ``clamp(max_norm / (total + 1e-6), max=1)`` (1 where
    ``unmeasured``), in place, one ``_foreach_mul_`` per bucket; ``max_norm`` a float or a
    0-dim tensor on ``total``'s device (the adaptive threshold, ``+inf``: coefficient 1 for a
    finite norm). No host read."""
    coef = clip_coefficient_device(total, unmeasured, max_norm)
    sparse = grads.sparse_positions
    for g in grads.sparse_grads:
        g.mul_(coef.to(g.device, g.dtype))  # sparse: values scaled in place
    tensors = grads.tensors
    skip = {id(tensors[i]) for i in sparse} if sparse else None
    for bucket in plan.buckets:
        bucket_tensors = [tensors[i] for i in bucket.positions]
        if skip:
            bucket_tensors = [t for t in bucket_tensors if id(t) not in skip]
        if bucket_tensors:
            torch._foreach_mul_(bucket_tensors, coef.to(bucket.device, bucket.dtype))


def clip_coefficient_device(
    total: Tensor, unmeasured: Tensor, max_norm: float | Tensor
) -> Tensor:
    """The factor :func:`scale_grads_` multiplies the gradients by: ``clamp(max_norm / (total
    + 1e-6), max=1)``, 1 where ``unmeasured`` (0-dim float64 on ``total``'s device). An
    elementwise function of tensors every rank holds bitwise equal, so every rank's factor is
    the same bits. Device ops only."""
    return torch.where(unmeasured, 1.0, torch.clamp(max_norm / (total + CLIP_EPS), max=1.0))


def unmeasured_total(device: torch.device) -> Tensor:
    """What a rank whose local pass failed returns from its clip, having stood in for its
    all-reduce: NaN, gradients untouched, as every other rank decides from the same vector
    (:func:`clip_grads_`). A fill on the device: no copy."""
    return torch.full((), torch.nan, dtype=torch.float64, device=device)
