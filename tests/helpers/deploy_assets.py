"""The deploy assets as data, shared by the static checks (tests/unit/test_deploy.py) and the
live ones (tests/e2e/test_deploy_e2e.py): paths, the metric and alert contracts, parsers of the
rules, the dashboard, the Compose stack and the Kubernetes manifests, and promtool."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "gradwatch-rules.yml"
RULES_TEST = DEPLOY / "prometheus" / "gradwatch-rules.test.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "gradwatch-dashboard.json"
PROVISIONING = DEPLOY / "grafana" / "provisioning"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "docker-compose.yml"
K8S = DEPLOY / "kubernetes"
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
EXAMPLE = ROOT / "examples" / "train_ddp.py"
GEN_K8S = ROOT / "scripts" / "gen_k8s_rules.py"

#: The exporter's metric names (the contract of docs/metrics.md), as PromQL sees them.
CONTRACT_METRICS = frozenset(
    {
        # gauges
        "gradwatch_global_grad_norm",
        "gradwatch_grad_norm",
        "gradwatch_grad_norm_ratio",
        "gradwatch_group_parameters",
        "gradwatch_vanishing_tensors",
        "gradwatch_exploding_tensors",
        "gradwatch_nonfinite_tensors",
        "gradwatch_health_score",
        "gradwatch_isolation_violated",
        "gradwatch_replica_divergence",
        "gradwatch_step",
        "gradwatch_last_collect_timestamp_seconds",
        "gradwatch_clip_coef",
        "gradwatch_param_grad_norm",
        "gradwatch_collecting",
        # optimizer-update health (update_stats)
        "gradwatch_weight_norm",
        "gradwatch_update_norm",
        "gradwatch_update_ratio",
        "gradwatch_stalled_update_fraction",
        # the per-rank view (DDP comm hook)
        "gradwatch_nonfinite_origin_ranks",
        "gradwatch_replica_grad_norm",
        "gradwatch_replica_grad_norm_max_rank",
        "gradwatch_replica_outlier_score",
        "gradwatch_gradient_noise_scale",
        "gradwatch_group_gradient_noise_scale",
        "gradwatch_last_nonfinite_origin",
        # which rank is slow (rank_timing)
        "gradwatch_slowest_rank",
        "gradwatch_straggler_score",
        "gradwatch_rank_work_seconds",
        # counters
        "gradwatch_collections_total",
        "gradwatch_nonfinite_steps_total",
        "gradwatch_no_gradient_steps_total",
        "gradwatch_exploding_steps_total",
        "gradwatch_isolation_violations_total",
        "gradwatch_publish_errors_total",
        "gradwatch_dropped_snapshots_total",
        "gradwatch_amp_skipped_steps_total",
        "gradwatch_internal_errors_total",
        # histogram
        "gradwatch_collect_seconds_bucket",
        "gradwatch_collect_seconds_sum",
        "gradwatch_collect_seconds_count",
        # info
        "gradwatch_build_info",
        "gradwatch_run_info",
        # restarts and ratio bands (constant for a run)
        "gradwatch_start_time_seconds",
        "gradwatch_grad_norm_ratio_band",
        # spikes and every step between scrapes (names fixed by the metric contract)
        "gradwatch_global_grad_norm_spike_score",
        "gradwatch_grad_norm_spike_score",
        "gradwatch_global_grad_norm_spikes_total",
        "gradwatch_grad_norm_spikes_total",
        "gradwatch_nonfinite_group_steps_total",
        "gradwatch_global_grad_norm_per_step_bucket",
        "gradwatch_global_grad_norm_per_step_sum",
        "gradwatch_global_grad_norm_per_step_count",
        "gradwatch_grad_norm_per_step_bucket",
        "gradwatch_grad_norm_per_step_sum",
        "gradwatch_grad_norm_per_step_count",
        # norm auditing
        "gradwatch_reported_norm_ratio",
        "gradwatch_norm_audit_disagreements_total",
        # the sinks (history file, trackers)
        "gradwatch_sink_errors_total",
        "gradwatch_sink_dropped_steps_total",
        # the optimizer-step guard
        "gradwatch_skipped_steps_total",
        "gradwatch_consecutive_skipped_steps",
        "gradwatch_guard_stopped",
    }
)

#: Alerts the deployment must ship (at least), with their severity and whether they need a `for`.
REQUIRED_ALERTS = {
    "GradwatchNonFiniteGradients": ("critical", False),
    "GradwatchExplodingGradients": ("warning", True),
    "GradwatchVanishingGradients": ("warning", True),
    "GradwatchIsolationViolated": ("warning", False),
    "GradwatchGradRatioDormant": ("warning", True),
    "GradwatchReplicaDivergence": ("critical", False),
    "GradwatchMetricsStale": ("warning", True),
    "GradwatchTargetDown": ("warning", True),
    "GradwatchNotCollecting": ("critical", False),
    "GradwatchGradNormSpike": ("warning", False),
    "GradwatchNormAuditDisagreement": ("critical", True),
    "GradwatchReplicaOutlier": ("warning", True),
    "GradwatchStepsSkipped": ("warning", False),
    "GradwatchGuardStopped": ("critical", False),
    "GradwatchSinkFailing": ("warning", False),

    "GradwatchOptimizerNotUpdating": ("critical", False),
    "GradwatchUpdateRatioOutOfBand": ("warning", True),
    "GradwatchStalledUpdates": ("warning", True),
    "GradwatchNoGradient": ("warning", False),
}

GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}

_NAME = re.compile(r"(?<![A-Za-z0-9_:])[A-Za-z_:][A-Za-z0-9_:]*")


# -- helpers ------------------------------------------------------------------------------------


def load_script(path: Path) -> Any:
    """The Python file ``path`` (a script of the repository, not a package module), imported."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def promtool() -> str:
    """Path of promtool; missing is a failure under CI (REQUIRE_E2E=1), a skip elsewhere."""
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not found: run `make system-deps` (Debian package 'prometheus')"
        if os.environ.get("REQUIRE_E2E") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def rule_groups() -> list[dict[str, Any]]:
    return load_yaml(RULES)["groups"]


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


