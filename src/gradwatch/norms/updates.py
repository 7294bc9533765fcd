"""Optimizer-update health, per rank: weight norms, the applied update, stalled elements.

What an optimizer step did to the weights, measured without a copy of the parameters.

**The applied update, recovered.** After ``optimizer.step()`` the parameter holds
``p_new = rnd(rnd(p_old * (1 - c)) - u)``, where ``u`` is the optimizer's intended step (from
its state, which the step just updated), ``c`` the decoupled weight decay (``lr * wd``; 0 when
there is none) and ``rnd`` rounding to the parameter's dtype. Given ``p_new``, ``u`` and ``c``,
this module inverts the step (:func:`recover`): ``p_mid = rnd(p_new + u)``, ``p_old =
rnd(p_mid / (1 - c))``, computed in float64 and rounded back to the parameter's dtype. Every
value of the dtype is a grid point, and ``p_new + u`` lies within half a unit in the last place
(ulp) of ``p_mid`` (the step's own rounding), plus the difference between this float64 ``u``
and the one the optimizer computed in its own precision (a few ulps *of u*, far below an ulp of
``p`` whenever ``|u| << |p|``); so the nearest grid point is ``p_mid`` itself except for
elements whose rounding error lay within that difference of a tie, where it is the neighbour:
an error of one ulp of ``p`` on a few elements. The applied update is then ``delta = p_new -
p_old``, exact in float64 (a difference of two values of a narrower dtype), and its squared
norm, the elements whose intended update was non-zero and those where it was rounded away
(``delta == 0``: the intended change was under half an ulp of the weight) are summed per
parameter in float64. Nothing is copied but one chunk at a time (:data:`CHUNK` elements).

Why not the alternatives. ``||p_new - p_old||^2 = ||p_new||^2 + ||p_old||^2 - 2<p_new, p_old>``
from norms alone cancels catastrophically: an update of relative size 1e-4 leaves 1e-8 of the
squared weight norm, below float32's and near float64's rounding of the three terms. The
intended update ``||u||`` alone is not the applied one for bf16/fp16 weights (an update under
half an ulp is rounded away, yet ``u`` says it moved). A shadow copy of the weights costs
their bytes (or half of them for low bits only); this reads the optimizer's state instead.

**Which optimizers** (:func:`intended_step`): ``torch.optim.SGD`` (momentum, dampening,
Nesterov, weight decay, ``maximize``), ``Adam`` and ``AdamW`` (``amsgrad``, ``maximize``, L2
or decoupled weight decay), each for-loop, ``foreach`` or ``fused``, with ``lr`` a float or a
tensor. A fused step skipped by ``found_inf`` (GradScaler, the optimizer-step guard) changed
nothing: ``u`` and ``c`` are multiplied by ``1 - found_inf`` on the device, and a fused SGD's
gradients are divided by its ``grad_scale`` (the kernel unscales them, ``.grad`` stays
scaled). Any other optimizer holding a watched parameter makes the step's update unmeasured
(the snapshot's update figures are None, logged once), never a guess.

**When.** A global optimizer step post-hook (``register_optimizer_step_post_hook``) measures
every step of an optimizer holding watched parameters; each parameter's figures overwrite the
previous step's, so a collect publishes the update of the last step that updated each parameter
(with ``every_n_steps > 1``: of the last step before the collect, not the sum since the
previous collect). :meth:`UpdateMeter.figures` (the collect) adds the weight norms, sums per
group over the pieces this rank counts, and clears the update figures: a collect with no
optimizer step since the previous one publishes an update of 0 (the weights did not change),
which is how a skipped step is seen. The first collect has no previous one (marked, so the
update figures are None). No host read anywhere: learning rates, step counts and ``found_inf``
stay tensors; the per-group sums are device ops.

Cost: a float64 pass over the parameters on every optimizer step (about twenty elementwise
ops per chunk) and a float64-accumulating norm of the weights per collect; persistent memory
``3 x parameters`` float64 figures, temporaries of a few chunks (:data:`CHUNK` elements).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from gradwatch.norms.rows import foreach_splits, host_to_device
from gradwatch.norms.stats import foreach_norms

log = logging.getLogger("gradwatch")

#: Elements read per float64 temporary: bounds the pass's extra memory (about five of these).
CHUNK = 1 << 16

Scalar = float | Tensor


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise), detached: no copy."""
    return getattr(t, "_local_tensor", t).detach()


def _chunks(t: Tensor) -> list[Tensor]:
    """``t``'s elements as flat views of at most :data:`CHUNK` (one view when it has no flat
    view: not contiguous)."""
    if not t.is_contiguous():
        return [t]
    return list(t.view(-1).split(CHUNK))


