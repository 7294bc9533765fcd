"""MLflow sink: one ``log_batch`` per snapshot, every metric at the training step.

Imports ``mlflow`` (``pip install 'torch-gradwatch[mlflow]'``, which needs only
``mlflow-skinny``) when the sink is built, never on ``import gradwatch``.
"""

from __future__ import annotations

import os
import re
from typing import Any

from gradwatch.config import WatchConfig
from gradwatch.export.sinks.scalars import StepScalars
from gradwatch.export.sinks.tracker import import_tracker
from gradwatch.snapshot import Snapshot

__all__ = ["MlflowSink", "mlflow_key"]

#: MLflow's limit on the metrics of one ``log_batch`` request.
MAX_BATCH_METRICS = 1000

# MLflow refuses keys with other characters than these.
_UNSAFE = re.compile(r"[^\w\-. /]")


def mlflow_key(tag: str) -> str:
    """``tag`` with every character MLflow refuses in a metric key (anything but letters,
    digits, ``_ - . /`` and space) replaced by ``_``."""
    return _UNSAFE.sub("_", tag)


class MlflowSink:
    """A :class:`~gradwatch.export.Sink` logging each snapshot's row
    (:class:`~gradwatch.export.sinks.scalars.StepScalars`) to an MLflow run, every metric at
    ``step=snapshot.step`` with the collect's wall time. Keys are :func:`mlflow_key` of the tags.

    The run is resolved once, at construction (MLflow's active run is per thread, and the sink
    writes from its own thread).

    Args:
        run_id: the run to log to; None: the active run of the constructing thread
            (``mlflow.active_run()``), else a new run in ``experiment_id`` (default: MLflow's,
            from ``MLFLOW_EXPERIMENT_NAME``/``MLFLOW_EXPERIMENT_ID``), ended by :meth:`close`.
            A run the sink did not create is never ended by it.
        tracking_uri: default: MLflow's (``MLFLOW_TRACKING_URI``, ``mlflow.set_tracking_uri``).
        config: the watcher's configuration (see :class:`StepScalars`).
        prefix: first component of every key.
    """

    #: The ``sink`` label of its ``gradwatch_sink_*`` series.
    name = "mlflow"
    #: Completes "could not ... a collected step" in error logs.
    action = "log to MLflow the scalars of"

    def __init__(
        self,
        run_id: str | None = None,
        *,
        tracking_uri: str | None = None,
        experiment_id: str | None = None,
        config: WatchConfig | None = None,
        prefix: str = "gradwatch",
    ) -> None:
        mlflow = import_tracker(
            "mlflow",
            "MlflowSink needs mlflow (or mlflow-skinny): pip install 'torch-gradwatch[mlflow]'",
        )
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        self._scalars = StepScalars(config, prefix=prefix)
        self._client: Any = MlflowClient(tracking_uri=tracking_uri)
        self._owns_run = False
        if run_id is None:
            active = mlflow.active_run()
            if active is not None:
                run_id = active.info.run_id
            else:
                run = self._client.create_run(experiment_id or _default_experiment(self._client))
                run_id, self._owns_run = run.info.run_id, True
        self.run_id: str = run_id

    def note_dropped(self, total: int) -> None:
        """Collected steps this sink never got so far (its worker's count, see
        :mod:`gradwatch.export.sinkworker`): ``<prefix>/dropped_steps`` in the next row."""
        self._scalars.dropped_steps = total

    def write(self, snapshot: Snapshot) -> None:
        millis = int(snapshot.timestamp * 1000)
        metrics = [
            self._metric(mlflow_key(name), value, millis, snapshot.step)
            for name, value in self._scalars(snapshot).items()
        ]
        for i in range(0, len(metrics), MAX_BATCH_METRICS):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + MAX_BATCH_METRICS])

    def close(self) -> None:
        if self._owns_run:
            self._client.set_terminated(self.run_id)


def _default_experiment(client: Any) -> str:
    """The experiment MLflow's fluent API would use: ``MLFLOW_EXPERIMENT_ID``, else
    ``MLFLOW_EXPERIMENT_NAME`` (created when missing), else the default experiment ``"0"``."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        found = client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else client.create_experiment(name)
    return "0"
