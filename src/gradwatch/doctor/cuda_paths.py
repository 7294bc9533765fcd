"""The doctor's CUDA checks of the device paths a CPU run cannot show (``gradwatch doctor
--device cuda``): gradients split between host memory and the GPU, and DeepSpeed's fp16 loss
scale. Each is a SKIP without CUDA.

* ``cuda[mixed]``: a model with one layer on the CPU and the rest on the GPU (CPU embedding
  tables, partial offload): a warm ``collect()`` and ``result()`` under
  ``torch.cuda.set_sync_debug_mode("error")`` make no synchronization, and the figure equals a
  float64 reference (the host part is repaired on the host, joined by one non-blocking copy
  from pinned memory: :meth:`gradwatch.norms.stats.NormEngine._mixed`).
* ``cuda[zero-fp16]``: the per-rank pass of a DeepSpeed fp16 engine (its loss scale, a Python
  float, divided out of the squared norms) on GPU gradients, with a stand-in engine holding a
  scale of 1024: no synchronization, and the unscaled norm equals the float64 reference.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from gradwatch.config import WatchConfig
from gradwatch.doctor.options import FAIL, PASS, Check
from gradwatch.norms.bands import BANDS, norm_from_bands
from gradwatch.norms.stats import NormEngine
from gradwatch.step.collector import measure_local
from gradwatch.watcher import GradWatch

#: The stand-in fp16 loss scale of ``cuda[zero-fp16]`` (a power of two, as DeepSpeed's).
LOSS_SCALE = 1024.0


def _config() -> WatchConfig:
    return WatchConfig(port=None, history_path=None, every_n_steps=1)


def _reference(model: nn.Module, scale: float = 1.0) -> float:
    """Float64 reference: exact squares of every gradient element, ``math.fsum``, / scale."""
    squares = (
        float(x) ** 2
        for p in model.parameters()
        if p.grad is not None
        for x in p.grad.detach().double().flatten().tolist()
    )
    return math.sqrt(math.fsum(squares)) / scale


class _Split(nn.Module):
    """A CPU embedding table feeding layers on the GPU."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4)).to(device)
        self.device = device

    def backward(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = self.table(torch.randint(0, 100, (16,), generator=g))
        self.zero_grad(set_to_none=True)
        self.body(rows.to(self.device)).square().sum().backward()


def check_cuda_mixed(device: torch.device) -> Check:
    threshold = "0 synchronizations in a warm collect() + result(); |rel err| <= 1e-6"
    model = _Split(device)
    with GradWatch(model, _config()) as watch:
        for step in range(3):  # warm: plans built, patterns seen
            model.backward(step)
            watch.collect(step).result()
        model.backward(10)
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            snap = watch.collect(10).result()
        except RuntimeError as exc:  # the sync debug mode's error, or the unmeasured step
            return Check("cuda[mixed]", FAIL, str(exc), threshold)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    want = _reference(model)
    err = abs(snap.global_norm - want) / want
    status = PASS if err <= 1e-6 else FAIL
    return Check("cuda[mixed]", status, f"0 synchronizations, rel err {err:.1e}", threshold)


class _Fp16Engine:
    """What the per-rank pass reads of a DeepSpeed fp16 engine: its loss scale."""

    def loss_scale(self) -> float:
        return LOSS_SCALE


def check_cuda_zero_fp16(device: torch.device) -> Check:
    threshold = "0 synchronizations dividing out the fp16 loss scale; |rel err| <= 1e-6"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 8)).to(device)
    with GradWatch(model, _config()) as watch:
        resolved = dataclasses.replace(watch._resolved, zero=_Fp16Engine())
        engine = NormEngine()
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(device)
        model(x).square().sum().mul(LOSS_SCALE).backward()  # gradients carry the scale
        for _ in range(2):
            measure_local(resolved, engine, None, None)
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            _grads, sq, _plan, _scale = measure_local(resolved, engine, None, None)
            bands = sq.view(BANDS, -1).sum(dim=1)
        except RuntimeError as exc:
            return Check("cuda[zero-fp16]", FAIL, str(exc), threshold)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    got = norm_from_bands(*bands.tolist())
    want = _reference(model, LOSS_SCALE)
    err = abs(got - want) / want
    status = PASS if err <= 1e-6 else FAIL
    return Check("cuda[zero-fp16]", status, f"0 synchronizations, rel err {err:.1e}", threshold)
