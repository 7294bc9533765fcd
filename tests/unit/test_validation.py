"""Bad settings fail at construction, naming the field or key: an empty or unusable history
path, numbers that would overflow later, duplicate keys in config files; and ``gradwatch plot``
names a malformed record's line instead of printing a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.config import MAX_TIMEOUT_SECONDS
from gradwatch.configfile import ConfigError, read_config_file
from gradwatch.errors import GradWatchError


def test_empty_history_path_is_an_error_not_the_current_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GRADWATCH_HISTORY_PATH", "")
    with pytest.raises(ValidationError, match="history_path"):
        WatchConfig()
    monkeypatch.delenv("GRADWATCH_HISTORY_PATH")
    with pytest.raises(ValidationError, match="history_path is empty"):
        WatchConfig(history_path="  ")


def test_history_path_checked_at_construction(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(GradWatchError, match=r"history_path .* is a directory"):
        GradWatch(model, WatchConfig(history_path=tmp_path))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(GradWatchError, match=r"history_path .*'.*file' is not a directory"):
        GradWatch(model, WatchConfig(history_path=blocker / "sub" / "h.jsonl"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(GradWatchError, match="is not writable"):
            GradWatch(model, WatchConfig(history_path=locked / "h.jsonl"))
    # A missing directory is fine (the writer creates it), and so is a new file.
    with GradWatch(model, WatchConfig(history_path=tmp_path / "new" / "h.jsonl")):
        pass


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("collective_timeout_seconds", 1e300),
        ("collective_timeout_seconds", MAX_TIMEOUT_SECONDS * 2),
        ("every_n_steps", 2**70),
        ("divergence_every", 10**400),
        ("history_max_bytes", 2**64),
        ("param_metrics_top_k", 2**63),
    ],
)
def test_numbers_that_would_overflow_later_fail_validation_naming_the_field(
    field: str, value: float
) -> None:
    with pytest.raises(ValidationError) as info:
        WatchConfig(**{field: value})
    assert info.value.errors()[0]["loc"] == (field,)


def test_the_longest_timeout_converts_without_overflow() -> None:
    cfg = WatchConfig(collective_timeout_seconds=MAX_TIMEOUT_SECONDS)
    assert timedelta(seconds=cfg.collective_timeout_seconds).total_seconds() == MAX_TIMEOUT_SECONDS


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("c.yaml", "port: 1\nport: 2\n", "'port' (line 2)"),
        ("c.yml", "groups:\n  head: [x]\n  head: [y]\n", "'head' (line 3)"),
        ("c.toml", "port = 1\nport = 2\n", "'port' (line 2)"),
        ("c.toml", "[groups]\nhead = ['x']\nhead = ['y']\n", "'head' (line 3)"),
        ("c.json", '{"port": 1, "port": 2}', "'port'"),
    ],
)
def test_duplicate_keys_in_config_files_are_an_error_naming_the_key(
    tmp_path: Path, name: str, text: str, key: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="duplicate key") as info:
        read_config_file(path)
    assert key in str(info.value)


def test_plot_names_a_malformed_record_by_line(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "h.jsonl"
    good = {"step": 0, "global_norm": 1.0, "groups": {"a": {"norm": 1.0}}, "health": 1.0}
    lines = [good, {**good, "step": 1, "groups": 5}, {**good, "step": 2, "ratios": [1]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradwatch.cli.main",
            "plot",
            str(path),
            "-o",
            str(tmp_path / "o.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{path} line 2: malformed record ('groups' is int, not a mapping)" in proc.stderr
    assert f"{path} line 3: malformed record ('ratios' is list, not a mapping)" in proc.stderr
    assert "1 snapshots" in proc.stdout


def test_gradwatch_enabled_false_config_is_inert() -> None:
    """``WatchConfig(enabled=False)`` passed directly: no endpoint even with a port."""
    model = nn.Linear(2, 2)
    with GradWatch(model, WatchConfig(enabled=False, port=0)) as watch:
        assert watch.metrics_url is None and watch.parallelism == "disabled"
        model(torch.randn(1, 2)).sum().backward()
        assert watch.collect(0).result().step == 0
