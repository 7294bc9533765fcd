"""This rank's gradient statistics *before* the data-parallel reduction, from a DDP comm hook.

Under DDP every figure computed after the all-reduce is the replicas' average: one rank's NaN
is every rank's NaN, and a rank whose gradient is far from the others' disappears in the mean.
DDP hands each gradient bucket to a communication hook before it reduces it; there, this
module measures the rank's own (accumulated, with ``no_sync()``) gradient, then performs the
reduction DDP would have done (``allreduce_hook``'s: divide by the group size, all-reduce,
SUM, issued through the process group's own method) or the user's own hook
(:func:`ddp_comm_hook` with ``inner=``).

**The math, per bucket** (:class:`_BucketPlan`, built once per bucket layout and found again
by the bucket's flat buffer, so a steady step asks DDP for neither the parameter list nor the
gradient views, which cost two view ops per parameter), with the norm engine's parts: on CPU, a
float32 bucket's flat buffer is read in place as rows of 512 elements normed in float32 and
summed per group (:class:`gradwatch.norms.rows.FlatRows`, the core engine's row path: relative error
below 5e-7); the few rows straddling two groups and the partial last row are read element by
element. Elsewhere the engine's :func:`gradwatch.norms.stats.foreach_norms` (float64 accumulation),
squared and added per group. A constant number of dispatched ops per bucket whatever the number
of its parameters, no gradient-sized temporary, no host read. A NaN/Inf gradient makes its
group's square NaN/Inf: the non-finite flags are the squares themselves. Limits (no repair
pass, no bands, unlike the core engine: both would read the host or cost a pass per bucket,
docs/design.md, "The comm hook's share"): float32 elements above about 1e19 make a row norm
overflow (Inf) and below about 1e-19 underflow; float64 gradients whose norm lies outside about
``[1e-154, 1e154]`` read 0 or Inf.

**Per backward.** Bucket 0 comes first in every backward (DDP launches buckets in index
order), so it resets the vector; the last bucket marks it complete. :meth:`LocalView.take`
hands a complete vector to ``collect()`` once; a collect that follows no hooked backward gets
None (the view is absent for that step, never a stale figure).

**Registration.** :func:`attach` registers gradwatch's hook on a DDP module that has none and
guards the module's ``register_comm_hook``: registering :func:`ddp_comm_hook` later composes the
user's hook with gradwatch's instead of failing in DDP (which allows one hook), any other hook
raises a :class:`~gradwatch.errors.GradWatchError` naming the wrapper. A module that already has
a user hook is left alone (warned about, naming the wrapper); a second live ``GradWatch`` on the
same module is refused.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gradwatch.errors import GradWatchError
from gradwatch.norms.rows import FlatRows, foreach_splits
from gradwatch.norms.stats import foreach_norms

log = logging.getLogger("gradwatch")

__all__ = ["LocalView", "attach", "ddp_comm_hook"]

#: The wrapper's name in every message.
WRAPPER = "gradwatch.ddp_comm_hook(watch, inner=your_hook)"

_UNSET = object()


class LocalView:
    """This rank's pre-reduction squared norms per group, filled by the hook bucket by bucket.

    ``group_of`` maps each watched parameter (by identity) to its group position in
    ``[0, groups)``. Thread-safety: the hook runs in backward (the autograd thread), ``take``
    on the training thread after backward returned.
    """

    def __init__(self, params: Sequence[Tensor], group_of: Sequence[int], groups: int) -> None:
        self.groups = groups
        self._group_of = {id(p): g for p, g in zip(params, group_of, strict=True)}
        self._plans: dict[int, _BucketPlan] = {}  # by bucket index
        self._acc: Tensor | None = None  # G group squares and one discard slot
        self._complete = False
        self._ok = True
        self._logged = False

    def observe(self, bucket: Any) -> None:
        """Add one bucket's local squared norms (before its reduction) to the group vector."""
        index = bucket.index()
        if index == 0:
            self._complete = False
            self._ok = True
        if not self._ok:
            return
        try:
            buffer = bucket.buffer()
            plan = self._plans.get(index)
            if plan is None or plan.source() is not buffer:
                # A new bucket layout (the first backward, or DDP rebuilt its buckets): the
                # only time the parameters are read; steady steps key on the buffer alone.
                grads = bucket.gradients()
                if not grads:
                    return
                if index == 0:  # a rebuild replaces every bucket: drop every old plan
                    self._plans.clear()
                groups = [self._group_of[id(p)] for p in bucket.parameters()]
                plan = self._plans[index] = _BucketPlan.build(buffer, grads, groups, self.groups)
            acc = self._acc
            if acc is None or acc.device != buffer.device:
                acc = self._acc = torch.zeros(
                    self.groups + 1, dtype=torch.float64, device=buffer.device
                )
            if index == 0:
                acc.zero_()
            plan.add_squares(acc, buffer)
        except Exception as exc:  # never let monitoring break the job's reduction
            self._ok = False
            if not self._logged:
                self._logged = True
                log.error(
                    "gradwatch: the per-rank view could not measure a gradient bucket (%s: %s); "
                    "the view is absent for such steps (logged once)",
                    type(exc).__name__,
                    exc,
                )
            return
        if bucket.is_last():
            self._complete = True

    def take(self) -> Tensor | None:
        """The complete vector of the last hooked backward (once), else None."""
        if not (self._complete and self._ok):
            return None
        self._complete = False
        assert self._acc is not None
        return self._acc[: self.groups]


