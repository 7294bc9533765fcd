"""The scalable handshake: the layout derived from distinct descriptions + per-rank records
equals build_layout's on every rank's full description, over generated layouts (DDP, FSDP2 with
uneven and empty shards, sub-mesh copies, FSDP2 x TP strided shards, HSDP, pipeline stages),
and disagreements raise LayoutMismatchError on both paths."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
from layout_reference import build_layout
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from benchmarks import handshake_sim
from gradwatch.errors import LayoutMismatchError
from gradwatch.reduce import handshake, layout
from gradwatch.reduce.layout import LocalPiece, derive_layout, piece_from_placements

Rank = list[LocalPiece]


def unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def numel_of(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
             placements: list[Any]) -> int:
    local, _ = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    total = 1
    for s in local:
        total *= s
    return total


def fsdp2_numel(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                placements: list[Any]) -> int:
    """The numel FSDP2 holds: it chunks the tensor-parallel local tensor, i.e. torch's rule
    with the Shard dims first and the _StridedShard dims (as plain shards) after them."""
    order = sorted(range(len(placements)), key=lambda i: isinstance(placements[i], _StridedShard))
    plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]
    return numel_of(shape, tuple(mesh_shape[i] for i in order), tuple(coord[i] for i in order),
                    [plain[i] for i in order])


def random_world(rng: random.Random) -> tuple[list[Rank], list[list[int] | None]]:
    """Every rank's pieces (built by the production piece_from_placements) and stage lists."""
    stages = rng.choice([1, 1, 2, 3])
    mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 3])))
    inner = 1
    for s in mesh_shape:
        inner *= s
    # Parameter templates per stage: (shape, placements on the inner mesh, sub-mesh dims).
    templates = []
    for _ in range(rng.randint(1, 6)):
        shape = tuple(rng.choice([1, 2, 3, 5, 7, 8]) for _ in range(rng.choice([1, 2])))
        kind = rng.choice(["whole", "mesh", "mesh", "sub"])
        dims = list(range(len(mesh_shape)))
        if kind == "sub":
            dims = sorted(rng.sample(dims, rng.randint(1, len(dims))))
        placements: list[Any] = []
        for _ in dims:
            choice = rng.choice(["rep", "shard", "shard", "strided"])
            tdim = rng.randrange(len(shape))
            if choice == "rep":
                placements.append(Replicate())
            elif choice == "shard":
                placements.append(Shard(tdim))
            else:
                placements.append(_StridedShard(tdim, split_factor=rng.choice([1, 2])))
        # laid out by torch's rule (distribute_tensor) or as FSDP2 holds strided shards
        layout = rng.choice([numel_of, fsdp2_numel])
        templates.append((shape, kind, dims, placements, layout))
    world = stages * inner
    per_rank: list[Rank] = []
    stage_lists: list[list[int] | None] = []
    for r in range(world):
        stage, within = divmod(r, inner)
        coord = unravel(within, mesh_shape)
        pieces: Rank = []
        for i, (shape, kind, dims, placements, layout) in enumerate(templates):
            name = f"s{stage}.p{i}" if stages > 1 else f"p{i}"
            if kind == "whole":
                n = 1
                for s in shape:
                    n *= s
                pieces.append(LocalPiece(name, shape, ("whole",), n))
                continue
            sub_shape = tuple(mesh_shape[d] for d in dims)
            sub_coord = tuple(coord[d] for d in dims)
            try:
                n = layout(shape, sub_shape, sub_coord, placements)
            except Exception:
                n = 1  # a placement torch cannot lay out here: an arbitrary (maybe bad) piece
            pieces.append(piece_from_placements(name, shape, placements, ("mesh", tuple(dims)),
                                                sub_coord, n, mesh_shape=sub_shape))
        per_rank.append(pieces)
        stage_lists.append(
            [s * inner + within for s in range(stages)] if stages > 1 else None)
    if rng.random() < 0.5:
        # Ranks need not be laid out stage-major and mesh-major: shuffle which rank is which.
        order = list(range(world))
        rng.shuffle(order)  # order[new] = old
        new_of = {old: new for new, old in enumerate(order)}
        per_rank = [per_rank[old] for old in order]
        stage_lists = [sorted(new_of[o] for o in stage_lists[old])
                       if stage_lists[old] is not None else None for old in order]
    return per_rank, stage_lists


