"""Each sink has its own queue and thread (gradwatch.export.sinkworker): a sink that blocks or
fails never holds up the endpoint or another sink, and every step a sink never got is counted
(``gradwatch_sink_errors_total``, ``gradwatch_sink_dropped_steps_total``), logged and given to
the tracker itself."""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from gradwatch import GradWatch, WatchConfig
from gradwatch.export import Publishing, sinkworker
from gradwatch.export.history import read_history
from gradwatch.export.sinkworker import RETRY_ATTEMPTS, RateLimitedLog, SinkWorker
from gradwatch.export.state import SelfStats
from gradwatch.snapshot import GroupStats, Snapshot

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing sink's backoff in milliseconds, so the tests wait for retries in milliseconds."""
    monkeypatch.setattr(sinkworker, "RETRY_FIRST_SECONDS", 0.001)
    monkeypatch.setattr(sinkworker, "RETRY_MAX_SECONDS", 0.01)


def snap(step: int) -> Snapshot:
    g = GroupStats(norm=float(step), numel=1, tensors=1, vanishing=0, exploding=0, nonfinite=0)
    return Snapshot(step=step, global_norm=float(step), groups={"host": g}, timestamp=1e9 + step)


class Ready:
    """A pending result already materialized."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.step = snapshot.step
        self._snap = snapshot

    def result(self) -> Snapshot:
        return self._snap


class Blocking:
    """A sink whose first write never returns (until the test releases it): a hung server."""

    name = "blocking"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.steps: list[int] = []

    def write(self, snapshot: Snapshot) -> None:
        self.entered.set()
        self.release.wait()
        self.steps.append(snapshot.step)


class Flaky:
    """A sink that raises while ``down`` (a tracker server that died), then writes again."""

    name = "flaky"

    def __init__(self) -> None:
        self.down = False
        self.calls = 0
        self.steps: list[int] = []
        self.noted: list[int] = []

    def note_dropped(self, total: int) -> None:
        self.noted.append(total)

    def write(self, snapshot: Snapshot) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("tracker server down")
        self.steps.append(snapshot.step)


class Slow:
    """A sink taking ``seconds`` per write."""

    name = "slow"

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.steps: list[int] = []
        self.noted = 0

    def note_dropped(self, total: int) -> None:
        self.noted = total

    def write(self, snapshot: Snapshot) -> None:
        time.sleep(self.seconds)
        self.steps.append(snapshot.step)


def scrape(url: str | None) -> Samples:
    assert url is not None
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def endpoint_config(**overrides: Any) -> WatchConfig:
    return WatchConfig(port=0, bind_address="127.0.0.1", **overrides)


def test_a_blocked_and_a_failing_sink_never_hold_up_the_endpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One sink hangs for good, another fails for ten steps then recovers: the endpoint shows
    every step as it is submitted, the failing sink gets every step before and after its
    outage, and every step either sink missed is counted, exactly."""
    caplog.set_level(logging.WARNING, logger="gradwatch.export")
    steps, queue, outage = 40, 8, range(10, 20)
    blocking, flaky = Blocking(), Flaky()
    pub = Publishing(
        endpoint_config(sink_queue_size=queue, sink_timeout_seconds=0.2),
        world_size=1,
        parallelism="single",
        sinks=[blocking, flaky],
    )
    blocked, flaky_worker = pub._publisher.workers
    try:
        for step in range(1, steps + 1):
            flaky.down = step in outage
            pub.submit(Ready(snap(step)))
            deadline = time.monotonic() + 10
            assert pub._publisher.flush_endpoint(deadline)
            assert pub.published_step == step  # the endpoint advanced at once, every step
            assert flaky_worker.flush(deadline, wait_failing=True)  # written, or given up
            if step == 1:
                assert blocking.entered.wait(10)
                time.sleep(0.3)  # past sink_timeout_seconds: the next offer reports the stall
        # flush() syncs the endpoint first, then gives up on the blocked sink within its bound
        assert not pub.flush(timeout=0.5)
        assert pub._http is not None and pub._http.sync(10)  # the sinks' counts served too
        samples = scrape(pub.url)
        queued_steps = blocked.dropped
    finally:
        pub.close(timeout=1.0)
        blocking.release.set()
    assert value(samples, "gradwatch_step") == steps
    assert value(samples, "gradwatch_collections_total") == steps
    assert value(samples, "gradwatch_publish_errors_total") == 0
    assert value(samples, "gradwatch_dropped_snapshots_total") == 0
    # the failing sink: every step outside its outage, each outage step tried then given up
    assert flaky.steps == [s for s in range(1, steps + 1) if s not in outage]
    assert flaky.calls == steps - len(outage) + RETRY_ATTEMPTS * len(outage)
    errors = value(samples, "gradwatch_sink_errors_total", sink="flaky")
    assert errors == RETRY_ATTEMPTS * len(outage)
    assert value(samples, "gradwatch_sink_dropped_steps_total", sink="flaky") == len(outage)
    assert flaky.noted[-1] == len(outage)  # the tracker itself was told
    # the blocked sink: step 1 in hand, the newest `queue` waiting, the rest dropped meanwhile
    assert queued_steps == steps - 1 - queue
    assert value(samples, "gradwatch_sink_dropped_steps_total", sink="blocking") == queued_steps
    assert value(samples, "gradwatch_sink_errors_total", sink="blocking") == 1  # one stall
    # closing counts the rest: every step the blocked sink never wrote is counted
    assert dict(pub.self_stats.view().sink_dropped) == {"blocking": steps, "flaky": len(outage)}
    messages = [r.getMessage() for r in caplog.records]
    assert sum("'blocking' sink has been writing one step" in m for m in messages) == 1
    assert sum("'flaky' sink failed" in m for m in messages) == 1  # then rate-limited
    assert sum("'flaky' sink writes again" in m for m in messages) == 1


