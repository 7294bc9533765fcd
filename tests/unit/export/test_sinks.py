"""Tracker sinks (gradwatch.sinks) against the real TensorBoard, W&B and MLflow, offline.

One reference job (tests/helpers/trackers.py: two groups, one ratio, a NaN step) runs through
GradWatch with each sink; what the tracker stored is read back with the tracker's own reader
and compared, per tag and training step, with float64 values computed from the exact
gradients, to 1e-6 relative: gradwatch norms CPU float32 gradients with float32 partial sums
(within 5e-7 of exact, gradwatch.norms.stats) and TensorBoard stores float32 scalars.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trackers
from gradwatch.sinks import MlflowSink, StepScalars, TensorBoardSink, WandbSink
from gradwatch.sinks.mlflow import mlflow_key
from pydantic import ValidationError

from gradwatch import GradWatch, WatchConfig
from gradwatch.errors import GradWatchError
from gradwatch.export import sinkworker
from gradwatch.snapshot import GroupStats, Snapshot

TRACKERS = ("tensorboard", "wandb", "mlflow")


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing sink's backoff in milliseconds, so a test waits for retries in milliseconds."""
    monkeypatch.setattr(sinkworker, "RETRY_FIRST_SECONDS", 0.001)
    monkeypatch.setattr(sinkworker, "RETRY_MAX_SECONDS", 0.01)


def job(**cfg: object) -> tuple[GradWatch, object]:
    net = trackers.model()
    watch = GradWatch(net, WatchConfig(groups=trackers.GROUPS, ratios=trackers.RATIOS, **cfg))
    return watch, net


def run(watch: GradWatch, net: object, *, healthy: bool = True) -> None:
    for step in range(trackers.STEPS):
        trackers.set_grads(net, step)  # type: ignore[arg-type]
        watch.collect(step)
        # every step reaches the sinks (a publisher that falls behind drops the oldest); a
        # failing sink is not waited for (flush may then return False), the others are
        flushed = watch.flush(30)
        assert flushed or not healthy
    watch.close()


def test_importing_gradwatch_imports_no_tracker() -> None:
    code = (
        "import sys, gradwatch, gradwatch.sinks, gradwatch.export\n"
        "from gradwatch.sinks import StepScalars, sinks_from_config\n"
        "import torch\n"
        "w = gradwatch.GradWatch(torch.nn.Linear(2, 2), gradwatch.WatchConfig())\n"
        "w.close()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('tensorboard', 'wandb', 'mlflow', 'tensorboardX') or m == 'torch.utils.tensorboard']\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_tensorboard_event_file_holds_every_step(tmp_path: Path) -> None:
    watch, net = job(sinks=["tensorboard"], tensorboard_dir=tmp_path / "tb")
    run(watch, net)
    got = trackers.tensorboard_rows(tmp_path / "tb")
    trackers.assert_rows_match(got, trackers.reference_rows(), rel=1e-6)


def test_wandb_offline_run_holds_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb
    from gradwatch.sinks import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    watch, net = job()
    sink = WandbSink(
        config=watch.config,
        project="gradwatch-test",
        dir=str(tmp_path),
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )
    run_dir = Path(sink.run.dir).parent
    watch.add_sink(sink)
    run(watch, net)  # closes the sink, which finishes the run it started
    got = trackers.wandb_rows(run_dir)
    trackers.assert_rows_match(got, trackers.reference_rows(), rel=1e-6)
    assert got["gradwatch/step"] == {s: float(s) for s in range(trackers.STEPS)}


def test_mlflow_file_store_holds_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = (tmp_path / "mlruns").as_uri()
    # MLflow 3 keeps the file store behind this switch; it is the store that needs no server.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    watch, net = job(sinks=["mlflow"])
    (sink,) = (s for s in watch._publishing.sinks if type(s).__name__ == "MlflowSink")
    run(watch, net)
    got = trackers.mlflow_rows(uri, sink.run_id)
    trackers.assert_rows_match(got, trackers.reference_rows(), rel=1e-6)
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri=uri).get_run(sink.run_id).info.status == "FINISHED"


