"""The optimizer-step guard: skip the update of a step whose gradients are non-finite or spike.

``watch.guard(optimizer)`` returns a :class:`GuardedOptimizer`. Its ``step()`` applies the
optimizer's update unless the guard decides to skip this step; every other attribute
(``zero_grad``, ``param_groups``, ``state_dict``, LR schedulers) reaches the optimizer
unchanged.

The decision (:class:`StepGuard`) is a device tensor computed from the step's reduced vector
(:class:`~gradwatch.reduce.ReducedVector`), the same bits on every rank:

* ``nonfinite``: some rank flagged NaN/Inf in some gradient, or the whole-model norm is not
  finite (``skip_nonfinite``); ``ln(norm)`` comes straight from the reduced bands,
  ``0.5 * logsumexp(ln(band sums) + ln(band scales))``, which never leaves float64;
* ``spike``: ``score = (ln(norm) - m) / max(1.4826 * MAD, 0.05)`` exceeds
  ``skip_spike_score``, where ``m`` and MAD are the median and median absolute deviation of the
  last ``spike_window`` samples of ``ln(norm)``, kept on the device in a shift register (the
  definition of :mod:`gradwatch.spikes`). A sample is a step whose gradients were all finite
  and whose norm is positive; every sample enters the window, skipped spikes too, so a lasting
  change of level becomes normal after ``spike_window / 2`` steps. The score is defined once
  the window holds ``spike_warmup`` samples;
* ``max_consecutive_skips``: the guard skips at most that many steps in a row; a further step
  it would skip is applied (the guard has *stopped*, ``gradwatch_guard_stopped`` 1 and the
  alert says why) until a step it would not skip re-arms it;
* a step some rank failed to measure (NaN step slot) is never skipped: a guard that cannot see
  does not act.

Why the bits agree on every rank: the inputs are the reduced vector (the result of one
all-reduce, identical everywhere) or, under plain DDP without gradwatch's all-reduce, each
rank's own norms of DDP's already reduced gradients, which are bitwise identical across ranks
(one all-reduce result, divided by the same world size), normed by the same kernels; every
later op is a deterministic function of those values and of the guard's own device state,
which starts equal and is updated by the same ops on every rank.

Sync behaviour: no host read and no collective of its own (the collect it uses makes its usual
one, or none under plain DDP). With an optimizer that accepts ``found_inf``
(``fused=True`` Adam, AdamW, SGD: ``_step_supports_amp_scaling``) the decision is handed to it
as ``found_inf`` the way ``torch.amp.GradScaler`` does, so the kernel skips the update on the
device and the step counters are restored (``step += 1 - found_inf``). Any other optimizer
costs one host read of the decision per step (``bool(skip)``). With a GradScaler, the
scaler's ``found_inf`` and the guard's decision are combined (``max``): one skip. The scaler
already skips every step with a non-finite gradient (``gradwatch_amp_skipped_steps_total``
counts them), so under a scaler the guard's own skips are the spike skips.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.config import WatchConfig
from gradwatch.reduce import ReducedVector, _wait_event
from gradwatch.spikes import MAD_TO_SIGMA, MIN_LOG_SPREAD
from gradwatch.stats import BANDS, HIGH_SHIFT, LOW_SHIFT

__all__ = ["GuardDecision", "GuardPolicy", "GuardReading", "GuardedOptimizer", "StepGuard"]

log = logging.getLogger("gradwatch")

#: The reasons of ``gradwatch_skipped_steps_total``, in decision-vector order.
SKIP_REASONS = ("nonfinite", "spike")

#: ``ln`` of the largest float64: a larger whole-model norm reads +Inf (non-finite) elsewhere.
_LN_FLOAT64_MAX = math.log(sys.float_info.max)

# Offsets of the decision vector (float64): whether the step is skipped, whether it would
# be for a non-finite gradient, for a spike, for either; the score, the consecutive skips,
# the steps skipped so far and those skipped for a non-finite gradient.
_SKIP, _NONFINITE, _SPIKE, _WANT, _SCORE, _CONSECUTIVE, _SKIPPED, _SKIPPED_NONFINITE = range(8)


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard skips: the guard fields of :class:`~gradwatch.config.WatchConfig`."""

    skip_nonfinite: bool
    skip_spike_score: float | None
    max_consecutive_skips: int
    window: int
    warmup: int

    @classmethod
    def from_config(cls, cfg: WatchConfig) -> GuardPolicy:
        policy = cls(
            skip_nonfinite=cfg.skip_nonfinite,
            skip_spike_score=cfg.skip_spike_score,
            max_consecutive_skips=cfg.max_consecutive_skips,
            window=cfg.spike_window,
            warmup=cfg.spike_warmup,
        )
        if not policy.skip_nonfinite and policy.skip_spike_score is None:
            raise ValueError(
                "gradwatch: guard() has nothing to skip: set skip_nonfinite=True "
                "(GRADWATCH_SKIP_NONFINITE) and/or skip_spike_score (GRADWATCH_SKIP_SPIKE_SCORE)"
            )
        return policy