def test_a_fast_loop_and_a_slow_sink_lose_no_step_silently() -> None:
    """Steps every ~1 ms through GradWatch, a 20 ms sink with the default queue: every step the
    endpoint published either reached the sink or is counted in its dropped steps."""
    model = torch.nn.Linear(8, 4)
    slow = Slow(0.02)
    steps = 400
    watch = GradWatch(model, endpoint_config())
    watch.add_sink(slow)
    try:
        for step in range(steps):
            model.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            watch.collect(step)
            time.sleep(0.001)
        assert watch._publishing is not None
        publishing = watch._publishing
        assert publishing._publisher.flush_endpoint(time.monotonic() + 30)
    finally:
        watch.close()
    view = publishing.self_stats.view()
    state = publishing._state
    assert state is not None
    published = state.current().counts.collections
    assert published + view.dropped == steps  # the endpoint: every step, or counted
    dropped = dict(view.sink_dropped)["slow"]
    assert len(slow.steps) + dropped == published, (len(slow.steps), dropped, published)
    assert dropped > 0  # the sink could not keep up at 20 ms per step
    assert slow.steps == sorted(slow.steps)


def test_a_tracker_server_that_dies_then_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's store goes away for a few steps (its run directory moved away) and comes back:
    those steps are counted, MLflow itself records `gradwatch/dropped_steps`, and the data
    resumes at the next step."""
    from mlflow.tracking import MlflowClient

    from gradwatch.export.sinks import MlflowSink

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the store that needs no server
    sink = MlflowSink(tracking_uri=uri, experiment_id="0")
    run_dir = next((tmp_path / "mlruns" / "0").glob(sink.run_id))
    pub = Publishing(WatchConfig(), world_size=1, parallelism="single", sinks=[sink])
    (worker,) = pub._publisher.workers
    try:
        for step in range(1, 11):
            if step == 4:
                run_dir.rename(tmp_path / "away")  # the server is gone
            if step == 7:
                (tmp_path / "away").rename(run_dir)  # and back
            pub.submit(Ready(snap(step)))
            assert pub._publisher.flush_endpoint(time.monotonic() + 10)
            assert worker.flush(time.monotonic() + 30, wait_failing=True)
        view = pub.self_stats.view()
    finally:
        pub.close()
    assert dict(view.sink_dropped) == {"mlflow": 3}
    assert dict(view.sink_errors) == {"mlflow": 3 * RETRY_ATTEMPTS}
    client = MlflowClient(tracking_uri=uri)
    norms = client.get_metric_history(sink.run_id, "gradwatch/global_grad_norm")
    assert sorted(m.step for m in norms) == [1, 2, 3, 7, 8, 9, 10]
    history = client.get_metric_history(sink.run_id, "gradwatch/dropped_steps")
    dropped = {m.step: m.value for m in history}
    assert dropped == {1: 0.0, 2: 0.0, 3: 0.0, 7: 3.0, 8: 3.0, 9: 3.0, 10: 3.0}


def test_flush_does_not_wait_for_a_failing_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead tracker retrying with backoff must not make every flush() last its timeout:
    flush returns False at once for it, and still waits for the healthy sinks."""
    monkeypatch.setattr(sinkworker, "RETRY_FIRST_SECONDS", 5.0)
    monkeypatch.setattr(sinkworker, "RETRY_MAX_SECONDS", 5.0)
    flaky, healthy = Flaky(), Slow(0.05)
    flaky.down = True
    pub = Publishing(WatchConfig(), world_size=1, parallelism="single", sinks=[flaky, healthy])
    try:
        pub.submit(Ready(snap(1)))
        started = time.monotonic()
        assert not pub.flush(timeout=10)
        assert time.monotonic() - started < 4.0  # not the 10 s timeout, nor the 5 s backoff
        assert healthy.steps == [1]  # the healthy sink was waited for
        assert flaky.calls == 1  # the failing one is backing off
    finally:
        pub.close(timeout=0.5)


