"""Unit tests of FSDP1's flat shards as the handshake describes them (gradwatch.stacks.fsdp1,
gradwatch.reduce.handshake): the slice rule against torch.chunk, the split plan of a local shard,
and the parallelism labels. The distributed behaviour is tested in
tests/distributed/test_fsdp1_distributed.py."""

from __future__ import annotations

import math
import random

import torch

from gradwatch.analysis.audit import parallel_factors
from gradwatch.reduce import handshake, layout
from gradwatch.stacks.fsdp1 import Unit, _split_plan


def _layout(rng: random.Random) -> tuple[list[tuple[int, ...]], list[int], int]:
    """Random parameter shapes laid end to end with alignment gaps: (shapes, starts, total)."""
    shapes, starts, at = [], [], 0
    for _ in range(rng.randint(1, 6)):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(1, 3)))
        at += rng.choice((0, 0, 1, 3))  # alignment padding before it
        shapes.append(shape)
        starts.append(at)
        at += math.prod(shape)
    return shapes, starts, at + rng.choice((0, 2))


def test_flat_shard_rule_is_torch_chunk() -> None:
    """Each rank's slice is the parameter's elements inside its torch.chunk piece of the flat
    parameter (as FSDP1 shards it), the pieces tile every parameter once, and the vectorized
    form agrees."""
    rng = random.Random(0)
    for _ in range(300):
        shapes, starts, total = _layout(rng)
        parts = rng.randint(1, 9)
        owner = torch.full((max(total, 1),), -1, dtype=torch.int64)
        for c, chunk in enumerate(torch.arange(total).chunk(parts)):
            owner[chunk] = c
        for shape, start in zip(shapes, starts, strict=True):
            spec = ((0, handshake.flat_shard(start, total)),)
            numel = math.prod(shape)
            held = owner[start : start + numel]
            got = [handshake.spec_numel(shape, spec, (parts,), [c]) for c in range(parts)]
            assert got == [int((held == c).sum()) for c in range(parts)], (shape, start, total)
            assert sum(got) == numel
            at = torch.arange(parts).view(parts, 1)
            assert layout._spec_numels(shape, spec, (parts,), at, False).tolist() == got
            # on the last dim of a (replicate, shard) mesh too
            spec2 = ((1, handshake.flat_shard(start, total)),)
            assert handshake.spec_numel(shape, spec2, (2, parts), [parts - 1]) == got[-1]


def test_flat_shard_rule_refuses_what_it_cannot_tell() -> None:
    spec = ((0, handshake.flat_shard(4, 10)),)
    assert handshake.spec_numel((7,), spec, (2,), [0]) is None  # beyond the flat parameter
    assert handshake.spec_numel((3,), spec, (2,), [2]) is None  # no such coordinate
    assert handshake.spec_numel((3,), ((0, "FlatShard(start=4)"),), (2,), [0]) is None


def test_split_plan_covers_the_local_shard() -> None:
    """Gaps (alignment padding), parameters held nowhere here (empty views) and the end
    padding are their own pieces; the parameters' pieces are where FSDP put them."""
    unit = Unit(flat=torch.zeros(0), names=("a", "b", "c", "d"), shapes=((5,), (3,), (4,), (2,)),
                starts=(0, 6, 10, 14), total=16, offsets=(0, 1, 5, 0), local=(0, 3, 4, 0),
                shard_numel=10, strategy="FULL_SHARD", mesh=None, coords=(), group_size=2,
                orig_params=None)
    sizes, picks = _split_plan(unit)
    assert sum(sizes) == unit.shard_numel
    shard = torch.arange(10.0)
    views = shard.split(sizes)
    assert [views[i].tolist() for i in picks] == [[], [1.0, 2.0, 3.0], [5.0, 6.0, 7.0, 8.0], []]


def test_fsdp1_labels_parse_for_the_audit() -> None:
    assert parallel_factors("fsdp1x4", 4) == {"world": 4, "shards": 4}
    assert parallel_factors("fsdp1hsdp2x2", 4) == {"world": 4, "replicas": 2, "shards": 2}
    assert parallel_factors("fsdp1noshard2", 2) == {"world": 2, "replicas": 2}
