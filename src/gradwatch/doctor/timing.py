"""The one timing harness of gradwatch's cost figures: ``gradwatch doctor`` and ``make bench``.

Methods are timed in interleaved rounds (every method once per round, the order rotating), so
a noisy moment of a shared machine hits every method alike; the caller decides what to report
of the per-call times (the doctor: the best and the median/best spread; the benchmarks: the
median and its spread). Steps of a multi-process job are timed in palindromic blocks
(:func:`palindromic`), a barrier before each, so every rank times the same step at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

K = TypeVar("K")


def interleaved(
    fns: Mapping[K, Callable[[], Any]],
    rounds: tuple[int, int],
    budget_s: float,
    sync: Callable[[], None] | None = None,
) -> dict[K, list[float]]:
    """Per-method wall times (seconds per call) over rounds that run every method once.

    One warm-up call each; then at least ``rounds[0]`` rounds, more until ``rounds[1]`` or
    ``budget_s`` seconds. The method order rotates each round (no method always runs first).
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs after each call, inside its time.
    """
    names = list(fns)
    for fn in fns.values():
        fn()
    if sync:
        sync()
    times: dict[K, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds[1]):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            if sync:
                sync()
            times[name].append(time.perf_counter() - t0)
        if r + 1 >= rounds[0] and time.perf_counter() - start > budget_s:
            break
    return times


def palindromic(
    step: Callable[[K, int], Any],
    kinds: Sequence[K],
    blocks: int,
    barrier: Callable[[], Any] | None = None,
    warmup_blocks: int = 3,
) -> dict[K, list[float]]:
    """Per-kind wall times (seconds) of ``step(kind, i)`` over ``blocks`` palindromic blocks.

    A block runs every kind once, then once more in reverse order (``a b c c b a``), so a
    linear drift cancels within a block and a kind's two times of block ``k`` are its samples
    ``2k`` and ``2k + 1`` (what a paired ratio pairs). ``warmup_blocks`` untimed blocks run
    first (``i`` from 0); the timed steps get ``i`` from 1000 on. ``barrier`` (e.g.
    ``torch.distributed.barrier``) runs before each timed step, outside its time, and once
    after the last, so every rank of a job times the same step at once.
    """
    block = (*kinds, *reversed(kinds))
    for i in range(warmup_blocks * len(block)):
        step(block[i % len(block)], i)
    times: dict[K, list[float]] = {kind: [] for kind in kinds}
    for i in range(blocks * len(block)):
        kind = block[i % len(block)]
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        step(kind, 1000 + i)
        times[kind].append(time.perf_counter() - t0)
    if barrier is not None:
        barrier()
    return times