class _BucketPlan:
    """How one bucket's gradients are summed per group, built once per bucket layout, from the
    norm engine's parts (:mod:`gradwatch.norms.stats`, :mod:`gradwatch.norms.rows`).

    * **CPU float32 buckets whose gradients are views of the bucket's flat buffer** (DDP's
      layout): the buffer read in place as rows (:class:`gradwatch.norms.rows.FlatRows`, owners =
      groups): pure rows normed in float32 and squared into float64 by the engine's
      :class:`~gradwatch.norms.rows.RowSquares`, straddling rows and the partial last row element by
      element. Seven ops per bucket.
    * **Otherwise** (accelerators, float64, bf16/fp16, gradients that are no buffer views, or
      more than a quarter of the buffer in straddling rows): the engine's float64-accumulating
      :func:`~gradwatch.norms.stats.foreach_norms`, squared, added per parameter's group. Four ops.
    """

    def __init__(
        self,
        *,
        source: Tensor,
        per_param: Tensor,
        grads: Sequence[Tensor] = (),
        rows: FlatRows | None = None,
    ) -> None:
        # The bucket buffer the plan was built for, by identity: DDP keeps a bucket's buffer
        # (and its Python object) for as long as the bucket layout lasts, and a weak reference
        # cannot outlive it, so a live match means the same layout. (A torch that handed out a
        # new Python object per call would only cost a rebuild per step, never a wrong plan.)
        # The plan's views hold the old storage only until a rebuild replaces bucket 0, which
        # drops every old plan.
        self.source = weakref.ref(source)
        self.per_param = per_param
        # Foreach path: the bucket's gradient views, kept (DDP makes two view ops per parameter
        # each time it is asked for them); views of the buffer, so they read its current values.
        self.grads = list(grads)
        self.splits = foreach_splits([g.numel() for g in self.grads])
        # Row path: the buffer's rows and loose elements (its whole-row view is made once).
        self.rows = rows

    @classmethod
    def build(
        cls, buffer: Tensor, grads: Sequence[Tensor], groups: list[int], discard: int
    ) -> _BucketPlan:
        device = buffer.device
        per_param = torch.tensor(groups, dtype=torch.long, device=device)
        if (
            device.type != "cpu"
            or buffer.dtype != torch.float32
            or not buffer.is_contiguous()
            or any(
                g.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
                or not g.is_contiguous()
                for g in grads
            )
        ):
            return cls(source=buffer, per_param=per_param, grads=grads)
        base = buffer.storage_offset()
        spans = [
            (g.storage_offset() - base, g.numel(), group)
            for g, group in zip(grads, groups, strict=True)
        ]
        rows = FlatRows(buffer, spans, discard)
        if rows.loose.numel() > buffer.numel() // 4:
            return cls(source=buffer, per_param=per_param, grads=grads)
        return cls(source=buffer, per_param=per_param, rows=rows)

    def add_squares(self, acc: Tensor, buffer: Tensor) -> None:
        """Add the squares of the bucket whose flat buffer is ``buffer`` into ``acc``."""
        if self.rows is None:
            acc.index_add_(0, self.per_param, foreach_norms(self.grads, self.splits).square_())
            return
        self.rows.add_squares(buffer, acc)


class GradWatchCommHook:
    """The hook DDP calls per bucket: measure into ``view``, then reduce like ``inner``
    (default: DDP's own average, ``allreduce_hook``)."""

    def __init__(self, view: LocalView | None, inner: Callable[..., Any] | None) -> None:
        # DDP reads a hook's __name__ / __qualname__ (its logging): an instance has neither.
        self.__name__ = self.__qualname__ = "gradwatch_comm_hook"
        self.view = view
        self.inner = inner
        self.inner_state: Any = _UNSET  # the state the user registered, once composed

    # Unannotated on purpose: DDP's register_comm_hook compares the annotations with
    # dist.GradBucket / Future[Tensor] objects, and postponed annotations are strings.
    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        view = self.view
        if view is not None:
            view.observe(bucket)
        if self.inner_state is not _UNSET:
            state = self.inner_state
        if self.inner is None:
            return _average(state, bucket)
        return self.inner(state, bucket)


