"""Workers of the fault matrix's agreement cells (tests/distributed/test_fault_matrix.py):
faults x stacks x what gradwatch does to the run, in one spawned 2-rank gloo world.

Faults (the last rank is the faulty one unless said otherwise), at step ``FAULT_STEP``:

* ``nan_before``: rank 0's loss is NaN, before the stack's reduction (it spreads to every rank);
* ``nan_after``: a NaN written into the last rank's gradient after the reduction;
* ``straggler``: the last rank sleeps 3x ``collective_timeout_seconds`` before gradwatch's call,
  at ``FAULT_STEP`` and two steps later;
* ``raise_retried``: the last rank's forward raises before any collective, the loop retries it;
* ``skip_all``: every rank's forward raises, every loop skips the step;
* ``skip_one``: the last rank's forward raises, its loop goes on with the next step number (it
  retries the data, so the stack's own collectives stay paired; gradwatch sees different steps);
* ``failed_pass``: the last rank's local pass raises (its norm engine);
* ``refused``: rank 0 cannot write its ``file_sd`` target (``gradwatch.watch()``);
* ``closed``: the last rank closes its watcher before that step's call;
* ``disabled``: ``enabled=False`` on every rank.

Modes: ``collect`` (``watch.collect``), ``clip`` (``clip_grad_norm_``), ``guard`` (a guarded
SGD: its step collects and decides), ``guard_scaler`` (the same under a CPU ``GradScaler``),
``clip_guard`` (a clip, then the guarded step decides from the clip's collect).

Every rank records per iteration: its step, clip norm (``repr``), the float64 reference (the
whole model's norm, gathered), whether its parameters changed (the effective decision), and
its guard readings; at the end: its watcher's type, why collection stopped, rank 0's
published figures and error counts, its ERROR/WARNING log lines and its endpoint's
``gradwatch_collecting``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from agree_cases import MAX_NORM, TIMEOUT_S, Built, record_decisions, scrape
from fault_cases import _arm_raise

FAULTS = ("nan_before", "nan_after", "straggler", "raise_retried", "skip_all", "skip_one",
          "failed_pass", "refused", "closed", "disabled")
MODES = ("collect", "clip", "guard", "guard_scaler", "clip_guard")
STEPS = 6
FAULT_STEP = 2
STRAGGLE_S = 3 * TIMEOUT_S


def modes_of(stack: str) -> tuple[str, ...]:
    """What each stack supports: DeepSpeed steps through its engine (no guard, no GradScaler:
    its optimizer scales itself); the CPU GradScaler unscales plain tensors only (DDP)."""
    if stack == "zero2":
        return ("collect", "clip")
    if stack in ("ddp", "ddp_always"):
        return MODES
    return ("collect", "clip", "guard", "clip_guard")


def selection() -> list[tuple[str, str, str]]:
    """Every fault on every stack once, the modes rotating so each fault and each stack meets
    each of its modes; ``nan_after`` on DDP's default path takes the guard: a guard makes
    every collect all-reduce, so the NaN one rank holds after the reduction is every rank's
    skipped step (unguarded, no gradwatch all-reduce runs there: the NaN stays that rank's
    alone and its replica splits in the bare loop too)."""
    cells = []
    stacks = ("ddp", "ddp_always", "fsdp2", "fsdp1", "zero2")
    for fi, fault in enumerate(FAULTS):
        for si, stack in enumerate(stacks):
            if fault == "nan_after" and stack == "ddp":
                cells.append((stack, fault, "guard"))
                continue
            modes = modes_of(stack)
            cells.append((stack, fault, modes[(fi + si) % len(modes)]))
    # A straggler 3x past the timeout under FSDP2 with clip and guard (the device route).
    return [("fsdp2", "straggler", "clip_guard") if c[:2] == ("fsdp2", "straggler") else c
            for c in cells]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _Published:
    def __init__(self) -> None:
        self.published: dict[int, dict[str, Any]] = {}

    def write(self, snapshot: Any) -> None:
        self.published[int(snapshot.step)] = {
            "norm": repr(float(snapshot.global_norm)),
            "nonfinite": len(snapshot.nonfinite_params),
            "skipped": dict(snapshot.skipped_steps),
        }


def _steps(fault: str, faulty: bool) -> list[int | None]:
    """The step number of each iteration (None: the loop skips that iteration)."""
    if fault == "skip_all":
        return [None if s == FAULT_STEP else s for s in range(STEPS)]
    if fault == "skip_one" and faulty:
        return [s if s < FAULT_STEP else s + 1 for s in range(STEPS)]
    return list(range(STEPS))


def _options(fault: str, out: str, stack: str, built: Built) -> dict[str, Any]:
    options: dict[str, Any] = dict(port=None, collective_timeout_seconds=TIMEOUT_S,
                                   divergence_every=1, skip_nonfinite=True, **built.extra)
    if fault == "refused":
        blocker = Path(out, f"matrix-refused-{stack}")
        if dist.get_rank() == 0:
            blocker.write_text("a file, not a directory")
        options.update(port=0, file_sd_path=str(blocker / "targets.json"))
    if fault == "disabled":
        options["enabled"] = False
    if stack == "ddp" and fault == "nan_after":  # divergence at its default (every 100th
        # collect): only the guard makes the NaN step's collect all-reduce
        del options["divergence_every"]
    return options


def cell(stack: str, fault: str, mode: str, out: str) -> Callable[[int, int], dict[str, Any]]:
    def run(rank: int, world: int) -> dict[str, Any]:
        import gradwatch

        built = Built(stack, rank)
        faulty = rank == world - 1
        options = _options(fault, out, stack, built)
        stage = {"stage_group": options.pop("stage_group")} if "stage_group" in options else {}
        lines = _Lines()
        logging.getLogger("gradwatch").addHandler(lines)
        dist.barrier()
        started = time.monotonic()
        try:
            watch = gradwatch.watch(built.model, **stage, **options)
            recorder = _Published()
            if rank == 0:
                watch.add_sink(recorder)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if mode == "guard_scaler" \
                else None
            guarded = mode.startswith("guard") or mode == "clip_guard"
            opt = watch.guard(built.opt, scaler) if guarded else built.opt
            readings = record_decisions(watch) if guarded and hasattr(watch, "_collector") else []
            iterations = _run(built, watch, opt, scaler, fault, mode, rank, faulty)
            flushed = watch.flush(timeout=10.0)
            seconds = time.monotonic() - started
            collector = getattr(watch, "_collector", None)
            reporter = getattr(watch, "_reporter", None)
            stats = getattr(reporter, "stats", None)
            result = {
                "type": type(watch).__name__,
                "iterations": iterations,
                "readings": readings,
                "seconds": seconds,
                "flushed": flushed,
                "broken": None if collector is None else collector.broken,
                "published": recorder.published,
                "internal_errors": dict(stats._internal_errors) if stats is not None else {},
                "scrape": scrape(watch.metrics_url, ("gradwatch_collecting",)),
                "params": built.digest(),
            }
            watch.close()
        finally:
            logging.getLogger("gradwatch").removeHandler(lines)
        result["log"] = lines.lines
        return result

    return run


def _run(built: Built, watch: Any, opt: Any, scaler: Any, fault: str, mode: str, rank: int,
         faulty: bool) -> list[dict[str, Any]]:
    """The training loop of one cell; one record per iteration it ran."""
    records = []
    for step in _steps(fault, faulty):
        if step is None:
            continue
        if fault == "raise_retried" and faulty and step == FAULT_STEP:
            pass  # the forward raised before any collective; the loop retries: nothing left
        nan = (fault == "nan_before" and rank == 0 and step == FAULT_STEP)
        _backward(built, step, rank, scaler, nan)
        if fault == "nan_after" and faulty and step == FAULT_STEP:
            _poison(built, watch)
        reference = built.reference()
        if scaler is not None:  # the gradients are scaled; gradwatch's figures are not
            reference /= float(scaler.get_scale())
        record: dict[str, Any] = {"step": step, "reference": reference}
        if fault == "straggler" and faulty and step in (FAULT_STEP, FAULT_STEP + 2):
            time.sleep(STRAGGLE_S)
        if fault == "closed" and faulty and step == FAULT_STEP:
            watch.close()
        disarm = _arm_raise(watch) if (fault == "failed_pass" and faulty
                                        and step == FAULT_STEP) else (lambda: None)
        before = built.digest()
        if mode in ("clip", "clip_guard"):
            record["clip"] = repr(float(watch.clip_grad_norm_(MAX_NORM, step=step)))
        elif mode == "collect":
            watch.collect(step)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            built.step(opt)
        disarm()
        record["changed"] = built.digest() != before
        records.append(record)
    return records


def _backward(built: Built, step: int, rank: int, scaler: Any, nan: bool) -> None:
    torch.manual_seed(100 + step + rank)
    x = torch.randn(4, 6)
    if built.engine is not None:
        loss = built.engine(x).pow(2).sum()
        built.engine.backward(loss * math.nan if nan else loss)
        return
    built.opt.zero_grad(set_to_none=True)
    loss = built.model(x).pow(2).sum()
    if nan:
        loss = loss * math.nan
    (scaler.scale(loss) if scaler is not None else loss).backward()


def _poison(built: Built, watch: Any) -> None:
    """A NaN in this rank's first local gradient, after the stack's reduction."""
    if built.engine is not None:  # ZeRO-2: this rank's slices of the averaged gradients
        for grad in watch._resolved.gradients.read().tensors:  # views of DeepSpeed's buffers
            if grad is not None and grad.numel() > 0:
                grad.view(-1)[0] = math.nan
                return
        raise AssertionError("no local gradient to poison")
    for p in built.model.parameters():
        if p.grad is not None:
            getattr(p.grad, "_local_tensor", p.grad).view(-1)[0] = math.nan
            return


def cells(out: str) -> list[tuple[str, Callable[[int, int], dict[str, Any]]]]:
    return [(f"{s}/{f}/{m}", cell(s, f, m, out)) for s, f, m in selection()]


def worker(rank: int, world: int, port: int, out: str, suite: str = "") -> None:
    from dist_cases import run_suite

    run_suite(rank, world, port, out, cells(out))