def recover(
    p_new: Tensor, u: Tensor, c: Scalar, dtype: torch.dtype, decay_rounded: bool = True
) -> tuple[Tensor, Tensor]:
    """The weights before the step and whether each element's intended update was non-zero,
    in float64, from the weights after it (``p_new``, float64), the intended step ``u``
    (float64) and the decay ``c`` (see the module docstring: each rounding of the step is
    inverted by rounding to ``dtype``). ``decay_rounded``: the step rounded the decayed
    weights before subtracting ``u`` (Adam's decoupled decay), else once at the end (SGD's
    ``p - lr * (g + wd * p)``)."""
    if isinstance(c, float) and c == 0.0:
        old = (p_new + u).to(dtype).to(torch.float64)
        return old, u != 0
    if decay_rounded:
        mid = (p_new + u).to(dtype).to(torch.float64)
        old = (mid / (1 - c)).to(dtype).to(torch.float64)
    else:
        old = ((p_new + u) / (1 - c)).to(dtype).to(torch.float64)
    return old, (u + old * c) != 0


def _scalar(value: Any, device: torch.device) -> Scalar:
    """A hyperparameter as a Python float or a float64 tensor on ``device`` (no host read)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float64)
    return float(value)


class _Kind:
    """The optimizers whose step this module inverts."""

    SGD = "sgd"
    ADAM = "adam"


def optimizer_kind(optimizer: Any) -> str | None:
    """Which inversion applies to ``optimizer`` (its exact type: a subclass may step
    otherwise), None for any other optimizer."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return _Kind.SGD
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return _Kind.ADAM
    return None


def intended_step(
    kind: str, group: dict[str, Any], state: dict[str, Any], param: Tensor, optimizer: Any
) -> tuple[list[Tensor], list[Tensor], Scalar]:
    """For one parameter after the step: the chunks of its intended update ``u`` (float64, as
    a list aligned with :func:`_chunks` of the parameter), its weights' chunks, and the
    decoupled decay ``c`` (``p_new = rnd(rnd(p_old (1 - c)) - u)``). Raises ``KeyError`` when
    the state lacks what the step left there."""
    p = _local(param)
    dev = p.device
    lr = _scalar(group["lr"], dev)
    keep = _keep(optimizer, dev)
    if kind == _Kind.ADAM:
        u, c = _adam_step(group, state, lr, dev)
    else:
        u, c = _sgd_step(group, state, param, lr, optimizer, dev)
    if keep is not None:
        u = [x * keep for x in u]
        c = c * keep
    return u, _chunks(p), c


