"""Squared norms of CPU float32/bf16/fp16 gradients by one compiled float64-accumulating loop.

The kernel, :func:`squares_kernel`, is ``torch.cat([t.double().reshape(1, -1).square()
.sum(dim=1) for t in tensors])`` compiled by inductor (:mod:`gradwatch.norms.kernels`) for one
layout of tensors:
one C++ function that reads each element once in its own dtype (bf16/fp16 are widened in
registers, never copied), squares it in float64 and adds it to a vectorized float64
accumulator per tensor. Nothing else is allocated but the output.

Exactness, over the whole float32 range: a float32, bf16 or fp16 value has at most 24
significant bits, so its square (at most 48 bits) is exact in float64, and its exponent
(float32: 2^-149 to 2^128) squares to within 2^-298 to 2^256, inside float64's normal range:
no square overflows, underflows or rounds. The sum of ``n`` such squares in float64 has a
relative error of at most about ``n / lanes * 2^-53`` (each lane of the accumulator adds ``n /
lanes`` terms in sequence): below 1e-9 up to 10^8 elements per lane, far under the 1e-6 the
engine guarantees. A NaN element makes the sum NaN, an Inf one +Inf (squares are never
negative, so no Inf - Inf). And every such norm is at least 2^-149 (or 0) and at most
``sqrt(n) * 2^128``, inside the bands' plain range ``[2^-450, 2^450]``
(:mod:`gradwatch.norms.bands`): the kernel's squares go straight into the plain band, with no
repair and no host read.

:class:`FusedNorms` is the part of a :class:`~gradwatch.norms.stats.NormPlan` the kernel norms:
its tensors in chunks of at most :data:`FUSED_CHUNK` (compile time grows with the tensors of a
layout; chunks of equal layout share one kernel), each chunk's kernel looked up in the
engine's :class:`~gradwatch.norms.kernels.KernelCache` until every chunk's is ready.

:class:`NarrowRows` is the other kernel: the float32 row norms of a bf16/fp16 bucket's
row-path tensors (:func:`row_norms_kernel`), what the eager rows compute after widening each
tensor into a float32 scratch, read in place instead: the engine squares, sums and repairs
them as the eager rows' (the same 1e-6 bound, not this module's exactness).

Sync behaviour: none (CPU tensors, no host read). The kernels are compiled by
:func:`~gradwatch.norms.kernels.compile_traced`: no dynamo, no guards, so a call costs a few
microseconds whatever the tensor count, and a kernel called with another layout would read
the wrong memory. What the compiled code assumes of each tensor is its dtype, shape and
strides, and that it is a plain tensor with data in CPU memory (its storage offset is in the
data pointer it is passed, and inductor's CPU loops load unaligned; ``requires_grad`` is
never read: calls run under ``no_grad``). The plan's per-step key checks dtype and shape of
every gradient; :meth:`FusedNorms.add_to` checks the strides, the device and the data (no
autograd zero tensor, whose pointer is null) of the tensors it passes, and raises
:class:`~gradwatch.norms.rows.StalePlan` before any call on a mismatch (the engine plans
again, and the new layout compiles off the calling thread).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradwatch.norms.bands import BANDS
from gradwatch.norms.kernels import KernelCache, compiled_calls_allowed, tensor_layout
from gradwatch.norms.rows import StalePlan

#: Tensors of at least this many elements are normed by the kernel; smaller ones stay in the
#: pack buffer, whose copy into a cache-sized buffer and float32 rows cost less than the
#: kernel's float64 loop there. Where the pack's copy costs more than the loop (measured, one
#: thread, the engine alone against torch's norm, interleaved: 1,000 x 4,096 float32 0.96x
#: compiled against 0.74x packed, 1,000 x 8,192 0.91x / 0.89x, 1,000 x 10,000 0.95x / 1.07x,
#: 1,000 x 12,000 1.00x / 1.05x).
FUSED_MIN_NUMEL = 8193
#: Tensors per compiled kernel. A guard-free call costs the same per tensor in one chunk or
#: several (one chunk of 1,000 measured no faster), but compiling a layout costs seconds plus
#: tens of milliseconds per tensor (docs/design.md): chunks bound one compile and what a layout
#: change recompiles, and equal chunks (a model's repeated blocks) share one kernel.
FUSED_CHUNK = 128
#: The dtypes the kernel norms. bf16/fp16 compile and are exact too, but their float64 loop
#: (a widening to four float64 vectors per 32 elements) measured about 2x slower than the eager
#: rows on this project's machines (AMD EPYC, AVX-512), guards or not: 48 x 1M bf16 17.0 ms
#: against 8.7 ms (squaring in float32 first: the same).
FUSED_DTYPES: tuple[torch.dtype, ...] = (torch.float32,)

def squares_kernel(tensors: list[Tensor]) -> Tensor:
    """``||t||^2`` of each of ``tensors``, accumulated in float64: a float64 vector. Compiled,
    one loop per tensor reading it once."""
    # Through float32 (exact): inductor's vector conversion bf16 -> float32 -> float64 is
    # faster than its direct bf16 -> float64 one (1.2 ms against 1.8 ms on 40 x 70,001).
    # Each sum over dim 1 of a one-row view, concatenated: inductor then writes every sum
    # straight into the output (a stack of 0-d sums allocates a buffer per tensor and copies
    # each, about 0.4 us per tensor per call); the same loop, the same bits.
    return torch.cat(_row_sums(tensors))


def _row_sums(tensors: list[Tensor]) -> list[Tensor]:
    """Per tensor, ``||t||^2`` in float64 as a one-element vector (the sum of a one-row view:
    see :func:`squares_kernel`)."""
    return [t.to(torch.float32).to(torch.float64).reshape(1, -1).square().sum(dim=1)
            for t in tensors]


def banded_squares_kernel(tensors: list[Tensor]) -> Tensor:
    """:func:`squares_kernel` followed by the zeros of the high and low bands
    (:mod:`gradwatch.norms.bands`): the engine's whole banded vector, when the kernel norms
    every position of a plan in one chunk (no other op then builds or fills it)."""
    # One cat of every sum and the zeros: inductor writes each into the output itself (a cat
    # of the squares' cat would be a second buffer and a copy per call).
    return torch.cat([*_row_sums(tensors),
                      torch.zeros((BANDS - 1) * len(tensors), dtype=torch.float64)])


def fusable(t: Tensor) -> bool:
    """A tensor the kernel norms: a plain (no subclass: its memory is what the kernel reads)
    strided CPU tensor in memory of a :data:`FUSED_DTYPES` dtype and at least
    :data:`FUSED_MIN_NUMEL` elements."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
            and t.dtype in FUSED_DTYPES and t.numel() >= FUSED_MIN_NUMEL
            and not t._is_zerotensor())


