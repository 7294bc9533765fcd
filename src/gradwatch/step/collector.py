"""The collect of one step: the schedule, the local pass, the all-reduce, the failure protocol.

Training thread: read every ``.grad`` (:mod:`gradwatch.norms.gradients`: a Python loop of attribute
reads, no tensor ops), compute all squared norms with a constant number of ops
(:mod:`gradwatch.norms.stats`), pack them and issue one all-reduce (none where DDP already reduced
every gradient: :meth:`gradwatch.reduce.packing.Reducer.issues_collective`); a clip also clips from
that vector (:mod:`gradwatch.step.clip`). A :class:`PendingSnapshot` is returned at once; the host
read of the reduced vector and the summary (:class:`gradwatch.analysis.summary.Summarizer`) happen
in ``result()``, on whichever thread asks first (the publisher, normally).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradwatch.analysis.audit import LocalSquares
from gradwatch.analysis.reporter import Reporter
from gradwatch.analysis.summary import CollectedStep, Summarizer
from gradwatch.config import OTHER_GROUP, WatchConfig
from gradwatch.errors import GradWatchError, GradWatchTimeoutError, UnsupportedParallelismError
from gradwatch.norms.stats import NormEngine
from gradwatch.records import fast_init
from gradwatch.reduce.collective import refuse_capture
from gradwatch.reduce.reduced import ReducedVector
from gradwatch.snapshot import Snapshot
from gradwatch.stacks.main_grad import clip_local_, gradients_for_fallback
from gradwatch.step.adaptive import AUTO, AdaptiveHistory
from gradwatch.step.clip import unmeasured_total
from gradwatch.step.failures import Failures, Replaced
from gradwatch.step.guard import GuardDecision, GuardPolicy, StepGuard
from gradwatch.step.incidents import IncidentLog, SkipLimit
from gradwatch.step.localpass import (
    Acting,
    act_alone,
    measure_local,
    square_on,
    update_section,
)
from gradwatch.step.resolve import Resolved


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


@fast_init
@dataclass(frozen=True)
class Collected:
    """What one call to :meth:`Collector.collect` produced: the step's result, the whole-model
    norm when it clipped (None otherwise), and the collect's duration when it queued a new
    result to publish (None for a skipped or failed step)."""

    pending: PendingSnapshot
    total: Tensor | None = None
    seconds: float | None = None


class StepActions:
    """What a :class:`Collector` does besides its collects: isolation, an unmeasured clip's
    return, the ``attach()`` hook, the adaptive history, the incident file, the skip limit."""

    cfg: WatchConfig
    resolved: Resolved
    reporter: Reporter
    isolated: tuple[str, ...]
    guard: StepGuard | None
    _clipped_step: int | None
    _next_step: int
    _optimizer_steps: int
    collect: Callable[..., Collected]  # Collector.collect
    closed: bool

    def close(self) -> None:
        """No collect from now on; rank 0's incident file gets what is queued (bounded)."""
        self.closed = True
        IncidentLog.close_any(self.incidents)

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

    def unclipped(self, auto: bool = False) -> Tensor | None:
        """Under DeepSpeed, what the last clip returns when gradwatch did not measure it: nothing
        can be clipped by torch's function (the gradients are not in ``.grad``): logged once,
        NaN. ``auto``: the adaptive clip's (:meth:`unclipped_auto`). None otherwise (torch's
        function clips: :func:`clip_locally`)."""
        if auto:
            return self.unclipped_auto()
        if self.resolved.zero is None:
            return None
        self.reporter.log_once(
            "zero-not-clipped",
            "gradwatch: step %d was not clipped (collection failed or stopped); DeepSpeed "
            "steps with unclipped gradients",
            self._clipped_step,
        )
        return torch.tensor(math.nan, dtype=torch.float64)

    def hooked(self) -> Callable[[Any, Any], None]:
        """The collect an ``attach()`` hook runs before each optimizer step, numbered by the
        optimizer-step counter (continuing after the highest step collected so far)."""
        self._optimizer_steps = max(self._optimizer_steps, self._next_step)

        def collect(scaler: Any, optimizer: Any) -> None:
            step = self._optimizer_steps
            self._optimizer_steps += 1
            if self._clipped_step == step or self.guard is not None:
                # clip_grad_norm_ already collected this step (pre-clip), or the guard collects
                # before its step (a collect in the optimizer's own step would decide too late)
                return
            self.collect(step, scaler, optimizer, None)

        return collect

    def _init_actions(self) -> None:
        # The EMA history of the whole-model norm (clip_grad_norm_("auto"), the guard's "ema"
        # statistic): fed by every collect that makes a pass, once it exists
        self.history: AdaptiveHistory | None = None
        rank0 = self.resolved.rank == 0  # rank 0 writes the incident file (incident_path)
        self.incidents = IncidentLog.of(self.cfg.incident_path) if rank0 else None
        self.skip_limit: SkipLimit | None = None  # on_max_consecutive_skips "raise"/"exit"
        self.batch: Any = None  # note_batch(ids): the coming collect's batch
        self._batch: Any = None  # the batch of the collect in progress
        self._decided_step = 0  # the step of the last decision

    def _start_actions(self, policy: GuardPolicy) -> None:
        """What the guard's policy starts: the history (``"ema"``), the skip limit."""
        if policy.statistic == "ema" and policy.skip_spike_score is not None:
            self.start_history()
        if self.cfg.on_max_consecutive_skips != "continue" and self.skip_limit is None:
            self.skip_limit = SkipLimit(
                self.cfg.on_max_consecutive_skips, self.cfg.max_consecutive_skips, self.incidents
            )

    def start_history(self) -> AdaptiveHistory:
        """The EMA history of the whole-model norm, made at its first use (the first
        ``clip_grad_norm_("auto")``, a guard with the ``"ema"`` statistic or a checkpoint
        load); every collect that makes a pass feeds it from then on."""
        if self.history is None:
            cfg = self.cfg
            self.history = AdaptiveHistory(
                cfg.adaptive_clip_z, cfg.adaptive_clip_alpha, cfg.adaptive_clip_warmup,
                self.resolved.reducer.device, cfg.collective_timeout_seconds,
                copy_to_host=self.resolved.rank == 0,
            )
        return self.history

    def unclipped_auto(self) -> Tensor:
        """What ``clip_grad_norm_("auto")`` returns for a step it could not measure: NaN,
        gradients left as they are (no threshold without the whole-model norm), logged once."""
        self.reporter.log_once(
            "auto-not-clipped",
            "gradwatch: step %d was not clipped (collection failed or stopped): "
            "clip_grad_norm_('auto') needs the whole-model norm",
            self._clipped_step,
        )
        return torch.tensor(math.nan, dtype=torch.float64)


