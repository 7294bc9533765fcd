"""Spike forensics: note_batch, the incident file's lines, and on_max_consecutive_skips
("raise" in process, "exit" in a subprocess with its documented exit code)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.errors import GuardStopError
from gradwatch.step.incidents import GUARD_STOP_EXIT_CODE, MAX_BATCH_BYTES


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "ids", [math.nan, object(), {"a": {1, 2}}, "x" * (MAX_BATCH_BYTES + 1)]
)
def test_note_batch_refuses_what_is_no_json(ids: object) -> None:
    with GradWatch(_model(), WatchConfig()) as watch, pytest.raises(ValueError,
                                                                     match="note_batch"):
        watch.note_batch(ids)


def test_clipped_and_skipped_steps_are_written_with_their_batch(tmp_path: Path) -> None:
    path = tmp_path / "incidents" / "run.jsonl"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = WatchConfig(incident_path=path, adaptive_clip_warmup=8)
    readings = {}
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)  # skip_nonfinite, the default
        for step in range(20):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
            if step == 15:
                x[0, 0] = math.nan
            watch.note_batch({"indices": [step * 8, step * 8 + 8], "shard": "a.bin"})
            (model(x).pow(2).mean() * (40.0 if step == 12 else 1.0)).backward()
            watch.clip_grad_norm_("auto", step=step)
            history = watch._collector.history
            assert history is not None and history.last is not None
            readings[step] = history.last.reading()
            guarded.step()
            guarded.zero_grad()
    lines = _lines(path)
    by_step = {line["step"]: line for line in lines}
    assert set(lines[0]) == {"step", "reason", "norm", "threshold", "batch"}
    spike = by_step[12]
    assert spike == {
        "step": 12, "reason": "clipped", "norm": readings[12].norm,
        "threshold": readings[12].threshold, "batch": {"indices": [96, 104], "shard": "a.bin"},
    }
    assert by_step[15]["reason"] == "nonfinite" and by_step[15]["norm"] is None
    assert by_step[15]["batch"] == {"indices": [120, 128], "shard": "a.bin"}
    for line in lines:  # only skipped or clipped steps, each as measured
        if line["reason"] == "clipped":
            assert line["norm"] > line["threshold"] == readings[line["step"]].threshold
    clipped = {s for s, r in readings.items() if r.clipped}
    assert {s for s, line in by_step.items() if line["reason"] == "clipped"} == clipped


def test_raise_at_the_skip_limit_before_the_next_step(tmp_path: Path) -> None:
    path = tmp_path / "incidents.jsonl"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = WatchConfig(
        incident_path=path, max_consecutive_skips=2, on_max_consecutive_skips="raise"
    )
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        for step in range(10):
            x = torch.randn(4, 8)
            if step in (3, 4):
                x[0, 0] = math.nan
            model(x).sum().backward()
            before = [p.detach().clone() for p in model.parameters()]
            if step == 5:
                with pytest.raises(GuardStopError, match="max_consecutive_skips"):
                    guarded.step()
                assert all(torch.equal(a, b)
                           for a, b in zip(before, model.parameters(), strict=True))
                break
            guarded.step()
            guarded.zero_grad()
    last = _lines(path)[-1]
    assert last["reason"] == "max_consecutive_skips" and last["step"] == 4
    assert last["action"] == "raise"


def test_exit_code_at_the_skip_limit(tmp_path: Path) -> None:
    path = tmp_path / "incidents.jsonl"
    script = textwrap.dedent(f"""
        import math, torch
        from torch import nn
        from gradwatch import GradWatch, WatchConfig
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = WatchConfig(incident_path={str(path)!r}, max_consecutive_skips=3,
                          on_max_consecutive_skips="exit")
        with GradWatch(model, cfg) as watch:
            guarded = watch.guard(opt)
            for step in range(20):
                x = torch.randn(2, 4)
                if step >= 5:
                    x[0, 0] = math.nan
                model(x).sum().backward()
                guarded.step()
                guarded.zero_grad()
                print("applied or skipped", step, flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == GUARD_STOP_EXIT_CODE == 75, done.stderr[-2000:]
    assert "applied or skipped 7" in done.stdout and "applied or skipped 8" not in done.stdout
    last = _lines(path)[-1]
    assert last["reason"] == "max_consecutive_skips" and last["step"] == 7
    assert last["exit_code"] == 75


def test_a_write_that_fails_is_counted_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer thread is a failure boundary: a file that cannot be written (here replaced
    by a directory) costs its lines, counted and logged once, never the training step."""
    from gradwatch.step.incidents import IncidentLog

    path = tmp_path / "incidents.jsonl"
    incidents = IncidentLog(path)
    path.unlink()
    path.mkdir()
    for step in range(3):
        incidents.write({"step": step, "reason": "spike"})
    assert incidents.flush(10)
    incidents.close()
    assert incidents.failed == 3
    assert sum("could not be written" in r.message for r in caplog.records) == 1


def test_an_unwritable_incident_path_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="incident_path"):
        GradWatch(_model(), WatchConfig(incident_path=tmp_path))  # a directory
