"""The construction handshake at any world size: digests first, descriptions once per structure.

**Descriptions relative to meshes.** A rank describes each piece it holds by its name, global
shape, local numel and *sharding spec*: the mesh dims whose placement is not ``Replicate`` and
those placements, plus which of the rank's meshes the piece lives on (a slot index, in order of
first appearance) and that mesh's shape. The rank's coordinates on those meshes are *not* part
of the description: every rank derives them from the meshes when all ranks agree (phase 0),
else they travel as fixed-size per-rank records. Nor, usually, is the local numel: when it
equals what the spec gives at the rank's coordinates (:func:`spec_numel`: torch's
``compute_local_shape_and_global_offset`` rule, or for strided shards the nested layout FSDP2
holds, or FSDP1's flat shards: ``FlatShard(start, total)``, :func:`flat_shard`), the
description says :data:`DERIVED` / :data:`DERIVED_NESTED` instead, the same on every rank, and
:func:`derive` recomputes each rank's numel from its coordinates. Ranks with the same structure
(every rank of one pipeline stage, uneven and empty shards included) therefore produce
byte-identical descriptions; a numel no rule gives (an exotic layout) stays explicit, so its
rank's digest differs and the records path below applies.

**Phase 0, one fixed-size all-reduce** (:data:`PHASE0_BYTES` sent and received per rank,
whatever the model and the world size). Every rank derives, from the meshes it holds, the
coordinates of *every* rank on them: a torch ``DeviceMesh`` (root, sub-mesh or flattened) knows
the ranks of all its copies (:func:`rank_grid`), so the rank's copy of a sub-mesh places the
other ranks on theirs (:func:`coordinate_table`). Each rank then votes (:func:`agreement_words`)
with the digest of its description, the digest of its coordinate table and a flag: "my row of
the table is my own coordinates, and I declare no stage group". The vote is all-reduced by MAX
next to its negation, so every rank learns each word's maximum and minimum: the same result
everywhere, hence the same branch everywhere (:func:`agreed`). When every word agrees and
every flag is set, every rank holds the one description and the one table, and each row of it
was checked by its own rank: the per-rank records are derived locally (:func:`agreed_records`)
and nothing more travels, except the host names when the per-rank view is on (one all-gather
of :data:`HOST_BYTES` per rank: that view already carries per-rank slots, see
:mod:`gradwatch.reduce.packing`; without it host names are not needed and not gathered).

**Otherwise, the records** (pipeline stages, shard sizes no rule gives, a mismatch, a mesh
whose grid is unreadable): two phases follow, on every rank alike.

1. One all-gather of a fixed-size record per rank (:data:`RECORD_BYTES`): the 16-byte BLAKE2b
   digest of the rank's canonical description, its length, the rank's stage group (size and
   an 8-byte digest of its sorted member list), its mesh coordinates and its host name.
   Received per rank: ``W x RECORD_BYTES`` (it grows with the world size).
2. Only when the digests differ: one all-reduce (SUM) of a byte buffer holding each *distinct*
   description once, written by the lowest rank of its digest group and zero elsewhere
   (pipeline jobs have few distinct stages: its size does not grow with ``W``).

At most three collectives at construction, the same on every rank.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from gradwatch.errors import GradWatchError

log = logging.getLogger("gradwatch")

MAX_COORDS = 32  # mesh coordinates per rank, over all its meshes (a 3-D mesh and 2 sub-meshes: 6)
HOST_BYTES = 64
#: A piece's local numel in a description when it equals what its sharding spec gives at the
#: rank's coordinates (:func:`spec_numel`): "derived from the spec", the same on every rank.
#: DERIVED: torch's rule (``compute_local_shape_and_global_offset``); DERIVED_NESTED: the
#: nested rule FSDP2 lays strided shards out by (see :func:`spec_numel`).
DERIVED = -1
DERIVED_NESTED = -2
_RECORD = struct.Struct(f"<16sq8sqqq{MAX_COORDS}i{HOST_BYTES}s")
RECORD_BYTES = _RECORD.size  # the fixed per-rank record of phase 1


class PieceLike(Protocol):
    """What :func:`describe` reads of a piece (:class:`gradwatch.reduce.layout.LocalPiece`)."""

    name: str
    global_shape: tuple[int, ...]
    key: tuple[Any, ...]
    numel: int
    mesh: Any
    coords: tuple[int, ...]
    mesh_shape: tuple[int, ...]


@dataclass(frozen=True)
class Description:
    """One rank's structural description (what the digest covers).

    ``pieces``: ``(name, global shape, spec, mesh slot, local numel)``; with a mesh slot >= 0
    the spec is ``((mesh dim, placement), ...)`` and the piece key on a rank is
    ``((dim, coordinate on that dim, placement), ...)``; with slot -1 the spec *is* the key
    (a plain tensor: ``("whole",)``). The local numel is :data:`DERIVED_NESTED` or
    :data:`DERIVED` when it equals :func:`spec_numel` (nested or not) at the rank's
    coordinates. ``meshes``: the shape of each mesh slot (``-1`` sizes when unknown: no numel
    is then derived on it).
    """

    version: str
    config: str
    stage: bool
    meshes: tuple[tuple[int, ...], ...]
    pieces: tuple[tuple[str, tuple[int, ...], tuple[Any, ...], int, int], ...]
    rank_view: int = 0  # G, the groups of the per-rank view this rank measures (0: none)
    # DDP all-reduces every described gradient over the world on this rank
    # (gradwatch.norms.model.ddp_reduces_every_gradient): with every rank agreeing and every piece
    # replicated on every rank, a collect may skip gradwatch's all-reduce (gradwatch.reduce.packing)
    synced: bool = False

    def encode(self) -> bytes:
        """Canonical bytes: equal descriptions give equal bytes (and digests)."""
        return json.dumps(
            [self.version, self.config, self.stage, self.meshes, self.pieces, self.rank_view,
             self.synced],
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Description:
        version, config, stage, meshes, pieces, rank_view, synced = json.loads(raw)
        return cls(
            version,
            config,
            bool(stage),
            tuple(tuple(m) for m in meshes),
            tuple(
                (name, tuple(shape), _hashable(spec), slot, numel)
                for name, shape, spec, slot, numel in pieces
            ),
            int(rank_view),
            bool(synced),
        )


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list | tuple) else value


def digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=16).digest()


_SHARD = re.compile(r"Shard\(dim=(\d+)\)")
_STRIDED = re.compile(r"_StridedShard\(dim=(\d+), sf=(\d+)\)")


def _placement_rule(placement: Any) -> tuple[int, int] | None:
    """(tensor dim, split factor) of a ``Shard`` (factor 0) or ``_StridedShard`` placement,
    from its ``repr`` as descriptions carry it; None for any other placement."""
    if not isinstance(placement, str):
        return None
    if m := _SHARD.fullmatch(placement):
        return int(m[1]), 0
    if (m := _STRIDED.fullmatch(placement)) and int(m[2]) > 0:
        return int(m[1]), int(m[2])
    return None


#: FSDP1's flat shard (:mod:`gradwatch.stacks.fsdp1`): a parameter occupying elements
#: ``[start, start + numel)`` of a flat parameter of ``total`` elements (alignment padding
#: included, the padding for divisibility excluded), which FSDP1 cuts into ``torch.chunk``
#: pieces over the shard mesh dim.
_FLAT = re.compile(r"FlatShard\(start=(\d+), total=(\d+)\)")


def flat_shard(start: int, total: int) -> str:
    """The placement string of an FSDP1 flat shard in a description (see :data:`_FLAT`)."""
    return f"FlatShard(start={start}, total={total})"


def _flat_rule(spec: Sequence[tuple[int, Any]]) -> tuple[int, int, int] | None:
    """(mesh dim, start, total) when ``spec`` is one FSDP1 flat shard, else None."""
    if len(spec) == 1 and isinstance(spec[0][1], str) and (m := _FLAT.fullmatch(spec[0][1])):
        return spec[0][0], int(m[1]), int(m[2])
    return None


def _chunk(size: int, parts: int, at: int) -> int:
    """Elements at position ``at`` of ``size`` split in ``parts``: ``torch.chunk`` sizes
    (ceil-sized chunks, the last ones short or empty), as DTensor's ``Shard`` cuts."""
    full = -(-size // parts)
    return max(0, min(size, full * (at + 1)) - full * at)


def spec_numel(global_shape: Sequence[int], spec: Sequence[tuple[int, Any]],
               mesh_shape: Sequence[int], coords: Sequence[int],
               nested: bool = False) -> int | None:
    """The local numel of the rank at ``coords`` (one per spec entry) on a mesh of
    ``mesh_shape`` (pure). Each step cuts the current size of one tensor dim, so over every
    coordinate of the mesh the pieces tile the tensor exactly once.

    Torch's rule (``nested=False``; tests hold it equal to
    ``_compute_local_shape_and_global_offset``): mesh dims in order; ``Shard(d)`` cuts tensor
    dim ``d`` into ``torch.chunk`` pieces; ``_StridedShard(d, sf)`` cuts it into ``sf``
    pieces, each of those into mesh-size pieces, and takes the rank's piece of each.

    The nested rule (``nested=True``): the ``Shard`` dims first, then the ``_StridedShard``
    dims, each a plain ``torch.chunk`` cut: what FSDP2 holds when it shards a tensor-parallel
    DTensor (it chunks the TP-local tensor; with uneven sizes torch's rule above may differ
    from it by a row, tests show both).

    None when a placement, a tensor dim or a coordinate is outside these rules (the numel
    then stays explicit).

    FSDP1's flat shard (one spec entry ``FlatShard(start, total)``): the elements of
    ``[start, start + numel)`` inside the rank's ``torch.chunk`` piece of ``range(total)``."""
    local = list(global_shape)
    if len(coords) != len(spec):
        return None
    if (flat := _flat_rule(spec)) is not None:
        mesh_dim, start, total = flat
        numel = math.prod(local)
        if not 0 <= mesh_dim < len(mesh_shape) or start + numel > total:
            return None
        parts, at = mesh_shape[mesh_dim], coords[0]
        if parts <= 0 or not 0 <= at < parts:
            return None
        full = -(-total // parts)
        return max(0, min(start + numel, total, full * (at + 1)) - max(start, full * at))
    steps = []
    for (mesh_dim, placement), at in zip(spec, coords, strict=True):
        rule = _placement_rule(placement)
        if rule is None or not 0 <= mesh_dim < len(mesh_shape):
            return None
        tdim, factor = rule
        parts = mesh_shape[mesh_dim]
        if tdim >= len(local) or parts <= 0 or not 0 <= at < parts:
            return None
        steps.append((tdim, 0 if nested else factor, parts, at, nested and factor > 0))
    if nested:
        steps.sort(key=lambda step: step[4])  # stable: Shard dims, then strided ones
    for tdim, factor, parts, at, _strided in steps:
        size = local[tdim]
        if factor == 0:
            local[tdim] = _chunk(size, parts, at)
        else:
            local[tdim] = sum(_chunk(_chunk(size, factor, j), parts, at) for j in range(factor))
    return math.prod(local)


@dataclass(frozen=True)
class RankRecord:
    """The fixed-size per-rank data of phase 1."""

    digest: bytes  # of the rank's encoded description
    length: int  # bytes of the encoded description
    stage_digest: bytes  # 8 bytes of the sorted stage group ranks; b"" when none declared
    stage_size: int  # 0: no stage group declared
    coords: tuple[int, ...]  # the rank's coordinates on its mesh slots, concatenated
    overflow: bool  # more than MAX_COORDS coordinates (refused on every rank)
    host: str

    def pack(self) -> bytes:
        coords = self.coords[:MAX_COORDS]
        padded = (*coords, *(0,) * (MAX_COORDS - len(coords)))
        return _RECORD.pack(
            self.digest, self.length, self.stage_digest.ljust(8, b"\0"), self.stage_size,
            -1 if self.overflow else len(coords), int(self.overflow), *padded,
            self.host.encode()[:HOST_BYTES],
        )

    @classmethod
    def unpack(cls, raw: bytes) -> RankRecord:
        fields = _RECORD.unpack(raw)
        dg, length, stage_digest, stage_size, n, overflow = fields[:6]
        coords = fields[6 : 6 + MAX_COORDS]
        host = fields[6 + MAX_COORDS].rstrip(b"\0").decode(errors="replace")
        return cls(dg, length, stage_digest if stage_size else b"", stage_size,
                   tuple(coords[: max(n, 0)]), bool(overflow), host)


def stage_digest(ranks: Sequence[int]) -> bytes:
    return hashlib.blake2b(",".join(map(str, sorted(ranks))).encode(), digest_size=8).digest()


def describe(
    pieces: Sequence[PieceLike], *, version: str, config_hash: str,
    stage_ranks: Sequence[int] | None = None, host: str | None = None, rank_view: int = 0,
    synced: bool = False,
) -> tuple[Description, RankRecord]:
    """A rank's description and its phase-1 record (pure but for the default host name)."""
    slots: dict[Any, int] = {}
    meshes: list[tuple[int, ...]] = []
    coords: list[int] = []
    described = []
    for p in pieces:
        if p.mesh is None:
            described.append((p.name, tuple(p.global_shape), _hashable(p.key), -1, p.numel))
            continue
        slot = slots.get(p.mesh)
        mesh_shape = tuple(p.mesh_shape)
        if slot is None:
            slot = slots[p.mesh] = len(meshes)
            meshes.append(mesh_shape if len(mesh_shape) == len(p.coords)
                          else (-1,) * len(p.coords))
            coords.extend(p.coords)
        spec = tuple((dim, placement) for dim, _coord, placement in p.key)
        # Uneven and empty shards of the standard rules are the same on every rank in this
        # form (derive() recomputes each rank's numel from its coordinates); any other
        # numel is written out, so ranks holding it differ and take the records path.
        numel = p.numel
        if mesh_shape == meshes[slot]:
            at = [c for _d, c, _pl in p.key]
            strided = any((_placement_rule(pl) or (0, 0))[1] for _d, pl in spec)
            # Strided shards: FSDP2's nested layout first (every rank of an FSDP2 x TP job
            # matches it), so ranks where both rules agree choose as the others do.
            for kind in (DERIVED_NESTED, DERIVED) if strided else (DERIVED,):
                if numel == spec_numel(p.global_shape, spec, mesh_shape, at,
                                       nested=kind == DERIVED_NESTED):
                    numel = kind
                    break
        described.append((p.name, tuple(p.global_shape), spec, slot, numel))
    desc = Description(version, config_hash, stage_ranks is not None, tuple(meshes),
                       tuple(described), rank_view, synced)
    raw = desc.encode()
    record = RankRecord(
        digest=digest(raw),
        length=len(raw),
        stage_digest=stage_digest(stage_ranks) if stage_ranks is not None else b"",
        stage_size=len(stage_ranks) if stage_ranks is not None else 0,
        coords=tuple(coords),
        overflow=len(coords) > MAX_COORDS,
        host=socket.gethostname() if host is None else host,
    )
    return desc, record


class Gathered(NamedTuple):
    """What every rank knows after the handshake (identical on every rank)."""

    descriptions: tuple[Description, ...]  # distinct, in order of their lowest rank
    rank_group: tuple[int, ...]  # per rank: its index into descriptions
    records: tuple[RankRecord, ...]  # per rank
    # True: phase 0 found every rank agreeing and every record was derived locally (no record
    # on the wire; host names only with the per-rank view or rank timing, "" otherwise)
    agreed: bool = False

    @property
    def hosts(self) -> tuple[str, ...]:
        """Per rank; empty when the agreed path did not gather them (neither the per-rank view
        nor rank timing)."""
        if self.agreed and not any(r.host for r in self.records):
            return ()
        return tuple(r.host for r in self.records)


def group_records(raw: bytes, world: int) -> tuple[tuple[RankRecord, ...], list[bytes],
                                                    tuple[int, ...]]:
    """Phase-1 result -> (records, distinct digests in order of their lowest rank, the digest
    group of each rank)."""
    records = tuple(
        RankRecord.unpack(raw[r * RECORD_BYTES : (r + 1) * RECORD_BYTES]) for r in range(world)
    )
    order: dict[bytes, int] = {}
    rank_group = tuple(order.setdefault(rec.digest, len(order)) for rec in records)
    return records, list(order), rank_group


def phase2_layout(records: Sequence[RankRecord], digests: Sequence[bytes],
                  rank_group: Sequence[int]) -> list[tuple[int, int, int]]:
    """Where each distinct description sits in the phase-2 buffer: (offset, length, writer)."""
    leaders: dict[int, int] = {}
    for r, g in enumerate(rank_group):
        leaders.setdefault(g, r)
    spans, offset = [], 0
    for g in range(len(digests)):
        length = records[leaders[g]].length
        spans.append((offset, length, leaders[g]))
        offset += length
    return spans


def split_descriptions(buffer: bytes, digests: Sequence[bytes],
                       spans: Sequence[tuple[int, int, int]]) -> tuple[Description, ...]:
    out = []
    for dg, (offset, length, _writer) in zip(digests, spans, strict=True):
        raw = buffer[offset : offset + length]
        if digest(raw) != dg:
            raise GradWatchError(
                "gradwatch: a layout description arrived corrupted in the construction handshake"
            )
        out.append(Description.decode(raw))
    return tuple(out)


def mesh_slots(pieces: Sequence[PieceLike]) -> tuple[Any, ...]:
    """The meshes of a rank's pieces in the order :func:`describe` numbers their slots."""
    return tuple(dict.fromkeys(p.mesh for p in pieces if p.mesh is not None))


def rank_grid(mesh: Any) -> torch.Tensor | None:
    """Every copy of ``mesh`` over the world, as ranks of shape ``(copies, *mesh shape)``.

    A torch ``DeviceMesh`` (a root mesh, a sub-mesh or a flattened one) knows the ranks of all
    its copies (``_layout.remap_to_tensor(_rank_map)``: one row per copy, the rank's own copy
    among them), so every rank can place every other rank on its copy without asking it. Other
    objects may carry the grid as a ``rank_grid`` tensor (simulated meshes). None when neither
    is readable (private torch API: phase 0 then falls back to the records)."""
    try:
        layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
        if layout is not None and rank_map is not None:
            return layout.remap_to_tensor(rank_map).cpu()
        grid = getattr(mesh, "rank_grid", None)
        return grid.cpu() if isinstance(grid, torch.Tensor) and grid.dim() >= 1 else None
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        return None  # a DeviceMesh this torch lays out differently


def coordinate_table(meshes: Sequence[Any], world: int) -> torch.Tensor | None:
    """Every rank's coordinates on ``meshes`` (the slots of :func:`describe`), concatenated:
    an int64 ``(world, coordinates)`` tensor, the coordinates a rank's record would carry
    (``-1`` on a mesh that does not hold the rank, as :func:`piece_from_placements` writes);
    None when some mesh's grid is unreadable or not a partition of ranks below ``world``."""
    columns = []
    for mesh in meshes:
        grid = rank_grid(mesh)
        if grid is None or grid.dim() < 2:
            return None
        shape = tuple(grid.shape[1:])
        flat = grid.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= world):
            return None
        if flat.numel() and int(torch.bincount(flat, minlength=world).max()) > 1:
            return None  # a rank on two copies: its copy is ambiguous
        cells = max(1, flat.numel() // max(1, grid.shape[0]))
        position = torch.full((world,), -1, dtype=torch.int64)
        position[flat] = torch.arange(flat.numel(), dtype=torch.int64) % cells
        stride = cells
        for size in shape:
            stride //= size
            columns.append(torch.where(position >= 0, (position // stride) % size, -1))
    if not columns:
        return torch.zeros((world, 0), dtype=torch.int64)
    return torch.stack(columns, dim=1)


# Phase 0's vector: (description digest, coordinate-table digest) as 32-bit words, and the
# "my row of the table is my record" flag; all-reduced by MAX next to their negations, so one
# collective yields each word's maximum and minimum over the world.
_DIGEST_WORDS = 4
AGREE_WORDS = 2 * _DIGEST_WORDS + 1
PHASE0_BYTES = 2 * AGREE_WORDS * 8  # int64


def agreement_words(record: RankRecord, stage: bool, table: torch.Tensor | None,
                    rank: int, table_digest: bytes | None = None) -> list[int]:
    """One rank's phase-0 words (before the negated copy). The flag is 1 when the rank can take
    the agreed path: no stage group (stage groups travel in the records) and the coordinate
    table derived from its meshes holds, at its own row, exactly its record's coordinates.
    ``table_digest``: the table's, when already computed (the simulation shares one table)."""
    ok = (not stage and table is not None and rank < table.shape[0]
          and tuple(table[rank].tolist()) == record.coords)
    if not ok or table is None:
        table_digest = bytes(16)
    elif table_digest is None:
        table_digest = digest(table.numpy().tobytes())
    words = [*struct.unpack("<4I", record.digest), *struct.unpack("<4I", table_digest)]
    return [*words, int(ok)]


def agreed(reduced: Sequence[int]) -> bool:
    """Phase 0's verdict from the all-reduced ``[words, -words]`` (identical on every rank):
    every word equal on every rank (the same description and the same coordinate table, up to
    BLAKE2b collisions) and every rank's flag set. Then every record is known: each rank's row
    of the shared table was checked by that rank against its own coordinates."""
    top, low = reduced[:AGREE_WORDS], [-x for x in reduced[AGREE_WORDS:]]
    return list(top) == low and low[-1] == 1


def agreed_records(record: RankRecord, table: torch.Tensor,
                   hosts: Sequence[str] | None) -> tuple[RankRecord, ...]:
    """Every rank's record on the agreed path: the shared digest and length, no stage group,
    the coordinates from the table, the host names when gathered ("" otherwise)."""
    rows = table.tolist()
    return tuple(
        RankRecord(record.digest, record.length, b"", 0, tuple(row),
                   len(row) > MAX_COORDS, hosts[r] if hosts is not None else "")
        for r, row in enumerate(rows)
    )


def _host_bytes(host: str) -> bytes:
    return host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    """Every rank's equal-sized ``tensor``, concatenated into ``output``: one collective.
    ``dist.all_gather_single`` where torch has it; ``all_gather_into_tensor`` (the same
    collective, deprecated with a FutureWarning where ``all_gather_single`` exists) before."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _split_hosts(raw: bytes, world: int) -> tuple[str, ...]:
    return tuple(raw[r * HOST_BYTES : (r + 1) * HOST_BYTES].rstrip(b"\0").decode(
        errors="replace") for r in range(world))


def exchange(desc: Description, record: RankRecord, group: Any, device: torch.device,
             meshes: Sequence[Any] | None = None, gather_hosts: bool = False) -> Gathered:
    """The exchange over ``group`` (every rank of the world calls it; ``group`` spans the
    world, so its ranks are global ranks). ``meshes``: the rank's mesh slots
    (:func:`mesh_slots`); None: never take the agreed path. ``gather_hosts``: every rank's
    host on the agreed path too (as the rank view gathers them); a setting the configuration
    hash covers, so equal on every rank whenever that path is taken."""
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    try:
        table = coordinate_table(meshes, world) if meshes is not None else None
    except Exception:  # never skip the vote: the others would wait for this rank's words
        log.warning("gradwatch: could not read this rank's mesh coordinates; the handshake "
                    "takes the per-rank records instead", exc_info=True)
        table = None
    words = agreement_words(record, desc.stage, table, me)
    vote = torch.tensor([*words, *(-w for w in words)], dtype=torch.int64, device=device)
    dist.all_reduce(vote, dist.ReduceOp.MAX, group=group)
    if agreed(vote.cpu().tolist()) and table is not None:
        hosts = None
        if desc.rank_view or gather_hosts:  # equal on every rank: agreed description
            mine = torch.frombuffer(bytearray(_host_bytes(record.host)),
                                    dtype=torch.uint8).to(device)
            everyone = torch.empty(world * HOST_BYTES, dtype=torch.uint8, device=device)
            _all_gather_single(everyone, mine, group=group)
            hosts = _split_hosts(bytes(everyone.cpu().tolist()), world)
        return Gathered((desc,), (0,) * world, agreed_records(record, table, hosts), True)
    mine = torch.frombuffer(bytearray(record.pack()), dtype=torch.uint8).to(device)
    everyone = torch.empty(world * RECORD_BYTES, dtype=torch.uint8, device=device)
    _all_gather_single(everyone, mine, group=group)
    records, digests, rank_group = group_records(bytes(everyone.cpu().tolist()), world)
    if len(digests) == 1:
        return Gathered((desc,), rank_group, records)
    spans = phase2_layout(records, digests, rank_group)
    buffer = torch.zeros(sum(length for _o, length, _w in spans), dtype=torch.uint8,
                         device=device)
    for offset, length, writer in spans:
        if writer == me:
            raw = desc.encode()
            buffer[offset : offset + length] = torch.frombuffer(
                bytearray(raw), dtype=torch.uint8).to(device)
    dist.all_reduce(buffer, dist.ReduceOp.SUM, group=group)
    return Gathered(split_descriptions(bytes(buffer.cpu().tolist()), digests, spans),
                    rank_group, records)


def local(desc: Description, record: RankRecord) -> Gathered:
    """A world of one (no process group)."""
    return Gathered((desc,), (0,), (record,))


