"""Worker side of the adaptive-clip tests of tests/distributed/test_zero.py:
``clip_grad_norm_("auto")`` under DeepSpeed ZeRO stages 0-3 on CPU (gloo), every case inside
one spawned world (the conventions, references and engine set-up of :mod:`zero_cases`).

DeepSpeed's own clipping is off (``gradient_clipping: 0``): gradwatch clips the partitions
DeepSpeed steps. Each case records the figures of every step as exact hex strings (compared
across ranks bit for bit by the test module), the coefficient gradwatch multiplied the
partitions by (:class:`clip_spy.CoefficientSpy`), and float64 references gathered in the test
only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from clip_spy import CoefficientSpy
from dist_cases import run_suite
from zero_cases import (
    MICRO_BATCH,
    _low,
    backward,
    batch,
    config,
    deepspeed_reference,
    engine_and_replica,
)

AUTO_STEPS = 60
AUTO_SPIKES = (35, 45, 55)  # after the default 25-step warm-up


def case_auto_clip(stage: int, dtype: str = "fp32",
                   loss_scale: float | None = None) -> Callable[[int, int], dict]:
    """``clip_grad_norm_("auto")`` with DeepSpeed's clipping off, 60 steps, 40x loss spikes at
    three steps after the warm-up, noise targets (a steady norm): per step the figures
    (hex: compared bit for bit across ranks), the coefficient gradwatch multiplied the
    partitions by, DeepSpeed's full gradient after the clip (a gather, float64 ``fsum``) and
    DeepSpeed's own norm in ``engine.step()`` (of the clipped partitions it steps)."""

    def run(rank: int, world: int) -> dict:
        from gradwatch import GradWatch
        from gradwatch.doctor.testing import OpCounter

        engine, _replica = engine_and_replica(
            stage, dtype,
            optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
        if loss_scale is not None:
            engine.optimizer.loss_scaler.cur_scale = loss_scale
        watch = GradWatch(engine, config())
        gen = torch.Generator().manual_seed(1000 + rank)
        rows: list[dict[str, Any]] = []
        scalar_reads = 0
        for step in range(AUTO_STEPS):
            x = torch.randn(MICRO_BATCH, 7, generator=gen).to(_low(engine))
            y = torch.randn(MICRO_BATCH, generator=gen)
            loss = (engine(x).float() - y).pow(2).mean()
            engine.backward(loss * (40.0 if step in AUTO_SPIKES else 1.0))
            with CoefficientSpy() as spy, OpCounter() as ops:
                total = watch.clip_grad_norm_("auto", step=step)
            scalar_reads += ops.scalar_reads
            history = watch._collector.history
            reading = history.last.reading()
            after = deepspeed_reference(engine)
            scale = float(engine.optimizer.loss_scale) if loss_scale is not None else 1.0
            post = math.sqrt(math.fsum(v for v in after.values() if v is not None)) / scale
            engine.step()
            ds_norm = engine.get_global_grad_norm()
            rows.append({
                "norm": float(total).hex(),
                "threshold": None if reading.threshold is None else reading.threshold.hex(),
                "limit": None if reading.limit is None else reading.limit.hex(),
                "coef": spy.hex(),
                "samples": reading.samples,
                "state": [float(t).hex() for t in history.state()],
                "post": post,
                "deepspeed_norm": None if ds_norm is None else float(ds_norm),
            })
        watch.close()
        return {"rows": rows, "scalar_reads": scalar_reads, "parallelism": watch.parallelism}

    return run


def case_auto_overflow(rank: int, world: int) -> dict:
    """``clip_grad_norm_("auto")`` (3-step warm-up) when DeepSpeed's loss scaler overflows at
    warm step 5 (an infinite loss): the clip returns NaN, the history is left as it was (no
    sample), DeepSpeed skips the step, and the next step clips by the threshold again; the
    figures as hex, to compare across ranks."""
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(2)
    engine.optimizer.loss_scaler.cur_scale = 1024.0  # the scaler that detects overflows
    watch = GradWatch(engine, config(adaptive_clip_warmup=3))
    rows: list[dict[str, Any]] = []
    for step in range(8):
        x = batch(dist.get_rank(), step).to(_low(engine))
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss * float("inf") if step == 5 else loss)
        with CoefficientSpy() as spy:
            total = watch.clip_grad_norm_("auto", step=step)
        history = watch._collector.history
        reading = history.last.reading()
        rows.append({"norm": float(total).hex(), "coef": spy.hex(), "samples": reading.samples,
                     "threshold": None if reading.threshold is None else reading.threshold.hex(),
                     "state": [float(t).hex() for t in history.state()]})
        engine.step()
    watch.close()
    return {"rows": rows, "engine_skipped": int(engine.skipped_steps)}


