"""Unit tests of the reduction without a process group: build_layout (pure) and the named
views of the packed vector (ReducedStats, the device accessors)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from layout_reference import build_layout

from gradwatch.errors import LayoutMismatchError
from gradwatch.reduce.layout import LocalPiece
from gradwatch.reduce.packing import Reducer
from gradwatch.reduce.reduced import ReducedStats
from gradwatch.reduce.steps import step_residues, steps_differ


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
    assert layouts[0].replicas == 4 and layouts[0].packed_length == 5 * 2 + 4 + 3
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
            [
                desc([whole("a")], stage=[0, 1]),
                desc([whole("b")], stage=[0, 1]),
                desc([whole("a")], stage=[2, 3]),
                desc([whole("c")], stage=[2, 3]),
            ],
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


# -- named views of the reduced vector --------------------------------------------------------


def one_process_reducer(*numels: int) -> Reducer:
    pieces = [LocalPiece(f"p{i}", (n,), ("whole",), n) for i, n in enumerate(numels)]
    return Reducer(pieces, version="v", config_hash="c", timeout_seconds=5.0)


def test_reduced_stats_name_every_section() -> None:
    reducer = one_process_reducer(3, 4, 5)
    # The engine's banded layout: [plain (3) | high (3) | low (3)].
    sq = torch.tensor([4.0, math.nan, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    reduced = reducer.pack_and_reduce(sq, [True, True, False], step=7, with_replicas=True)
    stats = reduced.stats()
    assert isinstance(stats, ReducedStats)
    assert stats.squares[0] == 4.0 and math.isnan(stats.squares[1]) and stats.squares[2] == 0.0
    assert stats.squares_high == [0.0, 0.0, 5.0] and stats.squares_low == [0.0, 0.0, 0.0]
    assert stats.nonfinite == [0.0, 1.0, 0.0]  # NaN and Inf squared norms flag their piece
    assert stats.has_grad == [1.0, 1.0, 0.0]
    assert stats.replica_squares == [0.0]  # R = 1 slot, filled only when R > 1
    assert stats.world_size == 1 and stats.step_check == 7.0
    assert stats.steps_agree(7) and not stats.steps_agree(8)
    assert stats.replica_divergence() == 0.0
    assert reduced.stats() is stats  # read to the host once


def test_device_views_match_the_host_views() -> None:
    reducer = one_process_reducer(2, 2)
    sq = torch.tensor([1.0, math.inf, 0.0, 0.0, 0.0, 3.0], dtype=torch.float64)
    reduced = reducer.pack_and_reduce(sq, [True, True], step=0, with_replicas=False)
    assert reduced.device_bands().tolist() == [1.0, math.inf, 0.0, 0.0, 0.0, 3.0]
    assert reduced.device_nonfinite().tolist() == [0.0, 1.0]
    stats = reduced.stats()
    assert stats.squares == [1.0, math.inf] and stats.nonfinite == [0.0, 1.0]
    assert stats.squares_high == [0.0, 0.0] and stats.squares_low == [0.0, 3.0]


def test_reduced_stats_from_values_of_a_replicated_layout() -> None:
    """Two replicas of two parameters: [squares | high | low | flags | has-grad | 2 replica
    sums | step | step residues and their squares]."""
    per_rank = [desc([whole("w"), whole("b", (3,))]) for _ in range(2)]
    lay = build_layout(per_rank, 0)
    values = [4.0, 1.0, 0.0, 7.0, 8.0, 0.0, 0.0, 0.0, 2.0, 2.0, 16.0, 25.0, 10.0, 10.0, 50.0]
    assert len(values) == lay.packed_length
    stats = ReducedStats.from_values(values, lay)
    assert not stats.steps_differ
    assert stats.squares == [4.0, 1.0] and stats.nonfinite == [0.0, 0.0]
    assert stats.squares_high == [0.0, 7.0] and stats.squares_low == [8.0, 0.0]
    assert stats.has_grad == [2.0, 2.0]
    assert stats.replica_squares == [16.0, 25.0] and stats.replica_norms == [4.0, 5.0]
    assert stats.replica_divergence() == pytest.approx((5.0 - 4.0) / 5.0)
    assert stats.steps_agree(5) and not stats.steps_agree(4)
    nan = ReducedStats.from_values([*values[:10], math.nan, *values[11:]], lay)
    assert math.isnan(nan.replica_divergence())
    with pytest.raises(ValueError, match="packed vector"):
        ReducedStats.from_values(values[:-1], lay)


@pytest.mark.parametrize(
    ("steps", "differ"),
    [((5, 5, 5), False), ((4, 5, 6), True), ((7, 7, 8), True), ((2**20 + 3, 2**20 + 3), False)],
)
def test_every_rank_tells_a_step_mismatch_from_the_reduced_residues(
    steps: tuple[int, ...], differ: bool
) -> None:
    """The residue sums say whether the ranks collected different steps, the same answer on
    every rank: steps 4, 5 and 6 sum to 3 x 5, so the step slot alone lets the rank at step 5
    believe they agree."""
    residues = [step_residues(s) for s in steps]
    total, squares = math.fsum(q for q, _ in residues), math.fsum(sq for _, sq in residues)
    assert steps_differ(len(steps), total, squares) is differ
    assert not steps_differ(len(steps), math.nan, squares)  # a stand-in: not a mismatch
class _Straggling:
    """A pending all-reduce that never completes within the wait."""

    def wait(self, timeout: float) -> None:
        from gradwatch.reduce.collective import CollectiveTimeout

        raise CollectiveTimeout(f"still in flight after {timeout}s")


def test_a_timeout_names_the_setting_that_bounded_the_wait() -> None:
    """collect()'s wait is bounded by collective_timeout_seconds; a clip's device view waits as
    long as the job's own collectives (the process group's timeout): each message names its
    own bound."""
    from gradwatch.errors import GradWatchTimeoutError
    from gradwatch.reduce.reduced import ReducedVector

    vector = ReducedVector(
        torch.zeros(4), _Straggling(), 5.0, 7, None, device_timeout=1800.0  # type: ignore[arg-type]
    )
    with pytest.raises(GradWatchTimeoutError, match=r"within 5s \(collective_timeout_seconds\)"):
        vector._wait_collective()
    with pytest.raises(GradWatchTimeoutError, match=r"within 1800s \(the job's process-group"):
        vector.device_bands()


@pytest.mark.parametrize("n", [3, 65, 300])
@pytest.mark.parametrize("kind", ["plain", "banded", "nonfinite", "no-grad"])
def test_reduced_stats_from_host_equals_from_values(n: int, kind: str) -> None:
    """``from_host`` (lazy sections, vectorized answers above EAGER_PARAMETERS) gives the
    fields ``from_values`` gives from the same vector, and the same answers."""
    per_rank = [desc([whole(f"p{i}", (2,)) for i in range(n)]) for _ in range(2)]
    lay = build_layout(per_rank, 0)
    gen = torch.Generator().manual_seed(n)
    host = torch.rand(lay.packed_length, dtype=torch.float64, generator=gen)
    host[n : 4 * n] = 0.0  # bands and flags clear
    host[4 * n : 5 * n] = 2.0  # every parameter has a gradient on both ranks
    if kind == "banded":
        host[n + n // 2] = 3.0
    if kind == "nonfinite":
        host[n // 3], host[3 * n + n // 3] = math.nan, 1.0
    if kind == "no-grad":
        host[4 * n + n - 1] = 0.0
    lazy = ReducedStats.from_host(host, lay)
    eager = ReducedStats.from_values(host.tolist(), lay)
    answers = (lazy.banded(), lazy.flagged(), lazy.all_have_grad())
    assert answers == (eager.banded(), eager.flagged(), eager.all_have_grad())
    assert answers == (kind == "banded", kind == "nonfinite", kind != "no-grad")
    norms, extremes = lazy.plain_norms()
    assert repr(norms) == repr(eager.plain_norms()[0])
    assert repr(norms) == repr([math.sqrt(s) for s in host[:n].tolist()])
    if extremes is not None and kind != "nonfinite":
        assert extremes == (min(norms), max(norms))
    assert repr(lazy) == repr(eager)  # NaN != NaN: compared as text
    with pytest.raises(AttributeError):
        _ = lazy.no_such_field


def _bits(values: list[float]) -> list[int]:
    """Each float as its IEEE bits (NaN payloads and signed zeros compared too)."""
    return [struct.unpack("<q", struct.pack("<d", v))[0] for v in values]


@pytest.mark.parametrize("case", ["plain", "nan", "inf", "banded", "no-grad", "big-step"])
@pytest.mark.parametrize("device_view", [False, True])
def test_host_packing_equals_the_tensor_packing_bit_for_bit(case: str, device_view: bool) -> None:
    """A one-process collect that clips nothing packs its vector as Python floats
    (HostPacking): the same vector, stats and step sums as the tensor ops' packing, slot for
    slot, and the same count of issued all-reduces; a device view built from it holds the
    same bits."""
    numels = (3, 4, 5, 6)
    fast, general = one_process_reducer(*numels), one_process_reducer(*numels)
    general._host_packing = None  # the tensor ops' path
    assert fast._host_packing is not None
    gen = torch.Generator().manual_seed(len(case))
    sq = torch.rand(12, dtype=torch.float64, generator=gen) * 1e3
    sq[4:] = 0.0  # the high and low bands: empty unless banded
    has_grad = [True, True, True, True]
    step = 2**40 + 17 if case == "big-step" else 9
    if case == "nan":
        sq[1] = math.nan
    if case == "inf":
        sq[2] = math.inf
    if case == "banded":
        sq[0], sq[4] = 0.0, 3.5  # a high-band square
    if case == "no-grad":
        sq[3], has_grad[3] = 0.0, False
    got = fast.pack_and_reduce(sq.clone(), has_grad, step, with_replicas=False,
                               device_collective=False)
    want = general.pack_and_reduce(sq.clone(), has_grad, step, with_replicas=False,
                                   device_collective=False)
    assert got._values is not None and want._values is None
    assert fast.issued == general.issued == 1
    if device_view:
        assert _bits(got.device_bands().tolist()) == _bits(want.device_bands().tolist())
        assert _bits(got._device().tolist()) == _bits(want._device().tolist())
    assert _bits(got._values) == _bits(want._device().tolist())
    assert repr(got.stats()) == repr(want.stats())  # NaN != NaN: compared as text
    assert got.step_sums(1.0) == want.step_sums(1.0)
    assert got.stats().steps_agree(step) and got.stats().ranks == want.stats().ranks
    # the next collect, another has-gradient pattern in the caller's same (reused) list
    has_grad[0] = not has_grad[0]
    again = fast.pack_and_reduce(sq.clone(), has_grad, step + 1, with_replicas=False,
                                 device_collective=False)
    has_grad[0] = not has_grad[0]  # the caller reuses its list: nothing kept refers to it
    want = general.pack_and_reduce(sq.clone(), [not has_grad[0], *has_grad[1:]], step + 1,
                                   with_replicas=False, device_collective=False)
    assert _bits(again._values) == _bits(want._device().tolist())


def test_a_clip_packs_by_tensor_ops() -> None:
    """A collect that clips or is guarded (the device views are read at once) packs by the
    tensor ops: no float vector is built then read back."""
    reducer = one_process_reducer(3, 4)
    sq = torch.zeros(6, dtype=torch.float64)
    reduced = reducer.pack_and_reduce(sq, [True, True], 0, with_replicas=False)
    assert reduced._values is None


def _snapshots(monkeypatch: pytest.MonkeyPatch, host_pieces: int,
               grads: list[list[float]]) -> list[dict]:
    """The snapshots of one collect per list of gradients (a 4-parameter model) by a watcher
    whose reducer packs on the host up to ``host_pieces`` pieces; timestamps left out."""
    import gradwatch.reduce.packing as packing
    from gradwatch import GradWatch, WatchConfig

    monkeypatch.setattr(packing, "HOST_PACK_PIECES", host_pieces)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)).double()
    params = list(model.parameters())
    out = []
    with GradWatch(model, WatchConfig(spike_warmup=2, compile_kernels="off")) as watch:
        assert (watch._collector.resolved.reducer._host_packing is None) == (host_pieces == 0)
        for step, values in enumerate(grads):
            for p, v in zip(params, values, strict=True):
                p.grad = torch.full_like(p, v)
            snap = watch.collect(step).result().to_dict()
            snap.pop("timestamp")
            out.append(snap)
    return out


def test_a_watcher_publishes_the_same_snapshots_packing_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process watcher's snapshots, field for field, whether its vector is packed as
    floats or by tensor ops: plain, NaN, Inf and overflowing-square steps, and spike scores
    over the series."""
    steps = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.2, 0.3, 0.4], [math.nan, 1.0, 1.0, 1.0],
             [0.2, math.inf, 0.1, 0.1], [1e200, 1.0, 1.0, 1.0], [1e-200, 0.0, 0.0, 0.0],
             [0.3, 0.2, 0.3, 0.4], [30.0, 0.2, 0.3, 0.4]]
    fast = _snapshots(monkeypatch, 64, steps)
    general = _snapshots(monkeypatch, 0, steps)
    assert repr(fast) == repr(general)  # NaN != NaN: compared as text
    assert fast[0]["global_norm"] > 0 and math.isnan(fast[2]["global_norm"])
