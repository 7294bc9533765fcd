"""Plain per-rank experts: expert parallelism whose experts are ordinary tensors.

Under expert parallelism (EP) each rank of an EP group holds a different subset of a mixture
of experts' experts. With DTensors (torchtitan: a stacked ``[experts, ...]`` weight
``Shard(0)`` over an ``"ep"`` mesh dim) the placements say so and the handshake needs nothing
more. With plain tensors (Megatron-style local experts) every rank holds ordinary
``nn.Parameter``s, and only their names can tell them apart: gradwatch needs

* a name unique to each expert (its global index: ``layers.0.experts.5.w1`` on the rank holding
  expert 5, never the rank-local index, which coincides across EP ranks and would read as
  copies of one tensor), and
* the declaration :attr:`gradwatch.WatchConfig.expert_parameters` (fnmatch patterns): a
  parameter whose name matches may be absent from some ranks. Every other name must be held as
  usual (by every rank, or, with ``stage_group=``, by one rank of each stage group), and a
  declared name held by exactly the ranks of a non-expert parameter is refused
  (:func:`check_expert_holders`).

An expert name is then counted once, from the lowest rank holding it (its copies across the
expert-data-parallel group are replicas, like DDP's). This module holds the pure rules, applied
identically on every rank by the handshake (:func:`gradwatch.reduce.handshake.derive`); it imports
nothing of torch.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from gradwatch.errors import LayoutMismatchError


def expert_names(names: Iterable[str], patterns: Sequence[str]) -> frozenset[str]:
    """The names matching one of ``patterns`` (case-sensitive ``fnmatch``, as groups)."""
    if not patterns:
        return frozenset()
    return frozenset(
        n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)
    )


def check_expert_holders(
    experts: frozenset[str], name_sets: Sequence[frozenset[str]], world_size: int
) -> None:
    """Refuse declared expert names held by exactly the ranks that hold some other parameter.

    ``name_sets``: the names held by each digest group (ranks with one description). Plain
    per-rank experts split the ranks that hold the rest of their layer (every rank, or the
    ranks of one pipeline stage): each expert is held by its expert-data-parallel group only.
    An expert name held by the very same ranks as a non-expert parameter means the local names
    coincide across EP ranks (``experts.0`` on each rank for different experts): counted once,
    as replicas, the norm would silently miss the other ranks' experts. Raises
    :class:`LayoutMismatchError` (the same on every rank). O(groups x names).
    """
    if world_size < 2 or not experts or not name_sets:
        return
    holders: dict[str, set[int]] = {}
    for g, names in enumerate(name_sets):
        for name in names:
            holders.setdefault(name, set()).add(g)
    others = {frozenset(h): n for n, h in sorted(holders.items()) if n not in experts}
    coinciding = sorted(n for n in experts if frozenset(holders.get(n, ())) in others)
    if coinciding:
        like = others[frozenset(holders[coinciding[0]])]
        raise LayoutMismatchError(
            f"gradwatch: expert parameter(s) {coinciding[:5]} (declared by expert_parameters) "
            f"are held by exactly the ranks that hold {like!r}, which is not an expert: plain "
            "per-rank experts must be named by their global expert index, unique across the "
            "expert-parallel group, or their copies on different ranks read as replicas of one "
            "tensor. Rename the experts, or remove them from expert_parameters if those ranks "
            "really hold every expert (no expert parallelism)"
        )
