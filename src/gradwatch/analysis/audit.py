"""Norm auditing: the gradient norm the training code computed, checked against gradwatch's.

Training code computes its own whole-model gradient norm (the return value of its clip, the
``grad_norm`` its trainer logs), and that code is where wrong norms come from: a local norm
where the whole model's was meant (FSDP2 shards summed without the all-reduce), replicas or
tensor-parallel copies counted several times, gradients reduced twice, a norm rounded to
bfloat16. gradwatch measures the exact whole-model norm of the same step, so it can check.

Cost split, so the training thread never waits:

* :meth:`NormAuditor.report` (training thread): stores ``(step, source, value)``; a tensor is
  kept as it is, on whatever device (no host read, no copy, no collective).
* :meth:`NormAuditor.judge` (the thread that materializes a step, the exporter's publisher on
  rank 0): once a step's exact norm is known, reads the reported values of that step and
  returns one :class:`Verdict` each. Reports of a step not built yet wait (at most
  :data:`MAX_PENDING` of them; the oldest are dropped).

The verdict: ``ratio = reported / exact``; the two *agree* when
``|reported - exact| <= tolerance * exact`` (both zero, or both non-finite, agree too). A
disagreement is matched against the known failures (:func:`diagnose`), using what gradwatch
knows of the job: the world size, the factors of its parallelism description (``fsdp2x4``,
``hsdp2x2``, ``tp2``, ``ddp2``...) and this rank's own local norm.
"""

from __future__ import annotations

import math
import re
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.norms.bands import BANDS, norm_from_bands
from gradwatch.reduce.collective import LandedFlag, landed, record_event

#: Reports waiting for their step's exact norm, at most (the oldest are dropped beyond it).
MAX_PENDING = 256

#: Exact norms of recent steps kept for reports that arrive after their step was built.
MAX_KNOWN_STEPS = 64

#: A ratio matches a known failure's factor within this relative distance.
MATCH_TOLERANCE = 0.02


@dataclass(frozen=True)
class Verdict:
    """The audit of one reported norm.

    Attributes:
        source: who computed it (the ``source`` label).
        step: the step it belongs to.
        reported: the reported norm (NaN when it could not be read).
        exact: gradwatch's whole-model norm of the step.
        ratio: ``reported / exact``; NaN when undefined (a non-finite value, or ``exact`` 0).
        agrees: within the tolerance (see the module docs).
        diagnosis: a sentence naming the likely failure, or None.
    """

    source: str
    step: int
    reported: float
    exact: float
    ratio: float
    agrees: bool
    diagnosis: str | None = None

    @property
    def kind(self) -> str:
        """What the log says once per source: ``nonfinite``, ``diagnosed`` or ``unexplained``."""
        if not math.isfinite(self.reported):
            return "nonfinite"
        return "diagnosed" if self.diagnosis else "unexplained"

    def message(self, tolerance: float) -> str:
        """The log line of a disagreement."""
        cause = f"; likely cause: {self.diagnosis}" if self.diagnosis else ""
        return (
            f"gradwatch: the norm {self.source!r} reported at step {self.step} disagrees with "
            f"gradwatch's exact global norm: reported {self.reported:.6g}, exact "
            f"{self.exact:.6g} (ratio {self.ratio:.6g}, tolerance {tolerance:g}){cause} "
            "(logged once)"
        )


def parallel_factors(parallelism: str, world_size: int) -> dict[str, int]:
    """Named rank counts of a job from its parallelism description (see
    :func:`gradwatch.norms.model.describe_parallelism`):
    ``{"world": 4, "shards": 2, "tp": 2}``..."""
    out: dict[str, int] = {"world": world_size} if world_size > 1 else {}
    for part in parallelism.split("+"):
        hsdp = re.fullmatch(r"(?:fsdp1)?hsdp(\d+)x(\d+)", part)
        if hsdp:
            out["replicas"], out["shards"] = int(hsdp.group(1)), int(hsdp.group(2))
            continue
        zero = re.fullmatch(r"zero([0-3])x(\d+)", part)  # DeepSpeed: stage 0 replicates
        if zero:
            out["replicas" if zero.group(1) == "0" else "shards"] = int(zero.group(2))
            continue
        m = re.fullmatch(r"(fsdp2x|fsdp1x|fsdp1noshard|ddp|replicated|dp|tp|pp|ep|cp)(\d+)", part)
        if m:
            kind = {"fsdp2x": "shards", "fsdp1x": "shards", "fsdp1noshard": "replicas",
                    "ddp": "replicas", "replicated": "replicas"}.get(
                m.group(1), m.group(1)
            )
            out[kind] = int(m.group(2))
    return {k: v for k, v in out.items() if v > 1}


