"""The optimizer-update figures in one compiled call per batch (CPU tensors).

:mod:`gradwatch.norms.updates` inverts an optimizer step with nine to eleven eager foreach
passes over the batch (Adam/AdamW), each reading and writing the whole batch. The same
arithmetic fused by inductor reads the weights and the optimizer state once and writes nothing
but the figures: per view ``[||p||^2, ||delta||^2, stalled, moving]`` (``4 x views`` float64),
the squared norms of the weights the step left and of the exact ``delta`` accumulated in
float64, the counts as int32 sums (exact: a view holds fewer than 2^31 elements). The kernels
are compiled per layout (the tensors' dtypes, shapes and strides, the variant, the thread count)
by :class:`gradwatch.norms.kernels.KernelCache` with
:func:`~gradwatch.norms.kernels.compile_traced_cpp` (traced to aten and compiled by inductor
without dynamo: no guards, never a recompile; a C++ wrapper: no Python per buffer), off the
training thread in ``"background"`` mode; until a layout's kernel is ready, and for any batch
this module does not cover, :meth:`FusedUpdates.batch_figures` answers None and the eager path
runs.

**The same arithmetic.** Each op of the eager inversion is an op here, in the same order and
dtype (``mid = p + (s * m) / (sqrt(v) + e)`` as ``addcdiv`` computes it, ``p_old = mid / (1 -
c)`` rounded to the weights' dtype, ``delta = p - p_old``): inductor emits them as written
(no reassociation, ``-ffp-contract=off``), so ``delta`` is the eager path's ``delta`` except
where the per-view factors ``s`` and ``e`` differ in their last float64 bit (computed here as
``exp(t log beta)``: inductor stores an exponential once per view, where a ``pow`` would be
recomputed for every vector of elements) and their float32 rounding lies on the other side of a
tie, or where SGD's ``u + mu * buf`` is rounded twice here and once by eager's fused
multiply-add. Such an element's ``delta`` differs by one ulp of the weight at most, as the
eager path's own ties do (module docstring of :mod:`gradwatch.norms.updates`). The counts
follow the eager path's definitions: with a decoupled decay ``stalled = #(p_mid != 0 and delta
== 0)`` (counted as ``#(p_mid != 0 or delta != 0) - applied``, times ``c != 0``) and
``moving = stalled + applied``; without, ``moving = #(marks !=
0) * meant`` and ``stalled = moving - applied``.

**Covered**: float32/float64 and bf16/fp16 weights on the CPU (bf16/fp16 as the eager path's
:func:`~gradwatch.norms.updates.narrow_figures`: the intended change materialised, each op
rounded to the dtype as eager's is, by inductor's ``emulate_precision_casts``; tested within
0.02 of the copies' stalled fraction, not element for element equal to eager's counts);
``torch.optim`` Adam/AdamW (decoupled or L2 decay, ``amsgrad``) and SGD (momentum, Nesterov,
weight decay, ``maximize``), for-loop, foreach or fused (``found_inf``, fused SGD's
``grad_scale``), with hyperparameters that are Python numbers (a tensor learning rate or betas
keeps the eager path). Scalars that change every step (the learning rate, the step counts,
``found_inf``) are tensor inputs, so a schedule never recompiles. Accelerator tensors keep the
eager path.

Sync behaviour: none (CPU tensors only; the hyperparameters become one float64 CPU tensor,
built from Python numbers, no host read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from gradwatch.norms.kernels import (
    CompileMode,
    KernelCache,
    compile_traced,
    compile_traced_cpp,
    compiled_calls_allowed,
)


class _Batch(Protocol):
    """What this module reads of a batch of :mod:`gradwatch.norms.updates`: its views of the
    parameters, the same views of the state tensors by name, each view's step count."""

    params: list[Tensor]
    tensors: dict[str, list[Tensor]]
    steps: list[Tensor]


F64 = torch.float64
WIDE = (torch.float32, torch.float64)
#: Weight dtypes whose figures come from the materialised intended change, each op rounded to
#: the dtype as eager's are (inductor's ``emulate_precision_casts``).
NARROW = (torch.bfloat16, torch.float16)


def _count(mask: Tensor) -> Tensor:
    """The number of true elements of ``mask`` as an int32 sum (exact below 2^31)."""
    return mask.to(torch.int32).sum(dtype=torch.int32)


