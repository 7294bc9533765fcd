"""Instruments that prove gradwatch's cost claims, in its own tests and benchmarks or in yours.

* :class:`OpCounter`: a ``TorchDispatchMode`` that counts every dispatched aten op, host scalar
  reads (``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``bool(t)``), c10d
  collectives and their sizes (largest tensor argument of each), and the largest *new* op
  output (bytes): outputs that share storage with an input (views, in-place ops) are not
  allocations and are ignored.
* :func:`count_host_reads`: counts bulk host reads a dispatch mode cannot see
  (``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.item``).
* :class:`NondeterministicOps`: records every dispatched op that PyTorch refuses under
  ``torch.use_deterministic_algorithms(True)`` on CUDA, or lists as nondeterministic there,
  whatever device the ops run on (a CPU test proves the CUDA path's choice of ops).
* :func:`largest_allocation`: the largest allocation one op made, from ``torch.profiler``,
  which also sees memory allocated *inside* a kernel.
* :class:`BlockingCopyCounter` (:func:`count_blocking_copies`): the patterns that synchronize a
  CUDA device although no scalar is read, visible on a CPU too: a tensor built from Python data
  (``torch.tensor(list)``: ``aten.lift_fresh``; on CUDA its copy to the device is a blocking
  copy from pageable memory) and a copy that crosses between host and device, or copies such a
  Python-built tensor, without ``non_blocking=True`` (``copy_`` / ``_to_copy`` end in
  ``cudaStreamSynchronize`` then).

Example: ``with OpCounter() as ops: watch.collect(step).result()`` then ``ops.scalar_reads``,
``ops.collectives``, ``ops.total``. Test-time tools: they patch ``torch.Tensor`` methods
(``count_host_reads``) or intercept every op, so never leave them on in training.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "BlockingCopyCounter",
    "NondeterministicOps",
    "OpCounter",
    "count_blocking_copies",
    "count_host_reads",
    "largest_allocation",
]


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # sparse, meta, ... (NotImplementedError included)
        return None


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops, scalar host reads, collectives and the largest new output."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.largest_bytes = 0
        self.largest_op = ""
        self.collective_bytes = 0  # bytes of the tensors passed to c10d ops (their payload)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        self.ops[name] += 1
        flat_in, _ = tree_flatten((args, kwargs or {}))
        if name.startswith("c10d") and flat_in:
            # The size of the collective: its largest tensor argument (the all-reduced buffer,
            # the full all-gathered output, the full reduce-scattered input).
            sizes = [a.numel() * a.element_size() for a in flat_in if isinstance(a, torch.Tensor)]
            self.collective_bytes += max(sizes, default=0)
        out = func(*args, **(kwargs or {}))
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


#: Ops that ``torch.use_deterministic_algorithms`` documents as nondeterministic on CUDA
#: whatever their arguments (atomic adds in arrival order, or refused in deterministic mode).
_ALWAYS_NONDETERMINISTIC = frozenset(
    f"aten.{name}"
    for name in (
        "index_add", "index_add_", "index_reduce", "index_reduce_", "scatter_add",
        "scatter_add_", "scatter_reduce", "scatter_reduce_", "put", "put_", "histc",
        "embedding_bag", "_embedding_bag",
    )
)


class NondeterministicOps(TorchDispatchMode):
    """Records the ops that PyTorch refuses under ``torch.use_deterministic_algorithms(True)``
    on CUDA or documents as nondeterministic there (its docstring's two lists), as
    ``"aten.op: why"`` strings in :attr:`found`, on whatever device they run:

    * always: ``index_add``, ``index_reduce``, ``scatter_add``, ``scatter_reduce``, ``put``,
      ``histc``, ``embedding_bag``;
    * ``median`` / ``nanmedian`` with a ``dim`` (indices output), ``cumsum`` of floating or
      complex values, ``scatter`` of a tensor ``src`` or with ``reduce``, ``bincount`` with
      ``weights``, ``index_put`` with ``accumulate=True``;
    * ``index_copy`` and ``index_put`` (``accumulate=False``) with a repeated index: which
      write wins is unordered (distinct indices are deterministic).
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        why = _nondeterministic(str(func.overloadpacket), func._overloadname, args, kwargs)
        if why is not None:
            self.found.append(f"{func.overloadpacket}: {why}")
        return func(*args, **kwargs)


def _nondeterministic(name: str, overload: str, args: Any, kwargs: dict[str, Any]) -> str | None:
    """Why ``name.overload`` called with ``args`` is nondeterministic on CUDA (None: it is not)."""
    if name in _ALWAYS_NONDETERMINISTIC:
        return "atomic accumulation (or refused) on CUDA"
    if name in ("aten.median", "aten.nanmedian") and overload != "default":
        return "median with indices output (refused on CUDA in deterministic mode)"
    if name in ("aten.cumsum", "aten.cumsum_"):
        dtype = kwargs.get("dtype") or args[0].dtype
        if dtype.is_floating_point or dtype.is_complex:
            return "cumsum of floating-point values (refused on CUDA in deterministic mode)"
    if name in ("aten.scatter", "aten.scatter_") and (
        "src" in overload or "reduce" in overload or "reduce" in kwargs
    ):
        return "scatter of a tensor src or with reduce on CUDA"
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    if name == "aten.bincount" and weights is not None:
        return "bincount with weights (refused on CUDA in deterministic mode)"
    if name in ("aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if accumulate:
            return "index_put with accumulate=True"
        if any(_repeats(i) for i in args[1] if isinstance(i, torch.Tensor)):
            return "index_put with a repeated index"
    if name in ("aten.index_copy", "aten.index_copy_") and _repeats(args[2]):
        return "index_copy with a repeated index"
    return None


def _repeats(index: torch.Tensor) -> bool:
    """Does the integer ``index`` name some position twice (a bool mask never does)?"""
    if index.dtype == torch.bool or index.numel() < 2:
        return False
    return bool(index.flatten().unique().numel() < index.numel())


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


def largest_allocation(fn: Any) -> int:
    """Largest memory (bytes) one op allocated while ``fn()`` ran, from ``torch.profiler`` with
    ``profile_memory=True``. Unlike :class:`OpCounter` it also sees allocations made *inside*
    an op's kernel (e.g. the float32 copy ``vector_norm(bf16, dtype=torch.float32)`` makes)."""
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_banners(), profile(
        activities=[ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    return max((max(0, e.cpu_memory_usage) for e in prof.events()), default=0)


#: Prefixes of the lines the profiler's native library (kineto) writes to the process's stderr
#: on every start and stop, whatever ``KINETO_LOG_LEVEL`` says.
_PROFILER_BANNERS = (b"USDT:", b"STAGE:")


@contextmanager
def _without_profiler_banners() -> Iterator[None]:
    """Hold file descriptor 2 in a temporary file while the profiler runs, then write back
    everything but the profiler's banner lines: what the caller prints stays its own."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held if not line.startswith(_PROFILER_BANNERS)]
            if kept:
                with contextlib.suppress(OSError):
                    os.write(2, b"".join(kept))


class BlockingCopyCounter(TorchDispatchMode):
    """Counts tensors built from Python data and blocking host<->device copies (see the module
    docstring); :meth:`describe` names the ops, for a failing test's message."""

    def __init__(self) -> None:
        super().__init__()
        self.python_tensors = 0
        self.blocking_copies = 0
        self.seen: Counter[str] = Counter()
        self._fresh: set[int] = set()  # storages of tensors built from Python data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        out = func(*args, **kwargs)
        if name in ("aten.lift_fresh", "aten.lift_fresh_copy"):
            self.python_tensors += 1
            self.seen[name] += 1
            ptr = _storage_ptr(out)
            if ptr is not None:
                self._fresh.add(ptr)
        elif name in ("aten.copy_", "aten._to_copy"):
            src = args[1] if name == "aten.copy_" else args[0]
            if name == "aten.copy_":
                dst_device = args[0].device
            else:
                dst_device = kwargs.get("device") or src.device
            non_blocking = bool(
                args[2] if name == "aten.copy_" and len(args) > 2 else kwargs.get("non_blocking")
            )
            crosses = (src.device.type == "cpu") != (torch.device(dst_device).type == "cpu")
            if not non_blocking and (crosses or _storage_ptr(src) in self._fresh):
                self.blocking_copies += 1
                self.seen[f"{name} from {src.device} to {dst_device}"] += 1
        return out

    @property
    def total(self) -> int:
        return self.python_tensors + self.blocking_copies

    def describe(self) -> str:
        return ", ".join(f"{k} x{n}" for k, n in sorted(self.seen.items()))


def count_blocking_copies() -> BlockingCopyCounter:
    """``with count_blocking_copies() as copies: watch.collect(step)`` then ``copies.total``."""
    return BlockingCopyCounter()
