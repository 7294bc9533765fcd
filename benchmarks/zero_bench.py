"""gradwatch's collect under DeepSpeed ZeRO-2 against DeepSpeed's own global norm, on one engine.

2 ranks, gloo, CPU (``DS_ACCELERATOR=cpu``, torch's Adam), spawned, one thread per rank. After
``engine.backward(loss)`` on an accumulation boundary, rounds alternate (the order flips every
round, so a drift hits both alike) between:

* *gradwatch*: ``watch.collect(step).result()``: this rank's slices of the averaged gradients
  read in place, their squared norms, the one all-reduce, the host summary;
* *DeepSpeed*: ``engine.optimizer.scaled_global_norm()``, the norm ``engine.step()`` computes
  (per-partition norms and its all-reduce).

Both read the same gradients (no optimizer step between rounds). Rank 0's times are reported.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.results import Failure, Timing

WORLD = 2
#: Target: gradwatch's collect at most this many times DeepSpeed's own norm computation.
TARGET = 1.25
WIDTH = 1024
LAYERS = 4


@dataclass(frozen=True)
class ZeroNormResult:
    """One ZeRO-2 engine: both methods' per-call wall times on rank 0."""

    stage: int
    world: int
    params: int  # elements of the whole model
    rounds: int
    gradwatch: Timing
    deepspeed: Timing

    @property
    def ratio(self) -> float:
        return self.gradwatch.median / self.deepspeed.median


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import deepspeed
        import deepspeed.comm.torch

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo, no JIT op
        deepspeed.init_distributed("gloo")

        from gradwatch import GradWatch, WatchConfig

        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 2}, "steps_per_print": 10**9})
        watch = GradWatch(engine, WatchConfig(groups={"first": ["0.*"]}))
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(x).pow(2).mean())
        ours: list[float] = []
        theirs: list[float] = []

        def gradwatch_norm(step: int) -> None:
            t0 = time.perf_counter()
            watch.collect(step).result()
            ours.append(time.perf_counter() - t0)

        def deepspeed_norm() -> None:
            t0 = time.perf_counter()
            engine.optimizer.scaled_global_norm()
            theirs.append(time.perf_counter() - t0)

        gradwatch_norm(0)  # warm: the plan and its buffers are built once
        deepspeed_norm()
        ours.clear()
        theirs.clear()
        for i in range(rounds):
            if i % 2:
                deepspeed_norm()
                gradwatch_norm(i + 1)
            else:
                gradwatch_norm(i + 1)
                deepspeed_norm()
        engine.step()
        watch.close()
        if rank == 0:
            result = ZeroNormResult(2, WORLD, sum(p.numel() for p in model.parameters()), rounds,
                                    Timing.of(ours), Timing.of(theirs))
            Path(out).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(rounds: int) -> ZeroNormResult | Failure:
    """Spawn the 2-rank job; a failure (DeepSpeed missing, a crash) is reported, not raised."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pickle")
        try:
            mp.spawn(_worker, args=(_free_port(), rounds, path), nprocs=WORLD, join=True)
            return pickle.loads(Path(path).read_bytes())  # our own child wrote it
        except Exception as exc:
            return Failure(f"{type(exc).__name__}: {exc}")


def text(result: ZeroNormResult | Failure | None) -> str:
    """The report's section body."""
    if result is None:
        return "skipped: --no-distributed\n"
    if isinstance(result, Failure):
        return f"failed: {result.error}\n"
    g, d = result.gradwatch, result.deepspeed
    verdict = "met" if result.ratio <= TARGET else "not met"
    return (
        f"ZeRO-{result.stage}, {result.world} ranks, {result.params:,} parameters in {LAYERS} fp32 "
        f"`Linear({WIDTH}, {WIDTH})`; rounds: {result.rounds}. Target: gradwatch <= {TARGET}x "
        "DeepSpeed.\n\n"
        "| method | median | p25-p75 | ratio | target |\n| --- | --- | --- | --- | --- |\n"
        f"| gradwatch collect + result | {g.median * 1e3:.2f} ms | {g.quartiles[0] * 1e3:.2f}-"
        f"{g.quartiles[1] * 1e3:.2f} ms | {result.ratio:.2f}x | {verdict} |\n"
        f"| DeepSpeed scaled_global_norm | {d.median * 1e3:.2f} ms | {d.quartiles[0] * 1e3:.2f}-"
        f"{d.quartiles[1] * 1e3:.2f} ms | 1.00x | |\n"
    )


if __name__ == "__main__":  # this section alone: python -m benchmarks.zero_bench [rounds]
    print(text(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 30)))
