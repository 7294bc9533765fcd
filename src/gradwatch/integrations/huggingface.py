"""Hugging Face ``transformers.Trainer`` callback (extra: ``torch-gradwatch[transformers]``).

Timing: the Trainer clips gradients (``max_grad_norm``, default 1.0) and then calls
``on_pre_optimizer_step``; it offers no hook between backward and clipping, so the norms seen
here are **post-clip** whenever clipping is on. The Trainer logs its own pre-clip ``grad_norm``;
gradwatch adds per-group norms, ratios, health and non-finite counts next to it.

The callback receives the unwrapped model; under DDP the Trainer's wrapper is found from it
(:func:`gradwatch.model.wrapping_ddp`), so the parallelism reads ``ddp{n}`` as for plain DDP.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from gradwatch.config import WatchConfig
from gradwatch.integrations.common import log_figures
from gradwatch.watcher import GradWatch


class GradWatchCallback(TrainerCallback):
    """Collects before every optimizer step and adds gradwatch's figures to the Trainer's logs.

    ``Trainer(..., callbacks=[GradWatchCallback(WatchConfig(groups=...))])``. The watcher is
    built at ``on_train_begin`` on every rank (its construction is a collective).
    """

    def __init__(self, config: WatchConfig | None = None, **overrides: Any) -> None:
        self.config = config if config is not None else WatchConfig(**overrides)
        self.watch: GradWatch | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if self.watch is None and model is not None and self.config.enabled:
            self.watch = GradWatch(model, self.config)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any):
        if self.watch is not None:
            # The Trainer counts this optimizer step once it is done: everything it logs for
            # it (loss, its own grad_norm) carries global_step + 1, and so do gradwatch's
            # snapshot, history line and metrics.
            self.watch.collect(step=state.global_step + 1)

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
        if self.watch is not None:
            self.watch.close()
            self.watch = None
