"""The catalog walk of the distributed configurations (2 gloo ranks): DDP, DDP with the
per-rank view, FSDP2. Each shows exactly the catalog metrics it can measure (what the others
cannot measure is absent from rank 0's endpoint and its tracker rows, None in its snapshot);
expectations and workers in tests/helpers/absent_cases.py, single process and disabled in
tests/unit/test_absent.py."""

from __future__ import annotations

from typing import Any

import absent_cases
import pytest
from absent_cases import EXPECTED_ABSENT, SNAPSHOT_FIELD, nan_or_none
from worlds import case_results, spawn_suite

from gradwatch.export.metrics import METRICS

pytestmark = [pytest.mark.distributed]

WORLD_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def w2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_suite(absent_cases.worker, "absent", 2, tmp_path_factory.mktemp("absent"),
                       WORLD_TIMEOUT)


@pytest.mark.timeout(WORLD_TIMEOUT + 60)
@pytest.mark.parametrize(
    ("case", "parallelism"),
    [("ddp", "ddp2"), ("ddp_rank_view", "ddp2"), ("fsdp2", "fsdp2x2")],
)
def test_catalog_walk(w2: list[dict[str, Any]], case: str, parallelism: str) -> None:
    rank0 = case_results(w2, case)[0]
    assert rank0["parallelism"] == parallelism
    absent = {m.name for m in METRICS} - set(rank0["present"])
    assert absent == EXPECTED_ABSENT[case]
    for metric, field in SNAPSHOT_FIELD.items():
        value = rank0["fields"][field]
        tag = "gradwatch/" + metric.removeprefix("gradwatch_")
        if metric in absent:
            assert nan_or_none(value), (metric, value)
            assert tag not in rank0["row_tags"], tag
        elif metric != "gradwatch_gradient_noise_scale":  # NaN while undefined, yet published
            assert value is not None and value == value, (metric, value)
            assert tag in rank0["row_tags"], tag


@pytest.mark.timeout(WORLD_TIMEOUT + 60)
def test_step_warnings_come_from_rank_0_only(w2: list[dict[str, Any]]) -> None:
    """Both ranks built the snapshots of a step without gradient and of a NaN step (result()
    on every rank): the warnings are rank 0's alone."""
    rank0, rank1 = case_results(w2, "ddp")
    assert any("no parameter has a gradient" in m for m in rank0["warnings"]), rank0["warnings"]
    assert any("non-finite gradients" in m for m in rank0["warnings"]), rank0["warnings"]
    quiet = [m for m in rank1["warnings"] if "gradient" in m]
    assert not quiet, quiet