@dataclass(frozen=True)
class GuardReading:
    """The host copy of one decision (read off the training thread, for the snapshot).

    Attributes:
        skipped: ``"nonfinite"`` or ``"spike"`` when the guard skipped the step, else None.
        consecutive: consecutive skipped steps up to and including this one.
        stopped: the guard would have skipped this step but had already skipped
            ``max_consecutive_skips`` in a row, so it applied it.
        score: the guard's global spike score (NaN while undefined or with spikes off).
        totals: skipped steps so far by reason (every guarded step, published or not).
    """

    skipped: str | None
    consecutive: int
    stopped: bool
    score: float
    totals: dict[str, int]

    @classmethod
    def from_values(cls, values: Sequence[float]) -> GuardReading:
        skipped = None
        if values[_SKIP] > 0:
            skipped = "nonfinite" if values[_NONFINITE] > 0 else "spike"
        skipped_all, skipped_nonfinite = int(values[_SKIPPED]), int(values[_SKIPPED_NONFINITE])
        return cls(
            skipped=skipped,
            consecutive=int(values[_CONSECUTIVE]),
            stopped=values[_WANT] > 0 and not values[_SKIP] > 0,
            score=float(values[_SCORE]),
            totals=dict(
                zip(SKIP_REASONS, (skipped_nonfinite, skipped_all - skipped_nonfinite), strict=True)
            ),
        )

    def snapshot_fields(self) -> dict[str, Any]:
        """The :class:`~gradwatch.snapshot.Snapshot` fields this reading sets."""
        return {
            "guard_skipped": self.skipped,
            "consecutive_skipped_steps": self.consecutive,
            "guard_stopped": self.stopped,
            "skipped_steps": self.totals,
        }


class GuardDecision:
    """One step's decision: the device tensor the optimizer step uses (``skip``), and a host
    copy of the whole decision that the snapshot reads later, off the training thread.

    ``parts``: the decision's 0-dim tensors, in decision-vector order; tensors
    the guard never writes again (it replaces its state each step), so on the CPU they are
    packed only when read; on CUDA they are packed at once and copied, non-blocking, to pinned
    memory with an event, as :class:`~gradwatch.reduce.ReducedVector` does.
    """

    def __init__(self, skip: Tensor, parts: Sequence[Tensor], timeout: float) -> None:
        self.skip = skip
        self._parts = tuple(parts)
        self._timeout = timeout
        self._reading: GuardReading | None = None
        if skip.device.type != "cpu":  # CUDA path, untested on this project's machines
            vector = _pack(self._parts)
            self._pinned = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            self._pinned.copy_(vector, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(vector.device))

    def found_inf(self, device: torch.device) -> Tensor:
        """The skip as a float32 ``found_inf`` (1.0: skip) on ``device``, no host read."""
        return self.skip.to(device=device, dtype=torch.float32, non_blocking=True)

    def reading(self) -> GuardReading:
        """Read the decision to the host (once; waits at most ``collective_timeout_seconds``
        for the device on CUDA)."""
        if self._reading is None:
            if self.skip.device.type != "cpu":
                _wait_event(self._event, self._timeout, "the guard's decision")
                values = self._pinned.tolist()
            else:
                values = _pack(self._parts).tolist()
            self._reading = GuardReading.from_values(values)
        return self._reading


def _pack(parts: Sequence[Tensor]) -> Tensor:
    """The decision vector (float64) of the 0-dim parts."""
    return torch.stack([t.to(torch.float64) for t in parts])


