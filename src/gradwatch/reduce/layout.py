"""The global layout, pure: pieces, the agreed layout, and its derivation.

Nothing here issues a collective or reads a device: given what the handshake
(:mod:`gradwatch.reduce.handshake`) gathered, every rank computes the same :class:`Layout`.

**Layout (construction, once).** Every rank describes the parameter *pieces* it holds: the
parameter's name, its global shape, and a piece key. A plain tensor is one piece ("whole"); a
DTensor's piece key is its coordinates on the mesh dimensions where its placement is a Shard
(``_StridedShard`` included). Ranks holding the same key of the same name hold identical copies
(DDP replicas, the replicate dim of HSDP, TP-replicated weights, copies on other coordinates of a
larger world mesh that the tensor's own mesh does not cover). The handshake
(:mod:`gradwatch.reduce.handshake`: fixed-size digests first, each distinct description once) shares
the descriptions; every rank then derives the same global layout:

* the global parameter list, in order of first appearance over ranks 0..W-1;
* for each piece, its *contributor*: the lowest rank holding it. Only contributors add the piece's
  squared norm, so replicas are counted once, exactly (masking, not weighting by 1/k);
* consistency checks raised identically on every rank (:class:`LayoutMismatchError`): differing
  configuration hashes or versions, a name with different global shapes, pieces that do not tile
  the parameter (numel of distinct pieces != global numel), a name held by two ranks of the same
  pipeline stage group.

:func:`derive_layout` computes it from the handshake's distinct descriptions without walking
world x parameters entries; the tests hold it against an independent reference over every
rank's full description (``tests/helpers/layout_reference.py``).

**Deriving the layout** (:func:`derive`, pure, identical on every rank) works on the distinct
descriptions plus the per-rank records, never on world x parameters entries: parameters with
the same holders pattern (the same digest groups, specs and mesh slots) form a *class*; the
ranks of a class are partitioned once by their piece keys (coordinates on the spec's dims), and
every parameter of the class shares that partition. Derived numels cost no ``world x
parameters`` walk either: the ranks of a cell share coordinates, hence (one rule, one mesh
shape) equal pieces, all empty or all not; when the cells are the whole coordinate grid of the
spec's mesh dims the rule's pieces tile every parameter exactly once (no sum needed), and the
largest cell holding elements is found without a numel when the cells are of one size; only the
rank's own pieces are computed. Classes mixing explicit and derived numels, or covering part of
a grid (the records path), are checked piece by piece (``cells x parameters`` of that class,
vectorized over cells).
Work is about ``distinct descriptions x parameters + classes x world``. The result equals the
tests' reference layout builder (``tests/helpers/layout_reference.py``) on the full per-rank
descriptions (tests prove it over generated layouts): global names in order of first appearance
over ranks, the lowest holder of each piece as its only contributor, replica slots for the most
replicated pieces, and the same consistency checks. Mismatches raise
:class:`LayoutMismatchError` on every rank alike, naming the digest groups (their ranks) and
one differing parameter.

**Replica slots are capped** at :data:`MAX_REPLICA_SLOTS`: under DDP the number of identical
copies R equals the world size, so beyond the cap the divergence compares the copies held by
the lowest-ranked :data:`MAX_REPLICA_SLOTS` holders (a sample; the per-step payload stays
bounded).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from gradwatch.errors import LayoutMismatchError, UnsupportedParallelismError
from gradwatch.reduce.experts import check_expert_holders, expert_names
from gradwatch.reduce.handshake import (
    DERIVED_NESTED,
    MAX_COORDS,
    Description,
    Gathered,
    _flat_rule,
    _placement_rule,
    spec_numel,
    stage_digest,
)
from gradwatch.reduce.sections import sections

MAX_REPLICA_SLOTS = 64


@dataclass(frozen=True)
class LocalPiece:
    """What one rank holds of one parameter."""

    name: str
    global_shape: tuple[int, ...]
    key: tuple[Any, ...]  # identifies the piece; equal keys on two ranks = identical copies
    numel: int  # elements of the local piece (0 for an empty shard)
    # A DTensor's mesh (None: plain tensor, or a key given as is) and this rank's coordinates
    # on it: the handshake describes the piece relative to the mesh (see
    # gradwatch.reduce.handshake).
    mesh: Any = field(default=None, compare=False)
    coords: tuple[int, ...] = ()
    mesh_shape: tuple[int, ...] = ()  # the mesh's shape (empty: unknown)


@dataclass(frozen=True)
class Layout:
    """The agreed global layout, identical on every rank, plus this rank's view of it."""

    names: tuple[str, ...]  # global parameter list
    numels: tuple[int, ...]  # global numel of each parameter
    local_to_global: tuple[int, ...]  # for each local parameter, its global index
    contributes: tuple[bool, ...]  # for each local parameter: does this rank count its piece
    replica_slot: tuple[int, ...]  # for each local parameter: replica slot or -1
    replicas: int  # R: the largest number of identical copies of a piece
    world_size: int
    rank: int
    # -- the rank view (additive): hosts and replicas from the handshake, the section's width
    hosts: tuple[str, ...] = ()  # per rank: its host name (the handshake's "host")
    replica_groups: tuple[tuple[int, ...], ...] = ()  # data-parallel replicas: ranks of each
    rank_view_groups: int = 0  # G: groups per rank slot; 0 = no rank-view section
    # Every rank holds every parameter whole and DDP all-reduces their gradients over the world
    # (replicated_and_synced): a collect needs gradwatch's all-reduce only on
    # divergence steps and with the rank view (Reducer.issues_collective)
    replicated_synced: bool = False
    update_groups: int = 0  # groups of the update section (gradwatch.norms.updates); 0 = none
    rank_timing: bool = False  # the timing section (gradwatch.reduce.ranktiming), agreed by hash

    @property
    def rank_view_slots(self) -> bool:
        """One slot per rank (``W <= RANK_SLOTS_MAX_WORLD``), else bounded sums."""
        return self.world_size <= RANK_SLOTS_MAX_WORLD

    @property
    def size(self) -> int:
        return len(self.names)

    @property
    def packed_length(self) -> int:
        return sections(self).length


