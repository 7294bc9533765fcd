"""The doctor's CUDA checks of the optimizer-step guard, run on the CPU (their logic is
device-agnostic; ``gradwatch doctor --device cuda`` runs them on the GPU): each PASSes on this
code and FAILs, with its figure, on the behaviour it guards against."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradwatch.doctor import cuda_guard
from gradwatch.doctor.options import FAIL, PASS
from gradwatch.norms import stats
from gradwatch.step import guard

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _accelerator_row_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row sums by the CSR product, as on accelerators (the CPU adds small buckets by
    ``index_add_``, deterministic there)."""
    monkeypatch.setattr(stats, "CSR_MIN_ROWS", 1)


def test_every_guard_check_passes() -> None:
    for name, check in cuda_guard.guard_checks():
        result = check(CPU)
        assert result.status == PASS and result.name == name, result


def test_guard_scaler_fails_when_the_scaler_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    def bare(inner: torch.optim.Optimizer, found_inf: Any, grad_scale: Any) -> Any:
        return inner.step()  # found_inf and grad_scale lost

    monkeypatch.setattr(guard, "_step_with", bare)
    result = cuda_guard.check_guard_scaler(CPU)
    assert result.status == FAIL and "tensors differ" in result.measured, result


def test_deterministic_fails_on_a_median_with_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    def with_indices(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return rows.nanmedian(dim=1).values

    monkeypatch.setattr(guard, "_at_sorted", with_indices)
    result = cuda_guard.check_deterministic(CPU)
    assert result.status == FAIL and "aten.nanmedian" in result.measured, result


def test_first_skip_fails_with_an_uninitialized_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard, "_unset_momentum", lambda optimizer: False)
    result = cuda_guard.check_first_skip(CPU)
    assert result.status == FAIL and not result.measured.startswith("0 buffers"), result