class LayoutKey:
    """A chunk's :func:`~gradwatch.norms.kernels.tensor_layout` with its hash computed once
    (the cache is asked for it on every call until the kernel is ready)."""

    __slots__ = ("_hash", "layout")

    def __init__(self, layout: tuple) -> None:
        self.layout = layout
        self._hash = hash(layout)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutKey) and other.layout == self.layout


def _example(layout: tuple) -> Callable[[], tuple]:
    """Arguments of ``layout`` for compiling (``empty_strided``: never the caller's tensors)."""

    def build() -> tuple:
        return ([torch.empty_strided(shape, stride, dtype=dtype, device=device)
                 .requires_grad_(grad) for dtype, device, shape, stride, grad in layout],)

    return build


@dataclass
class FusedChunk:
    """Up to :data:`FUSED_CHUNK` positions normed by one compiled call, into ``index``."""

    positions: list[int]
    index: Tensor  # the positions, on the CPU output
    key: Hashable
    example: Callable[[], tuple]
    strides: list[tuple[int, ...]]  # of the compiled layout: checked on every call
    kernel: Callable[..., Any] | None = None  # the traced kernel, once ready
    fn: Callable[[list[Tensor]], Tensor] = squares_kernel  # what the kernel computes


@dataclass
class FusedNorms:
    """The positions of a plan the compiled kernel norms, and its chunks. ``whole``: one
    chunk holds every position of the plan (none is None or normed otherwise), and its kernel
    is :func:`banded_squares_kernel`: :meth:`banded` is the plan's whole computation."""

    positions: list[int]
    chunks: list[FusedChunk] = field(default_factory=list)
    whole: bool = False

    @classmethod
    def build(cls, tensors: Sequence[Tensor | None], positions: list[int],
              kernels: KernelCache) -> FusedNorms:
        """Chunks of ``positions`` in order, each keyed by its layout; asks ``kernels`` for
        each, which starts compiling (``"background"``) or compiles now (``"wait"``)."""
        fused = cls(positions, whole=len(positions) == len(tensors) <= FUSED_CHUNK)
        for start in range(0, len(positions), FUSED_CHUNK):
            part = positions[start:start + FUSED_CHUNK]
            layout = tensor_layout([tensors[i] for i in part])
            fused.chunks.append(FusedChunk(
                part, torch.tensor(part, dtype=torch.long), LayoutKey(layout), _example(layout),
                [stride for _, _, _, stride, _ in layout],
                fn=banded_squares_kernel if fused.whole else squares_kernel))
        fused.ready(kernels)
        return fused

    def ready(self, kernels: KernelCache) -> bool:
        """Whether every chunk's kernel is compiled (never waits in ``"background"``)."""
        done = True
        for chunk in self.chunks:
            if chunk.kernel is None:
                kernel = kernels.get(chunk.fn, chunk.key, chunk.example)
                if kernel is None:
                    done = False
                    continue
                chunk.kernel = kernel
        return done

    def add_to(self, plain: Tensor, tensors: Sequence[Tensor | None],
               verified: bool = False) -> None:
        """Writes each position's squared norm into ``plain`` (float64, on the CPU): one
        compiled call and one ``index_copy_`` per chunk.

        Raises :class:`~gradwatch.norms.rows.StalePlan` before a chunk's call when one of its
        tensors has other strides than the compiled layout, left the CPU or has no memory (an
        autograd zero tensor, whose data pointer is null; the eager paths norm it): the plan's
        key, checked by the caller, holds their dtypes and shapes, and the traced kernel
        checks nothing and would read the wrong memory (about 0.2 us per tensor). Not checked
        again when ``verified`` (the plan's :class:`~gradwatch.norms.layout.LayoutGuard` held
        for these tensors: the same properties, in one call)."""
        for chunk in self.chunks:
            out = self._call(chunk, tensors, verified)
            plain.index_copy_(0, chunk.index, out[: len(chunk.positions)] if self.whole else out)

    def banded(self, tensors: Sequence[Tensor | None], verified: bool = False) -> Tensor:
        """The plan's whole banded vector (``whole`` plans only): one compiled call, the
        squares in the plain band and zeros in the others. Raises as :meth:`add_to`."""
        assert self.whole
        return self._call(self.chunks[0], tensors, verified)

    def _call(self, chunk: FusedChunk, tensors: Sequence[Tensor | None],
              verified: bool) -> Tensor:
        # A whole plan's one chunk is every tensor in order (the kernel copies the list)
        items = tensors if self.whole else [tensors[i] for i in chunk.positions]
        if not verified and ([t.stride() for t in items] != chunk.strides  # type: ignore[union-attr]
                             or not all(t.is_cpu and not t._is_zerotensor()  # type: ignore[union-attr]
                                        for t in items)):
            raise StalePlan
        assert chunk.kernel is not None
        return chunk.kernel(items)


