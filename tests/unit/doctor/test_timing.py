"""The one timing harness the doctor and the benchmarks share."""

from __future__ import annotations

from gradwatch.doctor.timing import interleaved, palindromic


def test_rounds_rotate_warm_and_respect_the_bounds() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved(fns, (2, 4), budget_s=1e9)
    assert calls[:3] == ["a", "b", "c"]  # one warm-up call each, untimed
    rounds = [calls[3 + 3 * r : 6 + 3 * r] for r in range(4)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_the_budget_stops_after_the_minimum_rounds() -> None:
    times = interleaved({"x": lambda: None}, (3, 1000), budget_s=0.0)
    assert len(times["x"]) == 3


def test_sync_runs_after_every_call() -> None:
    synced: list[int] = []
    interleaved({"x": lambda: None, "y": lambda: None}, (2, 2), 1e9, sync=lambda: synced.append(1))
    assert len(synced) == 1 + 2 * 2  # after the warm-ups, then after each timed call


def test_palindromic_blocks_pair_each_kind_twice_per_block() -> None:
    calls: list[tuple[str, int]] = []
    barriers: list[int] = []
    times = palindromic(
        lambda kind, i: calls.append((kind, i)), ("a", "b"), blocks=2,
        barrier=lambda: barriers.append(len(calls)), warmup_blocks=1,
    )
    assert calls == [("a", 0), ("b", 1), ("b", 2), ("a", 3),  # warm-up, untimed
                     ("a", 1000), ("b", 1001), ("b", 1002), ("a", 1003),
                     ("a", 1004), ("b", 1005), ("b", 1006), ("a", 1007)]  # fmt: skip
    assert barriers == [4, 5, 6, 7, 8, 9, 10, 11, 12]  # before each timed step, and at the end
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4}
    assert all(t >= 0 for ts in times.values() for t in ts)
