"""The collect of one step: the schedule, the local pass, the all-reduce, the failure protocol.

Training thread: read every ``.grad`` (:mod:`gradwatch.gradients`: a Python loop of attribute
reads, no tensor ops), compute all squared norms with a constant number of ops
(:mod:`gradwatch.stats`), pack them and issue one all-reduce (none where DDP already reduced
every gradient: :meth:`gradwatch.reduce.Reducer.issues_collective`); a clip also clips from that
vector (:mod:`gradwatch.clip`). A :class:`PendingSnapshot` is returned at once; the host read of
the reduced vector and the summary (:class:`gradwatch.summary.Summarizer`) happen in
``result()``, on whichever thread asks first (the publisher, normally).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.amp import pending_scale
from gradwatch.clip import clip_grads_
from gradwatch.config import OTHER_GROUP, WatchConfig
from gradwatch.errors import GradWatchError, GradWatchTimeoutError, UnsupportedParallelismError
from gradwatch.reduce import ReducedVector
from gradwatch.reporter import Reporter
from gradwatch.resolve import Resolved
from gradwatch.snapshot import Snapshot
from gradwatch.stats import MetaGradientError, NormEngine
from gradwatch.summary import CollectedStep, Summarizer

log = logging.getLogger("gradwatch")


class PendingSnapshot:
    """The not-yet-materialized statistics of one collected step.

    ``result()`` waits at most once (the collective and the device->host copy), builds the
    :class:`Snapshot` on the host and caches it; it is safe to call from any thread. A step
    that was not measured (its collect failed, or collection stopped) raises
    :class:`~gradwatch.errors.GradWatchError` saying why: never a made-up snapshot.
    """

    def __init__(
        self,
        step: int,
        builder: Callable[[], Snapshot] | None = None,
        snapshot: Snapshot | None = None,
    ) -> None:
        self.step = step
        self._builder = builder
        self._snapshot = snapshot
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._snapshot is not None

    def result(self) -> Snapshot:
        if self._snapshot is None:
            with self._lock:
                if self._snapshot is None:
                    assert self._builder is not None
                    self._snapshot = self._builder()
                    self._builder = None
        return self._snapshot


def not_measured(step: int, why: str) -> PendingSnapshot:
    """A result that raises: step ``step`` was not measured, because ``why``."""

    def fail() -> Snapshot:
        raise GradWatchError(f"gradwatch: step {step} was not measured: {why}")

    return PendingSnapshot(step, fail)


@dataclass(frozen=True)
class Collected:
    """What one call to :meth:`Collector.collect` produced: the step's result, the whole-model
    norm when it clipped (None otherwise), and the collect's duration when it queued a new
    result to publish (None for a skipped or failed step)."""

    pending: PendingSnapshot
    total: Tensor | None = None
    seconds: float | None = None


class Collector:
    """Runs the collects of one watcher, in order, on the training thread.

    Owns the schedule (``every_n_steps``, ``divergence_every``), the local pass and its
    all-reduce, and the failure protocol that keeps every rank's collective sequence aligned
    (:meth:`_failed`). Results are built by ``summarizer``; counters and logs go to
    ``reporter``.
    """

    def __init__(
        self,
        cfg: WatchConfig,
        resolved: Resolved,
        summarizer: Summarizer,
        reporter: Reporter,
    ) -> None:
        self.cfg = cfg
        self.resolved = resolved
        self.engine = NormEngine()
        self.summarizer = summarizer
        self.reporter = reporter
        self.isolated: tuple[str, ...] = tuple(cfg.isolated)
        self.latest: PendingSnapshot | None = None
        self.broken: str | None = None  # why collection stopped for the rest of the run
        self.closed = False
        self._collections = 0
        self.attempts = 0  # collects that did work, numbered: orders failures and results
        self._last_failed_attempt = 0

    def set_isolated(self, groups: Iterable[str]) -> None:
        """The groups expected to receive no gradient from the next collect on (see
        :meth:`gradwatch.watcher.GradWatch.set_isolated`)."""
        wanted = tuple(dict.fromkeys(groups))
        known = set(self.cfg.groups) | {OTHER_GROUP}
        unknown = [g for g in wanted if g not in known]
        if unknown:
            raise ValueError(
                f"gradwatch: set_isolated(groups=...) names unknown group(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        self.isolated = wanted

    def collect(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | None,
        batch_size: int | None = None,
    ) -> Collected:
        """Collect ``step`` (and clip to ``max_norm`` when given); never raises for a failed
        local pass (see :meth:`_failed`)."""
        skipped = step % self.cfg.every_n_steps != 0
        if self.broken:
            return Collected(not_measured(step, f"collection stopped: {self.broken}"))
        if self.closed or (skipped and max_norm is None):
            return Collected(self._pending_last(step))
        started = time.perf_counter()
        reducer = self.resolved.reducer
        issued = reducer.issued
        self.attempts += 1
        attempt = self.attempts
        # Decided before anything can fail, from counts equal on every rank: whether this
        # collect measures the replicas' divergence also decides whether it all-reduces
        # (Reducer.issues_collective), so a rank whose pass fails must decide as the others.
        measure = self._divergence_step(record=not skipped)
        try:
            replaced = self.resolved.slots.first_replaced()
            if replaced is not None:
                raise _Replaced(replaced)
            # A skipped step that clips still needs the whole-model norm (a rank-local one is
            # wrong under FSDP2/TP/pipelines): same pass and all-reduce, no snapshot.
            pending, total = self._pass(
                step, scaler, optimizer, max_norm, measure, attempt, batch_size
            )
        except Exception as exc:  # never-crash boundary: monitoring never crashes training
            self._last_failed_attempt = attempt
            failed = self._failed(
                step, exc, issued, clip=max_norm is not None, with_replicas=measure
            )
            return Collected(failed)
        if skipped:
            return Collected(self._pending_last(step), total)
        self.latest = pending
        return Collected(pending, total, time.perf_counter() - started)

    def _pass(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | None,
        measure: bool,
        attempt: int,
        batch_size: int | None,
    ) -> tuple[PendingSnapshot, Tensor | None]:
        """One statistics pass and all-reduce (see :meth:`Reducer.issues_collective`).
        ``measure``: a divergence step (:meth:`_divergence_step`). ``attempt`` numbers this
        collect (see :meth:`_measured`)."""
        r = self.resolved
        grads = r.gradients.read()
        sq, plan = self.engine.squared_norms_and_plan(grads.tensors, r.reducer.device)
        scale = pending_scale(scaler, optimizer)
        local = r.local_view.take() if r.local_view is not None else None
        if scale is not None:
            scale64 = scale.to(sq.device, torch.float64)
            sq = sq / (scale64 * scale64)
            if local is not None:
                local = local / (scale64 * scale64).to(local.device)
        has_grad = [g is not None for g in grads.tensors]
        reduced = r.reducer.pack_and_reduce(
            sq, has_grad, step, with_replicas=measure, rank_local=local,
            device_collective=max_norm is not None,
        )
        total = None
        if max_norm is not None:
            total = clip_grads_(reduced, max_norm, grads, plan)
        collected = CollectedStep(
            step=step,
            timestamp=time.time(),
            attempt=attempt,
            measure_divergence=measure,
            isolated=self.isolated,
            max_norm=max_norm,
            amp=scaler is not None and scaler.is_enabled(),
            batch_size=batch_size if batch_size is not None else self.cfg.batch_size,
            # This rank's local squares (a fresh tensor, never written again: holding it costs
            # no op), for the audit's local-norm diagnosis (read in result(), once audited).
            local_sq=sq if r.world_size > 1 else None,
        )
        return PendingSnapshot(step, lambda: self._build(reduced, collected)), total

    def _build(self, reduced: ReducedVector, collected: CollectedStep) -> Snapshot:
        """Wait for the reduced figures of ``collected`` and summarize them."""
        step = collected.step
        try:
            stats = reduced.stats()
        except GradWatchTimeoutError as exc:
            # Another rank failed or skipped this collective: later ones would never match.
            self._stop("collective", f"{type(exc).__name__}: {exc}", step)
            raise
        if stats.failed_rank:
            self.reporter.internal_error("other_rank")
            raise GradWatchError(
                f"gradwatch: step {step} was not measured: another rank's local pass failed "
                "(its log says why)"
            )
        if not stats.steps_agree(step):
            self.reporter.log_once(
                "step-mismatch",
                "gradwatch: ranks called collect() with different steps (rank %d: %d); the "
                "statistics of this collect mix steps",
                self.reporter.rank,
                step,
            )
        snap = self.summarizer.build(stats, collected)
        self._measured(collected.attempt)
        return snap

    def _divergence_step(self, record: bool) -> bool:
        """Does this collect measure the replicas' divergence (every ``divergence_every``
        recorded collects)? ``record=False`` (a clip on a step the schedule skips): no, and the
        count is unchanged."""
        every = self.cfg.divergence_every
        measure = (
            record
            and every > 0
            and self._collections % every == 0
            and self.resolved.layout.replicas > 1
        )
        self._collections += int(record)
        return measure

    def _failed(
        self,
        step: int,
        exc: Exception,
        issued: int,
        clip: bool = False,
        with_replicas: bool = False,
    ) -> PendingSnapshot:
        """A collect whose local pass raised: count and log it, keep the ranks' collective
        sequences aligned, and return a result that says the step was not measured.

        Recovery is safe exactly when this rank issues the same collectives as the others: if
        the failure came before this step's all-reduce, a failed-marked all-reduce of the same
        shape stands in for it (every rank then sees "a rank failed" and publishes nothing for
        the step); if it came after, the sequence is already complete. Collection stops for the
        rest of the run only when the stand-in itself fails, or for an error every rank raises
        identically before any collective (:class:`UnsupportedParallelismError`).
        """
        if isinstance(exc, UnsupportedParallelismError):
            # Raised identically on every rank before any collective (a layout gradwatch
            # cannot count, e.g. a Partial gradient): every rank stops together, no stand-in.
            self._stop("collect", f"{type(exc).__name__}: {exc}", step)
            return not_measured(step, f"collection stopped: {self.broken}")
        kind, why = _classify(exc, self.resolved.local_names)
        self.reporter.internal_error(kind)
        if self.reporter.first(kind):
            log.error(
                "gradwatch: collect(step=%d) failed on rank %d (%s): %s; steps are not "
                "measured until it succeeds again (logged once)",
                step,
                self.reporter.rank,
                kind,
                why,
            )
        reducer = self.resolved.reducer
        if reducer.issued == issued:
            try:
                reducer.reduce_failed(step, device_collective=clip, with_replicas=with_replicas)
            except Exception as inner:  # never-crash boundary: the stand-in stops collection
                self._stop("collective", f"{type(inner).__name__}: {inner}", step)
        return not_measured(step, f"collect(step={step}) failed: {why}")

    def _stop(self, kind: str, reason: str, step: int) -> None:
        """Stop collecting for the rest of the run (the ranks' collective sequences may have
        diverged): logged once, counted, ``gradwatch_collecting`` 0."""
        if self.broken is None:
            self.broken = reason
            self.reporter.internal_error(kind)
            log.error(
                "gradwatch: collection stopped at step %d on rank %d for the rest of this run "
                "(no per-step metrics from now on): %s",
                step,
                self.reporter.rank,
                reason,
            )

    def _measured(self, attempt: int) -> None:
        """A step was measured: collecting again, unless a later collect already failed (the
        publisher builds results after the training thread moved on)."""
        if self.broken is None and attempt > self._last_failed_attempt:
            self.reporter.collecting(True)

    def _pending_last(self, step: int) -> PendingSnapshot:
        """What a skipped step returns: the last collected step's pending result (before the
        first collect, a result saying that nothing was measured yet)."""
        if self.latest is not None:
            return self.latest
        return not_measured(step, "no step was collected yet (every_n_steps schedule)")


def clip_locally(
    held: list[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """torch's clip of the parameters ``held`` by their rank-local norm, as a float64 tensor:
    the clip of a step gradwatch did not measure, and the no-op watcher's."""
    params = [p for p in held if p.grad is not None]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return total.to(torch.float64)


class _Replaced(GradWatchError):
    """A parameter was replaced in its module after construction (see ParameterSlots)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _classify(exc: Exception, local_names: list[str]) -> tuple[str, str]:
    """``(kind, reason)`` of a failed local pass: the ``kind`` label of
    ``gradwatch_internal_errors_total`` and a sentence naming the parameter and the fix."""
    if isinstance(exc, _Replaced):
        return "parameters_replaced", (
            f"parameter {exc.name!r} was replaced in its module after GradWatch was built "
            "(to_empty() from meta, load_state_dict(assign=True), or assigning a new "
            "nn.Parameter); construct GradWatch after the model is materialized and loaded"
        )
    if isinstance(exc, MetaGradientError):
        name = local_names[exc.position]
        return "meta_gradient", (
            f"the gradient of parameter {name!r} is on the meta device; materialize the model "
            "(to_empty() and initialization) before training, and construct GradWatch after it"
        )
    return "collect", f"{type(exc).__name__}: {exc}"
