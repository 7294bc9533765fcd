"""Shared test fixtures: op/sync counting and the e2e-must-not-skip guard."""

from __future__ import annotations

import os

import pytest

from gradwatch.doctor.testing import OpCounter, count_host_reads

__all__ = ["OpCounter", "count_host_reads"]

# Compiling a fused kernel per layout takes seconds of CPU; the suite builds hundreds of
# layouts. Tests of the compiled kernels ask for them (compile_kernels="wait"); subprocesses
# the tests start inherit this.
os.environ.setdefault("GRADWATCH_COMPILE_KERNELS", "off")

_skipped_e2e: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "e2e" in report.keywords:
        _skipped_e2e.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_e2e and os.environ.get("REQUIRE_E2E") == "1":
        print(f"\nREQUIRE_E2E=1 but {len(_skipped_e2e)} e2e test(s) were skipped:")
        for nodeid in _skipped_e2e:
            print(f"  {nodeid}")
        session.exitstatus = 1
