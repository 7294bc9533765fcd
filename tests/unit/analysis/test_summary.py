"""summarize(): group/global combination, health, ratios and isolation vs an independent
re-implementation of the documented formulas (summary's helpers are not used as reference)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from references import ref_health, ref_ratio, ref_raw

from gradwatch import WatchConfig
from gradwatch.analysis.summary import summarize


def ref_combine(norms: list[float]) -> float:
    """L2 norm of per-parameter norms: NaN wins, then Inf, else math.hypot (no overflow)."""
    if any(math.isnan(x) for x in norms):
        return math.nan
    if any(math.isinf(x) for x in norms):
        return math.inf
    return math.hypot(*norms) if norms else 0.0


def same(a: float, b: float, rel: float = 1e-12) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return a == pytest.approx(b, rel=rel, abs=0.0)


SQUARES = st.one_of(
    st.floats(0.0, 1.7e307),
    st.floats(0.0, 1e-290),
    st.floats(0.0, 1e4),
    st.sampled_from([0.0, 1e-14, 1e4, 1.6e307, math.inf, math.nan]),
)


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(0, 12))
    params = []
    for i in range(n):
        group = draw(st.sampled_from(["a", "b", "other"]))
        has = draw(st.booleans() | st.just(True))
        sq = draw(SQUARES) if has else 0.0
        flag = (
            draw(st.booleans())
            if has and math.isfinite(sq) and draw(st.integers(0, 5)) == 0
            else (1.0 if has and not math.isfinite(sq) else 0.0)
        )
        numel = draw(st.integers(1, 10_000))
        params.append((f"{group}{i}", group, numel, sq, float(flag), float(has)))
    vt = draw(st.sampled_from([0.0, 1e-7, 1e-3, 1.0]))
    et = draw(st.sampled_from([2.0, 100.0, 1e100]))
    iso = draw(st.sampled_from([0.0, 1e-6, 10.0]))
    return params, vt, et, iso


@settings(max_examples=300, deadline=None)
@given(case=cases(), step=st.integers(0, 10**9))
def test_property_summary_vs_reference(case, step: int) -> None:  # type: ignore[no-untyped-def]
    params, vt, et, iso = case
    cfg = WatchConfig(
        groups={"a": ["a*"], "b": ["b*"]},
        ratios=[("a", "b"), ("b", "other"), ("other", "a")],
        isolated=["a", "other"],
        vanishing_threshold=vt,
        exploding_threshold=et,
        isolation_threshold=iso,
    )
    groups_of = [g for _, g, *_ in params]
    order = ["a", "b"] + (["other"] if "other" in groups_of else [])
    snap = summarize(
        step=step,
        cfg=cfg,
        names=[p[0] for p in params],
        groups_of=groups_of,
        numels=[p[2] for p in params],
        squares=[p[3] for p in params],
        nonfinite_flags=[p[4] for p in params],
        has_grad=[p[5] for p in params],
        group_order=order,
    )
    assert snap.step == step
    assert list(snap.groups) == order
    counted = [p for p in params if p[5] > 0]
    if not counted:  # no gradient at all: its own state, nothing reads as measured 0 or 1.0
        _check_no_gradient(snap, cfg)
        return
    assert set(snap.param_norms) == {p[0] for p in counted}
    bad_names = []
    total_v = total_e = 0
    all_norms = []
    for g in order:
        members = [p for p in counted if p[1] == g]
        norms = [math.sqrt(p[3]) for p in members]
        all_norms.extend(norms)
        bad = [p for p, x in zip(members, norms, strict=True) if p[4] > 0 or not math.isfinite(x)]
        bad_names.extend(p[0] for p in bad)
        e = sum(1 for p, x in zip(members, norms, strict=True) if p in bad or x > et)
        v = sum(
            1 for p, x in zip(members, norms, strict=True) if p not in bad and x <= et and x < vt
        )
        stats = snap.groups[g]
        assert same(stats.norm, ref_combine(norms)), (g, stats.norm, norms)
        assert stats.numel == sum(p[2] for p in members)
        assert stats.tensors == len(members)
        assert (stats.vanishing, stats.exploding, stats.nonfinite) == (v, e, len(bad))
        total_v += v
        total_e += e
        for p, x in zip(members, norms, strict=True):
            assert same(snap.param_norms[p[0]], x)
    want_global = ref_combine(all_norms)
    if bad_names and math.isfinite(want_global):
        want_global = math.nan  # a flagged replica makes the global norm NaN
    assert same(snap.global_norm, want_global)
    assert snap.nonfinite_params == tuple(sorted(bad_names))
    assert snap.health == ref_health(len(counted), total_v, total_e, want_global)
    zero = (0.0, 0)
    stat = {g: (snap.groups[g].norm, snap.groups[g].numel) for g in snap.groups}
    for num, den in cfg.ratios:
        (nn, nnum), (dn, dnum) = stat.get(num, zero), stat.get(den, zero)
        key = f"{num}/{den}"
        assert same(snap.ratios[key], ref_ratio(nn, nnum, dn, dnum)), key
        assert same(snap.raw_ratios[key], ref_raw(nn, dn)), key
    for g in cfg.isolated:
        norm = stat.get(g, zero)[0]
        assert snap.isolation_violated[g] == (not math.isfinite(norm) or norm > iso)


def _check_no_gradient(snap, cfg: WatchConfig) -> None:  # type: ignore[no-untyped-def]
    """A step on which no parameter had a gradient: NaN norms, ratios and health; isolation
    measured (no gradient violates nothing)."""
    assert snap.no_gradient and snap.measured
    assert math.isnan(snap.global_norm) and math.isnan(snap.health)
    assert all(math.isnan(g.norm) and g.tensors == 0 for g in snap.groups.values())
    assert all(math.isnan(v) for v in [*snap.ratios.values(), *snap.raw_ratios.values()])
    assert snap.isolation_violated == dict.fromkeys(cfg.isolated, False)
    assert snap.is_finite and not snap.nonfinite_step  # not a NaN gradient: nothing held one


def _one(squares, groups, numels=None, **cfg_kwargs):  # type: ignore[no-untyped-def]
    cfg = WatchConfig(groups={"a": ["a*"], "b": ["b*"]}, **cfg_kwargs)
    n = len(squares)
    return summarize(
        step=1,
        cfg=cfg,
        names=[f"{g}{i}" for i, g in enumerate(groups)],
        groups_of=groups,
        numels=numels or [1] * n,
        squares=squares,
        nonfinite_flags=[0.0] * n,
        has_grad=[1.0] * n,
        group_order=["a", "b"],
    )


def test_ratio_formula_exact_values() -> None:
    # a: norm 2 over 4 elements, b: norm 8 over 16 elements
    snap = _one([4.0, 64.0], ["a", "b"], [4, 16], ratios=[("a", "b"), ("b", "a")])
    assert snap.ratios["a/b"] == (2.0 / 2.0) / (8.0 / 4.0 + 1e-8)
    assert snap.ratios["b/a"] == (8.0 / 4.0) / (2.0 / 2.0 + 1e-8)
    assert snap.raw_ratios["a/b"] == 0.25 and snap.raw_ratios["b/a"] == 4.0


def test_ratio_zero_for_a_dormant_numerator_nan_when_undefined() -> None:
    """A numerator below 1e-8 over a defined denominator is 0 (dormant: measured); a
    denominator below 1e-8, without gradient or non-finite makes the ratio undefined: NaN,
    never a 0 that would read as dormant."""
    snap = _one([1e-17, 1.0], ["a", "b"], ratios=[("a", "b"), ("b", "a")])  # a norm ~3e-9
    assert snap.ratios["a/b"] == 0.0 and math.isnan(snap.ratios["b/a"])
    assert snap.raw_ratios["b/a"] == pytest.approx(1.0 / math.sqrt(1e-17))
    snap = _one([0.0, 1.0], ["a", "b"], ratios=[("b", "a")])
    assert math.isnan(snap.raw_ratios["b/a"]) and math.isnan(snap.ratios["b/a"])
    snap = _one([1.0], ["b"], ratios=[("b", "a"), ("a", "b")])  # a has no gradient: numel 0
    assert math.isnan(snap.ratios["b/a"]) and math.isnan(snap.raw_ratios["b/a"])
    assert snap.ratios["a/b"] == 0.0 and snap.raw_ratios["a/b"] == 0.0


def test_health_exact_values() -> None:
    snap = _one([1e-20, 1.0, 1e6, 1.0], ["a", "a", "b", "b"])
    assert snap.health == 1.0 - 0.5 * 1 / 4 - 0.8 * 1 / 4
    snap = _one([1e6, 1e6], ["a", "b"])  # all exploding: the floor of finite health is 0.2
    assert snap.health == pytest.approx(0.2, rel=1e-15)
    snap = _one([1e-20, 1e-20], ["a", "b"])  # all vanishing
    assert snap.health == 0.5
    snap = _one([], [])  # no gradient at all: nothing to judge, never a healthy 1.0
    assert math.isnan(snap.health) and math.isnan(snap.global_norm) and snap.no_gradient


def test_group_norm_does_not_overflow() -> None:
    snap = _one([1.6e307] * 20, ["a"] * 20)
    assert snap.groups["a"].norm == pytest.approx(math.sqrt(1.6e307) * math.sqrt(20), rel=1e-14)
    assert snap.global_norm == pytest.approx(math.sqrt(1.6e307) * math.sqrt(20), rel=1e-14)
    assert snap.health == pytest.approx(0.2, rel=1e-15)  # every norm (4e153) explodes


def test_group_norm_is_exact_sum() -> None:
    # 1 + 1e-16 * many: a naive float sum loses the small terms, fsum does not
    squares = [1.0] + [1e-16] * 10_000
    snap = _one(squares, ["a"] * len(squares))
    assert snap.groups["a"].norm == pytest.approx(math.sqrt(1.0 + 1e-12), rel=1e-15)


def test_one_filled_group_among_several_gives_the_exact_global_norm() -> None:
    """Every gradient in one group ("b"; "a" has none): the global norm is that group's,
    and both are the exact float64 norm; the vanishing and exploding counts are the
    reference counts on either side of the thresholds."""
    squares = [1e-20, 0.25, 9.0, 2.5e7, 1e-30]
    snap = _one(squares, ["b"] * 5, vanishing_threshold=1e-7, exploding_threshold=1e3)
    exact = math.sqrt(math.fsum(squares))
    assert snap.global_norm == exact == snap.groups["b"].norm
    assert snap.groups["a"].tensors == 0 and snap.groups["a"].norm == 0.0
    norms = [math.sqrt(s) for s in squares]
    assert snap.groups["b"].vanishing == sum(n < 1e-7 for n in norms) == 2
    assert snap.groups["b"].exploding == sum(n > 1e3 for n in norms) == 1
    calm = _one([0.25, 9.0], ["a", "b"], vanishing_threshold=1e-7, exploding_threshold=1e3)
    assert calm.vanishing == 0 and calm.exploding == 0
    assert calm.global_norm == math.sqrt(math.fsum([0.25, 9.0]))


@settings(max_examples=200, deadline=None)
@given(case=cases(), one_group=st.booleans())
def test_what_the_summarizer_precomputes_changes_no_figure(case, one_group: bool) -> None:  # type: ignore[no-untyped-def]
    """``norms``/``extremes`` precomputed, ``nonfinite_flags`` None when no flag is set and
    ``has_grad`` None when every parameter has one (what ``Summarizer.build`` passes, from
    ``ReducedStats``) give the snapshot summarize builds from the plain lists, bit for bit."""
    params, vt, et, iso = case
    if one_group:  # one group holding every parameter: the extremes are read
        params = [(name, "other", *rest) for name, _, *rest in params]
    cfg = WatchConfig(groups={"a": ["a*"], "b": ["b*"]}, isolated=["a"],
                      vanishing_threshold=vt, exploding_threshold=et, isolation_threshold=iso)
    groups_of = tuple(p[1] for p in params)
    order = ("a", "b", "other")
    squares = [p[3] for p in params]
    flags = [p[4] for p in params]
    has_grad = [p[5] for p in params]
    common = dict(step=1, cfg=cfg, names=[p[0] for p in params], numels=[p[2] for p in params],
                  squares=squares, group_order=order, groups_of=groups_of)
    plain = summarize(nonfinite_flags=flags, has_grad=has_grad, **common)
    norms = [math.sqrt(s) for s in squares]
    finite = [x for x in norms if math.isfinite(x)]
    extremes = (min(norms), max(norms)) if finite and len(finite) == len(norms) else (
        (math.nan, math.nan) if norms else None)
    hinted = summarize(
        nonfinite_flags=flags if any(flags) else None,
        has_grad=None if all(h > 0 for h in has_grad) else has_grad,
        norms=norms, extremes=extremes, **common,
    )
    assert repr(hinted.to_dict()) == repr(plain.to_dict())


def _watched_run(monkeypatch: pytest.MonkeyPatch, eager: int) -> list[str]:
    """The snapshots (as text, timestamps dropped) of a short run through GradWatch whose
    reduced figures take the list path (``eager`` large) or the vectorized one (0)."""
    import torch
    from torch import nn

    from gradwatch import GradWatch
    from gradwatch.reduce import reduced

    monkeypatch.setattr(reduced, "EAGER_PARAMETERS", eager)
    model = nn.ParameterList(nn.Parameter(torch.zeros(3, dtype=torch.float64)) for _ in range(80))
    cfg = WatchConfig(groups={"a": ["1*"], "b": ["2*", "3*"]}, ratios=[("a", "b")],
                      isolated=["b"], exploding_threshold=2.0, vanishing_threshold=1e-3,
                      spike_window=8, spike_warmup=2, spike_threshold=3.0)
    gen = torch.Generator().manual_seed(7)
    out = []
    with GradWatch(model, cfg) as watch:
        for step in range(10):
            for i, p in enumerate(model):
                scale = 10.0 ** ((i + step) % 7 - 3) * (50.0 if step == 6 else 1.0)
                p.grad = torch.randn(3, dtype=torch.float64, generator=gen) * scale
            if step == 3:
                model[5].grad[1] = math.nan
            if step == 4:
                model[7].grad = None
            if step == 5:
                model[9].grad *= 1e200  # a band: the norm is beyond 2^450
            if step == 7:
                model[11].grad[0] = math.inf
            snap = watch.collect(step).result().to_dict()
            snap.pop("timestamp")
            out.append(repr(snap))
    return out


def test_the_vectorized_reading_of_the_reduced_figures_changes_no_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model above ``EAGER_PARAMETERS`` (figures read from host memory, vectorized) gets
    the very snapshots of the all-lists path: every field, every float, every key order."""
    assert _watched_run(monkeypatch, 0) == _watched_run(monkeypatch, 10**9)
