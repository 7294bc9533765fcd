"""Deterministic float64 sums: no collect, clip or result adds by atomics.

On CUDA ``index_add_``, ``index_put_(accumulate=True)``, ``scatter_add_`` and
``scatter_reduce`` add in arrival order, so replicas holding equal gradients could compute clip
norms that differ in the last bits. The accelerators' paths (float64 gradients rescaled,
divergence slots, the clip, the host read) are driven here on the CPU under a dispatch mode
that records every op with its ``accumulate`` flag; the CPU-only row path of float32 gradients
(``index_add_`` or a sparse-CSR product, both sequential on a CPU) never runs on an
accelerator and is not part of it.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from layout_reference import build_layout
from torch.utils._python_dispatch import TorchDispatchMode

from gradwatch import GradWatch, WatchConfig
from gradwatch.norms.rescale import build_rescale_plan, rescaled_norms
from gradwatch.norms.rows import SegmentReduction
from gradwatch.norms.stats import NormEngine
from gradwatch.reduce.layout import LocalPiece
from gradwatch.reduce.packing import Reducer

#: Ops that accumulate in arrival order on CUDA.
ATOMIC = {"aten.index_add", "aten.index_add_", "aten.scatter_add", "aten.scatter_add_",
          "aten.scatter_reduce", "aten.scatter_reduce_", "aten.index_reduce",
          "aten.index_reduce_"}


class AccumulatingOps(TorchDispatchMode):
    """Records the dispatched ops that accumulate by atomics on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name in ATOMIC:
            self.seen.append(name)
        if name in ("aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
            accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
            if accumulate:
                self.seen.append(f"{name}(accumulate=True)")
        return func(*args, **kwargs)


def test_the_recorder_sees_what_it_forbids() -> None:
    with AccumulatingOps() as ops:
        x = torch.zeros(3, dtype=torch.float64)
        x.index_add_(0, torch.tensor([0, 0]), torch.ones(2, dtype=torch.float64))
        x.index_put_((torch.tensor([1]),), torch.ones(1, dtype=torch.float64), accumulate=True)
        x.scatter_reduce(0, torch.tensor([2]), torch.ones(1, dtype=torch.float64), "amax")
    assert len(ops.seen) == 3, ops.seen


def test_segment_reduction_is_exact_per_segment() -> None:
    rng = random.Random(0)
    for _ in range(30):
        length = rng.randint(0, 5000)
        order = list(range(length))
        rng.shuffle(order)
        cuts = sorted(rng.randint(0, length) for _ in range(rng.randint(0, 12)))
        segments = [order[a:b] for a, b in zip([0, *cuts], [*cuts, length], strict=True)]
        values = torch.rand(length, dtype=torch.float64) * 10.0 ** rng.randint(-30, 30)
        sums = SegmentReduction(segments, length, torch.device("cpu"))
        got, top = sums(values).tolist(), sums(values, "amax").tolist()
        for seg, s, m in zip(segments, got, top, strict=True):
            exact = math.fsum(values[i].item() for i in seg)
            assert abs(s - exact) <= 1e-14 * exact, (s, exact)
            assert m == max((values[i].item() for i in seg), default=0.0)


def test_segment_reduction_keeps_nan_and_inf_in_their_segment() -> None:
    values = torch.tensor([1.0, math.nan, 2.0, math.inf, 3.0], dtype=torch.float64)
    sums = SegmentReduction([[0, 1], [2, 3], [4], []], 5, torch.device("cpu"))
    got = sums(values).tolist()
    assert math.isnan(got[0]) and got[1] == math.inf and got[2:] == [3.0, 0.0]


def _rescaled_engine_watch(model: torch.nn.Module) -> GradWatch:
    watch = GradWatch(model, WatchConfig(port=None))
    # The accelerator's float64 path, on the CPU (stats.build_plan: rescale_float64).
    watch._collector.engine = NormEngine(rescale_float64=True)
    return watch


def test_collect_clip_and_result_never_accumulate_by_atomics() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(700, 300), torch.nn.Linear(300, 40), torch.nn.Linear(40, 3)
    ).double()
    model(torch.randn(5, 700, dtype=torch.float64)).square().sum().backward()
    exact = math.sqrt(math.fsum(
        x * x for p in model.parameters() for x in p.grad.flatten().tolist()  # type: ignore[union-attr]
    ))
    with _rescaled_engine_watch(model) as watch, AccumulatingOps() as ops:
        snap = watch.collect(0).result()
        total = watch.clip_grad_norm_(1e9, step=1)
        watch.flush()
    assert ops.seen == [], ops.seen
    assert abs(snap.global_norm - exact) <= 1e-12 * exact
    assert abs(float(total) - exact) <= 1e-12 * exact


def test_divergence_slots_sum_without_atomics() -> None:
    """Rank 1 of four replicas of three parameters: its slot holds the sum of its squares."""
    pieces = [LocalPiece(f"p{i}", (n,), ("whole",), n) for i, n in enumerate((3, 4, 5))]
    reducer = Reducer(pieces, version="v", config_hash="c", timeout_seconds=5.0)
    entries = [[f"p{i}", [n], ["whole"], n] for i, n in enumerate((3, 4, 5))]
    per_rank = [{"version": "v", "config": "c", "pieces": entries, "stage": None}] * 4
    reducer.layout = build_layout(per_rank, 1)
    reducer._plan_packing(reducer.layout)
    sq = torch.tensor([4.0, 9.0, 16.0] + [0.0] * 6, dtype=torch.float64)
    with AccumulatingOps() as ops:
        stats = reducer.pack_and_reduce(sq, [True] * 3, step=3, with_replicas=True).stats()
    assert ops.seen == [], ops.seen
    assert stats.replica_squares == [0.0, 29.0, 0.0, 0.0]


def _float64_tensors(device: torch.device) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(n, dtype=torch.float64, device=device) * s
            for n, s in ((70_000, 1e-160), (513, 1.0), (3_000_000, 1e150), (1, 2.0))]


def _rescaled(device: torch.device) -> list[Any]:
    tensors = _float64_tensors(device)
    plan = build_rescale_plan(tensors)
    return [rescaled_norms(plan, tensors).cpu() for _ in range(20)]


def test_rescaled_norms_repeat_bit_for_bit_on_the_cpu() -> None:
    runs = _rescaled(torch.device("cpu"))
    assert all(torch.equal(runs[0], r) for r in runs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_float64_norms_repeat_bit_for_bit() -> None:
    """The accelerator's float64 path, repeated: the same bits every run (no atomics)."""
    runs = _rescaled(torch.device("cuda"))
    assert all(torch.equal(runs[0].view(torch.int64), r.view(torch.int64)) for r in runs)
    sums = SegmentReduction([list(range(0, 200_000, 3)), list(range(1, 200_000, 3))], 200_000,
                            torch.device("cuda"))
    values = torch.rand(200_000, dtype=torch.float64, device="cuda")
    first = sums(values)
    assert all(torch.equal(first, sums(values)) for _ in range(20))
