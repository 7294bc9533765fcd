"""The per-rank view's parts without a process group: the hook's local measurement
(exactness, constant op count, no host read), the bounded packing, the host formulas (noise
scale, spread) and the bad inputs (batch_size)."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.analysis.rankview import NoiseScale, _spread
from gradwatch.doctor.testing import OpCounter, count_host_reads
from gradwatch.reduce.layout import Layout
from gradwatch.reduce.packing import pack_rank_view
from gradwatch.reduce.reduced import RankView
from gradwatch.reduce.sections import sections
from gradwatch.stacks.ddp_hook import LocalView


class FakeBucket:
    """What DDP hands a comm hook: the bucket's gradients (views of one flat buffer) and
    parameters, its index and whether it is the last."""

    def __init__(self, params: list[torch.Tensor], index: int, last: bool) -> None:
        self._params = params
        self._index = index
        self._last = last
        sizes = [p.numel() for p in params]
        self.flat = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
        self._grads = [v.view_as(p) for v, p in zip(self.flat.split(sizes), params, strict=True)]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list[torch.Tensor]:
        # Fresh views of the buffer at each call, as DDP makes them (dispatched view ops).
        sizes = [p.numel() for p in self._params]
        return [v.view_as(p) for v, p in zip(self.flat.split(sizes), self._params, strict=True)]

    def buffer(self) -> torch.Tensor:
        return self.flat

    def parameters(self) -> list[torch.Tensor]:
        return self._params


def _params(n: int, dtype: torch.dtype = torch.float32, big: int = 0) -> list[nn.Parameter]:
    """``n`` parameters of 3 + i elements (``big``: every other one ``big`` + i elements, so
    rows of the float32 path straddle parameters and groups), magnitudes 1e-2..1e2."""
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        size = big + i if big and i % 2 else 3 + i
        p = nn.Parameter(torch.zeros(size, dtype=dtype))
        p.grad = torch.randn(size, generator=g, dtype=dtype) * 10.0 ** (i % 5 - 2)
        out.append(p)
    return out


def _fsum(ts: list[torch.Tensor]) -> float:
    return math.fsum(x * x for t in ts for x in t.double().flatten().tolist())


@pytest.mark.parametrize(
    ("dtype", "tol", "big"),
    [(torch.float32, 1e-6, 0), (torch.float32, 1e-6, 6000), (torch.float64, 1e-12, 6000)],
)
def test_local_view_is_exact_per_group(dtype: torch.dtype, tol: float, big: int) -> None:
    """Both paths: float64 foreach norms, and the CPU float32 rows over the bucket's buffer
    (rows straddling groups and the partial last row read element by element)."""
    params = _params(7, dtype, big)
    groups = [i % 3 for i in range(7)]
    view = LocalView(params, groups, 3)
    view.observe(FakeBucket(params[:4], 0, False))
    assert view.take() is None  # the backward is not complete yet
    view.observe(FakeBucket(params[4:], 1, True))
    got = view.take()
    assert got is not None and got.dtype == torch.float64
    rows_path = [p.rows is not None for p in view._plans.values()]
    assert all(rows_path) == (dtype == torch.float32 and big > 0), rows_path
    for k in range(3):
        want = _fsum([p.grad for p, g in zip(params, groups, strict=True) if g == k])
        assert abs(got[k].item() - want) <= tol * want
    assert view.take() is None  # handed out once: a later collect without a backward gets None


@pytest.mark.parametrize("big", [0, 6000])
def test_local_view_flags_nonfinite_in_its_group_only(big: int) -> None:
    params = _params(4, big=big)
    params[2].grad[-1] = math.inf  # type: ignore[index]
    view = LocalView(params, [0, 0, 1, 2], 3)
    view.observe(FakeBucket(params, 0, True))
    got = view.take()
    assert got is not None
    assert math.isfinite(got[0].item()) and math.isinf(got[1].item())
    assert math.isfinite(got[2].item())


def test_local_view_restarts_at_bucket_zero() -> None:
    params = _params(2)
    view = LocalView(params, [0, 1], 2)
    for _ in range(3):  # three backwards without a collect: the last one only, not the sum
        view.observe(FakeBucket(params, 0, True))
    got = view.take()
    assert got is not None
    assert got[0].item() == pytest.approx(_fsum([params[0].grad]), rel=1e-6)


def test_hook_ops_per_bucket_do_not_grow_with_parameters_and_never_read_the_host() -> None:
    totals = []
    for n in (3, 60):
        params = _params(n, big=7000)
        view = LocalView(params, [i % 2 for i in range(n)], 2)
        bucket = FakeBucket(params, 0, True)
        view.observe(bucket)  # builds the bucket's group index once
        with OpCounter() as ops, count_host_reads() as reads:
            view.observe(bucket)
        assert ops.scalar_reads == 0 and sum(reads.values()) == 0
        totals.append(ops.total)
    # Bucket 0 on the row path: the reset, the rows' norm, square and sum, the loose elements'
    # select, widen, square and sum.
    assert totals[0] == totals[1] <= 8, totals


def test_noise_scale_is_exact_on_exact_inputs() -> None:
    """|G_b|^2 = |G|^2 + tr/b and |G_B|^2 = |G|^2 + tr/B in expectation: fed these, the
    estimators return |G|^2 and tr(Sigma) exactly, and B_simple = tr / |G|^2."""
    g2, trace, b, n = 3.0, 96.0, 4.0, 4
    noise = NoiseScale()
    small, big = g2 + trace / b, g2 + trace / (b * n)
    for _ in range(5):
        assert noise.update("", small, big, b, n) == pytest.approx(trace / g2, rel=1e-12)
    # Per-replica batches (b = 1): the same problem reads B_simple / b.
    unit = NoiseScale().update("", g2 + trace / b, g2 + trace / (b * n), 1.0, n)
    assert unit != pytest.approx(trace / g2)
    # Noise dominating (|G|^2 estimate <= 0): NaN, never a made-up number.
    assert math.isnan(NoiseScale().update("", 10.0, 10.0 / n - 1.0, 1.0, n))
    # A non-finite step does not poison the EMAs.
    assert noise.update("", math.nan, big, b, n) == pytest.approx(trace / g2, rel=1e-12)


def test_spread_names_the_outlier_and_its_rank() -> None:
    replicas = ((0,), (1,), (2,), (3,))
    out = _spread([1.0, 1.2, 0.9, 6.0], replicas)
    assert out["replica_grad_norm_max_rank"] == 3 and out["replica_outlier_rank"] == 3
    assert out["replica_grad_norm_median"] == pytest.approx(1.1)
    assert out["replica_outlier_score"] == pytest.approx((6.0 - 1.1) / 1.1)
    bad = _spread([1.0, math.nan, 1.0], ((0, 2), (1, 3), (4, 5)))
    assert bad["replica_grad_norm_max_rank"] == 1 and bad["replica_outlier_score"] == math.inf
    assert _spread([0.0, 0.0], ((0,), (1,)))["replica_outlier_score"] == 0.0


def _layout(world: int, rank: int, groups: int) -> Layout:
    return Layout(
        names=("w",), numels=(1,), local_to_global=(0,), contributes=(rank == 0,),
        replica_slot=(-1,), replicas=1, world_size=world, rank=rank,
        hosts=tuple(f"h{r}" for r in range(world)),
        replica_groups=tuple((r,) for r in range(world)), rank_view_groups=groups,
    )  # fmt: skip


@pytest.mark.parametrize("bounded", [False, True])
def test_rank_view_section_round_trip(monkeypatch: pytest.MonkeyPatch, bounded: bool) -> None:
    """Each rank packs its slot (or its share of the bounded sums); the SUM of the ranks'
    sections reads back as every rank's figures (slots) or their bounded summary."""
    import gradwatch.reduce.layout

    if bounded:
        monkeypatch.setattr(gradwatch.reduce.layout, "RANK_SLOTS_MAX_WORLD", 2)
    world, g = 3, 2
    local = [torch.tensor([1.0, 4.0]), torch.tensor([math.nan, 9.0]), torch.tensor([2.0, 3.0])]
    total, zero = None, torch.zeros((), dtype=torch.float64)
    for rank in range(world):
        lay = _layout(world, rank, g)
        packed = torch.zeros(lay.packed_length, dtype=torch.float64)
        pack_rank_view(packed[sections(lay).rank_view], lay, local[rank], zero)
        total = packed if total is None else total + packed
    assert total is not None
    at = sections(_layout(world, 0, g))
    view = RankView.from_section(total.tolist()[at.rank_view], _layout(world, 0, g))
    assert view is not None
    assert view.nonfinite_count == 1 and view.nonfinite_ranks == (1, 0)
    assert view.finite_sums == (3.0, 16.0)
    if bounded:
        assert view.per_rank is None and view.nonfinite_rank == 1
    else:
        assert view.per_rank is not None and math.isnan(view.per_rank[1][0])
        assert view.per_rank[2] == (2.0, 3.0)
    # A rank that did not report (no hooked backward): no view for the step.
    partial = torch.zeros_like(total)
    lay0 = _layout(world, 0, g)
    pack_rank_view(partial[sections(lay0).rank_view], lay0, local[0], zero)
    assert RankView.from_section(partial.tolist()[at.rank_view], lay0) is None