#: Up to this many ranks the rank view carries one slot per rank (``W x (G + 1)`` float64:
#: 8 KiB at 256 ranks and 3 groups); beyond it, bounded sums of ``2G + 3`` values.
RANK_SLOTS_MAX_WORLD = 256


def piece_of(name: str, param: Tensor) -> LocalPiece:
    """Describe the local piece of ``param`` (a plain tensor or a DTensor).

    Every mesh dimension whose placement is not ``Replicate`` contributes the rank's coordinate
    to the key: ``Shard`` and ``_StridedShard`` (FSDP2 over a tensor-parallel dim; it is *not*
    a ``Shard`` subclass and its ``is_shard()`` is False) and any placement this version does
    not know. Treating an unknown placement as a shard is the safe side: if it was a copy after
    all, the tiling check of :func:`derive_layout` refuses the layout on every rank instead of
    double counting. ``Partial`` is refused (a squared norm of a partial sum is meaningless).
    """
    spec = getattr(param, "_spec", None)
    if spec is None or not hasattr(param, "_local_tensor"):
        return LocalPiece(name, tuple(param.shape), ("whole",), param.numel())
    mesh = param.device_mesh
    return piece_from_placements(
        name,
        tuple(param.shape),
        param.placements,
        mesh,
        mesh.get_coordinate(),
        param._local_tensor.numel(),
        mesh_shape=tuple(mesh.shape),
    )


def piece_from_placements(
    name: str,
    global_shape: tuple[int, ...],
    placements: Sequence[Any],
    mesh: Any,
    coords: Sequence[int] | None,
    numel: int,
    mesh_shape: Sequence[int] = (),
) -> LocalPiece:
    """The piece of a DTensor from its placements, its mesh (any hashable identity), this
    rank's coordinates on it (None: not in the mesh) and the mesh's shape (empty: unknown;
    with it the handshake describes standard uneven shards alike on every rank); pure, so
    simulations describe fake ranks with the code real ones use."""
    key: list[Any] = []
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise UnsupportedParallelismError(
                f"gradwatch: parameter {name!r} has a Partial placement on mesh dim {dim}; "
                "squared norms of partial sums are meaningless before the reduction"
            )
        if placement.is_replicate():
            continue
        key.append((dim, coords[dim] if coords is not None else -1, repr(placement)))
    return LocalPiece(
        name,
        tuple(global_shape),
        tuple(key),
        numel,
        mesh=mesh,
        coords=tuple(coords) if coords is not None else (-1,) * len(placements),
        mesh_shape=tuple(mesh_shape),
    )