def case_auto_accumulation(rank: int, world: int) -> dict:
    """``clip_grad_norm_("auto")`` with two micro-steps per optimizer step: off the boundary
    it raises (nothing reduced to clip) and feeds no history; on it, it clips and samples."""
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(2, gas=2)
    watch = GradWatch(engine, config())
    out: dict[str, Any] = {"off": [], "samples": []}
    for step in range(3):
        backward(engine, step, micro=0)
        try:
            watch.clip_grad_norm_("auto", step=step)
            out["off"].append("")
        except Exception as exc:
            out["off"].append(f"{type(exc).__name__}: {exc}")
        engine.step()  # off the boundary: no optimizer step
        backward(engine, step, micro=1)
        total = watch.clip_grad_norm_("auto", step=step)
        out["samples"].append([watch._collector.history.last.reading().samples,
                               float(total).hex()])
        engine.step()
    watch.close()
    return out


RESUME_AT = 30  # warm, before the spikes
RESUME_STEPS = 40
RESUME_SPIKE = 35


def _resume_engine(stage: int) -> tuple[Any, Any]:
    from gradwatch import GradWatch

    engine, _replica = engine_and_replica(
        stage, optimizer={"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}})
    return engine, GradWatch(engine, config())


def _resume_steps(engine: Any, watch: Any, steps: range) -> dict[str, list[str]]:
    """Train ``steps`` with "auto" (noise targets seeded per rank and step, so a resumed run
    sees the same batches); step -> [norm, threshold, limit, coefficient] as hex."""
    rows: dict[str, list[str]] = {}
    for step in steps:
        gen = torch.Generator().manual_seed(5000 + 101 * dist.get_rank() + step)
        x = torch.randn(MICRO_BATCH, 7, generator=gen).to(_low(engine))
        y = torch.randn(MICRO_BATCH, generator=gen)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss * (40.0 if step == RESUME_SPIKE else 1.0))
        with CoefficientSpy() as spy:
            total = watch.clip_grad_norm_("auto", step=step)
        reading = watch._collector.history.last.reading()
        limit = "inf" if reading.limit is None else reading.limit.hex()
        threshold = "inf" if reading.threshold is None else reading.threshold.hex()
        rows[str(step)] = [float(total).hex(), threshold, limit, *spy.hex()]
        engine.step()
    return rows


def case_auto_resume(stage: int) -> Callable[[int, int], dict]:
    """A ZeRO run checkpointed at a warm step with ``engine.save_checkpoint(client_state=
    {"gradwatch": watch.state_dict()})`` and resumed in a new engine and watcher from
    ``engine.load_checkpoint`` and ``watch.load_state_dict(client_state["gradwatch"])``:
    the uninterrupted run's figures of the later steps (a spike among them) and the
    resumed run's, as hex; and a resumed watcher that loaded no state (its warm-up again)."""

    def run(rank: int, world: int) -> dict:
        import shutil
        import tempfile

        where = [tempfile.mkdtemp(prefix="gradwatch-zero-ckpt-") if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)
        engine, watch = _resume_engine(stage)
        _resume_steps(engine, watch, range(RESUME_AT))
        engine.save_checkpoint(where[0], tag="warm",
                               client_state={"gradwatch": watch.state_dict()})
        whole = _resume_steps(engine, watch, range(RESUME_AT, RESUME_STEPS))
        watch.close()
        out: dict[str, Any] = {"whole": whole}
        for load_watch in (True, False):
            engine, watch = _resume_engine(stage)
            _path, client = engine.load_checkpoint(where[0], tag="warm")
            if load_watch:
                watch.load_state_dict(client["gradwatch"])
            rows = _resume_steps(engine, watch, range(RESUME_AT, RESUME_STEPS))
            out["resumed" if load_watch else "fresh"] = rows
            watch.close()
        dist.barrier()  # both ranks loaded: the checkpoint can go
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
        return out

    return run


CASES: list[tuple[str, Callable[[int, int], dict]]] = [
    ("auto_s0", case_auto_clip(0)),
    ("auto_s1", case_auto_clip(1)),
    ("auto_s2", case_auto_clip(2)),
    ("auto_s3", case_auto_clip(3)),
    ("auto_s2_scaled", case_auto_clip(2, loss_scale=1024.0)),
    ("auto_s3_bf16", case_auto_clip(3, "bf16")),
    ("auto_overflow", case_auto_overflow),
    ("auto_accumulation", case_auto_accumulation),
    ("auto_resume_s2", case_auto_resume(2)),
    ("auto_resume_s3", case_auto_resume(3)),
]


def worker(rank: int, world: int, port: int, out: str, suite: str) -> None:
    run_suite(rank, world, port, out, CASES)
