"""End to end: a restarted job whose first scrape already counts a NaN step pages.

The scenario the restart-safe rules exist for: job A has a NaN step and stops (its counter at
1); job B starts on the same host:port and has a NaN step before Prometheus's first scrape of
it. Prometheus sees 1, 1, 1: ``increase()`` is 0, and only the new
``gradwatch_start_time_seconds`` says that B's 1 is a new event.

A real Prometheus (1 s scrape and evaluation intervals) loads gradwatch-rules.yml with its
5-minute windows scaled to 10 s (``[5m]`` and ``offset 5m`` only, a textual substitution: the
expressions are otherwise the shipped ones), so that A's alert resolves within the test. The
job is examples/train_ddp.py in one process. "Before the first scrape" is made exact rather
than likely: Prometheus is paused (SIGSTOP) from before A stops until B has published its NaN
step, then resumed (SIGCONT), so its next scrape is B's first and already shows 1.

Every process runs under a hard timeout and is stopped in teardown; Prometheus is always
resumed before it is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
from deploy_assets import EXAMPLE, ROOT, RULES
from promserver import free_port, http_get, run_prometheus, stop_group, tail, wait_for

pytestmark = pytest.mark.e2e

JOB = "gradwatch-restart-e2e"
ALERT = "GradwatchNonFiniteGradients"
WINDOW = "10s"  # the rules' 5-minute windows, scaled
A_NAN_STEP = 20  # 2 s of healthy steps at 0.1 s per step, so Prometheus sees A's 0 first


def scaled_rules(tmp: Path) -> Path:
    text = RULES.read_text()
    scaled = text.replace("[5m]", f"[{WINDOW}]").replace("offset 5m", f"offset {WINDOW}")
    assert scaled != text
    out = tmp / "gradwatch-rules.yml"
    out.write_text(scaled)
    return out


@contextmanager
def run_job(port: int, log: Path, nan_at: str) -> Iterator[subprocess.Popen[bytes]]:
    """examples/train_ddp.py in one process, serving on ``port``, until stopped."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GRADWATCH_", "INJECT_")) and k not in {"RANK", "WORLD_SIZE"}
    }
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
        GRADWATCH_PORT=str(port),
        GRADWATCH_BIND_ADDRESS="127.0.0.1",
        GRADWATCH_GROUPS='{"host": ["backbone.*"], "seed": ["seed.*"]}',
        INJECT_NAN_AT=nan_at,
        TRAIN_STEPS="0",
        STEP_SLEEP="0.1",
        OMP_NUM_THREADS="1",
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield proc
    except BaseException:
        print(f"--- {log.name} ---\n{tail(log)}")
        raise
    finally:
        stop_group(proc)


def exposition_value(url: str, name: str) -> float | None:
    for line in http_get(url).splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def firing(prom: Any) -> list[dict[str, Any]]:
    return [
        a for a in prom.alerts() if a["labels"]["alertname"] == ALERT and a["state"] == "firing"
    ]


@pytest.mark.timeout(180)
def test_nan_before_the_restarted_jobs_first_scrape_pages(tmp_path: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    url = f"http://{target}/metrics"
    with run_prometheus([target], (scaled_rules(tmp_path),), job=JOB, workdir=tmp_path) as prom:
        assert prom.pid is not None
        paused = False
        try:
            # Run A: Prometheus sees its counter at 0, then 1 (the alert fires and resolves).
            with run_job(port, tmp_path / "a.log", nan_at=str(A_NAN_STEP)) as a:

                def a_counter() -> float | None:
                    assert a.poll() is None, f"job A exited with {a.returncode}"
                    try:
                        return exposition_value(url, "gradwatch_nonfinite_steps_total")
                    except OSError:
                        return None  # not serving yet

                wait_for(lambda: a_counter() == 0, 60, "job A serving, before its NaN step")
                wait_for(lambda: a_counter() == 1, 30, "job A's NaN step")
                a_start = exposition_value(url, "gradwatch_start_time_seconds")
                prom.wait_until(lambda: firing(prom), 15, "the alert for job A's NaN step")
                prom.wait_until(lambda: not firing(prom), 30, "job A's alert resolved")
                # A's counter stays at 1 and its alert stays resolved: 1, 1, 1 from now on.
                time.sleep(2)
                assert not firing(prom)
                assert prom.value(f'gradwatch_nonfinite_steps_total{{job="{JOB}"}}') == 1
                os.kill(prom.pid, signal.SIGSTOP)  # no scrape until B has counted its NaN
                paused = True

            # Run B, same port: a NaN at its first step, counted before any scrape of B.
            with run_job(port, tmp_path / "b.log", nan_at="0") as b:

                def b_counted() -> bool:
                    assert b.poll() is None, f"job B exited with {b.returncode}"
                    try:
                        start = exposition_value(url, "gradwatch_start_time_seconds")
                        count = exposition_value(url, "gradwatch_nonfinite_steps_total")
                    except OSError:
                        return False
                    return start is not None and start != a_start and count == 1

                wait_for(b_counted, 60, "job B serving with its NaN step counted")
                os.kill(prom.pid, signal.SIGCONT)
                paused = False
                resumed = time.monotonic()

                (alert,) = prom.wait_until(
                    lambda: firing(prom), 10, "the alert for job B's NaN step"
                )
                latency = time.monotonic() - resumed
                assert alert["labels"]["severity"] == "critical"
                assert alert["labels"]["instance"] == target and alert["labels"]["job"] == JOB
                # What Prometheus saw: 1, 1, 1 (no rise for increase()), and a new start time.
                # (no result, or 0: the alert's increase() clause alone would not page)
                rise = prom.value(
                    f'increase(gradwatch_nonfinite_steps_total{{job="{JOB}"}}[{WINDOW}])'
                )
                assert not rise, rise
                new_start = prom.value(f'gradwatch_start_time_seconds{{job="{JOB}"}}')
                assert new_start is not None and new_start != a_start
                print(f"alert for the restarted job's NaN firing {latency:.1f} s after resume")
        finally:
            if paused:
                with suppress(ProcessLookupError):
                    os.kill(prom.pid, signal.SIGCONT)