def derive_layout(gathered: Gathered, rank: int, experts: Sequence[str] = ()) -> Layout:
    """The layout from the handshake's distinct descriptions and per-rank records (pure;
    equal to the tests' reference over the full descriptions). ``experts``: the
    ``expert_parameters`` patterns (:mod:`gradwatch.reduce.experts`)."""
    return Layout(
        *derive(gathered, rank, experts),
        world_size=len(gathered.rank_group),
        rank=rank,
        hosts=gathered.hosts,
        replica_groups=replica_groups(gathered),
        rank_view_groups=rank_view_groups(gathered),
        replicated_synced=replicated_and_synced(gathered),
    )


def replica_groups(gathered: Gathered) -> tuple[tuple[int, ...], ...]:
    """The data-parallel replicas, each as its ranks: a rank's stage group (pipeline stages
    hold one replica's parts), else the rank alone; ordered by lowest rank. O(world)."""
    stages: dict[bytes, list[int]] = {}
    groups: list[tuple[int, ...]] = []
    for r, rec in enumerate(gathered.records):
        if rec.stage_size:
            stages.setdefault(rec.stage_digest, []).append(r)
        else:
            groups.append((r,))
    groups += [tuple(members) for members in stages.values()]
    return tuple(sorted(groups))


def replicated_and_synced(gathered: Gathered) -> bool:
    """Every rank holds every parameter whole and declares its gradients all-reduced over the
    world by DDP: after backward each rank's gradients are the reduced ones, so the statistics
    a rank computes alone equal the all-reduced statistics. One description shared by every
    rank, of whole plain tensors only, declared synced: identical on every rank by
    construction."""
    if len(gathered.rank_group) < 2 or len(gathered.descriptions) != 1:
        return False
    desc = gathered.descriptions[0]
    return (
        desc.synced
        and not desc.stage
        and all(slot < 0 and spec == ("whole",) for _n, _s, spec, slot, _numel in desc.pieces)
    )


def rank_view_groups(gathered: Gathered) -> int:
    """G when every rank measures the per-rank view with the same G, else 0 (no section)."""
    declared = {d.rank_view for d in gathered.descriptions}
    return declared.pop() if len(declared) == 1 else 0


class Derived(NamedTuple):
    """The agreed layout's fields (see :class:`Layout`)."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    local_to_global: tuple[int, ...]
    contributes: tuple[bool, ...]
    replica_slot: tuple[int, ...]
    replicas: int


def ranks_text(ranks: Sequence[int], limit: int = 6) -> str:
    """``0-3, 8, 10-11``: ranks as ranges (ascending input), at most ``limit`` ranges."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:limit])
    more = sum(b - a + 1 for a, b in spans[limit:])
    return f"ranks {text}" + (f" and {more} more" if more else "")


def _groups_text(members: Sequence[Sequence[int]], which: Sequence[int]) -> str:
    return "; ".join(f"digest group {g} ({ranks_text(members[g])})" for g in which)


