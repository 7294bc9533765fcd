"""No rank stops alone: a clip's or guarded step's vector whose copy to the host has not landed
within ``collective_timeout_seconds`` is *in flight* (it lands when the late rank arrives),
never a reason to stop collecting on the rank that read it; and every rank tells a step
mismatch from the reduced vector alone, the same way."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from layout_reference import build_layout

from gradwatch.analysis.reporter import Reporter
from gradwatch.errors import GradWatchTimeoutError
from gradwatch.reduce.layout import piece_of
from gradwatch.reduce.packing import Reducer
from gradwatch.reduce.reduced import ReducedVector
from gradwatch.reduce.sections import sections
from gradwatch.reduce.steps import step_residues
from gradwatch.step.failures import Failures


def _reducer() -> Reducer:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    return Reducer([piece_of(f"p{i}", p) for i, p in enumerate(params)], version="v",
                   config_hash="c", timeout_seconds=0.05)


def _not_landed(reducer: Reducer, step: int) -> ReducedVector:
    """An accelerator vector whose pinned copy never lands (the CUDA path, on the CPU: a
    ``meta`` stand-in for the device tensor and a landing flag nobody sets)."""
    reduced = reducer.pack_and_reduce(torch.zeros(6, dtype=torch.float64), [True, True], step,
                                      with_replicas=False)
    reduced._pinned = reduced._packed.clone()
    reduced._packed = torch.zeros(reduced._packed.shape, dtype=torch.float64, device="meta")
    reduced._landed = threading.Event()
    return reduced


def test_a_late_landing_is_in_flight_and_stops_nothing() -> None:
    reducer = _reducer()
    failures = Failures(reducer, ["p0", "p1"], Reporter(0))
    reduced = _not_landed(reducer, 3)
    with pytest.raises(GradWatchTimeoutError) as raised:
        failures.reduced_stats(reduced, 3)
    assert getattr(raised.value, "in_flight", False), raised.value
    assert failures.broken is None  # the others' next all-reduces keep their partner
    reduced._landed.set()  # the late rank arrived: the same vector is read, measured
    assert reduced.stats().steps_agree(3)


def _world_vector(steps: tuple[int, ...]) -> ReducedVector:
    """The reduced vector of ``len(steps)`` ranks that collected ``steps`` (their sums)."""
    per_rank = [{"version": "v", "config": "c", "pieces": [["w", [2], ["whole"], 2]],
                 "stage": None}] * len(steps)
    layout = build_layout(per_rank, 0)
    at = sections(layout)
    packed = torch.zeros(layout.packed_length, dtype=torch.float64)
    packed[at.step] = float(sum(steps))
    packed[at.residues.start] = math.fsum(step_residues(s)[0] for s in steps)
    packed[at.residues.start + 1] = math.fsum(step_residues(s)[1] for s in steps)
    from gradwatch.reduce.collective import Pending

    return ReducedVector(packed, Pending(), 1.0, steps[0], layout)


@pytest.mark.parametrize(("steps", "unmeasured"), [((5, 5, 5), False), ((4, 5, 6), True)])
def test_every_rank_reads_a_step_mismatch_on_the_device(
    steps: tuple[int, ...], unmeasured: bool
) -> None:
    """Steps 4, 5, 6 sum to 3 x 5: the step slot alone would let the rank at step 5 clip and
    guard with a sum of three steps. The device step (what clip and guard read) is NaN on
    every rank alike, and the clip leaves the gradients alone."""
    reduced = _world_vector(steps)
    assert bool(reduced.device_unmeasured()) is unmeasured
    assert math.isnan(float(reduced.device_step())) is unmeasured
    assert reduced.stats().steps_differ is unmeasured
