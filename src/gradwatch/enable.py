"""``gradwatch.watch()``: turn monitoring on or off from the environment, under torchrun.

The same training script runs with the monitor on or off: ``GRADWATCH_ENABLED=0`` makes
:func:`watch` return a :class:`NoOpWatch` with the same methods, which does nothing but clip
(with torch's own function) when asked to, so the loop behaves identically. A ``GradWatch``
constructed directly with ``enabled=False`` (``GradWatch(model, WatchConfig())`` under
``GRADWATCH_ENABLED=0``) is inert in the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradwatch.config import WatchConfig
from gradwatch.configfile import load_config
from gradwatch.snapshot import Snapshot
from gradwatch.watcher import GradWatch, PendingSnapshot


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
    """
    cfg = load_config(**overrides)
    if not cfg.enabled:
        return NoOpWatch(model, cfg)
    return GradWatch(model, cfg, process_group=process_group, stage_group=stage_group)


class NoOpWatch:
    """Same methods as :class:`GradWatch`; collects nothing, opens no port, issues no collective."""

    metrics_url: str | None = None
    parallelism = "disabled"

    def __init__(self, model: nn.Module, config: WatchConfig | None = None) -> None:
        self.config = config if config is not None else WatchConfig(enabled=False)
        self._model = model

    @property
    def last(self) -> Snapshot | None:
        return None

    def collect(self, step: int, **_: Any) -> PendingSnapshot:
        return PendingSnapshot(step, snapshot=Snapshot(step=step))

    def attach(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
        return None

    def guard(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> Any:
        """The optimizer itself: nothing is measured, so nothing is skipped."""
        return optimizer

    @property
    def isolated(self) -> tuple[str, ...]:
        return tuple(self.config.isolated)

    def set_isolated(self, groups: Any) -> None:
        return None

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        **_: Any,
    ) -> Tensor:
        params = [p for p in self._model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

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
