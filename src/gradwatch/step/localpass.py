"""This rank's pass of one collect and what acts on its reduced vector, on the training thread.

:func:`measure_local` reads this rank's gradients (:mod:`gradwatch.norms.gradients`) and norms
them by the engine (:mod:`gradwatch.norms.stats`), the loss scale divided out; :class:`Acting`
feeds the adaptive history, clips and lets the guard decide from the reduced vector, by device
ops only; :func:`measure_alone` and :func:`act_alone` repeat both on the one rank whose pass
failed where every rank holds the reduced gradients (pure replication), so its clip and decision
equal the others' bit for bit. The :class:`~gradwatch.step.collector.Collector` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.analysis.reporter import Reporter
from gradwatch.norms.amp import pending_scale
from gradwatch.norms.gradients import LocalGradients
from gradwatch.norms.stats import NormEngine, NormPlan
from gradwatch.norms.updates import Section
from gradwatch.records import fast_init
from gradwatch.reduce.reduced import ReducedVector
from gradwatch.step.adaptive import AUTO, AdaptiveHistory, AdaptiveStep
from gradwatch.step.clip import clip_grads_, scale_grads_, whole_norm
from gradwatch.step.failures import Replaced
from gradwatch.step.guard import GuardDecision, StepGuard
from gradwatch.step.resolve import Resolved


def update_section(r: Resolved, measure: bool) -> Section | None:
    """This collect's update section (``update_stats``; None when off): every piece counts on
    a rank that does not all-reduce (:meth:`gradwatch.reduce.packing.Reducer.issues_collective`
    with ``measure``, the divergence step), else the pieces it contributes."""
    if r.updates is None:
        return None
    return r.updates.figures(count_all=not r.reducer.issues_collective(measure))


def measure_local(
    r: Resolved, engine: NormEngine, scaler: Any, optimizer: Any
) -> tuple[LocalGradients, Tensor, NormPlan, Tensor | float | None]:
    """This rank's gradients, their banded float64 squared norms (loss scale divided out) and
    the plan that normed them, by ``engine``; and the loss scale (None: none): a float64
    tensor on the gradients' device (a GradScaler's), or DeepSpeed's Python float. The
    reducer's device follows the gradients (decided at the first collect, again whenever they
    move): O(buckets), one (device, dtype) each."""
    grads = r.gradients.read()
    sq, plan = engine.squared_norms_and_plan(grads.tensors, r.reducer.device)
    if plan is not None and r.reducer.follow(accelerator_of(plan)):
        sq, plan = engine.squared_norms_and_plan(grads.tensors, r.reducer.device)
    scale64: Tensor | float | None
    if r.zero is None:
        scale = pending_scale(scaler, optimizer)
        scale64 = None if scale is None else scale.to(sq.device, torch.float64)
    else:
        # DeepSpeed's fp16 loss scale is a Python float: divided as a kernel argument, no
        # tensor is built from it and nothing is copied to the device.
        scale64 = r.zero.loss_scale()
    if scale64 is not None:
        sq = sq / (scale64 * scale64)
    return grads, sq, plan, scale64


def measure_alone(
    r: Resolved, step: int, scaler: Any, optimizer: Any, with_replicas: bool = False
) -> tuple[LocalGradients, NormPlan, ReducedVector]:
    """Measure this rank's pass again, by a fresh engine, with the very arithmetic the other
    ranks used (plan, packing, float64 band combine), where every rank holds the reduced
    gradients (pure replication): the gradients, their plan and the reduced vector, equal to
    the other ranks' bit for bit. A guarded collect all-reduces it (``with_replicas`` as the
    others' collect) in place of the failed pass's stand-in; others issue nothing.
    Raises what the pass raises (:class:`~gradwatch.step.failures.Replaced` for a replaced
    parameter)."""
    replaced = r.slots.first_replaced()
    if replaced is not None:
        raise Replaced(replaced)
    grads, sq, plan, _ = measure_local(r, NormEngine(), scaler, optimizer)
    has_grad = [g is not None for g in grads.tensors]
    return grads, plan, r.reducer.pack_and_reduce(sq, has_grad, step, with_replicas=with_replicas)


@fast_init
@dataclass(frozen=True)
class Acted:
    """What a collect did with its reduced vector: the clip's returned norm (None: no clip),
    the whole-model norm (None: not needed), the adaptive history's figures of the step and
    the guard's decision (None: none)."""

    total: Tensor | None = None
    norm: Tensor | None = None
    adaptive: AdaptiveStep | None = None
    decision: GuardDecision | None = None