def _keep(optimizer: Any, device: torch.device) -> Tensor | None:
    """``1 - found_inf`` when a fused step may have been skipped on the device, else None."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is None:
        return None
    return 1 - found_inf.to(device=device, dtype=torch.float64)


def _adam_step(
    group: dict[str, Any], state: dict[str, Any], lr: Scalar, dev: torch.device
) -> tuple[list[Tensor], Scalar]:
    """Adam/AdamW: ``u = lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` with the bias
    corrections of the step count the step left (``amsgrad``: the running max of ``v``); L2
    weight decay is inside ``m`` and ``v`` already, decoupled decay is ``c = lr * wd``."""
    beta1, beta2 = group["betas"]
    beta1, beta2 = _scalar(beta1, dev), _scalar(beta2, dev)
    step = state["step"].to(device=dev, dtype=torch.float64)
    bc1 = 1 - torch.pow(beta1, step)
    bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    step_size = lr / bc1
    eps = float(group["eps"])
    v_key = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
    m_chunks = _chunks(_local(state["exp_avg"]))
    v_chunks = _chunks(_local(state[v_key]))
    u = [
        step_size * m.to(torch.float64) / (v.to(torch.float64).sqrt() / bc2_sqrt + eps)
        for m, v in zip(m_chunks, v_chunks, strict=True)
    ]
    decoupled = group.get("decoupled_weight_decay", False)
    wd = float(group["weight_decay"])
    c: Scalar = lr * wd if decoupled and wd != 0.0 else 0.0
    return u, c


def _sgd_step(
    group: dict[str, Any],
    state: dict[str, Any],
    param: Tensor,
    lr: Scalar,
    optimizer: Any,
    dev: torch.device,
) -> tuple[list[Tensor], Scalar]:
    """SGD: ``p_new = p_old - lr * d`` with ``d = buf`` (momentum, the buffer the step left,
    weight decay inside it), else ``d = g + wd * p_old (+ mu * buf, Nesterov)``: then ``u =
    lr * (g + mu * buf)`` and the decay ``c = lr * wd`` acts like a decoupled one (``g`` is
    ``-grad`` under ``maximize``, unscaled by a fused step's ``grad_scale``)."""
    mu = float(group["momentum"])
    wd = float(group["weight_decay"])
    buf = state.get("momentum_buffer") if mu != 0.0 else None
    if buf is not None and not group["nesterov"]:
        return [lr * b.to(torch.float64) for b in _chunks(_local(buf))], 0.0
    grad = _local(param.grad)
    sign = -1.0 if group["maximize"] else 1.0
    scale = getattr(optimizer, "grad_scale", None)
    inv = sign if scale is None else sign / scale.to(device=dev, dtype=torch.float64)
    g_chunks = _chunks(grad)
    b_chunks = _chunks(_local(buf)) if buf is not None else [None] * len(g_chunks)
    u = []
    for g, b in zip(g_chunks, b_chunks, strict=True):
        d = g.to(torch.float64) * inv
        if b is not None:
            d = d + mu * b.to(torch.float64)
        u.append(lr * d)
    return u, (lr * wd if wd != 0.0 else 0.0)


def parameter_figures(
    u: Sequence[Tensor], p: Sequence[Tensor], c: Scalar, dtype: torch.dtype,
    decay_rounded: bool = True,
) -> Tensor:
    """``[||delta||^2, stalled elements, elements with an intended update]`` of one parameter
    (float64, on its device) from its chunks (:func:`intended_step`)."""
    out = torch.zeros(3, dtype=torch.float64, device=p[0].device if p else None)
    for u_k, p_k in zip(u, p, strict=True):
        new = p_k.to(torch.float64)
        old, moving = recover(new, u_k, c, dtype, decay_rounded)
        delta = new - old
        out[0] += torch.dot(delta.reshape(-1), delta.reshape(-1))
        out[1] += (moving & (delta == 0)).sum()
        out[2] += moving.sum()
    return out


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

    Thread-safety: :meth:`after_step` and :meth:`figures` run on the training thread.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        group_index: Sequence[int],
        groups: int,
        contributes: Sequence[bool],
        device: torch.device,
    ) -> None:
        self._params = list(params)
        self._position = {id(p): i for i, p in enumerate(self._params)}
        self._groups = groups
        self._device = device
        self._group = torch.tensor(list(group_index), dtype=torch.long, device=device)
        self._mask = torch.tensor(list(contributes), dtype=torch.bool, device=device)
        self._all = torch.ones_like(self._mask)
        self._updates = torch.zeros(3, len(self._params), dtype=torch.float64, device=device)
        self._splits = foreach_splits([_local(p).numel() for p in self._params])
        self._armed = False  # a collect packed figures before: the next one has an update
        self._unmeasured = False  # a step this module cannot invert touched a parameter
        self._warned: set[str] = set()
        self._indices: dict[tuple[int, ...], Tensor] = {}
        self._handle = register_optimizer_step_post_hook(self._hook)

    def close(self) -> None:
        """Stop observing optimizer steps."""
        self._handle.remove()

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The global post-step hook: a never-crash boundary (an error makes the step's
        update unmeasured, logged once; the training step itself already happened)."""
        try:
            self.after_step(optimizer)
        except Exception as exc:  # never-crash boundary: the update is unmeasured, logged
            self._unmeasured = True
            self._warn("error", "gradwatch: the optimizer update could not be measured "
                       "(%s: %s); update figures are unmeasured", type(exc).__name__, exc)

    def after_step(self, optimizer: Any) -> None:
        """Measure the update ``optimizer`` just applied to the watched parameters it holds
        (each overwrites its previous figures); others' steps are ignored."""
        held = [
            (group, p, i)
            for group in optimizer.param_groups
            for p in group["params"]
            for i in (self._position.get(id(p)),)
            if i is not None
        ]
        if not held:
            return
        kind = optimizer_kind(optimizer)
        if kind is None:
            self._unmeasured = True
            self._warn("kind", "gradwatch: update_stats cannot read %s's steps (supported: "
                       "torch.optim SGD, Adam, AdamW); update figures are unmeasured",
                       type(optimizer).__name__)
            return
        rows: list[Tensor] = []
        at: list[int] = []
        for group, p, i in held:
            if p.grad is None:  # the optimizer left it alone this step
                continue
            state = optimizer.state.get(p, {})
            if kind == _Kind.ADAM and not state:
                continue
            u, chunks, c = intended_step(kind, group, state, p, optimizer)
            figures = parameter_figures(u, chunks, c, p.dtype, kind == _Kind.ADAM)
            rows.append(figures.to(self._device))
            at.append(i)
        if rows:
            self._updates.index_copy_(1, self._index_of(tuple(at)), torch.stack(rows, dim=1))

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

    def figures(self, count_all: bool) -> Tensor:
        """This rank's update section for the packed vector (``4G + 2`` float64, see
        :func:`gradwatch.layout.update_width`): per group the weights' and the updates'
        squared norms, stalled and moving elements, over the pieces this rank counts (every
        piece when ``count_all``: the collect does not all-reduce); then 1 when some step
        could not be measured, 1 when there is no previous collect. Clears the update
        figures. A constant number of ops, no host read."""
        weights = [_local(p) for p in self._params]
        norms = foreach_norms(weights, self._splits).to(self._device)
        local = torch.cat([(norms * norms).unsqueeze(0), self._updates])
        counted = torch.where(self._all if count_all else self._mask, local, 0.0)
        sums = torch.zeros(4, self._groups, dtype=torch.float64, device=self._device)
        sums.index_add_(1, self._group, counted)
        tail = torch.zeros(2, dtype=torch.float64, device=self._device)
        tail[0].fill_(float(self._unmeasured))
        tail[1].fill_(float(not self._armed))
        self._updates.zero_()
        self._armed, self._unmeasured = True, False
        return torch.cat([sums.reshape(-1), tail])

    def _warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)
