"""Lightning callback (extra: ``torch-gradwatch[lightning]``).

Timing: Lightning calls ``on_before_optimizer_step`` after backward (and after AMP unscaling)
and **before** gradient clipping, so the norms are pre-clip and unscaled: the right moment.

The callback receives the unwrapped ``LightningModule``; under DDP the strategy's wrapper is
found from it (:func:`gradwatch.model.wrapping_ddp`), so the parallelism reads ``ddp{n}``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from gradwatch.config import WatchConfig
from gradwatch.integrations.common import log_figures
from gradwatch.watcher import GradWatch


class GradWatchCallback(pl.Callback):
    """Collects before each optimizer step and logs gradwatch's figures with ``log_dict``.

    ``Trainer(callbacks=[GradWatchCallback(WatchConfig(groups=...))])``. Figures of step N are
    logged at step N+1 (materializing them at step N would wait on the device).
    """

    def __init__(self, config: WatchConfig | None = None, **overrides: Any) -> None:
        self.config = config if config is not None else WatchConfig(**overrides)
        self.watch: GradWatch | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watch is None and self.config.enabled:
            self.watch = GradWatch(pl_module, self.config)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.watch is None:
            return
        previous = self.watch.last
        if previous is not None:
            pl_module.log_dict(log_figures(previous), on_step=True, on_epoch=False)
        self.watch.collect(step=trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