def row_norms_kernel(rows: list[Tensor]) -> Tensor:
    """The float32 L2 norm of every row of each of ``rows`` (2-D bf16/fp16 views of whole rows),
    concatenated: what the eager rows compute (each element widened to float32, squared and
    summed in float32 per row), compiled to one loop per tensor that reads the narrow values
    in place, with no widened copy."""
    return torch.cat([torch.linalg.vector_norm(r.to(torch.float32), 2, dim=1) for r in rows])


@dataclass
class NarrowRows:
    """The row norms of a CPU bf16/fp16 bucket's row-path tensors by one compiled call of
    :func:`row_norms_kernel` (traced, no guards) into ``out``, their slice of the bucket's row
    norms. The figures are float32 row norms, as the eager widening's: the engine squares,
    sums and repairs them alike."""

    shapes: list[tuple[int, int]]  # (rows, row length) of each row-path tensor
    strides: list[tuple[int, ...]]  # of each tensor, as planned
    out: Tensor
    key: Hashable
    example: Callable[[], tuple]
    kernels: KernelCache
    kernel: Callable[..., Any] | None = None

    @classmethod
    def build(cls, shapes: list[tuple[int, int]], strides: list[tuple[int, ...]],
              dtype: torch.dtype, out: Tensor, kernels: KernelCache) -> NarrowRows:
        layout = tuple((dtype, torch.device("cpu"), shape, (shape[1], 1), False)
                       for shape in shapes)
        return cls(shapes, strides, out, LayoutKey(layout), _example(layout), kernels)

    def fill(self, positions: list[int], tensors: Sequence[Tensor | None],
             verified: bool = False) -> bool:
        """Writes the row norms of ``positions`` into ``out`` by the compiled kernel: False
        (nothing written; the eager rows run, and check the strides) when it is not ready,
        a dispatch mode is active, or a tensor's strides, device or data differ from the
        plan's (checked here unless ``verified``: the plan's guard held). The views passed are
        the eager rows' own (``as_strided`` rows of the tensor's memory, its storage offset
        included): their layout is the key's by construction."""
        if not compiled_calls_allowed():
            return False
        if self.kernel is None:
            self.kernel = self.kernels.get(row_norms_kernel, self.key, self.example)
            if self.kernel is None:
                return False
        views = []
        for i, shape, stride in zip(positions, self.shapes, self.strides, strict=True):
            t = tensors[i]
            if type(t) is not Tensor or (not verified and (
                    t.stride() != stride or not t.is_cpu or t._is_zerotensor())):
                return False
            views.append(t.as_strided(shape, (shape[1], 1)))
        self.out.copy_(self.kernel(views))
        return True