def derive(gathered: Gathered, rank: int, experts: Sequence[str] = ()) -> Derived:
    """Every rank's layout from the distinct descriptions and the per-rank records (pure).

    ``experts``: the ``expert_parameters`` patterns (the same on every rank: the configuration
    hash covers them); names matching one may be held by some ranks only
    (:mod:`gradwatch.reduce.experts`)."""
    descs, rank_group, records = (gathered.descriptions, gathered.rank_group,
                                  gathered.records)
    members: list[list[int]] = [[] for _ in descs]
    for r, g in enumerate(rank_group):
        members[g].append(r)
    overflow = [r for r, rec in enumerate(records) if rec.overflow]
    if overflow:
        raise UnsupportedParallelismError(
            f"gradwatch: {ranks_text(overflow)} hold parameters on meshes with more than "
            f"{MAX_COORDS} coordinates in total"
        )
    if len({(d.version, d.config) for d in descs}) > 1:
        detail = "; ".join(
            f"digest group {g} ({ranks_text(members[g])}): version {d.version} config {d.config}"
            for g, d in enumerate(descs)
        )
        raise LayoutMismatchError(
            "gradwatch: ranks disagree on the gradwatch version or configuration "
            f"(groups, thresholds, every_n_steps, divergence_every): {detail}"
        )
    # Names and shapes, in order of first appearance over ranks: only each group's lowest rank
    # can introduce a name, and the groups are numbered in that order.
    names: list[str] = []
    index: dict[str, int] = {}
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    name_sets: list[frozenset[str]] = []
    for g, d in enumerate(descs):
        held = [p[0] for p in d.pieces]
        name_sets.append(frozenset(held))
        if len(name_sets[g]) != len(held):
            twice = next(n for i, n in enumerate(held) if n in held[:i])
            raise LayoutMismatchError(
                f"gradwatch: {ranks_text(members[g])} (digest group {g}) hold parameter "
                f"{twice!r} twice: names must be unique"
            )
        for name, shape, _spec, _slot, _numel in d.pieces:
            if name not in index:
                index[name] = len(names)
                names.append(name)
                shapes[name] = (shape, g)
            elif shapes[name][0] != shape:
                first_shape, h = shapes[name]
                raise LayoutMismatchError(
                    f"gradwatch: parameter {name!r} has global shape {first_shape} on "
                    f"{_groups_text(members, [h])} and {shape} on {_groups_text(members, [g])}: "
                    "the ranks hold different models"
                )
    every = frozenset(names)
    optional = expert_names(names, experts)
    check_expert_holders(optional, name_sets, len(rank_group))
    _check_name_sets(gathered, members, name_sets, every - optional)
    # Classes: parameters held (non-empty, or with numels derived from the spec) by the same
    # groups with the same specs, mesh slots and numel kind share one partition of ranks into
    # pieces.
    sigs: dict[str, list[tuple[int, int, Any, int]]] = {}
    numel_of: list[dict[str, int]] = []
    for g, d in enumerate(descs):
        numel_of.append({p[0]: p[4] for p in d.pieces})
        for name, _shape, spec, slot, numel in d.pieces:
            if numel:
                sigs.setdefault(name, []).append((g, slot, spec, min(numel, 0)))
    classes: dict[tuple[Any, ...], list[str]] = {}
    for name in names:
        if name in sigs:
            classes.setdefault(tuple(sigs[name]), []).append(name)
    replicas = 1
    mine: dict[Any, tuple[int, int, int]] = {}  # class or name -> (lowest, position, size)
    offsets = [_slot_offsets(d.meshes) for d in descs]
    for sig, class_names in classes.items():
        cells: dict[Any, list[int]] = {}
        for g, slot, spec, _kind in sig:
            if slot < 0:
                cells.setdefault(spec, []).extend(members[g])
                continue
            base = offsets[g][slot]
            dims = [(base + dim, dim, placement) for dim, placement in spec]
            for r in members[g]:
                c = records[r].coords
                key = tuple((dim, c[at], placement) for at, dim, placement in dims)
                cells.setdefault(key, []).append(r)
        if len(sig) > 1:
            for cell in cells.values():
                cell.sort()  # several groups' ranks interleave
        g0, slot0, spec0, kind0 = sig[0]
        if not any(kind for _g, _slot, _spec, kind in sig):
            _check_cells(cells, class_names, sig, rank_group, members, numel_of, shapes)
            replicas = max([replicas, *map(len, cells.values())])
        elif all(kind == kind0 and spec == spec0 and descs[g].meshes[slot] ==
                 descs[g0].meshes[slot0] for g, slot, spec, kind in sig) and _whole_grid(
                     cells, spec0, descs[g0].meshes[slot0]):
            # One rule on one mesh shape (one group, or groups differing elsewhere), every
            # coordinate of the spec's dims held: the derived pieces tile every parameter
            # exactly once (spec_numel's rule), and the ranks of a cell hold equal pieces,
            # all empty or all not. Work: cells, not cells x parameters.
            replicas = max(replicas, _largest_held(cells, class_names, shapes, spec0,
                                                   descs[g0].meshes[slot0], kind0))
        else:
            # Explicit and derived numels mixed, or a partial grid (the records path): piece
            # by piece, cells x parameters of this class.
            replicas = max(replicas, _check_pieces(
                cells, class_names, sig, rank_group, members, numel_of, shapes, descs,
                rank, mine))
            continue
        for g, slot, spec, _kind in sig:
            if g == rank_group[rank]:
                if slot < 0:
                    cell = cells[spec]
                else:
                    c, base = records[rank].coords, offsets[g][slot]
                    cell = cells[tuple((dim, c[base + dim], pl) for dim, pl in spec)]
                mine[sig] = (cell[0], cell.index(rank), len(cell))
    numels = [math.prod(shapes[name][0]) for name in names]
    local_to_global, contributes, slots = [], [], []
    g = rank_group[rank]
    for name, shape, spec, slot, numel in descs[g].pieces:
        local_to_global.append(index[name])
        if numel < 0:
            c, base = records[rank].coords, offsets[g][slot]
            numel = spec_numel(shape, spec, descs[g].meshes[slot],
                               [c[base + dim] for dim, _pl in spec],
                               nested=numel == DERIVED_NESTED) or 0
        if numel == 0:
            contributes.append(False)
            slots.append(-1)
            continue
        lowest, position, size = mine.get(name) or mine[tuple(sigs[name])]
        contributes.append(lowest == rank)
        slots.append(
            position if replicas > 1 and size == replicas and position < MAX_REPLICA_SLOTS
            else -1
        )
    return Derived(tuple(names), tuple(numels), tuple(local_to_global), tuple(contributes),
                   tuple(slots), min(replicas, MAX_REPLICA_SLOTS))


