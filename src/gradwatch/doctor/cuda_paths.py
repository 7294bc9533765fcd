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
* ``cuda[late-peer]``: a clip and guarded step whose vector lands after
  ``collective_timeout_seconds`` (a GPU sleep kernel ahead of it holds the stream, as an NCCL
  all-reduce waiting for a late rank does): its result raises an *in-flight* timeout, never a
  stop; the step is read once it lands, every later step is measured, and the clip norms and
  parameters equal, bit for bit, a twin run nobody held (a NaN step skipped by both).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
from torch import nn

from gradwatch.config import WatchConfig
from gradwatch.doctor.options import FAIL, PASS, Check
from gradwatch.errors import GradWatchError, GradWatchTimeoutError
from gradwatch.norms.bands import BANDS, norm_from_bands
from gradwatch.norms.stats import NormEngine
from gradwatch.snapshot import Snapshot
from gradwatch.step.collector import PendingSnapshot
from gradwatch.step.localpass import measure_local
from gradwatch.watcher import GradWatch

#: The stand-in fp16 loss scale of ``cuda[zero-fp16]`` (a power of two, as DeepSpeed's).
LOSS_SCALE = 1024.0
#: ``cuda[late-peer]``: the steps, the ``collective_timeout_seconds``, and how long the late
#: step's vector is held back (a straggler 5x past the timeout).
LATE_STEPS = 8
LATE_TIMEOUT_SECONDS = 0.2
LATE_HOLD_SECONDS = 1.0


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


class LatePeer(Protocol):
    """What holds a step's reduced vector back from the host, as a rank that reaches the
    all-reduce late does (the collective, and the copy behind it on the stream, wait for it)."""

    def hold(self) -> None:
        """Before the late step's clip: whatever that step enqueues lands late."""

    def held(self) -> None:
        """After the late step's clip and guarded step (its device views already read)."""

    def arrive(self) -> None:
        """The late rank arrives: the held vector lands."""


class StreamHold:
    """A late peer on one GPU: a ``torch.cuda._sleep`` kernel of ``seconds`` enqueued before
    the clip, so its kernels and the pinned copy behind them land late, as behind an NCCL
    all-reduce waiting for a straggler."""

    def __init__(self, device: torch.device, seconds: float) -> None:
        self._device, self._cycles = device, _cycles_for(device, seconds)

    def hold(self) -> None:
        with torch.cuda.device(self._device):
            torch.cuda._sleep(self._cycles)

    def held(self) -> None:
        return None

    def arrive(self) -> None:
        torch.cuda.synchronize(self._device)


def _cycles_for(device: torch.device, seconds: float) -> int:
    """Sleep cycles lasting about ``seconds`` on ``device``, measured with CUDA events."""
    probe = 1 << 20
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    per_cycle = start.elapsed_time(end) / 1e3 / probe
    return int(seconds / max(per_cycle, 1e-12))


def check_cuda_late_peer(device: torch.device, peer: LatePeer | None = None) -> Check:
    """A clip's and guarded step's vector held past ``collective_timeout_seconds``: in flight
    (its result raises an in-flight timeout), collection goes on, the held step is read once
    it lands, and every step's clip norm and the parameters equal an unheld twin's bit for bit
    (a NaN step after it skipped by both)."""
    threshold = (
        f"a clip + guard step held {LATE_HOLD_SECONDS:g}s past a {LATE_TIMEOUT_SECONDS:g}s "
        f"collective_timeout_seconds: in flight, 0 stops, {LATE_STEPS} steps measured, clip "
        "norms and parameters bitwise an unheld twin's"
    )
    peer = StreamHold(device, LATE_HOLD_SECONDS) if peer is None else peer
    late, nan_step = LATE_STEPS // 2, LATE_STEPS // 2 + 2
    cfg = WatchConfig(port=None, history_path=None, every_n_steps=1,
                      collective_timeout_seconds=LATE_TIMEOUT_SECONDS)
    runs = [_late_peer_run(device, cfg, peer if held else None, late, nan_step)
            for held in (True, False)]
    (norms, params, outcome, stopped, snaps), (twin_norms, twin_params, _, _, _) = runs
    differ = sum(not _same_bits(a, b) for a, b in zip(norms + params, twin_norms + twin_params,
                                                       strict=True))
    skipped = snaps[-1].skipped_steps.get("nonfinite", 0) if len(snaps) == LATE_STEPS else 0
    stop = "0 stops" if stopped is None else f"stopped: {stopped}"[:120]
    measured = (f"step {late}: {outcome}; {stop}; {len(snaps)} of "
                f"{LATE_STEPS} steps measured, {skipped} NaN step skipped, {differ} tensors "
                "differ from the twin")
    ok = (outcome == "in flight" and stopped is None and len(snaps) == LATE_STEPS
          and skipped == 1 and differ == 0)
    return Check("cuda[late-peer]", PASS if ok else FAIL, measured, threshold)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN norm equals the same NaN)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def _late_peer_run(
    device: torch.device, cfg: WatchConfig, peer: LatePeer | None, late: int, nan_step: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], str, str | None, list[Snapshot]]:
    """``LATE_STEPS`` steps of clip + fused SGD under the guard, step ``late`` held by
    ``peer`` (None: nothing held): the clip norms, the final parameters, how the held step's
    result was read, why collection stopped (None: it did not), the steps measured."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    norms: list[torch.Tensor] = []
    results: list[PendingSnapshot] = []
    outcome = "not held"
    with GradWatch(model, cfg) as watch:
        guarded = watch.guard(opt)
        for step in range(LATE_STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 32, generator=g).to(device)
            loss = model(x).square().mean() * (math.nan if step == nan_step else 1.0)
            loss.backward()
            if peer is not None and step == late:
                peer.hold()
            norms.append(watch.clip_grad_norm_(1.0, step=step).detach().clone())
            guarded.step()
            guarded.zero_grad()
            pending = watch._collector.latest
            if pending is not None and pending.step == step:  # else: collection stopped
                results.append(pending)
            else:
                pending = None
            if peer is not None and step == late:
                peer.held()
                outcome = "no result" if pending is None else _read_held(pending)
                peer.arrive()
        stopped = watch._collector.broken
        snaps = []
        for pending in results:
            try:
                snaps.append(pending.result())
            except GradWatchError:
                continue
    return norms, [p.detach().clone() for p in model.parameters()], outcome, stopped, snaps


def _read_held(pending: PendingSnapshot) -> str:
    """Read a held step's result: "in flight" when it raised an in-flight timeout."""
    try:
        pending.result()
    except GradWatchTimeoutError as exc:
        return "in flight" if getattr(exc, "in_flight", False) else "timeout, not in flight"
    except GradWatchError as exc:
        return f"{type(exc).__name__}: {exc}"[:120]
    return "read before it landed"
