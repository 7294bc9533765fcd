"""Optimizer-update health, per rank: weight norms, the applied update, stalled elements.

What an optimizer step did to the weights, measured without a copy of the parameters.

**The applied update, recovered.** After ``optimizer.step()`` the parameter holds
``p_new = rnd(rnd(p_old * (1 - c)) - u)``, where ``u`` is the optimizer's intended step (from
its state, which the step just updated), ``c`` the decoupled weight decay (``lr * wd``; 0 when
there is none) and ``rnd`` rounding to the parameter's dtype. Given ``p_new``, ``u`` and ``c``,
this module inverts the step: ``p_mid = rnd(p_new + u)``, ``p_old = rnd(p_mid / (1 - c))``,
each rounding done by the dtype's own arithmetic (the foreach ops below run in the parameter's
dtype, as the optimizer's do). Every value of the dtype is a grid point, and ``p_new + u`` lies
within half an ulp of ``p_mid`` (the step's own rounding) plus the difference between this
``u`` and the one the optimizer computed (a few ulps *of u*, far below an ulp of ``p`` whenever
``|u| << |p|``); so the nearest grid point is ``p_mid`` itself except for elements whose
rounding error lay within that difference of a tie, where it is the neighbour: an error of one
ulp of ``p`` on a few elements. The applied update is then ``delta = p_new - p_old``, exact (two
neighbouring values of one dtype: Sterbenz); the squared norm of ``delta`` is accumulated in
float32 per view of at most :data:`BATCH` elements (relative error about 1e-7, against the
1e-4 the update is held to) and summed over views in float64; an element of the update above
about 1e19 or below 1e-19 in magnitude would overflow or vanish in its float32 square (weights
of ordinary training are far inside).

**Stalled elements.** An element is *moving* when the step's intended change ``u + c * p_old``
is not 0 and *stalled* when it is moving and ``delta == 0`` (the change was under half an ulp
of the weight and was rounded away: Adam on an element whose gradient has long been 0, a tiny
learning rate, a large weight). Every count is the squared ``_foreach_norm`` of signs
(``-1, 0, 1``) over a batch's views, rounded: the number of non-zero elements, exact
(accumulated in float32 for views of up to 2^22 elements, in float64 above). An order-0 norm
counts the same but leaves the multi-tensor kernel on CUDA (it has L1, L2 and inf only: one
kernel per view) and runs several times slower than ``sign`` plus an L2 norm on CPU.
bf16/fp16 weights (:func:`narrow_figures`) materialise the intended change in the dtype and
count its signs. float32/float64 weights (:func:`wide_figures`) count without it, by exact
equivalents: ``applied`` = the non-zero elements of ``delta``; without decay (``c`` the float
0) the intended change is ``u``, non-zero exactly where Adam's ``m`` is (``u = s * m /
(sqrt(v) + e)`` with ``e > 0``: the real quotient, so an update that underflows float32
counts as moving and stalled) or SGD's ``u`` is, times ``s != 0`` (0 for a zero learning rate
or a skipped fused step): ``moving`` = those non-zeros; with a decay ``c != 0`` an element
with ``p_old != 0`` is moving (the decay meant to change it; an exact cancellation of ``u``
and ``c * p_old`` counts as moving too), one with ``p_old == 0`` moves exactly when the
optimizer's own ``u`` was non-zero, i.e. when ``p_new = rnd(-u)`` and so ``delta`` is: the
stalled elements are those with ``delta == 0`` and ``p_old != 0``: the non-zeros of
``p_mid`` (``rnd(p_old (1 - c))``, 0 exactly where ``p_old`` is) minus those of ``sign(p_mid)
* sign(delta)``, and ``moving = stalled + applied``. ``stalled = moving - applied``
without decay, as every element with ``delta != 0`` had ``u != 0``.

Why not the alternatives. ``||p_new - p_old||^2 = ||p_new||^2 + ||p_old||^2 - 2<p_new, p_old>``
from norms alone cancels catastrophically: an update of relative size 1e-4 leaves 1e-8 of the
squared weight norm, below float32's and near float64's rounding of the three terms. The
intended update ``||u||`` alone is not the applied one for bf16/fp16 weights (an update under
half an ulp is rounded away, yet ``u`` says it moved). A shadow copy of the weights costs
their bytes (or half of them for low bits only); this reads the optimizer's state instead.

**Which optimizers** (:func:`optimizer_kind`): ``torch.optim.SGD`` (momentum, dampening,
Nesterov, weight decay, ``maximize``), ``Adam`` and ``AdamW`` (``amsgrad``, ``maximize``, L2
or decoupled weight decay), each for-loop, ``foreach`` or ``fused``, with ``lr`` a float or a
tensor. A fused step skipped by ``found_inf`` (GradScaler, the optimizer-step guard) changed
nothing: ``u`` and ``c`` are multiplied by ``1 - found_inf`` on the device, and a fused SGD's
gradients are divided by its ``grad_scale`` (the kernel unscales them, ``.grad`` stays
scaled). Any other optimizer holding a watched parameter makes the step's update unmeasured
(the snapshot's update figures are None, logged once), never a guess. fp16 weights: an
intended update below fp16's smallest subnormal is 0 in the optimizer's arithmetic and here
(not moving).

**When.** A global optimizer step post-hook (``register_optimizer_step_post_hook``) measures
every step of an optimizer holding watched parameters; each parameter's figures overwrite the
previous step's, so a collect publishes the update of the last step that updated each parameter
(with ``every_n_steps > 1``: of the last step before the collect, not the sum since the
previous collect). :meth:`UpdateMeter.figures` (the collect) adds the weight norms, sums per
group over the pieces this rank counts, and clears the update figures (not the weight
squares): a collect with no
optimizer step since the previous one publishes an update of 0 (the weights did not change),
which is how a skipped step is seen. The first collect has no previous one (marked, so the
update figures are None). No host read anywhere: learning rates, step counts and ``found_inf``
stay tensors; the per-group sums are device ops.

Cost, float32/float64 weights (one batch per optimizer parameter group, device and dtype,
at most :data:`BATCH` elements): Adam/AdamW without decoupled decay nine foreach passes over
the batch (``sqrt(v)``, ``+ e``, one ``addcdiv`` giving ``p_mid``, a subtraction giving
``delta``, its norm; then ``sign`` of ``delta`` in place and of ``m``, one norm call over
both), eleven with it (the second ``addcdiv`` gives ``delta``; its norm, ``sign`` of
``delta`` and ``p_mid`` in place, one norm call over both, their product in place, its norm);
SGD eight to twelve; about 30 small ops on vectors of one element per view (the bias
corrections, the counts); no Python loop over elements, one over the
parameters to gather their state. bf16/fp16 weights: about fifteen foreach ops per batch (the
signs). Per collect where the weights are read (above), one float32 norm per view of
:data:`WEIGHT_ROWS` weights (their squares summed in float64: the weight norm's relative
error is about 1e-7). Persistent memory: four float64 figures per parameter *tensor*;
temporaries: at most three of a batch's size in its dtype, freed by the step.

**Weight norms, measured once.** Each piece's weight squares are kept with a *stamp*: its
local storage (``data_ptr``) and its version counter (``_version``, which every in-place op
on the tensor bumps, the optimizer's own included). A compiled step kernel (below) reads the
weights for the update anyway and also leaves their squares: the weights the step produced,
stamped right after the step. The collect compares every piece's stamp with the one kept; when
all match, the weights are what was measured and are not read again; otherwise (the first
collect, a step measured eagerly, an in-place change or new data after the step) it reads
every piece's weights once (one compiled call, or the float32 norms below) and keeps their
stamps. A change made through ``.data`` bumps no version counter: such a change after the last
step is seen when a step or a change through the tensor next measures the weights (the
``.data`` route is autograd's own blind spot for the same reason).

**Compiled** (:mod:`gradwatch.norms.fused_updates`): on CPU tensors, once a batch's layout
has its kernel (``compile_kernels``: compiled off the training thread by default), the batch's
figures come from one compiled call that reads the weights and the state once (the same
arithmetic, the sums in float64; the weight squares too), and the collect's section from
another; everything else, and
every batch until its kernel is ready, takes the eager path above. An Adam/AdamW step whose
batches all ran compiled repeats its prepared calls on the next steps, no batch rebuilt, while
what they read is unchanged (:mod:`gradwatch.norms.update_replay`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from gradwatch.norms.fused_updates import FusedUpdates
from gradwatch.norms.kernels import CompileMode
from gradwatch.norms.rows import host_to_device
from gradwatch.norms.update_batches import BATCH as BATCH
from gradwatch.norms.update_batches import Batch as _Batch
from gradwatch.norms.update_batches import Kind as _Kind
from gradwatch.norms.update_batches import flat_views as _views
from gradwatch.norms.update_batches import fragment_batches as _fragment_batches
from gradwatch.norms.update_batches import local_part as _local
from gradwatch.norms.update_batches import stepped_batches as _batches
from gradwatch.norms.update_replay import Replays
from gradwatch.norms.update_section import Section, SectionSums

log = logging.getLogger("gradwatch")

Scalar = float | Tensor


#: Elements per float32-accumulated norm of the weights (their squares summed in float64).
WEIGHT_ROWS = 1 << 16


def _scalar(value: Any) -> Scalar:
    """A hyperparameter as a Python float or a float64 tensor where it lives (a CPU learning
    rate or step count stays on the CPU: moving it to an accelerator from pageable memory
    would be a blocking copy; as a 0-dim CPU tensor it acts as a scalar there)."""
    if isinstance(value, Tensor):
        return value.to(dtype=torch.float64)
    return float(value)


def optimizer_kind(optimizer: Any) -> str | None:
    """Which inversion applies to ``optimizer`` (its exact type: a subclass may step
    otherwise), None for any other optimizer."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return _Kind.SGD
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return _Kind.ADAM
    return None


