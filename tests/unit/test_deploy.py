"""Static checks of the deploy assets (deploy/**, docs/runbook.md, examples/train_ddp.py).

promtool checks and unit-tests the rules; the Grafana dashboard, the Compose stack and the
Kubernetes manifests are parsed and cross-checked against each other and against the repository
(no Docker engine or cluster runs here). The live checks against a real Prometheus scraping a
real job are in tests/e2e/test_deploy_e2e.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_assets import (
    ALERTMANAGER,
    COMPOSE_DIR,
    DASHBOARD,
    EXAMPLE,
    GEN_K8S,
    GRAFANA_BUILTINS,
    K8S,
    PROM_CONFIG,
    PROVISIONING,
    REQUIRED_ALERTS,
    ROOT,
    RULES,
    RULES_TEST,
    RUNBOOK,
    alerts,
    check_names,
    compose,
    compose_mounts,
    dashboard,
    dashboard_exprs,
    dashboard_variable_queries,
    env_config,
    gradwatch_names,
    k8s_docs,
    k8s_one,
    label_values_selector,
    load_script,
    load_yaml,
    rule_groups,
    run_promtool,
    runbook_sections,
    substitute_grafana_vars,
)


def test_promtool_check_rules() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # "clean": no lint warning either.
    assert "WARNING" not in (result.stdout + result.stderr).upper()


def test_promtool_test_rules() -> None:
    result = run_promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_cover_every_alert_firing_and_not_firing() -> None:
    tests = load_yaml(RULES_TEST)["tests"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert set(alerts()) <= firing, f"never shown firing: {set(alerts()) - firing}"
    assert set(alerts()) <= quiet, f"never shown not firing: {set(alerts()) - quiet}"
    text = RULES_TEST.read_text()
    assert "NaN" in text and "stale" in text and "Inf" in text


def test_promtool_check_standalone_prometheus_config() -> None:
    result = run_promtool("check", "config", str(PROM_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr
    config = load_yaml(PROM_CONFIG)
    assert [(PROM_CONFIG.parent / f).resolve() for f in config["rule_files"]] == [RULES]
    targets = [
        t for sc in config["scrape_configs"] for s in sc["static_configs"] for t in s["targets"]
    ]
    assert targets == ["localhost:9977"]  # rank 0's port: the default demo port


def test_required_alerts_severity_and_for() -> None:
    found = alerts()
    for name, (severity, needs_for) in REQUIRED_ALERTS.items():
        assert name in found, f"missing alert {name}"
        assert found[name]["labels"]["severity"] == severity, name
        assert ("for" in found[name]) == needs_for, name
    for name, rule in found.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name


def test_alert_annotations_name_job_instance_group_and_runbook() -> None:
    sections = runbook_sections()
    for name, rule in alerts().items():
        annotations = rule["annotations"]
        assert set(annotations) >= {"summary", "description", "runbook_url"}, name
        for key in ("summary", "description"):
            text = annotations[key]
            assert "$labels.job" in text and "$labels.instance" in text, (name, key)
        both = annotations["summary"] + annotations["description"]
        assert (
            "$labels.group" in both
            or "$labels.numerator" in both
            or "all groups" in both
            or "Labels.group" in both
        ), f"{name}: annotations do not name the group"
        anchor = name.lower()
        assert annotations["runbook_url"] == f"docs/runbook.md#{anchor}", name
        assert anchor in sections, f"docs/runbook.md has no section for {name}"


_NUMBER_WORDS = (
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"),
    *("eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen"),
    *("eighteen", "nineteen", "twenty", "twenty-one", "twenty-two", "twenty-three"),
)


def test_operations_and_runbook_count_every_shipped_alert() -> None:
    """operations.md says how many alerts ship, in words; the runbook's table lists each."""
    text = (ROOT / "docs" / "operations.md").read_text()
    found = re.search(r"`gradwatch\.alerts`: ([a-z-]+) alerts", text)
    assert found, "operations.md no longer states the number of alerts"
    assert found.group(1) == _NUMBER_WORDS[len(alerts())], (found.group(1), len(alerts()))
    table = RUNBOOK.read_text().split("\n## ", 1)[0]
    for name in alerts():
        assert f"[{name}](#{name.lower()})" in table, f"runbook table misses {name}"


