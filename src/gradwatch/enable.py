"""``gradwatch.watch()``: turn monitoring on or off from the environment, under torchrun.

The same training script runs with the monitor on or off: ``GRADWATCH_ENABLED=0`` makes
:func:`watch` return a :class:`NoOpWatch` with the same methods, which does nothing but clip
(with torch's own function) when asked to, so the loop behaves identically. A ``GradWatch``
constructed directly with ``enabled=False`` (``GradWatch(model, WatchConfig())`` under
``GRADWATCH_ENABLED=0``) is inert in the same way.

Enabled from the environment, the monitor must never take the job down: when
:class:`GradWatch` refuses the setup (an unsupported parallelism, ranks holding different
models, a handshake timeout, a taken port), :func:`watch` logs the error once and returns a
:class:`RefusedWatch`: a :class:`NoOpWatch` that, on global rank 0 with a ``port``, serves
``gradwatch_collecting 0`` so the dashboard shows at once that nothing is measured. Invalid
settings still raise (a typo is caught before the first step); ``GradWatch(...)`` called
explicitly keeps raising.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.config import WatchConfig
from gradwatch.configfile import load_config
from gradwatch.main_grad import clip_local_, gradients_for_fallback
from gradwatch.snapshot import Snapshot
from gradwatch.watcher import GradWatch, PendingSnapshot

log = logging.getLogger("gradwatch")


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
    except Exception as exc:  # never take the job down: measure nothing, visibly
        return RefusedWatch(model, cfg, exc)


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
        held = list(self._model.parameters())
        if any(hasattr(p, "main_grad") for p in held):  # Megatron-Core: gradwatch.main_grad
            return clip_local_(gradients_for_fallback(held), max_norm, norm_type,
                               error_if_nonfinite)
        params = [p for p in held if p.grad is not None]
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


class RefusedWatch(NoOpWatch):
    """What :func:`watch` returns when :class:`GradWatch` refused the setup: a
    :class:`NoOpWatch` (collects nothing, issues no collective, clips with torch's rank-local
    function) that logged the refusal once and, on global rank 0 with a ``port``, serves
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

        try:
            publishing = open_publishing(
                config.model_copy(update={"history_path": None}),
                world_size=world_size,
                parallelism=self.parallelism,
            )
        except Exception as exc:
            log.error("gradwatch: the endpoint could not start either: %s", exc)
            return
        if publishing is not None:
            publishing.self_stats.set_collecting(False)
            self._publishing = publishing
            self.metrics_url = publishing.url

    def close(self) -> None:
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            publishing.close()

    def __exit__(self, *exc: object) -> None:
        self.close()
