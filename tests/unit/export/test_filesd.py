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
from gradwatch.export.filesd import FileSDTarget, job_labels, target_address


def watch(tmp: Path, **cfg: object) -> GradWatch:
    return GradWatch(
        torch.nn.Linear(2, 2),
        WatchConfig(port=0, bind_address="127.0.0.1", run_id="run-1", **cfg),
    )


def test_target_written_at_start_and_removed_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
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
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    w = watch(tmp_path, file_sd_path=tmp_path)
    try:
        assert [p.name for p in tmp_path.iterdir()] == ["gradwatch-77-3.json"]
    finally:
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_without_slurm_the_file_is_named_after_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NAME"):
        monkeypatch.delenv(var, raising=False)
    t = FileSDTarget(tmp_path, "h:1", job_labels("r-9", environ={}))
    assert t.path == tmp_path / "gradwatch-r-9.json"
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