def reference(per_rank: list[Rank], stages: list[list[int] | None], config: list[str],
              rank: int) -> Any:
    descs = [
        {"version": "v", "config": config[r], "stage": stages[r], "host": f"h{r}",
         "pieces": [[p.name, list(p.global_shape), [list(k) if isinstance(k, tuple) else k
                                                    for k in p.key], p.numel]
                    for p in pieces]}
        for r, pieces in enumerate(per_rank)
    ]
    return build_layout(descs, rank)


class GridMesh:
    """A simulated mesh: the ranks of all its copies, as a torch DeviceMesh knows them."""

    def __init__(self, rank_grid: torch.Tensor) -> None:
        self.rank_grid = rank_grid


def grids_of(per_rank: list[Rank]) -> list[GridMesh] | None:
    """The mesh slots of rank 0 as grids built from every rank's coordinates on them (ranks at
    one coordinate ascending, one per copy); None when they do not form whole copies."""
    out = []
    for token in handshake.mesh_slots(per_rank[0]):
        at: dict[tuple[int, ...], list[int]] = {}
        for r, pieces in enumerate(per_rank):
            coords = next((p.coords for p in pieces if p.mesh == token), None)
            if coords is not None:
                at.setdefault(coords, []).append(r)
        shape = tuple(max(c[d] for c in at) + 1 for d in range(len(next(iter(at)))))
        copies = {len(ranks) for ranks in at.values()}
        cells = 1
        for size in shape:
            cells *= size
        if len(copies) != 1 or len(at) != cells or min(min(c) for c in at) < 0:
            return None
        grid = torch.empty((copies.pop(), *shape), dtype=torch.int64)
        for coords, ranks in at.items():
            for k, r in enumerate(ranks):
                grid[(k, *coords)] = r
        out.append(GridMesh(grid))
    return out


def scalable(per_rank: list[Rank], stages: list[list[int] | None], config: list[str],
             rank: int, meshes: list[GridMesh] | None = None, agreed: list | None = None) -> Any:
    pairs = [
        handshake.describe(pieces, version="v", config_hash=config[r], stage_ranks=stages[r],
                           host=f"h{r}")
        for r, pieces in enumerate(per_rank)
    ]
    gathered = handshake_sim.simulate(pairs, meshes)
    if agreed is not None:
        agreed.append(gathered.agreed)
    return derive_layout(gathered, rank)


