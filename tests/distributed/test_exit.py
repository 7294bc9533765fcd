"""A rank leaves after training while its last monitoring all-reduce is still in flight (its
peer joins that collect late): ``close()`` waits for it (bounded), so the process exits with
status 0, whether or not the job calls ``destroy_process_group()``. A gloo all-reduce still in
flight at exit can abort the process (``terminate called without an active exception``): the
job would end failed after training finished."""

from __future__ import annotations

import json
from pathlib import Path

import exit_cases
import pytest
from worlds import spawn_world

pytestmark = [pytest.mark.distributed]


@pytest.mark.parametrize("mode", ["exit", "destroy"], ids=["exit", "destroy_then_exit"])
def test_a_rank_exits_cleanly_after_its_last_all_reduce_completes(
    tmp_path: Path, mode: str
) -> None:
    # raises on a crash; through the interpreter's own teardown
    spawn_world(exit_cases.worker, 2, (str(tmp_path), mode), timeout=120.0, leave_at_once=False)
    res = json.loads(Path(tmp_path, "1.json").read_text())
    assert res["in_flight"] == 0
    assert res["close_seconds"] >= exit_cases.LATE_S  # it waited for the late peer


def test_a_with_block_ended_by_an_exception_does_not_wait_for_peers(tmp_path: Path) -> None:
    """The loop is failing: ``__exit__`` closes without waiting for a peer that may never
    come (the collective timeout is 30 s, the peer 2 s late)."""
    spawn_world(
        exit_cases.worker, 2, (str(tmp_path), "raise"), timeout=120.0, leave_at_once=False
    )
    res = json.loads(Path(tmp_path, "1.json").read_text())
    assert res["close_seconds"] < 0.5 * exit_cases.LATE_S
