"""Workers of tests/distributed/test_agreement.py: every rank agrees, no rank stops alone.

One spawned 2-rank gloo world runs every case (small models, short timeouts). Stacks built by
:func:`build`: DDP (default path and ``always_reduce``), FSDP2, FSDP1 and DeepSpeed ZeRO-2 on
the CPU accelerator (:mod:`zero_cases`). Each case records, per rank, what it needs to assert
that decisions are equal across ranks bit for bit (``repr`` of floats) and exact against a
float64 reference (``math.fsum`` of exact squares of the whole model's gradient, gathered).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STACKS = ("ddp", "ddp_always", "fsdp2", "fsdp1", "zero2")
TIMEOUT_S = 1.0  # collective_timeout_seconds of every case
MAX_NORM = 0.5  # below every norm: each clip scales


class Built:
    """One stack: the module to watch, how to step (``engine.step`` for ZeRO) and the bare
    loop's clip (what a loop without gradwatch calls: ``clip_grad_norm_`` of torch on DDP and
    FSDP2, FSDP1's own method, none under DeepSpeed, whose engine clips)."""

    def __init__(self, stack: str, rank: int) -> None:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self.stack = stack
        self.engine: Any = None
        self.extra: dict[str, Any] = {"always_reduce": stack == "ddp_always"}
        if stack == "pipeline":  # two stages, no communication of their own
            from dist_cases import Stage

            torch.manual_seed(rank)
            net = Stage(rank, 6, 3)
            self.extra["stage_group"] = dist.group.WORLD
        if stack in ("ddp", "ddp_always"):
            self.model: nn.Module = nn.parallel.DistributedDataParallel(net)
        elif stack == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in (net[0], net[2]):
                fully_shard(layer)
            self.model = fully_shard(net)
        elif stack == "pipeline":
            self.model = net
        elif stack == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            self.model = FullyShardedDataParallel(
                net, device_id=torch.device("cpu"), use_orig_params=False
            )
        else:
            from zero_cases import ds_config, init_deepspeed

            deepspeed = init_deepspeed()
            self.engine, _, _, _ = deepspeed.initialize(
                model=net, model_parameters=net.parameters(), config=ds_config(2)
            )
            self.model = self.engine
        self.opt: Any = None  # DeepSpeed: the engine steps its own optimizer
        if self.engine is None:
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def backward(self, step: int, rank: int) -> None:
        torch.manual_seed(100 + step + rank)
        x = torch.randn(4, 6)
        if self.engine is not None:
            self.engine.backward(self.engine(x).pow(2).sum())
        else:
            self.opt.zero_grad(set_to_none=True)
            self.model(x).pow(2).sum().backward()

    def step(self, opt: Any = None) -> None:
        if self.engine is not None:
            self.engine.step()
        else:
            (opt if opt is not None else self.opt).step()

    def local_squares(self) -> float:
        """This rank's gradients' squared norm in float64 (its shards, its stage)."""
        return math.fsum(
            float(v) ** 2 for p in self.model.parameters() if p.grad is not None
            for v in getattr(p.grad, "_local_tensor", p.grad).double().flatten().tolist()
        )

    def reference(self) -> float:
        """The whole model's gradient norm in float64 (the clip's truth)."""
        if self.engine is not None:
            from deepspeed.utils import safe_get_full_grad

            sq = math.fsum(float(v) ** 2 for p in self.engine.module.parameters()
                           for v in safe_get_full_grad(p).double().flatten().tolist())
            return math.sqrt(sq)
        local = math.fsum(
            float(v) ** 2 for p in self.model.parameters() if p.grad is not None
            for v in getattr(p.grad, "_local_tensor", p.grad).double().flatten().tolist()
        )
        if self.stack in ("ddp", "ddp_always"):
            return math.sqrt(local)
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        return math.sqrt(float(total))

    def digest(self) -> str:
        """The bytes of every local parameter (shards): equal digests, equal replicas."""
        h = hashlib.sha256()
        for p in self.model.parameters():
            t = getattr(p, "_local_tensor", p).detach().contiguous()
            h.update(t.float().numpy().tobytes())
        return h.hexdigest()


class Errors(logging.Handler):
    """The ERROR lines gradwatch logs during a case."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> Errors:
        logging.getLogger("gradwatch").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("gradwatch").removeHandler(self)


def scrape(url: str | None, prefixes: tuple[str, ...] = ("gradwatch_",)) -> list[str]:
    """The endpoint's sample lines starting with ``prefixes`` (waits for the first export)."""
    if url is None:
        return []
    deadline = time.monotonic() + 20
    text = ""
    while "gradwatch_collecting" not in text and time.monotonic() < deadline:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        time.sleep(0.05)
    return [line for line in text.splitlines() if line.startswith(prefixes)]


