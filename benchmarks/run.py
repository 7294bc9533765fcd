"""gradwatch benchmarks: per-collect cost, targets, distributed overhead, the per-rank view,
scrape latency.

Usage: ``python benchmarks/run.py --out docs/performance.md`` (``make bench``, planned within
15 minutes on a quiet 2-core machine: ``benchmarks.cases.WALL_TIME_BUDGET_S``); ``--quick``
runs tiny sizes (tests/distributed/test_benchmarks.py runs it so the harness cannot rot; its
figures mean nothing); ``--no-distributed`` skips the multi-process sections. Every timing is a
median over rounds in which the compared methods run round-robin on the same tensors, so load
drift (other jobs on the machine) hits all of them alike.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler (largest allocation) is quiet
# No C++ warnings in the report's log (DDP's find_unused_parameters notice, once per rank);
# inherited by the spawned ranks.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import (  # noqa: E402
    distributed,
    divergence_bench,
    fsdp1_bench,
    guard_bench,
    measure,
    ranktiming_bench,
    rankview_bench,
    report,
    scale,
    shapes,
    update_bench,
    zero_bench,
)
from benchmarks.cases import Plan, describe_demo_model, full_plan, quick_plan  # noqa: E402
from benchmarks.page import machine  # noqa: E402
from benchmarks.results import Failure, RunResults  # noqa: E402
from gradwatch.norms import kernels  # noqa: E402

T = TypeVar("T")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/performance.md")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (harness self-test)")
    ap.add_argument("--no-distributed", action="store_true",
                    help="skip the multi-process sections")
    args = ap.parse_args(argv)
    command = "python benchmarks/run.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    plan = quick_plan() if args.quick else full_plan()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = measure_all(plan, command.strip(), distributed_sections=not args.no_distributed)
    finally:
        torch.set_num_threads(threads)
    text = report.render(run)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


def measure_all(plan: Plan, command: str, distributed_sections: bool = True) -> RunResults:
    """Runs every section of ``plan`` in turn, timing each."""
    started = time.perf_counter()
    run = RunResults(command=command, rounds=plan.rounds, load_start=os.getloadavg(),
                     machine=machine(), demo_model=describe_demo_model())

    def section(name: str, fn: Callable[[], T]) -> T:
        print(f"{name} ...", flush=True)
        # No kernel compiling in the background of one section while the next is timed.
        kernels.wait_idle(timeout=600)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            run.section_seconds[name] = time.perf_counter() - t0

    run.norm_cases = section("per-collect", lambda: measure.per_collect(
        plan.norm_cases, plan.rounds, plan.budget_s))
    shape_rounds = (min(7, plan.rounds[1]), max(7, plan.rounds[1]))
    run.shapes = section("shapes", lambda: shapes.measure(
        plan.shapes, shape_rounds, plan.budget_s))
    run.collect_call = section("collect call", lambda: shapes.measure_collect_call(
        plan.collect_call, shape_rounds, plan.budget_s))
    run.mixed = section("mixed sizes", lambda: measure.mixed(
        plan.mixed_rounds, 3 * plan.budget_s, plan.mixed_big))
    run.clipping = section("clipping", lambda: measure.clipping(
        plan.mixed_rounds, plan.budget_s, plan.mixed_big))
    run.scrape_latency = section("scrape latency", lambda: measure.scrape_latency(
        plan.scrape_params, plan.scrape_rounds))
    run.spike_cost = section("spike detection", lambda: measure.spike_cost(
        plan.scrape_params, plan.spike_rounds))
    run.scale = section("scale", lambda: scale.measure(plan.scale_worlds))
    run.divergence = section("divergence", divergence_bench.measure)
    if distributed_sections:
        run.distributed = section("distributed", lambda: distributed.overhead(
            plan.models, plan.dist_steps))
        run.rank_view = section("rank view", lambda: _reported(
            lambda: rankview_bench.rank_view(plan.rank_view_blocks)))
        run.rank_view_loop = section("rank view, collect only", lambda: _reported(
            lambda: rankview_bench.rank_view(
                plan.rank_view_blocks, rankview_bench.LOOP_KINDS, collect_only=True)))
        run.fsdp1 = section("fsdp1", lambda: fsdp1_bench.fsdp1(
            plan.fsdp1_rounds, plan.fsdp1_width))
        run.guard = section("guard", lambda: _reported(
            lambda: guard_bench.guard(plan.guard_blocks)))
        run.updates = section("update stats", lambda: _reported(
            lambda: update_bench.updates(plan.update_blocks)))
        run.rank_timing = section("rank timing", lambda: _reported(
            lambda: ranktiming_bench.measure(plan.rank_timing_blocks)))
        run.zero = section("deepspeed zero-2", lambda: zero_bench.measure(plan.zero_rounds))
        run.scrapers = section("scrapers", lambda: [
            _reported(lambda sp=sp: distributed.scrapers_during_training(sp))
            for sp in plan.scrapers])
    if torch.cuda.is_available():
        run.cuda_device = torch.cuda.get_device_name()
        run.cuda_cases = section("cuda", lambda: measure.per_collect(
            plan.norm_cases, plan.rounds, plan.budget_s, device="cuda"))
    run.load_end = os.getloadavg()
    run.total_seconds = time.perf_counter() - started
    return run


def _reported(fn: Callable[[], T]) -> T | Failure:
    """``fn()``, or its failure as a result: a section that fails must not lose the others."""
    try:
        return fn()
    except Exception as exc:
        return Failure(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