@fast_init
@dataclass(frozen=True)
class Acting:
    """What acts on a reduced vector: the guard and the adaptive history (each optional);
    ``with_norm``: the whole-model norm is wanted anyway (rank 0's incident file)."""

    guard: StepGuard | None
    history: AdaptiveHistory | None
    with_norm: bool = False

    def act(
        self, reduced: ReducedVector, max_norm: float | str | None, grads: LocalGradients,
        plan: NormPlan,
    ) -> Acted:
        """Feed the history, clip (to ``max_norm`` or, for ``"auto"``, to the history's
        threshold) and decide, in that order, from ``reduced``; device ops only."""
        norm = adaptive = total = None
        if self.history is not None or self.with_norm or max_norm == AUTO:
            norm, unmeasured = whole_norm(reduced)
            if self.history is not None:
                adaptive = self.history.observe(norm)
            if max_norm is not None:
                limit = adaptive.limit if max_norm == AUTO and adaptive else max_norm
                scale_grads_(norm, unmeasured, limit, grads, plan)
                total = norm
        elif max_norm is not None:
            total = clip_grads_(reduced, float(max_norm), grads, plan)
        guard, decision = self.guard, None
        if guard is not None:
            decision = guard.decide(reduced) if adaptive is None else guard.decide(
                reduced, adaptive.score, adaptive.finite
            )
        return Acted(total, norm, adaptive, decision)


def act_alone(
    r: Resolved,
    reporter: Reporter,
    step: int,
    scaler: Any,
    optimizer: Any,
    max_norm: float | str | None,
    acting: Acting,
    with_replicas: bool = False,
) -> tuple[Tensor | None, GuardDecision | None]:
    """The clip (to ``max_norm``, when given) and the decision of ``acting`` (the guard and
    the adaptive history, each when given) of a rank whose pass failed alone under pure
    replication, from one measurement again (:func:`measure_alone`) taken before the clip, as
    the other ranks' pass takes it: its norm, its clipped gradients, its decision, the guard's
    spike window and the adaptive history equal theirs bit for bit.
    ``(None, None)`` when that fails too: torch's rank-local clip, and the step applied
    unguarded with no sample in the window (logged once; docs/distributed.md)."""
    try:
        grads, plan, alone = measure_alone(r, step, scaler, optimizer, with_replicas)
        acted = acting.act(alone, max_norm, grads, plan)
        return acted.total, acted.decision
    except Exception as exc:  # never-crash boundary: torch's clip takes over, logged
        reporter.log_once(
            "act-alone", "gradwatch: step %d: the replicated clip and guard decision could not "
            "be measured again (%s: %s); torch's rank-local clip takes over and the optimizer "
            "step is applied unguarded", step, type(exc).__name__, exc,
        )
        return None, None


def square_on(scale: Tensor | float, device: torch.device) -> Tensor | float:
    """``scale**2`` where it divides a tensor on ``device``: a Python float as is (a kernel
    argument), a tensor moved there."""
    square = scale * scale
    return square if isinstance(square, float) else square.to(device)


def accelerator_of(plan: NormPlan) -> torch.device | None:
    """The first accelerator among the plan's buckets (None: every gradient on the CPU)."""
    for bucket in plan.buckets:
        if bucket.device.type not in ("cpu", "meta"):
            return bucket.device
    return None
