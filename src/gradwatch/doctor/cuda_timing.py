"""The doctor's CUDA check of rank timing's device clock (``gradwatch doctor --device cuda``):
``cuda[rank-timing]``. A SKIP without CUDA (:func:`gradwatch.doctor.cuda.cuda_checks`).

A model on the GPU whose last layer's backward queues a GPU sleep of
:data:`WORK_SECONDS` (``torch.cuda._sleep``, calibrated with CUDA events) runs
:data:`STEPS` steps timed by :class:`~gradwatch.step.ranktimer.RankTimer` with its CUDA-event
clock, under ``torch.cuda.set_sync_debug_mode("error")``: no synchronization may happen
(events are recorded and ``query()``-ed, ``elapsed_time`` read only on completed pairs). After
the loop the check synchronizes itself (outside the timed code) and reads the rest: every step
after the first is measured, none dropped, and the median working time is the GPU's (at least
the sleep, at most 1.5x it plus 5 ms), where the host clock, which sees only the queuing, reads
less than half of it.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from gradwatch.doctor.cuda_paths import _cycles_for
from gradwatch.doctor.options import FAIL, PASS, Check
from gradwatch.step.ranktimer import RankTimer, cuda_clock

#: The GPU work queued in each step's backward, seconds.
WORK_SECONDS = 0.05
#: Timed steps (the first only learns which gradient arrives last).
STEPS = 10


def check_cuda_rank_timing(device: torch.device) -> Check:
    """``cuda[rank-timing]`` (see the module docstring)."""
    threshold = (f"{STEPS - 1} of {STEPS} steps measured by CUDA events, 0 dropped, median in "
                 f"[{WORK_SECONDS:g}s, 1.5x + 5 ms] of a {WORK_SECONDS:g}s GPU sleep, "
                 "0 synchronizations")
    cycles = _cycles_for(device, WORK_SECONDS)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 8)).to(device)
    model[2].register_full_backward_pre_hook(lambda _m, _g: torch.cuda._sleep(cycles))
    params = list(model.parameters())
    clock = cuda_clock(params)
    if clock is None:
        return Check("cuda[rank-timing]", FAIL, "no CUDA-event clock for GPU parameters",
                     threshold)
    timer = RankTimer(params, device=clock)
    x = torch.randn(16, 64, device=device)
    host: list[float] = []
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(STEPS):
            timer.start()
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            model(x).square().sum().backward()
            host.append(time.perf_counter() - started)
            timer.lap()
    except RuntimeError as exc:  # the sync debug mode's error
        return Check("cuda[rank-timing]", FAIL, f"synchronized: {exc}"[:200], threshold)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        timer.close()
    torch.cuda.synchronize(device)  # the check's own wait, outside the timed code
    clock.start()
    clock.lap(timer.window)
    measured = len(timer.window)
    median = timer.window.drain()
    host_median = statistics.median(host)
    shown = (f"{measured} steps measured, {clock.dropped} dropped, median "
             f"{median if median is None else round(median, 4)}s on the GPU, "
             f"{host_median:.4f}s on the host clock")
    ok = (measured == STEPS - 1 and clock.dropped == 0 and median is not None
          and WORK_SECONDS <= median <= 1.5 * WORK_SECONDS + 0.005
          and host_median < WORK_SECONDS / 2)
    return Check("cuda[rank-timing]", PASS if ok else FAIL, shown, threshold)
