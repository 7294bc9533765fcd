"""The "shapes" section: one collect against torch's own norm at every gradient shape.

Per shape (tensors x elements, one dtype): gradwatch's ``watch.collect(step).result()
.global_norm`` (host time per call, the norm read once) against torch's own norm read once,
``torch.nn.utils.get_total_norm(grads).item()`` for float32 and the float32-output
``_foreach_norm`` path for bfloat16 (plain ``get_total_norm`` rounds a bf16 norm to bf16, which
the 1e-6 exactness rules out). Both run in interleaved rounds in one process on the same
tensors, in steady state: the engine's compiled kernels (default ``compile_kernels``, built
off the training thread) are waited for before the rounds, and the table gives how long they
took from the first collect (inductor's on-disk cache makes a rerun on the same machine
faster). The ratio is of the best times (a shared machine's load only ever adds time, so the
best of N is the least disturbed figure of each), the medians are shown beside it. Each
norm's relative error is against a float64 reference computed once per shape (the exact
float64 squares of every element, summed per 64K-element chunk, the chunks by ``math.fsum``).
The section's last row: the host time of one ``watch.collect(step)`` call (nothing read) of
a 1,000-parameter model against one ``get_total_norm`` call (no ``.item()``)
(:class:`CollectCallResult`). Also runnable alone: ``python benchmarks/shapes.py
[--quick]`` prints both tables.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import Tensor

from benchmarks.cases import GradHolder, dtype_name, make_grads
from benchmarks.measure import ready_kernels
from benchmarks.results import Target, TargetCheck, Timing
from gradwatch.doctor import timing

#: every shape: collect() + result() at most this many times torch's own norm
SHAPES_TARGET = Target(1.25, "x")
#: and a relative error against float64 at most this
SHAPES_REL_ERROR = 1e-6
#: the known cause a miss links to (docs/benchmarks.md)
SHAPES_CAUSE = "Shapes"


@dataclass(frozen=True)
class Shape:
    """``n_tensors`` gradients of ``numel`` elements each, of ``dtype``."""

    n_tensors: int
    numel: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.n_tensors:,} x {self.numel:,} {dtype_name(self.dtype)}"


#: The shapes of ordinary models and of large checkpoints, float32 and bfloat16.
FULL_SHAPES = (
    Shape(10, 100_000, torch.float32),
    Shape(300, 30_000, torch.float32),
    Shape(1_000, 10_000, torch.float32),
    Shape(1_000, 10_000, torch.bfloat16),
    Shape(10_000, 1_000, torch.float32),
    Shape(100, 2_000_000, torch.float32),
    Shape(100, 2_000_000, torch.bfloat16),
)
#: Tiny sizes for the harness self-test (figures mean nothing).
QUICK_SHAPES = (Shape(10, 5_000, torch.float32), Shape(40, 70_001, torch.bfloat16))


@dataclass(frozen=True)
class ShapeResult:
    """One shape's figures: both methods' times, the ratio of their best times, the errors."""

    label: str
    baseline: str
    gradwatch: Timing
    torch: Timing
    gradwatch_error: float
    torch_error: float
    compile_s: float = 0.0  # first collect until the engine's kernels were ready

    @property
    def ratio(self) -> float:
        return min(self.gradwatch.samples) / min(self.torch.samples)

    @property
    def met(self) -> bool:
        return SHAPES_TARGET.met(self.ratio) and self.gradwatch_error <= SHAPES_REL_ERROR


def float64_reference(grads: Sequence[Tensor], chunk: int = 1 << 16) -> float:
    """``sqrt(math.fsum(...))`` of the exact float64 squares of every element (a float32 or
    bf16 value squares exactly in float64), summed in float64 per chunk of ``chunk`` elements
    (relative error about 1e-15 per chunk) and the chunk sums by ``math.fsum``: six orders
    of magnitude below the 1e-6 being checked, without a Python float per element."""
    partials = [
        float(piece.double().square().sum())
        for g in grads for piece in g.detach().reshape(-1).split(chunk)
    ]
    return math.sqrt(math.fsum(partials))


def torch_norm(grads: list[Tensor]) -> tuple[str, Callable[[], float]]:
    """torch's own norm of ``grads`` read once, and its name in the table."""
    if grads[0].dtype == torch.float32:
        return "get_total_norm(...).item()", lambda: torch.nn.utils.get_total_norm(grads).item()

    def foreach_f32() -> float:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).square().sum().sqrt().item()

    return "_foreach_norm(dtype=float32) + .item()", foreach_f32


def measure_shape(shape: Shape, rounds: tuple[int, int], budget_s: float) -> ShapeResult:
    """Both methods on one shape's gradients, interleaved, then each checked once."""
    from gradwatch import GradWatch, WatchConfig

    grads = make_grads([shape.numel] * shape.n_tensors, shape.dtype, seed=4)
    reference = float64_reference(grads)
    baseline, theirs = torch_norm(grads)
    with GradWatch(GradHolder(grads), WatchConfig()) as watch:

        def ours() -> float:
            return watch.collect(0).result().global_norm

        compile_s = ready_kernels(watch, ours)
        times = timing.interleaved({"gradwatch": ours, "torch": theirs}, rounds, budget_s)
        ours_error = abs(ours() - reference) / reference
    return ShapeResult(shape.label, baseline, Timing.of(times["gradwatch"]),
                       Timing.of(times["torch"]), ours_error,
                       abs(theirs() - reference) / reference, compile_s)


