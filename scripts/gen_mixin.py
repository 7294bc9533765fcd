"""Render the gradwatch monitoring mixin (deploy/mixin) into the shipped rules and dashboard.

    python scripts/gen_mixin.py            # (re)write the shipped files (make deploy-assets)
    python scripts/gen_mixin.py --check    # exit 1 if a committed file is not the mixin's output
    python scripts/gen_mixin.py --config '{"explodingNormThreshold": "500"}' --out-dir my/
                                           # your own settings: rules + dashboard into my/

With the mixin's default ``_config`` the outputs are the committed
deploy/prometheus/gradwatch-rules.yml and deploy/grafana/gradwatch-dashboard.json (and the
Kubernetes PrometheusRule generated from the rules, scripts/gen_k8s_rules.py);
tests/unit/test_mixin.py regenerates them and fails when they differ. ``--config`` takes a JSON
object merged into ``_config`` (docs/operations.md lists the keys). The jsonnet evaluator is the
``jsonnet`` Python package (its wheels bundle the C++ evaluator).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
MIXIN = ROOT / "deploy" / "mixin" / "mixin.libsonnet"
RULES = ROOT / "deploy" / "prometheus" / "gradwatch-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gradwatch-dashboard.json"
K8S_RULE = ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"

RULES_HEADER = """\
# GENERATED from the gradwatch mixin (deploy/mixin) by scripts/gen_mixin.py: do not edit.
# Change deploy/mixin/*.libsonnet (the comments explaining each rule live there), then run
# `make deploy-assets`; tests/unit/test_mixin.py fails when this file is not the mixin's output.
# Your own thresholds, selectors and `for` durations: `_config`, docs/operations.md.
# Thresholds, durations and what to do for each alert: docs/runbook.md.
# Unit tests: promtool test rules deploy/prometheus/gradwatch-rules.test.yml
"""

#: Key order of a rule in the YAML (jsonnet sorts keys; people read them in this order).
RULE_KEYS = ("alert", "record", "expr", "for", "labels", "annotations")


def evaluate(config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The mixin's ``prometheusRules``, ``prometheusAlerts`` and ``grafanaDashboards`` with
    ``config`` merged into ``_config``."""
    import _jsonnet

    snippet = (
        f"local mixin = (import {json.dumps(str(MIXIN))}) "
        f"+ {{ _config+:: {json.dumps(config or {})} }};\n"
        "{ rules: mixin.prometheusRules, alerts: mixin.prometheusAlerts, "
        "dashboards: mixin.grafanaDashboards }"
    )
    return json.loads(_jsonnet.evaluate_snippet("gen_mixin", snippet))


def _ordered_rule(rule: dict[str, Any]) -> dict[str, Any]:
    unknown = set(rule) - set(RULE_KEYS)
    if unknown:
        raise ValueError(f"rule {rule.get('alert') or rule.get('record')}: keys {unknown}")
    return {k: rule[k] for k in RULE_KEYS if k in rule}


def render_rules(out: dict[str, Any]) -> str:
    """The rules file: recording groups, then alerting groups, rules in their written order."""
    groups = [
        {"name": g["name"], "rules": [_ordered_rule(r) for r in g["rules"]]}
        for g in out["rules"]["groups"] + out["alerts"]["groups"]
    ]
    gen = _k8s_generator()
    body = yaml.dump(
        {"groups": groups},
        Dumper=gen._Dumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=10_000,
    )
    return RULES_HEADER + body


def render_dashboard(out: dict[str, Any]) -> str:
    return json.dumps(out["dashboards"]["gradwatch-dashboard.json"], indent=2) + "\n"


def _k8s_generator() -> Any:
    path = ROOT / "scripts" / "gen_k8s_rules.py"
    spec = importlib.util.spec_from_file_location("gen_k8s_rules", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outputs(config: dict[str, Any] | None = None) -> dict[Path, str]:
    """Every generated file (the shipped paths) and its text."""
    out = evaluate(config)
    rules = render_rules(out)
    gen = _k8s_generator()
    k8s = gen.HEADER + gen.render_text(rules)
    return {RULES: rules, DASHBOARD: render_dashboard(out), K8S_RULE: k8s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file is out of date")
    parser.add_argument("--config", default="{}", help="JSON object merged into _config")
    parser.add_argument("--out-dir", type=Path, help="write there instead of deploy/")
    args = parser.parse_args(argv)
    config = json.loads(args.config)
    if not isinstance(config, dict):
        parser.error("--config must be a JSON object")
    files = outputs(config)
    if args.check:
        stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p} is not the mixin's output: run `make deploy-assets`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        target = args.out_dir / path.name if args.out_dir else path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