def _keep(optimizer: Any, device: torch.device) -> Tensor | None:
    """``1 - found_inf`` when a fused step may have been skipped on the device, else None."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    return 1 - found_inf.to(device=device, dtype=torch.float64)


def _adam_scalars(
    b: _Batch, group: dict[str, Any], keep: Tensor | None
) -> tuple[Tensor, Tensor, Scalar]:
    """Adam/AdamW per view, as float64 vectors where the step counts live: ``s = lr / bc1 *
    sqrt(bc2)`` (times ``1 - found_inf``) and ``e = eps * sqrt(bc2)``, so that the intended
    step ``lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` is ``s * m / (sqrt(v) + e)`` (the
    bias corrections of each parameter's step count after the step; ``amsgrad``: ``v`` is the
    running max); and the decoupled decay ``c = lr * wd`` (0 without it: L2 decay is inside
    ``m`` and ``v``). A handful of ops on vectors of one element per view."""
    beta1, beta2 = (_scalar(x) for x in group["betas"])
    lr = _scalar(group["lr"])
    steps = torch.stack(b.steps).to(torch.float64)  # where the optimizer keeps them
    bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, steps))
    s = lr * bc2_sqrt / (1 - torch.pow(beta1, steps))
    if keep is not None:
        s = s * keep
    wd = float(group["weight_decay"])
    c: Scalar = 0.0
    if group.get("decoupled_weight_decay", False) and wd != 0.0:
        c = lr * wd if keep is None else lr * wd * keep
    return s, bc2_sqrt * float(group["eps"]), c


def _adam_denominators(b: _Batch, e: Tensor) -> list[Tensor]:
    """``sqrt(v) + e`` per view: the batch's one new temporary list, two passes."""
    d = list(torch._foreach_sqrt(b.tensors["v"]))
    torch._foreach_add_(d, list(e.to(d[0].dtype).unbind()))  # one cast, not one per view
    return d


def _intended_adam(
    b: _Batch, group: dict[str, Any], keep: Tensor | None
) -> tuple[list[Tensor], Scalar]:
    """Adam/AdamW's intended step ``u = s * m / (sqrt(v) + e)`` (:func:`_adam_scalars`) and
    the decay ``c``: five passes, in place on one temporary."""
    s, e, c = _adam_scalars(b, group, keep)
    u = _adam_denominators(b, e)
    torch._foreach_reciprocal_(u)
    torch._foreach_mul_(u, b.tensors["m"])
    torch._foreach_mul_(u, list(s.unbind()))
    return u, c


def _before_decay_adam(
    b: _Batch, group: dict[str, Any], keep: Tensor | None
) -> tuple[list[Tensor], Scalar]:
    """``rnd(p_new + u)`` for Adam/AdamW (the weights before the step's ``addcdiv``, after
    its decay) and the decay ``c``: three passes. With the per-view factors ``s`` in host
    memory (the optimizer keeps step counts on the CPU unless it is fused or capturable) one
    ``_foreach_addcdiv`` reads them there as its scalars (no copy to or from a device);
    otherwise a division, a multiplication and an addition."""
    s, e, c = _adam_scalars(b, group, keep)
    d = _adam_denominators(b, e)
    if s.device.type == "cpu":
        return list(torch._foreach_addcdiv(b.params, b.tensors["m"], d, s)), c
    u = list(torch._foreach_div(b.tensors["m"], d))
    del d
    torch._foreach_mul_(u, list(s.unbind()))
    torch._foreach_add_(u, b.params)
    return u, c


def _nonzero_rate(group: dict[str, Any], keep: Tensor | None) -> Scalar:
    """1 when Adam's step factor ``s`` (:func:`_adam_scalars`) is non-zero, else 0: ``s`` is 0
    exactly when the learning rate is or a fused step was skipped (``keep`` 0); a float, or a
    0-dim tensor where the learning rate or ``keep`` lives (no host read)."""
    lr = _scalar(group["lr"])
    rate: Scalar = float(lr != 0.0) if isinstance(lr, float) else (lr != 0).to(torch.float64)
    return rate if keep is None else rate * keep


def _intended_sgd(
    b: _Batch, group: dict[str, Any], optimizer: Any, keep: Tensor | None
) -> tuple[list[Tensor], Scalar]:
    """SGD: ``p_new = p_old - lr * d`` with ``d = buf`` (momentum, the buffer the step left,
    weight decay inside it), else ``d = g + wd * p_old (+ mu * buf, Nesterov)``: ``u = lr *
    (g + mu * buf)`` and the decay ``c = lr * wd`` (``g`` is ``-grad`` under ``maximize``,
    unscaled by a fused step's ``grad_scale``)."""
    lr = _scalar(group["lr"])
    rate = lr if keep is None else lr * keep
    mu, wd = float(group["momentum"]), float(group["weight_decay"])
    bufs = b.tensors.get("buf")
    if bufs is not None and not group["nesterov"]:
        return _times(bufs, rate, copy=True), 0.0
    scale = getattr(optimizer, "grad_scale", None)
    sign = -1.0 if group["maximize"] else 1.0
    inv: Scalar = sign if scale is None else sign / scale.to(dtype=torch.float64)
    u = _times(b.tensors["g"], inv, copy=True)
    if bufs is not None:
        torch._foreach_add_(u, bufs, alpha=mu)
    u = _times(u, rate, copy=False)
    return u, (rate * wd if wd != 0.0 else 0.0)


def _times(tensors: list[Tensor], factor: Scalar, copy: bool) -> list[Tensor]:
    """``tensors * factor`` (a new list when ``copy``, else in place), ``factor`` a float or
    a 0-dim tensor (no host read)."""
    factors: Any = factor if isinstance(factor, float) else [factor] * len(tensors)
    if copy:
        return list(torch._foreach_mul(tensors, factors))
    torch._foreach_mul_(tensors, factors)
    return tensors


#: Weight dtypes whose figures come from the materialised intended change
#: (:func:`narrow_figures`); the others (float32, float64) take :func:`wide_figures`.
NARROW = (torch.bfloat16, torch.float16)


def _undo_decay(mid: list[Tensor], c: Scalar) -> None:
    """``p_old = rnd(p_mid / (1 - c))`` in place (nothing when ``c`` is the float 0)."""
    if isinstance(c, float) and c == 0.0:
        return
    keep = 1 - c
    torch._foreach_div_(mid, keep if isinstance(keep, float) else [keep] * len(mid))


def wide_figures(b: _Batch, mid: list[Tensor], c: Scalar, marks: list[Tensor],
                 meant: Scalar) -> Tensor:
    """``[||delta||^2, stalled, moving]`` per view (``3 x views`` float64) for float32/float64
    weights, from ``mid = rnd(p_new + u)`` (consumed; see the module docstring). ``marks``:
    per view, a tensor whose non-zero elements are those the update ``u`` means to move
    (Adam's ``m``, SGD's ``u``); ``meant``: 1 when ``u`` is the marks times a non-zero
    factor, 0 when that factor is 0.

    The applied update: with a float decay ``c`` one ``addcdiv(p_new, mid, 1 - c, value=-1) =
    p_new - rnd(mid / (1 - c))`` (the kernel rounds the quotient to the dtype, ``p_old``, as a
    division alone would, before adding; ``p_new - p_old`` is then exact: Sterbenz), and
    ``mid`` stays ``p_mid``; a tensor decay divides in place first (``mid`` becomes
    ``p_old``), then subtracts into a new list; no decay subtracts in place. Then its squared
    norm.

    Stalled elements, counted without materialising the intended change ``u + c p_old``, as
    squared norms of signs (``_foreach_sign`` then ``_foreach_norm``: rounded, the count of
    non-zero elements, exact: :func:`_nonzeros`; see the module docstring for why
    not an order-0 norm): ``applied`` = non-zeros of ``delta``. Without decay,
    ``moving`` = non-zeros of the marks times ``meant`` (one norm call with ``applied``) and
    ``stalled = moving - applied`` (every element with ``delta != 0`` had ``u != 0``). With a
    decay, an element with a non-zero weight before the step is moving (the decay meant to
    change it), and one with a zero weight is moving exactly when the optimizer's own ``u`` was
    non-zero, i.e. when ``p_new = rnd(-u)`` and so ``delta`` is; ``mid`` is 0 exactly where
    ``p_old`` is (``rnd(p_old (1 - c))`` is never 0 for ``c < 1/2``), so ``stalled`` =
    non-zeros of ``mid`` minus those of ``sign(mid) * sign(delta)`` and ``moving = stalled +
    applied``. A tensor decay that is 0 (a skipped fused step, a zero learning rate) meant
    nothing to move: its stalled count is multiplied by ``c != 0``."""
    if isinstance(c, float) and c != 0.0:
        first = b.params[0]
        keep = torch.full((), 1 - c, dtype=first.dtype, device=first.device)
        delta = list(torch._foreach_addcdiv(b.params, mid, [keep] * len(mid), value=-1.0))
    elif isinstance(c, float):
        torch._foreach_sub_(mid, b.params)  # p_old - p_new = -delta, exact (Sterbenz)
        delta = mid
    else:
        _undo_decay(mid, c)
        delta = list(torch._foreach_sub(mid, b.params))  # -delta; mid stays p_old
    squares = _norms(delta).square()
    views = len(delta)
    torch._foreach_sign_(delta)
    if isinstance(c, float) and c == 0.0:
        nonzero = _nonzeros(delta + list(torch._foreach_sign(marks)))
        applied, moving = nonzero[:views], nonzero[views:] * meant
        stalled = moving - applied
    else:
        torch._foreach_sign_(mid)
        nonzero = _nonzeros(delta + mid)
        applied = nonzero[:views]
        torch._foreach_mul_(mid, delta)  # +-1 where the weight was non-zero and moved
        stalled = nonzero[views:] - _nonzeros(mid)
        if not isinstance(c, float):
            stalled = stalled * (c != 0)
        moving = stalled + applied
    return torch.stack([squares, stalled, moving])


def narrow_figures(b: _Batch, u: list[Tensor], c: Scalar) -> Tensor:
    """``[||delta||^2, stalled, moving]`` per view (``3 x views`` float64) for bf16/fp16
    weights from the intended update ``u`` (consumed) and the decay ``c`` (see the module
    docstring). The decay's inversion rounds twice, as Adam's step does; SGD's step rounds
    ``p - lr (g + wd p)`` once, so there a tie can leave one more element one ulp off."""
    old = torch._foreach_add(b.params, u)  # rnd(p_new + u)
    if not (isinstance(c, float) and c == 0.0):
        _undo_decay(old, c)
        torch._foreach_add_(u, _times(old, c, copy=True))  # the intended change u + c p_old
    torch._foreach_sub_(old, b.params)  # -delta
    squares = _norms(old).square()
    torch._foreach_sign_(u)  # -1, 0, 1: whether each element was meant to move
    moving = _nonzeros(u)
    torch._foreach_sign_(old)
    torch._foreach_mul_(u, old)  # +-1 where it was meant to move and moved
    moved = _nonzeros(u)
    return torch.stack([squares, moving - moved, moving])


#: Elements per view up to which a float32 norm of signs, squared and rounded, counts exactly
#: (the float32 square root's relative error, 6e-8, doubled by the square, stays under half a
#: unit); a larger view (a non-contiguous tensor is one) is counted in float64.
EXACT_COUNT = 1 << 22


def _nonzeros(signs: list[Tensor]) -> Tensor:
    """The number of non-zero elements of each tensor of signs (``-1, 0, 1``): its squared L2
    norm, rounded, as one float64 vector (see :func:`_norms`); exact at any size."""
    wide = any(t.numel() > EXACT_COUNT for t in signs)
    return _norms(signs, torch.float64 if wide else None).square().round()


def _norms(tensors: list[Tensor], accumulate: torch.dtype | None = None) -> Tensor:
    """The L2 norm of each tensor, accumulated in ``accumulate`` when given, else in float32
    (bf16/fp16 widened by the op; float64 in float64), as one float64 vector on the first
    tensor's device: one ``_foreach_norm`` per (device, dtype)."""
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    device = tensors[0].device
    parts: list[Tensor] = []
    order: list[int] = []
    for (_, dtype), idx in buckets.items():
        narrow = torch.float32 if dtype in (torch.bfloat16, torch.float16) else None
        wide = accumulate or narrow
        norms = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=wide)
        parts.append(torch.stack(norms).to(device=device, dtype=torch.float64))
        order += idx
    if len(parts) == 1:
        return parts[0]
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    return out.index_copy_(0, torch.tensor(order, device=device), torch.cat(parts))


def section_width(groups: int) -> int:
    """The packed vector's update section for ``groups`` groups: ``[weight squares | update
    squares | stalled elements | moving elements]`` per group (``4G``), then the ranks that
    could not measure the update and the ranks with no previous collect (2); 0 when off."""
    return 4 * groups + 2 if groups > 0 else 0


class UpdateMeter:
    """This rank's optimizer-update figures, kept between collects on the packed vector's
    device.

    Args:
        params: the watched parameters in local order (plain tensors or DTensors).
        group_index: per local parameter, its group's position in the update section.
        groups: the number of groups of the section.
        contributes: per local parameter, does this rank count its piece (the layout's
            contributor: replicas counted once).
        device: the packed vector's device.
        fragments: under DeepSpeed ZeRO stages 1-3 (``params`` are then the pieces' fp32
            master fragments): per flat partition the optimizer steps (by ``id``), the
            ``(position, start, numel)`` of each piece's fragment in it.
        compile_kernels: whether to compile the fused kernels of
            :mod:`gradwatch.norms.fused_updates` (CPU batches;
            ``WatchConfig.compile_kernels``); the eager path measures until they are ready.
        host_section: may the section be given as floats (the packed vector is packed on
            the host; :class:`~gradwatch.norms.update_section.SectionSums`)?

    Thread-safety: :meth:`after_step` and :meth:`figures` run on the training thread.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        group_index: Sequence[int],
        groups: int,
        contributes: Sequence[bool],
        device: torch.device,
        fragments: Mapping[int, Sequence[tuple[int, int, int]]] | None = None,
        compile_kernels: CompileMode = "off",
        host_section: bool = True,
    ) -> None:
        self._params = list(params)
        self.fused = FusedUpdates(compile_kernels)
        self._replays = Replays(self.fused)
        self._position = {id(p): i for i, p in enumerate(self._params)}
        # DeepSpeed ZeRO 1-3: the inner optimizer steps flat fp32 partitions; per partition
        # (by id), the (piece position, start, numel) of each watched fragment
        self._fragments = dict(fragments or {})
        self._groups = groups
        self._device = device
        self._section = SectionSums(group_index, groups, contributes, device, self.fused,
                                    host_section)
        # per piece [weight squares, update squares, stalled, moving]: the update figures of
        # the last step that stepped it, its weight squares as last measured (by that step's
        # kernel or by a collect), current while the piece's stamp is the one kept here
        self._updates = torch.zeros(4, len(self._params), dtype=torch.float64, device=device)
        self._update_rows = self._updates[1:]  # what a collect clears: one view, kept
        self._weighed: list[tuple[int, int] | None] = [None] * len(self._params)
        self._armed = False  # a collect packed figures before: the next one has an update
        self._unmeasured = False  # a step this module cannot invert touched a parameter
        self._warned: set[str] = set()
        self._indices: dict[tuple[int, ...], Tensor] = {}
        self._weight_key: tuple[tuple[int, int], ...] | None = None
        self._weight_views: list[Tensor] = []
        self._weight_owners: tuple[int, ...] = ()
        self._handle = register_optimizer_step_post_hook(self._hook)

    def close(self) -> None:
        """Stop observing optimizer steps."""
        self._handle.remove()
        self._replays.clear()

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The global post-step hook: a never-crash boundary (an error makes the step's
        update unmeasured, logged once; the training step itself already happened)."""
        try:
            self.after_step(optimizer)
        except Exception as exc:  # never-crash boundary: the update is unmeasured, logged
            self._unmeasured = True
            self._weights_changed(None, ())
            self._warn("error", "gradwatch: the optimizer update could not be measured "
                       "(%s: %s); update figures are unmeasured", type(exc).__name__, exc)

    def after_step(self, optimizer: Any) -> None:
        """Measure the update ``optimizer`` just applied to the watched parameters it holds
        (each overwrites its previous figures); others' steps are ignored. A step like the
        previous one of a compiled Adam repeats its prepared calls
        (:mod:`gradwatch.norms.update_replay`). The compiled kernels also leave the squares of
        the weights they read (:meth:`_weights_changed`)."""
        replayed = self._replays.run(optimizer, self._updates)
        if replayed is not None:
            self._weights_changed(replayed, ())
            return
        held = [
            (group, p, i)
            for group in optimizer.param_groups
            for p in group["params"]
            for i in (self._position.get(id(p)),)
            if i is not None
        ]
        parts = [
            (group, p, fragment)
            for group in optimizer.param_groups
            for p in group["params"]
            for fragment in self._fragments.get(id(p), ())
        ]
        if not held and not parts:
            return
        kind = optimizer_kind(optimizer)
        if kind is None:
            self._unmeasured = True
            self._weights_changed(None, ())
            self._warn("kind", "gradwatch: update_stats cannot read %s's steps (supported: "
                       "torch.optim SGD, Adam, AdamW); update figures are unmeasured",
                       type(optimizer).__name__)
            return
        self.fused.ran.clear()
        measured = []
        weighed: set[int] = set()
        unweighed: set[int] = set()
        with torch.no_grad():
            for group, batch in _batches(kind, optimizer, held) + _fragment_batches(
                kind, optimizer, parts
            ):
                figures = self._batch_figures(kind, optimizer, group, batch)
                owners = self._index_of(tuple(batch.owners))
                with_weights = figures.shape[0] == 4  # a compiled kernel's: weights included
                rows = self._updates if with_weights else self._updates[1:]
                rows.index_fill_(1, owners, 0.0)
                rows.index_add_(1, owners, figures.to(self._device))
                (weighed if with_weights else unweighed).update(batch.owners)
                measured.append((group, owners, len(set(batch.owners)) == len(batch.owners)))
        self._weights_changed(weighed - unweighed, unweighed)
        if kind == _Kind.ADAM and not parts:  # the next steps repeat the compiled calls
            self._replays.record(optimizer, [p for _, p, _ in held], measured, sorted(weighed))
        self.fused.ran.clear()  # no reference to the step's tensors (SGD's gradients) kept

    def _weights_changed(self, weighed: Collection[int] | None, unweighed: Collection[int]
                         ) -> None:
        """After a step: the pieces whose weight squares its compiled kernels measured
        (``weighed``) keep the stamp they have now; those it stepped eagerly (``unweighed``:
        no squares) lose theirs; None: the step may have changed any weight, every piece's
        squares are read at the next collect."""
        if weighed is None:
            self._weighed = [None] * len(self._params)
            return
        now = self._stamps()
        if not unweighed and len(weighed) == len(now):  # every piece (a whole replayed step)
            self._weighed = now
            return
        for i in weighed:
            self._weighed[i] = now[i]
        for i in unweighed:
            self._weighed[i] = None

    def _stamps(self) -> list[tuple[int, int] | None]:
        """Each local piece's storage and version counter (bumped by every in-place op)."""
        return [(t.data_ptr(), t._version) for t in map(_local, self._params)]

    def _batch_figures(self, kind: str, optimizer: Any, group: dict[str, Any],
                       batch: _Batch) -> Tensor:
        """One batch's figures: ``4 x views`` from a compiled kernel (the weight squares
        first), else ``3 x views``: :func:`wide_figures` from the weights before
        the decay for float32/float64 weights, :func:`narrow_figures` from the intended
        update for bf16/fp16."""
        keep = _keep(optimizer, batch.params[0].device)
        fused = self.fused.batch_figures(kind, optimizer, group, batch, keep)
        if fused is not None:
            return fused
        if batch.params[0].dtype not in NARROW:
            if kind == _Kind.ADAM:
                mid, c = _before_decay_adam(batch, group, keep)
                marks, meant = batch.tensors["m"], _nonzero_rate(group, keep)
            else:
                marks, c = _intended_sgd(batch, group, optimizer, keep)
                meant = 1.0
                if isinstance(c, float) and c == 0.0:  # u is counted: kept
                    mid = list(torch._foreach_add(marks, batch.params))
                else:  # in place (the decay's count needs no marks): three temporaries
                    torch._foreach_add_(marks, batch.params)
                    mid = marks
            return wide_figures(batch, mid, c, marks, meant)
        if kind == _Kind.ADAM:
            u, c = _intended_adam(batch, group, keep)
        else:
            u, c = _intended_sgd(batch, group, optimizer, keep)
        return narrow_figures(batch, u, c)

    def _index_of(self, positions: tuple[int, ...]) -> Tensor:
        """The positions as a device index, built once per pattern (one non-blocking copy)."""
        index = self._indices.get(positions)
        if index is None:
            if len(self._indices) >= 16:
                self._indices.pop(next(iter(self._indices)))
            index = self._indices[positions] = host_to_device(
                positions, torch.long, self._device
            )
        return index

    def figures(self, count_all: bool) -> Section:
        """This rank's update section for the packed vector (``4G + 2`` float64, see
        :func:`section_width`): per group the weights' and the updates'
        squared norms, stalled and moving elements, over the pieces this rank counts (every
        piece when ``count_all``: the collect does not all-reduce); then 1 when some step
        could not be measured, 1 when there is no previous collect. Clears the update
        figures. The weight squares are those the steps' compiled kernels left, read again
        (:meth:`_measure_weights`) when some piece's storage or version changed since it was
        measured (an in-place change after the step, new data, a step measured eagerly, the
        first collect). No host read of a device: a CPU meter of at most
        :data:`~gradwatch.norms.update_section.HOST_SECTION_PIECES` pieces sums its figures as
        Python floats (the same bits as the eager tensor route); else a constant number of
        ops, or one compiled call once it is ready (:mod:`gradwatch.norms.update_section`)."""
        now = self._stamps()
        if now != self._weighed:
            self._measure_weights()
            self._weighed = now
        out = self._section.of(self._updates, count_all, (self._unmeasured, not self._armed))
        self._update_rows.zero_()
        self._armed, self._unmeasured = True, False
        return out

    def _measure_weights(self) -> None:
        """Every piece's weight squares into the figures' first row: one compiled call
        (:func:`gradwatch.norms.fused_updates.weight_squares`) once ready, else
        :meth:`_weight_squares`."""
        squares = self.fused.weights([_local(p) for p in self._params])
        if squares is None:
            squares = self._weight_squares()
        self._updates[0].copy_(squares)

    def _weight_squares(self) -> Tensor:
        """Each local piece's squared norm: float32 norms of views of at most
        :data:`WEIGHT_ROWS` elements (relative error about 1e-7 each), squared and summed per
        piece in float64: one norm pass over the weights, a constant number of ops, no host
        read. The views are kept while every piece's storage and size stay (a parameter
        whose data was replaced gets new views)."""
        locals_ = [_local(p) for p in self._params]
        key = tuple((t.data_ptr(), t.numel()) for t in locals_)
        if key != self._weight_key:
            views: list[Tensor] = []
            owners: list[int] = []
            for i, t in enumerate(locals_):
                parts = [v for v in _views(t.detach(), WEIGHT_ROWS) if v.numel()]
                views += parts
                owners += [i] * len(parts)
            self._weight_views, self._weight_owners = views, tuple(owners)
            self._weight_key = key
        out = torch.zeros(len(self._params), dtype=torch.float64, device=self._device)
        if self._weight_views:
            with torch.no_grad():
                squares = _norms(self._weight_views).square().to(self._device)
            out.index_add_(0, self._index_of(self._weight_owners), squares)
        return out

    def _warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
