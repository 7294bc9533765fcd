"""The adaptive clip threshold: an EMA history of the exact whole-model norm, on the device.

``watch.clip_grad_norm_("auto")`` clips a norm above ``mean + z * std``, the exponential moving
mean and standard deviation of the whole-model norms of earlier steps (ZClip, arXiv
2504.02507, with its default "adaptive scaling"), and
the guard's ``guard_spike_statistic="ema"`` skips on the z-score ``(norm - mean) / std`` of the
same history. One :class:`AdaptiveHistory` per watcher, fed once per collect that makes a pass
(:meth:`AdaptiveHistory.observe`), so both read the same figures.

The math, per measured step with whole-model norm ``g`` (float64 throughout):

* ``sd = max(sqrt(var), MIN_RELATIVE_STD * mean)``: the spread, floored so that a run whose
  norm hardly moves is not clipped at every ripple;
* warm (``count >= warmup``): threshold ``t = mean + z * sd``, score ``s = (g - mean) / sd``;
  during the first ``warmup`` samples there is no threshold (``t = +inf``) and no score (NaN);
* the limit ``c``: ``t`` for a norm at most ``t``; above it, ``mean + z^2 * sd / s`` (below
  ``t``, and the closer to the mean the larger the spike: ZClip's "adaptive scaling"); the
  gradients are multiplied by ``clamp(c / (g + 1e-6), max=1)`` (1 during warm-up);
* the sample is ``x = min(g, c)``: a clipped spike enters as the norm it was clipped to, at
  most ``t``, so one spike moves the mean by at most ``z * sd * (1 - alpha)`` and a large one
  hardly moves the history at all (a sample near the mean);
* the update with weight ``w = 1 / (count + 1)`` during warm-up (the plain mean and population
  variance of the warm-up samples, Welford's recurrence) and ``w = 1 - alpha`` after:
  ``d = x - mean``, ``mean += w * d``, ``var = (1 - w) * (var + w * d^2)``; ``count += 1``.

A step whose norm is NaN or Inf (a non-finite gradient on some rank, or a norm beyond float64),
or that some rank stood in for (not measured), is no sample: the history is left as it was,
and the score is NaN. Such a step's clip coefficient is torch's (NaN for a NaN norm) once warm.

Why every rank holds the same bits: the input is the whole-model norm of the reduced vector
(the same bits on every rank, see :mod:`gradwatch.step.clip`), and every op is a deterministic
elementwise function of it and of this state, which starts equal (or is loaded from the same
checkpoint). Sync behaviour: device ops on 0-dim float64 tensors, no host read, no collective;
the state is replaced (never written in place) each step, so a reading of an earlier step stays
valid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.reduce.collective import wait_event
from gradwatch.step.clip import CLIP_EPS

__all__ = ["AUTO", "AdaptiveHistory", "AdaptiveReading", "AdaptiveStep"]

#: The ``max_norm`` of ``clip_grad_norm_`` that asks for the adaptive threshold.
AUTO = "auto"

#: The spread's floor, relative to the mean: a threshold at least ``z`` percent points above it.
MIN_RELATIVE_STD = 0.01

#: The version of :meth:`AdaptiveHistory.state_dict`.
STATE_VERSION = 1

_STATE_KEYS = ("mean", "var", "count")


@dataclass(frozen=True)
class AdaptiveReading:
    """The host copy of one step's figures (read off the training thread).

    Attributes:
        norm: the whole-model norm the step was judged by (NaN: not finite or not measured).
        threshold: the adaptive clip threshold of the step; None during warm-up.
        limit: the norm the step was clipped to when above the threshold (else the
            threshold); None during warm-up.
        coef: the coefficient ``min(1, limit / (norm + 1e-6))`` (1.0 during warm-up).
        score: the EMA z-score ``(norm - mean) / sd``; None when undefined.
        samples: samples in the history before this step (the warm-up count, capped at no
            figure: it keeps counting).
    """

    norm: float
    threshold: float | None
    limit: float | None
    coef: float
    score: float | None
    samples: int

    @property
    def clipped(self) -> bool:
        """The adaptive threshold cut this step's norm."""
        return self.threshold is not None and self.norm > self.threshold


class AdaptiveStep:
    """One step's device figures (0-dim float64 tensors, never written again): ``norm``,
    ``threshold`` and ``limit`` (``+inf`` during warm-up), ``score`` (NaN when undefined) and
    the history's ``count`` before the step, and ``finite`` (0-dim bool: the norm is finite, the
    step a sample); read to the host once by :meth:`reading` (on CUDA,
    with ``copy_to_host``, from a pinned copy queued at once, waiting at most ``timeout``
    seconds for its event; without, by a blocking read, which a rank that publishes nothing
    never makes)."""

    def __init__(
        self, norm: Tensor, threshold: Tensor, limit: Tensor, score: Tensor, count: Tensor,
        timeout: float, copy_to_host: bool = True, finite: Tensor | None = None,
    ) -> None:
        self.norm = norm
        # 0-dim bool: the norm is finite (the step is a sample); None: not computed
        self.finite = finite
        self.threshold = threshold
        self.limit = limit
        self.score = score
        self._count = count
        self._timeout = timeout
        self._reading: AdaptiveReading | None = None
        self._vector: Tensor | None = None
        if copy_to_host and norm.device.type != "cpu":  # CUDA path, untested here
            vector = self._pack()
            self._vector = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            self._vector.copy_(vector, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(vector.device))

    def _pack(self) -> Tensor:
        return torch.stack((self.norm, self.threshold, self.limit, self.score, self._count))

    def reading(self) -> AdaptiveReading:
        """The host copy (computed once)."""
        if self._reading is None:
            if self._vector is not None:
                wait_event(self._event, self._timeout, "the adaptive clip's figures")
                norm, threshold, limit, score, count = self._vector.tolist()
            else:
                norm, threshold, limit, score, count = self._pack().tolist()
            warm = math.isfinite(threshold)
            coef = min(1.0, limit / (norm + CLIP_EPS)) if warm else 1.0
            if math.isnan(norm):
                coef = math.nan if warm else 1.0
            self._reading = AdaptiveReading(
                norm=norm,
                threshold=threshold if warm else None,
                limit=limit if warm else None,
                coef=coef,
                score=None if math.isnan(score) else score,
                samples=int(count),
            )
        return self._reading


