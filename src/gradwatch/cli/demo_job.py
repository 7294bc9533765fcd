"""The training job behind ``gradwatch demo``: a small CPU DDP model growing a seed module.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m gradwatch.cli.demo_job --workdir DIR [--parent-pid PID]

It ships in the package so ``gradwatch demo`` works from an installed wheel. Its options are the
parent's :class:`gradwatch.cli.demo.DemoOptions`, read whole from ``DIR/options.json`` and
checked (a bad field is an error naming it, exit status 2); a job started by hand without that
file runs with the defaults, and without ``--parent-pid`` it needs no parent.

The model: a frozen input projection ``stem``, the ``host`` backbone (``host.*`` and its output
``head.*``), and a small ``seed`` module added to the host's features through a 0.1 gate.
gradwatch watches three groups, ``host``, ``seed`` and ``stem``, the ``seed/host`` ratio, and
serves from global rank 0. The run has three phases:

1. ``host`` (steps < ``--seed-at``): only the host trains; the seed is not in the graph yet, so
   it has no gradient (its norm and numel are 0);
2. ``seed`` (``--seed-at`` <= step < ``--blend-at``): the host is frozen (its features and the
   head are detached, so no gradient reaches it: norm 0) and only the seed trains;
3. ``blend`` (from ``--blend-at``): host and seed train together; the ratio shows their balance.

How isolation is shown. ``isolated`` in ``WatchConfig`` is part of the layout every rank
agrees on at construction, and declaring ``isolated=["host"]`` for the whole run would report
violations in phases 1 and 3 that are not faults. So the configuration declares
``isolated=["stem"]`` (frozen for the whole run: the check is shown, and holds), and the job
switches the host's expectation with ``GradWatch.set_isolated`` at the phase boundaries:
``["stem", "host"]`` during phase 2 only. ``set_isolated`` is host-side (nothing re-agreed
across ranks), so the endpoint shows ``gradwatch_isolation_violated{group="host"}`` exactly while
the host is expected to be frozen.

Fault injection: at ``--nan-at`` the gradients are multiplied by NaN, at ``--explode-at`` by
1e6, at ``--spike-at`` by 30 (a spike relative to the recent norms, below the fixed exploding
threshold: only adaptive spike detection sees it), by scaling the loss before the backward
pass: every rank's local gradients carry the fault before DDP's all-reduce, so every feature
the demo shows (the reduced norms, the per-rank view with the replicas' spread and the gradient
noise scale) sees the same step, as it would a real fault. The optimizer skips that step (as a
GradScaler would), so training is healthy again afterwards. With ``--guard`` the loop does not
skip by itself: it steps a fused SGD through ``watch.guard(optimizer)`` (``skip_spike_score``
6), which skips the non-finite and spiking steps on every rank. After an injected step the job
pauses ``ANOMALY_PAUSE`` seconds so a scraper polling a few times a second sees the step's
gauges (the counters keep it anyway).

What rank 0 tells the parent (the ready message once serving, an error if it cannot serve, the
:class:`~gradwatch.cli.demo.Summary` of every snapshot it saw at the end) are the parent's typed
messages, written to the work directory (:class:`~gradwatch.cli.demo.Workdir`). After the
summary, rank 0 keeps serving until the parent's ack (with ``--parent-pid``, at most
``ACK_TIMEOUT`` seconds: the parent's final scrape) and for ``--linger`` seconds. Every rank
stops at the same step when ``--parent-pid`` disappears (a one-element all-reduce per step
agrees on it), so a killed ``gradwatch demo`` leaves no job behind. SIGINT and SIGTERM stop a
rank quietly (exit 130 / 143), closing the endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradwatch.cli.demo_protocol import (
    ANOMALY_PAUSE,
    DemoOptions,
    JobError,
    Ready,
    Summary,
    Workdir,
)

#: How long rank 0 waits for the parent's ``ack`` after writing ``summary.json``.
ACK_TIMEOUT = 10.0
#: Group patterns of the demo model (see the module docstring).
GROUPS: dict[str, list[str]] = {
    "host": ["host.*", "head.*"],
    "seed": ["seed.*"],
    "stem": ["stem.*"],
}
RATIOS: list[tuple[str, str]] = [("seed", "host")]
ISOLATED: list[str] = ["stem"]

NAN_FACTOR = float("nan")
EXPLODE_FACTOR = 1e6
#: Well above the demo's step-to-step noise in every phase (the seed alone varies by ~3x), so the
#: spike is found wherever it is injected, and below the exploding threshold.
SPIKE_FACTOR = 30.0
SEED_GATE = 0.1


#: Width of the demo model and its batch: ~0.55M trainable parameters, so a step costs what a
#: small real training step costs (gradwatch's fixed cost per collect is then measured against
#: a step of realistic length, see docs/performance.md) while a demo run stays short.
DEMO_WIDTH = 512
DEMO_BATCH = 128


#: ``skip_spike_score`` of ``--guard``.
GUARD_SPIKE_SCORE = 6.0
#: Rank 0 prints a progress line to the job's log every this many steps.
LOG_EVERY = 20

class DemoNet(nn.Module):
    """stem (frozen) -> host backbone -> head, with a gated seed module on the host features."""

    def __init__(self, d_in: int = 16, d: int = DEMO_WIDTH) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.stem.requires_grad_(False)
        self.host = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh())
        self.seed = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, d))
        self.head = nn.Linear(d, 1)
        self.phase = "host"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.phase == "seed":  # host frozen: no gradient may reach host.* or head.*
            with torch.no_grad():
                h = self.host(self.stem(x))
            z = h + SEED_GATE * self.seed(h)
            return nn.functional.linear(z, self.head.weight.detach(), self.head.bias.detach())
        h = self.host(self.stem(x))
        if self.phase == "host":  # the seed is not grown yet
            return self.head(h)
        return self.head(h + SEED_GATE * self.seed(h))


def _alive(pid: int | None) -> bool:
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class _Interrupted(BaseException):
    """Raised by the SIGTERM handler, so a terminated rank unwinds like a Ctrl-C."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Interrupted


