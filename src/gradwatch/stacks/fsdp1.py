"""FSDP1 (``FullyShardedDataParallel``): its flat shards as the handshake's pieces, and its
gradients read every collect, per original parameter, without a copy.

**The layout FSDP1 keeps** (torch's ``torch/distributed/fsdp/_flat_param.py``). Each wrapped
unit owns one ``FlatParameter``: its original parameters flattened and laid end to end
(``_numels_with_padding``, ``_is_padding_mask``: under ``use_orig_params=True`` alignment
padding sits between them), ``total`` elements, cut into ``torch.chunk`` pieces over the unit's
shard group and padded at the end to equal sizes. So original parameter ``i`` occupies elements
``[start_i, start_i + numel_i)`` of the unsharded flat parameter, and the rank at shard
coordinate ``c`` holds their intersection with its chunk ``[c * ceil(total / s),
(c + 1) * ceil(total / s))``, at the offset ``_shard_param_infos`` records. Padding never
belongs to a parameter, so it is never counted.

**Pieces** (:func:`resolve`). Every rank describes every original parameter (clean name,
original shape) with the placement ``FlatShard(start, total)`` on the shard mesh dim
(:func:`gradwatch.reduce.handshake.flat_shard`); the handshake derives every rank's slice from it
(:func:`gradwatch.reduce.handshake.spec_numel`), so every rank's description is the same and the
fixed-size phase-0 vote suffices. Constructing GradWatch checks the derived slices against
FSDP's own ``_shard_param_infos`` on this rank (a torch whose FSDP1 lays shards out otherwise
is refused, never measured). By sharding strategy:

* ``FULL_SHARD``, ``SHARD_GRAD_OP``: a one-dim mesh, the shard group; disjoint slices, summed.
* ``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``: a (replicate, shard) mesh from the unit's inter-
  and intra-node groups (or its ``device_mesh``): slices summed over the shard dim, each
  replica counted once (its lowest rank contributes).
* ``NO_SHARD``: every rank holds every parameter whole, gradients all-reduced by FSDP: whole
  pieces, replicas counted once; with every unit over the whole world, collects may skip
  gradwatch's all-reduce as under DDP (:meth:`Fsdp1Model.reduces_every_gradient`).

Parameters FSDP does not manage (``ignored_modules``) are plain pieces, as without FSDP.

**Gradients** (:class:`Fsdp1GradientReader`). ``use_orig_params=True``: each original
parameter's ``.grad``, which FSDP sets to a view of its slice of the flat gradient (None where
the rank holds none of it). ``use_orig_params=False``: the flat parameter's ``.grad`` (the
reduced local shard; with ``CPUOffload(offload_params=True)`` FSDP's CPU copy of it), cut by
one ``split_with_sizes`` per unit into per-parameter views: no copy, a constant number of ops
per unit, whatever its number of parameters. Clipping scales those views, so it scales FSDP's
flat gradient in place. A flat gradient of another size than the local shard (inside
``no_sync()``, where FSDP1 keeps the unsharded, unreduced gradient) is not measured: the
collect fails on every rank alike, saying why.

**Refused at construction** (:class:`~gradwatch.errors.UnsupportedParallelismError`, naming the
case and the fix): FSDP1 and FSDP2 (``fully_shard``) in one model, FSDP1 over DTensor
parameters (FSDP1 with tensor parallelism), complex flat parameters, parameters of an FSDP1
unit outside the module given to GradWatch.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.errors import GradWatchError, UnsupportedParallelismError
from gradwatch.norms.gradients import GradientReader, LocalGradients
from gradwatch.norms.model import clean_name
from gradwatch.reduce.handshake import flat_shard, rank_grid, spec_numel
from gradwatch.reduce.layout import LocalPiece, piece_of

#: FSDP1's strategies whose flat parameter is sharded over a replicate x shard mesh.
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


@dataclass(frozen=True)
class ShardMesh:
    """An FSDP1 unit's process groups as a mesh for the handshake: ``(shard,)``, or
    ``(replicate, shard)`` for the hybrid strategies.

    ``members``: this rank's shard group and replicate group, as global ranks (identity: units
    on other groups get other mesh slots). ``grid``: every copy of the mesh over the world,
    flattened (``copies x shape``), when this rank can tell it without asking the others (a
    ``device_mesh``, the whole world, or the standard layout its own groups match); else None,
    and the handshake exchanges coordinates instead."""

    shape: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]
    grid: tuple[int, ...] | None = None

    @property
    def rank_grid(self) -> Tensor | None:
        """What :func:`gradwatch.reduce.handshake.rank_grid` reads: ranks of shape ``(copies,
        *shape)``."""
        if self.grid is None:
            return None
        return torch.tensor(self.grid, dtype=torch.int64).view(-1, *self.shape)


@dataclass(frozen=True, eq=False)
class Unit:
    """One FSDP1 unit: its flat parameter and where each original parameter lies in it."""

    flat: Tensor  # the FlatParameter
    names: tuple[str, ...]  # clean names of its original parameters (state_dict keys)
    shapes: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]  # first element of each parameter in the unsharded flat parameter
    total: int  # elements of the unsharded flat parameter (alignment padding in, end padding out)
    offsets: tuple[int, ...]  # each parameter's offset in this rank's local shard
    local: tuple[int, ...]  # each parameter's elements in this rank's local shard
    shard_numel: int  # elements of this rank's local flat shard (end padding included)
    strategy: str  # the ShardingStrategy's name
    mesh: ShardMesh | None  # None: NO_SHARD (whole pieces)
    coords: tuple[int, ...]  # this rank's coordinates on ``mesh``
    group_size: int  # ranks of the unit's data-parallel groups together
    orig_params: tuple[Tensor, ...] | None  # use_orig_params=True: the original parameters

    def piece(self, k: int, name: str) -> LocalPiece:
        """The handshake's description of parameter ``k``'s local slice."""
        shape = self.shapes[k]
        if self.mesh is None:
            return LocalPiece(name, shape, ("whole",), math.prod(shape))
        dim = len(self.mesh.shape) - 1  # the shard dim is the last one
        key = ((dim, self.coords[dim], flat_shard(self.starts[k], self.total)),)
        return LocalPiece(name, shape, key, self.local[k], mesh=self.mesh, coords=self.coords,
                          mesh_shape=self.mesh.shape)


class UnshardedGradientError(GradWatchError):
    """A flat gradient is not the reduced local shard (inside ``no_sync()``)."""


class Fsdp1GradientReader:
    """Reads a collect's gradients of a model with FSDP1 units as a :class:`LocalGradients`,
    one entry per original parameter, in the order of :attr:`Fsdp1Model.names`.

    ``params``: the tensors whose ``.grad`` is read as is (original parameters, parameters FSDP
    does not manage), at ``positions``; ``flat``: ``(unit, first position)`` of the units read
    from their flat parameter; ``units``: every unit (their flat gradients' sizes are checked).
    """

    def __init__(self, n: int, params: Sequence[Tensor], positions: Sequence[int],
                 flat: Sequence[tuple[Unit, int]], units: Sequence[Unit]) -> None:
        self._n = n
        self._plain = GradientReader(params)
        self._positions = list(positions)
        self._identity = self._positions == list(range(n))
        self._flat = [(u, first, *_split_plan(u)) for u, first in flat]
        self._sharded = [u for u in units if u.mesh is not None]

    def read(self) -> LocalGradients:
        for u in self._sharded:
            g = u.flat.grad
            if g is not None and g.numel() != u.shard_numel:
                raise UnshardedGradientError(
                    f"gradwatch: the FSDP1 unit of {u.names[0]!r} holds a flat gradient of "
                    f"{g.numel()} elements, not its local shard's {u.shard_numel}: the gradients "
                    "are not reduced yet (inside no_sync()); collect after the synchronizing "
                    "backward"
                )
        plain = self._plain.read()
        if self._identity:
            return plain
        tensors: list[Tensor | None] = [None] * self._n
        for position, g in zip(self._positions, plain.tensors, strict=True):
            tensors[position] = g
        for u, first, sizes, picks in self._flat:
            g = u.flat.grad
            if g is None or not u.flat.requires_grad:
                continue
            views = g.split(sizes)  # one split_with_sizes: views, no copy
            tensors[first : first + len(picks)] = [views[i] for i in picks]
        sparse = [self._positions[i] for i in plain.sparse_positions]
        return LocalGradients(tensors, sparse, plain.sparse_grads)


def _split_plan(u: Unit) -> tuple[list[int], list[int]]:
    """``(sizes, picks)``: ``split_with_sizes`` sizes covering the local flat shard (gaps and
    end padding as their own pieces, an empty piece for a parameter this rank holds none of),
    and which pieces are the parameters, in order."""
    sizes: list[int] = []
    picks: list[int] = []
    at = 0
    for offset, numel in zip(u.offsets, u.local, strict=True):
        if numel and offset > at:
            sizes.append(offset - at)
            at = offset
        picks.append(len(sizes))
        sizes.append(numel)
        at += numel
    if u.shard_numel > at:
        sizes.append(u.shard_numel - at)
    return sizes, picks


@dataclass(frozen=True, eq=False)
class Fsdp1Model:
    """A module with FSDP1 units, resolved once (:func:`resolve`).

    Attributes:
        held_names, held_params: what ``model.named_parameters()`` holds (clean names): flat
            parameters under ``use_orig_params=False``. What replacement checks and the
            fallback clip act on.
        names, pieces: one entry per original parameter this rank describes (all of them), in
            local order; the names are the clean ``state_dict`` keys.
        reader: reads each collect's gradients in that order.
        units: the FSDP1 units.
        plain: how many parameters FSDP does not manage.
    """

    held_names: tuple[str, ...]
    held_params: tuple[Tensor, ...]
    names: tuple[str, ...]
    pieces: tuple[LocalPiece, ...]
    reader: Fsdp1GradientReader
    units: tuple[Unit, ...]
    plain: int

    def reduces_every_gradient(self, world_size: int) -> bool:
        """Every parameter is in a ``NO_SHARD`` unit whose gradients FSDP all-reduces over the
        whole world: every rank holds the same reduced gradients after backward (a collect may
        skip gradwatch's all-reduce, as under DDP: :mod:`gradwatch.reduce.packing`)."""
        return world_size > 1 and not self.plain and all(
            u.mesh is None and u.group_size == world_size for u in self.units)

    def parallelism(self, stage_ranks: int | None) -> str:
        """The label of :attr:`gradwatch.snapshot.Snapshot.parallelism`: ``fsdp1x{s}``
        (``FULL_SHARD``, ``SHARD_GRAD_OP`` over s ranks), ``fsdp1hsdp{r}x{s}`` (the hybrid
        strategies), ``fsdp1noshard{n}``, after ``pp{n}`` with a stage group; units of
        different kinds are joined by ``+``."""
        parts = [f"pp{stage_ranks}"] if stage_ranks else []
        for u in self.units:
            if u.mesh is None:
                part = f"fsdp1noshard{u.group_size}"
            elif u.strategy in HYBRID:
                part = f"fsdp1hsdp{u.mesh.shape[0]}x{u.mesh.shape[1]}"
            else:
                part = f"fsdp1x{u.mesh.shape[0]}"
            if part not in parts:
                parts.append(part)
        return "+".join(parts)


def fsdp1_type() -> type | None:
    """``FullyShardedDataParallel``, or None in a torch without distributed."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return FullyShardedDataParallel


def resolve(model: nn.Module) -> Fsdp1Model | None:
    """The FSDP1 units of ``model`` and its parameters as pieces, or None when no parameter of
    ``model`` belongs to FSDP1 (the ordinary path then applies).

    Raises :class:`UnsupportedParallelismError` for the cases the module docstring lists."""
    fsdp = fsdp1_type()
    if fsdp is None:
        return None
    instances = [(clean_name(n), m) for n, m in model.named_modules() if isinstance(m, fsdp)]
    named = list(model.named_parameters())
    # FSDP1 marks the parameters it flattened (flat and original ones alike)
    flattened = [(n, p) for n, p in named if getattr(p, "_fsdp_flattened", False)]
    if not instances and not flattened:
        return None
    _refuse_fsdp2(model, instances)
    units = [_unit(m, prefix) for prefix, m in instances if _handle(m) is not None]
    covered = _covered(units)
    if any(id(p) not in covered for _n, p in flattened):
        # The module given is the one a FullyShardedDataParallel wraps (a framework hands its
        # callbacks the unwrapped model): its root unit is found among the live objects.
        root = _wrapping_fsdp(model, fsdp)
        if root is not None and _handle(root) is not None:
            units.insert(0, _unit(root, ""))
            covered = _covered(units)
        outside = [n for n, p in flattened if id(p) not in covered]
        if outside:
            raise UnsupportedParallelismError(
                f"gradwatch: parameter {clean_name(outside[0])!r} belongs to an FSDP1 unit "
                "outside the module given to GradWatch; pass the FullyShardedDataParallel-"
                "wrapped model (or the module it wraps)"
            )
    if not units:
        return None
    return _resolved(named, units)


def _covered(units: Sequence[Unit]) -> set[int]:
    ids = {id(u.flat) for u in units}
    for u in units:
        ids.update(id(p) for p in u.orig_params or ())
    return ids


def _resolved(named: Sequence[tuple[str, Tensor]], units: Sequence[Unit]) -> Fsdp1Model:
    flat_of = {id(u.flat): u for u in units if u.orig_params is None}
    orig_of = {id(p): (u, k) for u in units for k, p in enumerate(u.orig_params or ())}
    names: list[str] = []
    pieces: list[LocalPiece] = []
    read_params: list[Tensor] = []
    positions: list[int] = []
    flat: list[tuple[Unit, int]] = []
    plain = 0
    for raw, p in named:
        if hasattr(p, "_local_tensor"):
            raise UnsupportedParallelismError(
                f"gradwatch: parameter {clean_name(raw)!r} is a DTensor in a model with FSDP1 "
                "units: FSDP1 over tensor-parallel (DTensor) parameters is not supported; use "
                "FSDP2 (torch.distributed.fsdp.fully_shard) with parallelize_module, which "
                "gradwatch measures exactly"
            )
        unit = flat_of.get(id(p))
        if unit is not None:  # use_orig_params=False: every parameter of the unit
            flat.append((unit, len(names)))
            for k, name in enumerate(unit.names):
                names.append(name)
                pieces.append(unit.piece(k, name))
            continue
        name = clean_name(raw)
        positions.append(len(names))
        read_params.append(p)
        names.append(name)
        where = orig_of.get(id(p))
        if where is None:  # not managed by FSDP (ignored_modules): as without FSDP
            plain += 1
            pieces.append(piece_of(name, p))
            continue
        unit, k = where
        if unit.mesh is not None and p.numel() != unit.local[k]:
            raise _not_understood(unit, k, f"holds {p.numel()} elements of it")
        pieces.append(unit.piece(k, name))
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GradWatchError(f"gradwatch: duplicate parameter names after unwrapping: {dup}")
    reader = Fsdp1GradientReader(len(names), read_params, positions, flat, units)
    return Fsdp1Model(
        held_names=tuple(clean_name(n) for n, _p in named),
        held_params=tuple(p for _n, p in named),
        names=tuple(names),
        pieces=tuple(pieces),
        reader=reader,
        units=tuple(units),
        plain=plain,
    )


def _handle(module: nn.Module) -> Any:
    """The unit's ``FlatParamHandle`` (None: an FSDP1 instance whose parameters all belong to
    nested units)."""
    return getattr(module, "_handle", None)


def _refuse_fsdp2(model: nn.Module, instances: Sequence[tuple[str, nn.Module]]) -> None:
    from torch.distributed.fsdp import FSDPModule

    fsdp2 = next((clean_name(n) for n, m in model.named_modules() if isinstance(m, FSDPModule)),
                 None)
    if fsdp2 is not None:
        fsdp1 = instances[0][0] if instances else ""
        raise UnsupportedParallelismError(
            "gradwatch: this model mixes FSDP1 (FullyShardedDataParallel"
            f"{f' at {fsdp1!r}' if fsdp1 else ''}) and FSDP2 (fully_shard at "
            f"{fsdp2 or 'the root'!r}); gradwatch measures either, not both in one model: "
            "wrap the whole model with one of them (FSDP2 is torch's current API)"
        )


def _wrapping_fsdp(model: nn.Module, fsdp: type) -> nn.Module | None:
    """The live ``FullyShardedDataParallel`` whose wrapped module is ``model``, else None: one
    scan of the garbage collector's objects, at construction, only when ``model`` holds FSDP1
    parameters of a unit it does not contain."""
    objects = gc.get_objects()
    types = {t for t in set(map(type, objects)) if issubclass(t, fsdp)}
    for obj in objects:
        if type(obj) in types and getattr(obj, "_fsdp_wrapped_module", None) is model:
            return obj
    return None


def _unit(state: Any, prefix: str) -> Unit:
    """A :class:`Unit` from an FSDP1 instance with a handle; ``prefix``: the clean name of the
    module it wraps, relative to the model given."""
    handle = _handle(state)
    fp = handle.flat_param
    if fp.is_complex():
        raise UnsupportedParallelismError(
            f"gradwatch: FSDP1 unit {prefix or '(root)'!r} holds complex parameters; complex "
            "flat parameters are not supported (use FSDP2: fully_shard)"
        )
    if any(e is not None for e in fp._param_extensions):
        raise UnsupportedParallelismError(
            f"gradwatch: FSDP1 unit {prefix or '(root)'!r} flattens DTensor parameters (FSDP1 "
            "with tensor parallelism): not supported; use FSDP2 (fully_shard) with "
            "parallelize_module, which gradwatch measures exactly"
        )
    starts: list[int] = []
    at = 0
    for numel, padding in zip(fp._numels_with_padding, fp._is_padding_mask, strict=True):
        if not padding:
            starts.append(at)
        at += numel
    total = at
    infos = fp._shard_param_infos
    local = tuple(int(i.numel_in_shard) if i.in_shard else 0 for i in infos)
    offsets = tuple(int(i.offset_in_shard) if i.in_shard else 0 for i in infos)
    strategy = handle._sharding_strategy.name
    sharded = bool(handle.uses_sharded_strategy)
    pg = state.process_group
    group_size = dist.get_world_size(pg)
    mesh: ShardMesh | None = None
    coords: tuple[int, ...] = ()
    if sharded:
        mesh, coords = _shard_mesh(state, strategy in HYBRID)
        group_size = math.prod(mesh.shape)
    names = tuple(clean_name(f"{prefix}.{fqn}" if prefix else fqn) for fqn in fp._fqns)
    unit = Unit(
        flat=fp,
        names=names,
        shapes=tuple(tuple(s) for s in fp._shapes),
        starts=tuple(starts),
        total=total,
        offsets=offsets,
        local=local,
        shard_numel=int(fp._sharded_size.numel()),
        strategy=strategy,
        mesh=mesh,
        coords=coords,
        group_size=group_size,
        orig_params=tuple(fp._params) if handle._use_orig_params else None,
    )
    _check(unit)
    return unit


def _check(u: Unit) -> None:
    """The slices the handshake will derive are FSDP's own (``_shard_param_infos``)."""
    if u.mesh is None:
        for k in range(len(u.names)):
            if u.local[k] != math.prod(u.shapes[k]) or u.offsets[k] != u.starts[k]:
                raise _not_understood(u, k, f"holds {u.local[k]} elements at {u.offsets[k]}")
        return
    parts, at = u.mesh.shape[-1], u.coords[-1]
    full = -(-u.total // parts)
    if u.shard_numel != full:
        raise _not_understood(u, 0, f"has a local shard of {u.shard_numel} elements, not "
                              f"{full}")
    for k, shape in enumerate(u.shapes):
        spec = ((0, flat_shard(u.starts[k], u.total)),)
        derived = spec_numel(shape, spec, (parts,), (at,))
        offset = max(u.starts[k], full * at) - full * at
        if derived != u.local[k] or (derived and offset != u.offsets[k]):
            raise _not_understood(
                u, k, f"holds {u.local[k]} elements at {u.offsets[k]}, the chunk rule "
                f"{derived} at {offset}")


def _not_understood(u: Unit, k: int, what: str) -> UnsupportedParallelismError:
    return UnsupportedParallelismError(
        f"gradwatch: FSDP1's flat parameter layout is not understood: this rank {what} for "
        f"parameter {u.names[k]!r} ({u.strategy}); this torch's FSDP1 lays shards out otherwise "
        "than its _shard_param_infos and torch.chunk say (please report, and use FSDP2)"
    )


def _shard_mesh(state: Any, hybrid: bool) -> tuple[ShardMesh, tuple[int, ...]]:
    """The unit's mesh and this rank's coordinates on it, from its process groups."""
    pg = state.process_group
    shard = tuple(dist.get_process_group_ranks(pg))
    coords: tuple[int, ...] = (dist.get_rank(pg),)
    shape: tuple[int, ...] = (len(shard),)
    members: tuple[tuple[int, ...], ...] = (shard,)
    if hybrid:
        inter = state._inter_node_pg
        replicate = tuple(dist.get_process_group_ranks(inter))
        coords = (dist.get_rank(inter), *coords)
        shape = (len(replicate), *shape)
        members = (replicate, shard)
    return ShardMesh(shape, members, _grid(state, shape, coords, members)), coords


def _grid(state: Any, shape: tuple[int, ...], coords: tuple[int, ...],
          members: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """Every copy of the unit's mesh over the world, flattened, when this rank can tell it
    alone: from the ``device_mesh`` FSDP was given, else the standard layout (ranks in order,
    ``(world / size, *shape)``) when this rank's own groups sit where it puts them. None
    otherwise: the handshake then exchanges coordinates (no guess is ever trusted: every rank
    checks its own row)."""
    mesh = getattr(state, "_device_mesh", None)
    if mesh is not None and tuple(mesh.shape) == shape:
        grid = rank_grid(mesh)
        if grid is not None:
            return tuple(grid.reshape(-1).tolist())
    world = dist.get_world_size()
    size = math.prod(shape)
    if world % size:
        return None
    standard = torch.arange(world).view(-1, *shape)
    me = dist.get_rank()
    at = standard[me // size]
    if len(shape) == 1:
        own = tuple(at.tolist())
        ok = own == members[0] and int(at[coords[0]]) == me
    else:
        ok = (tuple(at[coords[0]].tolist()) == members[1]
              and tuple(at[:, coords[1]].tolist()) == members[0]
              and int(at[coords[0], coords[1]]) == me)
    return tuple(standard.reshape(-1).tolist()) if ok else None