def test_runbook_documents_thresholds_durations_and_actions() -> None:
    sections = runbook_sections()
    for name, rule in alerts().items():
        text = sections[name.lower()]
        assert rule["labels"]["severity"] in text, f"{name}: severity not documented"
        if "for" in rule:
            assert rule["for"] in text, f"{name}: duration {rule['for']} not documented"
        assert re.search(r"(?i)what to do", text), f"{name}: no 'what to do'"


def test_nonfinite_alert_built_on_the_counter_without_for() -> None:
    rule = alerts()["GradwatchNonFiniteGradients"]
    assert "for" not in rule
    assert "gradwatch_nonfinite_steps_total" in rule["expr"]
    assert "increase(" in rule["expr"]  # counter resets are handled


def test_stale_alert_requires_target_up() -> None:
    expr = alerts()["GradwatchMetricsStale"]["expr"]
    assert "gradwatch_last_collect_timestamp_seconds" in expr and "time()" in expr
    assert re.search(r"and on \(job, instance\)\s+up == 1", expr)


def test_rule_metric_names_are_exported_or_recorded() -> None:
    for group in rule_groups():
        for rule in group["rules"]:
            where = rule.get("alert") or rule.get("record")
            texts = [rule["expr"], *rule.get("annotations", {}).values()]
            check_names(gradwatch_names("\n".join(texts)), f"rule {where}")