def train(opts: DemoOptions, work: Workdir, parent_pid: int | None) -> int:
    """The whole job on one rank; returns the exit code."""
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.errors import PortInUseError

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.set_num_threads(1)

    torch.manual_seed(0)  # identical initial weights on every rank
    net = DemoNet()
    teacher = nn.Linear(16, 1)
    # Parameters leave and join the graph with the phases: DDP must look for unused ones.
    model: nn.Module = (
        nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
        if distributed
        else net
    )
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.05, fused=opts.guard or None
    )
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    cfg = WatchConfig(
        groups=GROUPS,
        ratios=RATIOS,
        isolated=ISOLATED,
        port=opts.port,
        bind_address=opts.bind,
        rank_view=True,  # opt-in: the demo shows where a NaN started and the noise scale
        update_stats=True,  # opt-in: the demo shows weight and update norms, stalled updates
        skip_spike_score=GUARD_SPIKE_SCORE if opts.guard else None,
    )
    try:
        watch = GradWatch(model, cfg)
    except OSError as exc:  # PortInUseError is one
        kind = "port_in_use" if isinstance(exc, PortInUseError) else "error"
        work.write(JobError(kind=kind, message=str(exc)))
        print(str(exc), file=sys.stderr, flush=True)
        return 2
    guarded = watch.guard(optimizer) if opts.guard else None
    if rank == 0:
        assert watch.metrics_url is not None  # rank 0 serves: cfg.port is set
        work.write(Ready(metrics_url=watch.metrics_url))
        print(f"gradwatch demo job: serving {watch.metrics_url}", flush=True)
    summary = Summary()
    try:
        for step in range(opts.steps):
            stop = torch.tensor([0.0 if _alive(parent_pid) else 1.0])
            if distributed:
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                print(f"rank {rank}: the parent process is gone; stopping", flush=True)
                return 1
            phase = opts.phase(step)
            if phase != net.phase:  # the host's isolation is expected in phase 2 only
                watch.set_isolated([*ISOLATED, "host"] if phase == "seed" else ISOLATED)
            net.phase = phase
            x = torch.randn(DEMO_BATCH, 16, generator=data)
            with torch.no_grad():  # a noisy target keeps a floor under the gradients
                y = torch.tanh(teacher(x)) + 0.1 * torch.randn(DEMO_BATCH, 1, generator=data)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            factor = injected_factor(opts, step)
            injected = factor != 1.0
            # The fault enters the local gradients through the loss, before DDP's all-reduce,
            # as a real one would: the reduced figures, the per-rank view and the noise scale
            # all see the same step. --nan-rank: on that rank only (the per-rank view names it
            # as the origin; the all-reduce spreads the NaN to every rank).
            local_nan = opts.nan_rank is not None and step == opts.nan_at
            scale = (NAN_FACTOR if rank == opts.nan_rank else 1.0) if local_nan else factor
            (loss * scale if scale != 1.0 else loss).backward()
            pending = watch.collect(step=step)
            if guarded is not None:
                guarded.step()  # the guard decides, from this collect, on every rank
            elif not injected:
                optimizer.step()
            if rank == 0:
                snap = pending.result()
                summary.add(snap)
                if injected or step % LOG_EVERY == 0:
                    print(
                        f"step {step} phase {phase} loss {loss.item():.4f} global_norm "
                        f"{snap.global_norm:.4g} health {snap.health:.2f}"
                        + (f" (gradients x {factor})" if injected else "")
                        + (
                            f"; guard skipped it ({snap.guard_skipped})"
                            if snap.guard_skipped
                            else ""
                        ),
                        flush=True,
                    )
            pause = ANOMALY_PAUSE if injected else 0.0
            if opts.step_sleep > 0 or pause > 0:
                time.sleep(max(opts.step_sleep, pause))
        if rank == 0:
            work.write(summary)
            _hold(work, opts, parent_pid)
        return 0
    finally:
        watch.close()