def outcome(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except LayoutMismatchError:
        return "LayoutMismatchError"


def mutate(rng: random.Random, per_rank: list[Rank], stages: list, config: list[str]) -> None:
    r = rng.randrange(len(per_rank))
    what = rng.choice(["config", "numel", "shape", "drop", "dup", "stage"])
    pieces = per_rank[r]
    if what == "config":
        config[r] = "other"
    elif what == "stage" and stages[r] is not None:
        stages[r] = stages[r][:-1] or None
    elif pieces:
        i = rng.randrange(len(pieces))
        p = pieces[i]
        if what == "numel":
            pieces[i] = dataclasses.replace(p, numel=p.numel + 1)
        elif what == "shape":
            pieces[i] = dataclasses.replace(p, global_shape=(*p.global_shape, 2),
                                            numel=p.numel * 2)
        elif what == "drop":
            del pieces[i]
        else:
            pieces.append(p)


@pytest.mark.parametrize("seed", range(300))
def test_derived_layout_equals_build_layout(seed: int) -> None:
    rng = random.Random(seed)
    per_rank, stages = random_world(rng)
    config = ["c"] * len(per_rank)
    if seed % 3 == 2:
        mutate(rng, per_rank, stages, config)
    outcomes = set()
    meshes = grids_of(per_rank)
    paths: list[bool] = []
    for rank in range(len(per_rank)):
        want = outcome(reference, per_rank, stages, config, rank)
        got = outcome(scalable, per_rank, stages, config, rank)
        assert got == want, (seed, rank)
        # The agreed path (coordinates derived from the meshes' grids, no records exchanged)
        # derives the same layout, or falls back to the records.
        if meshes is not None:
            got = outcome(scalable, per_rank, stages, config, rank, meshes, paths)
            assert strip_hosts(got) == strip_hosts(want), (seed, rank)
        outcomes.add(str(got))
    one_structure = len({handshake.describe(p, version="v", config_hash=c)[0]
                         for p, c in zip(per_rank, config, strict=True)}) == 1
    agreeable = one_structure and stages[0] is None and meshes is not None
    assert paths == [agreeable] * len(paths), seed
    if seed % 3 != 2 and stages[0] is None and meshes is not None and standard(per_rank):
        assert paths == [True] * len(per_rank), seed  # uneven and empty shards included
    # (strided shards laid out by torch's rule where it differs from FSDP2's take the records)
    if "LayoutMismatchError" in outcomes:
        assert outcomes == {"LayoutMismatchError"}  # every rank refuses alike


def strip_hosts(lay: Any) -> Any:
    """The layout without host names (the agreed path gathers them only for the rank view)."""
    return lay if isinstance(lay, str) else dataclasses.replace(lay, hosts=())


def test_generated_layouts_cover_the_interesting_cases() -> None:
    """The generator is not vacuous: valid and refused worlds, replicas, empty shards, strided
    shards and stages all occur over the seeds the equivalence test uses."""
    seen = set()
    for seed in range(300):
        rng = random.Random(seed)
        per_rank, stages = random_world(rng)
        config = ["c"] * len(per_rank)
        if seed % 3 == 2:
            mutate(rng, per_rank, stages, config)
        pieces = [p for rank in per_rank for p in rank]
        try:
            lay = reference(per_rank, stages, config, 0)
            seen.add("valid")
            if lay.replicas > 1:
                seen.add("replicas")
            if stages[0] is not None:
                seen.add("stages")
            paths: list[bool] = []
            if (meshes := grids_of(per_rank)) is not None:
                scalable(per_rank, stages, config, 0, meshes, paths)
            if paths == [True]:
                seen.add("agreed")
                if any(len({p.numel for rank in per_rank for p in rank if p.name == name}) > 1
                       for name in {p.name for p in per_rank[0]}):
                    seen.add("agreed uneven")
        except LayoutMismatchError:
            seen.add("refused")
        if any(p.numel == 0 for p in pieces):
            seen.add("empty")
        if any("_StridedShard" in str(p.key) for p in pieces):
            seen.add("strided")
    assert seen == {"valid", "refused", "replicas", "empty", "strided", "stages", "agreed",
                    "agreed uneven"}


def describe_world(per_rank: list[Rank], stages: list | None = None,
                   config: list[str] | None = None,
                   meshes: list[Any] | None = None) -> handshake.Gathered:
    return handshake_sim.simulate([
        handshake.describe(pieces, version="v", config_hash=(config or ["c"] * 99)[r],
                           stage_ranks=(stages or [None] * 99)[r], host=f"h{r}")
        for r, pieces in enumerate(per_rank)
    ], meshes)


def fsdp(world: int, names: int, shape: tuple[int, ...] = (8, 3)) -> list[Rank]:
    return [
        [piece_from_placements(f"p{i}", shape, [Shard(0)], "dp", (r,),
                               numel_of(shape, (world,), (r,), [Shard(0)]), mesh_shape=(world,))
         for i in range(names)]
        for r in range(world)
    ]


def dp_grid(world: int) -> list[GridMesh]:
    return [GridMesh(torch.arange(world).reshape(1, world))]


def test_agreeing_ranks_send_and_receive_fixed_bytes_at_any_world_size() -> None:
    """Phase 0 alone: the same bytes sent and received per rank whatever the number of
    parameters and ranks; the records path (no readable mesh grids) receives W records."""
    for world in (2, 4, 64):
        for names in (50, 2000):
            per_rank = fsdp(world, names, (world * 2, 3))
            gathered = describe_world(per_rank, meshes=dp_grid(world))
            assert gathered.agreed and len(gathered.descriptions) == 1
            assert handshake_sim.bytes_per_rank(gathered) == (handshake.PHASE0_BYTES,
                                                          handshake.PHASE0_BYTES)
            assert gathered.hosts == ()  # not gathered: no per-rank view
            assert [r.coords for r in gathered.records] == [(r,) for r in range(world)]
            fallback = describe_world(per_rank)
            assert not fallback.agreed
            assert handshake_sim.bytes_per_rank(fallback) == (
                handshake.PHASE0_BYTES + handshake.RECORD_BYTES,
                handshake.PHASE0_BYTES + world * handshake.RECORD_BYTES)
            assert derive_layout(gathered, world - 1) == dataclasses.replace(
                derive_layout(fallback, world - 1), hosts=())
    assert describe_world(fsdp(2, 3)).hosts == ("h0", "h1")


def test_agreed_path_gathers_host_names_only_for_the_rank_view() -> None:
    pairs = [handshake.describe(pieces, version="v", config_hash="c", host=f"h{r}",
                                rank_view=3)
             for r, pieces in enumerate(fsdp(4, 5))]
    gathered = handshake_sim.simulate(pairs, dp_grid(4))
    assert gathered.agreed and gathered.hosts == ("h0", "h1", "h2", "h3")
    assert handshake_sim.bytes_per_rank(gathered) == (
        handshake.PHASE0_BYTES + handshake.HOST_BYTES,
        handshake.PHASE0_BYTES + 4 * handshake.HOST_BYTES)
    assert derive_layout(gathered, 2).rank_view_groups == 3


def test_a_grid_that_misplaces_a_rank_falls_back_to_the_records() -> None:
    """Rank 1's row of the derived table is not its own coordinate (ranks 1 and 2 swapped):
    its flag is off, every rank takes the records path, and the layout is unchanged."""
    per_rank = fsdp(4, 3)
    wrong = [GridMesh(torch.tensor([[0, 2, 1, 3]]))]
    gathered = describe_world(per_rank, meshes=wrong)
    assert not gathered.agreed
    assert derive_layout(gathered, 1) == derive_layout(describe_world(per_rank), 1)
    unreadable = [object()]
    assert not describe_world(per_rank, meshes=unreadable).agreed


def test_phase0_verdict() -> None:
    rec = handshake.describe(fsdp(2, 2)[0], version="v", config_hash="c", host="h")[1]
    table = torch.tensor([[0], [1]])
    words = handshake.agreement_words(rec, False, table, 0)
    assert len(words) == handshake.AGREE_WORDS and words[-1] == 1
    assert handshake.agreed([*words, *(-w for w in words)])
    other = [*words[:-2], words[-2] + 1, 1]  # another table digest on some rank
    top = [max(a, b) for a, b in zip(words, other, strict=True)]
    low = [min(a, b) for a, b in zip(words, other, strict=True)]
    assert not handshake.agreed([*top, *(-x for x in low)])
    assert handshake.agreement_words(rec, True, table, 0)[-1] == 0  # stage groups: records
    assert handshake.agreement_words(rec, False, table, 1)[-1] == 0  # not its coordinates
    assert handshake.agreement_words(rec, False, None, 0)[-1] == 0


def test_coordinate_table_of_device_meshes_equals_every_ranks_coordinates() -> None:
    """Real torch DeviceMeshes (a fake process group per rank, one process): the table one
    rank derives from its root mesh, sub-meshes, a flattened mesh and a permuted mesh equals
    the coordinates every other rank reads from its own copies (``get_coordinate``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 8
    tables, coords = [], []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
            permuted = DeviceMesh("cpu", torch.tensor([[3, 0, 6, 1], [2, 7, 4, 5]]))
            meshes = [root, root["tp"], root["dp", "tp"], root["pp", "tp"],
                      root["dp", "tp"]._flatten("dptp"), permuted]
            table = handshake.coordinate_table(meshes, world)
            assert table is not None
            tables.append(table)
            coords.append(tuple(c for m in meshes for c in m.get_coordinate()))
        finally:
            dist.destroy_process_group()
    for rank in range(world):
        assert torch.equal(tables[rank], tables[0])
        assert tuple(tables[0][rank].tolist()) == coords[rank], rank
    assert tables[0].shape == (world, 3 + 1 + 2 + 2 + 1 + 2)


def fsdp2_layout_numel(piece: LocalPiece) -> int | None:
    """The local numel of ``piece`` at its coordinates as FSDP2 lays it out (torch's rule when
    no _StridedShard), from its key's placements (None: torch cannot lay it out)."""
    namespace = {"Shard": Shard, "_StridedShard": _StridedShard}
    placements = [eval(pl, namespace) for _dim, _c, pl in piece.key]  # keys hold reprs
    try:
        return fsdp2_numel(piece.global_shape,
                           tuple(piece.mesh_shape[d] for d, _c, _pl in piece.key),
                           tuple(c for _d, c, _pl in piece.key), placements)
    except Exception:
        return None


def standard(per_rank: list[Rank]) -> bool:
    """Every DTensor piece's numel is what the standard rules give at the rank's coordinates
    (torch's; for strided shards FSDP2's nested layout)."""
    return all(p.numel == fsdp2_layout_numel(p) for pieces in per_rank for p in pieces
               if p.mesh is not None)


def test_spec_numel_equals_torch_and_tiles() -> None:
    """handshake.spec_numel equals torch's _compute_local_shape_and_global_offset for Shard
    and _StridedShard (any split factor, several mesh dims on one tensor dim, uneven and empty
    shards), and over every coordinate its pieces tile the tensor exactly once."""
    choices = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2),
               _StridedShard(1, split_factor=3), _StridedShard(0, split_factor=1)]
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 9, 12]) for _ in range(rng.choice([1, 2])))
        mesh_shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.choice([1, 2, 3])))
        placements = [rng.choice(choices) for _ in mesh_shape]
        if any(not isinstance(pl, Replicate) and pl.dim >= len(shape) for pl in placements):
            spec = tuple((d, repr(pl)) for d, pl in enumerate(placements)
                         if not isinstance(pl, Replicate))
            assert handshake.spec_numel(shape, spec, mesh_shape, [0] * len(spec)) is None
            continue
        spec = tuple((d, repr(pl)) for d, pl in enumerate(placements)
                     if not isinstance(pl, Replicate))
        nested_total = 0
        cells = {}
        for r in range(1 if not mesh_shape else torch.tensor(mesh_shape).prod().item()):
            coord = unravel(r, mesh_shape)
            want = numel_of(shape, mesh_shape, coord, placements)
            at = [coord[d] for d, _pl in spec]
            assert handshake.spec_numel(shape, spec, mesh_shape, at) == want, (
                shape, mesh_shape, placements, coord)
            cells[tuple(at)] = want
            nested_total += handshake.spec_numel(shape, spec, mesh_shape, at, nested=True)
            checked += 1
        total = sum(cells.values())
        whole = numel_of(shape, (1,), (0,), [Replicate()])
        # the vectorized form derive() uses on mixed classes gives the same numbers
        at_all = torch.tensor(list(cells), dtype=torch.int64).view(len(cells), len(spec))
        for nested in (False, True):
            assert layout._spec_numels(shape, spec, mesh_shape, at_all, nested).tolist() == [
                handshake.spec_numel(shape, spec, mesh_shape, list(at), nested=nested)
                for at in cells]
        # each distinct coordinate of the spec's dims recurs once per replicated position
        copies = torch.tensor(mesh_shape).prod().item() // len(cells)
        assert total == whole and nested_total == whole * copies, (shape, placements)
    assert checked > 1000
    assert handshake.spec_numel((4,), ((0, "Partial(sum)"),), (2,), [0]) is None
    assert handshake.spec_numel((4,), ((0, "Shard(dim=0)"),), (2,), [2]) is None
    assert handshake.spec_numel((4,), ((0, "Shard(dim=0)"),), (-1,), [0]) is None


