"""The training job behind ``gradwatch demo``: a small CPU DDP model growing a seed module.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        -m gradwatch.cli.demo_job --workdir DIR --steps 200 --port 9977

It ships in the package so ``gradwatch demo`` works from an installed wheel; it can also be run
by hand as above (without ``--ack`` and ``--parent-pid`` it needs no parent).

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
the host is expected to be frozen. With a gradwatch whose ``GradWatch`` lacks ``set_isolated``
the job keeps ``["stem"]`` throughout and phase 2 is shown by the host's norm (0) alone.

Fault injection: at ``--nan-at`` the gradients are multiplied by NaN, at ``--explode-at`` by
1e6, after the backward pass and before ``collect``; the optimizer skips that step (as a
GradScaler would), so training is healthy again afterwards. After an injected step the job
pauses ``--anomaly-pause`` seconds so a scraper polling a few times a second sees the step's
gauges (the counters keep it anyway).

Files in ``--workdir`` (written by rank 0, JSON written to a temporary name then renamed):

* ``endpoint.json`` ``{"metrics_url", "port", "seed_at", "blend_at", "steps"}``, once serving;
* ``error.json`` ``{"kind": "port_in_use" | "error", "message", "port"}`` if rank 0 failed to
  start serving (the port is taken);
* ``summary.json`` at the end of training: the key facts of every snapshot rank 0 saw (steps
  run, last norms, the non-finite and exploding steps, the lowest health), so the parent's
  summary does not depend on which scrapes happened to land on an injected step.

After ``summary.json``, rank 0 keeps serving until the parent creates ``ack`` (with ``--ack``,
at most ``ACK_TIMEOUT`` seconds: the parent's final scrape) and for ``--linger`` seconds.
Every rank stops at the same step when ``--parent-pid`` disappears (a one-element all-reduce
per step agrees on it), so a killed ``gradwatch demo`` leaves no job behind. SIGINT and
SIGTERM stop a rank quietly (exit 130 / 143), closing the endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradwatch.cli.phases import default_phases, phase_of

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
SEED_GATE = 0.1


#: Width of the demo model and its batch: ~0.55M trainable parameters, steps of a few to tens of
#: milliseconds on one CPU thread, so the run looks like training (and gradwatch's fixed cost per
#: collect, a few hundred microseconds, is measured against a step of realistic length; see
#: docs/performance.md), while 200 steps still take well under a minute.
DEMO_WIDTH = 512
DEMO_BATCH = 128


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


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` atomically (temporary name, then rename); NaN is written as ``NaN``."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


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


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gradwatch.cli.demo_job", description=__doc__.splitlines()[0]
    )
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed-at", type=int, default=None)
    p.add_argument("--blend-at", type=int, default=None)
    p.add_argument("--nan-at", type=int, action="append", default=[])
    p.add_argument("--explode-at", type=int, action="append", default=[])
    p.add_argument("--port", type=int, default=9977)
    p.add_argument("--bind", default="0.0.0.0")
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per step")
    p.add_argument("--anomaly-pause", type=float, default=1.0)
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument("--ack", action="store_true", help="wait for WORKDIR/ack before closing")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=DEMO_BATCH)
    p.add_argument("--log-every", type=int, default=20)
    return p.parse_args(argv)


class _Record:
    """Rank 0's running summary of the snapshots it saw (written as ``summary.json``)."""

    def __init__(self) -> None:
        self.steps_run = 0
        self.last: dict[str, Any] | None = None
        self.nonfinite_steps: list[int] = []
        self.exploding_steps: list[int] = []
        self.isolation_steps: dict[str, list[int]] = {}
        self.health_min: dict[str, Any] | None = None
        self.world_size = 1
        self.parallelism = ""

    def add(self, snap: Any, phase: str) -> None:
        self.steps_run += 1
        self.world_size, self.parallelism = snap.world_size, snap.parallelism
        self.last = {
            "step": snap.step,
            "phase": phase,
            "global_norm": snap.global_norm,
            "groups": {g: s.norm for g, s in snap.groups.items()},
            "ratios": dict(snap.ratios),
            "health": snap.health,
        }
        if not snap.is_finite and not snap.amp_skipped:
            self.nonfinite_steps.append(snap.step)
        if snap.exploding > 0:
            self.exploding_steps.append(snap.step)
        for group, violated in snap.isolation_violated.items():
            steps = self.isolation_steps.setdefault(group, [])
            if violated:
                steps.append(snap.step)
        if self.health_min is None or snap.health < self.health_min["value"]:
            self.health_min = {"value": snap.health, "step": snap.step}

    def as_json(self, **extra: Any) -> dict[str, Any]:
        return {
            "steps_run": self.steps_run,
            "last": self.last,
            "nonfinite_steps": self.nonfinite_steps,
            "exploding_steps": self.exploding_steps,
            "isolation_violation_steps": self.isolation_steps,
            "health_min": self.health_min,
            "world_size": self.world_size,
            "parallelism": self.parallelism,
            **extra,
        }