#: Largest finite float32, and the largest norm whose square a float32 sum still holds.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_SQUARE_LIMIT = math.sqrt(FLOAT32_MAX)


def nonfinite_diagnosis(reported: float, exact: float) -> str | None:
    """Why a non-finite reported norm differs from a finite exact one, or None when no cause
    is known (the message then states only the two values, not a sentence repeating them).

    An Inf where the exact norm's square exceeds float32's range (norm above about 1.8e19) is
    a sum of squares accumulated in float32 (DeepSpeed's and torch's fp32 norms do this)."""
    if not math.isfinite(exact):
        return None
    if math.isinf(reported) and exact > FLOAT32_SQUARE_LIMIT:
        return (
            f"a sum of squares in float32: the exact norm's square ({exact * exact:.3g}) "
            f"exceeds float32's largest value ({FLOAT32_MAX:.3g}), so a float32 norm "
            "overflows to inf although every gradient is finite"
        )
    return (
        "every gradient is finite, so the reporter's own arithmetic overflowed or it read "
        "values gradwatch did not (e.g. still loss-scaled, or another step's)"
    )


def bf16_round(x: float) -> float:
    """``x`` rounded to bfloat16 (nearest even), as a float."""
    return float(torch.tensor(x, dtype=torch.float64).to(torch.bfloat16))


def near_bf16(reported: float, exact: float) -> bool:
    """``reported`` is a bfloat16 value within a few bf16 ulps (2^-7 relative) of ``exact``:
    a norm accumulated or stored in bf16 (exact rounding or bf16 sums)."""
    return (
        math.isfinite(exact)
        and exact > 0
        and reported == bf16_round(reported)
        and abs(reported - exact) <= 2**-7 * exact
    )


def diagnose(
    ratio: float, reported: float, exact: float, factors: dict[str, int], local: float | None
) -> str | None:
    """The known failure a disagreeing ``ratio`` points to, as a sentence, or None.

    In order: this rank's local norm (an exact match when ``local`` is given and differs from
    ``exact``), ``1/sqrt(n)`` for a count of shards, replicas or ranks, ``sqrt(tp)`` and ``tp``,
    ``sqrt(n)`` for replicas (a norm reduced over identical replicas), ``2`` or the world size
    (gradients reduced twice), and a bf16-rounded norm. Only causes possible in the job's
    parallelism are named: each needs its factor in ``factors`` (a single process has none, so
    no cross-rank cause: a 2x there is left unexplained rather than blamed on a reduction).
    """

    def near(target: float) -> bool:
        return abs(ratio - target) <= MATCH_TOLERANCE * target

    local_differs = local is not None and math.isfinite(local) and abs(local - exact) > 1e-6 * exact
    if local_differs and abs(reported - local) <= 1e-6 * max(local, 1e-300):  # type: ignore[operator]
        kind = "shards" if "shards" in factors else "ranks"
        n = factors.get("shards") or factors.get("world", 1)
        return (
            f"the reported norm is this rank's local norm (ratio {ratio:.4g}, about "
            f"1/sqrt({n}) = {1 / math.sqrt(n):.4g} for {n} {kind}): the squared norms were "
            "not all-reduced across ranks (e.g. summing local shard norms of FSDP2 "
            "DTensors without the reduction)"
        )
    for kind in ("shards", "replicas", "world"):
        n = factors.get(kind)
        if n and near(1 / math.sqrt(n)):
            return (
                f"ratio {ratio:.4g} matches 1/sqrt({n}) ({n} {kind}): a norm of one rank's part "
                "only, the squared norms were not all-reduced across them"
            )
    tp = factors.get("tp")
    if tp and near(math.sqrt(tp)):
        return (
            f"ratio {ratio:.4g} matches sqrt({tp}) (tp={tp}): tensor-parallel replicated gradients "
            "counted once per tensor-parallel rank"
        )
    if tp and near(float(tp)):
        return (
            f"ratio {ratio:.4g} matches {tp} (tp={tp}): norms (not squared norms) added over "
            "tensor-parallel ranks that hold replicated gradients"
        )
    for kind in ("replicas", "world"):
        n = factors.get(kind)
        if n and near(math.sqrt(n)):
            return (
                f"ratio {ratio:.4g} matches sqrt({n}) ({n} {kind}): the squared norm summed over "
                "replicas that already hold the same (reduced) gradient"
            )
    # A second reduction needs ranks to reduce over: in a single process it cannot happen.
    world = factors.get("world")
    if world and (near(2.0) or near(float(world))):
        factor = 2 if near(2.0) else world
        return (
            f"ratio {ratio:.4g} matches {factor}: gradients reduced twice (e.g. already averaged "
            "DDP gradients all-reduced again with a sum)"
        )
    if near_bf16(reported, exact):
        return (
            f"ratio {ratio:.6g}: the reported norm is a bfloat16 number within bfloat16 "
            "precision of the exact one (computed or stored in bf16: 8 significant bits)"
        )
    return None


