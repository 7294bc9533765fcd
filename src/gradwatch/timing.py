"""The one timing harness of gradwatch's cost figures: ``gradwatch doctor`` and ``make bench``.

Methods are timed in interleaved rounds (every method once per round, the order rotating), so
a noisy moment of a shared machine hits every method alike; the caller decides what to report
of the per-call times (the doctor: the best and the median/best spread; the benchmarks: the
median and its spread).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
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