def _row(p: Tensor, delta: Tensor, stalled: Tensor, moving: Tensor) -> Tensor:
    """``[||p||^2, ||delta||^2, stalled, moving]`` of one view, float64: the weights the step
    left and the applied update, each square accumulated in float64 (``p`` is read for the
    update anyway: the weight norm costs no second pass over the weights)."""
    weight, wide = p.to(F64), delta.to(F64)
    return torch.stack([(weight * weight).sum(), (wide * wide).sum(), stalled.to(F64),
                        moving.to(F64)])


def _decayed(p: Tensor, mid: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``delta = p - rnd(mid / (1 - c))`` and the counts with a decoupled decay ``c``: the
    elements with ``mid != 0 or delta != 0`` less the applied ones are those with ``mid != 0
    and delta == 0`` (one comparison fewer per element than counting them), stalled where ``c !=
    0``."""
    delta = p - mid / (1 - c).to(p.dtype)
    applied = _count(delta != 0)
    stalled = (_count((mid != 0) | (delta != 0)) - applied) * (c != 0)
    return delta, stalled, stalled + applied


def _plain(p: Tensor, mid: Tensor, marks: Tensor, meant: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``delta = p - mid`` and the counts without decay (``marks`` non-zero where the update
    meant to move, times ``meant``)."""
    delta = p - mid
    moving = _count(marks != 0) * meant
    return delta, moving - _count(delta != 0), moving


def _scalar_dtype(p: Tensor) -> torch.dtype:
    """The dtype eager's ops read a Python or 0-dim scalar in, for tensors of ``p``'s dtype
    (their compute type: float32 for bf16/fp16)."""
    return torch.float32 if p.dtype in NARROW else p.dtype


def _narrow(p: Tensor, u: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """bf16/fp16 weights, from the intended update ``u`` (in the weights' dtype) and the decay
    ``c`` (None: none), as :func:`gradwatch.norms.updates.narrow_figures`: ``p_old = rnd(rnd(p
    + u) / (1 - c))``, the intended change ``u + c p_old``, ``-delta = p_old - p``; moving
    where the intended change is non-zero, stalled where it is and ``delta`` is 0."""
    old = p + u
    if c is not None:
        old = old / (1 - c).to(torch.float32)
        u = u + old * c.to(torch.float32)
    neg = old - p
    moving = _count(u != 0)
    return neg, moving - _count((u != 0) & (neg != 0)), moving


def _adam(params: list[Tensor], ms: list[Tensor], vs: list[Tensor], steps: list[Tensor],
          hyper: Tensor, keep: Tensor | None, decay: bool) -> Tensor:
    """Adam/AdamW's figures (``hyper`` = ``[lr, beta1, beta2, eps, weight_decay]``): per view
    ``s = lr sqrt(bc2) / bc1`` (times ``keep``), ``e = eps sqrt(bc2)``, the weights before the
    step's ``addcdiv`` ``mid = p + (s m) / (sqrt(v) + e)``, then :func:`_decayed` with ``c = lr
    wd`` (times ``keep``) or :func:`_plain` with the marks ``m``."""
    lr, beta1, beta2, eps, wd = hyper.unbind()
    t = torch.stack(steps).to(F64)
    bc2_sqrt = torch.sqrt(1 - torch.exp(t * torch.log(beta2)))
    s = lr * bc2_sqrt / (1 - torch.exp(t * torch.log(beta1)))
    e = bc2_sqrt * eps
    c = lr * wd
    meant = (lr != 0).to(F64)
    if keep is not None:
        s, c, meant = s * keep, c * keep, meant * keep
    rows = []
    for i, (p, m, v) in enumerate(zip(params, ms, vs, strict=True)):
        if p.dtype in NARROW:  # the intended update, materialised: 1 / (sqrt(v) + e) * m * s
            u = torch.reciprocal(v.sqrt() + e[i].to(p.dtype)) * m * s[i].to(torch.float32)
            rows.append(_row(p, *_narrow(p, u, c if decay else None)))
            continue
        mid = p + (s[i].to(p.dtype) * m) / (v.sqrt() + e[i].to(p.dtype))
        figures = _decayed(p, mid, c) if decay else _plain(p, mid, m, meant)
        rows.append(_row(p, *figures))
    return torch.stack(rows, 1)


def adam_decoupled(params: list[Tensor], ms: list[Tensor], vs: list[Tensor],
                   steps: list[Tensor], hyper: Tensor, keep: Tensor | None) -> Tensor:
    """:func:`_adam` with a decoupled weight decay (AdamW, ``weight_decay != 0``)."""
    return _adam(params, ms, vs, steps, hyper, keep, decay=True)


def adam_plain(params: list[Tensor], ms: list[Tensor], vs: list[Tensor],
               steps: list[Tensor], hyper: Tensor, keep: Tensor | None) -> Tensor:
    """:func:`_adam` without a decoupled decay (Adam; L2 decay is inside ``m`` and ``v``)."""
    return _adam(params, ms, vs, steps, hyper, keep, decay=False)


def _sgd(params: list[Tensor], gs: list[Tensor], bufs: list[Tensor] | None, hyper: Tensor,
         keep: Tensor | None, scale: Tensor | None, decay: bool) -> Tensor:
    """SGD's figures from the gradient (``hyper`` = ``[lr, momentum, weight_decay, sign]``):
    ``u = rate ((sign / scale) g + mu buf)``, ``mid = u + p``, then :func:`_decayed` with ``c =
    rate wd`` or :func:`_plain` with the marks ``u`` (``rate = lr``, times ``keep``)."""
    lr, mu, wd, sign = hyper.unbind()
    rate = lr if keep is None else lr * keep
    inv = sign if scale is None else sign / scale.to(F64)
    rows = []
    for i, (p, g) in enumerate(zip(params, gs, strict=True)):
        k = _scalar_dtype(p)
        u = g * inv.to(k)
        if bufs is not None:
            u = u + mu.to(k) * bufs[i]
        u = u * rate.to(k)
        if p.dtype in NARROW:
            rows.append(_row(p, *_narrow(p, u, rate * wd if decay else None)))
            continue
        mid = u + p
        figures = _decayed(p, mid, rate * wd) if decay else _plain(p, mid, u, torch.ones_like(lr))
        rows.append(_row(p, *figures))
    return torch.stack(rows, 1)


def sgd_decayed(params: list[Tensor], gs: list[Tensor], bufs: list[Tensor] | None,
                hyper: Tensor, keep: Tensor | None, scale: Tensor | None) -> Tensor:
    """:func:`_sgd` with a weight decay outside a momentum buffer."""
    return _sgd(params, gs, bufs, hyper, keep, scale, decay=True)


def sgd_plain(params: list[Tensor], gs: list[Tensor], bufs: list[Tensor] | None,
              hyper: Tensor, keep: Tensor | None, scale: Tensor | None) -> Tensor:
    """:func:`_sgd` without weight decay."""
    return _sgd(params, gs, bufs, hyper, keep, scale, decay=False)


def sgd_buffer(params: list[Tensor], bufs: list[Tensor], hyper: Tensor,
               keep: Tensor | None) -> Tensor:
    """SGD with momentum, not Nesterov: ``u = rate buf`` (the decay is inside the buffer),
    ``mid = u + p``, :func:`_plain` with the marks ``u``."""
    lr = hyper[0]
    rate = lr if keep is None else lr * keep
    rows = []
    for p, buf in zip(params, bufs, strict=True):
        u = buf * rate.to(_scalar_dtype(p))
        if p.dtype in NARROW:
            rows.append(_row(p, *_narrow(p, u, None)))
            continue
        rows.append(_row(p, *_plain(p, u + p, u, torch.ones_like(lr))))
    return torch.stack(rows, 1)


def weight_squares(weights: list[Tensor]) -> Tensor:
    """Each weight's squared norm, accumulated in float64 (``P`` float64): what the collect
    reads when the steps did not leave them
    (:meth:`gradwatch.norms.updates.UpdateMeter.figures`)."""
    return torch.stack([w.to(F64).square().sum() for w in weights])


def update_section(updates: Tensor, group: Tensor, counted: Tensor, tail: Tensor) -> Tensor:
    """The collect's update section (:meth:`gradwatch.norms.updates.UpdateMeter.figures`): the
    ``4 x P`` figures (weight squares, update squares, stalled, moving) zeroed where
    ``counted`` is false, summed per group (``group``: each piece's group; the number of
    groups is ``tail``'s length minus 2; a masked sum, where inductor cannot lower an
    ``index_add`` into one group), then ``tail``'s last two values."""
    groups = torch.arange(tail.shape[0] - 2, device=group.device)
    member = (group.unsqueeze(0) == groups.unsqueeze(1)) & counted  # G x P
    sums = torch.where(member, updates.unsqueeze(1), 0.0).sum(-1)  # 4 x G
    return torch.cat([sums.reshape(-1), tail[-2:]])


def _float(value: Any) -> float | None:
    """``value`` as a float when it is a Python number, else None (a tensor keeps eager)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def hyper_tensor(values: Sequence[Any]) -> Tensor | None:
    """The hyperparameters as one float64 CPU tensor (None when one is not a number)."""
    floats = [_float(v) for v in values]
    if any(f is None for f in floats):
        return None
    return torch.tensor(floats, dtype=F64)


def _example(layout: tuple) -> Callable[[], tuple]:
    """Arguments of ``layout`` (:func:`_layout`: the key's own record, so the compiled kernel
    is the key's even if a tensor changes before the compile thread gets to it; no reference
    to the caller's tensors), zeros (an index argument must be in range), on the CPU."""

    def like(spec: Any) -> Any:
        if spec is None:
            return None
        if isinstance(spec, tuple) and spec and isinstance(spec[0], torch.dtype):
            dtype, shape, stride, _cpu = spec
            return torch.empty_strided(shape, stride, dtype=dtype).zero_()
        return [like(t) for t in spec]

    return lambda: tuple(like(a) for a in layout)


def _spec(t: Tensor) -> tuple | None:
    return (t.dtype, t.shape, t.stride(), True) if t.is_cpu else None


def _layout(args: tuple) -> tuple | None:
    """What a traced kernel assumes of its arguments (the structure; per tensor its dtype,
    shape and strides): :func:`~gradwatch.norms.kernels.tensor_layout` less what a call under
    ``no_grad`` on the CPU does not depend on, at half its cost (a key is built on every call);
    None when a tensor is not on the CPU (the kernels are CPU kernels)."""
    out: list[Any] = []
    for a in args:
        if isinstance(a, list):
            specs = tuple(_spec(t) for t in a)
            if None in specs:
                return None
            out.append(specs)
        elif a is None:
            out.append(None)
        else:
            spec = _spec(a)
            if spec is None:
                return None
            out.append(spec)
    return tuple(out)


def _compile(fn: Callable[..., Tensor], example: Callable[[], tuple]) -> Callable[..., Tensor]:
    """The step kernels and the weight squares (a result buffer per view) with a C++ wrapper
    (:func:`~gradwatch.norms.kernels.compile_traced_cpp`: no Python per buffer), the
    collect's small section with inductor's Python one (fewer steps into C++ for its few)."""
    if fn is update_section:
        return compile_traced(fn, example)
    return compile_traced_cpp(fn, example)


#: Layouts one meter compiles at most (batches and sections); any after stay eager. A job's
#: layouts are its optimizer parameter groups times dtypes, times the sets of parameters with
#: gradients it steps (phases that freeze some): a few; one that changes every step is eager.
LAYOUTS = 16


class FusedUpdates:
    """The compiled kernels of one update meter, per layout, from a :class:`KernelCache` in
    ``mode``. ``calls`` counts the batches measured by a compiled kernel and ``section_calls``
    the collects (the tests read them: the compiled path is the one taken)."""

    def __init__(self, mode: CompileMode) -> None:
        self.cache = KernelCache(mode, _compile, limit=LAYOUTS)
        self.calls = 0
        self.section_calls = 0
        #: the compiled batch calls ``(kernel, args)`` since the caller last cleared it (the
        #: meter, at each step it measures batch by batch: what
        #: :class:`gradwatch.norms.update_replay.Replays` prepares from)
        self.ran: list[tuple[Callable[..., Tensor], tuple]] = []
        self._last: tuple[Callable[..., Tensor], tuple] | None = None
        self._section_last: tuple[tuple, Callable[..., Tensor]] | None = None
        self._weights_last: tuple[tuple, Callable[..., Tensor]] | None = None

    def _run(self, fn: Callable[..., Tensor], args: tuple) -> Tensor | None:
        """``fn(*args)`` compiled for their layout if it is ready (starting its compile on
        first sight), else None."""
        if self.cache.mode == "off" or not compiled_calls_allowed():
            return None
        layout = _layout(args)
        if layout is None:
            return None
        kernel = self.cache.get(fn, (layout, torch.get_num_threads()), _example(layout))
        if kernel is None:
            return None
        self._last = (kernel, args)
        with torch.no_grad():
            return kernel(*args)

    def batch_figures(self, kind: str, optimizer: Any, group: dict[str, Any], batch: _Batch,
                      keep: Tensor | None) -> Tensor | None:
        """The batch's ``4 x views`` figures from a compiled kernel, or None (the eager path
        measures it): not a covered batch (module docstring), or its kernel is not ready."""
        first = batch.params[0]
        if self.cache.mode == "off" or first.device.type != "cpu" or first.dtype not in (
                WIDE + NARROW):
            return None
        if kind == "adam":
            out = self._adam(group, batch, keep)
        else:
            out = self._sgd(optimizer, group, batch, keep)
        if out is not None:
            self.calls += 1
            self.ran.append(self._last)  # type: ignore[arg-type]
        self._last = None  # no reference to the step's tensors kept past it
        return out

    def _adam(self, group: dict[str, Any], batch: _Batch, keep: Tensor | None
              ) -> Tensor | None:
        hyper = hyper_tensor([group["lr"], *group["betas"], group["eps"], group["weight_decay"]])
        if hyper is None:
            return None
        decay = bool(group.get("decoupled_weight_decay", False)) and (
            float(group["weight_decay"]) != 0.0)
        fn = adam_decoupled if decay else adam_plain
        t = batch.tensors
        return self._run(fn, (batch.params, t["m"], t["v"], batch.steps, hyper, keep))

    def _sgd(self, optimizer: Any, group: dict[str, Any], batch: _Batch,
             keep: Tensor | None) -> Tensor | None:
        sign = -1.0 if group["maximize"] else 1.0
        hyper = hyper_tensor([group["lr"], group["momentum"], group["weight_decay"], sign])
        if hyper is None:
            return None
        bufs = batch.tensors.get("buf")
        if bufs is not None and not group["nesterov"]:
            return self._run(sgd_buffer, (batch.params, bufs, hyper, keep))
        fn = sgd_decayed if float(group["weight_decay"]) != 0.0 else sgd_plain
        scale = getattr(optimizer, "grad_scale", None)
        return self._run(fn, (batch.params, batch.tensors["g"], bufs, hyper, keep, scale))

    def weights(self, weights: list[Tensor]) -> Tensor | None:
        """:func:`weight_squares` from a compiled kernel, or None (eager): weights not all CPU
        tensors of a covered dtype, or the kernel is not ready. The layout of the last compiled
        call is kept: weights with the same layout (each one's device, dtype, shape and
        strides, the thread count) call its kernel without building the key."""
        if self.cache.mode == "off" or not weights or not compiled_calls_allowed():
            return None
        quick = (torch.get_num_threads(),
                 [(w.device.type, w.dtype, w.shape, w.stride()) for w in weights])
        last = self._weights_last
        if last is not None and last[0] == quick:
            with torch.no_grad():
                return last[1](weights)
        if any(w.device.type != "cpu" or w.dtype not in WIDE + NARROW for w in weights):
            return None
        out = self._run(weight_squares, (weights,))
        if out is not None and self._last is not None:
            self._weights_last = (quick, self._last[0])
        self._last = None
        return out

    def section(self, updates: Tensor, group: Tensor, counted: Tensor, tail: Tensor
                ) -> Tensor | None:
        """:func:`update_section` from a compiled kernel, or None (eager: ``updates`` not on
        the CPU, or the kernel is not ready). ``tail``: ``G + 2`` float64, its last two the
        section's tail (its length carries the number of groups into the layout key). The
        layout of the last compiled call is kept as :meth:`weights`' is."""
        if self.cache.mode == "off" or updates.device.type != "cpu":
            return None
        if not compiled_calls_allowed():
            return None
        args = (updates, group, counted, tail)
        quick = (torch.get_num_threads(), updates.shape, group.shape, counted.shape, tail.shape)
        last = self._section_last
        if last is not None and last[0] == quick:
            with torch.no_grad():
                out = last[1](*args)
        else:
            out = self._run(update_section, args)
            if out is not None and self._last is not None:
                self._section_last = (quick, self._last[0])
            self._last = None
        if out is not None:
            self.section_calls += 1
        return out
