"""``gradwatch doctor`` under torchrun: one collect across 2 gloo ranks equals the
single-process float64 reference with one collective; a world whose second rank never comes is
reported as a failed rendezvous within the doctor's timeout instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from promserver import free_port, start_torchrun, stop_group

pytestmark = [pytest.mark.distributed]
TIMEOUT = 180


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def test_doctor_under_torchrun_two_gloo_ranks(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = start_torchrun(
        [
            "--redirects=3",
            f"--log-dir={logs}",
            "-m",
            "gradwatch.cli.main",
            "doctor",
            "--device=cpu",
            "--json",
            "--quick",
            "--checks=syncs,distributed",
            "--timeout=60",
        ],
        _clean_env(),
        tmp_path / "torchrun.log",
        tmp_path,
    )
    try:
        assert proc.wait(timeout=TIMEOUT) == 0, (tmp_path / "torchrun.log").read_text()
    finally:
        stop_group(proc)
    outputs = {out.parent.name: out for out in logs.rglob("stdout.log")}
    assert sorted(outputs) == ["0", "1"], outputs
    # Rank 0 alone prints the document; rank 1, whose checks passed, prints nothing.
    doc = json.loads(outputs["0"].read_text())
    status = {c["name"]: c for c in doc["checks"]}
    assert status["distributed"]["status"] == "PASS", status["distributed"]
    assert "1 collective(s), 2 ranks" in status["distributed"]["measured"]
    assert status["distributed"]["detail"] == "gloo"
    assert status["syncs"]["status"] == "PASS"
    assert doc["ok"] is True
    assert outputs["1"].read_text() == ""
    for err in logs.rglob("stderr.log"):  # no torch FutureWarning, no profiler banner
        text = err.read_text()
        assert "FutureWarning" not in text and "USDT" not in text, (err, text)


def test_a_missing_rank_is_reported_within_the_timeout() -> None:
    env = _clean_env()
    env.update(
        RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "gradwatch.cli.main", "doctor", "--device=cpu", "--json",
         "--checks=distributed", "--timeout=5"],
        env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    (check,) = doc["checks"]
    assert check["name"] == "distributed" and check["status"] == "FAIL"
    assert check["measured"].startswith("rendezvous failed"), check
    assert "FAILED: distributed" in result.stderr
    assert elapsed < 90, elapsed  # bounded by --timeout (plus start-up), never a hang


#: A rank whose gradwatch configuration differs from the others' (``exploding_threshold`` is
#: in the configuration every rank must agree on), then the real command line.
_MISCONFIGURED_RANK = (
    "import sys\n"
    "import gradwatch.doctor.checks as d\n"
    "config = d._config\n"
    "d._config = lambda **kw: config(**{**kw, 'exploding_threshold': 1e9})\n"
    "from gradwatch.cli.main import main\n"
    "sys.argv[0] = 'gradwatch'\n"
    "main()\n"
)


def test_mismatched_ranks_report_the_handshake_error_within_the_timeout() -> None:
    """Two ranks that disagree on gradwatch's configuration: both report the handshake's
    LayoutMismatchError as a FAIL of ``distributed`` (exit 1), bounded, never a hang."""
    env = _clean_env()
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = ["doctor", "--device=cpu", "--json", "--checks=distributed", "--timeout=30"]
    commands = [
        [sys.executable, "-m", "gradwatch.cli.main", *args],
        [sys.executable, "-c", _MISCONFIGURED_RANK, *args],
    ]
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, cmd in enumerate(commands)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    elapsed = time.monotonic() - started
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 1, out + err
        (check,) = json.loads(out)["checks"]
        assert check["name"] == "distributed" and check["status"] == "FAIL", check
        assert check["measured"].startswith("handshake failed: LayoutMismatchError"), check
        assert "FAILED: distributed" in err
    assert elapsed < 120, elapsed  # bounded by --timeout (plus start-up), never a hang
