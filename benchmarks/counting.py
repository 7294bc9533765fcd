"""Counting utilities for the benchmarks (kept apart from tests/conftest.py on purpose).

* :class:`OpCounter`: a ``TorchDispatchMode`` that counts every dispatched aten op, host scalar
  reads (``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)``), c10d
  collectives, and the largest *new* op output (bytes) seen: outputs that share storage with
  an input (views, in-place ops) are not allocations and are ignored.
* :func:`count_host_reads`: counts bulk host reads a dispatch mode cannot see
  (``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.item``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # sparse, meta, ...
        return None


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops, scalar host reads, collectives and the largest new output."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.largest_bytes = 0
        self.largest_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        self.ops[name] += 1
        out = func(*args, **(kwargs or {}))
        flat_in, _ = tree_flatten((args, kwargs or {}))
        in_ptrs = {
            _storage_ptr(a)
            for a in flat_in
            if isinstance(a, torch.Tensor) and a.layout == torch.strided
        }
        flat_out, _ = tree_flatten(out)
        for o in flat_out:
            if not isinstance(o, torch.Tensor) or o.layout != torch.strided:
                continue
            if _storage_ptr(o) in in_ptrs:
                continue  # view or in-place: no new memory
            nbytes = o.untyped_storage().nbytes()
            if nbytes > self.largest_bytes:
                self.largest_bytes = nbytes
                self.largest_op = name
        return out

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
    """Counts ``tolist``/``numpy``/``item`` calls on tensors while active."""
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "item")}

    def wrap(name: str) -> Any:
        original = originals[name]

        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
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


def measure_counts(fn: Any) -> dict[str, Any]:
    """Runs ``fn()`` once under both counters and returns host syncs, ops, largest temp.

    Host syncs = scalar reads seen by the dispatch mode (``item``/``float``/``bool``) plus
    ``tolist``/``numpy`` calls (``item`` is counted once: it dispatches
    ``_local_scalar_dense``).
    """
    with count_host_reads() as reads, OpCounter() as ops:
        fn()
    syncs = ops.scalar_reads + reads["tolist"] + reads["numpy"]
    return {
        "host_syncs": syncs,
        "ops": ops.total,
        "largest_bytes": ops.largest_bytes,
        "largest_op": ops.largest_op,
        "collectives": ops.collectives,
    }
