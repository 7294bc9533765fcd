"""The :class:`GradWatch` facade, the no-op watcher and :func:`watch`.

Construction (once, collective on every rank when a process group is initialized) resolves the
model, its DDP module and the reducer (:mod:`gradwatch.step.resolve`) and, on global rank 0, starts
publishing (the endpoint and/or the history file). Every collect is run by the
:class:`~gradwatch.step.collector.Collector`; its result is built by the
:class:`~gradwatch.analysis.summary.Summarizer` where it is first asked for (the publisher thread).
Both
stages report through one :class:`~gradwatch.analysis.reporter.Reporter`.

The same training script runs with the monitor on or off: under ``enabled=False``
(``GRADWATCH_ENABLED=0``) both :func:`watch` and ``GradWatch(...)`` give a :class:`NoOpWatch`,
with the same methods, which does nothing but clip (with torch's own function) when asked to.

Enabled from the environment, the monitor must never take the job down: when
:class:`GradWatch` refuses the setup (an unsupported parallelism, ranks holding different
models, a handshake timeout, a taken port), :func:`watch` logs the error once and returns a
:class:`RefusedWatch`: a :class:`NoOpWatch` that, on global rank 0 with a ``port``, serves
``gradwatch_collecting 0`` so the dashboard shows at once that nothing is measured. Invalid
settings still raise (a typo is caught before the first step); ``GradWatch(...)`` called
explicitly keeps raising.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.analysis.reporter import Reporter
from gradwatch.analysis.summary import Summarizer
from gradwatch.config import WatchConfig, ratio_key
from gradwatch.configfile import load_config
from gradwatch.errors import GradWatchError, SetupRefusedError
from gradwatch.norms.hooks import before_optimizer_step
from gradwatch.norms.model import shown_groups
from gradwatch.snapshot import Snapshot
from gradwatch.stacks.ddp_hook import detach
from gradwatch.step.adaptive import AUTO
from gradwatch.step.collector import Collector, PendingSnapshot, bare_loop_clip, clip_locally
from gradwatch.step.guard import GuardedOptimizer
from gradwatch.step.incidents import batch_ids
from gradwatch.step.ranktimer import close_timer
from gradwatch.step.resolve import Resolved, resolve

if TYPE_CHECKING:
    from gradwatch.export import Publishing, Sink

__all__ = ["GradWatch", "NoOpWatch", "PendingSnapshot", "RefusedWatch", "watch"]

log = logging.getLogger("gradwatch")


class StepControls:
    """What a loop tells a :class:`GradWatch` about its steps and what it saves with a
    checkpoint: the batch of a step, the groups expected to receive no gradient, the adaptive
    clip's history (thin wiring to the collector: :mod:`gradwatch.step.incidents`,
    :mod:`gradwatch.step.adaptive`)."""

    _collector: Collector

    def note_batch(self, ids: Any) -> None:
        """Name the batch of the coming step (its collect or clip) for the incident file:
        any JSON-able value (sample indices, shard and offset, file names), copied now;
        ``ValueError`` naming ``note_batch(ids)`` otherwise. Host only, no collective."""
        self._collector.batch = batch_ids(ids)

    @property
    def isolated(self) -> tuple[str, ...]:
        """The groups currently expected to receive no gradient (see :meth:`set_isolated`)."""
        return self._collector.isolated

    def set_isolated(self, groups: Iterable[str]) -> None:
        """Change which groups are expected to receive no gradient, from the next collect on.

        Isolation is a per-stage expectation, not a fixed rule: a host network is isolated
        while a new seed module trains alone, then trains again when the seed blends in.
        Host-side only (no collective, nothing re-agreed across ranks); it starts with
        ``WatchConfig.isolated``. Unknown group names raise ``ValueError`` naming them.
        """
        self._collector.set_isolated(groups)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue as this one: the adaptive clip's EMA history
        (:meth:`gradwatch.step.adaptive.AdaptiveHistory.state_dict`, CPU tensors; None before its
        first use). The same on every rank; save it with the model's checkpoint. One host
        transfer of three scalars."""
        history = self._collector.history
        return {"version": 1, "adaptive_clip": None if history is None else history.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the adaptive threshold resumes where it was, bit
        for bit (load the same state on every rank). ``ValueError`` for a foreign dict."""
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("gradwatch: load_state_dict expects a GradWatch.state_dict()")
        if state.get("adaptive_clip") is not None:
            self._collector.start_history().load_state_dict(state["adaptive_clip"])


class GradWatch(StepControls):
    """Gradient health of a (possibly distributed) model; see the package docs.

    Args:
        model: the module, possibly wrapped (DDP, ``fully_shard``, ``torch.compile``,
            activation checkpointing). Its parameters are resolved once, here.
        config: a :class:`WatchConfig`; ``None`` reads everything from ``GRADWATCH_*``. A
            disabled one (``enabled=False``) makes the constructor return a :class:`NoOpWatch`:
            no port, no collective, no hook, logged once.
        process_group: the data-parallel group of ``model`` (informational; every rank of the
            world must construct a GradWatch, because the reduction spans the world).
        stage_group: the group of ranks holding *different* parts of the model (pipeline
            stages, hand-split model parallelism); their parameter names must be disjoint.
    """

    def __new__(cls, model: nn.Module, config: WatchConfig | None = None, **_: Any) -> GradWatch:
        cfg = config if config is not None else WatchConfig()
        if not cfg.enabled:
            log.warning(
                "gradwatch: disabled (enabled=False, e.g. GRADWATCH_ENABLED=0): nothing is "
                "collected, served or written"
            )
            return NoOpWatch(model, cfg)  # type: ignore[return-value]
        watcher = super().__new__(cls)
        watcher.config = cfg  # read once: __init__ receives the caller's None again
        return watcher

    def __init__(
        self,
        model: nn.Module,
        config: WatchConfig | None = None,
        *,
        process_group: Any = None,
        stage_group: Any = None,
    ) -> None:
        cfg = self.config
        self._hooks: list[Any] = []
        self._closed = False
        self._publishing: Publishing | None = None  # rank 0; gradwatch.export imported lazily
        self._model = model  # the bare loop's clip (bare_loop_clip) needs the wrapper
        resolved = resolve(model, cfg, process_group=process_group, stage_group=stage_group)
        self._resolved = resolved
        self.rank = resolved.rank
        self.world_size = resolved.world_size
        self.parallelism = resolved.parallelism
        self._reducer = resolved.reducer
        agree_setup(self, cfg, resolved)

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
        latest = self._collector.latest
        if latest is not None:
            try:
                return latest.result()
            except Exception as exc:  # a timed-out collective must not escape a property
                self._reporter.log_once("last", "gradwatch: the last collect failed: %s", exc)
        return self._summarizer.last

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Every parameter of the whole model (all ranks and stages), in layout order."""
        return self._resolved.layout.names

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
        return self._collector.collect(step, scaler, optimizer, None, batch_size).pending

    def clip_grad_norm_(
        self,
        max_norm: float | str,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        step: int | None = None,
        scaler: Any = None,
    ) -> Tensor:
        """Clip all gradients to a whole-model norm of ``max_norm`` (or ``"auto"``) and collect.

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
        norm), or, when it stopped on every rank together (a step mismatch), the bare loop's
        clip (:func:`gradwatch.step.collector.bare_loop_clip`).
        """
        if norm_type != 2.0:
            raise ValueError(
                f"gradwatch: clip_grad_norm_ supports norm_type=2.0 only, got {norm_type}"
            )
        total = self._collector.clip(step, scaler, _max_norm(max_norm))
        if total is None:  # collection stopped, or this collect failed
            unclipped = self._collector.unclipped(auto=max_norm == AUTO)
            if unclipped is not None:
                return unclipped
            if self._collector.failures.stopped_together:  # every rank here, at this step
                return bare_loop_clip(self._model, max_norm, norm_type, error_if_nonfinite)
            held = self._resolved.slots.current()
            return clip_locally(held, max_norm, norm_type, error_if_nonfinite)
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

        ``reported``: the whole-model norm the loop clips with or logs (its clip's return
        value, its ``grad_norm``): a float or a scalar tensor on any device (a DTensor: its
        replicated value). ``step``: its collected step (default: the last collected one).
        ``source``: the ``source`` label of the exported series. Nothing is read here: the value
        is compared in ``result()``, on the exporter's thread (no host read, no collective on
        the training thread), and exported as ``gradwatch_reported_norm_ratio{source}``
        (reported / exact), with ``gradwatch_norm_audit_disagreements_total{source}`` counting
        those beyond ``audit_tolerance``; the first of a kind is logged once, with a diagnosis
        when the ratio matches a known failure (a rank-local norm, 1/sqrt(shards or replicas),
        sqrt(tp), tp, a double reduction, a bf16-rounded norm). A non-finite or unreadable value
        is counted and logged, never raised; a step not measured is not audited.
        """
        if self._closed:
            return
        if step is None:
            latest = self._collector.latest
            if latest is None:
                return
            step = latest.step
        self._summarizer.report_norm(int(step), str(source), reported)

    def attach(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
        """Collect automatically before every ``every_n_steps``-th ``optimizer.step()``.

        The step number is gradwatch's own counter of optimizer steps (identical on every rank),
        continuing after the highest step already given to :meth:`collect`.
        A pre-step hook sees gradients *after* any clipping the loop did: to watch pre-clip norms
        and clip in one pass, call :meth:`clip_grad_norm_` instead of torch's (it records the
        step, so the hook does not collect twice). With a ``scaler``, collection happens in
        ``scaler.step(optimizer)`` (wrapped), so steps the scaler skips are seen too.
        """
        if self._resolved.zero is not None:
            raise GradWatchError(
                "gradwatch: attach() cannot hook a DeepSpeed engine's optimizer (engine.step() "
                "runs it, after the reduced gradients are consumed): call "
                "watch.collect(step=...) between engine.backward(loss) and engine.step()"
            )
        self._hooks.append(before_optimizer_step(optimizer, scaler, self._collector.hooked()))

    def guard(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> GuardedOptimizer:
        """``optimizer`` whose ``step()`` is skipped on non-finite or spiking gradients
        (``skip_nonfinite``, ``skip_spike_score``, ``max_consecutive_skips``), the same
        decision on every rank, with no host read for ``fused=True`` optimizers; see
        :mod:`gradwatch.step.guard`. ``scaler``: the GradScaler, when the loop uses one (the guard's
        own collects then see unscaled norms; non-finite steps are the scaler's skips). From
        now on every collect decides and all-reduces (its inputs agreed across ranks, under
        plain DDP too), and :meth:`attach` hooks no longer collect (the guard does, before the
        optimizer's step): call it on every rank, before the first guarded step. Without a
        decision (a step not measured) ``step()`` is the bare optimizer's, the scaler's
        ``found_inf`` and ``grad_scale`` passed through."""
        self._collector.start_guard(scaler)
        decide = self._collector.guard_decision
        return GuardedOptimizer(optimizer, lambda opt: decide(scaler, opt))

    def add_sink(self, sink: Sink) -> None:
        """Hand every snapshot published from now on to ``sink`` too (see
        :class:`gradwatch.export.Sink`), from its own thread, never the training thread.

        Global rank 0 only (the other ranks publish nothing): a no-op elsewhere, after
        :meth:`close` and when disabled. Errors a sink raises are counted
        (``gradwatch_sink_errors_total``), logged and retried, never raised here.
        """
        if self.rank != 0 or self._closed:
            return
        if self._publishing is None:
            self._open_publishing(extra_sinks=[sink])
        else:
            self._publishing.add_sink(sink)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step collected so far is published on the endpoint (audited: the
        verdicts of :meth:`audit_norm` counted and served), then written by the history file and
        every sink, or lost by a sink and counted; at most ``timeout`` seconds in all.

        Only global rank 0 publishes; elsewhere, and with neither ``port`` nor ``history_path``
        nor a sink, returns True at once. False on timeout, when a sink is failing or stalled
        (not waited for; logged), or after :meth:`close`.
        """
        if self._publishing is None:
            self._summarizer.audit()  # reports that arrived after their step was built
            return not self._closed
        # Late reports are judged before the endpoint syncs: a scrape after this shows them.
        return bool(self._publishing.flush(timeout, settle=self._summarizer.audit))

    def close(self) -> None:
        """Flush and stop the endpoint and the history, wait for this rank's gradwatch
        all-reduces in flight, release gradwatch's process group (each wait bounded).
        Idempotent."""
        self._close(drain=True)

    def _close(self, drain: bool) -> None:
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._collector.close()  # no collect from now on; rank 0's incident file written
        detach(self._resolved.comm_hook)
        if self._resolved.updates is not None:
            self._resolved.updates.close()
        close_timer(self._resolved.timer)
        try:
            if self._publishing is not None:
                self._summarizer.audit()  # reports whose step was built: judged while served
                self._publishing.close()  # flushes first: pending steps reach every sink
        finally:
            self._reducer.close(drain)

    def __enter__(self) -> GradWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close(drain=exc[0] is None)  # an exception: no wait for peers that may not come

    # -- internals ----------------------------------------------------------------------------

    def _open_publishing(self, extra_sinks: Sequence[Sink] = ()) -> None:
        """Global rank 0: the endpoint (``port``) and/or the history file (``history_path``),
        fed by one publisher thread (:func:`gradwatch.export.open_publishing`), so the training
        thread only ever queues a pending result."""
        from gradwatch.export import open_publishing

        self._publishing = open_publishing(
            self.config, world_size=self.world_size, parallelism=self.parallelism,
            extra_sinks=extra_sinks,
        )
        if self._publishing is not None:
            self._reporter.stats = self._publishing.self_stats
            self._collector.publish = functools.partial(_publish, self._publishing)


def _max_norm(max_norm: float | str) -> float | str:
    """``"auto"``, or ``max_norm`` as a float; ``ValueError`` naming ``max_norm`` else."""
    if isinstance(max_norm, str):
        if max_norm != AUTO:
            raise ValueError(
                f"gradwatch: clip_grad_norm_(max_norm=...) takes a number or 'auto', got "
                f"{max_norm!r}"
            )
        return AUTO
    return float(max_norm)


def agree_setup(watcher: GradWatch, cfg: WatchConfig, resolved: Resolved) -> None:
    """What follows the handshake: the summary, the collector and, on rank 0, publishing
    (endpoint, sinks, ``file_sd`` target); then every rank learns whether any rank refused
    its part: one agreed all-reduce (:meth:`gradwatch.reduce.collective.Collective.agree`). A
    refusal on any rank makes every rank release what it opened and raise: the refusing rank
    its own error, the others :class:`~gradwatch.errors.SetupRefusedError` naming it, so
    :func:`watch` gives a no-op on every rank together and no rank is left issuing collectives
    no one pairs."""
    refusal: Exception | None = None
    try:
        watcher._reporter = Reporter(watcher.rank)
        watcher._summarizer = Summarizer(cfg, resolved, watcher._reporter)
        watcher._collector = Collector(cfg, resolved, watcher._summarizer, watcher._reporter)
        watcher._local_view = resolved.local_view  # what ddp_comm_hook(watch) measures into
        if watcher.rank == 0:
            watcher._open_publishing()
    except Exception as exc:  # agreed below: every rank refuses together, or none
        refusal = exc
    try:
        count, ranks = watcher._reducer.collective.agree(refusal is not None)
    except Exception:
        _release(watcher)
        raise
    if count == 0:
        return
    _release(watcher)
    if refusal is not None:
        raise refusal
    who = f"rank {ranks}" if count == 1 else f"{count} ranks"
    raise SetupRefusedError(
        f"gradwatch: {who} refused the setup after the construction handshake (its log says "
        "why); no rank collects"
    )


def _release(watcher: GradWatch) -> None:
    """Release what a refused construction opened: the endpoint and sinks, the comm hook,
    gradwatch's host thread (no wait: nothing was issued after the handshake)."""
    watcher._closed = True
    detach(watcher._resolved.comm_hook)
    publishing, watcher._publishing = watcher._publishing, None
    try:
        if publishing is not None:
            publishing.close()
    finally:
        watcher._reducer.close(drain=False)


def _publish(publishing: Publishing, pending: PendingSnapshot, seconds: float) -> None:
    """Hand a new pending result, and its collect's duration, to rank 0's publisher."""
    publishing.observe_collect_seconds(seconds)
    publishing.submit(pending)


class NoOpWatch:
    """Same methods as :class:`GradWatch`; collects nothing, opens no port, issues no collective.

    What ``enabled=False`` gives, from :func:`watch` and from ``GradWatch(...)`` alike.
    ``clip_grad_norm_`` is the bare loop's (:func:`gradwatch.step.collector.bare_loop_clip`:
    torch's, FSDP1's own, nothing under DeepSpeed), returned as float64 like GradWatch's.
    ``collect`` and ``clip_grad_norm_`` give :meth:`Snapshot.unmeasured` snapshots: the keys
    an enabled watcher would give (groups, ratios, isolated groups), every figure NaN or None,
    so a loop written for one runs with the other and nothing reads as healthy; :attr:`last`
    is the newest of them.
    """

    metrics_url: str | None = None
    parallelism = "disabled"
    world_size = 1
    parameter_names: tuple[str, ...] = ()

    def __init__(
        self,
        model: nn.Module,
        config: WatchConfig | None = None,
        *,
        process_group: Any = None,
        stage_group: Any = None,
    ) -> None:
        self.config = config if config is not None else WatchConfig(enabled=False)
        self._model = model
        self.rank = int(os.environ.get("RANK", "0"))
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()  # not a collective
        self._isolated = tuple(self.config.isolated)
        self._groups = shown_groups(model, self.config.groups)
        self._last: Snapshot | None = None
        self._steps = 0

    @property
    def last(self) -> Snapshot | None:
        """The unmeasured snapshot of the last ``collect``/``clip_grad_norm_`` (None before)."""
        return self._last

    def collect(self, step: int, **_: Any) -> PendingSnapshot:
        return PendingSnapshot(step, snapshot=self._unmeasured(step))

    def _unmeasured(self, step: int | None) -> Snapshot:
        """The snapshot of ``step`` (default: one past the last), with this watcher's keys."""
        step = self._steps if step is None else int(step)
        self._steps = step + 1
        self._last = Snapshot.unmeasured(
            step,
            groups=self._groups,
            ratios=[ratio_key(*r) for r in self.config.ratios],
            isolated=self._isolated,
            parallelism=self.parallelism,
            timestamp=time.time(),
        )
        return self._last

    def attach(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
        return None

    def guard(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> Any:
        """The optimizer itself: nothing is measured, so nothing is skipped."""
        return optimizer

    @property
    def isolated(self) -> tuple[str, ...]:
        return self._isolated

    def set_isolated(self, groups: Iterable[str]) -> None:
        self._isolated = tuple(groups)

    def clip_grad_norm_(
        self,
        max_norm: float | str,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        step: int | None = None,
        **_: Any,
    ) -> Tensor:
        """torch's clip; ``"auto"`` (no history without gradwatch) clips nothing and returns
        the rank-local norm."""
        limit = _max_norm(max_norm)
        self._unmeasured(step)
        bound = math.inf if limit == AUTO else float(limit)
        return bare_loop_clip(self._model, bound, norm_type, error_if_nonfinite)

    def note_batch(self, ids: Any) -> None:
        batch_ids(ids)  # validated alike: a script that runs disabled runs enabled

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "adaptive_clip": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def audit_norm(
        self, reported: Any, *, step: int | None = None, source: str = "trainer"
    ) -> None:
        return None

    def add_sink(self, sink: Any) -> None:
        return None

    def flush(self, timeout: float = 10.0) -> bool:
        return True

    def close(self) -> None:
        return None

    def __enter__(self) -> NoOpWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class RefusedWatch(NoOpWatch):
    """What :func:`watch` returns when :class:`GradWatch` refused the setup: a
    :class:`NoOpWatch` (collects nothing, issues no collective of its own, clips as the bare
    loop would: :func:`gradwatch.step.collector.bare_loop_clip`) that logged the refusal
    once and, on global rank 0 with a ``port``, serves
    ``gradwatch_collecting 0`` (with ``gradwatch_run_info{parallelism="refused"}`` and the
    exporter's own series), so the missing measurement is visible at once. When even the
    endpoint cannot start (e.g. the port is taken) that is logged too and nothing is served.

    Attributes:
        error: the exception ``GradWatch(...)`` raised (what an explicit construction raises).
    """

    parallelism = "refused"

    def __init__(self, model: nn.Module, config: WatchConfig, error: Exception) -> None:
        super().__init__(model, config)
        self.error = error
        self._publishing: Any = None
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
        world_size = dist.get_world_size() if distributed else 1
        log.error(
            "gradwatch: monitoring is off for this run on rank %d, training continues "
            "unmonitored: %s: %s",
            rank,
            type(error).__name__,
            error,
        )
        if rank == 0 and config.port is not None:
            self._serve_not_collecting(config, world_size)

    def _serve_not_collecting(self, config: WatchConfig, world_size: int) -> None:
        from gradwatch.export import open_publishing

        # What serves the endpoint only: no history, no tracker sinks (either may be what was
        # refused); the file_sd target when it can be written (Prometheus finds the endpoint),
        # else without it.
        bare = config.model_copy(update={"history_path": None, "sinks": []})
        attempts = [bare]
        if bare.file_sd_path is not None:
            attempts.append(bare.model_copy(update={"file_sd_path": None}))
        publishing = None
        for attempt in attempts:
            try:
                publishing = open_publishing(
                    attempt, world_size=world_size, parallelism=self.parallelism
                )
                break
            except Exception as exc:
                log.error("gradwatch: the endpoint could not start either: %s", exc)
        if publishing is not None:
            publishing.self_stats.set_collecting(False)
            # Served before construction returns: the first scrape already says "not
            # collecting" (bounded; a slow exporter start only delays when it does).
            publishing.flush(timeout=5.0)
            self._publishing = publishing
            self.metrics_url = publishing.url

    def close(self) -> None:
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            publishing.close()

    def __exit__(self, *exc: object) -> None:
        self.close()


def watch(
    model: nn.Module,
    *,
    process_group: Any = None,
    stage_group: Any = None,
    **overrides: Any,
) -> GradWatch | NoOpWatch:
    """A watcher configured from ``GRADWATCH_*`` variables, with ``overrides`` winning.

    Under torchrun, rank and world size come from the initialized process group (or the
    ``RANK`` variable when none is initialized); only global rank 0 serves the endpoint.
    Invalid settings raise :class:`gradwatch.configfile.ConfigError` (a ``GradWatchError`` and
    a ``ValueError``) before training, one line per bad field naming it and where its value
    came from, e.g. ``invalid value for port: ... (from env GRADWATCH_PORT='abc')``.

    Any other error of the construction (the setup is refused: see the module docstring) is
    logged once and yields a :class:`RefusedWatch`, which measures nothing and never raises.
    """
    cfg = load_config(**overrides)
    if not cfg.enabled:
        return NoOpWatch(model, cfg)
    try:
        return GradWatch(model, cfg, process_group=process_group, stage_group=stage_group)
    except Exception as exc:  # never-crash boundary: measure nothing, visibly
        return RefusedWatch(model, cfg, exc)