def injected_factor(opts: DemoOptions, step: int) -> float:
    """What the loss of ``step`` is multiplied by: NaN at ``--nan-at``, 1e6 at
    ``--explode-at``, 30 at ``--spike-at`` (the first of these when several fall on ``step``),
    else 1."""
    for at, factor in (
        (opts.nan_at, NAN_FACTOR),
        (opts.explode_at, EXPLODE_FACTOR),
        (opts.spike_at, SPIKE_FACTOR),
    ):
        if step == at:
            return factor
    return 1.0


def _hold(work: Workdir, opts: DemoOptions, parent_pid: int | None) -> None:
    """Rank 0 keeps serving: until the parent's ack (bounded; with a parent only) and for
    ``--linger`` s."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        acked = parent_pid is None or work.acked() or elapsed > ACK_TIMEOUT
        if (acked and elapsed >= opts.linger) or not _alive(parent_pid):
            return
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gradwatch.cli.demo_job",
        description="The training job behind gradwatch demo; its options are "
        "WORKDIR/options.json (gradwatch.cli.demo.DemoOptions; defaults when absent).",
    )
    p.add_argument("--workdir", type=Path, required=True, help="the run's private directory")
    p.add_argument(
        "--parent-pid", type=int, default=None,
        help="stop when this process is gone; keep serving until its ack",
    )  # fmt: skip
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    ns.workdir.mkdir(parents=True, exist_ok=True)
    work = Workdir(ns.workdir)
    try:
        opts = work.read_options()
    except ValueError as exc:
        print(f"{ns.workdir / Workdir.OPTIONS}: {exc}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    code = 0
    try:
        code = train(opts, work, ns.parent_pid)
    except KeyboardInterrupt:
        code = 130
    except _Interrupted:
        code = 143
    finally:
        if dist.is_available() and dist.is_initialized():
            # best effort while stopping
            with contextlib.suppress(RuntimeError, ValueError, KeyboardInterrupt, _Interrupted):
                dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