def chunk(size: int, parts: int, at: int) -> int:
    """torch.chunk's piece ``at`` of ``size`` in ``parts`` (empty pieces past the end)."""
    pieces = torch.arange(size).chunk(parts) if size else ()
    return len(pieces[at]) if at < len(pieces) else 0


def test_nested_rule_is_fsdp2s_layout_and_tiles() -> None:
    """spec_numel(nested=True) is FSDP2's layout of a tensor-parallel DTensor (the TP-local
    rows chunked over the data-parallel dim: chunk(chunk(rows, tp, t), dp, d)); torch's rule
    differs from it for some uneven sizes; both tile the tensor over every coordinate."""
    differ = 0
    for rows in range(0, 40):
        for dp, tp in ((1, 2), (2, 2), (3, 2), (4, 2), (3, 3), (4, 3)):
            spec = ((0, repr(_StridedShard(0, split_factor=tp))), (1, repr(Shard(0))))
            nested = flat = 0
            for d in range(dp):
                for t in range(tp):
                    got = handshake.spec_numel((rows, 2), spec, (dp, tp), [d, t], nested=True)
                    assert got == 2 * chunk(chunk(rows, tp, t), dp, d), (rows, dp, tp, d, t)
                    torch_rule = handshake.spec_numel((rows, 2), spec, (dp, tp), [d, t])
                    differ += torch_rule != got
                    nested, flat = nested + got, flat + torch_rule
            assert nested == flat == 2 * rows
    assert differ > 0


