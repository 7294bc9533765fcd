"""Hugging Face ``transformers.Trainer`` callback (extra: ``torch-gradwatch[transformers]``).

Timing: the Trainer clips gradients (``max_grad_norm``, default 1.0) *before* any callback
runs, through ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``, and offers no
hook between backward and clipping. So the callback routes that call, for the Trainer's model
only, to :meth:`GradWatch.clip_grad_norm_`: one pass and at most one all-reduce measure the pre-clip
gradients and clip them with the same ``max_grad_norm``, the same coefficient
``min(1, max_norm / (total + 1e-6))`` and the whole-model norm, and the total returned is the
``grad_norm`` the Trainer logs, so its ``grad_norm`` and gradwatch's global norm are one number.

The route is an override of ``accelerate.Accelerator.clip_grad_norm_`` installed from
``on_train_begin`` to ``on_train_end`` (the callback is never handed the Trainer or its
accelerator); it takes a call only when its parameters are exactly the watched model's, the
norm is L2 and finite, and the accelerator runs a path gradwatch measures exactly (single
process, DDP, FSDP1 with either ``use_orig_params``, FSDP2); any other call goes to accelerate
untouched. Under FSDP1 accelerate would call the root's ``FullyShardedDataParallel.clip_grad_norm_``
(the same coefficient over the whole model); gradwatch scales every rank's shards by the
coefficient of its exact whole-model norm instead. Under XLA or Megatron-LM (the engine clips),
or when the Trainer clips without the accelerator (its mixed-mesh path), gradwatch cannot take
over: it warns once, and its figures are then **post-clip** (at most ``max_grad_norm``).

**Under DeepSpeed** accelerate's ``backward`` runs ``engine.backward(loss)`` and, on an
accumulation boundary, ``engine.step()``, which clips (``gradient_clipping``, the Trainer's
``max_grad_norm``) inside the optimizer step; ``on_pre_optimizer_step`` comes after it, when the
reduced gradients are gone. So the callback wraps the engine's ``step`` (an instance attribute,
from ``on_train_begin`` to ``on_train_end``): on a boundary it collects first, from DeepSpeed's
partitions (:mod:`gradwatch.stacks.zero`): **pre-clip** figures, never labelled post-clip. After the
step, DeepSpeed's own ``get_global_grad_norm()`` (what the Trainer logs as ``grad_norm``) is
handed to :meth:`GradWatch.audit_norm` (``source="deepspeed"``).

With ``max_grad_norm=0`` (no clipping) the Trainer's own norm is computed by accelerate with
torch's function, and gradwatch collects in ``on_pre_optimizer_step``, before the optimizer step.

The callback receives the unwrapped model; under DDP the Trainer's wrapper is found from it
(:func:`gradwatch.norms.model.wrapping_ddp`), so the parallelism reads ``ddp{n}`` as for plain DDP.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from transformers import TrainerCallback

from gradwatch.config import WatchConfig
from gradwatch.integrations.common import LIVE_RUNS, close_watch, log_figures
from gradwatch.step.guard import GuardedOptimizer
from gradwatch.watcher import GradWatch

log = logging.getLogger("gradwatch")

#: accelerate's distributed types whose clipping is not ``_clip_grad_norm_dtensor_aware`` over
#: the given parameters (the engine clips, or gradwatch cannot read the layout): not routed.
_ENGINE_CLIPS = frozenset({"DEEPSPEED", "XLA", "MEGATRON_LM"})


class GradWatchCallback(TrainerCallback):
    """Collects pre-clip gradients once per optimizer step and adds gradwatch's figures to the
    Trainer's logs.

    ``Trainer(..., callbacks=[GradWatchCallback(WatchConfig(groups=...))])``. The watcher is
    built at ``on_train_begin`` on every rank (its construction is a collective). With
    clipping on, the Trainer clips through :meth:`GradWatch.clip_grad_norm_` (see the module
    docs); :attr:`routed` says whether it does.
    """

    def __init__(self, config: WatchConfig | None = None, **overrides: Any) -> None:
        self.config = config if config is not None else WatchConfig(**overrides)
        self.watch: GradWatch | None = None
        self._state: Any = None
        self._params: frozenset[int] = frozenset()
        self._routed_step: int | None = None
        self._warned = False
        self._engine: Any = None  # the DeepSpeed engine whose step is wrapped

    @property
    def routed(self) -> bool:
        """True while the Trainer's clipping is routed through gradwatch (clipping on)."""
        return self in _ROUTE.callbacks

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        # A run whose training raised never reached on_train_end: its watcher is closed here
        # (this callback's included), so this run watches and clips the model it is given.
        LIVE_RUNS.begin(self)
        self._routed_step = None
        self._warned = False
        if model is not None and self.config.enabled:
            self.watch = GradWatch(model, self.config)
        zero = self.watch._resolved.zero if self.watch is not None else None
        if zero is not None:
            if self.config.guard:
                log.warning(
                    "gradwatch: the optimizer-step guard does not cover a DeepSpeed engine "
                    "(its step is the engine's): WatchConfig.guard is ignored"
                )
            self._wrap_engine_step(zero.engine, state)
            return
        if self.watch is not None and _accelerate_kind() == "DEEPSPEED":
            # DeepSpeed trains, but no engine holds this model: its .grad stays None, and
            # figures of nothing must not be published as norms of 0.
            log.error(
                "gradwatch: accelerate runs DeepSpeed but no DeepSpeedEngine trains the "
                "Trainer's model: not watching (the reduced gradients are in the engine's "
                "partitions, which gradwatch reads only through the engine)"
            )
            self.watch.close()
            self.watch = None
            return
        if self.watch is not None and self.config.guard:
            self._guard(kw.get("optimizer"))
        if self.watch is None or not args.max_grad_norm > 0:
            return
        self._state = state
        self._params = frozenset(id(p) for p in model.parameters())
        why = _cannot_route()
        if why is None:
            _ROUTE.add(self)
        else:
            self._warn_post_clip(args, why)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any):
        if self.watch is None:
            return
        # The Trainer counts this optimizer step once it is done: everything it logs for it
        # (loss, its own grad_norm) carries global_step + 1, and so do gradwatch's snapshot,
        # history line and metrics.
        step = state.global_step + 1
        if self._routed_step == step:
            return  # measured pre-clip by the routed clip (or DeepSpeed's step) of this step
        if self._engine is not None:
            return  # DeepSpeed: measured in engine.step(), never after it
        if args.max_grad_norm > 0:
            self._warn_post_clip(args, "the Trainer clipped without accelerate's clip_grad_norm_")
        self.watch.collect(step=step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
        if self.watch is None or logs is None:
            return
        snap = self.watch.last
        if snap is None or snap.step != state.global_step:
            return  # never label another step's figures with this step
        figures = log_figures(snap)
        logs.update(figures)  # seen by the reporting callbacks that run after this one
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        self.end_run(drain=True)

    def end_run(self, drain: bool) -> None:
        """Close the run's watcher (``drain``: wait, bounded, for its all-reduces in flight),
        remove the clip route and the engine wrapper. Idempotent; also called, without
        draining, when a later run begins on this thread and this one never ended."""
        LIVE_RUNS.end(self)
        _ROUTE.remove(self)
        self._params = frozenset()
        if self._engine is not None:
            self._engine.__dict__.pop("step", None)  # the class's step again
            self._engine = None
        if self.watch is not None:
            close_watch(self.watch, drain)
            self.watch = None

    # -- DeepSpeed ----------------------------------------------------------------------------

    def _wrap_engine_step(self, engine: Any, state: Any) -> None:
        """Collect on every accumulation boundary inside ``engine.step()``, before DeepSpeed's
        optimizer step (and its clipping) consumes the reduced gradients; audit DeepSpeed's
        own norm after it."""
        original = engine.step
        self._engine = engine

        def step(*args: Any, **kwargs: Any) -> Any:
            watch = self.watch
            collected = None
            if watch is not None and engine.is_gradient_accumulation_boundary():
                collected = state.global_step + 1
                self._routed_step = collected
                watch.collect(step=collected)
            out = original(*args, **kwargs)
            if watch is not None and collected is not None:
                norm = engine.get_global_grad_norm()
                if norm is not None:  # None: DeepSpeed computed no norm (ZeRO-0, fp32)
                    watch.audit_norm(norm, step=collected, source="deepspeed")
            return out

        engine.step = step

    def _guard(self, optimizer: Any) -> None:
        """``WatchConfig.guard``: the Trainer's optimizer steps through ``watch.guard()``. The
        Trainer's is accelerate's ``AcceleratedOptimizer``: the torch optimizer inside it is
        wrapped, so accelerate's GradScaler (fp16) composes with the guard."""
        assert self.watch is not None
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or isinstance(inner, GuardedOptimizer):
            return
        scaler = getattr(optimizer, "scaler", None)
        optimizer.optimizer = self.watch.guard(inner, scaler=scaler)

    # -- the routed clip ----------------------------------------------------------------------

    def _takes(
        self, accelerator: Any, params: list[Any], max_norm: float, norm_type: float
    ) -> bool:
        """Whether this call is the Trainer's clip of the watched model, on a path gradwatch
        measures exactly."""
        if self.watch is None or norm_type != 2 or not math.isfinite(max_norm):
            return False
        kind = getattr(getattr(accelerator, "distributed_type", None), "value", "")
        if kind in _ENGINE_CLIPS:
            return False
        return len(params) == len(self._params) and {id(p) for p in params} == self._params

    def _clip(self, accelerator: Any, max_norm: float) -> Any:
        assert self.watch is not None
        accelerator.unscale_gradients()  # as accelerate does first (fp16 GradScaler)
        step = self._state.global_step + 1
        self._routed_step = step
        # The scaler (gradients already unscaled: not divided again) marks AMP-skipped steps.
        scaler = getattr(accelerator, "scaler", None)
        return self.watch.clip_grad_norm_(max_norm, step=step, scaler=scaler)

    def _warn_post_clip(self, args: Any, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "gradwatch: cannot take over the Trainer's gradient clipping (%s): gradwatch's "
                "figures are post-clip (at most max_grad_norm=%s) and the exploding alert cannot "
                "see larger norms; the Trainer's own grad_norm is pre-clip",
                why,
                args.max_grad_norm,
            )


def _accelerate_kind() -> str | None:
    """accelerate's distributed type (``"DEEPSPEED"``, ...), None when no state is set up."""
    try:
        from accelerate.state import AcceleratorState, is_initialized

        if not is_initialized():
            return None
        return str(AcceleratorState().distributed_type.value)
    except (ImportError, AttributeError):  # accelerate missing or laid out differently
        return None


def _cannot_route() -> str | None:
    """Why accelerate's clip cannot be routed (None when it can)."""
    try:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - transformers requires accelerate
        return "accelerate is not importable"
    if not callable(getattr(Accelerator, "clip_grad_norm_", None)):
        return "accelerate has no Accelerator.clip_grad_norm_"
    try:
        from accelerate.state import is_initialized

        if not is_initialized():  # constructing AcceleratorState() would initialize one
            return None
        kind = AcceleratorState().distributed_type.value
    except (ImportError, AttributeError):  # an unknown state: the per-call check decides
        return None
    if kind in _ENGINE_CLIPS:
        return f"accelerate runs {kind}, whose engine clips"
    return None


class _AcceleratorRoute:
    """The override of ``Accelerator.clip_grad_norm_`` shared by active callbacks: installed
    while at least one is training, removed (the class attribute restored) after the last."""

    def __init__(self) -> None:
        self.callbacks: list[GradWatchCallback] = []
        self._lock = threading.Lock()
        self._original: Any = None

    def add(self, callback: GradWatchCallback) -> None:
        from accelerate import Accelerator

        with self._lock:
            if callback in self.callbacks:
                return
            if not self.callbacks:
                self._original = Accelerator.__dict__["clip_grad_norm_"]
                original = self._original

                def clip_grad_norm_(
                    acc: Any, parameters: Any, max_norm: float, norm_type: float = 2
                ) -> Any:
                    params = list(parameters)
                    for cb in list(self.callbacks):
                        if cb._takes(acc, params, max_norm, norm_type):
                            return cb._clip(acc, max_norm)
                    return original(acc, params, max_norm, norm_type)

                clip_grad_norm_.__doc__ = original.__doc__
                Accelerator.clip_grad_norm_ = clip_grad_norm_  # type: ignore[method-assign]
            self.callbacks.append(callback)

    def remove(self, callback: GradWatchCallback) -> None:
        with self._lock:
            if callback not in self.callbacks:
                return
            self.callbacks.remove(callback)
            if not self.callbacks and self._original is not None:
                from accelerate import Accelerator

                Accelerator.clip_grad_norm_ = self._original  # type: ignore[method-assign]
                self._original = None


_ROUTE = _AcceleratorRoute()