class Collector(StepActions):
    """Runs the collects of one watcher, in order, on the training thread.

    Owns the schedule (``every_n_steps``, ``divergence_every``), the local pass and its
    all-reduce, and the failure protocol that keeps every rank's collective sequence aligned
    (:class:`gradwatch.step.failures.Failures`). Results are built by ``summarizer``; counters and
    logs go to ``reporter``.
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
        self.engine = NormEngine.for_job(cfg.compile_kernels, resolved.world_size)
        self.summarizer = summarizer
        self.reporter = reporter
        self.isolated: tuple[str, ...] = tuple(cfg.isolated)
        self.guard: StepGuard | None = None  # GradWatch.guard(): decides on every collect
        self._init_actions()
        self.decision: GuardDecision | None = None  # the last collect's, until step() takes it
        self._collected = False  # a collect ran (or failed) since the last guarded step
        self.latest: PendingSnapshot | None = None
        self.closed = False
        # Where a new pending result goes with its collect's duration (rank 0's publisher)
        self.publish: Callable[[PendingSnapshot, float], None] | None = None
        # gradwatch's own step numbers for the collects it makes (attach() hooks): they
        # continue after the highest step given to collect()
        self._next_step = 0
        self._optimizer_steps = 0
        self._clipped_step: int | None = None
        self._clip_total: Tensor | None = None  # this collect's clip, once applied
        self._collections = 0
        self.attempts = 0  # collects that did work, numbered: orders failures and results
        self.failures = Failures(resolved.reducer, resolved.local_names, reporter)

    def collect(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | str | None,
        batch_size: int | None = None,
    ) -> Collected:
        """Collect ``step`` (and clip to ``max_norm`` when given), handing a new result to
        :attr:`publish`; never raises for a failed local pass (see
        :mod:`gradwatch.step.failures`)."""
        if max_norm is None:
            self._next_step = max(self._next_step, step + 1)
        self._batch, self.batch = self.batch, None
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # nothing a collect computes is differentiated
        try:
            collected = self._collect(step, scaler, optimizer, max_norm, batch_size)
        finally:
            torch._C._set_grad_enabled(grad_mode)
        if collected.seconds is not None and self.publish is not None and not self.closed:
            self.publish(collected.pending, collected.seconds)
        if self.resolved.timer is not None:  # the next step's work starts here
            self.resolved.timer.start()
        return collected

    def clip(self, step: int | None, scaler: Any, max_norm: float | str) -> Tensor | None:
        """Collect and clip ``step`` (default: the optimizer-step counter) to ``max_norm``,
        or to the adaptive threshold for :data:`~gradwatch.step.adaptive.AUTO`; the whole-model
        norm, or None when the step was not measured. Raises when this setup cannot clip
        through gradwatch (DeepSpeed: :meth:`gradwatch.stacks.zero.ZeroGradients.clip_refusal`)."""
        zero = self.resolved.zero
        if zero is not None:
            refusal = zero.clip_refusal() or zero.off_boundary()
            if refusal is not None:
                raise GradWatchError(f"gradwatch: clip_grad_norm_ under DeepSpeed: {refusal}")
        if max_norm == AUTO:
            self.start_history()
        if step is None:
            step = self._optimizer_steps
        self._clipped_step = step
        return self.collect(step, scaler, None, max_norm).total

    def start_guard(self, scaler: Any) -> None:
        """From now on every collect decides whether the optimizer steps (see
        :meth:`gradwatch.watcher.GradWatch.guard`)."""
        policy = GuardPolicy.from_config(self.cfg)
        self.resolved.reducer.guarded = True  # its inputs agreed: one all-reduce per collect
        self._start_actions(policy)
        if self.guard is None:
            self.guard = StepGuard(
                policy, self.resolved.reducer.device, self.cfg.collective_timeout_seconds,
                amp=scaler is not None and scaler.is_enabled(),
            )

    def guard_decision(self, scaler: Any, optimizer: Any) -> GuardDecision | None:
        """The decision of this step's collect; collects first when none was made since the
        last guarded step. None when the step was not measured (the guard does not act)."""
        if self.guard is None:
            return None
        if not self._collected:  # a failed collect counts: collecting again would add a
            self.collect(self._next_step, scaler, optimizer, None)  # collective others lack
        decision, self.decision, self._collected = self.decision, None, False
        if self.skip_limit is not None:
            self.skip_limit.check(self._decided_step, decision)
        return decision

    def _collect(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | str | None,
        batch_size: int | None,
    ) -> Collected:
        refuse_capture()
        skipped = step % self.cfg.every_n_steps != 0
        self.failures.check_group(step)  # and the last all-reduce's step agreement
        if self.broken:
            return Collected(not_measured(step, f"collection stopped: {self.broken}"))
        if skipped and max_norm is None and self.guard is None:
            return Collected(self._pending_last(step))
        if self.closed and max_norm is None:
            if self.resolved.world_size > 1:
                self.failures.stand_in_closed(step, self._divergence_step(record=True))
            return Collected(self._pending_last(step))
        zero = self.resolved.zero
        if zero is not None:
            off = zero.off_boundary()  # identical on every rank: no collective is skipped
            if off is not None:
                self.reporter.log_once(
                    "zero-boundary", "gradwatch: step %d not measured: %s", step, off
                )
                return Collected(not_measured(step, off))
        started = time.perf_counter()
        if self.guard is not None:  # its spike window re-bases on a new stage, as published
            self.guard.stage = frozenset(self.isolated)
        reducer = self.resolved.reducer
        issued = reducer.issued
        self._collected = True
        self.attempts += 1
        attempt = self.attempts
        # Decided before anything can fail, from counts equal on every rank: whether this
        # collect measures the replicas' divergence also decides whether it all-reduces
        # (Reducer.issues_collective), so a rank whose pass fails must decide as the others.
        measure = self._divergence_step(record=not skipped)
        self._clip_total = None
        self.decision = None
        try:
            replaced = self.resolved.slots.first_replaced()
            if replaced is not None:
                raise Replaced(replaced)
            # A skipped step that clips still needs the whole-model norm (a rank-local one is
            # wrong under FSDP2/TP/pipelines): same pass and all-reduce, no snapshot.
            pending, total = self._pass(
                step, scaler, optimizer, max_norm, measure, attempt, batch_size
            )
        except Exception as exc:  # never-crash boundary: monitoring never crashes training
            self.failures.last_failed_attempt = attempt
            before_issue = reducer.issued == issued
            again = None
            if before_issue and self._measures_again(exc):
                # Its all-reduce goes out in place of a stand-in: no stand-in follows.
                again = act_alone(
                    self.resolved, self.reporter, step, scaler, optimizer, max_norm,
                    Acting(self.guard, self.history), with_replicas=measure,
                )
            why = self.failures.failed(
                step, exc, issued, clip=max_norm is not None or self.guard is not None,
                with_replicas=measure,
            )
            total = self._clip_total  # the pass clipped before it failed: never clip twice
            stood_in = before_issue and reducer.issued > issued and self.resolved.world_size > 1
            fresh = total is None and self.decision is None and self.broken is None
            if again is not None and reducer.issued > issued:
                total, self.decision = again
                self._decided_step = step
            elif fresh and stood_in:
                # The stand-in went out: every rank reads "unmeasured" from the same vector,
                # leaves its gradients unclipped (clip_grads_) and its guard skips nothing;
                # so does this one, its guard's state updated as theirs.
                if max_norm is not None:
                    total = unmeasured_total(reducer.device)
                if self.guard is not None:
                    self.decision = self.failures.decide_stood_in(self.guard, step)
                    self._decided_step = step
            elif fresh and (max_norm is not None or self.guard is not None) and (
                self.resolved.world_size > 1 and not reducer.issues_collective(measure)
            ):  # no rank all-reduced: the others clipped and decided by their own vector
                total, self.decision = act_alone(
                    self.resolved, self.reporter, step, scaler, optimizer, max_norm,
                    Acting(self.guard, self.history),
                )
                self._decided_step = step
            return Collected(not_measured(step, why), total)
        total = self.failures.settle_clip(step, total, self.decision is not None)
        if skipped:
            return Collected(self._pending_last(step), total)
        self.latest = pending
        return Collected(pending, total, time.perf_counter() - started)

    def _measures_again(self, exc: Exception) -> bool:
        """Does a guarded collect whose pass failed before its all-reduce measure again, and
        all-reduce that, instead of standing in? Under pure replication (the others' vectors
        are the whole model's too, from the same reduced gradients): then its decision is
        theirs, a NaN or spike step skipped on every rank. Not for the errors every rank
        raises alike or that stop collection (:meth:`Failures.failed`)."""
        return (
            self.guard is not None
            and self.resolved.world_size > 1
            and self.resolved.reducer.layout.replicated_synced
            and not isinstance(exc, (UnsupportedParallelismError, GradWatchTimeoutError))
        )

    def _pass(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | str | None,
        measure: bool,
        attempt: int,
        batch_size: int | None,
    ) -> tuple[PendingSnapshot, Tensor | None]:
        """One statistics pass and all-reduce (see :meth:`Reducer.issues_collective`).
        ``measure``: a divergence step (:meth:`_divergence_step`). ``attempt`` numbers this
        collect (see :meth:`Failures.measured`)."""
        r = self.resolved
        grads, sq, plan, scale64 = measure_local(r, self.engine, scaler, optimizer)
        local = r.local_view.take() if r.local_view is not None else None
        if scale64 is not None and local is not None:
            local = local / square_on(scale64, local.device)
        has_grad = [g is not None for g in grads.tensors]
        # Queued before the packed vector's copy: landed by the time its step is judged.
        local_sq = LocalSquares.of(sq, self.summarizer.auditing) if r.world_size > 1 else None
        guard = self.guard  # decides on the device: the job's backend, like a clip
        reduced = r.reducer.pack_and_reduce(
            sq, has_grad, step, with_replicas=measure, rank_local=local,
            device_collective=max_norm is not None or guard is not None,
            updates=update_section(r, measure),
            work=r.timer.lap() if r.timer is not None else None,
        )
        acting = Acting(guard, self.history, self.incidents is not None)
        acted = acting.act(reduced, max_norm, grads, plan)
        total = self._clip_total = acted.total
        decision = self.decision = acted.decision
        self._decided_step = step
        if self.incidents is not None:
            self.incidents.submit(step, self._batch, acted.norm, acted.adaptive, decision)
        collected = CollectedStep(
            step=step,
            timestamp=time.time(),
            attempt=attempt,
            measure_divergence=measure,
            isolated=self.isolated,
            max_norm=None if max_norm == AUTO else max_norm,
            adaptive_clip=max_norm == AUTO,
            amp=scaler is not None and scaler.is_enabled(),
            batch_size=batch_size if batch_size is not None else self.cfg.batch_size,
            local_sq=local_sq,
            guard=guard,
            decision=decision,
            deepspeed_skipped_steps=None if r.zero is None else r.zero.skips_since_last(),
            adaptive=acted.adaptive,
        )
        return PendingSnapshot(step, lambda: self._build(reduced, collected)), total

    def _build(self, reduced: ReducedVector, collected: CollectedStep) -> Snapshot:
        """Wait for the reduced figures of ``collected`` and summarize them."""
        stats = self.failures.reduced_stats(reduced, collected.step)
        snap = self.summarizer.build(stats, collected)
        self.failures.measured(collected.attempt)
        return snap

    @property
    def broken(self) -> str | None:
        """Why collection stopped for the rest of the run (None: it did not)."""
        return self.failures.broken

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

    def _pending_last(self, step: int) -> PendingSnapshot:
        """What a skipped step returns: the last collected step's pending result (before the
        first collect, a result saying that nothing was measured yet)."""
        if self.latest is not None:
            return self.latest
        return not_measured(step, "no step was collected yet (every_n_steps schedule)")


def clip_locally(
    held: list[Tensor], max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """torch's clip of the parameters ``held`` by their rank-local norm (of their
    ``main_grad`` under Megatron-Core, :mod:`gradwatch.stacks.main_grad`), as a float64 tensor: the
    clip of a step gradwatch did not measure, and the no-op watcher's."""
    if any(hasattr(p, "main_grad") for p in held):
        total = clip_local_(gradients_for_fallback(held), max_norm, norm_type, error_if_nonfinite)
    else:
        params = [p for p in held if p.grad is not None]
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return total.to(torch.float64)


