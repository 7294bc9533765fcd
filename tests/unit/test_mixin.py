"""The monitoring mixin (deploy/mixin): the shipped rules, dashboard and PrometheusRule are its
output with the default ``_config``, and its settings reach every rule and query.

The rules' behaviour is tested by promtool (tests/unit/test_deploy.py, unchanged); here: the
regeneration diff, and a configured rendering that promtool accepts and that carries the
selector, thresholds, ``for`` durations and runbook URL it was given."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from deploy_assets import ROOT, load_script, run_promtool

GEN = ROOT / "scripts" / "gen_mixin.py"


def gen() -> Any:
    return load_script(GEN)


def test_shipped_files_are_the_mixin_output() -> None:
    files = gen().outputs()
    assert len(files) == 3
    for path, text in files.items():
        assert path.read_text() == text, f"{path} is not the mixin's output: make deploy-assets"
    result = subprocess.run(
        [sys.executable, str(GEN), "--check"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


OVERRIDES = {
    "selector": 'cluster="eu-1"',
    "explodingNormThreshold": "500",
    "replicaDivergenceThreshold": "1e-05",
    "metricsStaleSeconds": "1800",
    "overheadFraction": "0.025",
    "explodingFor": "1h",
    "vanishingFor": "30m",
    "runbookURLPattern": "https://wiki.example/gradwatch#%s",
}


def test_config_reaches_every_rule_and_query(tmp_path: Path) -> None:
    g = gen()
    out = g.evaluate(OVERRIDES)
    rules_text = g.render_rules(out)
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(rules_text)
    result = run_promtool("check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = {
        r.get("alert") or r["record"]: r
        for grp in yaml.safe_load(rules_text)["groups"]
        for r in grp["rules"]
    }
    exploding = rules["GradwatchExplodingGradients"]
    assert 'gradwatch_grad_norm{cluster="eu-1"} > 500' in exploding["expr"]
    assert exploding["for"] == "1h" and "for 1 hour:" in exploding["annotations"]["description"]
    assert "above 500 (current" in exploding["annotations"]["description"]
    assert rules["GradwatchVanishingGradients"]["for"] == "30m"
    assert "for 30 minutes." in rules["GradwatchVanishingGradients"]["annotations"]["description"]
    divergence = rules["GradwatchReplicaDivergence"]
    assert divergence["expr"].endswith("> 1e-05")
    assert divergence["annotations"]["description"].endswith("> 1e-5.")
    assert "> 1800" in rules["GradwatchMetricsStale"]["expr"]
    assert 'up{cluster="eu-1"} == 1' in rules["GradwatchMetricsStale"]["expr"]
    overhead = rules["GradwatchOverheadHigh"]
    assert overhead["expr"].endswith("> 0.025") and "2.5%" in overhead["annotations"]["summary"]
    assert (
        'gradwatch_grad_norm_ratio_band{bound="dormant",cluster="eu-1"}'
        in rules["GradwatchGradRatioDormant"]["expr"]
    )
    for name, rule in rules.items():
        if "alert" in rule:
            assert rule["annotations"]["runbook_url"] == (
                f"https://wiki.example/gradwatch#{name.lower()}"
            )
        # every raw gradwatch series is selected
        for token in rule["expr"].replace("(", " ").split():
            if token.startswith("gradwatch_") and ":" not in token:
                assert 'cluster="eu-1"' in token, (name, token)

    board = out["dashboards"]["gradwatch-dashboard.json"]
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", []) if "expr" in t]
    assert exprs and all('cluster="eu-1"' in e for e in exprs if "$instance" in e)
    variables = {v["name"]: v["query"] for v in board["templating"]["list"]}
    assert variables["job"] == 'label_values(gradwatch_build_info{cluster="eu-1"}, job)'
    assert 'cluster="eu-1"' in variables["instance"]


def test_default_files_select_every_series_and_show_exemplars() -> None:
    text = (ROOT / "deploy" / "prometheus" / "gradwatch-rules.yml").read_text()
    assert "{@}" not in text and ",@}" not in text and "$(" not in text
    board = json.loads((ROOT / "deploy" / "grafana" / "gradwatch-dashboard.json").read_text())
    with_exemplars = {
        p["title"]
        for p in board["panels"]
        for t in p.get("targets", [])
        if t.get("exemplar")
    }
    assert with_exemplars == {"Global gradient norm", "Gradient norm by group"}