def test_real_fsdp2_over_tp_uneven_shards_describe_alike() -> None:
    """Real fully_shard over a tensor-parallel DTensor (a fake process group per rank, one
    process; 8 ranks on a (4, 2) mesh, a 50,257-row vocabulary): the local sizes FSDP2 holds
    differ from torch's rule on some ranks, match the nested rule on every rank, and every
    rank describes the piece alike."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, descs, torch_rule = 8, set(), 0
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
            model = nn.Module()
            model.w = nn.Parameter(distribute_tensor(torch.zeros(50257, 3), mesh["tp"],
                                                     [Shard(0)], src_data_rank=None))
            fully_shard(model, mesh=mesh["dp"])
            param = model.w
            assert "_StridedShard" in repr(param.placements)
            # The root mesh's coordinates: one process reuses rank 0's mesh for the
            # parameter (the fake group's cache), real ranks each hold their own.
            coord = mesh.get_coordinate()
            piece = piece_from_placements("w", tuple(param.shape), param.placements, "2d",
                                          coord, param.to_local().numel(),
                                          mesh_shape=tuple(mesh.shape))
            torch_rule += piece.numel != numel_of((50257, 3), (4, 2), tuple(coord),
                                                  list(param.placements))
            desc, _record = handshake.describe([piece], version="v", config_hash="c", host="h")
            assert desc.pieces[0][4] == handshake.DERIVED_NESTED, rank
            descs.add(desc)
        finally:
            dist.destroy_process_group()
    assert len(descs) == 1 and torch_rule > 0


def test_uneven_shards_agree() -> None:
    """Standard uneven and empty shards (6 rows over 4 ranks: 2, 2, 2, 0; a 50,257-row
    vocabulary over 4 ranks) describe alike on every rank: one description, phase 0 alone,
    and the layout equals the reference's."""
    for shape in ((6, 3), (50257, 8)):
        per_rank = fsdp(4, 5, shape)
        assert len({p.numel for pieces in per_rank for p in pieces}) > 1
        gathered = describe_world(per_rank, meshes=dp_grid(4))
        assert gathered.agreed and gathered.rank_group == (0, 0, 0, 0)
        assert all(p[4] == handshake.DERIVED for p in gathered.descriptions[0].pieces)
        assert handshake_sim.bytes_per_rank(gathered) == (handshake.PHASE0_BYTES,) * 2
        records = describe_world(per_rank)  # the records path: one description too
        assert not records.agreed and len(records.descriptions) == 1
        for rank in range(4):
            want = reference(per_rank, [None] * 4, ["c"] * 4, rank)
            assert derive_layout(gathered, rank) == strip_hosts(want)
            assert derive_layout(records, rank) == want
    assert derive_layout(describe_world(fsdp(4, 5, (6, 3)), meshes=dp_grid(4)),
                         3).contributes == (False,) * 5


