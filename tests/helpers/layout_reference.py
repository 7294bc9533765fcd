"""The reference layout: what every rank must derive, stated over every rank's full description.

An independent statement of the layout semantics of :mod:`gradwatch.reduce.layout` (global names in
order of first appearance, the lowest holder of each piece as its only contributor, replica
slots for the most replicated pieces, the same consistency checks), walking world x parameters
entries in plain Python. The product derives the layout from the handshake's distinct
descriptions (:func:`gradwatch.reduce.layout.derive_layout`); tests hold the two equal over
generated layouts, and use this one to state expected layouts directly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gradwatch.errors import LayoutMismatchError
from gradwatch.reduce.layout import MAX_REPLICA_SLOTS, Layout


def build_layout(per_rank: Sequence[dict[str, Any]], rank: int) -> Layout:
    """Derive the global layout from every rank's full description (pure; identical on every
    rank): the reference semantics, walking world x parameters entries. The handshake derives
    the same layout from distinct descriptions only (:func:`derive_layout`; tests prove them
    equal).

    ``per_rank[r]`` = ``{"version", "config", "pieces": [[name, shape, key, numel], ...],
    "stage": [ranks of r's stage group] or None}``.
    """
    world = len(per_rank)
    configs = {(d["version"], d["config"]) for d in per_rank}
    if len(configs) > 1:
        detail = ", ".join(
            f"rank {r}: version {d['version']} config {d['config']}" for r, d in enumerate(per_rank)
        )
        raise LayoutMismatchError(
            "gradwatch: ranks disagree on the gradwatch version or configuration "
            f"(groups, thresholds, every_n_steps, divergence_every): {detail}"
        )
    names: list[str] = []
    index: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    shape_rank: dict[str, int] = {}
    holders: dict[tuple[str, str], list[int]] = {}  # (name, key) -> ranks, ascending
    piece_numel: dict[tuple[str, str], int] = {}
    name_sets: list[set[str]] = []
    for r, d in enumerate(per_rank):
        held: set[str] = set()
        for name, shape, key, numel in d["pieces"]:
            shape = tuple(shape)
            if name in held:
                raise LayoutMismatchError(
                    f"gradwatch: rank {r} holds parameter {name!r} twice: names must be unique"
                )
            held.add(name)
            if name not in index:
                index[name] = len(names)
                names.append(name)
                shapes[name] = shape
                shape_rank[name] = r
            elif shapes[name] != shape:
                raise LayoutMismatchError(
                    f"gradwatch: parameter {name!r} has global shape {shapes[name]} on rank "
                    f"{shape_rank[name]} and {shape} on rank {r}: the ranks hold different models"
                )
            if numel == 0:
                continue  # empty shard: nothing to count
            k = (name, json.dumps(key))
            holders.setdefault(k, []).append(r)
            if piece_numel.setdefault(k, numel) != numel:
                raise LayoutMismatchError(
                    f"gradwatch: ranks {holders[k][0]} and {r} hold the same piece of {name!r} "
                    f"with different sizes ({piece_numel[k]} and {numel} elements)"
                )
        name_sets.append(held)
    _check_name_sets(per_rank, name_sets, set(names))
    # Distinct pieces must tile each parameter exactly once.
    covered: dict[str, int] = {}
    for (name, _key), numel in piece_numel.items():
        covered[name] = covered.get(name, 0) + numel
    numels = []
    for name in names:
        total = 1
        for s in shapes[name]:
            total *= s
        numels.append(total)
        if covered.get(name, 0) not in (0, total):
            raise LayoutMismatchError(
                f"gradwatch: the shards of {name!r} cover {covered.get(name, 0)} of {total} "
                "elements; its placements are not understood (please report this layout)"
            )
    replicas = max((len(h) for h in holders.values()), default=1)
    cap = MAX_REPLICA_SLOTS
    local_to_global, contributes, slots = [], [], []
    for name, _shape, key, numel in per_rank[rank]["pieces"]:
        local_to_global.append(index[name])
        if numel == 0:
            contributes.append(False)
            slots.append(-1)
            continue
        h = holders[(name, json.dumps(key))]
        contributes.append(h[0] == rank)
        at = h.index(rank)
        slots.append(at if replicas > 1 and len(h) == replicas and at < cap else -1)
    return Layout(
        names=tuple(names),
        numels=tuple(numels),
        local_to_global=tuple(local_to_global),
        contributes=tuple(contributes),
        replica_slot=tuple(slots),
        replicas=min(replicas, cap),
        world_size=world,
        rank=rank,
        hosts=tuple(str(d.get("host", "")) for d in per_rank),
        replica_groups=_replica_groups(per_rank),
        rank_view_groups=_rank_view_groups(per_rank),
    )


def _rank_view_groups(per_rank: Sequence[dict[str, Any]]) -> int:
    """G when every rank measures the rank view with the same G, else 0 (no section)."""
    declared = {int(d.get("rank_view", 0)) for d in per_rank}
    return declared.pop() if len(declared) == 1 else 0


def _replica_groups(per_rank: Sequence[dict[str, Any]]) -> tuple[tuple[int, ...], ...]:
    """The data-parallel replicas, each as its ranks: a rank's stage group (pipeline stages
    hold one replica's parts), else the rank alone; ordered by lowest rank."""
    groups = {tuple(sorted(d.get("stage") or [r])) for r, d in enumerate(per_rank)}
    return tuple(sorted(groups))


def _check_name_sets(
    per_rank: Sequence[dict[str, Any]], name_sets: list[set[str]], every: set[str]
) -> None:
    """Which ranks hold which names: the same model everywhere, or disjoint stages.

    Without stage groups every rank holds every name (replicas and shards of one model). With
    stage groups (pipeline stages, hand-split model parallelism) the ranks of one stage group
    hold disjoint names whose union is the whole model, for every stage group.
    """
    stages = [d.get("stage") for d in per_rank]
    declared = [r for r, s in enumerate(stages) if s]
    if declared and len(declared) != len(stages):
        missing = [r for r, s in enumerate(stages) if not s]
        raise LayoutMismatchError(
            f"gradwatch: ranks {declared} passed a stage_group and ranks {missing} did not: "
            "every rank must pass its stage group, or none"
        )
    if not declared:
        for r, held in enumerate(name_sets):
            if held != every:
                missing_names = sorted(every - held)[:5]
                raise LayoutMismatchError(
                    f"gradwatch: rank {r} does not hold parameters {missing_names} that other "
                    "ranks hold: the ranks hold different models (pipeline stages and hand-split "
                    "models must pass stage_group=)"
                )
        return
    for r, stage in enumerate(stages):
        assert stage is not None
        if r not in stage or any(stages[o] != stage for o in stage if o < len(stages)):
            raise LayoutMismatchError(
                f"gradwatch: the stage groups are inconsistent (rank {r} declares {stage}, "
                f"its members declare {[stages[o] for o in stage if o < len(stages)]})"
            )
        seen: dict[str, int] = {}
        for o in stage:
            for name in sorted(name_sets[o]):
                if name in seen:
                    raise LayoutMismatchError(
                        f"gradwatch: parameter name {name!r} is held by ranks {seen[name]} and "
                        f"{o} of the same stage group {stage}; pipeline stages must hold "
                        "disjoint parameter names"
                    )
                seen[name] = o
        if set(seen) != every:
            missing_names = sorted(every - set(seen))[:5]
            raise LayoutMismatchError(
                f"gradwatch: stage group {stage} does not hold parameters {missing_names} that "
                "other stage groups hold: the ranks hold different models"
            )
