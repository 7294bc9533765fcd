"""Tracker sinks: gradwatch's per-step scalars in TensorBoard, Weights & Biases and MLflow.

Each sink is a :class:`~gradwatch.export.Sink` fed by its own thread on rank 0 (never the
training thread), writing one row of scalars per published snapshot at its training step
(:class:`~gradwatch.export.sinks.scalars.StepScalars`: the endpoint's figures, same meaning). Turn
them on in the configuration or add one yourself::

    GradWatch(model, WatchConfig(sinks=["tensorboard"], tensorboard_dir="runs/gradwatch"))
    watch.add_sink(WandbSink())                 # the active W&B run, or a new one

Every tracker is an optional extra (``torch-gradwatch[tensorboard]``, ``[wandb]``,
``[mlflow]``), imported when its sink is built: ``import gradwatch`` and
``import gradwatch.export.sinks`` import none of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from gradwatch.export.sinks.scalars import StepScalars
from gradwatch.export.sinks.tracker import import_tracker

if TYPE_CHECKING:
    from gradwatch.config import WatchConfig
    from gradwatch.export.publisher import Sink
    from gradwatch.export.sinks.mlflow import MlflowSink
    from gradwatch.export.sinks.tensorboard import TensorBoardSink
    from gradwatch.export.sinks.wandb import WandbSink

__all__ = [
    "MlflowSink",
    "StepScalars",
    "TensorBoardSink",
    "WandbSink",
    "import_tracker",
    "sinks_from_config",
]

_LAZY = {
    "TensorBoardSink": "gradwatch.export.sinks.tensorboard",
    "WandbSink": "gradwatch.export.sinks.wandb",
    "MlflowSink": "gradwatch.export.sinks.mlflow",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sinks_from_config(cfg: WatchConfig) -> Iterator[Sink]:
    """The sinks ``cfg.sinks`` names, in that order (global rank 0 builds them at construction,
    so a missing package or an unusable run fails there, naming the setting)."""
    for name in cfg.sinks:
        try:
            if name == "tensorboard":
                from gradwatch.export.sinks.tensorboard import TensorBoardSink

                assert cfg.tensorboard_dir is not None  # WatchConfig checks it
                yield TensorBoardSink(cfg.tensorboard_dir, config=cfg)
            elif name == "wandb":
                from gradwatch.export.sinks.wandb import WandbSink

                yield WandbSink(config=cfg)
            else:
                from gradwatch.export.sinks.mlflow import MlflowSink

                yield MlflowSink(config=cfg)
        except Exception as exc:
            from gradwatch.errors import GradWatchError

            raise GradWatchError(
                f"gradwatch: sinks: could not start the {name!r} sink ({type(exc).__name__}: {exc})"
            ) from exc
