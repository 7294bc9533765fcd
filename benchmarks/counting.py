"""Counting utilities for the benchmarks: gradwatch.testing's instruments, summarized.

:func:`measure_counts` runs a method once under :class:`~gradwatch.testing.OpCounter` and
:func:`~gradwatch.testing.count_host_reads`, and once under the profiler
(:func:`~gradwatch.testing.largest_allocation`), for the table's host syncs, ops and largest
temporary columns.
"""

from __future__ import annotations

from typing import Any

from gradwatch.testing import OpCounter, count_host_reads, largest_allocation

__all__ = ["OpCounter", "count_host_reads", "largest_allocation", "measure_counts"]


def measure_counts(fn: Any, allocations: bool = True) -> dict[str, Any]:
    """Runs ``fn()`` once under both counters (and once under the profiler) and returns host
    syncs, ops, largest temporary.

    Host syncs = scalar reads seen by the dispatch mode (``item``/``float``/``bool``) plus
    ``tolist``/``numpy`` calls (``item`` is counted once: it dispatches
    ``_local_scalar_dense``). ``largest_bytes``: the larger of the largest new op output seen
    by the dispatch mode and the profiler's largest per-op allocation.
    """
    with count_host_reads() as reads, OpCounter() as ops:
        fn()
    syncs = ops.scalar_reads + reads["tolist"] + reads["numpy"]
    inner = largest_allocation(fn) if allocations else 0
    return {
        "host_syncs": syncs,
        "ops": ops.total,
        "largest_bytes": max(ops.largest_bytes, inner),
        "largest_op": ops.largest_op,
        "collectives": ops.collectives,
        "collective_bytes": ops.collective_bytes,
    }
