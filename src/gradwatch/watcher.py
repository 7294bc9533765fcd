"""The :class:`GradWatch` facade: resolve parameters once, collect cheaply every step.

Construction (once, collective on every rank when a process group is initialized): resolve the
model (:mod:`gradwatch.model`: names, groups, parallelism), describe the local pieces, agree on
the global layout with one handshake (:mod:`gradwatch.reduce`), and on global rank 0 start
publishing (the endpoint and/or the history file).

``collect(step)`` (training thread): read every ``.grad`` (:mod:`gradwatch.gradients`: a Python
loop of attribute reads, no tensor ops), compute all squared norms with a constant number of ops
(:mod:`gradwatch.stats`), pack them and issue one all-reduce (none where DDP already reduced
every gradient: :meth:`gradwatch.reduce.Reducer.issues_collective`); ``clip_grad_norm_`` also
clips from that vector (:mod:`gradwatch.clip`). It returns a :class:`PendingSnapshot` at once; the
host read of the reduced vector and the host-side summary (:mod:`gradwatch.summary`) happen in
``result()``, which the exporter calls from its own thread (the publisher, which also appends to
the history file when ``history_path`` is set, with or without an endpoint).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.amp import pending_scale
from gradwatch.anomalies import AnomalyLog
from gradwatch.audit import NormAuditor, Verdict, parallel_factors
from gradwatch.clip import clip_coefficient, clip_grads_
from gradwatch.config import OTHER_GROUP, WatchConfig, check_history_path
from gradwatch.ddp_hook import GradWatchCommHook, LocalView, detach
from gradwatch.errors import GradWatchError, GradWatchTimeoutError, UnsupportedParallelismError
from gradwatch.fsdp1 import Fsdp1GradientReader
from gradwatch.fsdp1 import resolve as resolve_fsdp1
from gradwatch.gradients import GradientReader
from gradwatch.guard import GuardDecision, GuardedOptimizer, GuardPolicy, StepGuard
from gradwatch.hooks import before_optimizer_step
from gradwatch.main_grad import clip_local_, gradients_for_fallback, reject_distributed_optimizer
from gradwatch.model import (
    ParameterSlots,
    ddp_reduces_every_gradient,
    describe_parallelism,
    empty_groups,
    find_ddp,
    group_membership,
    group_of,
    named_parameters,
    wrapping_ddp,
)
from gradwatch.rankview import NoiseScale, rank_view_fields
from gradwatch.reduce import ReducedVector, Reducer, gradient_device, piece_of
from gradwatch.snapshot import Snapshot
from gradwatch.spikes import SpikeDetector
from gradwatch.stats import BANDS, MetaGradientError, NormEngine, norm_from_bands
from gradwatch.summary import summarize
from gradwatch.zero import ZeroGradients, find_engine

if TYPE_CHECKING:
    from gradwatch.export import Publishing, Sink
    from gradwatch.export.state import SelfStats

log = logging.getLogger("gradwatch")


def _version() -> str:
    from gradwatch import __version__

    return __version__


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


class GradWatch:
    """Gradient health of a (possibly distributed) model; see the package docs.

    Args:
        model: the module, possibly wrapped (DDP, ``fully_shard``, ``torch.compile``,
            activation checkpointing). Its parameters are resolved once, here.
        config: a :class:`WatchConfig`; ``None`` reads everything from ``GRADWATCH_*``.
        process_group: the data-parallel group of ``model`` (informational; every rank of the
            world must construct a GradWatch, because the reduction spans the world).
        stage_group: the group of ranks holding *different* parts of the model (pipeline
            stages, hand-split model parallelism); their parameter names must be disjoint.
    """

    def __init__(
        self,
        model: nn.Module,
        config: WatchConfig | None = None,
        *,
        process_group: Any = None,
        stage_group: Any = None,
    ) -> None:
        self.config = config if config is not None else WatchConfig()
        cfg = self.config
        self._hooks: list[Any] = []
        self._closed = False
        self._publishing: Publishing | None = None  # rank 0; gradwatch.export imported lazily
        self._latest: PendingSnapshot | None = None
        self._last: Snapshot | None = None
        self._isolated: tuple[str, ...] = tuple(cfg.isolated)
        self._enabled = cfg.enabled
        self._step_guard: StepGuard | None = None  # guard(): decides on every collect
        self._decision: GuardDecision | None = None  # the last collect's, until step() takes it
        self._collected = False  # a collect ran (or failed) since the last guarded step
        self._zero: ZeroGradients | None = None
        if not self._enabled:
            self._inert(model)
            return
        # A DeepSpeed engine (or the module one trains): its gradients are read from its
        # partitions (gradwatch.zero); None otherwise.
        self._zero = _zero_source(model)
        if self._zero is not None:
            model = self._zero.module
        reject_distributed_optimizer(model)
        distributed = dist.is_available() and dist.is_initialized()
        # FSDP1 units (gradwatch.fsdp1): pieces are the original parameters' slices of the
        # flat shards, whatever the model's parameters are (flat ones or views)
        self._fsdp1 = resolve_fsdp1(model) if self._zero is None else None
        if self._fsdp1 is None:
            names, self._params = named_parameters(model)
        else:
            names, self._params = list(self._fsdp1.held_names), list(self._fsdp1.held_params)
        self._names = tuple(names)
        self._slots = ParameterSlots(model, self._params, names)
        self._local_names = names if self._fsdp1 is None else list(self._fsdp1.names)
        on_meta = [n for n, p in zip(names, self._params, strict=True) if p.is_meta]
        if on_meta:
            log.warning(
                "gradwatch: parameter %r (and %d more) is on the meta device: if the model is "
                "materialized later (to_empty()), parameters it replaces are reported as "
                "replaced; construct GradWatch after to_empty() and initialization",
                on_meta[0],
                len(on_meta) - 1,
            )
        self.rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
        self.world_size = dist.get_world_size() if distributed else 1
        if self.rank == 0 and cfg.history_path is not None:
            try:
                check_history_path(cfg.history_path)
            except ValueError as exc:
                raise GradWatchError(f"gradwatch: {exc}") from None
        if not distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            log.warning(
                "gradwatch: WORLD_SIZE=%s but no process group is initialized: statistics are "
                "this rank's only; call torch.distributed.init_process_group before GradWatch",
                os.environ["WORLD_SIZE"],
            )
        flat = self._fsdp1
        self._gradients: GradientReader | ZeroGradients | Fsdp1GradientReader
        if self._zero is not None:
            self._gradients = self._zero
            pieces = self._zero.pieces()
        elif flat is not None:
            self._gradients = flat.reader
            pieces = list(flat.pieces)
        else:
            self._gradients = GradientReader(self._params)
            pieces = [piece_of(n, p) for n, p in zip(names, self._params, strict=True)]
        ddp = self._find_ddp(model) if self._zero is None else None
        self._attach_rank_view(ddp, names)
        try:
            self._reducer = Reducer(
                pieces,
                version=_version(),
                config_hash=cfg.layout_hash(),
                timeout_seconds=cfg.collective_timeout_seconds,
                stage_group=stage_group,
                rank_view_groups=len(self._view_groups) if self._comm_hook is not None else 0,
                synced=not cfg.always_reduce and stage_group is None
                and (ddp_reduces_every_gradient(ddp, self._params, self.world_size)
                     or (flat is not None and flat.reduces_every_gradient(self.world_size))),
                device=gradient_device(self._params),
                experts=cfg.expert_parameters,
            )
        except BaseException:
            detach(self._comm_hook)
            raise
        self._layout = self._reducer.layout
        if self._comm_hook is not None and self._layout.rank_view_groups == 0:
            self._log_rank_view_off()
        self._groups_of, self._group_order = group_membership(self._layout.names, cfg.groups)
        if self.rank == 0:
            for group in empty_groups(self._groups_of, cfg.groups):
                log.warning(
                    "gradwatch: group %r matches no parameter of the model (patterns %s); it "
                    "will read 0 every step. Parameter names look like %r",
                    group,
                    list(cfg.groups[group]),
                    self._layout.names[0] if self._layout.names else "",
                )
        if self._zero is not None:
            self.parallelism = self._zero.label
        elif flat is not None:
            self.parallelism = flat.parallelism(
                dist.get_world_size(stage_group) if stage_group is not None else None)
        else:
            self.parallelism = describe_parallelism(
                model, self._params, self.world_size, stage_group, process_group)
        self._engine = NormEngine()
        self._collections = 0
        self._attempts = 0  # collects that did work, numbered: orders failures and results
        self._last_failed_attempt = 0
        self._clipped_step: int | None = None
        self._last_divergence = 0.0
        self._broken: str | None = None
        self._logged: set[str] = set()
        self._anomalies = AnomalyLog(self.rank, cfg.isolation_threshold)
        self._spikes = SpikeDetector(
            cfg.spike_window, cfg.spike_threshold, cfg.spike_warmup, self.rank
        )
        self._optimizer_steps = 0
        self._next_step = 0  # one past the highest step given to collect(): attach continues it
        self._auditor = NormAuditor(
            cfg.audit_tolerance, parallel_factors(self.parallelism, self.world_size)
        )
        if self.rank == 0:
            self._start_publishing(cfg)

    # -- the per-rank view (DDP comm hook; gradwatch.ddp_hook, gradwatch.rankview) ---------------

    def _find_ddp(self, model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
        """The DDP module training ``model`` (inside it, or wrapping it), when it matters: more
        than one rank, and the rank view or a collect without the all-reduce may use it."""
        if self.world_size < 2 or (self.config.always_reduce and not self.config.rank_view):
            return None
        if self._fsdp1 is not None:
            return None  # FSDP1 reduces the gradients itself
        ddp = find_ddp(model)
        if ddp is None and not any(hasattr(p, "_local_tensor") for p in self._params):
            ddp = wrapping_ddp(model)  # one scan of live objects; DTensor models take no DDP
        return ddp

    def _attach_rank_view(
        self, ddp: nn.parallel.DistributedDataParallel | None, names: list[str]
    ) -> None:
        """Under DDP with ``rank_view``: measure this rank's gradients in DDP's comm hook."""
        from gradwatch.ddp_hook import attach

        self._view_groups = (*self.config.groups, OTHER_GROUP)
        self._local_view: LocalView | None = None
        self._comm_hook: GradWatchCommHook | None = None
        self._noise = NoiseScale()
        if not self.config.rank_view or ddp is None:
            return
        position = {g: k for k, g in enumerate(self._view_groups)}
        view = LocalView(
            self._params, [position[group_of(n, self.config.groups)] for n in names],
            len(self._view_groups),
        )
        self._comm_hook = attach(ddp, view)
        if self._comm_hook is not None:
            self._local_view = view

    def _log_rank_view_off(self) -> None:
        if self.rank == 0:
            log.warning(
                "gradwatch: the per-rank view is off: not every rank measures it (each rank "
                "needs a DDP module with gradwatch's comm hook and rank_view=True)"
            )
        detach(self._comm_hook)
        self._comm_hook = self._local_view = None

    def _inert(self, model: nn.Module) -> None:
        """``enabled=False`` (``GRADWATCH_ENABLED=0``): the same object, inert. No port, no
        collective, no hook; ``collect()`` returns an empty snapshot like
        :class:`~gradwatch.enable.NoOpWatch` and ``clip_grad_norm_`` is torch's. Logged once."""
        self._params = list(model.parameters())
        self._names = ()
        self._broken = None
        self._clipped_step = None
        self._optimizer_steps = 0
        self._next_step = 0
        self._auditor = None
        self.rank = int(os.environ.get("RANK", "0"))
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()  # not a collective
        self.world_size = 1
        self.parallelism = "disabled"
        log.warning(
            "gradwatch: disabled (enabled=False, e.g. GRADWATCH_ENABLED=0): nothing is "
            "collected, served or written"
        )

    # -- public API ---------------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` on the serving rank, ``None`` elsewhere."""
        return self._publishing.url if self._publishing is not None else None

    @property
    def last(self) -> Snapshot | None:
        """The snapshot of the last measured step (None before the first one): a step whose
        collect failed is never shown as a made-up snapshot, ``last`` stays the one before.

        Materializes the newest pending result if nobody did (waits for it, once).
        """
        latest = self._latest
        if latest is not None:
            try:
                return latest.result()
            except Exception as exc:  # a timed-out collective must not escape a property
                self._log_once("last", "gradwatch: the last collect failed: %s", exc)
        return self._last

    @property
    def isolated(self) -> tuple[str, ...]:
        """The groups currently expected to receive no gradient (see :meth:`set_isolated`)."""
        return self._isolated

    def set_isolated(self, groups: Iterable[str]) -> None:
        """Change which groups are expected to receive no gradient, from the next collect on.

        Isolation is a per-stage expectation, not a fixed rule: a host network is isolated
        while a new seed module trains alone, then trains again when the seed blends in.
        Host-side only (no collective, nothing re-agreed across ranks); it starts with
        ``WatchConfig.isolated``. Unknown group names raise ``ValueError`` naming them.
        """
        wanted = tuple(dict.fromkeys(groups))
        known = set(self.config.groups) | {OTHER_GROUP}
        unknown = [g for g in wanted if g not in known]
        if unknown:
            raise ValueError(
                f"gradwatch: set_isolated(groups=...) names unknown group(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        self._isolated = wanted

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Every parameter of the whole model (all ranks and stages), in layout order (empty
        when disabled)."""
        return self._layout.names if self._enabled else self._names

    def collect(
        self,
        step: int,
        *,
        scaler: Any = None,
        optimizer: Any = None,
        batch_size: int | None = None,
    ) -> PendingSnapshot:
        """Queue the statistics of the current gradients for ``step``; never waits on the device.

        A step the schedule skips (``step % every_n_steps != 0``) is a no-op returning the last
        snapshot, identically on every rank. ``scaler``: a ``torch.amp.GradScaler``; norms are
        then of the unscaled gradients (divided by the scale on the device, unless
        ``scaler.unscale_`` already ran), and a non-finite step is reported as AMP-skipped.
        Errors are logged (once per kind) and counted, never raised here. A collect whose local
        pass fails (an exception, a gradient on ``meta``, a parameter replaced since
        construction) still issues this step's all-reduce, marked failed, so every rank's
        collective sequence stays aligned and collection resumes at the next step that succeeds;
        only a failed or timed-out gradwatch collective stops collection for the rest of the run.
        The returned result of a step not measured raises ``GradWatchError`` (never a made-up
        snapshot); the exporter shows ``gradwatch_collecting 0`` and no per-step gauge.
        ``batch_size``: samples (or tokens) per replica of this step, for the gradient noise
        scale (default ``WatchConfig.batch_size``); must be >= 1.
        """
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(
                f"gradwatch: collect(batch_size=...) must be a positive int, got {batch_size!r}"
            )
        self._next_step = max(self._next_step, step + 1)
        return self._guarded(step, scaler, optimizer, None, batch_size)[0]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        step: int | None = None,
        scaler: Any = None,
    ) -> Tensor:
        """Clip all gradients to a whole-model L2 norm of ``max_norm`` and collect, in one pass.

        Equals ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on one process,
        and the whole-model result under DDP, FSDP2, TP and pipeline stages (where torch's own
        function returns a rank-local norm): the norm comes from the same all-reduce that
        carries the statistics. Returns the pre-clip total norm, a 0-dim float64 tensor (no host
        sync; on gloo the all-reduce is awaited, as clipping needs it). Gradients are multiplied
        by ``clamp(max_norm / (total + 1e-6), max=1)`` with ``_foreach_mul_``, unconditionally,
        like ``clip_grads_with_norm_``. ``step`` defaults to gradwatch's own optimizer-step
        counter. The collected snapshot has pre-clip norms and ``clip_coef``. Steps the schedule
        skips are clipped by the whole-model norm too (same pass and all-reduce, no snapshot);
        only when a collect failed or collection stopped does torch's function clip (rank-local
        norm).
        """
        if norm_type != 2.0:
            raise ValueError(
                f"gradwatch: clip_grad_norm_ supports norm_type=2.0 only, got {norm_type}"
            )
        if step is None:
            step = self._optimizer_steps
        zero = self._zero if self._enabled else None
        if zero is not None:
            refusal = zero.clip_refusal() or zero.off_boundary()
            if refusal is not None:
                raise GradWatchError(f"gradwatch: clip_grad_norm_ under DeepSpeed: {refusal}")
        _, total = self._guarded(step, scaler, None, float(max_norm))
        if total is None and zero is not None:
            # DeepSpeed's gradients are not in .grad: torch's function would clip nothing.
            self._log_once(
                "zero-not-clipped",
                "gradwatch: step %d was not clipped (collection failed or stopped); DeepSpeed "
                "steps with unclipped gradients",
                step,
            )
            return torch.tensor(math.nan, dtype=torch.float64)
        if total is None:  # skipped by the schedule, or collection disabled after an error
            held = self._slots.current() if self._enabled else self._params
            if any(hasattr(p, "main_grad") for p in held):
                return clip_local_(gradients_for_fallback(held), max_norm, norm_type,
                                   error_if_nonfinite)
            params = [p for p in held if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite
            ).to(torch.float64)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"gradwatch: the total norm of gradients is non-finite ({float(total)}), so it "
                "cannot be clipped; set error_if_nonfinite=False to clip anyway"
            )
        return total

    def audit_norm(
        self, reported: Any, *, step: int | None = None, source: str = "trainer"
    ) -> None:
        """Check a gradient norm the training code computed against gradwatch's exact one.

        ``reported``: the whole-model norm the training code clips with or logs (its clip's
        return value, its ``grad_norm``), a float or a scalar tensor on any device (a DTensor:
        its replicated value). ``step``: the collected step it belongs to (default: the last
        collected one). ``source``: the ``source`` label of the exported series.

        Nothing is read here: the value is carried with the step and compared in ``result()``
        (the exporter's thread), so auditing adds no host read and no collective to the
        training thread. The verdict exports ``gradwatch_reported_norm_ratio{source}``
        (reported / exact) and counts ``gradwatch_norm_audit_disagreements_total{source}``
        beyond ``audit_tolerance`` (relative); the first disagreement of a kind is logged
        once, with a diagnosis when the ratio matches a known failure (a rank-local norm,
        1/sqrt(shards or replicas), sqrt(tp), tp, a double reduction, a bf16-rounded norm). A
        non-finite or unreadable value is counted and logged, never raised. A step not measured
        (a schedule skip, a failed collect) is not audited.
        """
        if self._auditor is None or self._closed:
            return
        if step is None:
            latest = self._latest
            if latest is None:
                return
            step = latest.step
        self._auditor.report(int(step), str(source), reported)

    def _audit(self, snap: Snapshot | None, local_sq: Tensor | None) -> None:
        """Judge the reported norms waiting for ``snap`` (or any built step when None)."""
        auditor = self._auditor
        if auditor is None:
            return
        try:
            if snap is None:
                verdicts = auditor.judge()
            else:
                local = None
                if local_sq is not None and auditor.active:
                    bands = local_sq.detach().view(BANDS, -1).sum(dim=1).tolist()
                    local = norm_from_bands(*bands)
                verdicts = auditor.judge(snap.step, snap.global_norm, local)
            for verdict in verdicts:
                self._publish_verdict(verdict)
        except Exception as exc:  # an audit never breaks the step it rides on
            self._log_once("audit-error", "gradwatch: a norm audit failed: %s", exc)

    def _publish_verdict(self, v: Verdict) -> None:
        stats = self._self_stats()
        if stats is not None:
            stats.add_audit(v.source, v.ratio, v.agrees)
        if not v.agrees:
            self._log_once(
                f"audit:{v.source}:{v.kind}", "%s", v.message(self.config.audit_tolerance)
            )

    def attach(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
        """Collect automatically before every ``every_n_steps``-th ``optimizer.step()``.

        The step number is gradwatch's own counter of optimizer steps (identical on every rank),
        continuing after the highest step already given to :meth:`collect`.
        A pre-step hook sees gradients *after* any clipping the loop did: to watch pre-clip norms
        and clip in one pass, call :meth:`clip_grad_norm_` instead of torch's (it records the
        step, so the hook does not collect twice). With a ``scaler``, collection happens in
        ``scaler.step(optimizer)`` (wrapped), so steps the scaler skips are seen too.
        """
        if self._zero is not None:
            raise GradWatchError(
                "gradwatch: attach() cannot hook a DeepSpeed engine's optimizer (engine.step() "
                "runs it, after the reduced gradients are consumed): call "
                "watch.collect(step=...) between engine.backward(loss) and engine.step()"
            )
        if self._enabled:
            self._optimizer_steps = max(self._optimizer_steps, self._next_step)
            self._hooks.append(before_optimizer_step(optimizer, scaler, self._hooked_collect))

    def guard(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> GuardedOptimizer:
        """``optimizer`` whose ``step()`` is skipped on non-finite or spiking gradients
        (``skip_nonfinite``, ``skip_spike_score``, ``max_consecutive_skips``), the same
        decision on every rank, with no host read for ``fused=True`` optimizers; see
        :mod:`gradwatch.guard`. ``scaler``: the GradScaler, when the loop uses one (the guard's
        own collects then see unscaled norms; non-finite steps are the scaler's skips). From
        now on every collect decides, and :meth:`attach` hooks no longer collect (the guard
        does, before the optimizer's step)."""
        policy = GuardPolicy.from_config(self.config)
        if self._zero is not None:
            raise GradWatchError(
                "gradwatch: guard() does not cover a DeepSpeed engine (the engine steps its own "
                "optimizer); watch it without the guard"
            )
        if self._enabled and self._step_guard is None:
            self._step_guard = StepGuard(
                policy, self._reducer.device, self.config.collective_timeout_seconds,
                amp=scaler is not None and scaler.is_enabled(),
            )
        return GuardedOptimizer(optimizer, lambda opt: self._guard_decision(opt, scaler))

    def _guard_decision(self, optimizer: Any, scaler: Any) -> GuardDecision | None:
        """The decision of this step's collect; collects first when none was made since the
        last guarded step. None when the step was not measured (the guard does not act)."""
        if self._step_guard is None:
            return None
        if not self._collected:  # a failed collect counts: collecting again would add a
            step = self._next_step  # collective the other ranks do not issue
            self._next_step = step + 1
            self._guarded(step, scaler, optimizer, None)
        decision, self._decision, self._collected = self._decision, None, False
        return decision

    def _hooked_collect(self, scaler: Any, optimizer: Any) -> None:
        step = self._optimizer_steps
        self._optimizer_steps += 1
        if self._clipped_step == step or self._step_guard is not None:
            # clip_grad_norm_ already collected this step (pre-clip), or the guard collects
            # before its step (a collect in the optimizer's own step would decide too late)
            return
        self.collect(step, scaler=scaler, optimizer=optimizer)

    def _guarded(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | None,
        batch_size: int | None = None,
    ) -> tuple[PendingSnapshot, Tensor | None]:
        if max_norm is not None:
            self._clipped_step = step
        if not self._enabled:
            return PendingSnapshot(step, snapshot=Snapshot(step=step)), None
        skipped = step % self.config.every_n_steps != 0
        if self._broken:
            return self._not_measured(step, f"collection stopped: {self._broken}"), None
        if self._closed or (skipped and max_norm is None and self._step_guard is None):
            return self._pending_last(step), None
        if self._zero is not None:
            off = self._zero.off_boundary()  # identical on every rank: no collective is skipped
            if off is not None:
                self._log_once("zero-boundary", "gradwatch: step %d not measured: %s", step, off)
                return self._not_measured(step, off), None
        started = time.perf_counter()
        issued = self._reducer.issued
        self._collected = True
        self._attempts += 1
        attempt = self._attempts
        # Decided before anything can fail, from counts equal on every rank: whether this
        # collect measures the replicas' divergence also decides whether it all-reduces
        # (Reducer.issues_collective), so a rank whose pass fails must decide as the others.
        measure = self._divergence_step(record=not skipped)
        try:
            replaced = self._slots.first_replaced()
            if replaced is not None:
                raise _Replaced(replaced)
            # A skipped step that clips still needs the whole-model norm (a rank-local one is
            # wrong under FSDP2/TP/pipelines): same pass and all-reduce, no snapshot.
            pending, total = self._collect(
                step, scaler, optimizer, max_norm, measure=measure, attempt=attempt,
                batch_size=batch_size,
            )
        except Exception as exc:  # never let monitoring crash training
            self._last_failed_attempt = attempt
            return self._failed(
                step, exc, issued, clip=max_norm is not None or self._step_guard is not None,
                with_replicas=measure,
            ), None
        if skipped:
            return self._pending_last(step), total
        self._latest = pending
        if self._publishing is not None:
            self._publishing.observe_collect_seconds(time.perf_counter() - started)
            self._publishing.submit(pending)
        return pending, total

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
            return self._not_measured(step, f"collection stopped: {self._broken}")
        kind, why = _classify(exc, self._local_names)
        self._internal_error(kind)
        if kind not in self._logged:
            self._logged.add(kind)
            log.error(
                "gradwatch: collect(step=%d) failed on rank %d (%s): %s; steps are not "
                "measured until it succeeds again (logged once)",
                step,
                self.rank,
                kind,
                why,
            )
        if self._reducer.issued == issued:
            try:
                self._reducer.reduce_failed(
                    step, device_collective=clip, with_replicas=with_replicas
                )
            except Exception as inner:
                self._stop("collective", f"{type(inner).__name__}: {inner}", step)
        return self._not_measured(step, f"collect(step={step}) failed: {why}")

    def _stop(self, kind: str, reason: str, step: int) -> None:
        """Stop collecting for the rest of the run (the ranks' collective sequences may have
        diverged): logged once, counted, ``gradwatch_collecting`` 0."""
        if self._broken is None:
            self._broken = reason
            self._internal_error(kind)
            log.error(
                "gradwatch: collection stopped at step %d on rank %d for the rest of this run "
                "(no per-step metrics from now on): %s",
                step,
                self.rank,
                reason,
            )

    def _internal_error(self, kind: str) -> None:
        stats = self._self_stats()
        if stats is not None:
            stats.add_internal_error(kind)

    def _measured(self, attempt: int) -> None:
        """A step was measured: collecting again, unless a later collect already failed (the
        publisher builds results after the training thread moved on)."""
        stats = self._self_stats()
        if stats is not None and self._broken is None and attempt > self._last_failed_attempt:
            stats.set_collecting(True)

    def _self_stats(self) -> SelfStats | None:
        """The exporter's self-stats (rank 0 with publishing), else None."""
        publishing = self._publishing
        return None if publishing is None else publishing.self_stats

    def add_sink(self, sink: Sink) -> None:
        """Hand every snapshot published from now on to ``sink`` too (see
        :class:`gradwatch.export.Sink`), from the publisher thread, never the training thread.

        Global rank 0 only (the other ranks publish nothing): a no-op elsewhere, after
        :meth:`close` and when disabled. Errors a sink raises are logged once and counted, never
        raised here.
        """
        if self.rank != 0 or self._closed or not self._enabled:
            return
        if self._publishing is None:
            from gradwatch.export import open_publishing

            self._publishing = open_publishing(
                self.config,
                world_size=self.world_size,
                parallelism=self.parallelism,
                extra_sinks=[sink],
            )
        else:
            self._publishing.add_sink(sink)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step collected so far reached the endpoint and the history file.

        Only global rank 0 publishes; elsewhere, and with neither ``port`` nor
        ``history_path``, returns True at once. False on timeout or after :meth:`close`.
        """
        if self._publishing is None:
            done = not self._closed
        else:
            done = bool(self._publishing.flush(timeout))
        self._audit(None, None)  # reports that arrived after their step was built
        return done

    def close(self) -> None:
        """Flush and stop the endpoint and the history (bounded wait), release gradwatch's
        process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._enabled:
            detach(self._comm_hook)
        try:
            if self._publishing is not None:
                self._audit(None, None)  # reports whose step was built: judged while served
                self._publishing.close()  # flushes first: pending steps reach every sink
        finally:
            if self._enabled:
                self._reducer.close()

    def __enter__(self) -> GradWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _start_publishing(self, cfg: WatchConfig) -> None:
        """Global rank 0: the endpoint (``port``) and/or the history file (``history_path``),
        fed by one publisher thread (:func:`gradwatch.export.open_publishing`), so the training
        thread only ever queues a pending result."""
        from gradwatch.export import open_publishing

        self._publishing = open_publishing(
            cfg, world_size=self.world_size, parallelism=self.parallelism
        )

    def _collect(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | None,
        measure: bool = False,
        attempt: int = 0,
        batch_size: int | None = None,
    ) -> tuple[PendingSnapshot, Tensor | None]:
        """One statistics pass and all-reduce (see :meth:`Reducer.issues_collective`).
        ``measure``: a divergence step (:meth:`_divergence_step`). ``attempt`` numbers this
        collect (see :meth:`_measured`)."""
        grads = self._gradients.read()
        sq, plan = self._engine.squared_norms_and_plan(grads.tensors, self._reducer.device)
        scale = pending_scale(scaler, optimizer) if self._zero is None else None
        local = self._local_view.take() if self._local_view is not None else None
        if scale is not None:
            scale64 = scale.to(sq.device, torch.float64)
            sq = sq / (scale64 * scale64)
            if local is not None:
                local = local / (scale64 * scale64).to(local.device)
        zero_scale = self._zero.loss_scale() if self._zero is not None else None
        if zero_scale is not None:  # DeepSpeed's loss scale, a Python float: a kernel argument
            sq = sq / (zero_scale * zero_scale)
        has_grad = [g is not None for g in grads.tensors]
        guard = self._step_guard  # decides on the device: the job's backend, like a clip
        reduced = self._reducer.pack_and_reduce(
            sq, has_grad, step, with_replicas=measure, rank_local=local,
            device_collective=max_norm is not None or guard is not None,
        )
        b = batch_size if batch_size is not None else self.config.batch_size
        total = None
        if max_norm is not None:
            total = clip_grads_(reduced, max_norm, grads, plan)
        decision = self._decision = guard.decide(reduced) if guard is not None else None
        amp = scaler is not None and scaler.is_enabled()
        isolated = self._isolated  # the expectation at collect time, not at result() time
        timestamp = time.time()
        # This rank's local squares (a fresh tensor, never written again: holding it costs no
        # op), for the audit's local-norm diagnosis (read in result(), only once audited).
        local_sq = sq if self.world_size > 1 else None
        return (
            PendingSnapshot(
                step,
                lambda: self._build(
                    reduced, step, measure, timestamp, max_norm, amp, isolated, attempt,
                    local_sq, b, decision,
                ),
            ),
            total,
        )

    def _divergence_step(self, record: bool) -> bool:
        """Does this collect measure the replicas' divergence (every ``divergence_every``
        recorded collects)? ``record=False`` (a clip on a step the schedule skips): no, and the
        count is unchanged."""
        every = self.config.divergence_every
        measure = (
            record and every > 0 and self._collections % every == 0 and self._layout.replicas > 1
        )
        self._collections += int(record)
        return measure

    def _build(
        self,
        reduced: ReducedVector,
        step: int,
        measured: bool,
        ts: float,
        max_norm: float | None,
        amp: bool,
        isolated: tuple[str, ...],
        attempt: int = 0,
        local_sq: Tensor | None = None,
        batch_size: int | None = None,
        decision: GuardDecision | None = None,
    ) -> Snapshot:
        try:
            stats = reduced.stats()
        except GradWatchTimeoutError as exc:
            # Another rank failed or skipped this collective: later ones would never match.
            self._stop("collective", f"{type(exc).__name__}: {exc}", step)
            raise
        if stats.failed_rank:
            self._internal_error("other_rank")
            raise GradWatchError(
                f"gradwatch: step {step} was not measured: another rank's local pass failed "
                "(its log says why)"
            )
        if not stats.steps_agree(step):
            self._log_once(
                "step-mismatch",
                "gradwatch: ranks called collect() with different steps (rank %d: %d); the "
                "statistics of this collect mix steps",
                self.rank,
                step,
            )
        if measured:
            self._last_divergence = stats.replica_divergence()
        snap = summarize(
            step=step,
            cfg=self.config,
            names=self._layout.names,
            groups_of=self._groups_of,
            numels=self._layout.numels,
            squares=stats.squares,
            squares_high=stats.squares_high,
            squares_low=stats.squares_low,
            nonfinite_flags=stats.nonfinite,
            has_grad=stats.has_grad,
            group_order=self._group_order,
            isolated=isolated,
            world_size=stats.world_size,
            parallelism=self.parallelism,
            replica_divergence=self._last_divergence,
            timestamp=ts,
        )
        changes: dict[str, Any] = {}
        if max_norm is not None:
            changes["clip_coef"] = clip_coefficient(max_norm, snap.global_norm)
        if amp and not snap.is_finite:
            changes["amp_skipped"] = True
        if decision is not None and self._step_guard is not None:
            reading = decision.reading()
            changes.update(reading.snapshot_fields())
            self._step_guard.report(reading, step, self.rank)
        if stats.rank_view is not None:
            changes.update(
                rank_view_fields(
                    stats.rank_view, snap, self._view_groups, self._noise, batch_size or 1
                )
            )
        if changes:
            snap = snap.replace(**changes)
        # Host-side, after the one read: scored in collect order (attempt), see gradwatch.spikes.
        snap = self._spikes.score(snap, attempt)
        self._anomalies.report(snap)
        self._measured(attempt)
        if self._last is None or snap.step >= self._last.step:
            self._last = snap
        self._audit(snap, local_sq)
        return snap

    def _pending_last(self, step: int) -> PendingSnapshot:
        """What a skipped step returns: the last collected step's pending result (before the
        first collect, a result saying that nothing was measured yet)."""
        if self._latest is not None:
            return self._latest
        return self._not_measured(step, "no step was collected yet (every_n_steps schedule)")

    @staticmethod
    def _not_measured(step: int, why: str) -> PendingSnapshot:
        """A result that raises: step ``step`` was not measured, because ``why``."""

        def fail() -> Snapshot:
            raise GradWatchError(f"gradwatch: step {step} was not measured: {why}")

        return PendingSnapshot(step, fail)

    def _log_once(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)


def _zero_source(model: nn.Module) -> ZeroGradients | None:
    """The DeepSpeed engine's gradient source when ``model`` is one or is trained by one
    (only when the program imported DeepSpeed), else None."""
    engine = find_engine(model)
    if engine is None:
        return None
    return ZeroGradients(engine, None if model is engine else model)


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
