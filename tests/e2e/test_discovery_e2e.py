"""End to end with a real Prometheus: discovery through ``file_sd_configs`` and exemplars.

* file_sd: Prometheus reads ``<dir>/*.json``; a job with ``file_sd_path=<dir>`` (and a Slurm
  job id in its environment) is scraped with its labels while it runs, and its target is gone
  once the job closed.
* exemplars: Prometheus with ``--enable-feature=exemplar-storage`` scrapes a job whose steps
  spike and go non-finite; ``/api/v1/query_exemplars`` returns, on the spike and non-finite
  counters, the exemplar of the step that increased them.

Every wait is bounded; Prometheus is stopped by its fixture, the jobs are closed here.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from deploy_assets import DASHBOARD
from promserver import PromServer, run_prometheus

from gradwatch import GradWatch, WatchConfig

pytestmark = pytest.mark.e2e


def dashboard_exemplar_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p["targets"] if t.get("exemplar")]
    assert len(queries) == 2
    return queries


def gradwatch_targets(prom: PromServer) -> list[dict[str, Any]]:
    return [t for t in prom.targets() if t["labels"].get("run_id", "").startswith("sd-")]


def test_file_sd_target_is_picked_up_and_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    targets = tmp_path / "targets"
    targets.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with run_prometheus([], file_sd_files=[str(targets / "*.json")]) as prom:
        net = torch.nn.Linear(3, 2)
        watch = GradWatch(
            net,
            WatchConfig(port=0, bind_address="127.0.0.1", run_id="sd-1", file_sd_path=targets),
        )
        try:
            net(torch.ones(1, 3)).sum().backward()
            watch.collect(5)
            assert watch.flush(30)
            (target,) = prom.wait_until(
                lambda: [t for t in gradwatch_targets(prom) if t["health"] == "up"],
                60,
                "the file_sd target scraped",
            )
            assert target["labels"]["slurm_job_id"] == "4242"
            assert target["scrapeUrl"].startswith("http://127.0.0.1:")
            prom.wait_for_value('gradwatch_step{slurm_job_id="4242",run_id="sd-1"}', 5.0, 30)
        finally:
            watch.close()
        assert list(targets.iterdir()) == []
        prom.wait_until(lambda: not gradwatch_targets(prom), 60, "the target dropped")


def test_exemplars_name_the_step_of_a_spike_and_of_a_nan(tmp_path: Path) -> None:
    net = torch.nn.Linear(4, 4)
    watch = GradWatch(
        net,
        WatchConfig(
            port=0,
            bind_address="127.0.0.1",
            groups={"layer": ["*"]},
            spike_window=16,
            spike_warmup=4,
        ),
    )
    start = time.time()
    try:
        port = watch._publishing.port
        with run_prometheus(
            [f"127.0.0.1:{port}"], flags=["--enable-feature=exemplar-storage"]
        ) as prom:
            spike, nan = 8, 11
            for step in range(13):
                for p in net.parameters():
                    p.grad = torch.full_like(p, 1000.0 if step == spike else 1.0 + step * 1e-3)
                if step == nan:
                    net.weight.grad[0, 0] = math.nan
                watch.collect(step)
                assert watch.flush(30)
            prom.wait_for_value("gradwatch_step", 12.0, 30)
            prom.wait_for_value("gradwatch_nonfinite_steps_total", 1.0, 30)

            def exemplars(metric: str) -> dict[str, list[dict[str, Any]]]:
                data = prom.api(
                    "query_exemplars",
                    query=metric,
                    start=repr(start - 60),
                    end=repr(time.time() + 60),
                )
                return {
                    s["seriesLabels"].get("group", ""): s["exemplars"]
                    for s in data
                    if s["exemplars"]
                }

            got = prom.wait_until(
                lambda: exemplars("gradwatch_nonfinite_steps_total"), 30, "NaN exemplar"
            )
            (ex,) = got[""]
            assert ex["labels"] == {"step": str(nan)} and float(ex["value"]) == 1.0
            assert start - 1 <= float(ex["timestamp"]) <= time.time() + 1
            got = prom.wait_until(
                lambda: exemplars("gradwatch_grad_norm_spikes_total"), 30, "spike exemplar"
            )
            assert [e["labels"] for e in got["layer"]] == [{"step": str(spike)}]
            got = exemplars("gradwatch_nonfinite_group_steps_total")
            assert [e["labels"] for e in got["layer"]] == [{"step": str(nan)}]
            # A counter the catalog does not mark carries none.
            assert exemplars("gradwatch_collections_total") == {}
            # The dashboard's exemplar-only queries (norm panels) return them too.
            for query in dashboard_exemplar_queries():
                data = prom.api(
                    "query_exemplars",
                    query=query.replace("$job", ".*").replace("$instance", ".*"),
                    start=repr(start - 60),
                    end=repr(time.time() + 60),
                )
                steps = {e["labels"]["step"] for series in data for e in series["exemplars"]}
                assert steps == {str(spike), str(nan)}, (query, got)
    finally:
        watch.close()