def test_exotic_shards_keep_their_numel_and_take_the_records_path() -> None:
    """Local sizes that tile the tensor but not by torch's rule (rows 3, 1, 1, 1 of 6; or
    2, 2, 1, 1: two ranks standard, two not) stay explicit: the descriptions differ, every rank
    falls back to the records, and the layout equals the reference's; sizes that do not tile
    are refused alike."""
    for rows in ((3, 1, 1, 1), (2, 2, 1, 1), (2, 2, 2, 1)):
        per_rank = fsdp(4, 3, (6, 3))
        per_rank = [[dataclasses.replace(p, numel=rows[r] * 3) for p in pieces]
                    for r, pieces in enumerate(per_rank)]
        gathered = describe_world(per_rank, meshes=dp_grid(4))
        assert not gathered.agreed and len(gathered.descriptions) > 1
        for rank in range(4):
            want = outcome(reference, per_rank, [None] * 4, ["c"] * 4, rank)
            assert outcome(derive_layout, gathered, rank) == want
        assert (want == "LayoutMismatchError") == (sum(rows) != 6)


def test_uneven_copies_count_replicas_over_non_empty_pieces_only() -> None:
    """Coordinates held by unequal numbers of ranks (one rank at coordinate 0, two at 1 of a
    2-rank mesh): the most replicated piece is the largest cell that holds elements of some
    parameter, as the reference counts it."""
    coords = [(0,), (1,), (1,)]
    for shapes in (((1,),), ((1,), (3,))):
        per_rank = [[piece_from_placements(f"p{i}", shape, [Shard(0)], "dp", c,
                                           numel_of(shape, (2,), c, [Shard(0)]),
                                           mesh_shape=(2,))
                     for i, shape in enumerate(shapes)] for c in coords]
        gathered = describe_world(per_rank)
        assert len(gathered.descriptions) == 1
        for rank in range(3):
            want = reference(per_rank, [None] * 3, ["c"] * 3, rank)
            assert derive_layout(gathered, rank) == want
        assert want.replicas == len(shapes)


