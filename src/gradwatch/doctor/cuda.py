"""The doctor's CUDA agreement checks (``gradwatch doctor --device cuda --checks cuda``): what
the CUDA path promises and this project cannot test without a GPU.

* ``cuda[syncs]``: under ``torch.cuda.set_sync_debug_mode("error")``, a warm ``collect()``,
  ``clip_grad_norm_`` and ``result()`` on float32, bfloat16 and float64 gradients: zero
  synchronizations on the training thread.
* ``cuda[follow]``: ``GradWatch(model)`` then ``model.cuda()`` (the same Parameters): the
  packed vector lives on the GPU from the first collect on.
* ``cuda[bitwise]``: two replicas with identical gradients clip for 200 steps: every clip
  norm equal bit for bit (deterministic float64 sums, no atomics).
* ``cuda[capture]``: ``collect()`` inside CUDA graph capture is refused with a clear error.
* ``cuda[mixed]``, ``cuda[zero-fp16]``: gradients split between host and GPU, and DeepSpeed's
  fp16 loss scale: no synchronization, exact figures; ``cuda[late-peer]``: a clip's and
  guarded step's vector landing after ``collective_timeout_seconds`` is in flight, never a
  stop (:mod:`gradwatch.doctor.cuda_paths`).
* the optimizer-step guard's checks (:mod:`gradwatch.doctor.cuda_guard`):
  ``cuda[guard-scaler]``, ``cuda[deterministic]``, ``cuda[first-skip]``.
* ``cuda[rank-timing]``: rank timing's CUDA-event clock measures the GPU's working time with
  no synchronization (:mod:`gradwatch.doctor.cuda_timing`).

On a machine without CUDA each is a SKIP.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradwatch.config import WatchConfig
from gradwatch.doctor.cuda_guard import guard_checks
from gradwatch.doctor.cuda_paths import (
    check_cuda_late_peer,
    check_cuda_mixed,
    check_cuda_zero_fp16,
)
from gradwatch.doctor.cuda_timing import check_cuda_rank_timing
from gradwatch.doctor.options import FAIL, PASS, SKIP, Check
from gradwatch.errors import GradWatchError
from gradwatch.reduce.collective import capture_window
from gradwatch.watcher import GradWatch

#: Clip steps compared bit for bit across the two replicas.
BITWISE_STEPS = 200


def _config() -> WatchConfig:
    return WatchConfig(port=None, history_path=None, every_n_steps=1)


def _model(dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 8)).to(device, dtype)


def _backward(model: nn.Module, dtype: torch.dtype, device: torch.device, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(16, 64, generator=g).to(device, dtype)
    model.zero_grad(set_to_none=True)
    model(x).float().square().sum().backward()


def check_cuda_syncs(device: torch.device) -> Check:
    threshold = "0 synchronizations in collect() + clip_grad_norm_ + result()"
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        model = _model(dtype, device)
        with GradWatch(model, _config()) as watch:
            for step in range(3):  # warm: plans built, patterns seen
                _backward(model, dtype, device, step)
                watch.clip_grad_norm_(1.0, step=step)
                watch.last  # noqa: B018 - the cached result, no read
            _backward(model, dtype, device, 10)
            torch.cuda.synchronize(device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                watch.clip_grad_norm_(1.0, step=10)
                pending = watch.collect(11)
                pending.result()
            except RuntimeError as exc:  # the sync debug mode's error, or the unmeasured step
                return Check("cuda[syncs]", FAIL, f"{dtype}: {exc}", threshold)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    return Check("cuda[syncs]", PASS, "0 synchronizations (fp32, bf16, fp64)", threshold)


def check_cuda_follow(device: torch.device) -> Check:
    threshold = "the packed vector on the gradients' GPU after model.cuda()"
    model = _model(torch.float32, "cpu")
    with GradWatch(model, _config()) as watch:
        model.to(device)  # the same Parameter objects, moved
        _backward(model, torch.float32, device, 0)
        watch.collect(0).result()
        where = watch._reducer.device
    ok = where.type == device.type
    return Check("cuda[follow]", PASS if ok else FAIL, f"packed vector on {where}", threshold)


def check_cuda_bitwise(device: torch.device) -> Check:
    threshold = f"{BITWISE_STEPS} clip norms equal bit for bit across two replicas"
    replicas = [_model(torch.float32, device) for _ in range(2)]
    watches = [GradWatch(m, _config()) for m in replicas]
    try:
        for step in range(BITWISE_STEPS):
            totals = []
            for model, watch in zip(replicas, watches, strict=True):
                _backward(model, torch.float32, device, step)
                totals.append(watch.clip_grad_norm_(0.5, step=step))
            if not torch.equal(totals[0], totals[1]):
                return Check("cuda[bitwise]", FAIL, f"step {step}: {totals}", threshold)
    finally:
        for watch in watches:
            watch.close()
    return Check("cuda[bitwise]", PASS, f"{BITWISE_STEPS} equal", threshold)


def check_cuda_capture(device: torch.device) -> Check:
    threshold = (
        "collect() inside CUDA graph capture refused with a clear error; a global-mode "
        "capture inside capture_window() with a result in flight succeeds"
    )
    model = _model(torch.float32, device)
    with GradWatch(model, _config()) as watch:
        _backward(model, torch.float32, device, 0)
        watch.collect(0).result()
        in_flight = watch.collect(1)  # its landing waits while the window is open
        graph = torch.cuda.CUDAGraph()
        refused = None
        try:
            with capture_window(), torch.cuda.graph(graph):  # capture_error_mode="global"
                try:
                    watch.collect(2)
                except GradWatchError as exc:
                    refused = str(exc)
        except RuntimeError as exc:  # the capture itself failed: something ran that must not
            return Check("cuda[capture]", FAIL, f"capture broke: {exc}", threshold)
        in_flight.result()
    if refused is None:
        return Check("cuda[capture]", FAIL, "collect() ran inside the capture", threshold)
    return Check("cuda[capture]", PASS, "refused", threshold)


def cuda_checks(device: torch.device) -> list[tuple[str, Callable[[], Check]]]:
    """The CUDA agreement checks on ``device``; each a SKIP off CUDA."""
    named: list[tuple[str, Callable[[torch.device], Check]]] = [
        ("cuda[syncs]", check_cuda_syncs),
        ("cuda[follow]", check_cuda_follow),
        ("cuda[bitwise]", check_cuda_bitwise),
        ("cuda[capture]", check_cuda_capture),
        *guard_checks(),
        ("cuda[mixed]", check_cuda_mixed),
        ("cuda[zero-fp16]", check_cuda_zero_fp16),
        ("cuda[late-peer]", check_cuda_late_peer),
        ("cuda[rank-timing]", check_cuda_rank_timing),
    ]
    if device.type != "cuda":
        return [
            (name, lambda name=name: Check(name, SKIP, "no CUDA device", "CUDA only"))
            for name, _ in named
        ]
    return [(name, lambda f=f: f(device)) for name, f in named]
