"""Weights & Biases sink: one ``run.log`` per snapshot, at the training step.

Imports ``wandb`` (``pip install 'torch-gradwatch[wandb]'``) when the sink is built, never on
``import gradwatch``. Offline runs (``WANDB_MODE=offline``) work the same.
"""

from __future__ import annotations

from typing import Any

from gradwatch.config import WatchConfig
from gradwatch.export.sinks.scalars import StepScalars
from gradwatch.export.sinks.tracker import import_tracker
from gradwatch.snapshot import Snapshot

__all__ = ["WandbSink"]


class WandbSink:
    """A :class:`~gradwatch.export.Sink` logging each snapshot's row
    (:class:`~gradwatch.export.sinks.scalars.StepScalars`) to a W&B run with ``step=snapshot.step``.

    The row also carries ``<prefix>/step`` (the training step), declared as the x axis of
    ``<prefix>/*`` (``define_metric``), so the charts are by training step even where another
    logger declared its own x axis for ``*``. W&B keeps a run's steps increasing: a row for a
    step below the run's current one is dropped by W&B with a warning (log your own metrics
    with the same training step, or without ``step=``).

    Args:
        run: the run to log to; None: the active run (``wandb.run``), else a new one started
            with ``wandb.init(**init_kwargs)`` (configured by the usual ``WANDB_*`` variables)
            and finished by :meth:`close`. A run the sink did not start is never finished by it.
        config: the watcher's configuration (see :class:`StepScalars`).
        prefix: first component of every key.
    """

    #: The ``sink`` label of its ``gradwatch_sink_*`` series.
    name = "wandb"
    #: Completes "could not ... a collected step" in error logs.
    action = "log to W&B the scalars of"

    def __init__(
        self,
        run: Any = None,
        *,
        config: WatchConfig | None = None,
        prefix: str = "gradwatch",
        **init_kwargs: Any,
    ) -> None:
        wandb = import_tracker(
            "wandb", "WandbSink needs the wandb package: pip install 'torch-gradwatch[wandb]'"
        )
        self._scalars = StepScalars(config, prefix=prefix)
        self._step_key = f"{prefix}/step"
        self._owns_run = run is None and wandb.run is None
        self.run: Any = run if run is not None else (wandb.run or wandb.init(**init_kwargs))
        self.run.define_metric(self._step_key)
        self.run.define_metric(f"{prefix}/*", step_metric=self._step_key)

    def note_dropped(self, total: int) -> None:
        """Collected steps this sink never got so far (its worker's count, see
        :mod:`gradwatch.export.sinkworker`): ``<prefix>/dropped_steps`` in the next row."""
        self._scalars.dropped_steps = total

    def write(self, snapshot: Snapshot) -> None:
        row: dict[str, Any] = self._scalars(snapshot)
        row[self._step_key] = snapshot.step
        self.run.log(row, step=snapshot.step)

    def close(self) -> None:
        if self._owns_run:
            self.run.finish()
