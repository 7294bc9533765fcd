"""The optimizer-step guard: skip the update of a step whose gradients are non-finite or spike.

``watch.guard(optimizer)`` returns a :class:`GuardedOptimizer`. Its ``step()`` applies the
optimizer's update unless the guard decides to skip this step; every other attribute
(``zero_grad``, ``param_groups``, ``state_dict``, LR schedulers) reaches the optimizer
unchanged.

The decision (:class:`StepGuard`) is a device tensor computed from the step's reduced vector
(:class:`~gradwatch.reduce.reduced.ReducedVector`), the same bits on every rank:

* ``nonfinite``: some rank flagged NaN/Inf in some gradient, or the whole-model norm is not
  finite (``skip_nonfinite``), told straight from the reduced bands and flags, never outside
  float64 (:meth:`StepGuard.decide`);
* ``spike``: ``score = (ln(norm) - m) / max(1.4826 * MAD, 0.05)`` exceeds
  ``skip_spike_score``, where ``m`` and MAD are the median and median absolute deviation of the
  last ``spike_window`` samples of ``ln(norm)``, kept on the device (the definition of
  :mod:`gradwatch.analysis.spikes`; :class:`_SpikeWindow`). A sample is a measured step whose
  gradients were all finite and whose norm is positive and at most ``2^550`` (about 4e165: a
  norm above scores +Inf, a spike once the window is warm), outside the low band (pieces
  below ``2^-450``, whose squares float64 may not hold: a step whose whole norm lies there
  has no score); every sample enters the window, skipped spikes too. Changes of level re-base
  the window exactly as the published score's does (:mod:`gradwatch.spikes`): a new stage
  (the isolated groups changed, ``set_isolated``) empties it, and ``SHIFT_RUN`` consecutive
  scores beyond ``SHIFT_SCORE`` on one side keep only those samples. The score is defined once
  the window holds ``spike_warmup`` samples; it is published as ``gradwatch_guard_score``, the
  figure the guard acted on;
* ``max_consecutive_skips``: the guard skips at most that many steps in a row; a further step
  it would skip is applied (the guard has *stopped*, ``gradwatch_guard_stopped`` 1 and the
  alert says why) until a step it would not skip re-arms it;
* a step some rank stood in for (its step slot NaN: a failed local pass, or -inf: a closed
  watcher) is never skipped and is no sample: a guard that cannot see does not act.

Cost per step: a fixed sequence of small device ops, 11 (58 with ``skip_spike_score``), on
state allocated once; no host read (docs/integrations.md, *What it costs*).

Why the bits agree on every rank: the inputs are the reduced vector, the result of one
all-reduce, identical everywhere. With a guard every collect all-reduces, under plain DDP too
(where collects otherwise skip it: :meth:`gradwatch.reduce.packing.Reducer.issues_collective`), so a
gradient that one rank alone holds differently after DDP's reduction (a NaN written by a
post-backward hook) is every rank's, decided and published alike. Every later op is a
deterministic function of that vector and of the guard's own device state, which starts equal
and is updated by the same ops on every rank. A rank whose own pass failed stands in (a NaN
step slot): no rank skips that step. Call ``guard()`` on every rank, before the first guarded
step.

Sync behaviour: no host read and no collective of its own (the collect it uses makes its one
all-reduce). With an optimizer that accepts ``found_inf``
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.analysis.spikes import MAD_TO_SIGMA, MIN_LOG_SPREAD, SHIFT_RUN, SHIFT_SCORE
from gradwatch.config import WatchConfig
from gradwatch.norms.bands import HIGH_SHIFT
from gradwatch.reduce.collective import wait_event
from gradwatch.reduce.reduced import ReducedVector

__all__ = ["GuardDecision", "GuardPolicy", "GuardReading", "GuardedOptimizer", "StepGuard"]

log = logging.getLogger("gradwatch")

#: The reasons of ``gradwatch_skipped_steps_total``, in decision-vector order.
SKIP_REASONS = ("nonfinite", "spike")

#: The spike window's ``y`` is ``ln`` of the plain and high bands as one float64 sum,
#: ``norm^2 * 2^Y_EXPONENT``: the high band weighs ``2^1023`` (its ``2^-HIGH_SHIFT`` scale
#: cannot be undone in one float64 weight), the plain band ``2^Y_EXPONENT`` to match. The sum
#: is exact to rounding up to norms of ``2^550`` (``ln`` +Inf above: a spike once the window
#: is warm); the low band (pieces below ``2^-450``) is left out (a step whose whole norm lies
#: there has ``ln`` -Inf: no sample).
_Y_EXPONENT = 1023 - HIGH_SHIFT

#: Whole-model norms from ``2^1024`` up do not fit float64: their high band sum (the squares
#: times ``2^-HIGH_SHIFT``) reaches ``2^(2048 - HIGH_SHIFT)``.
_HIGH_BAND_LIMIT_EXPONENT = 2048 - HIGH_SHIFT

#: One non-finite flag weighs ``2^1000`` in the finiteness test: beyond every finite norm's.
_FLAG_EXPONENT = 1000

# Offsets of the decision vector (float64): the consecutive skips before this step and after
# it (a skip raised the count: a skip; a count above 0: the guard wanted to skip), whether it
# wanted to for a non-finite gradient, the spike score, the steps skipped so far and those
# skipped for a non-finite gradient.
_BEFORE, _CONSECUTIVE, _NONFINITE, _SCORE, _SKIPPED, _SKIPPED_NONFINITE = range(6)


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard skips: the guard fields of :class:`~gradwatch.config.WatchConfig`."""

    skip_nonfinite: bool
    skip_spike_score: float | None
    max_consecutive_skips: int
    window: int
    warmup: int
    statistic: str = "median_mad"  # or "ema": the z-score of gradwatch.step.adaptive

    @classmethod
    def from_config(cls, cfg: WatchConfig) -> GuardPolicy:
        policy = cls(
            skip_nonfinite=cfg.skip_nonfinite,
            skip_spike_score=cfg.skip_spike_score,
            max_consecutive_skips=cfg.max_consecutive_skips,
            window=cfg.spike_window,
            warmup=cfg.spike_warmup,
            statistic=cfg.guard_spike_statistic,
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
        consecutive = int(values[_CONSECUTIVE])
        skip = consecutive > values[_BEFORE]
        skipped = None
        if skip:
            skipped = "nonfinite" if values[_NONFINITE] > 0 else "spike"
        skipped_all, skipped_nonfinite = int(values[_SKIPPED]), int(values[_SKIPPED_NONFINITE])
        return cls(
            skipped=skipped,
            consecutive=consecutive,
            stopped=consecutive > 0 and not skip,
            score=float(values[_SCORE]),
            totals=dict(
                zip(SKIP_REASONS, (skipped_nonfinite, skipped_all - skipped_nonfinite), strict=True)
            ),
        )

    def snapshot_fields(self, spikes: bool = False) -> dict[str, Any]:
        """The :class:`~gradwatch.snapshot.Snapshot` fields this reading sets (``spikes``:
        the guard skips spikes, so its score is published too)."""
        fields: dict[str, Any] = {
            "guard_skipped": self.skipped,
            "consecutive_skipped_steps": self.consecutive,
            "guard_stopped": self.stopped,
            "skipped_steps": self.totals,
        }
        if spikes:
            fields["guard_score"] = self.score
        return fields


class GuardDecision:
    """One step's decision: ``found_inf``, the float32 0-dim tensor (1.0: skip) the optimizer
    step uses, and a host copy of the whole decision that the snapshot reads later, off the
    training thread.

    ``parts``: the decision's 0-dim tensors, in decision-vector order; tensors the guard never
    writes again (it replaces that state each step), so on the CPU they are packed only when
    read; on CUDA they are packed at once and copied, non-blocking, to pinned memory with an
    event, as :class:`~gradwatch.reduce.reduced.ReducedVector` does. ``found_inf`` itself is the
    guard's one reused buffer: read it within the step it belongs to.
    """

    def __init__(self, found_inf: Tensor, parts: Sequence[Tensor], timeout: float) -> None:
        self.skip = found_inf
        self._parts = tuple(parts)
        self._timeout = timeout
        self._reading: GuardReading | None = None
        if found_inf.device.type != "cpu":  # CUDA path, untested on this project's machines
            vector = _pack(self._parts)
            self._pinned = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            self._pinned.copy_(vector, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(vector.device))

    def found_inf(self, device: torch.device) -> Tensor:
        """The skip as a float32 ``found_inf`` (1.0: skip) on ``device``, no host read."""
        skip = self.skip
        if skip.device == device:
            return skip
        return skip.to(device=device, non_blocking=True)

    def reading(self) -> GuardReading:
        """Read the decision to the host (once; waits at most ``collective_timeout_seconds``
        for the device on CUDA)."""
        if self._reading is None:
            if self.skip.device.type != "cpu":
                wait_event(self._event, self._timeout, "the guard's decision")
                values = self._pinned.tolist()
            else:
                values = _pack(self._parts).tolist()
            self._reading = GuardReading.from_values(values)
        return self._reading


def _pack(parts: Sequence[Tensor]) -> Tensor:
    """The decision vector (float64) of the 0-dim parts."""
    return torch.stack([t.to(torch.float64) for t in parts])


class _SpikeWindow:
    """The last ``size`` samples of ``y = ln(norm^2) + c`` on the device (``c`` a constant of
    the band scales, which every score cancels), and the spike score of a new one against
    them: ``(y - m) / max(1.4826 * MAD, 2 * MIN_LOG_SPREAD)`` with ``m`` the median and MAD
    the median absolute deviation of the samples (``statistics.median``: the mean of the two
    middle ones for an even count). In ``ln(norm^2)`` every term is twice its ``ln(norm)``
    value (exactly: a factor of 2), so the score is the ``ln(norm)`` one of
    :mod:`gradwatch.analysis.spikes`.

    The window is a ``(2, size)`` tensor, oldest sample first, NaN while empty: a sample
    shifts it by one, in place; a step that is no sample leaves it as it was. Each column
    holds ``y`` and ``-y``: the lower middle order statistic of the two rows (one sort, NaN
    last, read at ``(n - 1) // 2`` for ``n`` samples) gives the lower middle sample and minus
    the upper one, whose mean is the median; the deviations are taken the same way. No op
    PyTorch refuses or lists as nondeterministic on CUDA under
    ``torch.use_deterministic_algorithms(True)`` (no ``median(dim=)``: its indices). Each call
    is a fixed sequence of small ops, no host read, no allocation of state.

    Why so few kinds of op: on the CPU a small op costs its dispatch, and right after the
    backward pass (which evicts the caches) each *kind* of kernel first costs several times
    its warm dispatch; the window reuses the guard's own kinds (``dot``, ``where``) where it
    can.
    """

    def __init__(self, size: int, warmup: int, threshold: float, device: torch.device) -> None:
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        self.threshold = torch.tensor(threshold, **f64)
        self.samples = torch.full((2, size), math.nan, **f64)  # rows y, -y; oldest first
        self._warmup = warmup
        self._views()
        self._signs = torch.tensor([[1.0], [-1.0]], **f64)
        self._halves = torch.tensor([0.5, -0.5], **f64)
        self._sigma_halves = torch.tensor([0.5 * MAD_TO_SIGMA, -0.5 * MAD_TO_SIGMA], **f64)
        self._floor = torch.tensor(2.0 * MIN_LOG_SPREAD, **f64)
        self._zero = torch.zeros((), **f64)
        self._nan = torch.full((), math.nan, **f64)
        self._shift_score = torch.tensor(SHIFT_SCORE, **f64)
        self._shift_run = torch.tensor(float(SHIFT_RUN), **f64)
        # The latest scores beyond SHIFT_SCORE on one side: their count, signed by the side.
        self._run = torch.zeros((), **f64)
        # The samples older than a full run: emptied when the run re-bases the window.
        older = torch.arange(size, device=device) < size - SHIFT_RUN
        self._before_run = older.expand(2, size).contiguous()

    def _views(self) -> None:
        size = self.samples.shape[1]
        self._values = self.samples[0]
        self._older = self.samples[:, 1:]  # all but the oldest sample
        # NaN until ``warmup`` samples entered, and with it the median and the score
        self._warm = self.samples[0, size - self._warmup]

    def move_to(self, device: torch.device) -> None:
        """Keep the window, on ``device``."""
        for name in ("threshold", "samples", "_signs", "_halves", "_sigma_halves", "_floor",
                     "_zero", "_nan", "_shift_score", "_shift_run", "_run",
                     "_before_run"):
            setattr(self, name, getattr(self, name).to(device))
        self._views()

    def score(self, y: Tensor, sample: Tensor) -> Tensor:
        """The score of ``y`` against the window (NaN while undefined: before ``warmup``
        samples, or when ``sample`` is False); then ``y`` enters the window if ``sample``."""
        samples = self.samples
        middle = _lower_middle_index(self._values)
        lower_upper = _at_sorted(samples, middle)  # [lower middle, -upper middle]
        median = torch.addcmul(torch.dot(lower_upper, self._halves), self._warm, self._zero)
        deviations = torch.copysign(self._values - median, self._signs)  # |y_i - m|, -|y_i - m|
        lower_upper = _at_sorted(deviations, middle)  # as many NaN (while warm), same index
        spread = torch.maximum(torch.dot(lower_upper, self._sigma_halves), self._floor)
        shifted = torch.cat((self._older, y * self._signs), dim=1)
        samples.copy_(torch.where(sample, shifted, samples))
        score = (torch.where(sample, y, self._nan) - median) / spread
        self._track_shift(score)
        return score

    def _track_shift(self, score: Tensor) -> None:
        """:meth:`gradwatch.spikes.SpikeWindow.track_shift` on the device: a defined ``score``
        beyond ``SHIFT_SCORE`` on the side of the current run extends it, on the other side
        starts a new one, within it ends it; the ``SHIFT_RUN``-th sample of a run re-bases
        the window on the run's samples (its last ``SHIFT_RUN`` columns: they entered one
        after another), as the published score's window does. The run is one signed count
        (its length, signed by its side): ``(max(run * side, 0) + 1) * side``."""
        side = torch.where(score.abs() > self._shift_score, score.sign(), self._zero)
        extended = (torch.clamp(self._run * side, min=0.0) + 1.0) * side
        run = torch.where(torch.eq(score, score), extended, self._run)  # NaN: undefined
        rebase = torch.ge(run.abs(), self._shift_run)
        self.samples.masked_fill_(rebase & self._before_run, math.nan)
        self._run = torch.where(rebase, self._zero, run)

    def clear(self) -> None:
        """Empty the window (a new stage: a new baseline, as the published score's)."""
        self.samples.fill_(math.nan)
        self._run = self._zero.clone()


def _lower_middle_index(values: Tensor) -> Tensor:
    """The index, in ascending order with NaN last, of the lower middle of the non-NaN
    ``values`` (``(n - 1) // 2`` of ``n``; 0 when there is none): a one-element int64 device
    tensor, no host read."""
    count = torch.eq(values, values).sum(dim=0, keepdim=True)  # NaN != NaN
    return torch.floor_divide(count - 1, 2).clamp_(min=0)


def _at_sorted(rows: Tensor, index: Tensor) -> Tensor:
    """Each row's value at ``index`` once sorted ascending (NaN sort last): the exact order
    statistic ``nanmedian`` gives, by a values-only sort and an ``index_select``, ops torch
    runs deterministically on CUDA (``median``/``nanmedian`` with a ``dim`` return indices,
    which ``torch.use_deterministic_algorithms(True)`` refuses there)."""
    return rows.sort(dim=1).values.index_select(1, index).view(-1)


class StepGuard:
    """The guard's device state and its decision per step (see the module docstring).

    State on the reduce device: the spike window (:class:`_SpikeWindow`), the consecutive
    skips and the skip totals, updated by device ops only: 11 small ops per step without
    spike skipping, 58 with it (``tests/unit/step/test_guard_cost.py`` pins the counts).
    """

    def __init__(
        self, policy: GuardPolicy, device: torch.device, timeout: float, amp: bool = False
    ) -> None:
        self.policy = policy
        # Under a GradScaler the scaler skips non-finite steps itself (counted as AMP-skipped):
        # the guard adds its spike skips only, identically with fused and other optimizers.
        self._skip_nonfinite = policy.skip_nonfinite and not amp
        self._timeout = timeout
        self._logged: set[str] = set()
        # The stage (the isolated groups) of the step being decided, set by the collect on
        # every rank alike, and of the last decided step.
        self.stage: frozenset[str] = frozenset()
        self._decided_stage: frozenset[str] | None = None
        self._start(device)

    def _start(self, device: torch.device) -> None:
        """The state on ``device``: empty, or moved there with the gradients."""
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        previous = getattr(self, "_device", None)
        self._device = device
        self._high_limit = torch.tensor(2.0**_HIGH_BAND_LIMIT_EXPONENT, **f64)
        self._weights = torch.empty(0, **f64)
        self._y_weights = torch.empty(0, **f64)
        self._neg_inf = torch.tensor(-math.inf, **f64)
        self._one = torch.ones((), **f64)
        self._zero = torch.zeros((), **f64)
        self._cap = torch.tensor(float(self.policy.max_consecutive_skips), **f64)
        self._false = torch.zeros((), dtype=torch.bool, device=device)
        self._nan = torch.full((), math.nan, **f64)
        spike = self.policy.skip_spike_score
        ema = spike is not None and self.policy.statistic == "ema"
        self._ema_limit = torch.tensor(spike, **f64) if ema else None
        # The skip as the optimizer takes it: the one buffer reused step after step.
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if previous is None:
            self._consecutive = torch.zeros((), **f64)
            self._skipped = torch.zeros((), **f64)
            self._skipped_nonfinite = self._skipped if self._skip_nonfinite else self._zero
            self._window = None
            if self.policy.skip_spike_score is not None and self.policy.statistic != "ema":
                p = self.policy
                self._window = _SpikeWindow(p.window, p.warmup, p.skip_spike_score, device)
            return
        self._consecutive = self._consecutive.to(device)
        self._skipped = self._skipped.to(device)
        both = self._skip_nonfinite and self.policy.skip_spike_score is not None
        if not self._skip_nonfinite:
            self._skipped_nonfinite = self._zero
        elif not both:
            self._skipped_nonfinite = self._skipped
        else:
            self._skipped_nonfinite = self._skipped_nonfinite.to(device)
        if self._window is not None:
            self._window.move_to(device)

    def _weights_for(self, head: Tensor) -> tuple[Tensor, Tensor]:
        """The dot products' weights for ``head`` (``4N``: plain, high, low bands, flags),
        made again when ``N`` changes: the finiteness test's (0, 1, 0, ``2^1000``) and the
        spike window's ``y`` (``2^Y_EXPONENT``, ``2^1023``, 0, 0)."""
        if self._weights.numel() != head.numel():
            n = head.numel() // 4
            weights = torch.zeros(2, 4, n, dtype=torch.float64, device=head.device)
            weights[0, 1] = 1.0
            weights[0, 3] = 2.0**_FLAG_EXPONENT
            weights[1, 0] = 2.0**_Y_EXPONENT
            weights[1, 1] = 2.0**1023
            self._weights, self._y_weights = weights[0].view(-1), weights[1].view(-1)
        return self._weights, self._y_weights

    def decide(
        self, reduced: ReducedVector, ema_score: Tensor | None = None,
        finite_norm: Tensor | None = None,
    ) -> GuardDecision:
        """This step's decision from its reduced vector; updates the state. No host read.
        ``ema_score``: the adaptive history's z-score of this step (the spike score with
        ``statistic="ema"``; None: undefined, no spike skip). ``finite_norm``: the adaptive
        history's test of the same vector's whole-model norm (0-dim bool: no rank flagged
        NaN/Inf, no rank stood in, and the norm fits float64), which stands for the dot
        product below when the history already made it.

        Whether the step is finite, from one dot product of the bands and flags, ``t = high
        band sum + 2^1000 * flag sum`` (NaN when any band holds NaN or Inf): finite when
        ``t < 2^948``, the high band's value of a norm of ``2^1024`` (every gradient was finite
        and the norm fits float64). The spike window's sample, from a second dot product,
        ``y = ln(plain + 2^1100 * high) - 77 ln 2`` (:data:`_Y_EXPONENT`).
        """
        window = self._window
        head = None
        if finite_norm is None or window is not None:
            head, step = reduced.device_bands_flags_and_step()
        else:
            step = reduced.device_step()
        if step.device != self._device:  # the reducer followed the gradients
            self._start(step.device)
        if self.stage != self._decided_stage:
            if window is not None and self._decided_stage is not None:
                window.clear()  # the isolated groups changed: a new baseline, as published
            self._decided_stage = self.stage
        finite = finite_norm  # the same test, made by the history (False unmeasured too)
        if finite is None:
            assert head is not None
            finite = torch.dot(head, self._weights_for(head)[0]) < self._high_limit  # NaN: False
        measured = step > self._neg_inf  # NaN or -inf: a rank stood in
        want_nonfinite = self._false
        if self._skip_nonfinite:
            want_nonfinite = torch.gt(measured, finite)  # measured and not finite
        score = self._nan
        if window is not None:
            assert head is not None
            y = torch.dot(head, self._weights_for(head)[1]).log()
            sample = finite & measured & (y > self._neg_inf)
            score = window.score(y, sample)
            want_spike = score > window.threshold  # NaN (undefined) is never above it
            want = want_spike | want_nonfinite if self._skip_nonfinite else want_spike
        elif self._ema_limit is not None:  # statistic "ema": the shared history's score
            score = self._nan if ema_score is None else ema_score.to(self._device)
            want_spike = score > self._ema_limit  # NaN (undefined) is never above it
            want = want_spike | want_nonfinite if self._skip_nonfinite else want_spike
        else:
            want = want_nonfinite
        before = self._consecutive
        # A wanted skip raises the count, up to the cap, where the guard stops skipping: the
        # step is skipped exactly when the count rose. Not wanted: back to 0.
        consecutive = torch.where(want, torch.minimum(before + self._one, self._cap), self._zero)
        skip = torch.gt(consecutive, before, out=self._found_inf)  # 1.0: skip
        self._consecutive = consecutive
        self._skipped = skipped = self._skipped + skip
        if self._skip_nonfinite:
            if self.policy.skip_spike_score is None:
                self._skipped_nonfinite = skipped  # the only reason
            else:
                self._skipped_nonfinite = torch.addcmul(
                    self._skipped_nonfinite, skip, want_nonfinite
                )
        parts = (before, consecutive, want_nonfinite, score, skipped, self._skipped_nonfinite)
        return GuardDecision(self._found_inf, parts, self._timeout)

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
    called at all (as ``GradScaler`` does); nor is fused SGD's while it has no momentum
    buffers (its first step: one host read of the decision), so a skipped first step leaves
    the state of a fresh optimizer. Without a decision (the step was not measured, collection
    stopped, the watcher closed) ``step()`` is the bare optimizer's, the scaler's
    ``found_inf`` and ``grad_scale`` passed through as ``GradScaler.step`` sets them. LR
    schedulers still advance when the loop calls ``scheduler.step()``, as after a
    GradScaler-skipped step.
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
        scaler_found_inf = self.__dict__.get("found_inf")
        fused = getattr(inner, "_step_supports_amp_scaling", False)
        if decision is None:  # not measured: a guard that cannot see is the bare step
            if fused and scaler_found_inf is not None:  # exactly as GradScaler.step set them
                _step_with(inner, scaler_found_inf, self.__dict__.get("grad_scale"))
            else:
                inner.step()
            return loss
        if fused:
            device = _params_device(inner)
            found_inf = decision.found_inf(device)
            if scaler_found_inf is not None:
                found_inf = torch.maximum(found_inf, scaler_found_inf.to(device, torch.float32))
            if _unset_momentum(inner) and bool(found_inf):  # the one host read, first step
                return loss  # not stepped: the state stays a fresh optimizer's
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


def _unset_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Would this ``step()`` create momentum buffers uninitialized? Fused SGD with momentum
    makes a group's first buffers with ``empty_like`` and fills them in the kernel, which
    returns early on ``found_inf``: a skipped first step would leave garbage that the next
    step reads. True while a fused group with momentum has no buffer for its first parameter
    with a gradient (torch makes a group's buffers all at once). O(groups), no tensor op."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("momentum", 0) == 0:
            continue
        for p in group["params"]:
            if p.grad is not None:
                state = optimizer.state.get(p)
                if state is None or state.get("momentum_buffer") is None:
                    return True
                break
    return False


def _step_with(inner: torch.optim.Optimizer, found_inf: Tensor, grad_scale: Any) -> Any:
    """``inner.step()`` with ``found_inf`` (and the scaler's ``grad_scale``) set as the
    attributes ``fused`` optimizers read, as ``GradScaler.step`` sets them; restored after."""
    own = inner.__dict__
    saved_inf = own.get("found_inf", _UNSET)
    saved_scale = own.get("grad_scale", _UNSET)
    own["found_inf"] = found_inf
    if grad_scale is not None:
        own["grad_scale"] = grad_scale
    try:
        return inner.step()
    finally:
        _restore(own, "found_inf", saved_inf)
        _restore(own, "grad_scale", saved_scale)


#: An attribute the optimizer did not have before the guarded step set it.
_UNSET = object()


def _restore(own: dict[str, Any], name: str, saved: Any) -> None:
    if saved is _UNSET:
        own.pop(name, None)
    else:
        own[name] = saved