@pytest.mark.parametrize("bad", [0, -3])
def test_batch_size_must_be_positive(bad: int) -> None:
    with pytest.raises(pydantic.ValidationError, match="batch_size"):
        WatchConfig(batch_size=bad)
    model = nn.Linear(2, 1)
    with GradWatch(model, WatchConfig()) as watch:
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(ValueError, match="batch_size"):
            watch.collect(0, batch_size=bad)
        snap = watch.collect(0, batch_size=4).result()
    assert snap.rank_view is False and snap.gradient_noise_scale is None  # no DDP: no view


def test_rank_view_is_in_the_handshake_hash() -> None:
    assert WatchConfig(rank_view=True).layout_hash() != WatchConfig(rank_view=False).layout_hash()
    assert WatchConfig(batch_size=8).layout_hash() == WatchConfig().layout_hash()  # rank 0's


def test_rank_view_fields_survive_json_and_pickle() -> None:
    import json
    import pickle

    from gradwatch import Snapshot

    snap = Snapshot(
        step=3, rank_view=True, nonfinite_origin_ranks=(2,), nonfinite_origin_count=1,
        nonfinite_origin_hosts=("node-c",), nonfinite_origin_groups=("head",),
        replica_grad_norm_min=1.0, replica_grad_norm_median=2.0, replica_grad_norm_max=math.inf,
        replica_grad_norm_max_rank=2, replica_outlier_score=math.inf, replica_outlier_rank=2,
        gradient_noise_scale=12.5, group_noise_scale={"head": math.nan},
    )  # fmt: skip
    back = Snapshot.from_dict(json.loads(json.dumps(snap.to_dict())))
    assert back.nonfinite_origin_ranks == (2,) and back.nonfinite_origin_hosts == ("node-c",)
    assert back.replica_grad_norm_max == math.inf and math.isnan(back.group_noise_scale["head"])
    assert pickle.loads(pickle.dumps(snap)).gradient_noise_scale == 12.5
    # An old history record (no rank-view keys) reads as "no view".
    old = Snapshot.from_dict({"step": 1, "global_norm": 1.0})
    assert old.rank_view is False and old.gradient_noise_scale is None


