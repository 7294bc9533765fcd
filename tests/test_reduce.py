"""Pure unit tests of build_layout (no process group)."""

from __future__ import annotations

import pytest

from gradwatch.errors import LayoutMismatchError
from gradwatch.reduce import build_layout


def desc(pieces, stage=None, config="c", version="v"):
    return {"version": version, "config": config, "pieces": pieces, "stage": stage}


def whole(name, shape=(2, 3)):
    numel = 1
    for s in shape:
        numel *= s
    return [name, list(shape), ["whole"], numel]


def shard(name, shape, coords, numel, placement="Shard(dim=0)"):
    return [name, list(shape), [[d, c, placement] for d, c in coords], numel]


def test_ddp_replicas_counted_once_by_lowest_rank() -> None:
    per_rank = [desc([whole("w"), whole("b", (3,))]) for _ in range(4)]
    layouts = [build_layout(per_rank, r) for r in range(4)]
    assert layouts[0].contributes == (True, True)
    assert all(lay.contributes == (False, False) for lay in layouts[1:])
    assert [lay.replica_slot for lay in layouts] == [(r, r) for r in range(4)]
    assert layouts[0].replicas == 4 and layouts[0].packed_length == 3 * 2 + 4 + 1
    assert layouts[0].numels == (6, 3)


def test_uneven_fsdp_with_empty_shard() -> None:
    per_rank = [
        desc([shard("b", (3,), [(0, 0)], 2)]),
        desc([shard("b", (3,), [(0, 1)], 1)]),
        desc([shard("b", (3,), [(0, 2)], 0)]),
    ]
    layouts = [build_layout(per_rank, r) for r in range(3)]
    assert [lay.contributes for lay in layouts] == [(True,), (True,), (False,)]
    assert layouts[0].replicas == 1


def test_strided_shard_coordinates_distinguish_pieces() -> None:
    # FSDP2 x TP: (_StridedShard on dp, Shard on tp); four distinct pieces.
    pl = ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    per_rank = []
    for dp in range(2):
        for tp in range(2):
            key = [[0, dp, pl[0]], [1, tp, pl[1]]]
            per_rank.append(desc([["w", [6, 5], key, 10 if dp == 0 else 5]]))
    layouts = [build_layout(per_rank, r) for r in range(4)]
    assert all(lay.contributes == (True,) for lay in layouts)


def test_submesh_param_copies_across_other_dim() -> None:
    # dp-sub-mesh param on a dp x tp world: ranks with the same dp coordinate hold copies.
    per_rank = [desc([shard("n", (3,), [(0, r // 2)], 2 if r < 2 else 1)]) for r in range(4)]
    layouts = [build_layout(per_rank, r) for r in range(4)]
    assert [lay.contributes[0] for lay in layouts] == [True, False, True, False]
    assert [lay.replica_slot[0] for lay in layouts] == [0, 1, 0, 1]


def test_pipeline_stages_union_in_rank_order() -> None:
    per_rank = [
        desc([whole("s0.w")], stage=[0, 2]),
        desc([whole("s0.w")], stage=[1, 3]),
        desc([whole("s1.w")], stage=[0, 2]),
        desc([whole("s1.w")], stage=[1, 3]),
    ]
    lay = build_layout(per_rank, 2)
    assert lay.names == ("s0.w", "s1.w")
    assert lay.local_to_global == (1,) and lay.contributes == (True,)
    assert build_layout(per_rank, 3).contributes == (False,)


@pytest.mark.parametrize(
    ("per_rank", "words"),
    [
        ([desc([whole("w")], config="a"), desc([whole("w")], config="b")], "configuration"),
        ([desc([whole("w")]), desc([whole("w", (3, 3))])], "global shape"),
        ([desc([whole("w")]), desc([whole("w"), whole("x")])], "different models"),
        ([desc([whole("w")], stage=[0, 1]), desc([whole("w")], stage=[0, 1])], "same stage"),
        ([desc([whole("w")], stage=[0, 1]), desc([whole("w")])], "stage_group"),
        (
            [desc([whole("a")], stage=[0, 1]), desc([whole("b")], stage=[0, 1]),
             desc([whole("a")], stage=[2, 3]), desc([whole("c")], stage=[2, 3])],
            "different models",
        ),
        (
            [desc([shard("w", (4,), [(0, 0)], 2)]), desc([shard("w", (4,), [(0, 0)], 2)])],
            "cover 2 of 4",
        ),
        ([desc([whole("w"), whole("w")])], "twice"),
    ],
)
def test_mismatches_raise(per_rank: list, words: str) -> None:
    for rank in range(len(per_rank)):
        with pytest.raises(LayoutMismatchError, match=words):
            build_layout(per_rank, rank)