def _slot_offsets(meshes: Sequence[Sequence[int]]) -> list[int]:
    out, at = [], 0
    for shape in meshes:
        out.append(at)
        at += len(shape)
    return out


def _whole_grid(cells: dict[Any, list[int]], spec: Sequence[tuple[int, Any]],
                mesh_shape: Sequence[int]) -> bool:
    """The cells are every coordinate of the spec's mesh dims, once each (the cells' keys are
    distinct, so counting the in-range ones suffices)."""
    grid = math.prod([mesh_shape[dim] for dim, _pl in spec])
    return len(cells) == grid and all(
        0 <= c < mesh_shape[dim] for key in cells for dim, c, _pl in key)


def _largest_held(cells: dict[Any, list[int]], class_names: Sequence[str],
                  shapes: dict[str, tuple[tuple[int, ...], int]],
                  spec: Sequence[tuple[int, Any]], mesh_shape: Sequence[int],
                  kind: int) -> int:
    """The largest cell holding a non-empty piece of some parameter of the class (1 when
    none does): over a whole grid a parameter with elements has a non-empty piece, so cells
    of one size need no numel at all; otherwise cells are tried largest first."""
    if not any(math.prod(shapes[name][0]) for name in class_names):
        return 1
    sizes = {len(cell) for cell in cells.values()}
    if len(sizes) == 1:
        return sizes.pop()
    for key, cell in sorted(cells.items(), key=lambda kv: -len(kv[1])):
        at = [c for _dim, c, _pl in key]
        if any(spec_numel(shapes[name][0], spec, mesh_shape, at, nested=kind == DERIVED_NESTED)
               for name in class_names):
            return len(cell)
    return 1