def test_groups_differing_elsewhere_share_derived_pieces() -> None:
    """Ranks whose descriptions differ only outside their pieces (a per-rank view asked by two
    ranks of four) hold the same derived uneven pieces: the layout equals the reference's."""
    per_rank = fsdp(4, 5, (6, 3))
    gathered = handshake_sim.simulate([
        handshake.describe(pieces, version="v", config_hash="c", host=f"h{r}",
                           rank_view=3 if r < 2 else 0)
        for r, pieces in enumerate(per_rank)], dp_grid(4))
    assert not gathered.agreed and gathered.rank_group == (0, 0, 1, 1)
    for rank in range(4):
        assert derive_layout(gathered, rank) == reference(per_rank, [None] * 4, ["c"] * 4, rank)


def test_replica_slots_are_capped() -> None:
    world = layout.MAX_REPLICA_SLOTS + 6
    per_rank = [[LocalPiece("w", (2,), ("whole",), 2)] for _ in range(world)]
    gathered = describe_world(per_rank)
    lays = [derive_layout(gathered, r) for r in (0, layout.MAX_REPLICA_SLOTS - 1,
                                                 layout.MAX_REPLICA_SLOTS)]
    assert lays[0].replicas == layout.MAX_REPLICA_SLOTS
    assert [lay.replica_slot for lay in lays] == [(0,), (layout.MAX_REPLICA_SLOTS - 1,),
                                                  (-1,)]


@pytest.mark.parametrize("shape", [(8, 3), (6, 3)])  # even; uneven with an empty shard
def test_mismatch_names_digest_groups_and_a_parameter(shape: tuple[int, ...]) -> None:
    per_rank = fsdp(4, 3, shape)
    per_rank[2] = per_rank[2][:2]  # rank 2 lacks p2
    assert not describe_world(per_rank, meshes=dp_grid(4)).agreed
    with pytest.raises(LayoutMismatchError) as err:
        derive_layout(describe_world(per_rank, meshes=dp_grid(4)), 0)
    text = str(err.value)
    assert "digest group 1 (ranks 2)" in text and "'p2'" in text
    assert "digest group 0 (ranks 0-1, 3)" in text and "different models" in text
    config = ["a", "a", "b", "a"]
    with pytest.raises(LayoutMismatchError, match=r"digest group 1 \(ranks 2\): version v "
                                                  r"config b"):
        derive_layout(describe_world(fsdp(4, 3), config=config), 1)


def test_ranks_text() -> None:
    assert layout.ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert layout.ranks_text(list(range(0, 20, 2)), limit=2) == "ranks 0, 2 and 8 more"


def test_record_round_trip_and_coordinate_overflow() -> None:
    desc, record = handshake.describe(
        [piece_from_placements("w", (4,), [Shard(0)] * 3, ("m", i), (1, 0, 1), 1)
         for i in range(11)],
        version="v", config_hash="c", host="node-1")
    assert record.overflow  # 11 meshes x 3 coordinates > MAX_COORDS
    with pytest.raises(Exception, match="more than 32 coordinates"):
        derive_layout(handshake_sim.simulate([(desc, record)]), 0)
    desc, record = handshake.describe(fsdp(2, 2)[1], version="v", config_hash="c",
                                      stage_ranks=[1, 3], host="node-2")
    again = handshake.RankRecord.unpack(record.pack())
    assert again == record and again.coords == (1,) and again.host == "node-2"
    assert handshake.Description.decode(desc.encode()) == desc


def _replicas(world: int, names: int = 3) -> list[Rank]:
    return [[LocalPiece(f"p{i}", (4, 2), ("whole",), 8) for i in range(names)]
            for _ in range(world)]


def _declared(per_rank: list[Rank], synced: list[bool],
              stages: list | None = None) -> handshake.Gathered:
    return handshake_sim.simulate([
        handshake.describe(pieces, version="v", config_hash="c", host=f"h{r}",
                           synced=synced[r], stage_ranks=(stages or [None] * 99)[r])
        for r, pieces in enumerate(per_rank)
    ])