def test_rate_limited_log_says_how_many_it_kept_quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gradwatch.export")
    log = RateLimitedLog(interval=0.2)
    assert log.warning("k", "first %d", 1)
    assert not log.warning("k", "second %d", 2)
    assert not log.warning("k", "third %d", 3)
    assert log.warning("other", "another kind")  # kinds are limited apart
    time.sleep(0.25)
    assert log.warning("k", "fourth %d", 4)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["first 1", "another kind", "fourth 4 (2 more since the last such message)"]


def test_a_full_queue_drops_the_oldest_and_close_counts_the_rest() -> None:
    stats = SelfStats()
    stats.add_sink("blocking")
    sink = Blocking()
    worker = SinkWorker(sink, "blocking", stats, queue_size=3, timeout=60.0)
    try:
        worker.offer(snap(1))
        assert sink.entered.wait(10)
        for step in range(2, 8):  # 6 more: 3 wait, 3 are dropped (the oldest)
            worker.offer(snap(step))
        assert worker.dropped == 3
        assert not worker.flush(time.monotonic() + 0.1)  # bounded: the sink is stuck
        assert worker.stop(time.monotonic() + 0.1) == 4  # 3 waiting + the one in hand
    finally:
        sink.release.set()
    assert dict(stats.view().sink_dropped) == {"blocking": 7}
    assert dict(stats.view().sink_errors) == {"blocking": 0}  # never past its timeout


def test_sink_settings_are_refused_naming_the_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="sink_queue_size"):
        WatchConfig(sink_queue_size=0)
    with pytest.raises(ValidationError, match="sink_timeout_seconds"):
        WatchConfig(sink_timeout_seconds=math.inf)


