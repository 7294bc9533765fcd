"""A small CPU training job watched by gradwatch: torchrun, gloo, DistributedDataParallel.

    GRADWATCH_PORT=9977 \\
    GRADWATCH_GROUPS='{"host": ["backbone.*"], "seed": ["seed.*"], "stem": ["stem.*"]}' \\
    GRADWATCH_RATIOS='[["seed", "host"]]' GRADWATCH_ISOLATED='["stem"]' \\
    torchrun --nproc_per_node 2 examples/train_ddp.py --steps 200

The model: a frozen input projection ``stem`` (it gets no gradient: an isolated group), the
``backbone`` (the host network), a small ``seed`` module added to it through a 0.1 gate, and a
``head`` (no pattern: group "other"). Every gradwatch setting comes from ``GRADWATCH_*``
variables (``gradwatch.WatchConfig()``); only global rank 0 serves the metrics.

Fault injection, for alert tests and demos. A spec is a comma-separated list of steps and
ranges: ``"50"``, ``"50,60"``, ``"150-199"``, ``"150-"`` (from 150 on):

* ``INJECT_NAN_AT``: the gradients are multiplied by NaN at those steps, before ``collect``;
* ``INJECT_EXPLODE_AT``: the gradients are multiplied by 1e6 at those steps.

An injected step is measured, then skipped by the optimizer (as a GradScaler skips an
overflowing step), so the run is healthy again afterwards. With ``GRADWATCH_GUARD=1`` the
optimizer steps through ``watch.guard(optimizer)``, which skips the NaN steps itself (the loop
still skips the exploding ones).

Other settings (a command-line option wins over its variable): ``--steps``/``TRAIN_STEPS``
(default 200; 0 = until stopped), ``--sleep``/``STEP_SLEEP`` (seconds per step, default 0.05,
so dashboards have time to show the run), ``--batch-size``/``BATCH_SIZE`` (default 64),
``--log-every``/``LOG_EVERY`` (rank 0 prints a line every that many steps, default 20),
``--clip-norm``/``CLIP_NORM`` (clip the whole-model gradient norm to this with
``watch.clip_grad_norm_``, which collects too and exports ``gradwatch_clip_coef``; default 0:
no clipping).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import gradwatch

NAN_FACTOR = float("nan")
EXPLODE_FACTOR = 1e6


class StepSpec:
    """A set of steps given as ``"3"``, ``"3,7"``, ``"10-20"`` or ``"10-"`` (open range)."""

    def __init__(self, spec: str | None) -> None:
        self.ranges: list[tuple[int, float]] = []
        for part in (spec or "").split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                lo, hi = part.split("-", 1)
                self.ranges.append((int(lo), float(hi) if hi.strip() else math.inf))
            else:
                self.ranges.append((int(part), int(part)))

    def __contains__(self, step: int) -> bool:
        return any(lo <= step <= hi for lo, hi in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)


class Net(nn.Module):
    def __init__(self, d_in: int = 16, d: int = 64) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.stem.requires_grad_(False)  # frozen: the isolated group
        self.backbone = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh())
        self.seed = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, d))
        self.head = nn.Linear(d, 1)
        self.gate = 0.1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone(self.stem(x))
        return self.head(h + self.gate * self.seed(h))


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=int(env.get("TRAIN_STEPS", "200")))
    parser.add_argument("--sleep", type=float, default=float(env.get("STEP_SLEEP", "0.05")))
    parser.add_argument("--batch-size", type=int, default=int(env.get("BATCH_SIZE", "64")))
    parser.add_argument("--log-every", type=int, default=int(env.get("LOG_EVERY", "20")))
    parser.add_argument("--clip-norm", type=float, default=float(env.get("CLIP_NORM", "0")))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    nan_at = StepSpec(os.environ.get("INJECT_NAN_AT"))
    explode_at = StepSpec(os.environ.get("INJECT_EXPLODE_AT"))

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.set_num_threads(1)

    torch.manual_seed(0)  # identical initial weights on every rank
    model: nn.Module = Net()
    teacher = nn.Linear(16, 1)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.02)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    watch = gradwatch.GradWatch(model, gradwatch.WatchConfig())
    guarded = watch.guard(optimizer) if watch.config.guard else None
    if rank == 0:
        print(f"gradwatch serving {watch.metrics_url}", flush=True)
    try:
        step = 0
        while args.steps <= 0 or step < args.steps:
            x = torch.randn(args.batch_size, 16, generator=data)
            with torch.no_grad():  # a noisy target: gradients keep a floor on long runs
                y = torch.tanh(teacher(x)) + 0.1 * torch.randn(args.batch_size, 1, generator=data)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()

            factor = NAN_FACTOR if step in nan_at else EXPLODE_FACTOR if step in explode_at else 1.0
            injected = factor != 1.0
            if injected:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(factor)
                if rank == 0:
                    print(f"step {step}: gradients multiplied by {factor}", flush=True)

            # The loop's own norm (what it would clip with or log, before any clipping), audited
            # against gradwatch's exact one: gradwatch_reported_norm_ratio{source="loop"} reads 1.
            norm = torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]
            )
            if args.clip_norm > 0:  # clips and collects in one pass (pre-clip norms, clip_coef)
                watch.clip_grad_norm_(args.clip_norm, step=step)
            else:
                watch.collect(step=step)
            watch.audit_norm(norm, step=step, source="loop")
            if guarded is not None and step not in explode_at:
                guarded.step()  # skips the NaN steps: the same decision on every rank
            elif not injected:
                optimizer.step()
            snap = None
            if rank == 0 and args.log_every > 0 and step % args.log_every == 0:
                snap = watch.last  # this step's snapshot (waits for it, as result() would)
            if snap is not None:
                print(
                    f"step {step} loss {loss.item():.4f} global_norm {snap.global_norm:.4g} "
                    f"health {snap.health:.2f}",
                    flush=True,
                )
            if args.sleep > 0:
                time.sleep(args.sleep)
            step += 1
    finally:
        watch.close()
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