class AdaptiveHistory:
    """The EMA mean and variance of the whole-model norm and its sample count, on the reduce
    device (see the module docstring for the math).

    Args:
        z: the threshold's distance from the mean, in ``sd`` (``adaptive_clip_z``).
        alpha: the EMA's decay per sample (``adaptive_clip_alpha``).
        warmup: samples before the first threshold (``adaptive_clip_warmup``).
        device: where the state lives (moved with the reducer's device).
        timeout: the longest wait of a host reading on CUDA.
        copy_to_host: queue each step's figures to pinned host memory (global rank 0, which
            publishes them and writes the incident file); other ranks queue nothing.
    """

    def __init__(
        self, z: float, alpha: float, warmup: int, device: torch.device, timeout: float,
        copy_to_host: bool = True,
    ) -> None:
        self._copy_to_host = copy_to_host
        self.z = z
        self.alpha = alpha
        self.warmup = warmup
        self._timeout = timeout
        self.last: AdaptiveStep | None = None
        self._device = device
        self._constants(device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.mean, self.var, self.count = zero, zero, zero

    def _constants(self, device: torch.device) -> None:
        f64: dict[str, Any] = {"dtype": torch.float64, "device": device}
        self._inf = torch.tensor(math.inf, **f64)
        self._nan = torch.tensor(math.nan, **f64)
        self._one = torch.ones((), **f64)
        self._zero = torch.zeros((), **f64)
        self._warmup = torch.tensor(float(self.warmup), **f64)
        self._ema_weight = torch.tensor(1.0 - self.alpha, **f64)

    def _follow(self, device: torch.device) -> None:
        """Move the state to ``device`` (the reducer followed the gradients there)."""
        if device != self._device:
            self._device = device
            self._constants(device)
            self.mean, self.var, self.count = (t.to(device) for t in self.state())

    def state(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(mean, var, count)``, the device state (0-dim float64)."""
        return self.mean, self.var, self.count

    def observe(self, norm: Tensor) -> AdaptiveStep:
        """This step's threshold and score from the state before it, then the state updated
        with its sample (a finite ``norm``: see the module docstring). ``norm``: the
        whole-model norm of :func:`gradwatch.step.clip.whole_norm` (0-dim float64, NaN when some
        gradient was non-finite or some rank stood in). Device ops only, no host read."""
        self._follow(norm.device)
        mean, var, count = self.state()
        warm = count >= self._warmup
        sd = torch.maximum(var.sqrt(), mean * MIN_RELATIVE_STD)
        threshold = torch.where(warm, torch.addcmul(mean, sd, self._one, value=self.z), self._inf)
        sample = norm < self._inf  # a norm is >= 0: False exactly for NaN and +inf
        score = torch.where(warm & sample, (norm - mean) / sd, self._nan)
        over = norm > threshold  # False during warm-up and for NaN
        scaled = torch.addcdiv(mean, sd, score, value=self.z * self.z)  # mean + z^2 sd / s
        limit = torch.where(over, scaled, threshold)
        x = torch.minimum(norm, limit)
        weight = torch.where(warm, self._ema_weight, (count + 1.0).reciprocal())
        # No sample: delta 0 and kept 1 leave mean and var exactly as they were (x + 0 and
        # 1 * (var + 0) are x and var), and the count adds 0: no select of the old state.
        delta = torch.where(sample, x - mean, self._zero)
        kept = torch.where(sample, 1.0 - weight, self._one)
        self.mean = torch.addcmul(mean, weight, delta)
        self.var = kept * torch.addcmul(var, weight * delta, delta)
        self.count = count + sample
        self.last = AdaptiveStep(
            norm, threshold, limit, score, count, self._timeout, self._copy_to_host, sample
        )
        return self.last

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The history as CPU tensors (a copy; one host transfer of three scalars) with the
        settings it was built under: ``torch.save``-able, and bitwise what was on the device."""
        return {
            "version": STATE_VERSION,
            "z": self.z,
            "alpha": self.alpha,
            "warmup": self.warmup,
            **{k: t.detach().to("cpu", copy=True) for k, t in zip(_STATE_KEYS, self.state(),
                                                                    strict=True)},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the same bits on the device. Raises
        ``ValueError`` for another version or missing entries; differing settings are allowed
        (the new ones apply from now on)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"gradwatch: adaptive clip state version {state.get('version')!r} is not "
                f"{STATE_VERSION}"
            )
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"gradwatch: adaptive clip state lacks {missing}")
        values = []
        for key in _STATE_KEYS:
            value = torch.as_tensor(state[key], dtype=torch.float64)
            if value.numel() != 1:
                raise ValueError(f"gradwatch: adaptive clip state {key!r} is not a scalar")
            values.append(value.reshape(()).to(self._device))
        self.mean, self.var, self.count = values