def test_flush_returns_once_every_late_audit_is_counted_and_served() -> None:
    """Reports given after their step was built are judged by flush() and served before it
    returns: a scrape right after it shows every disagreement."""
    model = torch.nn.Linear(8, 4)
    steps = 10
    with GradWatch(model, endpoint_config()) as watch:
        for step in range(steps):
            model.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            watch.collect(step).result()  # built: the report below arrives late
            watch.audit_norm(12345.0, step=step)  # far from the exact norm: a disagreement
            assert watch.flush(10)
            samples = scrape(watch.metrics_url)
            got = value(samples, "gradwatch_norm_audit_disagreements_total", source="trainer")
            assert got == step + 1


def test_history_directory_deleted_mid_run_is_created_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    path = tmp_path / "run" / "history.jsonl"
    model = torch.nn.Linear(8, 4)
    caplog.set_level(logging.WARNING, logger="gradwatch.export")
    with GradWatch(model, WatchConfig(history_path=path)) as watch:
        for step in range(6):
            if step == 3:
                shutil.rmtree(path.parent)
            model.zero_grad()
            model(torch.randn(2, 8)).sum().backward()
            watch.collect(step)
            assert watch.flush(10)
        assert watch._publishing is not None
        view = watch._publishing.self_stats.view()
    assert [r["step"] for r in read_history(path)] == [3, 4, 5]
    assert dict(view.sink_dropped) == {"history": 0} and dict(view.sink_errors) == {"history": 0}
    removed = [r.getMessage() for r in caplog.records if "removed or replaced" in r.getMessage()]
    assert len(removed) == 1, removed


def test_tensorboard_sink_resumes_after_its_disk_heals(tmp_path: Path) -> None:
    """The run directory becomes unwritable (replaced by a file) for three steps: those are
    counted, and the data resumes in a new event file once the directory can be created."""
    import shutil

    import trackers

    from gradwatch.export.sinks import TensorBoardSink

    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir)
    pub = Publishing(WatchConfig(), world_size=1, parallelism="single", sinks=[sink])
    (worker,) = pub._publisher.workers
    try:
        for step in range(1, 11):
            if step == 4:
                shutil.rmtree(log_dir)
                log_dir.write_text("not a directory")  # every write fails now
            if step == 7:
                log_dir.unlink()  # healed
            pub.submit(Ready(snap(step)))
            assert pub._publisher.flush_endpoint(time.monotonic() + 10)
            assert worker.flush(time.monotonic() + 30, wait_failing=True)
        view = pub.self_stats.view()
    finally:
        pub.close()
    assert dict(view.sink_dropped) == {"tensorboard": 3}
    assert dict(view.sink_errors) == {"tensorboard": 3 * RETRY_ATTEMPTS}
    rows = trackers.tensorboard_rows(log_dir)
    assert sorted(rows["gradwatch/global_grad_norm"]) == [7, 8, 9, 10]
    assert rows["gradwatch/dropped_steps"] == {7: 3.0, 8: 3.0, 9: 3.0, 10: 3.0}


def test_top_shows_the_sinks_that_fail_or_lose_steps() -> None:
    from gradwatch.cli.endpoint import parse_exposition
    from gradwatch.cli.render import anomalies_text

    text = (
        "gradwatch_step 7\n"
        'gradwatch_sink_errors_total{sink="mlflow"} 6\n'
        'gradwatch_sink_errors_total{sink="history"} 0\n'
        'gradwatch_sink_dropped_steps_total{sink="mlflow"} 2\n'
        'gradwatch_sink_dropped_steps_total{sink="history"} 0\n'
    )
    view = parse_exposition(text)
    assert view.sink_errors == {"mlflow": 6, "history": 0}
    assert view.sink_dropped == {"mlflow": 2, "history": 0}
    shown = anomalies_text(view).plain
    assert shown.endswith(", sink mlflow: errors 6, dropped 2"), shown  # history keeps up
    assert "sink" not in anomalies_text(parse_exposition("gradwatch_step 7\n")).plain
