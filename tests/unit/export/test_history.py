"""The JSON-lines history: writer/reader round trip, rotation, torn lines, and the wiring of
``WatchConfig.history_path`` into GradWatch (rank 0, publisher thread, with and without port)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, GroupStats, Snapshot, WatchConfig
from gradwatch.export import sinkworker
from gradwatch.export.history import HistoryWriter, read_history, rotated_path
from gradwatch.export.sinkworker import RETRY_ATTEMPTS


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("GRADWATCH_"):
            monkeypatch.delenv(key)


def snap(step: int, norm: float = 1.0, **changes: object) -> Snapshot:
    """A made-up snapshot with two groups, a ratio and per-parameter norms."""
    base = Snapshot(
        step=step,
        global_norm=norm,
        groups={"host": GroupStats(norm=norm, numel=10, tensors=2), "seed": GroupStats(0.5, 4, 1)},
        param_norms={"host.w": norm, "seed.w": 0.5},
        ratios={"seed/host": 0.1},
        health=1.0,
        timestamp=1000.0 + step,
    )
    return base.replace(**changes) if changes else base


# -- writer / reader ----------------------------------------------------------------------------


def test_round_trip_keeps_fields_and_drops_param_norms(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "h.jsonl"  # the directory is created
    with HistoryWriter(path) as writer:
        for i in range(3):
            assert writer.append(snap(i, norm=1.0 + i))
        writer.append(snap(3, norm=math.nan, nonfinite_params=("host.w",), health=0.0))
        writer.append(snap(4, norm=math.inf))
    records = read_history(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["global_norm"] for r in records[:3]] == [1.0, 2.0, 3.0]
    assert math.isnan(records[3]["global_norm"]) and records[3]["nonfinite_params"] == ["host.w"]
    assert records[4]["global_norm"] == math.inf
    assert "param_norms" not in records[0]
    back = Snapshot.from_dict(records[1])
    assert back.groups["host"] == GroupStats(norm=2.0, numel=10, tensors=2)
    assert back.ratios == {"seed/host": 0.1}
    assert path.read_bytes().endswith(b"\n")
    assert len(path.read_bytes().splitlines()) == 5


def test_rotation_past_max_bytes_keeps_one_backup(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    line_len = len(json.dumps(snap(0).to_dict()))  # upper bound of one line (param_norms kept)
    max_bytes = 4096
    n = 3 * max_bytes // line_len + 5  # enough for two rotations
    with HistoryWriter(path, max_bytes=max_bytes) as writer:
        for i in range(n):
            assert writer.append(snap(i))
    backup = rotated_path(path)
    assert backup.exists()
    assert 0 < path.stat().st_size <= max_bytes
    assert 0 < backup.stat().st_size <= max_bytes
    steps = [r["step"] for r in read_history(path)]
    # Oldest records are gone (rotated twice), the rest are contiguous and end with the last.
    assert steps == list(range(steps[0], n)) and steps[0] > 0
    assert [r["step"] for r in read_history(path, include_rotated=False)][-1] == n - 1
    # The backup is read first.
    assert (
        read_history(backup, include_rotated=False)[-1]["step"] + 1
        == (read_history(path, include_rotated=False)[0]["step"])
    )


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as writer:
        writer.append(snap(0))
        writer.append(snap(1))
    whole = _line_bytes(snap(2))
    with open(path, "ab") as fh:
        fh.write(whole[: len(whole) // 2])  # a crash mid-write
    assert [r["step"] for r in read_history(path)] == [0, 1]


def test_torn_line_in_the_middle_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    good = [_line_bytes(snap(i)) for i in range(4)]
    torn = good[2][:-30] + b"\n"
    path.write_bytes(good[0] + good[1] + torn + good[3] + b"\n" + b"[1, 2]\n" + b"17\n")
    assert [r["step"] for r in read_history(path)] == [0, 1, 3]


def test_reopen_after_crash_isolates_the_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as writer:
        writer.append(snap(0))
    whole = _line_bytes(snap(1))
    with open(path, "ab") as fh:
        fh.write(whole[:-25])  # crash: the file does not end in a newline
    with HistoryWriter(path) as writer:  # the restarted job
        writer.append(snap(2))
        writer.append(snap(3))
    lines = path.read_bytes().split(b"\n")
    assert lines[1] == whole[:-25]  # the torn line stays on its own line
    assert [r["step"] for r in read_history(path)] == [0, 2, 3]


def test_lazy_writer_touches_nothing_until_the_first_write(tmp_path: Path) -> None:
    path = tmp_path / "later" / "h.jsonl"
    writer = HistoryWriter(path, lazy=True)
    assert not path.parent.exists()
    writer.write(snap(0))
    writer.close()
    writer.write(snap(1))  # ignored after close
    assert [r["step"] for r in read_history(path)] == [0]


def test_io_errors_raise_from_write_and_not_from_append(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    writer = HistoryWriter(blocker / "h.jsonl", lazy=True)
    with pytest.raises(OSError):
        writer.write(snap(0))
    assert writer.append(snap(1)) is False
    assert isinstance(writer.last_error, OSError)


def test_concurrent_appends_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with HistoryWriter(path) as writer:
        threads = [
            threading.Thread(
                target=lambda k=k: [writer.append(snap(100 * k + i)) for i in range(50)]
            )
            for k in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(r["step"] for r in read_history(path)) == sorted(
        100 * k + i for k in range(4) for i in range(50)
    )


def _canon(data: dict) -> str:
    return json.dumps(data, sort_keys=True)


def _line_bytes(s: Snapshot) -> bytes:
    data = s.to_dict()
    data.pop("param_norms")
    return (json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n").encode()


# -- GradWatch wiring ---------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.seed = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seed(torch.tanh(self.backbone(x)))


def _train(watch: GradWatch, model: nn.Module, steps: int, nan_at: int | None = None) -> list:
    torch.manual_seed(0)
    snaps = []
    for step in range(steps):
        model.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        if step == nan_at:
            model.seed.weight.grad[0, 0] = math.nan
        snaps.append(watch.collect(step).result())
    return snaps


def _config(path: Path, **kwargs: object) -> WatchConfig:
    return WatchConfig(
        groups={"host": ["backbone.*"], "seed": ["seed.*"]},
        ratios=[("seed", "host")],
        history_path=path,
        **kwargs,
    )


def test_gradwatch_writes_one_line_per_collected_step_without_port(tmp_path: Path) -> None:
    path = tmp_path / "run" / "history.jsonl"
    model = Net()
    with GradWatch(model, _config(path)) as watch:
        assert watch.metrics_url is None
        snaps = _train(watch, model, steps=4, nan_at=2)  # 4 <= MAX_PENDING: nothing dropped
    records = read_history(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for rec, s in zip(records, snaps, strict=True):
        if math.isnan(s.global_norm):
            assert math.isnan(rec["global_norm"])
        else:
            assert rec["global_norm"] == s.global_norm
        # Everything but the per-parameter norms, NaN included (compared as JSON text).
        expected = s.replace(param_norms={}).to_dict()
        assert _canon(Snapshot.from_dict(rec).to_dict()) == _canon(expected)
    assert records[2]["nonfinite_params"] == ["seed.weight"]


def test_history_written_by_its_own_sink_thread_with_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "h.jsonl"
    model = Net()
    writers: set[str] = set()
    original = HistoryWriter.write

    def spy(self: HistoryWriter, s: Snapshot) -> None:
        writers.add(threading.current_thread().name)
        original(self, s)

    monkeypatch.setattr(HistoryWriter, "write", spy)
    watch = GradWatch(model, _config(path, every_n_steps=2))
    try:
        for step in range(20):
            model.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            watch.collect(step)
            assert watch.flush(10.0)
    finally:
        watch.close()
    assert writers == {"gradwatch-sink-history"}  # its own worker: never training's thread
    assert [r["step"] for r in read_history(path)] == list(range(0, 20, 2))
    assert watch.flush() is False  # closed


def test_history_with_endpoint_and_errors_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sinkworker, "RETRY_FIRST_SECONDS", 0.001)
    monkeypatch.setattr(sinkworker, "RETRY_MAX_SECONDS", 0.01)
    blocker = tmp_path / "file"
    model = Net()
    cfg = _config(blocker / "h.jsonl", port=0, bind_address="127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="gradwatch"), GradWatch(model, cfg) as watch:
        blocker.write_text("x")  # after the construction-time check: cannot be created now
        _train(watch, model, steps=3)  # training is unaffected
        watch.flush(10.0)  # the endpoint's part; a failing history is not waited for
        assert watch._publishing.published_step == 2  # the endpoint still publishes
        (history,) = watch._publishing._publisher.workers
        assert history.flush(time.monotonic() + 30, wait_failing=True)  # every step given up
        assert watch._publishing._http.sync(10)
        body = _scrape(watch.metrics_url)
    # each step: RETRY_ATTEMPTS failed writes, then given up (counted as dropped)
    assert f'gradwatch_sink_errors_total{{sink="history"}} {3.0 * RETRY_ATTEMPTS}' in body
    assert 'gradwatch_sink_dropped_steps_total{sink="history"} 3.0' in body
    assert "gradwatch_publish_errors_total 0.0" in body  # the endpoint itself is fine
    failed = [r for r in caplog.records if "'history' sink failed" in r.getMessage()]
    assert len(failed) == 1  # logged once (then rate-limited), counted every time


def test_history_path_and_port_on_the_same_publisher(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    model = Net()
    with GradWatch(model, _config(path, port=0, bind_address="127.0.0.1")) as watch:
        snaps = _train(watch, model, steps=3)
        assert watch.flush(10.0)
        assert "gradwatch_publish_errors_total 0.0" in _scrape(watch.metrics_url)
    assert [r["global_norm"] for r in read_history(path)] == [s.global_norm for s in snaps]


def test_no_history_no_port_starts_no_thread(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    with GradWatch(Net(), WatchConfig()) as watch:
        assert watch._publishing is None
        assert "gradwatch-publisher" not in {t.name for t in threading.enumerate()} - before
        assert watch.flush() is True


def test_history_path_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "env.jsonl"
    monkeypatch.setenv("GRADWATCH_HISTORY_PATH", str(path))
    model = Net()
    with GradWatch(model) as watch:
        _train(watch, model, steps=2)
    assert [r["step"] for r in read_history(path)] == [0, 1]


def _scrape(url: str | None) -> str:
    import urllib.request

    assert url is not None
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


# -- rotation races and a file system that blocks --------------------------------------------------


def test_reader_racing_a_rotation_never_raises(tmp_path: Path) -> None:
    """A reader looping while the writer rotates a small file: no FileNotFoundError, and every
    read is in step order with no duplicate (the backup first, the live file after)."""
    path = tmp_path / "h.jsonl"
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        with HistoryWriter(path, max_bytes=4096) as w:
            while not stop.is_set():
                w.write(snap(written[0]))
                written[0] += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        reads = 0
        while written[0] < 3000 and reads < 100_000:  # many rotations (about 16 lines a file)
            steps = [r["step"] for r in read_history(path)]
            assert steps == sorted(set(steps)), steps
            reads += 1
    finally:
        stop.set()
        thread.join(10)
    assert written[0] >= 3000 and reads > 100


@pytest.mark.parametrize("port", [None, 0], ids=["history-only", "with-endpoint"])
def test_close_is_bounded_when_the_history_file_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, port: int | None
) -> None:
    """History on a FIFO nobody reads: open() blocks the publisher thread for good (a hung
    network file system in life). close() still returns within its bound, and says what it
    could not flush; every collected step is accounted for exactly once."""
    fifo = tmp_path / "history.fifo"
    os.mkfifo(fifo)
    model = Net()
    watch = GradWatch(model, _config(fifo, port=port, bind_address="127.0.0.1"))
    try:
        _train(watch, model, steps=6)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="gradwatch"):
            watch.close()
        elapsed = time.monotonic() - started
        publishing = watch._publishing
        view = publishing.self_stats.view()
        state = publishing._state
        published = state.current().counts.collections if state is not None else 0
    finally:
        # Let the abandoned publisher thread go: a reader appears and leaves at once.
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert elapsed < 6.0, f"close() took {elapsed:.1f}s"
    # The blocked history never held up the endpoint: every step materialized in time (not
    # dropped by a publisher that fell behind) is on it.
    assert view.publish_errors == 0
    handled = 6 - view.dropped
    assert published == (handled if port is not None else 0)
    # The first step is stuck in the history's open(), the next ones wait in its queue: at
    # close every one is counted as lost by that sink, and logged.
    assert dict(view.sink_dropped) == {"history": handled}, view
    lost = [r.getMessage() for r in caplog.records if "'history' sink lost" in r.getMessage()]
    assert len(lost) == 1 and "gradwatch_sink_dropped_steps_total" in lost[0], lost