class StepGuard:
    """The guard's device state and its decision per step (see the module docstring).

    State on the reduce device: the window of recent log-norms (NaN: empty slot), the number of
    samples seen, the consecutive skips and the skip totals. All updated by device ops only.
    """

    def __init__(
        self, policy: GuardPolicy, device: torch.device, timeout: float, amp: bool = False
    ) -> None:
        self.policy = policy
        # Under a GradScaler the scaler skips non-finite steps itself (counted as AMP-skipped):
        # the guard adds its spike skips only, identically with fused and other optimizers.
        self._skip_nonfinite = policy.skip_nonfinite and not amp
        self._timeout = timeout
        f64 = {"dtype": torch.float64, "device": device}
        self._window = torch.full((policy.window,), math.nan, **f64)
        self._samples = torch.zeros((), dtype=torch.int64, device=device)
        # the two middle positions of a sorted window of n samples: (n - 1) // 2 and n // 2
        self._middle_offsets = torch.tensor([-1, 0], dtype=torch.int64, device=device)
        self._consecutive = torch.zeros((), **f64)
        self._skipped = torch.zeros((), **f64)  # every skip so far
        self._skipped_nonfinite = torch.zeros((), **f64)  # the non-finite ones
        self._nan = torch.full((), math.nan, **f64)
        self._zero = torch.zeros((), **f64)
        # ln of each band's scale: ln(total^2) = logsumexp(ln(band sums) + these)
        self._band_logs = torch.tensor(
            [0.0, HIGH_SHIFT * math.log(2.0), -LOW_SHIFT * math.log(2.0)], **f64
        )
        self._logged: set[str] = set()

    def decide(self, reduced: ReducedVector) -> GuardDecision:
        """This step's decision from its reduced vector; updates the state. No host read."""
        policy = self.policy
        # ln(norm) straight from the bands (a few ops, never outside float64): -inf for a zero
        # norm, NaN or +inf when a gradient was non-finite.
        sums = reduced.device_bands().view(BANDS, -1).sum(dim=1)
        log_norm = torch.logsumexp(sums.log() + self._band_logs, dim=0) * 0.5
        finite = (log_norm < _LN_FLOAT64_MAX) & (reduced.device_nonfinite().sum() == 0)
        nonfinite = ~finite
        step = reduced.device_step()
        measured = step == step  # NaN: some rank's local pass failed
        want_nonfinite = nonfinite if self._skip_nonfinite else torch.zeros_like(nonfinite)
        score = self._nan
        if policy.skip_spike_score is not None:
            score, want_spike = self._spike(log_norm, finite, policy.skip_spike_score)
        else:
            want_spike = torch.zeros_like(nonfinite)
        want = (want_nonfinite | want_spike) & measured
        consecutive = self._consecutive
        limit = float(policy.max_consecutive_skips)
        skip = want & (consecutive < limit)
        self._consecutive = torch.where(want, torch.clamp(consecutive + 1.0, max=limit), self._zero)
        self._skipped = self._skipped + skip
        self._skipped_nonfinite = self._skipped_nonfinite + (skip & want_nonfinite)
        parts = (skip, want_nonfinite, want_spike, want, score, self._consecutive,
                 self._skipped, self._skipped_nonfinite)  # fmt: skip
        return GuardDecision(skip, parts, self._timeout)

    def _spike(self, x: Tensor, finite: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
        """The global spike score of ``x = ln(norm)`` against the window, whether it spikes,
        and the window updated with this step's sample (finite, positive norms only)."""
        window = self._window
        sample = finite & (x > -math.inf)
        # The median of the n samples: sorted, empty (NaN) slots last; the mean of the two
        # middle ones for an even n, as the host detector's (torch.nanmedian takes the lower).
        n = torch.clamp(self._samples, max=self.policy.window)
        middle = (n + self._middle_offsets).div_(2, rounding_mode="floor").clamp_(min=0)
        median = torch.sort(window).values.index_select(0, middle).mean()
        deviations = torch.sort((window - median).abs()).values
        mad = deviations.index_select(0, middle).mean()
        score = (x - median) / torch.clamp(mad * MAD_TO_SIGMA, min=MIN_LOG_SPREAD)
        defined = sample & (self._samples >= self.policy.warmup)
        score = torch.where(defined, score, self._nan)
        self._window = torch.where(sample, torch.cat((window[1:], x.view(1))), window)
        self._samples = self._samples + sample
        return score, score > threshold  # NaN (undefined) is never above it

    def report(self, reading: GuardReading, step: int, rank: int) -> None:
        """Log a skip (the first of each reason) and the guard stopping (each time it starts
        letting bad steps through), on rank 0: after the host read, off the training thread."""
        if rank != 0:
            return
        if reading.skipped is not None and reading.skipped not in self._logged:
            self._logged.add(reading.skipped)
            log.warning(
                "gradwatch: guard skipped the optimizer step of step %d (%s gradients); "
                "gradwatch_skipped_steps_total counts every skip (logged once per reason)",
                step,
                reading.skipped,
            )
        if reading.stopped and "stopped" not in self._logged:
            self._logged.add("stopped")
            log.error(
                "gradwatch: guard stopped skipping at step %d: %d consecutive steps were "
                "already skipped (max_consecutive_skips); bad steps are applied until a "
                "healthy one re-arms it (gradwatch_guard_stopped)",
                step,
                self.policy.max_consecutive_skips,
            )
        elif not reading.stopped and reading.skipped is None:
            self._logged.discard("stopped")


class GuardedOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` is skipped when the guard says so.

    A :class:`torch.optim.Optimizer` (LR schedulers, Hugging Face and Lightning accept it) that
    owns no state of its own: ``param_groups``, ``state``, ``defaults``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``, ``add_param_group`` and every other attribute are the
    wrapped optimizer's. Build it with :meth:`gradwatch.GradWatch.guard`.

    ``step()`` uses the decision of this step's collect (``watch.collect``,
    ``watch.clip_grad_norm_``) when one was made since the last ``step()``, otherwise it
    collects first. A skipped step leaves parameters and optimizer state untouched: the fused
    optimizers' step counters are restored on the device, other optimizers' ``step()`` is not
    called at all (as ``GradScaler`` does). LR schedulers still advance when the loop calls
    ``scheduler.step()``, as after a GradScaler-skipped step.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        decide: Callable[[Any], GuardDecision | None],
    ) -> None:
        # No Optimizer.__init__: the wrapped optimizer owns the parameters and the state.
        self.__dict__["optimizer"] = optimizer
        self.__dict__["_decide"] = decide

    # -- the wrapped optimizer's state ---------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks: hooks, flags, custom methods.
        return getattr(self.__dict__["optimizer"], name)

    def __getstate__(self) -> dict[str, Any]:
        return self.optimizer.__getstate__()

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    # -- the guarded step ----------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Apply the wrapped optimizer's update unless the guard skips this step; return the
        closure's loss (None without one).

        ``closure`` (Lightning passes one) is evaluated once, with gradients enabled, before
        the decision, as torch's optimizers do; optimizers that evaluate it several times per
        step (LBFGS) cannot be guarded. ``GradScaler.step(guarded)`` works as with the bare
        optimizer: for fused optimizers the scaler sets ``grad_scale`` and ``found_inf`` on
        this wrapper and the guard passes its ``found_inf`` combined with the scaler's; for
        others the scaler reads its own ``found_inf`` and calls this ``step()`` only when it
        is 0.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.optimizer
        decision = self._decide(self)
        if decision is None:  # not measured (a failed collect): a guard that cannot see
            inner.step()
            return loss
        scaler_found_inf = self.__dict__.get("found_inf")
        if getattr(inner, "_step_supports_amp_scaling", False):
            device = _params_device(inner)
            found_inf = decision.found_inf(device)
            if scaler_found_inf is not None:
                found_inf = torch.maximum(found_inf, scaler_found_inf.to(device, torch.float32))
            _step_with(inner, found_inf, self.__dict__.get("grad_scale"))
            return loss
        if not bool(decision.skip):  # the one host read of optimizers without found_inf
            inner.step()
        return loss


def _params_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def _step_with(inner: torch.optim.Optimizer, found_inf: Tensor, grad_scale: Any) -> Any:
    """``inner.step()`` with ``found_inf`` (and the scaler's ``grad_scale``) set as the
    attributes ``fused`` optimizers read, as ``GradScaler.step`` sets them; restored after."""
    saved = {k: inner.__dict__[k] for k in ("found_inf", "grad_scale") if k in inner.__dict__}
    inner.found_inf = found_inf  # type: ignore[attr-defined]
    if grad_scale is not None:
        inner.grad_scale = grad_scale  # type: ignore[attr-defined]
    try:
        return inner.step()
    finally:
        for k in ("found_inf", "grad_scale"):
            inner.__dict__.pop(k, None)
        inner.__dict__.update(saved)
