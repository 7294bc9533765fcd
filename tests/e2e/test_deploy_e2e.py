"""End to end: a real Prometheus loads gradwatch-rules.yml and scrapes a real gradwatch job.

The job is examples/train_ddp.py under torchrun (2 ranks, gloo DDP on CPU), configured only
through GRADWATCH_* variables, that injects NaN gradients at one step and exploding gradients
from a later step on. Prometheus runs on loopback from a temporary directory with 1 s scrape and
evaluation intervals. Checked:

* no alert is pending or firing while training is healthy;
* GradwatchNonFiniteGradients is firing within 10 s of the NaN step reaching the exporter;
* GradwatchExplodingGradients goes pending once the gradients explode;
* every rule evaluates without error; every PromQL expression of the Grafana dashboard
  (variables substituted) is accepted and returns data for the job; every gradwatch_* name used
  by the rules and the dashboard is in the live exposition.

Both processes run under hard timeouts and are always stopped in teardown.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from deploy_assets import (
    ROOT,
    RULES,
    dashboard_exprs,
    dashboard_variable_queries,
    data_query,
    gradwatch_names,
    label_values_selector,
    rule_groups,
    substitute_grafana_vars,
)
from promserver import (
    free_port,
    http_get,
    run_prometheus,
    start_torchrun,
    stop_group,
    tail,
    wait_for,
)

pytestmark = pytest.mark.e2e

JOB = "gradwatch-e2e"
NAN_STEP = 120  # 12 s of healthy training at 0.1 s per step
EXPLODE_FROM = 160  # 4 s later, until the end
STEP_SLEEP = 0.1
TOTAL_STEPS = 900  # far more than needed: the test stops the job when done
FIRING_DEADLINE = 10.0
# The slowest rank is named only when one rank stands alone in the slowest timing bin: in this
# balanced job none does, so the series is absent (its panel's score and work times are checked;
# tests/distributed/test_stragglers_distributed.py names a slow rank).
ABSENT_IN_A_BALANCED_JOB = {"gradwatch_slowest_rank"}

# -- processes ----------------------------------------------------------------------------------


@contextmanager
def run_training_job(port: int, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADWATCH_", "INJECT_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")])),
        GRADWATCH_PORT=str(port),
        GRADWATCH_BIND_ADDRESS="127.0.0.1",
        GRADWATCH_GROUPS='{"host": ["backbone.*"], "seed": ["seed.*"], "stem": ["stem.*"]}',
        GRADWATCH_RATIOS='[["seed", "host"]]',
        GRADWATCH_ISOLATED='["stem"]',
        GRADWATCH_DIVERGENCE_EVERY="10",
        GRADWATCH_PARAM_METRICS_TOP_K="5",  # the dashboard's top-k panel
        GRADWATCH_RANK_VIEW="1",  # the per-rank view is opt-in: its panels need it
        GRADWATCH_GUARD="1",  # the optimizer-step guard too (its alerts and panel)
        GRADWATCH_UPDATE_STATS="1",  # optimizer-update health (opt-in): its panels need it
        GRADWATCH_RANK_TIMING="1",  # slow-rank attribution (opt-in): its panel needs it
        # No kernels compiling beside the first steps: a rank compiling is a slower rank for
        # those seconds, and this test's alert windows are seconds (docs/design.md).
        GRADWATCH_COMPILE_KERNELS="off",
        GRADWATCH_HISTORY_PATH=str(workdir / "history.jsonl"),  # a sink: the sink panels
        CLIP_NORM="1000",  # clipped through gradwatch (gradwatch_clip_coef), never reached healthy
        INJECT_NAN_AT=str(NAN_STEP),
        INJECT_EXPLODE_AT=f"{EXPLODE_FROM}-",
        TRAIN_STEPS=str(TOTAL_STEPS),
        STEP_SLEEP=str(STEP_SLEEP),
        OMP_NUM_THREADS="1",
    )
    log = workdir / "train.log"
    proc = start_torchrun([str(ROOT / "examples" / "train_ddp.py")], env, log, ROOT)
    try:
        yield proc
    except BaseException:
        print(f"--- training job log ---\n{tail(log)}")
        raise
    finally:
        stop_group(proc)


# -- the exposition -----------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape(url: str) -> dict[str, list[tuple[str, float]]]:
    """Metric name -> [(labels, value)] of a text exposition."""
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in http_get(url).splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            samples.setdefault(m.group(1), []).append((m.group(2) or "", float(m.group(3))))
    return samples


def value(samples: dict[str, list[tuple[str, float]]], name: str) -> float:
    (only,) = samples[name]
    return only[1]


def by_name(alerts: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [a for a in alerts if a["labels"]["alertname"] == name]


# -- the test -----------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_rules_and_dashboard_against_a_live_job(tmp_path: Path) -> None:
    started = time.monotonic()
    port = free_port()
    target = f"127.0.0.1:{port}"
    metrics_url = f"http://{target}/metrics"
    with (
        run_prometheus([target], (RULES,), job=JOB, workdir=tmp_path) as prom,
        run_training_job(port, tmp_path) as job,
    ):

        def exporter() -> dict[str, list[tuple[str, float]]]:
            assert job.poll() is None, f"training job exited with {job.returncode}"
            return scrape(metrics_url)

        # The job is up and Prometheus has its series.
        wait_for(lambda: "gradwatch_step" in exporter(), 60, "the first collect")
        prom.wait_until(
            lambda: prom.query(f'gradwatch_step{{job="{JOB}"}}'), 15, "gradwatch_step scraped"
        )

        # Healthy: no alert at all (not even pending), over evaluations that saw only
        # healthy steps (the exporter's step, read after the alerts, is before the NaN step).
        # One exception: this toy's plain SGD at lr 0.02 moves about 1.4% of its weights per
        # step, above the update-ratio band the shipped rule takes from large-model training
        # (0.01): that alert is rightly pending (its `for` is 15 minutes, never reached here).
        healthy_checks: list[float] = []
        while True:
            alerts = [
                a for a in prom.alerts()
                if a["labels"]["alertname"] != "GradwatchUpdateRatioOutOfBand"
            ]
            step = value(exporter(), "gradwatch_step")
            if step >= NAN_STEP:
                break
            assert alerts == [], f"alerts while healthy (step {step}): {alerts}"
            healthy_checks.append(time.monotonic())
            time.sleep(0.5)
        assert len(healthy_checks) >= 4 and healthy_checks[-1] - healthy_checks[0] >= 3, (
            "too few healthy observations: the job ran faster than expected"
        )

        # NaN at NAN_STEP: the alert fires within FIRING_DEADLINE of the step's publication.
        wait_for(
            lambda: value(exporter(), "gradwatch_nonfinite_steps_total") >= 1,
            30,
            "the NaN step in the exposition",
            every=0.1,
        )
        published = time.monotonic()
        firing = prom.wait_until(
            lambda: [
                a
                for a in by_name(prom.alerts(), "GradwatchNonFiniteGradients")
                if a["state"] == "firing"
            ],
            FIRING_DEADLINE + 5,
            "GradwatchNonFiniteGradients firing",
        )
        latency = time.monotonic() - published
        assert latency <= FIRING_DEADLINE, f"non-finite alert fired after {latency:.1f} s"
        (alert,) = firing
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["job"] == JOB and alert["labels"]["instance"] == target
        assert alert["annotations"]["runbook_url"].endswith("#gradwatchnonfinitegradients")
        others = [
            a["labels"]["alertname"]
            for a in prom.alerts()
            if a["state"] == "firing" and a["labels"]["alertname"] != "GradwatchNonFiniteGradients"
        ]
        assert others == [], f"other alerts firing after one NaN step: {others}"

        # Exploding gradients from EXPLODE_FROM on: the exploding alert goes pending (for: 5m).
        wait_for(
            lambda: value(exporter(), "gradwatch_step") >= EXPLODE_FROM,
            30,
            "the exploding steps",
        )

        def exploding_pending() -> list[dict[str, Any]]:
            return [
                a
                for a in by_name(prom.alerts(), "GradwatchExplodingGradients")
                if a["state"] == "pending"
            ]

        pending = prom.wait_until(exploding_pending, 10, "GradwatchExplodingGradients pending")
        assert {a["labels"]["severity"] for a in pending} == {"warning"}
        assert {a["labels"]["group"] for a in pending} >= {"host", "seed"}
        time.sleep(2)
        assert exploding_pending(), "the exploding alert did not stay pending while exploding"

        # Every rule evaluates without error (templates, vector matching at run time).
        for group in prom.api("rules")["groups"]:
            for rule in group["rules"]:
                assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))

        # Every dashboard expression is accepted and returns data for this job.
        for where, expr in dashboard_exprs():
            promql = substitute_grafana_vars(data_query(expr), job=JOB, instance=target)
            if gradwatch_names(promql) <= ABSENT_IN_A_BALANCED_JOB:
                continue
            # Bounded wait: a figure measured on most steps (the slowest rank is named only
            # when alone in its timing bin) may be absent from one scrape.
            prom.wait_until(
                lambda q=promql: prom.query(q), 20, f"dashboard {where}: data for {promql}"
            )
        for name, query in dashboard_variable_queries():
            selector, label = label_values_selector(substitute_grafana_vars(query, job=JOB))
            found = {s["metric"].get(label) for s in prom.query(selector)}
            assert {"job": JOB, "instance": target}[name] in found, (name, found)

        # Every gradwatch_* metric name used by the rules and the dashboard is exported.
        exported = set(exporter())
        used: set[str] = set()
        for group in rule_groups():
            for rule in group["rules"]:
                used |= gradwatch_names(
                    "\n".join([rule["expr"], *rule.get("annotations", {}).values()])
                )
        for _, expr in dashboard_exprs():
            used |= gradwatch_names(expr)
        for _, query in dashboard_variable_queries():
            used |= gradwatch_names(query)
        missing = {n for n in used if ":" not in n} - exported - ABSENT_IN_A_BALANCED_JOB
        assert not missing, f"not in the live exposition: {sorted(missing)}"

    assert time.monotonic() - started < 120