def test_collects_skip_the_all_reduce_only_when_every_rank_holds_every_parameter_synced() -> None:
    """Whole plain pieces on every rank, every rank declaring DDP's reduction over the world:
    the same decision on every rank; anything else keeps the all-reduce."""
    world = 4
    both = _declared(_replicas(world), [True] * world)
    assert {derive_layout(both, r).replicated_synced for r in range(world)} == {True}
    one_not = _declared(_replicas(world), [True, True, False, True])
    assert {derive_layout(one_not, r).replicated_synced for r in range(world)} == {False}
    undeclared = _declared(_replicas(world), [False] * world)
    assert not derive_layout(undeclared, 0).replicated_synced
    alone = _declared(_replicas(1), [True])
    assert not derive_layout(alone, 0).replicated_synced
    # sharded pieces (FSDP2) never qualify, even declared
    sharded = handshake_sim.simulate([
        handshake.describe(pieces, version="v", config_hash="c", host=f"h{r}", synced=True)
        for r, pieces in enumerate(fsdp(world, 3))], dp_grid(world))
    assert not derive_layout(sharded, 1).replicated_synced
    # pipeline stages: different parameters per stage, declared synced within each stage
    stage_pieces = [[LocalPiece(f"s{r // 2}.p", (4, 2), ("whole",), 8)] for r in range(world)]
    stages = [[0, 2], [1, 3], [0, 2], [1, 3]]
    staged = _declared(stage_pieces, [True] * world, stages)
    assert not derive_layout(staged, 0).replicated_synced


def test_the_synced_declaration_survives_encoding() -> None:
    desc, _ = handshake.describe(_replicas(1)[0], version="v", config_hash="c", host="h",
                                 synced=True)
    assert handshake.Description.decode(desc.encode()) == desc
    assert handshake.Description.decode(desc.encode()).synced is True


def flat_world(shard: int, replicas: int = 1) -> tuple[list[Rank], list[Any]]:
    """FSDP1 flat shards (``FlatShard(start, total)`` on the last dim of a (replicas, shard)
    mesh, as gradwatch.stacks.fsdp1 describes them): parameters laid end to end with alignment gaps,
    uneven and empty slices; each rank's numel counted from torch.chunk of the flat range."""
    from gradwatch.stacks.fsdp1 import ShardMesh

    shapes = [(5, 7), (7,), (3, 7), (3,), (1,), (2, 3)]
    starts, at = [], 0
    for s in shapes:
        starts.append(at)
        at += math.prod(s) + 1  # one element of alignment padding after each
    total = at
    world = shard * replicas
    shape = (replicas, shard) if replicas > 1 else (shard,)
    grid = tuple(range(world))
    owner = torch.full((total,), -1, dtype=torch.int64)
    for c, chunk in enumerate(torch.arange(total).chunk(shard)):
        owner[chunk] = c
    per_rank = []
    for r in range(world):
        coords = (r // shard, r % shard) if replicas > 1 else (r,)
        mesh = ShardMesh(shape, (), grid)
        dim = len(shape) - 1
        per_rank.append([
            LocalPiece(f"p{i}", s, ((dim, coords[dim], handshake.flat_shard(st, total)),),
                       int((owner[st : st + math.prod(s)] == coords[dim]).sum()), mesh=mesh,
                       coords=coords, mesh_shape=shape)
            for i, (s, st) in enumerate(zip(shapes, starts, strict=True))])
    return per_rank, [ShardMesh(shape, (), grid)]


def test_fsdp1_flat_shards_agree_and_equal_the_reference() -> None:
    """FSDP1's flat shards describe alike on every rank (their slices derived from the
    placement): phase 0 alone, and the derived layout equals the reference's over the explicit
    numels, sharded over 4 ranks and hybrid over 2 x 2 (replicas counted once)."""
    for shard, replicas in ((4, 1), (2, 2), (3, 1)):
        per_rank, meshes = flat_world(shard, replicas)
        world = shard * replicas
        assert any(p.numel == 0 for pieces in per_rank for p in pieces)  # empty slices
        gathered = describe_world(per_rank, meshes=meshes)
        assert gathered.agreed and len(gathered.descriptions) == 1
        assert all(p[4] == handshake.DERIVED for p in gathered.descriptions[0].pieces)
        records = describe_world(per_rank)
        assert not records.agreed and len(records.descriptions) == 1
        for rank in range(world):
            want = reference(per_rank, [None] * world, ["c"] * world, rank)
            assert derive_layout(gathered, rank) == strip_hosts(want)
            assert derive_layout(records, rank) == want
        assert derive_layout(gathered, 0).replicas == replicas
