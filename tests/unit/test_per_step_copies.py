"""The warm per-step path builds no tensor from Python data and makes no blocking host copy:
the patterns that synchronize a CUDA device although no scalar is read (``torch.tensor(list)``
copied into a device vector waits for the whole backward). Checked on the CPU with
:class:`gradwatch.doctor.testing.BlockingCopyCounter`, which sees the same ops CUDA would run; the
reducer's device choice is checked as the pure function it is."""

from __future__ import annotations

import math

import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.doctor.testing import OpCounter, count_blocking_copies, count_host_reads
from gradwatch.reduce.packing import gradient_device, reducer_device


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(300, 400), nn.ReLU(), nn.Linear(400, 10), nn.Linear(10, 3))


def _backward(model: nn.Module, unused: bool) -> None:
    model.zero_grad(set_to_none=True)
    x = torch.randn(8, 300)
    out = model[1](model[0](x))
    out = model[2](out)
    out = (out if unused else model[3](out)).sum()
    out.backward()


def test_counter_sees_python_built_tensors_and_blocking_copies() -> None:
    vector = torch.zeros(4, dtype=torch.float64)
    with count_blocking_copies() as copies:
        vector[:2].copy_(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert copies.python_tensors == 1 and copies.blocking_copies == 1, copies.describe()
    with count_blocking_copies() as copies:
        vector[:2].copy_(torch.tensor([1.0, 2.0]), non_blocking=True)  # built, not blocking
        vector.fill_(3.0)
        vector[2:].copy_(vector[:2])  # device-side
    assert (copies.python_tensors, copies.blocking_copies) == (1, 0), copies.describe()


def _check_steps(watch: GradWatch, model: nn.Module, pattern: list[bool], first: int) -> list:
    """Collect one step per entry of ``pattern`` (True: the last layer gets no gradient),
    counting each collect; check every result against a float64 reference."""
    counted = []
    for step, unused in enumerate(pattern, start=first):
        _backward(model, unused)
        with count_blocking_copies() as copies, OpCounter() as ops, count_host_reads():
            pending = watch.collect(step)
        assert ops.scalar_reads == 0
        snap = pending.result()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        want = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        assert snap.step == step and math.isclose(snap.global_norm, want, rel_tol=1e-6)
        assert snap.groups["other"].tensors == len(grads) == (4 if unused else 6)
        counted.append(copies)
    return counted


def test_warm_collects_build_no_tensor_from_python_data_and_copy_nothing_blocking() -> None:
    torch.manual_seed(0)
    model = _model()
    watch = GradWatch(model, WatchConfig())
    try:
        _check_steps(watch, model, [False, False], 0)  # cold: plans and buffers
        for copies in _check_steps(watch, model, [False] * 4, 2):
            assert copies.total == 0, copies.describe()
    finally:
        watch.close()


def test_a_change_of_which_gradients_are_none_copies_nothing_blocking() -> None:
    """Unused parameters or MoE experts change which gradients are None: the plan's index lists
    are rebuilt on the host (on an accelerator they travel by one non-blocking copy from pinned
    memory, :func:`gradwatch.norms.rows.host_to_device`), the has-gradient flags of a pattern seen
    before come from the device; nothing blocks."""
    torch.manual_seed(0)
    model = _model()
    watch = GradWatch(model, WatchConfig())
    try:
        _check_steps(watch, model, [False, True], 0)
        for copies in _check_steps(watch, model, [False, True, False, True], 2):
            assert copies.blocking_copies == 0, copies.describe()
    finally:
        watch.close()


def test_reducer_device_follows_the_gradients_and_the_bound_device() -> None:
    cuda1, cuda0 = torch.device("cuda", 1), torch.device("cuda", 0)
    cpu = torch.device("cpu")
    # A single-process or gloo job with CUDA gradients reduces on their GPU (no copies).
    assert reducer_device(cuda1, None, None) == cuda1
    assert reducer_device(cuda1, "gloo", None) == cuda1
    # NCCL: the process group's bound device (device_id=) first, then the gradients'.
    assert reducer_device(cuda1, "nccl", cuda0) == cuda0
    assert reducer_device(cuda1, "nccl", None) == cuda1
    assert reducer_device(None, "gloo", None) == cpu
    assert reducer_device(None, None, None) == cpu
    params = [torch.empty(2, device="meta"), torch.empty(2)]
    assert gradient_device(params) is None


def test_foreach_scratch_is_bounded_by_splitting_huge_buckets() -> None:
    from gradwatch.norms.rows import foreach_splits

    # 1,000 tensors with one of 1B elements: one call would need 1,000 x 15,259 partial sums.
    numels = [1000] * 500 + [10**9] + [1000] * 499
    splits = foreach_splits(numels)
    covered = [i for part in splits for i in range(len(numels))[part]]
    assert covered == list(range(len(numels)))  # every tensor once, in order
    for part in splits:
        chunk = numels[part]
        scratch = len(chunk) * max(-(-n // 65536) for n in chunk)
        assert scratch <= 1 << 20 or len(chunk) == 1
    assert len(splits) <= 3
    assert foreach_splits([5] * 10) == [slice(0, 10)]  # small buckets stay one call
    assert foreach_splits([]) == []
