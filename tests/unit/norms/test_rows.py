"""The row paths' shared parts: ``RowSquares`` (row norms squared and summed per owner) and
``FlatRows`` (one flat buffer of many tensors read in place as rows, the comm hook's layout),
against ``math.fsum`` of the exact values, and their op counts."""

from __future__ import annotations

import math

import pytest
import torch

from gradwatch.doctor.testing import OpCounter, count_host_reads
from gradwatch.norms.rows import ROW_NUMEL, FlatRows, RowSquares


def _fsum_squares(values: torch.Tensor) -> float:
    return math.fsum(x * x for x in values.double().tolist())


def _spans(sizes: list[int], owners: list[int], gap: int) -> list[tuple[int, int, int]]:
    """Tensors back to back, ``gap`` unowned elements after each (padding a buffer may hold)."""
    spans, at = [], 0
    for size, owner in zip(sizes, owners, strict=True):
        spans.append((at, size, owner))
        at += size + gap
    return spans


@pytest.mark.parametrize("gap", [0, 3])
def test_flat_rows_sum_each_owner_exactly(gap: int) -> None:
    """Pure rows, rows straddling two owners, the partial last row and unowned padding: each
    owner's figure is the float64 sum of its elements' squares (1e-6, the float32 rows'
    bound); the padding goes to the discard slot only."""
    gen = torch.Generator().manual_seed(3)
    sizes = [20 * ROW_NUMEL + 7, 3, 8 * ROW_NUMEL, 700, ROW_NUMEL - 1, 16 * ROW_NUMEL + 300]
    owners = [0, 1, 2, 0, 1, 2]
    spans = _spans(sizes, owners, gap)
    numel = spans[-1][0] + sizes[-1] + 11  # a partial last row
    buffer = torch.randn(numel, generator=gen) * torch.logspace(-3, 3, numel)
    rows = FlatRows(buffer, spans, discard=3)
    assert 0 < rows.loose.numel() < numel // 4  # both parts of the path are exercised
    into = torch.zeros(4, dtype=torch.float64)
    rows.add_squares(buffer, into)
    for owner in range(3):
        mine = torch.cat([buffer[a : a + n] for a, n, o in spans if o == owner])
        want = _fsum_squares(mine)
        assert abs(into[owner].item() - want) <= 1e-6 * want
    owned = sum(sizes)
    assert math.fsum(into[:3].tolist()) <= _fsum_squares(buffer) * (1 + 1e-6)
    if gap == 0 and owned == numel:
        assert into[3].item() == 0.0
    # New values in the same buffer are read through the view made at construction.
    buffer.mul_(2.0)
    again = torch.zeros(4, dtype=torch.float64)
    rows.add_squares(buffer, again)
    assert again[:3].tolist() == pytest.approx((4 * into[:3]).tolist(), rel=1e-6)


def test_flat_rows_nonfinite_stays_in_its_owner() -> None:
    buffer = torch.ones(6 * ROW_NUMEL)
    buffer[ROW_NUMEL + 5] = math.nan  # a pure row of owner 0
    buffer[2 * ROW_NUMEL + 7] = math.inf  # owner 1's, in a row straddling owners 0 and 1
    spans = [(0, 2 * ROW_NUMEL + 5, 0), (2 * ROW_NUMEL + 5, 2 * ROW_NUMEL - 5, 1)]
    spans.append((4 * ROW_NUMEL, 2 * ROW_NUMEL, 2))
    into = torch.zeros(4, dtype=torch.float64)
    FlatRows(buffer, spans, discard=3).add_squares(buffer, into)
    assert math.isnan(into[0].item()) and math.isinf(into[1].item())
    assert into[2].item() == pytest.approx(2 * ROW_NUMEL, rel=1e-6)


def test_flat_rows_ops_do_not_grow_with_tensors_and_never_read_the_host() -> None:
    totals = []
    for n in (4, 80):
        sizes = [ROW_NUMEL + 13 * i for i in range(n)]
        spans = _spans(sizes, [i % 3 for i in range(n)], 0)
        buffer = torch.randn(sum(sizes))
        rows = FlatRows(buffer, spans, discard=3)
        into = torch.zeros(4, dtype=torch.float64)
        with OpCounter() as ops, count_host_reads() as reads:
            rows.add_squares(buffer, into)
        assert ops.scalar_reads == 0 and sum(reads.values()) == 0
        totals.append(ops.total)
    assert totals[0] == totals[1] <= 7, totals


@pytest.mark.parametrize("csr", [False, True])
def test_row_squares_sum_per_owner(csr: bool) -> None:
    """Both summations (``index_add_``, the CSR product) add each row's square to its owner's
    slot on top of what the slot held, in float64."""
    gen = torch.Generator().manual_seed(5)
    owner = [2, 0, 2, 1, 2, 0]
    sums = RowSquares.build(owner, 3, torch.device("cpu"), csr)
    assert (sums.sum_rows is not None) == csr
    sums.norms.copy_(torch.rand(len(owner), generator=gen) * 1e3)
    into = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    sums.add_to(into)
    norms = sums.norms.tolist()
    for k, start in enumerate([1.0, 0.0, 0.5]):
        want = start + math.fsum(norms[j] ** 2 for j, o in enumerate(owner) if o == k)
        assert into[k].item() == pytest.approx(want, rel=1e-7)