def test_generated_prometheusrule_matches_source() -> None:
    gen = load_script(GEN_K8S)
    generated = K8S / "prometheusrule.yaml"
    assert generated.read_text() == gen.render(RULES), (
        "deploy/kubernetes/prometheusrule.yaml differs from deploy/prometheus/gradwatch-rules.yml:"
        " run `make deploy-assets`"
    )
    manifest = load_yaml(generated)
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == rule_groups()
    # The --check mode agrees.
    result = subprocess.run(
        [sys.executable, str(GEN_K8S), "--check"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_generated_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    manifest = load_yaml(K8S / "prometheusrule.yaml")
    rules_file = tmp_path / "from-k8s.yml"
    rules_file.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}))
    result = run_promtool("check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr


# -- Grafana ------------------------------------------------------------------------------------


def test_dashboard_identity_and_variables() -> None:
    board = dashboard()
    assert board["uid"] == "gradwatch"
    assert board["schemaVersion"] >= 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("job", "instance"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    queries = dict(dashboard_variable_queries())
    job_selector, job_label = label_values_selector(queries["job"])
    inst_selector, inst_label = label_values_selector(queries["instance"])
    assert job_label == "job" and inst_label == "instance"
    assert job_selector.split("{")[0] in {"gradwatch_build_info", "gradwatch_step"}
    assert inst_selector.startswith(job_selector.split("{")[0]) and "$job" in inst_selector


def test_dashboard_panels_units_datasource_and_filters() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        title = panel["title"]
        assert panel["type"] != "row", "rows have no unit: the dashboard uses none"
        unit = panel["fieldConfig"]["defaults"].get("unit")
        assert unit and unit != "none", f"panel {title!r} has no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", title
            expr = target["expr"]
            assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, (title, expr)


def test_dashboard_variables_used_are_defined() -> None:
    defined = {v["name"] for v in dashboard()["templating"]["list"]} | GRAFANA_BUILTINS
    for where, expr in dashboard_exprs():
        used = {a or b for a, b in re.findall(r"\$\{(\w+)\}|\$(\w+)", expr)}
        assert used <= defined, f"{where}: undefined variables {used - defined}"


def test_dashboard_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_dashboard_shows_every_key_metric_with_log_norms_ratio_bands_and_annotations() -> None:
    board = dashboard()
    by_metric: dict[str, list[dict[str, Any]]] = {}
    for panel in board["panels"]:
        for target in panel["targets"]:
            for name in gradwatch_names(target["expr"]):
                by_metric.setdefault(name, []).append(panel)
    for metric in (
        "gradwatch_global_grad_norm",
        "gradwatch_grad_norm",
        "gradwatch_grad_norm_ratio",
        "gradwatch_health_score",
        "gradwatch_vanishing_tensors",
        "gradwatch_exploding_tensors",
        "gradwatch_nonfinite_tensors",
        "gradwatch_isolation_violated",
        "gradwatch_replica_divergence",
        "gradwatch_step",
        "gradwatch_collections_total",
        "gradwatch_collect_seconds_bucket",
        "gradwatch_collect_seconds_sum",
    ):
        assert metric in by_metric, f"no panel shows {metric}"
    # Norm panels on a log scale.
    for metric in ("gradwatch_global_grad_norm", "gradwatch_grad_norm"):
        for panel in by_metric[metric]:
            if panel["type"] == "timeseries":
                scale = panel["fieldConfig"]["defaults"]["custom"]["scaleDistribution"]
                assert scale["type"] == "log", panel["title"]
    # Ratio panel: each pair's configured band is drawn from the exported band series, no
    # level is written into the dashboard.
    (ratio,) = by_metric["gradwatch_grad_norm_ratio"]
    assert ratio in by_metric["gradwatch_grad_norm_ratio_band"]
    bands = [t["expr"] for t in ratio["targets"] if "gradwatch_grad_norm_ratio_band" in t["expr"]]
    assert any("low|high" in e for e in bands) and any('bound="dormant"' in e for e in bands)
    defaults = ratio["fieldConfig"]["defaults"]
    assert [s["value"] for s in defaults["thresholds"]["steps"]] == [None]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "off"
    # Staleness, clipping, spikes, the per-step distribution and the top-k parameters.
    for metric in (
        "gradwatch_last_collect_timestamp_seconds",
        "gradwatch_clip_coef",
        "gradwatch_grad_norm_spike_score",
        "gradwatch_global_grad_norm_spike_score",
        "gradwatch_grad_norm_spikes_total",
        "gradwatch_global_grad_norm_spikes_total",
        "gradwatch_global_grad_norm_per_step_bucket",
        "gradwatch_grad_norm_per_step_bucket",
        "gradwatch_param_grad_norm",
    ):
        assert metric in by_metric, f"no panel shows {metric}"
    for metric in (
        "gradwatch_global_grad_norm_per_step_bucket",
        "gradwatch_grad_norm_per_step_bucket",
    ):
        for panel in by_metric[metric]:
            exprs = [t["expr"] for t in panel["targets"] if metric in t["expr"]]
            assert all(e.startswith("histogram_quantile(") and "le)" in e for e in exprs), exprs
    # Annotations on non-finite steps and on spikes.
    exprs = [a.get("expr", "") for a in board["annotations"]["list"]]
    assert any("gradwatch_nonfinite_steps_total" in e for e in exprs)
    assert any("gradwatch_grad_norm_spikes_total" in e for e in exprs)


def test_dashboard_metric_names_are_exported_or_recorded() -> None:
    for where, expr in dashboard_exprs():
        check_names(gradwatch_names(expr), f"dashboard {where}")
    for name, query in dashboard_variable_queries():
        check_names(gradwatch_names(query), f"dashboard variable {name}")


def test_dashboard_exprs_parse(tmp_path: Path) -> None:
    """promtool parses PromQL offline when it checks rules: one recording rule per expression."""
    exprs = [substitute_grafana_vars(e) for _, e in dashboard_exprs()]
    exprs += [
        label_values_selector(substitute_grafana_vars(q))[0]
        for _, q in dashboard_variable_queries()
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:expr_{i}", "expr": e} for i, e in enumerate(exprs)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning() -> None:
    (datasource,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "gradwatch.yml")["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# -- Compose ------------------------------------------------------------------------------------


def test_compose_services_ports_and_mounts_exist() -> None:
    services = compose()["services"]
    assert set(services) >= {"trainer", "prometheus", "grafana"}
    published = {
        name: {p.split(":")[-1] for p in svc.get("ports", [])} for name, svc in services.items()
    }
    assert "9977" in published["trainer"]
    assert "9090" in published["prometheus"]
    assert "3000" in published["grafana"]
    for name, service in services.items():
        for host, _ in compose_mounts(service):
            assert host.exists(), f"service {name} mounts {host}, which is not in the repository"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose().get("volumes", {}), f"undeclared volume {source}"


def test_compose_trainer_build_and_command() -> None:
    trainer = compose()["services"]["trainer"]
    context = (COMPOSE_DIR / trainer["build"]["context"]).resolve()
    assert context == ROOT
    dockerfile = context / trainer["build"]["dockerfile"]
    assert dockerfile.exists()
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", dockerfile.read_text(), flags=re.M)
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for sources in copied:
        for source in sources.split():
            assert (context / source).exists(), f"{dockerfile.name} copies missing {source}"
            assert source.rstrip("/") in allowed, f"{source} is excluded by the .dockerignore"
    command = trainer["command"]
    assert command[0] == "torchrun" and "--nproc_per_node=2" in command
    script = next(c for c in command if c.endswith(".py"))
    assert (ROOT / script).exists()
    assert script == "examples/train_ddp.py"


def test_compose_trainer_env_is_a_valid_config(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose()["services"]
    env = {k: str(v) for k, v in services["trainer"]["environment"].items()}
    cfg = env_config(env, monkeypatch)
    assert cfg.enabled and cfg.port == 9977 and cfg.bind_address == "0.0.0.0"
    assert set(cfg.groups) == {"host", "seed", "stem"}
    assert f"{cfg.port}:{cfg.port}" in services["trainer"]["ports"]
    # The compose Prometheus scrapes that port on the trainer service.
    prom = load_yaml(COMPOSE_DIR / "prometheus.yml")
    targets = [
        t for sc in prom["scrape_configs"] for s in sc["static_configs"] for t in s["targets"]
    ]
    assert targets == [f"trainer:{cfg.port}"]


def test_compose_prometheus_config_and_rules_mount(tmp_path: Path) -> None:
    prometheus = compose()["services"]["prometheus"]
    mounts = {target: host for host, target in compose_mounts(prometheus)}
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if "--config.file" in a)
    assert mounts[config_path] == COMPOSE_DIR / "prometheus.yml"
    config = load_yaml(mounts[config_path])
    assert [mounts[f] for f in config["rule_files"]] == [RULES]
    alertmanagers = [
        t
        for am in config["alerting"]["alertmanagers"]
        for s in am["static_configs"]
        for t in s["targets"]
    ]
    assert alertmanagers == ["alertmanager:9093"]
    # promtool on the config as the container sees it (container paths -> repository paths).
    config["rule_files"] = [str(mounts[f]) for f in config["rule_files"]]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    result = run_promtool("check", "config", str(local))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_compose_grafana_provisioning_mounts() -> None:
    services = compose()["services"]
    grafana = services["grafana"]
    mounts = dict(compose_mounts(grafana))
    assert mounts[PROVISIONING / "datasources"] == "/etc/grafana/provisioning/datasources"
    assert mounts[PROVISIONING / "dashboards"] == "/etc/grafana/provisioning/dashboards"
    (provider,) = load_yaml(PROVISIONING / "dashboards" / "gradwatch.yml")["providers"]
    board_target = mounts[DASHBOARD]
    assert board_target.rsplit("/", 1)[0] == provider["options"]["path"]
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == board_target
    (datasource,) = load_yaml(PROVISIONING / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    assert "9090:9090" in services["prometheus"]["ports"]
    interval = load_yaml(COMPOSE_DIR / "prometheus.yml")["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == interval


def test_alertmanager_routes_critical_to_the_pager() -> None:
    config = load_yaml(ALERTMANAGER)
    receivers = {r["name"] for r in config["receivers"]}
    route = config["route"]
    assert route["receiver"] in receivers
    critical = [r for r in route["routes"] if 'severity = "critical"' in r["matchers"]]
    assert len(critical) == 1 and critical[0]["receiver"] == "pager" and "pager" in receivers
    mounts = dict(compose_mounts(compose()["services"]["alertmanager"]))
    assert mounts[ALERTMANAGER] == "/etc/alertmanager/alertmanager.yml"


# -- Kubernetes ---------------------------------------------------------------------------------


def test_k8s_manifests_parse_and_kinds() -> None:
    kinds = sorted(d["kind"] for d in k8s_docs())
    assert kinds == ["Job", "PodMonitor", "PrometheusRule", "Service", "Service"]
    for doc in k8s_docs():
        assert doc["apiVersion"] and doc["metadata"]["name"]


def test_k8s_job_runs_torchrun_with_gradwatch(monkeypatch: pytest.MonkeyPatch) -> None:
    job = k8s_one("Job")
    pod = job["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    argv = container["command"] + container["args"]
    assert argv[0] == "torchrun" and "examples/train_ddp.py" in argv
    assert (ROOT / "examples" / "train_ddp.py").exists()
    nnodes = int(next(a for a in argv if a.startswith("--nnodes=")).split("=")[1])
    assert nnodes == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert "--node_rank=$(JOB_COMPLETION_INDEX)" in argv
    assert job["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "JOB_COMPLETION_INDEX" in env  # declared before its use in args
    cfg = env_config({k: v for k, v in env.items() if v is not None}, monkeypatch)
    assert cfg.enabled and cfg.port is not None
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == cfg.port
    # Rendezvous: master_addr is pod 0's DNS name under the headless Service.
    master = next(a for a in argv if a.startswith("--master_addr=")).split("=")[1]
    headless = k8s_one("Service", pod["spec"]["subdomain"])
    assert headless["spec"]["clusterIP"] == "None"
    assert master == f"{job['metadata']['name']}-0.{headless['metadata']['name']}"
    master_port = int(next(a for a in argv if a.startswith("--master_port=")).split("=")[1])
    assert ports["rendezvous"] == master_port


def test_k8s_service_and_podmonitor_select_rank_zero() -> None:
    job = k8s_one("Job")
    pod_labels = dict(job["spec"]["template"]["metadata"]["labels"])
    # Added by the Job controller to each pod of an Indexed Job (Kubernetes >= 1.28).
    index_label = "batch.kubernetes.io/job-completion-index"
    service = k8s_one("Service", "gradwatch-example-metrics")
    monitor = k8s_one("PodMonitor")
    for selector in (service["spec"]["selector"], monitor["spec"]["selector"]["matchLabels"]):
        assert selector[index_label] == "0"
        rest = {k: v for k, v in selector.items() if k != index_label}
        assert rest.items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "metrics" and port["port"] == 9977
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_kustomize_build() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (optional: the manifests are parsed above)")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(result.stdout) if d)
    assert kinds == ["Job", "PodMonitor", "PrometheusRule", "Service", "Service"]


# -- the example job ----------------------------------------------------------------------------


def _example_module() -> Any:
    return load_script(EXAMPLE)


def test_example_step_specs() -> None:
    spec = _example_module().StepSpec
    assert 5 in spec("5") and 4 not in spec("5")
    assert 7 in spec("3,7") and 5 not in spec("3,7")
    assert 10 in spec("10-20") and 20 in spec("10-20") and 21 not in spec("10-20")
    assert 10**9 in spec("150-") and 149 not in spec("150-")
    assert not spec("") and not spec(None)


@pytest.mark.timeout(120)
def test_example_runs_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example against the public API, without torchrun or an endpoint (a few steps)."""
    for key in list(os.environ):
        if key.startswith(("GRADWATCH_", "INJECT_")) or key in {"WORLD_SIZE", "RANK"}:
            monkeypatch.delenv(key)
    monkeypatch.setenv("GRADWATCH_GROUPS", '{"host": ["backbone.*"], "seed": ["seed.*"]}')
    monkeypatch.setenv("INJECT_NAN_AT", "2")
    monkeypatch.setenv("INJECT_EXPLODE_AT", "3-")
    assert _example_module().main(["--steps", "5", "--sleep", "0", "--log-every", "1"]) == 0


def test_counter_alerts_are_restart_safe() -> None:
    """A counter alert also fires on a counter above 0 in a run whose start time changed: a
    restarted job can count its first event before Prometheus's first scrape (1, 1, 1)."""
    for name, rule in alerts().items():
        expr = rule["expr"]
        for window in re.findall(r"increase\(gradwatch_\w+_total\[(\w+)\]\)", expr):
            assert (
                "gradwatch_start_time_seconds\n"
                f"!= last_over_time(gradwatch_start_time_seconds[1h] offset {window})"
            ) in re.sub(r"\n\s+", "\n", expr), name


def test_ratio_alert_reads_the_configured_bands() -> None:
    rule = alerts()["GradwatchGradRatioDormant"]
    assert 'gradwatch_grad_norm_ratio_band{bound="dormant"}' in rule["expr"]
    text = rule["expr"] + rule["annotations"]["description"]
    for number in ("0.01", "0.05", "0.2"):  # levels come from the job, not the rules
        assert number not in text, number


def test_nonfinite_and_spike_descriptions_name_groups_from_the_counters() -> None:
    found = alerts()
    for name, counter in (
        ("GradwatchNonFiniteGradients", "gradwatch_nonfinite_group_steps_total"),
        ("GradwatchGradNormSpike", "gradwatch_grad_norm_spikes_total"),
    ):
        description = found[name]["annotations"]["description"]
        assert counter in description and "query" in description, name
        assert "gradwatch_nonfinite_tensors" not in description, name  # not the last step


@pytest.mark.parametrize(
    ("title", "metric"),
    [("Non-finite steps", "gradwatch_nonfinite_steps_total"),
     ("Exploding steps", "gradwatch_exploding_steps_total")],
)
def test_step_count_panels_count_a_restarted_runs_first_steps(
    tmp_path: Path, title: str, metric: str
) -> None:
    """Run A counts a step and stops; run B, on the same target, counts one before its first
    scrape, so Prometheus sees 1, 1, 1 across the restart. The stat counts both steps over the
    whole range and only B's over a range that starts after A's (promtool evaluates the
    panel's own query). ``increase()`` alone would show 1 for the whole range."""
    panel = next(p for p in dashboard()["panels"] if p.get("title") == title)
    (target,) = panel["targets"]
    labels = 'job="train",instance="n0:9977"'
    info = f'gradwatch_run_info{{{labels},world_size="2",parallelism="ddp2",run_id="%s"}}'
    spec = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                # A: t=0..4m (a step counted at 2m); down at 5-6m; B: 7-12m, 1 from the start.
                {"series": f"{metric}{{{labels}}}", "values": "0 0 1 1 1 stale _ 1 1 1 1 1 1"},
                {"series": info % "A", "values": "1 1 1 1 1 stale"},
                {"series": info % "B", "values": "_ _ _ _ _ _ _ 1 1 1 1 1 1"},
            ],
            "promql_expr_test": [
                {"expr": substitute_grafana_vars(target["expr"]).replace("1h", range_),
                 "eval_time": "12m",
                 "exp_samples": [{"labels": f"{{{labels}}}", "value": want}]}
                for range_, want in (("1h", 2), ("9m", 1))
            ],
        }],
    }  # fmt: skip
    path = tmp_path / "panel.test.yml"
    path.write_text(yaml.safe_dump(spec))
    result = run_promtool("test", "rules", path.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


#: A path the docs cite from the repository root (``tests/unit/test_x.py``, ``src/...``,
#: ``deploy/compose/``), optionally with a test (``::test_name``); not part of a URL.
CITED_PATH = re.compile(
    r"(?<![\w/.:-])((?:tests|src|benchmarks|scripts|examples|deploy)/[\w/.-]*\w)(?:::(\w+))?"
)
#: A relative markdown link: ``[text](performance.md#anchor)``, ``(../deploy/README.md)``.
RELATIVE_LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)(?:#[^)]*)?\)")


def test_every_file_the_docs_cite_exists() -> None:
    """README.md, tests/README.md, docs/ and the deployment READMEs name test, source,
    benchmark, script, example and deploy files by path (and tests by ``::name``), and link
    each other: every one exists, so a reader following the docs finds the file."""
    root = Path(__file__).resolve().parents[2]
    docs = [root / "README.md", root / "tests" / "README.md", *root.glob("docs/*.md"),
            *root.glob("deploy/**/*.md")]
    missing = []
    for doc in docs:
        text = doc.read_text()
        where = doc.relative_to(root)
        for m in CITED_PATH.finditer(text):
            path, test = root / m.group(1), m.group(2)
            if not (path.exists() or (doc.parent / m.group(1)).exists()):
                missing.append(f"{where}: {m.group(1)}")
            elif test and not re.search(rf"^(?:async )?def {test}\(", path.read_text(), re.M):
                missing.append(f"{where}: {m.group(1)}::{test}")
        missing += [f"{where}: link {m.group(1)}" for m in RELATIVE_LINK.finditer(text)
                    if not (doc.parent / m.group(1)).exists()]
    assert not missing, f"docs cite files that do not exist: {missing}"


_NUMBER_WORDS = [
    *("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"),
    *("eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen"),
    *("eighteen", "nineteen", "twenty", "twenty-one", "twenty-two", "twenty-three"),
]


def test_operations_states_the_shipped_alert_count() -> None:
    """docs/operations.md's count of the shipped alerts is the rules file's, computed here."""
    text = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(r"`gradwatch\.alerts`: ([a-z-]+) alerts", text)
    assert m is not None, "docs/operations.md no longer states the number of alerts"
    assert m.group(1) == _NUMBER_WORDS[len(alerts())], (m.group(1), len(alerts()))