def bare_loop_clip(
    model: Any, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> Tensor:
    """The clip a training loop without gradwatch makes on ``model``, as a float64 tensor:
    what a watcher that measures nothing on any rank (disabled, refused on every rank
    together) clips with, on every rank alike (collective where the stack's own clip is):

    * FSDP1 (``FullyShardedDataParallel``): the outermost unit's own ``clip_grad_norm_``,
      which all-reduces the shards' squares (torch's function over the flat shards would
      clip each rank by its own shard's norm: a different coefficient on every rank);
    * a DeepSpeed engine: nothing can be clipped here (the engine clips in ``engine.step()``
      by its ``gradient_clipping``; its gradients are not in ``.grad``): NaN;
    * otherwise ``torch.nn.utils.clip_grad_norm_`` over the parameters (their ``main_grad``
      under Megatron-Core): the whole model's norm for DDP replicas and for DTensor
      parameters (FSDP2, TP: torch reduces DTensor norms over their mesh), a rank-local one
      for pipeline stages and plain per-rank experts, where torch has no whole-model clip.
    """
    from gradwatch.stacks.zero import find_engine

    if find_engine(model) is not None:
        return torch.tensor(math.nan, dtype=torch.float64)
    root = _fsdp1_root(model)
    if root is not None:
        total = root.clip_grad_norm_(max_norm, norm_type)
    else:
        total = clip_locally(list(model.parameters()), max_norm, norm_type, error_if_nonfinite)
    full = getattr(total, "full_tensor", None)  # a DTensor norm: replicated, no collective
    return (full() if full is not None else total).to(torch.float64)


def _fsdp1_root(model: Any) -> Any:
    """The outermost FSDP1 unit of ``model`` (None: none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, torch.nn.Module):
        return None
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            return module
    return None
