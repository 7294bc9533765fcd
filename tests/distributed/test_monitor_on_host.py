"""When one rank stops collecting under NCCL, the others' training must not stall: monitoring-only
collects all-reduce on a separate gloo group, issued off the training thread, while
``clip_grad_norm_`` keeps the job's backend. The same code path runs here on a gloo world (the
host path forced on): exact results, no collective on the training thread for a collect, one
for a clip, and a rank that stops collecting costs the others a ``GradWatchTimeoutError`` from
``result()`` after the timeout, with ``collect()`` itself returning at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import host_reduce_cases
import pytest
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("host_reduce")
    spawn_world(host_reduce_cases.worker, 2, (str(out),), timeout=150.0)
    results = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert "traceback" not in res, f"rank {rank}: {res['error']}\n{res['traceback']}"
    return results


def test_monitoring_collect_is_exact_and_off_the_training_thread(w2: list) -> None:
    for res in w2:
        assert res["host_group"] is True
        assert res["collect_collectives"] == 0
        assert abs(res["collect_norm"] - res["reference"]) <= 1e-6 * res["reference"]


def test_clip_keeps_the_jobs_backend(w2: list) -> None:
    for res in w2:
        # Created at the first clip, on every rank: no extra communicator before one is needed.
        assert res["device_group_before_clip"] is False
        assert res["device_group_after_clip"] is True
        assert res["clip_collectives"] == 1
        assert abs(res["clip_norm"] - res["reference"]) <= 1e-6 * res["reference"]
        assert res["clip_snapshot_norm"] == pytest.approx(res["clip_norm"], rel=1e-12)


def test_a_one_off_failure_recovers_on_the_host_path(w2: list) -> None:
    """The stand-in all-reduce of a failed collect takes the same (host) route as the others'
    monitoring collect, so the sequences stay aligned and the next step is measured."""
    for res in w2:
        assert res["failed_step"] == "GradWatchError"
        assert abs(res["recovered_norm"] - res["reference"]) <= 1e-6 * res["reference"]


def test_a_rank_that_stops_collecting_costs_a_timeout_not_a_stall(w2: list) -> None:
    res = w2[0]
    assert res["collect_seconds"] < 2.0  # the training thread never waits for the others
    assert res["result"].startswith("GradWatchTimeoutError"), res["result"]
    timeout = host_reduce_cases.TIMEOUT_S
    assert timeout * 0.5 <= res["result_seconds"] <= timeout * 3, res["result_seconds"]
