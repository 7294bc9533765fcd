"""Shared test fixtures: op/sync counting and the e2e-must-not-skip guard."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

_skipped_e2e: list[str] = []


class OpCounter(TorchDispatchMode):
    """Counts every dispatched aten op, host reads (`_local_scalar_dense`) and c10d collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def scalar_reads(self) -> int:
        return self.ops["aten._local_scalar_dense"]

    @property
    def collectives(self) -> int:
        return sum(n for name, n in self.ops.items() if name.startswith("c10d"))


@contextmanager
def count_host_reads() -> Iterator[Counter[str]]:
    """Counts bulk host reads that a dispatch mode cannot see (`tolist`, `numpy`, `item`)."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "item")}

    def wrap(name: str):  # type: ignore[no-untyped-def]
        original = originals[name]

        def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return original(self, *args, **kwargs)

        return counted

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "e2e" in report.keywords:
        _skipped_e2e.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_e2e and os.environ.get("REQUIRE_E2E") == "1":
        print(f"\nREQUIRE_E2E=1 but {len(_skipped_e2e)} e2e test(s) were skipped:")
        for nodeid in _skipped_e2e:
            print(f"  {nodeid}")
        session.exitstatus = 1