class NormAuditor:
    """Holds reported norms until their step's exact norm is known, then judges them.

    Thread-safe: :meth:`report` runs on the training thread, :meth:`judge` on whichever thread
    materializes a step. ``tolerance``: relative. ``factors``: :func:`parallel_factors`.
    """

    def __init__(self, tolerance: float, factors: dict[str, int]) -> None:
        self.tolerance = tolerance
        self.factors = dict(factors)
        self._lock = threading.Lock()
        self._pending: deque[tuple[int, str, Any]] = deque(maxlen=MAX_PENDING)
        self._known: dict[int, tuple[float, float | None]] = {}
        self.active = False  # set by the first report: steps keep their local norms from then

    def report(self, step: int, source: str, value: Any) -> None:
        """Store a reported norm of ``step`` (a float or a scalar tensor). A CPU tensor is kept
        as given (not even ``detach()``, itself a dispatched op); an accelerator tensor starts
        one non-blocking copy to pinned host memory (:class:`HostCopy`), so judging it never
        reads the device, whichever thread judges."""
        if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta"):
            value = HostCopy.of(value)
        with self._lock:
            self._pending.append((step, source, value))
            self.active = True

    def judge(
        self, step: int | None = None, exact: float = math.nan, local: float | None = None
    ) -> list[Verdict]:
        """Record ``step``'s exact (and this rank's local) norm when given, then judge every
        pending report whose step is known. Host reads of reported tensors happen here."""
        with self._lock:
            if step is not None:
                self._known[step] = (exact, local)
                while len(self._known) > MAX_KNOWN_STEPS:
                    del self._known[min(self._known)]
            # A report whose host copy has not landed waits for a later judgement.
            ready = [r for r in self._pending if r[0] in self._known and _landed(r[2])]
            if not ready:
                return []
            taken = {id(r) for r in ready}
            self._pending = deque(
                (r for r in self._pending if id(r) not in taken), maxlen=MAX_PENDING
            )
            known = {r[0]: self._known[r[0]] for r in ready}
        return [self._verdict(s, src, v, *known[s]) for s, src, v in ready]

    def _verdict(
        self, step: int, source: str, value: Any, exact: float, local: float | None
    ) -> Verdict:
        reported, unreadable = read_norm(value)
        if unreadable is not None:
            return Verdict(source, step, math.nan, exact, math.nan, False, unreadable)
        if math.isfinite(reported) and math.isfinite(exact):
            agrees = abs(reported - exact) <= self.tolerance * exact
            ratio = reported / exact if exact > 0 else math.nan
        else:  # non-finite on either side: agree only when both are (the trainer saw it too)
            agrees = not math.isfinite(reported) and not math.isfinite(exact)
            ratio = math.nan
        diagnosis = None
        if not agrees:
            if not math.isfinite(reported):
                diagnosis = nonfinite_diagnosis(reported, exact)
            elif math.isfinite(ratio):
                diagnosis = diagnose(ratio, reported, exact, self.factors, local)
        return Verdict(source, step, reported, exact, ratio, agrees, diagnosis)


