"""The doctor's check of the compiled CPU kernels (``gradwatch doctor``): ``kernels``.

``compile_kernels`` (default ``"background"``) has CPU tensors normed, and optimizer updates
measured, by kernels ``torch.compile``'s inductor builds on this machine (a C++ compiler, the
inductor cache directory). Whether that works is a property of the machine, not of gradwatch,
so the doctor proves it here, on the calling thread (``"wait"``):

* the norm kernel: float32 gradients of the sizes it takes, values near float32's overflow and
  underflow included, against ``math.fsum`` of their exact float64 squares (<= 1e-12);
* the bf16 row-norm kernel: bf16 gradients of the row path, with squares that overflow and
  underflow float32 (the rows' repair), against ``math.fsum`` (<= 1e-6 on the norm, the rows'
  bound);
* the update kernel: three AdamW steps of a small model watched with ``update_stats=True``,
  compiled against the eager path on an identical copy (update norm within 1e-6, stalled and
  moving counts as the eager path's).

A FAIL means compiling does not work here: gradwatch then keeps its eager paths (the same
figures, slower; logged once), and ``compile_kernels="off"`` stops it trying. The other checks
run with ``compile_kernels="off"``, so what they time is the eager path, with nothing compiling
beside it. CUDA devices: SKIP (the kernels are for CPU tensors only).
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from gradwatch.doctor.options import FAIL, PASS, SKIP, Check
from gradwatch.norms.kernels import KernelCache
from gradwatch.norms.stats import NormEngine

THRESHOLD = ("compiles; norms within 1e-12 of float64, extremes included; bf16 row norms "
             "within 1e-6; update norm within 1e-6 of the eager path's, counts equal")


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(40_000, generator=g) * scale for scale in (1.0, 1e19, 1e-22)]


def _narrow_grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return [(torch.randn(70_000, generator=g) * scale).to(torch.bfloat16)
            for scale in (1.0, 1e20, 1e-25)]


def _norm_error(kernels: KernelCache, grads: list[torch.Tensor]) -> float:
    """The largest relative error of the engine's norms of ``grads`` (its kernels compiled on
    the first call, ``"wait"``) against ``math.fsum`` of the exact float64 squares."""
    engine = NormEngine(kernels=kernels)
    got = engine.squared_norms(grads)[: len(grads)].tolist()
    worst = 0.0
    for g, sq in zip(grads, got, strict=True):
        want = math.fsum(x * x for x in g.double().tolist())
        worst = max(worst, abs(math.sqrt(sq) - math.sqrt(want)) / math.sqrt(want))
    return worst


def _update_figures(mode: str) -> list[tuple[float | None, ...]]:
    """Four collects of the same small AdamW run, its kernels compiled (``"wait"``) or not."""
    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    figures = []
    # Every field explicit: the job's GRADWATCH_* environment must not change what is compared.
    fields = {name: info.get_default(call_default_factory=True)
              for name, info in WatchConfig.model_fields.items()}
    config = WatchConfig(**{**fields, "update_stats": True, "compile_kernels": mode})
    with GradWatch(model, config) as watch:
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            snap = watch.collect(step).result()
            opt.step()
            figures.append((snap.update_norm, snap.weight_norm, snap.stalled_fraction))
    return figures


def check_kernels(device: torch.device) -> Check:
    """``kernels`` (see the module docstring)."""
    if device.type != "cpu":
        return Check("kernels", SKIP, "compiled kernels are for CPU tensors only", THRESHOLD)
    started = time.perf_counter()
    kernels = KernelCache("wait")
    norm_err = _norm_error(kernels, _grads())
    narrow_err = _norm_error(kernels, _narrow_grads())
    if kernels.failed or kernels.ready < 2:
        return Check("kernels", FAIL, "the norm kernels did not compile (see the log): "
                     "gradwatch uses its eager paths here", THRESHOLD)
    compiled = _update_figures("wait")
    eager = _update_figures("off")
    seconds = time.perf_counter() - started
    update_err = 0.0
    counts_equal = True
    for (cu, cw, cs), (eu, ew, es) in zip(compiled, eager, strict=True):
        if (cu is None) != (eu is None) or (cw is None) != (ew is None):
            counts_equal = False
            continue
        if cu is not None and eu:
            update_err = max(update_err, abs(cu - eu) / eu)
        counts_equal &= cs == es
    measured = (f"compiled in {seconds:.1f} s; norm rel err {norm_err:.1g}; bf16 rows "
                f"{narrow_err:.1g}; update norm rel "
                f"err {update_err:.1g}; counts {'equal' if counts_equal else 'DIFFER'}")
    ok = norm_err <= 1e-12 and narrow_err <= 1e-6 and update_err <= 1e-6 and counts_equal
    return Check("kernels", PASS if ok else FAIL, measured, THRESHOLD)