def case_refused_on_rank0(stack: str, out: str) -> Callable[[int, int], dict[str, Any]]:
    """``gradwatch.watch()`` whose ``file_sd_path`` rank 0 cannot write (its parent is a
    file): refused on rank 0 after the handshake. Every rank must get a no-op together, clip
    as the bare loop would (the same norm on every rank, the whole model's) and finish at
    once; rank 0 serves ``gradwatch_collecting 0``; an explicit ``GradWatch`` raises on every
    rank."""

    def run(rank: int, world: int) -> dict[str, Any]:
        import gradwatch
        from gradwatch import WatchConfig

        blocker = Path(out, f"refused-{stack}")
        if rank == 0:
            blocker.write_text("a file, not a directory")
        dist.barrier()
        built = Built(stack, rank)
        options = dict(port=0, file_sd_path=str(blocker / "targets.json"),
                       collective_timeout_seconds=TIMEOUT_S, **built.extra)
        started = time.monotonic()
        with Errors() as errors:
            watch = gradwatch.watch(built.model, **options)
        clips, refs = [], []
        for step in range(3):
            built.backward(step, rank)
            refs.append(built.reference())
            clips.append(repr(float(watch.clip_grad_norm_(MAX_NORM, step=step))))
            built.step()
        seconds = time.monotonic() - started
        result = {
            "type": type(watch).__name__,
            "seconds": seconds,
            "clips": clips,
            "references": refs,
            "errors": errors.lines,
            "scrape": scrape(watch.metrics_url, ("gradwatch_collecting", "gradwatch_run_info")),
        }
        watch.close()
        dist.barrier()  # rank 0 scraped its endpoint: the handshake's 1 s bound starts together
        try:
            gradwatch.GradWatch(built.model, WatchConfig(**options))
            result["explicit"] = None
        except Exception as exc:
            result["explicit"] = type(exc).__name__
        return result

    return run


def _config(built: Built, **fields: Any) -> tuple[Any, dict[str, Any]]:
    """The case's WatchConfig and GradWatch's keyword arguments for ``built``."""
    from gradwatch import WatchConfig

    extra = dict(built.extra)
    kwargs = {"stage_group": extra.pop("stage_group")} if "stage_group" in extra else {}
    cfg = WatchConfig(port=None, collective_timeout_seconds=TIMEOUT_S, skip_nonfinite=True,
                      **extra, **fields)
    return cfg, kwargs


def record_decisions(watch: Any) -> list[Any]:
    """Every guard decision's host reading from now on, in order (None: no decision)."""
    collector = watch._collector
    decide = collector.guard_decision
    readings: list[Any] = []

    def recorded(scaler: Any, optimizer: Any) -> Any:
        decision = decide(scaler, optimizer)
        readings.append(None if decision is None else repr(decision.reading()))
        return decision

    collector.guard_decision = recorded
    return readings


MISMATCH_ITERATIONS = 8
MISMATCH_AT = 5  # the iteration whose forward raises on the last rank


def case_step_mismatch(stack: str, shifted: bool) -> Callable[[int, int], dict[str, Any]]:
    """The last rank's forward raises at iteration ``MISMATCH_AT`` (before any collective)
    and its loop skips that step: it collects no step ``MISMATCH_AT``. ``shifted``: the loop
    retries, so every rank runs as many iterations and the job's own collectives stay paired,
    but that rank's step numbers run one ahead from then on; else (pipeline stages: no
    collective of the job's own) it runs one iteration fewer. Clip (``clip_grad_norm_``) and
    guard every step. Each rank records its steps, clip norms, local squares, guard readings,
    why collection stopped and its run time."""

    def run(rank: int, world: int) -> dict[str, Any]:
        from gradwatch import GradWatch

        built = Built(stack, rank)
        cfg, kwargs = _config(built, divergence_every=1)
        faulty = rank == world - 1
        if faulty:
            steps = [s for s in range(MISMATCH_ITERATIONS + int(shifted)) if s != MISMATCH_AT]
        else:
            steps = list(range(MISMATCH_ITERATIONS))
        dist.barrier()
        started = time.monotonic()
        with Errors() as errors:
            watch = GradWatch(built.model, cfg, **kwargs)
            recorder = _Published()
            if rank == 0:
                watch.add_sink(recorder)
            readings = record_decisions(watch)
            opt = watch.guard(built.opt)
            clips, squares, refs = [], [], []
            for step in steps:
                built.backward(step, rank)
                squares.append(built.local_squares())
                refs.append(built.reference() if shifted else None)
                clips.append(repr(float(watch.clip_grad_norm_(MAX_NORM, step=step))))
                built.step(opt)
            watch.flush(timeout=10.0)
            seconds = time.monotonic() - started
            result = {
                "steps": steps, "clips": clips, "squares": squares, "references": refs,
                "readings": readings, "seconds": seconds, "broken": watch._collector.broken,
                "published": recorder.published, "errors": errors.lines,
                "internal_errors": dict(watch._reporter.stats._internal_errors)
                if rank == 0 else {},
                "params": built.digest(),
            }
            watch.close()
        return result

    return run


class _Published:
    """A sink: the steps rank 0 published, with their whole-model norm."""

    def __init__(self) -> None:
        self.published: dict[int, float] = {}

    def write(self, snapshot: Any) -> None:
        self.published[int(snapshot.step)] = float(snapshot.global_norm)


def cases(out: str) -> list[tuple[str, Callable[[int, int], dict[str, Any]]]]:
    return [
        *((f"refused/{stack}", case_refused_on_rank0(stack, out))
          for stack in ("ddp", "fsdp2", "fsdp1")),
        ("mismatch/fsdp2", case_step_mismatch("fsdp2", shifted=True)),
        ("mismatch/pipeline", case_step_mismatch("pipeline", shifted=False)),
    ]


def worker(rank: int, world: int, port: int, out: str, suite: str = "") -> None:
    from dist_cases import run_suite

    run_suite(rank, world, port, out, cases(out))
