"""TensorBoard sink: one scalar per tag and step in a TensorBoard event file.

Writes through ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package,
``pip install 'torch-gradwatch[tensorboard]'``), imported when the sink is built, never by
``import gradwatch``.
"""

from __future__ import annotations

import contextlib
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
    ``global_step=snapshot.step``, with the collect's wall time. A failed write raises (the
    sink's worker counts it and retries) and the next write opens a new event file, so the data
    resumes once the disk heals.

    Args:
        log_dir: the run's directory (TensorBoard's ``--logdir`` or one of its runs).
        config: the watcher's configuration (see :class:`StepScalars`).
        prefix: first component of every tag.
        flush_secs: TensorBoard's own flush period (each :meth:`write` flushes its row anyway).
    """

    #: The ``sink`` label of its ``gradwatch_sink_*`` series.
    name = "tensorboard"
    #: Completes "could not ... a collected step" in error logs.
    action = "write the TensorBoard scalars of"

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        config: WatchConfig | None = None,
        prefix: str = "gradwatch",
        flush_secs: int = 10,
    ) -> None:
        self._tensorboard: Any = import_tracker(
            "torch.utils.tensorboard",
            "TensorBoardSink needs the tensorboard package: "
            "pip install 'torch-gradwatch[tensorboard]'",
        )
        self.log_dir = os.fspath(log_dir)
        self._flush_secs = flush_secs
        self._scalars = StepScalars(config, prefix=prefix)
        self._writer: Any = self._open()

    def _open(self) -> Any:
        return self._tensorboard.SummaryWriter(log_dir=self.log_dir, flush_secs=self._flush_secs)

    def note_dropped(self, total: int) -> None:
        """Collected steps this sink never got so far (its worker's count, see
        :mod:`gradwatch.export.sinkworker`): ``<prefix>/dropped_steps`` in the next row."""
        self._scalars.dropped_steps = total

    def write(self, snapshot: Snapshot) -> None:
        """Write the row and flush it to the event file, so a failed write raises here (and is
        retried) instead of in TensorBoard's own thread, which would fail every later write.

        After a failure, or when the event file was removed under the writer, the writer is
        replaced by a new one (a new event file in ``log_dir``, created again if needed)."""
        if self._writer is None or not self._file_present():
            self._discard()
            self._writer = self._open()
        walltime = snapshot.timestamp or None
        try:
            for name, value in self._scalars(snapshot).items():
                self._writer.add_scalar(name, value, global_step=snapshot.step, walltime=walltime)
            self._writer.flush()
        except Exception:
            self._discard()
            raise

    def _file_present(self) -> bool:
        """Whether the writer's event file is still where it writes (not deleted under it)."""
        event_writer = getattr(getattr(self._writer, "file_writer", None), "event_writer", None)
        name = getattr(event_writer, "_file_name", None)
        return os.path.isfile(name) if isinstance(name, str) else os.path.isdir(self.log_dir)

    def _discard(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(OSError):  # its own thread may have failed already
                writer.close()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self._discard()