def _first(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
    return fut.value()[0]


@functools.cache
def _sum_options() -> Any:
    """A SUM all-reduce's options, as ``dist.all_reduce(async_op=True)`` builds them
    (``asyncOp`` defaults to True where it exists); built on first use, once."""
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    return options


def _average(group: Any, bucket: Any) -> torch.futures.Future[Tensor]:
    """DDP's own reduction, as ``allreduce_hook`` does it (divide by the group size, SUM
    all-reduce, the bucket as the future's value), through the process group's own method: the
    same c10d op without ``dist.all_reduce``'s Python checks, all of which hold for a DDP
    bucket (one dense tensor, a group this rank belongs to, no coalescing during backward).
    Complex buckets (rare) take ``allreduce_hook`` itself (it reduces their real view)."""
    buffer = bucket.buffer()
    if group is None or buffer.is_complex():
        return allreduce_hook(group, bucket)
    buffer.div_(group.size())
    return group.allreduce([buffer], _sum_options()).get_future().then(_first)


def ddp_comm_hook(
    watch: Any, inner: Callable[..., Any] | None = None
) -> Callable[..., torch.futures.Future[Tensor]]:
    """A DDP communication hook measuring ``watch``'s per-rank view, then reducing with
    ``inner`` (your hook: bf16 compression, PowerSGD, ...; default: DDP's average).

    Register it in place of your hook, after constructing the :class:`~gradwatch.GradWatch`:
    ``ddp.register_comm_hook(your_state, gradwatch.ddp_comm_hook(watch, inner=your_hook))``.
    The statistics are of this rank's gradients before ``inner`` compresses them.
    """
    view = getattr(watch, "_local_view", None)
    return GradWatchCommHook(view, inner)


def _registered(ddp: nn.parallel.DistributedDataParallel) -> list[tuple[Any, Any]]:
    return list(getattr(ddp, "_comm_hooks", []))


def attach(ddp: nn.parallel.DistributedDataParallel, view: LocalView) -> GradWatchCommHook | None:
    """Measure ``view`` in ``ddp``'s comm hook: gradwatch's own hook when the module has none
    (or a closed watch's), None (warned) when the user registered another one. Raises
    :class:`GradWatchError` when a live GradWatch already watches this module."""
    ours = getattr(ddp, "_gradwatch_hook", None)
    if isinstance(ours, GradWatchCommHook):
        if ours.view is not None:
            raise GradWatchError(
                "gradwatch: another GradWatch already watches this DDP module through its "
                "communication hook; close() it first, or pass rank_view=False to this one "
                f"(one hook per module: compose your own with {WRAPPER})"
            )
        ours.view = view
        return ours
    hooks = _registered(ddp)
    if hooks:
        user = getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
        log.warning(
            "gradwatch: this DDP module already has a communication hook (%s), and DDP allows "
            "one: the per-rank view (non-finite origin, replica spread, noise scale) is off. To "
            "keep your hook and get the view, construct GradWatch before registering your "
            "hook and register %s in its place",
            user,
            WRAPPER,
        )
        return None
    hook = GradWatchCommHook(view, None)
    try:
        ddp.register_comm_hook(ddp.process_group, hook)
    except RuntimeError as exc:  # a built-in hook (not listed in _comm_hooks) is registered
        log.warning(
            "gradwatch: could not register gradwatch's DDP communication hook (%s): the "
            "per-rank view is off. To keep your hook and get the view, construct GradWatch "
            "before registering your hook and register %s in its place",
            exc,
            WRAPPER,
        )
        return None
    ddp._gradwatch_hook = hook  # type: ignore[attr-defined]
    _guard(ddp, hook)
    return hook


def _guard(ddp: nn.parallel.DistributedDataParallel, hook: GradWatchCommHook) -> None:
    """Later registrations on ``ddp``: gradwatch's wrapper composes with the registered hook;
    anything else fails with a message naming the wrapper (DDP's own would only say "once")."""

    def register_comm_hook(state: object, new: Callable[..., Any]) -> None:
        if isinstance(new, GradWatchCommHook):
            if new.view is not None and hook.view is not None and new.view is not hook.view:
                raise GradWatchError(
                    "gradwatch: this DDP module is watched by another GradWatch; pass that "
                    f"watch to {WRAPPER}"
                )
            hook.inner, hook.inner_state = new.inner, state
            return
        raise GradWatchError(
            "gradwatch: GradWatch registered its communication hook on this DDP module and DDP "
            f"allows one: register {WRAPPER} instead of "
            f"{getattr(new, '__qualname__', repr(new))}; it measures the per-rank view and "
            "then runs your hook"
        )

    def register_builtin(comm_hook_type: object) -> None:
        raise GradWatchError(
            "gradwatch: GradWatch registered its communication hook on this DDP module and DDP "
            f"allows one: a built-in hook ({comm_hook_type}) cannot be added; use its Python "
            f"equivalent through {WRAPPER}"
        )

    ddp.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    ddp._register_builtin_comm_hook = register_builtin  # type: ignore[method-assign]


def detach(hook: GradWatchCommHook | None) -> None:
    """The watch closed: the hook stays registered (DDP cannot remove it) but only reduces."""
    if hook is not None:
        hook.view = None
