"""Construction at scale, simulated: the handshake's layout step for thousands of ranks.

No machine here has 16,384 ranks, so the ranks are simulated: for a 3,000-parameter
transformer-like model under DDP, FSDP2, FSDP2 x TP, HSDP and PP x FSDP2 x TP (and HSDP of
the same model with its vocabulary padded so every shard is even), each rank's
pieces are built by the production :func:`gradwatch.reduce.layout.piece_from_placements` (real torch
placements, local shard sizes by the chunking DTensor uses: uneven and empty shards included)
and described by the production :func:`gradwatch.reduce.handshake.describe`. Ranks whose pieces are
the same (same stage, same local shard sizes) share one description object; their records
differ only in coordinates, stage group and host, which are filled per rank. Standard uneven
shards are described alike on every rank (their sizes are derived from the spec), so ranks of
one stage share one digest, as in a real run. :func:`self_check` proves those shortcuts on a
small world: the local sizes equal torch's ``_compute_local_shape_and_global_offset`` (for
FSDP2 over TP, applied as FSDP2 shards: the TP shard first, then the data-parallel chunks of
the TP-local rows), the records equal a full ``describe`` of every rank, and the ranks of one
stage share one digest.

The meshes are simulated too: each carries the grid of its copies over the world
(``rank_grid``, what the handshake reads of a torch DeviceMesh), from which phase 0 derives
every rank's coordinates; the self-check proves the derived coordinates equal the records'.

Measured: the layout step every rank runs after the exchange: phase 0's coordinate table and
vote, decoding the records (and, when descriptions differ, the distinct descriptions) unless
every rank agrees, and deriving the layout (:func:`benchmarks.handshake_sim.simulate` +
:func:`gradwatch.reduce.layout.derive_layout`), its wall time on one core and its peak Python memory
(tracemalloc), which handshake path the world takes, and the handshake bytes per rank
(:func:`benchmarks.handshake_sim.bytes_per_rank`), next to what the simple alternative (every rank's
JSON description all-gathered, padded to the longest) would receive.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from benchmarks import handshake_sim
from benchmarks.results import ScaleResult
from gradwatch.reduce import handshake
from gradwatch.reduce.layout import (
    Layout,
    LocalPiece,
    derive_layout,
    piece_from_placements,
)
from gradwatch.reduce.sections import sections

CASES = ("DDP", "FSDP2", "FSDP2 x TP", "HSDP", "PP x FSDP2 x TP", "HSDP, even shards")
#: The case whose model pads its vocabulary to a multiple of 128 (50,304, as GPT-2 training
#: code does): every sharded dimension then divides by the shard degree (8) and every rank
#: holds the same shard sizes (the unpadded HSDP case agrees as well: uneven shards are
#: described alike; this one shows the padding changes nothing in the handshake).
EVEN_CASE = "HSDP, even shards"
EVEN_VOCAB = 50304
WORLDS = (8, 64, 1024, 16384)


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    tp: str  # "col" (rows split by TP), "row" (columns split), "rep" (replicated over TP),
    # "none" (not TP-parallel: lives on the data-parallel sub-mesh)


def transformer(layers: int = 187, d: int = 4096, ffn: int = 11008, vocab: int = 50257,
                ctx: int = 4096) -> list[Param]:
    """16 parameters per layer + 8 around them: 3,000 parameters at 187 layers."""
    out = [Param("embed.weight", (vocab, d), "col"), Param("pos.weight", (ctx, d), "none"),
           Param("embed_norm.weight", (d,), "none"), Param("embed_norm.bias", (d,), "none")]
    for i in range(layers):
        p = f"layers.{i}."
        for x in "qkv":
            out += [Param(f"{p}attn.{x}.weight", (d, d), "col"),
                    Param(f"{p}attn.{x}.bias", (d,), "col")]
        out += [Param(f"{p}attn.o.weight", (d, d), "row"), Param(f"{p}attn.o.bias", (d,), "rep")]
        for n in ("ln1", "ln2"):
            out += [Param(f"{p}{n}.weight", (d,), "none"), Param(f"{p}{n}.bias", (d,), "none")]
        out += [Param(f"{p}mlp.up.weight", (ffn, d), "col"),
                Param(f"{p}mlp.up.bias", (ffn,), "col"),
                Param(f"{p}mlp.down.weight", (d, ffn), "row"),
                Param(f"{p}mlp.down.bias", (d,), "rep")]
    out += [Param("ln_f.weight", (d,), "none"), Param("ln_f.bias", (d,), "none"),
            Param("head.weight", (vocab, d), "col"), Param("head.bias", (vocab,), "col")]
    return out


def chunk(size: int, parts: int, at: int) -> int:
    """Elements at position ``at`` of ``size`` split in ``parts`` (torch.chunk / DTensor Shard:
    ceil-sized chunks, the last ones short or empty)."""
    full = -(-size // parts)
    return max(0, min(size, full * (at + 1)) - full * at)


@dataclass(frozen=True)
class Spec:
    """One parallelism: the mesh of a rank and how each kind of parameter is placed on it."""

    name: str
    world: int
    pp: int = 1
    dp: int = 1  # FSDP shard degree
    tp: int = 1
    rep: int = 1  # HSDP replicate degree

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(stage, replicate, shard, tp) coordinates of ``rank``."""
        rank, t = divmod(rank, self.tp)
        rank, d = divmod(rank, self.dp)
        p, r = divmod(rank, self.rep)
        return p, r, d, t

    def stage_params(self, params: Sequence[Param], stage: int) -> list[Param]:
        if self.pp == 1:
            return list(params)
        per = -(-len(params) // self.pp)
        return list(params[stage * per : (stage + 1) * per])

    def placement(self, p: Param) -> tuple[Any, list[Any], str]:
        """(mesh token, placements, how the local size is computed)."""
        if self.name == "DDP":
            return None, [], "whole"
        if self.name == "FSDP2":
            return "dp", [Shard(0)], "fsdp"
        if self.name == "HSDP":
            return "hsdp", [Replicate(), Shard(0)], "hsdp"
        if p.tp == "none":
            return "dp", [Shard(0)], "fsdp"
        if p.tp == "col":
            return "2d", [_StridedShard(0, split_factor=self.tp), Shard(0)], "col"
        if p.tp == "row":
            return "2d", [Shard(0), Shard(1)], "row"
        return "2d", [Shard(0), Replicate()], "fsdp"

    def local_numel(self, p: Param, how: str, rank: int) -> int:
        _s, _r, d, t = self.coords(rank)
        rows, rest = p.shape[0], math.prod(p.shape[1:])
        if how == "whole":
            return rows * rest
        if how == "hsdp" or how == "fsdp":
            return chunk(rows, self.dp, d) * rest
        if how == "col":  # FSDP2 shards dim 0 of the TP-local tensor
            return chunk(chunk(rows, self.tp, t), self.dp, d) * rest
        return chunk(rows, self.dp, d) * chunk(p.shape[1], self.tp, t) * math.prod(p.shape[2:])

    def mesh_coords(self, token: Any, rank: int) -> tuple[int, ...]:
        _s, r, d, t = self.coords(rank)
        return {"dp": (d,), "2d": (d, t), "hsdp": (r, d)}[token]

    def mesh_shape(self, token: Any) -> tuple[int, ...]:
        return {"dp": (self.dp,), "2d": (self.dp, self.tp), "hsdp": (self.rep, self.dp)}[token]

    def rank_grid(self, token: Any) -> torch.Tensor:
        """Every copy of the ``token`` mesh over the world, as a torch DeviceMesh holds them
        (``_layout.remap_to_tensor(_rank_map)``): ranks of shape ``(copies, *mesh shape)``,
        copies ordered by the coordinates the mesh does not span."""
        shape = self.mesh_shape(token)
        copies: dict[tuple[int, ...], torch.Tensor] = {}
        for rank in range(self.world):
            s, r, _d, t = self.coords(rank)
            other = {"dp": (s, r, t), "2d": (s, r), "hsdp": (s, t)}[token]
            if other not in copies:
                copies[other] = torch.full(shape, -1, dtype=torch.int64)
            copies[other][self.mesh_coords(token, rank)] = rank
        return torch.stack([copies[k] for k in sorted(copies)])

    def stage_ranks(self, rank: int) -> list[int] | None:
        if self.pp == 1:
            return None
        inner = rank % (self.world // self.pp)
        return [q * (self.world // self.pp) + inner for q in range(self.pp)]


def spec_for(case: str, world: int) -> Spec:
    tp = 8 if world >= 64 else 2
    if case == "DDP":
        return Spec(case, world, rep=world)
    if case == "FSDP2":
        return Spec(case, world, dp=world)
    if case == "FSDP2 x TP":
        return Spec(case, world, dp=world // tp, tp=tp)
    if case in ("HSDP", EVEN_CASE):
        return Spec("HSDP", world, rep=world // 8 if world >= 16 else 2,
                    dp=8 if world >= 16 else world // 2)
    pp = {8: 2, 64: 4, 1024: 8}.get(world, 16)
    return Spec(case, world, pp=pp, dp=world // (pp * tp), tp=tp)


def rank_pieces(spec: Spec, params: Sequence[Param], rank: int) -> list[LocalPiece]:
    """One rank's pieces, built as the production code builds them."""
    stage = spec.coords(rank)[0]
    out = []
    for p in spec.stage_params(params, stage):
        token, placements, how = spec.placement(p)
        numel = spec.local_numel(p, how, rank)
        if token is None:
            out.append(LocalPiece(p.name, p.shape, ("whole",), numel))
        else:
            out.append(piece_from_placements(p.name, p.shape, placements, token,
                                             spec.mesh_coords(token, rank), numel,
                                             mesh_shape=spec.mesh_shape(token)))
    return out


def _describe(spec: Spec, pieces: Sequence[LocalPiece], rank: int) -> tuple[Any, Any]:
    return handshake.describe(pieces, version="v", config_hash="c",
                              stage_ranks=spec.stage_ranks(rank), host=f"node{rank // 8}")


def structures(spec: Spec, params: Sequence[Param]) -> list[tuple[Any, ...]]:
    """Per rank, its structure: its stage and its local shard sizes (ranks of one structure
    hold the same pieces up to coordinates; cheap: one size per distinct parameter kind)."""
    templates: dict[int, list[tuple[Param, str]]] = {}
    for stage in range(spec.pp):
        seen: dict[tuple[Any, ...], tuple[Param, str]] = {}
        for p in spec.stage_params(params, stage):
            _token, _pl, how = spec.placement(p)
            seen.setdefault((p.shape, how), (p, how))
        templates[stage] = list(seen.values())
    out = []
    for rank in range(spec.world):
        stage = spec.coords(rank)[0]
        out.append((stage, tuple(spec.local_numel(p, how, rank) for p, how in templates[stage])))
    return out


def simulated_ranks(spec: Spec, params: Sequence[Param]) -> list[tuple[Any, Any]]:
    """Every rank's (description, record): one full description per distinct structure (its
    digest tells whether ranks of several structures describe alike: standard uneven shards
    do)."""
    memo: dict[tuple[Any, ...], tuple[Any, Any, list[Any]]] = {}
    out = []
    for rank, sig in enumerate(structures(spec, params)):
        hit = memo.get(sig)
        if hit is None:
            pieces = rank_pieces(spec, params, rank)
            desc, record = _describe(spec, pieces, rank)
            tokens = list(dict.fromkeys(p.mesh for p in pieces if p.mesh is not None))
            memo[sig] = (desc, record, tokens)
            out.append((desc, record))
            continue
        desc, record, tokens = hit
        stage_ranks = spec.stage_ranks(rank)
        coords = tuple(c for token in tokens for c in spec.mesh_coords(token, rank))
        out.append((desc, dataclasses.replace(
            record, coords=coords, host=f"node{rank // 8}",
            stage_digest=handshake.stage_digest(stage_ranks) if stage_ranks else b"",
        )))
    return out


def self_check(world: int = 8, params: Sequence[Param] | None = None) -> None:
    """The simulation's shortcuts hold: local sizes equal torch's for every parameter kind and
    coordinate, and every simulated record/description equals a full describe of the rank."""
    params = list(params or transformer(layers=2, d=12, ffn=20, vocab=30, ctx=6))
    for case in CASES:
        spec = spec_for(case, world)
        simulated = simulated_ranks(spec, params)
        for rank in range(world):
            pieces = rank_pieces(spec, params, rank)
            for p, piece in zip(spec.stage_params(params, spec.coords(rank)[0]), pieces,
                                strict=True):
                token, placements, _how = spec.placement(p)
                if token is not None:
                    # FSDP2 chunks the TP-local tensor: torch's rule with the TP dim first
                    order = sorted(range(len(placements)),
                                   key=lambda i: isinstance(placements[i], _StridedShard))
                    shape, coords = spec.mesh_shape(token), spec.mesh_coords(token, rank)
                    local, _ = _compute_local_shape_and_global_offset(
                        p.shape, [shape[i] for i in order], [coords[i] for i in order],
                        [Shard(placements[i].dim) if isinstance(placements[i], _StridedShard)
                         else placements[i] for i in order])
                    assert math.prod(local) == piece.numel, (case, rank, p, local, piece.numel)
            assert simulated[rank] == _describe(spec, pieces, rank), (case, rank)
        stages: dict[int, set[bytes]] = {}
        for rank, (_desc, record) in enumerate(simulated):
            stages.setdefault(spec.coords(rank)[0], set()).add(record.digest)
        assert all(len(digests) == 1 for digests in stages.values()), case
        # The simulated meshes place every rank where its record does (the agreed path's
        # coordinate table is the records' coordinates).
        table = handshake.coordinate_table(simulated_meshes(spec, params), world)
        if spec.pp == 1:
            assert table is not None
            assert [tuple(row) for row in table.tolist()] == [rec.coords for _d, rec in simulated]


def _gather_all_bytes(pairs: Sequence[tuple[Any, Any]], spec: Spec,
                      params: Sequence[Param]) -> int:
    """Received per rank by an all-gather of every rank's JSON description (keys with
    coordinates, explicit local sizes), padded to the longest, plus the lengths."""
    longest, seen = 0, set()
    for rank, sig in enumerate(structures(spec, params)):
        if sig in seen:
            continue
        seen.add(sig)
        pieces = rank_pieces(spec, params, rank)
        old = {"version": "v", "config": "c", "stage": spec.stage_ranks(rank),
               "pieces": [[p.name, list(p.global_shape), list(p.key), p.numel] for p in pieces]}
        longest = max(longest, len(json.dumps(old, sort_keys=True).encode()))
    return len(pairs) * (longest + 8)


@dataclass(frozen=True, eq=False)
class SimulatedMesh:
    """What the handshake reads of a DeviceMesh to place other ranks: the grid of its copies."""

    rank_grid: torch.Tensor


def simulated_meshes(spec: Spec, params: Sequence[Param]) -> list[SimulatedMesh]:
    """The mesh slots of rank 0 (every rank of a non-pipeline case holds the same ones)."""
    tokens = handshake.mesh_slots(rank_pieces(spec, params, 0))
    return [SimulatedMesh(spec.rank_grid(token)) for token in tokens]


def _layout_step(pairs: Sequence[tuple[Any, Any]], meshes: Sequence[Any], rank: int) -> Any:
    return derive_layout(handshake_sim.simulate(pairs, meshes), rank)


def measure_case(case: str, world: int, params: Sequence[Param]) -> ScaleResult:
    spec = spec_for(case, world)
    pairs = simulated_ranks(spec, params)
    meshes = simulated_meshes(spec, params)
    rank = world - 1  # every rank does the same work; the last one holds the emptiest shards
    gc.collect()
    t0 = time.perf_counter()
    layout = _layout_step(pairs, meshes, rank)
    seconds = time.perf_counter() - t0
    gc.collect()
    tracemalloc.start()
    try:
        gathered = handshake_sim.simulate(pairs, meshes)
        derive_layout(gathered, rank)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sent, received = handshake_sim.bytes_per_rank(gathered)
    return ScaleResult(
        case=case, world=world, n_params=len(params), mesh=_mesh_text(spec),
        distinct=len(gathered.descriptions), seconds=seconds, peak_bytes=peak,
        sent_bytes=sent, received_bytes=received,
        gather_all_received_bytes=_gather_all_bytes(pairs, spec, params),
        packed_bytes=8 * layout.packed_length, replicas=layout.replicas,
        agreed=gathered.agreed, **timing_bytes(layout),
    )


def timing_bytes(layout: Layout) -> dict[str, int]:
    """What ``rank_timing`` adds to each rank's per-step vector at this world: the vector
    with it and its timing section alone (constant in the world size by design)."""
    timed = dataclasses.replace(layout, rank_timing=True)
    at = sections(timed).rank_timing
    return {"timed_packed_bytes": 8 * timed.packed_length,
            "timing_bytes": 8 * (at.stop - at.start)}


def _mesh_text(spec: Spec) -> str:
    if spec.name == "DDP":
        return f"dp{spec.world}"
    if spec.name == "HSDP":
        return f"{spec.rep}x{spec.dp}"
    parts = [f"pp{spec.pp}"] * (spec.pp > 1) + [f"dp{spec.dp}"] + [f"tp{spec.tp}"] * (spec.tp > 1)
    return " x ".join(parts)


def measure(worlds: Sequence[int] = WORLDS, cases: Sequence[str] = CASES,
            progress: Callable[[str], None] = print) -> list[ScaleResult]:
    self_check()
    params, even = transformer(), transformer(vocab=EVEN_VOCAB)
    out = []
    for world in worlds:
        for case in cases:
            res = measure_case(case, world, even if case == EVEN_CASE else params)
            progress(f"  {case} at {world} ranks: {res.seconds:.2f} s, "
                     f"{res.peak_bytes / 2**20:.0f} MiB, {res.distinct} distinct, "
                     f"{'agreed' if res.agreed else 'records'}: {res.sent_bytes} B sent, "
                     f"{res.received_bytes} B received, rank timing {res.timing_bytes} B")
            out.append(res)
    return out


if __name__ == "__main__":
    import sys

    measure([int(w) for w in sys.argv[1:]] or WORLDS)
