"""Sinks behind a fast loop: does every collected step reach each sink, or get counted?

A one-process loop of ``steps`` collects, one every ``step_seconds`` (about 1 ms), with an
endpoint and either

* ``slow``: one user sink taking ``sink_seconds`` (20 ms) per write, or
* ``trackers``: the history file, TensorBoard and MLflow (file store) at once.

After ``flush`` and ``close`` it reads back what each sink stored (the history file, the
TensorBoard event files, the MLflow run) and the counters: the endpoint's published steps and
``gradwatch_dropped_snapshots_total``, each sink's ``gradwatch_sink_dropped_steps_total``.
Accounting holds when, per sink, received + dropped == published, and published + dropped
snapshots == steps (``tests/unit/export/test_sink_workers.py`` asserts it on every run; this prints
the figures docs/integrations.md quotes).

Standalone::

    PYTHONPATH=src:tests/helpers:. python -m benchmarks.sinks_bench
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gradwatch import GradWatch, Snapshot, WatchConfig
from gradwatch.export.history import read_history


class SlowSink:
    """A user sink taking ``seconds`` per write."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.steps: list[int] = []

    def write(self, snapshot: Snapshot) -> None:
        time.sleep(self.seconds)
        self.steps.append(snapshot.step)


def _loop(cfg: WatchConfig, steps: int, step_seconds: float, extra: tuple[Any, ...] = ()) -> dict:
    model = torch.nn.Linear(8, 4)
    watch = GradWatch(model, cfg)
    for sink in extra:
        watch.add_sink(sink)
    started = time.perf_counter()
    for step in range(steps):
        model.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        watch.collect(step)
        time.sleep(step_seconds)
    elapsed = time.perf_counter() - started
    publishing = watch._publishing
    assert publishing is not None
    flushed = watch.flush(120)
    watch.close()
    view = publishing.self_stats.view()
    state = publishing._state
    return {
        "steps": steps,
        "ms_per_step": round(1000 * elapsed / steps, 2),
        "flushed": flushed,
        "published": state.current().counts.collections if state is not None else None,
        "dropped_snapshots": view.dropped,
        "sink_dropped": dict(view.sink_dropped),
        "sink_errors": dict(view.sink_errors),
    }


def slow(steps: int = 400, step_seconds: float = 0.001, sink_seconds: float = 0.02) -> dict:
    sink = SlowSink(sink_seconds)
    cfg = WatchConfig(port=0, bind_address="127.0.0.1")
    out = _loop(cfg, steps, step_seconds, (sink,))
    out["received"] = {"slow": len(sink.steps)}
    return out


def trackers(steps: int = 300, step_seconds: float = 0.001) -> dict:
    import trackers as read_back  # tests/helpers: each tracker's own reader

    root = Path(tempfile.mkdtemp(prefix="gradwatch-sinks-"))
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    os.environ["MLFLOW_TRACKING_URI"] = (root / "mlruns").as_uri()
    cfg = WatchConfig(
        port=0,
        bind_address="127.0.0.1",
        history_path=root / "history.jsonl",
        sinks=["tensorboard", "mlflow"],
        tensorboard_dir=root / "tb",
    )
    out = _loop(cfg, steps, step_seconds)
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs(["0"])
    out["received"] = {
        "history": len(read_history(root / "history.jsonl")),
        "tensorboard": len(read_back.tensorboard_rows(root / "tb")["gradwatch/global_grad_norm"]),
        "mlflow": len(client.get_metric_history(run.info.run_id, "gradwatch/global_grad_norm")),
    }
    return out


if __name__ == "__main__":
    for name, result in (("slow", slow()), ("trackers", trackers())):
        print(name, json.dumps(result))
