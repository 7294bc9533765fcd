"""Lightning callback (extra: ``torch-gradwatch[lightning]``).

Timing: Lightning calls ``on_before_optimizer_step`` after backward (and after AMP unscaling)
and **before** gradient clipping, so the norms are pre-clip and unscaled: the right moment.

The callback receives the unwrapped ``LightningModule``; under DDP the strategy's wrapper is
found from it (:func:`gradwatch.norms.model.wrapping_ddp`), so the parallelism reads ``ddp{n}``.

Auditing: when the module logs Lightning's own total gradient norm (the
``grad_2.0_norm_total`` entry of ``lightning.pytorch.utilities.grad_norm``, the documented way
to log it from ``on_before_optimizer_step``), the value is handed to
:meth:`GradWatch.audit_norm` (``source="lightning"``) with the step it was logged for: the
module's ``log`` is wrapped from ``on_fit_start`` to ``on_fit_end`` to see the value as it is
logged (no host read; a stale value of an earlier step is never audited).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from gradwatch.config import WatchConfig
from gradwatch.integrations.common import LIVE_RUNS, PREFIX, close_watch, log_figures
from gradwatch.step.guard import GuardedOptimizer
from gradwatch.watcher import GradWatch

#: The key of the total norm ``lightning.pytorch.utilities.grad_norm(module, 2)`` returns.
LIGHTNING_TOTAL_NORM = "grad_2.0_norm_total"


class GradWatchCallback(pl.Callback):
    """Collects before each optimizer step and logs gradwatch's figures with ``log_dict``.

    ``Trainer(callbacks=[GradWatchCallback(WatchConfig(groups=...))])``. Figures of step N are
    logged at step N+1, on rank 0, as CPU tensors, with ``gradwatch/step`` = N (materializing
    them at step N would wait on the device; other ranks log none: Lightning's loggers write
    from rank 0).
    """

    def __init__(self, config: WatchConfig | None = None, **overrides: Any) -> None:
        self.config = config if config is not None else WatchConfig(**overrides)
        self.watch: GradWatch | None = None
        self._step: int | None = None  # the step collected in the current optimizer step
        self._logged: int | None = None  # the step of the last snapshot logged
        self._wrapped: pl.LightningModule | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run that ended without on_fit_end or on_exception (a framework that skipped them)
        # is closed here, this callback's included: this run watches the module it is given.
        LIVE_RUNS.begin(self)
        self._step = self._logged = None
        if self.config.enabled:
            self.watch = GradWatch(pl_module, self.config)
            if self.config.guard:
                self._guard(trainer)
            self._wrap_log(pl_module)

    def _guard(self, trainer: pl.Trainer) -> None:
        """``WatchConfig.guard``: the strategy's optimizers step through ``watch.guard()``
        (Lightning's closure is evaluated first, so the collect of ``on_before_optimizer_step``
        decides the step; its AMP scaler composes)."""
        assert self.watch is not None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        trainer.strategy.optimizers = [
            opt if isinstance(opt, GuardedOptimizer) else self.watch.guard(opt, scaler=scaler)
            for opt in trainer.strategy.optimizers
        ]

    def _wrap_log(self, pl_module: pl.LightningModule) -> None:
        """Audit Lightning's total gradient norm as the module logs it."""
        original = pl_module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            watch, step = self.watch, self._step
            if (
                watch is not None
                and step is not None
                and name.endswith(LIGHTNING_TOTAL_NORM)
                and isinstance(value, (torch.Tensor, float, int))
            ):
                watch.audit_norm(value, step=step, source="lightning")
            return original(name, value, *args, **kwargs)

        pl_module.log = log  # type: ignore[method-assign]
        self._wrapped = pl_module

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.watch is None:
            return
        self._log_ready(pl_module)
        self.watch.collect(step=trainer.global_step)
        self._step = trainer.global_step

    def _log_ready(self, pl_module: pl.LightningModule) -> None:
        """On rank 0, log the newest measured snapshot (the previous step's, built by the
        publisher or here from its landed result), once, with its own step as
        ``gradwatch/step``. Other ranks log nothing: Lightning's loggers write from rank 0.

        Lightning turns a logged Python number into ``torch.tensor(v, device=module.device)``,
        one blocking host-to-device copy per figure; a logged CPU tensor is only cloned on the
        host. So the figures go as views of one CPU tensor per step: nothing reaches the
        device, nothing is read back from it."""
        watch = self.watch
        snap = watch.last if watch is not None and watch.rank == 0 else None
        if snap is None or snap.step == self._logged:
            return
        self._logged = snap.step
        figures = {**log_figures(snap), f"{PREFIX}step": float(snap.step)}
        values = torch.tensor(list(figures.values()), dtype=torch.float64)  # host memory
        pl_module.log_dict(
            dict(zip(figures, values.unbind(), strict=True)), on_step=True, on_epoch=False
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._step = None  # a value logged outside the optimizer step is not audited

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end_run(drain=True)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """The fit raised: its watcher is closed now (port freed), without waiting for peers."""
        self.end_run(drain=False)

    def end_run(self, drain: bool) -> None:
        """Close the run's watcher (``drain``: wait, bounded, for its all-reduces in flight) and
        unwrap the module's ``log``. Idempotent."""
        LIVE_RUNS.end(self)
        self._step = None
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("log", None)
            self._wrapped = None
        if self.watch is not None:
            close_watch(self.watch, drain)
            self.watch = None