def test_origin_is_reported_on_non_finite_steps_only() -> None:
    """A local square can overflow where the exact reduced figures do not: no origin is named
    on a step the reduced figures call finite."""
    from gradwatch import Snapshot
    from gradwatch.analysis.rankview import rank_view_fields

    view = RankView(
        per_rank=((1.0, math.inf), (1.0, 2.0)), finite_sums=(2.0, 2.0), nonfinite_ranks=(0, 1),
        nonfinite_count=1, nonfinite_rank=None, replica_groups=((0,), (1,)), hosts=("a", "b"),
    )  # fmt: skip
    groups = ["w", "b"]
    finite = rank_view_fields(view, Snapshot(step=0, global_norm=2.0), groups, NoiseScale(), 1)
    assert finite["nonfinite_origin_ranks"] == () and finite["nonfinite_origin_count"] == 0
    bad = rank_view_fields(view, Snapshot(step=0, global_norm=math.inf), groups, NoiseScale(), 1)
    assert bad["nonfinite_origin_ranks"] == (0,) and bad["nonfinite_origin_hosts"] == ("a",)
    assert bad["nonfinite_origin_groups"] == ("b",) and bad["nonfinite_origin_count"] == 1


def test_endpoint_view_and_top_line_name_the_last_origin() -> None:
    from gradwatch.cli.endpoint import parse_exposition
    from gradwatch.cli.render import anomalies_text

    text = (
        "# TYPE gradwatch_nonfinite_steps_total counter\n"
        "gradwatch_nonfinite_steps_total 1.0\n"
        "# TYPE gradwatch_last_nonfinite_origin gauge\n"
        'gradwatch_last_nonfinite_origin{rank="3",host="node-b"} 42.0\n'
    )
    view = parse_exposition(text)
    assert view.nonfinite_origin == (("3", "node-b"),) and view.nonfinite_origin_step == 42
    assert "(last at step 42 from rank 3)" in anomalies_text(view).plain
    assert parse_exposition("gradwatch_step 1.0\n").nonfinite_origin == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the row and foreach paths
def test_bucket_plan_is_kept_per_buffer_and_rebuilt_for_a_new_layout(dtype: torch.dtype) -> None:
    """Steady steps key on the bucket's buffer alone (DDP is asked for neither the parameter
    list nor the gradient views); a new buffer at the same index (DDP rebuilt its buckets) gets
    a new plan, and the figures stay exact."""
    params = _params(6, dtype, big=6000)
    view = LocalView(params, [i % 3 for i in range(6)], 3)
    bucket = FakeBucket(params[:4], 0, True)
    view.observe(bucket)
    asked: list[str] = []
    fresh = bucket.gradients
    bucket.parameters = lambda: asked.append("parameters") or params[:4]  # type: ignore[method-assign]
    bucket.gradients = lambda: asked.append("gradients") or fresh()  # type: ignore[method-assign]
    bucket.flat.mul_(2.0)  # a new backward's values in the same buffer
    view.observe(bucket)
    assert asked == []
    got = view.take()
    assert got is not None
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for k in range(3):
        want = 4 * _fsum([p.grad for i, p in enumerate(params[:4]) if i % 3 == k])
        assert abs(got[k].item() - want) <= tol * want
    rebuilt = FakeBucket(params[2:], 0, True)  # same index, another layout and buffer
    view.observe(rebuilt)
    got = view.take()
    assert got is not None
    for k in range(3):
        want = _fsum([p.grad for i, p in enumerate(params) if i >= 2 and i % 3 == k])
        assert abs(got[k].item() - want) <= tol * want