class HostCopy:
    """A reported accelerator tensor on its way to pinned host memory: the copy is queued on
    its stream at report time, :attr:`landed` is set when it completed (no poll)."""

    def __init__(self, host: Tensor | None, landed: LandedFlag | None, why: str | None):
        self.host, self.landed, self.why = host, landed, why

    @classmethod
    def of(cls, value: Tensor) -> HostCopy | Tensor:
        from torch.distributed.tensor import DTensor

        try:
            if isinstance(value, DTensor):
                if any(p.is_partial() for p in value.placements):
                    return value  # judged unreadable, with the reason (read_norm)
                value = value.to_local()
            if value.numel() != 1:
                return value  # judged unreadable by its element count, no read
            host = torch.empty((), dtype=value.dtype, pin_memory=True)
            host.copy_(value.detach().reshape(()), non_blocking=True)
            return cls(host, landed(record_event(value.device)), None)
        except Exception as exc:  # never-crash boundary: the verdict says why
            return cls(None, None, f"the reported norm could not be read ({exc})")


class LocalSquares:
    """This rank's squared norms of one collect (the engine's three bands), for the audit's
    local-norm diagnosis (a rank-local norm reported as the whole model's); read on the host
    only, never a device tensor, whichever thread judges the step.

    CPU: the collect's own vector, held as is (no op) and read when the step is judged (a
    memory read). Accelerators, once some norm was reported (:attr:`NormAuditor.active`): its
    three band sums on the device, copied to pinned host memory by a non-blocking copy queued
    before the packed vector's, with the event that lands it; a step judged before it landed
    has no local diagnosis (nothing waits)."""

    def __init__(self, host: Tensor, landed_flag: LandedFlag | None) -> None:
        self._host, self._landed = host, landed_flag

    @classmethod
    def of(cls, squares: Tensor, auditing: bool) -> LocalSquares | None:
        """Hold (CPU) or start copying (accelerators, when ``auditing``) ``squares``."""
        if squares.device.type == "cpu":
            return cls(squares, None)
        if not auditing:
            return None
        bands = squares.detach().view(BANDS, -1).sum(dim=1)
        host = torch.empty(bands.shape, dtype=bands.dtype, pin_memory=True)
        host.copy_(bands, non_blocking=True)
        return cls(host, landed(record_event(bands.device)))

    def norm(self) -> float | None:
        """This rank's local norm, or None while its copy has not landed."""
        if self._landed is not None and not self._landed.landed():
            return None  # not yet, or never (its wait raised): never read it
        return norm_from_bands(*self._host.view(BANDS, -1).sum(dim=1).tolist())


def _landed(value: Any) -> bool:
    return not isinstance(value, HostCopy) or value.landed is None or value.landed.landed()


def read_norm(value: Any) -> tuple[float, str | None]:
    """``(value as a float, None)``, or ``(nan, why)`` when it cannot be read without a
    collective (a DTensor with a pending reduction) or at all."""
    if isinstance(value, HostCopy):
        if value.host is None:
            return math.nan, value.why
        value = value.host
    try:
        if isinstance(value, torch.Tensor):
            from torch.distributed.tensor import DTensor

            if isinstance(value, DTensor):
                if any(p.is_partial() for p in value.placements):
                    return math.nan, (
                        "the reported norm is a DTensor with a pending (Partial) reduction: "
                        "pass reported.full_tensor()"
                    )
                value = value.to_local()
            if value.numel() != 1:
                return math.nan, f"the reported norm has {value.numel()} elements, not 1"
            return float(value.detach().reshape(())), None
        return float(value), None
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:  # float() and torch;
        # anything else reaches the audit's boundary (Summarizer.audit)
        return math.nan, f"the reported norm could not be read ({type(exc).__name__}: {exc})"