def measure(shapes: Sequence[Shape], rounds: tuple[int, int],
            budget_s: float) -> list[ShapeResult]:
    return [measure_shape(s, rounds, budget_s) for s in shapes]


def table(results: Sequence[ShapeResult]) -> str:
    rows = [[r.label, r.baseline, f"{min(r.gradwatch.samples) * 1e3:.3f}",
             f"{min(r.torch.samples) * 1e3:.3f}", f"{r.ratio:.2f}x",
             f"{r.gradwatch.median * 1e3:.3f} / {r.torch.median * 1e3:.3f}",
             f"{r.gradwatch_error:.1e}", f"{r.torch_error:.1e}", f"{r.compile_s:.1f}",
             "met" if r.met else "**NOT MET**"] for r in results]
    header = ["shape (tensors x elements)", "torch's norm", "gradwatch best ms",
              "torch best ms", "ratio (best)", "medians ms (gradwatch / torch)",
              "gradwatch rel err", "torch rel err", "kernels compiled in s",
              f"{SHAPES_TARGET}, <= 1e-6"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def checks(results: Sequence[ShapeResult]) -> list[TargetCheck]:
    """One targets-table row per shape."""
    return [TargetCheck(
        "norm cost", f"shape {r.label}: collect()+result() {SHAPES_TARGET} {r.baseline}, "
        f"rel err <= 1e-6", SHAPES_TARGET, r.ratio if r.gradwatch_error <= SHAPES_REL_ERROR
        else math.inf, f"{r.ratio:.2f}x, rel err {r.gradwatch_error:.0e}",
        f"medians {r.gradwatch.median * 1e3:.3f} / {r.torch.median * 1e3:.3f} ms",
        SHAPES_CAUSE) for r in results]


# -- the host time of one collect() --------------------------------------------------------

#: one ``collect()`` call of a 1,000-parameter model: host time at most this many times one
#: ``get_total_norm`` call on the same gradients
COLLECT_CALL_TARGET = Target(1.25, "x")
#: the 1,000-parameter model it is measured on, and the harness self-test's
COLLECT_CALL_SHAPE = Shape(1_000, 10_000, torch.float32)
QUICK_COLLECT_CALL_SHAPE = Shape(1_000, 100, torch.float32)


@dataclass(frozen=True)
class CollectCallResult:
    """Host time of ``watch.collect(step)`` alone (the call that queues a step on the training
    thread; nothing is read) against ``torch.nn.utils.get_total_norm(grads)`` alone (no
    ``.item()``), interleaved on the same gradients."""

    label: str
    collect: Timing
    torch: Timing

    @property
    def ratio(self) -> float:
        return min(self.collect.samples) / min(self.torch.samples)


def measure_collect_call(shape: Shape, rounds: tuple[int, int],
                         budget_s: float) -> CollectCallResult:
    """Both calls on one shape's gradients, interleaved (see :class:`CollectCallResult`)."""
    from gradwatch import GradWatch, WatchConfig

    grads = make_grads([shape.numel] * shape.n_tensors, shape.dtype, seed=5)
    with GradWatch(GradHolder(grads), WatchConfig()) as watch:
        ready_kernels(watch, lambda: watch.collect(0).result())
        times = timing.interleaved(
            {"collect": lambda: watch.collect(0),
             "torch": lambda: torch.nn.utils.get_total_norm(grads)}, rounds, budget_s)
    return CollectCallResult(shape.label, Timing.of(times["collect"]), Timing.of(times["torch"]))


def collect_call_table(r: CollectCallResult) -> str:
    rows = [[f"`watch.collect(step)`, {r.label}", f"{min(r.collect.samples) * 1e3:.3f}",
             f"{r.collect.median * 1e3:.3f}", f"{r.ratio:.2f}x",
             "met" if COLLECT_CALL_TARGET.met(r.ratio) else "**NOT MET**"],
            [f"`torch.nn.utils.get_total_norm(grads)`, {r.label}",
             f"{min(r.torch.samples) * 1e3:.3f}", f"{r.torch.median * 1e3:.3f}", "1.00x", ""]]
    header = ["call (host time, nothing read)", "best ms", "median ms", "ratio (best)",
              f"{COLLECT_CALL_TARGET}"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def collect_call_checks(r: CollectCallResult | None) -> list[TargetCheck]:
    """The targets-table row of the host time per collect (none when not measured)."""
    if r is None:
        return []
    return [TargetCheck(
        "norm cost", f"host time per `collect()` of a {r.label.split(' x ')[0]}-parameter "
        f"model ({r.label}): {COLLECT_CALL_TARGET} one `get_total_norm` call",
        COLLECT_CALL_TARGET, r.ratio, f"{r.ratio:.2f}x", f"medians {r.collect.median * 1e3:.3f}"
        f" / {r.torch.median * 1e3:.3f} ms", SHAPES_CAUSE)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (harness self-test)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds at most")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    rounds = (min(7, args.rounds), args.rounds)
    print(table(measure(shapes, rounds, 4.0)))
    call = QUICK_COLLECT_CALL_SHAPE if args.quick else COLLECT_CALL_SHAPE
    print("\n" + collect_call_table(measure_collect_call(call, rounds, 4.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