def train(args: argparse.Namespace) -> int:
    """The whole job on one rank; returns the exit code."""
    from gradwatch import GradWatch, WatchConfig
    from gradwatch.errors import PortInUseError

    work: Path = args.workdir
    seed_at, blend_at = default_phases(args.steps, args.seed_at, args.blend_at)
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
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    cfg = WatchConfig(
        groups=GROUPS,
        ratios=RATIOS,
        isolated=ISOLATED,
        port=args.port,
        bind_address=args.bind,
    )
    try:
        watch = GradWatch(model, cfg)
    except PortInUseError as exc:
        write_json(
            work / "error.json", {"kind": "port_in_use", "message": str(exc), "port": args.port}
        )
        print(str(exc), file=sys.stderr, flush=True)
        return 2
    except OSError as exc:
        write_json(work / "error.json", {"kind": "error", "message": str(exc), "port": args.port})
        print(str(exc), file=sys.stderr, flush=True)
        return 2
    url = watch.metrics_url
    if rank == 0:
        write_json(
            work / "endpoint.json",
            {
                "metrics_url": url,
                "port": int(url.rsplit(":", 1)[1].split("/", 1)[0]) if url else None,
                "steps": args.steps,
                "seed_at": seed_at,
                "blend_at": blend_at,
            },
        )
        print(f"gradwatch demo job: serving {url}", flush=True)
    record = _Record()
    # Per-phase isolation expectation (see the module docstring); absent in older gradwatch.
    set_isolated = getattr(watch, "set_isolated", None)
    nan_at, explode_at = set(args.nan_at), set(args.explode_at)
    try:
        for step in range(args.steps):
            stop = torch.tensor([0.0 if _alive(args.parent_pid) else 1.0])
            if distributed:
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                print(f"rank {rank}: the parent process is gone; stopping", flush=True)
                return 1
            phase = phase_of(step, seed_at, blend_at)
            if phase != net.phase and set_isolated is not None:
                set_isolated([*ISOLATED, "host"] if phase == "seed" else ISOLATED)
            net.phase = phase
            x = torch.randn(args.batch_size, 16, generator=data)
            with torch.no_grad():  # a noisy target keeps a floor under the gradients
                y = torch.tanh(teacher(x)) + 0.1 * torch.randn(args.batch_size, 1, generator=data)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()

            factor = NAN_FACTOR if step in nan_at else EXPLODE_FACTOR if step in explode_at else 1.0
            injected = factor != 1.0
            if injected:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor)
            pending = watch.collect(step=step)
            if not injected:
                optimizer.step()
            if rank == 0:
                snap = pending.result()
                record.add(snap, phase)
                if injected or (args.log_every > 0 and step % args.log_every == 0):
                    print(
                        f"step {step} phase {phase} loss {loss.item():.4f} global_norm "
                        f"{snap.global_norm:.4g} health {snap.health:.2f}"
                        + (f" (gradients x {factor})" if injected else ""),
                        flush=True,
                    )
            pause = args.anomaly_pause if injected else 0.0
            if args.sleep > 0 or pause > 0:
                time.sleep(max(args.sleep, pause))
        if rank == 0:
            write_json(
                work / "summary.json",
                record.as_json(
                    metrics_url=url, steps=args.steps, seed_at=seed_at, blend_at=blend_at
                ),
            )
            _hold(work, args)
        return 0
    finally:
        watch.close()


def _hold(work: Path, args: argparse.Namespace) -> None:
    """Rank 0 keeps serving: until the parent's ``ack`` (bounded) and for ``--linger`` s."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        acked = not args.ack or (work / "ack").exists() or elapsed > ACK_TIMEOUT
        if (acked and elapsed >= args.linger) or not _alive(args.parent_pid):
            return
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    code = 0
    try:
        code = train(args)
    except KeyboardInterrupt:
        code = 130
    except _Interrupted:
        code = 143
    finally:
        if dist.is_available() and dist.is_initialized():
            # best effort while stopping
            with contextlib.suppress(Exception, KeyboardInterrupt, _Interrupted):
                dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