def recorded_names() -> set[str]:
    return {r["record"] for g in rule_groups() for r in g["rules"] if "record" in r}


def gradwatch_names(text: str) -> set[str]:
    """Metric names mentioning gradwatch_ in a PromQL expression or a template."""
    return {m for m in _NAME.findall(text) if "gradwatch_" in m}


def check_names(names: set[str], where: str) -> None:
    """Plain names must be exporter metrics; names with ':' must be our recording rules."""
    recorded = recorded_names()
    unknown = {n for n in names if ":" not in n and n not in CONTRACT_METRICS}
    unknown |= {n for n in names if ":" in n and n not in recorded}
    assert not unknown, f"{where} uses names that are neither exported nor recorded: {unknown}"


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) of every PromQL expression of the dashboard: panels and annotations."""
    board = dashboard()
    out = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in board["panels"]
        for t in p.get("targets", [])
    ]
    out += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in board["annotations"]["list"]
        if "expr" in a
    ]
    return out


def data_query(expr: str) -> str:
    """The query of ``expr`` that must return data: an exemplar-only query (the norm panels'
    ``(counters) < 0``, which draws no line and only fetches the counters' exemplars) is asked
    for its counters."""
    suffix = " < 0"
    if expr.startswith("(") and expr.endswith(")" + suffix):
        return expr[: -len(suffix)]
    return expr


def dashboard_variable_queries() -> list[tuple[str, str]]:
    out = []
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]
        out.append((var["name"], query["query"] if isinstance(query, dict) else query))
    return out


def substitute_grafana_vars(expr: str, job: str = "train", instance: str = ".*") -> str:
    """The expression Grafana sends for one choice of the variables."""
    values = {
        "job": job,
        "instance": instance,
        "__rate_interval": "1m",
        "__interval": "15s",
        "__range": "1h",
        "__interval_ms": "15000",
        "__range_s": "3600",
    }

    def repl(m: re.Match[str]) -> str:
        return values[m.group(1) or m.group(2)]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def label_values_selector(query: str) -> tuple[str, str]:
    """``label_values(selector, label)`` -> (selector, label)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
    assert m, f"variable query {query!r} is not label_values(selector, label)"
    return m.group(1), m.group(2)


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


def compose_mounts(service: dict[str, Any]) -> Iterator[tuple[Path, str]]:
    """(host path, container path) of the bind mounts of a Compose service."""
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            yield (COMPOSE_DIR / source).resolve(), target


def k8s_docs() -> list[dict[str, Any]]:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        docs += load_yaml_all(K8S / resource)
    return docs


def k8s_one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d
        for d in k8s_docs()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def env_config(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The WatchConfig a process would build from exactly these GRADWATCH_* variables."""
    from gradwatch import WatchConfig

    for key in list(os.environ):
        if key.startswith("GRADWATCH_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("GRADWATCH_"):
            monkeypatch.setenv(key, value)
    return WatchConfig()


def github_anchor(heading: str) -> str:
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """GitHub anchor of each heading of docs/runbook.md -> its text (up to the next heading)."""
    sections: dict[str, str] = {}
    current = None
    for line in RUNBOOK.read_text().splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            current = github_anchor(m.group(1))
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


# -- Prometheus rules ---------------------------------------------------------------------------
