"""The Prometheus file_sd target of rank 0's endpoint (WatchConfig.file_sd_path): content,
atomic write, Slurm labels, removal at close, and the errors that name the setting. The live
check against a real Prometheus is tests/e2e/test_discovery_e2e.py."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gradwatch import GradWatch, WatchConfig
from gradwatch.errors import GradWatchError
from gradwatch.export.filesd import (
    FileSDTarget,
    job_labels,
    target_address,
    target_file_name,
)


def watch(tmp: Path, **cfg: object) -> GradWatch:
    return GradWatch(
        torch.nn.Linear(2, 2),
        WatchConfig(port=0, bind_address="127.0.0.1", run_id="run-1", **cfg),
    )


def test_target_written_at_start_and_removed_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_NAME", "pretrain")
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    target = tmp_path / "targets" / "job.json"
    w = watch(tmp_path, file_sd_path=target, file_sd_labels={"team": "llm"})
    try:
        entry = json.loads(target.read_text())
        port = w._publishing.port
        assert entry == [
            {
                "targets": [f"127.0.0.1:{port}"],
                "labels": {
                    "run_id": "run-1",
                    "slurm_job_id": "4242",
                    "slurm_job_name": "pretrain",
                    "team": "llm",
                },
            }
        ]
        assert oct(target.stat().st_mode & 0o777) == oct(0o644)
        assert [p.name for p in target.parent.iterdir()] == ["job.json"]  # no temporary left
    finally:
        w.close()
    assert not target.exists()


def test_a_directory_gets_a_file_named_after_the_slurm_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    w = watch(tmp_path, file_sd_path=tmp_path)
    try:
        assert [p.name for p in tmp_path.iterdir()] == ["gradwatch-77-3.json"]
    finally:
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_without_slurm_the_file_is_named_after_the_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NAME", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    t = FileSDTarget(tmp_path, "h:1", job_labels("r-9", environ={}))
    assert t.path == tmp_path / "gradwatch-h-1.json"  # the endpoint's identity, not the run's
    t.remove()  # wrote nothing: a no-op
    t.write()
    t.write()  # idempotent: replaced whole
    assert json.loads(t.path.read_text())[0]["labels"] == {"run_id": "r-9"}
    t.remove()
    t.remove()
    assert not t.path.exists()


def test_a_write_is_atomic_for_a_reader(tmp_path: Path) -> None:
    """A reader of the path sees the old entry or the new one, never a partial file: the new
    content arrives by rename (a new inode), never by writing into the file in place."""
    t = FileSDTarget(tmp_path / "t.json", "h:1", {"run_id": "a"})
    t.write()
    before = os.stat(t.path).st_ino
    t.entry[0]["labels"]["run_id"] = "b" * 100_000
    t.write()
    assert os.stat(t.path).st_ino != before
    assert json.loads(t.path.read_text())[0]["labels"]["run_id"] == "b" * 100_000


def test_address_is_the_bound_one_or_this_machine() -> None:
    assert target_address("127.0.0.1", 9977) == "127.0.0.1:9977"
    assert target_address("::1", 9977) == "[::1]:9977"
    assert target_address("0.0.0.0", 9977) == f"{socket.gethostname()}:9977"
    assert target_address("localhost", 1) == "localhost:1"


def test_extra_labels_win_over_slurm() -> None:
    env = {"SLURM_JOB_ID": "1"}
    assert job_labels("r", {"slurm_job_id": "x"}, env) == {"run_id": "r", "slurm_job_id": "x"}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"file_sd_path": "t.json"}, "file_sd_path needs port"),
        ({"port": 0, "file_sd_path": "t.json", "file_sd_labels": {"1x": "a"}}, "file_sd_labels"),
        ({"port": 0, "file_sd_path": "t.json", "file_sd_labels": {"__x": "a"}}, "file_sd_labels"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        WatchConfig(**kwargs)


def test_an_unwritable_path_fails_construction_naming_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(GradWatchError, match="file_sd_path"):
        watch(tmp_path, file_sd_path=blocker / "sub" / "t.json")


# -- one file per endpoint, named after the job; kept, never another job's, gone on SIGTERM ----


def test_names_follow_the_job_not_the_run() -> None:
    step0 = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    step1 = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}
    assert target_file_name("n1:9977", step0) == "gradwatch-4242-step0.json"
    assert target_file_name("n1:9977", step1) == "gradwatch-4242-step1.json"  # 2 steps, 2 files
    array = {"SLURM_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3", "SLURM_STEP_ID": "0"}
    assert target_file_name("n1:9977", array) == "gradwatch-77-3-step0.json"
    assert target_file_name("n1:9977", {"SLURM_JOB_ID": "4242"}) == "gradwatch-4242.json"
    # outside Slurm: the endpoint (torchrun restarts on the same node and port replace it)
    assert target_file_name("node17.cluster:9977", {}) == "gradwatch-node17.cluster-9977.json"
    assert target_file_name("[::1]:9977", {}) == "gradwatch-__1-9977.json"


def test_a_restarted_job_replaces_its_target(tmp_path: Path) -> None:
    """A run killed without cleanup (SIGKILL) leaves its file; the next run of the same job on
    the same endpoint writes the same file with its own run id: one target, never two."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    first = FileSDTarget(tmp_path, "n1:9977", job_labels("run-a", environ=env), env)
    first.write()  # then killed: never removed
    second = FileSDTarget(tmp_path, "n1:9977", job_labels("run-b", environ=env), env)
    second.write()
    assert [p.name for p in tmp_path.iterdir()] == ["gradwatch-4242-step0.json"]
    assert json.loads(second.path.read_text())[0]["labels"]["run_id"] == "run-b"
    second.remove()
    assert list(tmp_path.iterdir()) == []


def test_two_jobs_never_delete_each_others_target(tmp_path: Path) -> None:
    """Two live jobs under one name (a misconfiguration): the first to close leaves the other's
    target in place; the other removes it at its own close."""
    path = tmp_path / "shared.json"
    a = FileSDTarget(path, "n1:9977", {"run_id": "a"})
    b = FileSDTarget(path, "n2:9977", {"run_id": "b"})
    a.write()
    b.write()
    a.remove()
    assert json.loads(path.read_text())[0]["targets"] == ["n2:9977"]
    b.remove()
    assert not path.exists()


def test_the_target_comes_back_with_its_directory(tmp_path: Path) -> None:
    import shutil
    import time

    directory = tmp_path / "targets"
    t = FileSDTarget(directory / "job.json", "n1:9977", {"run_id": "a"})
    t.write()
    t.keep(interval=0.05)
    try:
        shutil.rmtree(directory)
        directory.mkdir()
        deadline = time.monotonic() + 10
        while not t.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert t.owns_file()
        # a file another job wrote since is left alone, and not removed at close
        t.path.write_text("[]\n")
        time.sleep(0.2)
        assert t.path.read_text() == "[]\n"
    finally:
        t.remove()
    assert t.path.read_text() == "[]\n"


_SIGTERM_JOB = """
import sys, time, torch
from gradwatch import GradWatch, WatchConfig
w = GradWatch(torch.nn.Linear(2, 2), WatchConfig(port=0, bind_address="127.0.0.1",
                                                  file_sd_path=sys.argv[1]))
print("READY", flush=True)
time.sleep(120)
"""


def test_sigterm_removes_the_target_and_still_terminates(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADWATCH_", "SLURM_"))}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGTERM_JOB, str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read() if proc.stderr else ""
        assert len(list(tmp_path.glob("gradwatch-*.json"))) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM  # ended by the signal, as before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert list(tmp_path.iterdir()) == []
