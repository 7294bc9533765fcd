"""TensorBoard sink: one scalar per tag and step in a TensorBoard event file.

Writes through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package,
``pip install 'torch-gradwatch[tensorboard]'``), imported when the sink is built, never by
``import gradwatch``.
"""

from __future__ import annotations

import os
from typing import Any

from gradwatch.config import WatchConfig
from gradwatch.export.sinks.scalars import StepScalars
from gradwatch.export.sinks.tracker import import_tracker
from gradwatch.snapshot import Snapshot

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """A :class:`~gradwatch.export.Sink` writing each snapshot's row
    (:class:`~gradwatch.export.sinks.scalars.StepScalars`) as TensorBoard scalars at
    ``global_step=snapshot.step``, with the collect's wall time.

    Args:
        log_dir: the run's directory (TensorBoard's ``--logdir`` or one of its runs).
        config: the watcher's configuration (see :class:`StepScalars`).
        prefix: first component of every tag.
        flush_secs: the writer flushes its queue to disk at least this often; :meth:`close`
            flushes the rest.
    """

    #: Completes "could not ... a collected step" in the publisher's error log.
    action = "write the TensorBoard scalars of"

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        config: WatchConfig | None = None,
        prefix: str = "gradwatch",
        flush_secs: int = 10,
    ) -> None:
        tensorboard = import_tracker(
            "torch.utils.tensorboard",
            "TensorBoardSink needs the tensorboard package: "
            "pip install 'torch-gradwatch[tensorboard]'",
        )
        self.log_dir = os.fspath(log_dir)
        self._scalars = StepScalars(config, prefix=prefix)
        self._writer: Any = tensorboard.SummaryWriter(log_dir=self.log_dir, flush_secs=flush_secs)

    def write(self, snapshot: Snapshot) -> None:
        walltime = snapshot.timestamp or None
        for name, value in self._scalars(snapshot).items():
            self._writer.add_scalar(name, value, global_step=snapshot.step, walltime=walltime)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