def _check_pieces(
    cells: dict[Any, list[int]], class_names: Sequence[str],
    sig: Sequence[tuple[int, int, Any, int]], rank_group: Sequence[int],
    members: Sequence[Sequence[int]], numel_of: Sequence[dict[str, int]],
    shapes: dict[str, tuple[tuple[int, ...], int]], descs: Sequence[Description], rank: int,
    mine: dict[Any, tuple[int, int, int]],
) -> int:
    """A class whose groups' numels may differ cell by cell (explicit and derived mixed, or a
    partial grid): each piece's holders are the ranks of its cell whose numel there is not
    zero; they agree on its size and the pieces tile each parameter once. Records
    ``mine[name]`` for ``rank``; returns the most holders of a piece (1 when none).
    Vectorized over cells (int64 tensors): a few tensor ops per parameter, not a Python step
    per cell and parameter."""
    keys = list(cells)
    groups = list(dict.fromkeys(g for g, _slot, _spec, _kind in sig))
    col = {g: i for i, g in enumerate(groups)}
    pairs = [(k, col[rank_group[r]]) for k, key in enumerate(keys) for r in cells[key]]
    count = torch.zeros(len(keys) * len(groups), dtype=torch.int64)
    count.index_add_(0, torch.tensor([k * len(groups) + c for k, c in pairs], dtype=torch.int64),
                     torch.ones(len(pairs), dtype=torch.int64))
    count = count.view(len(keys), len(groups))
    present = count > 0
    where: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # derived group -> (cells, coords)
    for g, _slot, spec, kind in sig:
        if kind:
            at = present[:, col[g]].nonzero().flatten()
            where[g] = at, torch.tensor([[c for _d, c, _pl in keys[k]] for k in at.tolist()],
                                        dtype=torch.int64).view(len(at), len(spec))
    own_k = next((k for k, key in enumerate(keys) if rank in cells[key]), None)
    largest = 1
    for name in class_names:
        shape = shapes[name][0]
        size = torch.zeros(len(keys), len(groups), dtype=torch.int64)
        for g, slot, spec, kind in sig:
            if kind:
                at, coords = where[g]
                size[at, col[g]] = _spec_numels(shape, spec, descs[g].meshes[slot], coords,
                                                kind == DERIVED_NESTED)
            else:
                size[:, col[g]] = numel_of[g][name]
        held = present & (size > 0)
        top = torch.where(held, size, -1).max(1).values
        low = torch.where(held, size, top.max() + 1).min(1).values
        bad = (held.any(1) & (top != low)).nonzero().flatten()
        if len(bad):
            k = int(bad[0])
            order = [g for g in dict.fromkeys(rank_group[r] for r in cells[keys[k]])
                     if held[k, col[g]]]
            a = order[0]
            b = next(g for g in order if int(size[k, col[g]]) != int(size[k, col[a]]))
            raise LayoutMismatchError(
                f"gradwatch: {_groups_text(members, [a, b])} hold the same piece of "
                f"{name!r} with different sizes ({int(size[k, col[a]])} and "
                f"{int(size[k, col[b]])} elements)"
            )
        covered = int(top.clamp(min=0).sum())
        if covered not in (0, math.prod(shape)):
            raise LayoutMismatchError(
                f"gradwatch: the shards of {name!r} cover {covered} of {math.prod(shape)} "
                "elements; its placements are not understood (please report this layout)"
            )
        largest = max(largest, int((count * held).sum(1).max()) if len(keys) else 1)
        if own_k is not None and held[own_k, col[rank_group[rank]]]:
            holders = [r for r in cells[keys[own_k]] if held[own_k, col[rank_group[r]]]]
            mine[name] = (holders[0], holders.index(rank), len(holders))
    return largest