def test_mlflow_sink_logs_to_the_active_run_and_leaves_it_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow
    from gradwatch.sinks import MlflowSink

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run() as active:
            sink = MlflowSink()
            assert sink.run_id == active.info.run_id
            sink.write(Snapshot(step=7, global_norm=2.5, timestamp=1.0))
            sink.close()
            assert mlflow.active_run() is not None
        history = trackers.mlflow_rows(uri, active.info.run_id)
        assert history["gradwatch/global_grad_norm"] == {7: 2.5}
    finally:
        mlflow.set_tracking_uri("")


def test_rows_are_the_endpoint_figures_absent_not_zero() -> None:
    scalars = StepScalars(WatchConfig(groups={"a": ["a.*"], "b": ["b.*"]}, ratios=[["a", "b"]]))
    # b has no gradient: the ratio is undefined (NaN, never the 0.0 the snapshot holds).
    row = scalars(
        Snapshot(
            step=1,
            global_norm=3.0,
            groups={"a": GroupStats(norm=3.0, numel=4, tensors=1), "b": GroupStats()},
            ratios={"a/b": 0.0},
        )
    )
    assert row["gradwatch/global_grad_norm"] == 3.0
    assert math.isnan(row["gradwatch/grad_norm_ratio/a/b"])
    # Not measured: no clip coefficient, no spike score, no per-rank view.
    assert not [t for t in row if "clip_coef" in t or "spike_score" in t or "replica_grad" in t]
    assert "gradwatch/step" not in row and not [t for t in row if "param_grad_norm" in t]
    row = scalars(
        Snapshot(
            step=2,
            global_norm=math.inf,
            groups={"a": GroupStats(norm=math.inf, numel=4, tensors=1, nonfinite=1)},
            nonfinite_params=("a.w",),
            clip_coef=0.5,
            amp_skipped=True,
        )
    )
    assert row["gradwatch/clip_coef"] == 0.5
    assert row["gradwatch/amp_skipped_steps_total"] == 1.0
    assert row["gradwatch/nonfinite_steps_total"] == 0.0  # AMP-skipped: counted apart
    assert row["gradwatch/collections_total"] == 2.0


def test_a_broken_sink_does_not_stop_the_others(tmp_path: Path) -> None:
    class Broken:
        def write(self, snapshot: Snapshot) -> None:
            raise RuntimeError("tracker down")

    watch, net = job(sinks=["tensorboard"], tensorboard_dir=tmp_path / "tb")
    watch.add_sink(Broken())
    run(watch, net, healthy=False)
    got = trackers.tensorboard_rows(tmp_path / "tb")
    assert sorted(got["gradwatch/global_grad_norm"]) == list(range(trackers.STEPS))


def test_mlflow_keys_are_made_safe() -> None:
    assert mlflow_key("gradwatch/grad_norm/attn:q*") == "gradwatch/grad_norm/attn_q_"
    assert mlflow_key("gradwatch/grad_norm/a b.c-d") == "gradwatch/grad_norm/a b.c-d"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sinks": ["tensorboard"]}, "tensorboard_dir"),
        ({"tensorboard_dir": "runs"}, "tensorboard_dir"),
        ({"sinks": ["wandb", "wandb"]}, "sinks"),
        ({"sinks": ["comet"]}, "sinks"),
    ],
)
def test_bad_sink_settings_are_refused_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ValidationError, match=field):
        WatchConfig(**kwargs)


def test_a_sink_that_cannot_start_fails_construction_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(GradWatchError, match=r"sinks.*'wandb'.*pip install"):
        job(sinks=["wandb"])


@pytest.mark.parametrize(
    ("module", "build", "message"),
    [
        ("wandb", lambda: WandbSink(),
         "gradwatch: WandbSink needs the wandb package: pip install 'torch-gradwatch[wandb]'"),
        ("mlflow", lambda: MlflowSink(),
         "gradwatch: MlflowSink needs mlflow (or mlflow-skinny): "
         "pip install 'torch-gradwatch[mlflow]'"),
        ("torch.utils.tensorboard", lambda: TensorBoardSink("unused"),
         "gradwatch: TensorBoardSink needs the tensorboard package: "
         "pip install 'torch-gradwatch[tensorboard]'"),
    ],
)
def test_a_missing_tracker_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, build: Callable[[], object], message: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError) as raised:
        build()
    assert str(raised.value) == message