def _spec_numels(global_shape: Sequence[int], spec: Sequence[tuple[int, Any]],
                 mesh_shape: Sequence[int], coords: torch.Tensor, nested: bool) -> torch.Tensor:
    """:func:`spec_numel` at many coordinates at once (``coords``: int64 ``(n, len(spec))``,
    every row valid: the ranks there derived their numel with it); tests hold the two equal."""
    if (flat := _flat_rule(spec)) is not None:
        mesh_dim, start, total = flat
        full = -(-total // mesh_shape[mesh_dim])
        end = min(start + math.prod(global_shape), total)
        at = coords[:, 0]
        return (torch.clamp(full * (at + 1), max=end) - torch.clamp(full * at, min=start)
                ).clamp(min=0)
    local = [torch.full((coords.shape[0],), s, dtype=torch.int64) for s in global_shape]
    steps = []
    for i, (mesh_dim, placement) in enumerate(spec):
        tdim, factor = _placement_rule(placement) or (0, 0)
        steps.append((tdim, 0 if nested else factor, mesh_shape[mesh_dim], coords[:, i],
                      nested and factor > 0))
    if nested:
        steps.sort(key=lambda step: step[4])
    for tdim, factor, parts, at, _strided in steps:
        size = local[tdim]
        if factor == 0:
            local[tdim] = _chunks(size, parts, at)
        else:
            local[tdim] = sum((_chunks(_chunks(size, factor, torch.full_like(at, j)), parts, at)
                               for j in range(factor)), torch.zeros_like(at))
    total = torch.ones(coords.shape[0], dtype=torch.int64)
    for s in local:
        total = total * s
    return total


def _chunks(size: torch.Tensor, parts: int, at: torch.Tensor) -> torch.Tensor:
    """:func:`_chunk` elementwise."""
    full = (size + parts - 1) // parts
    return (torch.minimum(size, full * (at + 1)) - full * at).clamp(min=0)


def _check_cells(
    cells: dict[Any, list[int]], class_names: Sequence[str],
    sig: Sequence[tuple[int, int, Any, int]], rank_group: Sequence[int],
    members: Sequence[Sequence[int]], numel_of: Sequence[dict[str, int]],
    shapes: dict[str, tuple[tuple[int, ...], int]],
) -> None:
    """Holders of one piece agree on its size; distinct pieces tile each parameter once (every
    numel explicit)."""
    groups = [g for g, _slot, _spec, _kind in sig]
    per_group = {g: 0 for g in groups}  # distinct pieces whose lowest holder is in group g
    seen_sets: set[tuple[int, ...]] = set()
    for cell in cells.values():
        if len(groups) == 1:
            per_group[groups[0]] += 1
            continue
        in_cell = tuple(sorted({rank_group[r] for r in cell}))
        per_group[rank_group[min(cell)]] += 1
        if len(in_cell) > 1 and in_cell not in seen_sets:
            seen_sets.add(in_cell)
            for name in class_names:
                sizes = {numel_of[g][name] for g in in_cell}
                if len(sizes) > 1:
                    a, b = in_cell[0], next(g for g in in_cell if numel_of[g][name] !=
                                            numel_of[in_cell[0]][name])
                    raise LayoutMismatchError(
                        f"gradwatch: {_groups_text(members, [a, b])} hold the same piece of "
                        f"{name!r} with different sizes ({numel_of[a][name]} and "
                        f"{numel_of[b][name]} elements)"
                    )
    for name in class_names:
        total = 1
        for s in shapes[name][0]:
            total *= s
        covered = sum(n * numel_of[g][name] for g, n in per_group.items())
        if covered not in (0, total):
            raise LayoutMismatchError(
                f"gradwatch: the shards of {name!r} cover {covered} of {total} elements; its "
                "placements are not understood (please report this layout)"
            )


def _check_name_sets(gathered: Gathered, members: Sequence[Sequence[int]],
                     name_sets: Sequence[frozenset[str]], every: frozenset[str]) -> None:
    """The same model everywhere, or disjoint stages covering it (see
    the tests' reference layout builder), decided per digest group and per distinct stage
    group composition. ``every``: the names each rank (or stage group) must hold, declared
    plain per-rank experts excluded (they are held by some ranks only)."""
    rank_group, records = gathered.rank_group, gathered.records
    declared = [r for r, rec in enumerate(records) if rec.stage_size]
    if declared and len(declared) != len(records):
        missing = [r for r, rec in enumerate(records) if not rec.stage_size]
        raise LayoutMismatchError(
            f"gradwatch: {ranks_text(declared)} passed a stage_group and {ranks_text(missing)} "
            "did not: every rank must pass its stage group, or none"
        )
    if not declared:
        for g, held in enumerate(name_sets):
            if not every <= held:
                missing_names = sorted(every - held)[:5]
                others = [h for h, s in enumerate(name_sets) if s != held][:1]
                raise LayoutMismatchError(
                    f"gradwatch: {_groups_text(members, [g])} do not hold parameters "
                    f"{missing_names} that {_groups_text(members, others)} hold: the ranks "
                    "hold different models (pipeline stages and hand-split models must pass "
                    "stage_group=; plain per-rank experts must be declared in "
                    "expert_parameters)"
                )
        return
    stages: dict[bytes, list[int]] = {}
    for r, rec in enumerate(records):
        stages.setdefault(rec.stage_digest, []).append(r)
    checked: set[tuple[int, ...]] = set()
    for dg, stage in stages.items():
        size = records[stage[0]].stage_size
        if stage_digest(stage) != dg or any(records[o].stage_size != size for o in stage):
            raise LayoutMismatchError(
                f"gradwatch: the stage groups are inconsistent ({ranks_text(stage)} declare a "
                f"stage group of {size} ranks that is not exactly them)"
            )
        composition = tuple(rank_group[o] for o in stage)
        if composition in checked:
            continue
        checked.add(composition)
        seen: dict[str, int] = {}
        for o in stage:
            for name in sorted(name_sets[rank_group[o]] & every):
                if name in seen:
                    raise LayoutMismatchError(
                        f"gradwatch: parameter name {name!r} is held by ranks {seen[name]} and "
                        f"{o} of the same stage group ({ranks_text(stage)}); pipeline stages "
                        "must hold disjoint parameter names"
                    )
                seen[name] = o
        if not every <= set(seen):
            missing_names = sorted(every - set(seen))[:5]
            raise LayoutMismatchError(
                f"gradwatch: stage group ({ranks_text(stage)}) does not hold parameters "
                f"{missing_names} that other stage groups hold: the ranks hold different models "
                "(plain per-rank experts must be declared in expert_parameters)"
            )
