"""GradWatch end to end on one process: snapshot contents vs independent references, bad input,
host syncs, op counts, temporaries, schedule and wrappers."""

from __future__ import annotations

import math

import pytest
import torch
from allocations import OutputRecorder
from hypothesis import given, settings
from hypothesis import strategies as st
from references import EXP_RANGE, ref_health, ref_norm, ref_ratio, ref_raw, rel_err, values
from torch import nn

from gradwatch import GradWatch, WatchConfig
from gradwatch.doctor.testing import OpCounter, count_host_reads
from gradwatch.errors import GradWatchError
from gradwatch.norms.model import clean_name

REL = 1e-6


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(__import__("os").environ):
        if key.startswith("GRADWATCH_"):
            monkeypatch.delenv(key)


def example_config(**overrides) -> WatchConfig:  # type: ignore[no-untyped-def]
    kwargs = dict(
        groups={"host": ["backbone.*"], "seed": ["seed.*"]},
        ratios=[("seed", "host")],
        isolated=["host"],
        vanishing_threshold=1e-7,
        exploding_threshold=100.0,
        isolation_threshold=1e-6,
        port=None,
    )
    kwargs.update(overrides)
    return WatchConfig(**kwargs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        self.seed = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.seed(self.backbone(x)))


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        clean_name(n): p.grad
        for n, p in model.named_parameters()
        if p.grad is not None and p.requires_grad
    }


def check_against_reference(snap, model: nn.Module, cfg: WatchConfig) -> None:  # type: ignore[no-untyped-def]
    """Every norm of ``snap`` vs the float64 reference, groups assigned independently."""
    import fnmatch

    grads = grads_of(model)
    assert set(snap.param_norms) == set(grads)
    if not grads:  # no gradient at all: NaN, never a measured 0
        assert snap.no_gradient and math.isnan(snap.global_norm)
        return
    for name, g in grads.items():
        assert rel_err(snap.param_norms[name], ref_norm([g])) <= REL, name
    members: dict[str, list[torch.Tensor]] = {}
    for name, g in grads.items():
        matching = (
            k for k, pats in cfg.groups.items() if any(fnmatch.fnmatchcase(name, p) for p in pats)
        )
        group = next(matching, "other")
        members.setdefault(group, []).append(g)
    for group, gs in members.items():
        stats = snap.groups[group]
        assert rel_err(stats.norm, ref_norm(gs)) <= REL, group
        assert stats.numel == sum(g.numel() for g in gs)
        assert stats.tensors == len(gs)
    assert rel_err(snap.global_norm, ref_norm(list(grads.values()))) <= REL


# -- the host/seed example: two groups, a ratio, an isolated group ---------------------------------


def test_host_seed_example_snapshot() -> None:
    torch.manual_seed(0)
    model = Net()
    model(torch.randn(4, 16)).pow(2).sum().backward()
    cfg = example_config()
    with GradWatch(model, cfg) as watch:
        pending = watch.collect(step=7)
        snap = pending.result()
    assert snap.step == 7
    assert list(snap.groups) == ["host", "seed", "other"]
    check_against_reference(snap, model, cfg)
    host, seed = snap.groups["host"], snap.groups["seed"]
    assert host.numel == 16 * 32 + 32 + 32 * 8 + 8 and host.tensors == 4
    assert seed.numel == 72 and seed.tensors == 2
    want = (seed.norm / math.sqrt(72)) / (host.norm / math.sqrt(host.numel) + 1e-8)
    assert snap.ratios["seed/host"] == pytest.approx(want, rel=1e-12)
    assert snap.raw_ratios["seed/host"] == pytest.approx(seed.norm / host.norm, rel=1e-12)
    assert snap.isolation_violated == {"host": True}
    assert snap.nonfinite_params == ()
    assert snap.health == 1.0
    assert snap.world_size == 1


def test_other_group_only_when_some_parameter_matches_nothing() -> None:
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    cfg = WatchConfig(groups={"all": ["*"]})
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(0).result()
    assert list(snap.groups) == ["all"]
    check_against_reference(snap, model, cfg)


def test_first_matching_group_wins() -> None:
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    cfg = WatchConfig(groups={"weights": ["*.weight"], "seed": ["seed.*"]})
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(0).result()
    assert snap.groups["seed"].tensors == 1  # seed.weight went to "weights"
    assert snap.groups["weights"].tensors == 4
    check_against_reference(snap, model, cfg)


def test_exact_expected_values() -> None:
    model = nn.ModuleDict({"backbone": nn.Linear(4, 4, bias=False), "seed": nn.Linear(2, 2)})
    model["backbone"].weight.grad = torch.full((4, 4), 2.0)  # norm 8, numel 16
    model["seed"].weight.grad = torch.tensor([[60.0, 80.0], [0.0, 0.0]])  # norm exactly 100
    model["seed"].bias.grad = torch.tensor([1e-8, 0.0])  # vanishing
    cfg = example_config(isolation_threshold=8.0)
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(3).result()
    assert snap.param_norms["backbone.weight"] == 8.0
    assert snap.param_norms["seed.weight"] == 100.0
    assert snap.groups["seed"].exploding == 0  # 100 is not above 100
    assert snap.groups["seed"].vanishing == 1
    assert snap.groups["host"].vanishing == 0
    seed_norm = math.sqrt(100.0**2 + float(torch.tensor(1e-8)) ** 2)
    assert snap.groups["seed"].norm == pytest.approx(seed_norm, rel=1e-15)
    assert snap.ratios["seed/host"] == pytest.approx(
        (seed_norm / math.sqrt(6)) / (8.0 / 4.0 + 1e-8), rel=1e-12
    )
    assert snap.raw_ratios["seed/host"] == pytest.approx(seed_norm / 8.0, rel=1e-12)
    assert snap.isolation_violated == {"host": False}  # 8 is not above 8
    assert snap.health == pytest.approx(1 - 0.5 * 1 / 3)
    assert snap.global_norm == pytest.approx(math.sqrt(64 + seed_norm**2), rel=1e-15)


def test_exploding_threshold_and_health_floor() -> None:
    model = nn.ParameterDict({f"p{i}": nn.Parameter(torch.zeros(3)) for i in range(4)})
    for i, p in enumerate(model.values()):
        p.grad = torch.full((3,), 1e3 if i < 3 else 1.0)
    with GradWatch(model, WatchConfig()) as watch:
        snap = watch.collect(0).result()
    assert snap.groups["other"].exploding == 3
    assert snap.health == pytest.approx(max(0.0, 1 - 0.8 * 3 / 4))
    for p in list(model.values())[:3]:
        p.grad.fill_(1e4)
    list(model.values())[3].grad.fill_(1e4)
    with GradWatch(model, WatchConfig()) as watch:
        assert watch.collect(1).result().health == pytest.approx(0.2)


# -- bad input ----------------------------------------------------------------------------------


def test_no_gradient_anywhere() -> None:
    model = Net()
    with GradWatch(model, example_config()) as watch:
        snap = watch.collect(1).result()
    # its own state: NaN norms and health (a 0.0 and 1.0 would read as a perfect step)
    assert snap.no_gradient and math.isnan(snap.global_norm) and math.isnan(snap.health)
    assert dict(snap.param_norms) == {}
    assert list(snap.groups) == ["host", "seed", "other"]
    for stats in snap.groups.values():
        assert math.isnan(stats.norm)
        assert (
            stats.numel,
            stats.tensors,
            stats.vanishing,
            stats.exploding,
            stats.nonfinite,
        ) == (0, 0, 0, 0, 0)
    # no gradient in the denominator: the ratio is undefined (NaN), never a 0 read as dormant
    assert math.isnan(snap.ratios["seed/host"]) and math.isnan(snap.raw_ratios["seed/host"])
    assert snap.isolation_violated == {"host": False}


def test_none_and_frozen_parameters_skipped() -> None:
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    model.head.bias.grad = None
    model.seed.weight.requires_grad_(False)  # keeps a stale .grad: must be ignored
    assert model.seed.weight.grad is not None
    cfg = example_config()
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(2).result()
    assert "head.bias" not in snap.param_norms and "seed.weight" not in snap.param_norms
    assert snap.groups["seed"].tensors == 1 and snap.groups["seed"].numel == 8
    check_against_reference(snap, model, cfg)


def test_sparse_embedding_gradient() -> None:
    model = nn.ModuleDict({"emb": nn.Embedding(50, 6, sparse=True), "lin": nn.Linear(6, 1)})
    idx = torch.tensor([1, 3, 3, 3, 7, 1])  # repeated rows: uncoalesced sparse gradient
    model["lin"](model["emb"](idx)).sum().backward()
    grad = model["emb"].weight.grad
    assert grad.is_sparse
    dense = grad.to_dense()
    cfg = WatchConfig()
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(0).result()
    assert rel_err(snap.param_norms["emb.weight"], ref_norm([dense])) <= REL
    assert snap.groups["other"].numel == 50 * 6 + 7
    assert rel_err(snap.global_norm, ref_norm([dense, *grads_of(model["lin"]).values()])) <= REL


def test_complex_gradient_uses_abs() -> None:
    model = nn.ParameterDict(
        {
            "z": nn.Parameter(torch.zeros(3, dtype=torch.complex64)),
            "r": nn.Parameter(torch.zeros(2)),
        }
    )
    model["z"].grad = torch.tensor([3 + 4j, 0 + 1j, -1 - 1j], dtype=torch.complex64)
    model["r"].grad = torch.tensor([2.0, 0.0])
    with GradWatch(model, WatchConfig()) as watch:
        snap = watch.collect(0).result()
    assert snap.param_norms["z"] == pytest.approx(math.sqrt(25 + 1 + 2), rel=1e-7)
    assert snap.global_norm == pytest.approx(math.sqrt(25 + 1 + 2 + 4), rel=1e-7)
    assert snap.groups["other"].numel == 5


def test_nan_and_inf_gradients_are_counted_and_named() -> None:
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    model.seed.weight.grad[0, 0] = float("nan")
    model.backbone[0].bias.grad[3] = float("inf")
    big = nn.Parameter(torch.zeros(100_000))  # row path with a NaN
    big.grad = torch.ones(100_000)
    big.grad[99_999] = float("nan")
    model.big = big
    with GradWatch(model, example_config()) as watch:
        snap = watch.collect(5).result()
    assert snap.nonfinite_params == ("backbone.0.bias", "big", "seed.weight")
    assert snap.groups["seed"].nonfinite == 1 and snap.groups["seed"].exploding >= 1
    assert snap.groups["host"].nonfinite == 1 and snap.groups["host"].exploding >= 1
    assert snap.groups["other"].nonfinite == 1
    assert math.isnan(snap.global_norm)
    assert math.isinf(snap.param_norms["backbone.0.bias"])
    assert math.isnan(snap.param_norms["seed.weight"])
    assert snap.health == 0.0
    assert snap.isolation_violated == {"host": True}
    assert not snap.is_finite
    # untouched parameters still exact
    assert rel_err(snap.param_norms["head.weight"], ref_norm([model.head.weight.grad])) <= REL


def test_inf_only_gives_inf_global_norm() -> None:
    model = nn.ParameterDict({"a": nn.Parameter(torch.zeros(4)), "b": nn.Parameter(torch.zeros(4))})
    model["a"].grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])
    model["b"].grad = torch.ones(4)
    with GradWatch(model, WatchConfig(groups={"g": ["a"]}, isolated=["g"])) as watch:
        snap = watch.collect(0).result()
    assert math.isinf(snap.global_norm) and snap.health == 0.0
    assert snap.nonfinite_params == ("a",)
    assert snap.groups["g"].exploding == 1 and snap.groups["g"].nonfinite == 1
    assert snap.isolation_violated == {"g": True}
    assert snap.groups["other"].norm == 2.0


# -- range, dtypes, layouts ---------------------------------------------------------------------


def test_mixed_dtypes_and_extreme_magnitudes() -> None:
    gen = torch.Generator().manual_seed(11)
    specs = {
        "a": ((300,), torch.float32, 1e30),
        "b": ((70_000,), torch.float32, 1e-30),
        "c": ((200, 400), torch.bfloat16, 1e-35),
        "d": ((5,), torch.float16, 1e-6),
        "e": ((70_001,), torch.float16, 3e4),
        "f": ((123,), torch.float64, 1e-150),
        "g": ((1000,), torch.float64, 1e150),
        "h": ((90_000,), torch.bfloat16, 1e35),
    }
    model = nn.ParameterDict()
    for name, (shape, dtype, scale) in specs.items():
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        g = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 + 0.1
        p.grad = (g * scale).to(dtype)
        model[name] = p
    cfg = WatchConfig(groups={"low": ["a", "b", "c", "d"], "high": ["e", "g", "h"]})
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(0).result()
    check_against_reference(snap, model, cfg)


def test_2_pow_24_gradients_exact() -> None:
    model = nn.ParameterDict(
        {
            "const": nn.Parameter(torch.zeros(1 << 24)),
            "rand": nn.Parameter(torch.zeros(4096, 4096)),
        }
    )
    gen = torch.Generator().manual_seed(12)
    model["const"].grad = torch.full((1 << 24,), 0.1)
    model["rand"].grad = torch.randn(4096, 4096, generator=gen)
    with GradWatch(model, WatchConfig(groups={"c": ["const"]})) as watch:
        snap = watch.collect(0).result()
    assert rel_err(snap.param_norms["const"], float(torch.tensor(0.1).double()) * 4096) <= REL
    check_against_reference(snap, model, WatchConfig(groups={"c": ["const"]}))


def test_non_contiguous_gradients() -> None:
    gen = torch.Generator().manual_seed(13)
    model = nn.ParameterDict(
        {
            "t": nn.Parameter(torch.zeros(500, 600)),
            "cl": nn.Parameter(torch.zeros(8, 64, 32, 32, dtype=torch.bfloat16)),
            "strided": nn.Parameter(torch.zeros(450, 300)),
        }
    )
    model["t"].grad = torch.randn(600, 500, generator=gen).t()
    model["cl"].grad = torch.randn(8, 64, 32, 32, generator=gen).to(
        torch.bfloat16, memory_format=torch.channels_last
    )
    model["strided"].grad = torch.randn(900, 900, generator=gen)[::2, ::3]
    for p in model.values():
        assert not p.grad.is_contiguous()
    with GradWatch(model, WatchConfig()) as watch:
        snap = watch.collect(0).result()
        snap2 = watch.collect(1).result()  # cached plan
    check_against_reference(snap, model, WatchConfig())
    assert dict(snap2.param_norms) == dict(snap.param_norms)


# -- cost: host reads, op counts, temporaries ---------------------------------------------------


def test_host_reads_at_most_two_and_no_scalar_reads() -> None:
    torch.manual_seed(0)
    model = Net()
    model.big = nn.Parameter(torch.zeros(300, 400))
    model(torch.randn(4, 16)).sum().backward()
    model.big.grad = torch.randn(300, 400)
    with GradWatch(model, example_config()) as watch:
        for step in range(2):  # first collect builds the plan; both must stay within budget
            with count_host_reads() as reads, OpCounter() as counter:
                snap = watch.collect(step).result()
            assert sum(reads.values()) <= 2, reads
            assert counter.scalar_reads == 0
    check_against_reference(snap, model, example_config())


def _param_model(n: int) -> nn.Module:
    gen = torch.Generator().manual_seed(n)
    model = nn.ParameterDict()
    sizes = [100, 4000, 16384, 7]  # all packed (at most WHOLE_NUMEL)
    for i in range(n):
        p = nn.Parameter(torch.zeros(sizes[i % 4]))
        p.grad = torch.randn(sizes[i % 4], generator=gen)
        model[f"p{i}"] = p
    return model


def test_ops_do_not_grow_with_parameter_count() -> None:
    """Dispatched ops do not grow with the number of parameters: 20, 400 and 800 parameters
    cost the same ops but for two per fill of the pack buffer (a copy and a norm per
    PACK_NUMEL elements of small tensors, however many tensors that is)."""
    totals = []
    for n in (80, 400, 800):  # above HOST_CHECK_MAX: the repair check by tensor ops
        model = _param_model(n)
        cfg = WatchConfig(groups={"a": ["p1*"]})
        with GradWatch(model, cfg) as watch:
            watch.collect(0).result()
            with OpCounter() as counter:
                snap = watch.collect(1).result()
            plan = watch._collector.engine._plan
            assert plan is not None
            fills = plan.pack_fills
        check_against_reference(snap, model, cfg)
        totals.append((counter.total - 2 * fills, counter.scalar_reads))
    assert totals[0] == totals[1] == totals[2]
    assert all(reads == 0 for _, reads in totals)


def test_no_gradient_sized_temporaries() -> None:
    gen = torch.Generator().manual_seed(14)
    model = nn.ParameterDict(
        {
            "w32": nn.Parameter(torch.zeros(1024, 1100)),
            "wbf": nn.Parameter(torch.zeros(1 << 20, dtype=torch.bfloat16)),
            "w16": nn.Parameter(torch.zeros(1200, 1000, dtype=torch.float16)),
            "small": nn.Parameter(torch.zeros(10)),
        }
    )
    for p in model.values():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    with GradWatch(model, WatchConfig()) as watch:
        watch.collect(0).result()  # first collect: the plan and the bounded widening buffer
        with OutputRecorder() as rec:
            snap = watch.collect(1).result()
    check_against_reference(snap, model, WatchConfig())
    smallest = 1 << 20
    assert max(n for _, n, _ in rec.outputs) <= smallest // 64
    assert not [o for o in rec.outputs if o[2] == torch.float64 and o[1] >= smallest]


# -- schedule -------------------------------------------------------------------------------------


def test_every_n_steps_skips_without_work() -> None:
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    with GradWatch(model, example_config(every_n_steps=3)) as watch:
        first = watch.collect(3).result()
        model.seed.weight.grad.mul_(10)  # a skipped step must not see this
        with OpCounter() as counter, count_host_reads() as reads:
            skipped = watch.collect(4)
            snap = skipped.result()
        assert counter.total == 0 and sum(reads.values()) == 0
        assert snap.step == 3
        assert dict(snap.param_norms) == dict(first.param_norms)
        assert watch.collect(6).result().step == 6


def test_skipped_step_before_first_collect() -> None:
    """Nothing measured yet: no work, and the result says so instead of an empty snapshot
    (global norm 0.0, health 1.0) that was never measured."""
    with GradWatch(Net(), example_config(every_n_steps=3)) as watch, OpCounter() as counter:
        pending = watch.collect(1)
        assert counter.total == 0
        with pytest.raises(GradWatchError, match="step 1 was not measured"):
            pending.result()
        assert watch.last is None


def test_close_is_idempotent_and_context_manager_closes() -> None:
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    watch = GradWatch(model, example_config())
    snap = watch.collect(0).result()
    watch.close()
    watch.close()
    assert watch.collect(1).result().step == snap.step  # closed: no new work


# -- wrappers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("module.layer.0.weight", "layer.0.weight"),
        ("module._orig_mod.layer.0.weight", "layer.0.weight"),
        ("_fsdp_wrapped_module.block._checkpoint_wrapped_module.w", "block.w"),
        ("modules.weight", "modules.weight"),
        ("my_module.bias", "my_module.bias"),
    ],
)
def test_clean_name(raw: str, clean: str) -> None:
    assert clean_name(raw) == clean


class DDPLike(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_ddp_like_wrapper_names() -> None:
    model = Net()
    wrapped = DDPLike(model)
    wrapped(torch.randn(3, 16)).sum().backward()
    cfg = example_config()
    with GradWatch(wrapped, cfg) as watch:
        snap = watch.collect(0).result()
        assert watch.parameter_names == tuple(n for n, _ in model.named_parameters())
    assert snap.groups["host"].tensors == 4 and snap.groups["seed"].tensors == 2
    check_against_reference(snap, model, cfg)


def test_torch_compile_wrapper_names() -> None:
    model = Net()
    compiled = torch.compile(model)  # not run: only its parameter names matter here
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    model(torch.randn(3, 16)).sum().backward()
    cfg = example_config()
    with GradWatch(compiled, cfg) as watch:
        snap = watch.collect(0).result()
        assert watch.parameter_names == tuple(n for n, _ in model.named_parameters())
    check_against_reference(snap, model, cfg)


def test_checkpoint_wrapper_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Net()
    model.backbone = checkpoint_wrapper(model.backbone)
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    model(torch.randn(3, 16)).sum().backward()
    cfg = example_config()
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(0).result()
    assert snap.groups["host"].tensors == 4
    assert "backbone.0.weight" in snap.param_norms
    check_against_reference(snap, model, cfg)


def test_duplicate_names_after_unwrapping_rejected() -> None:
    from gradwatch import GradWatchError

    model = nn.Module()
    model.module = nn.Linear(2, 2)
    model.add_module("_orig_mod", nn.Linear(2, 2))  # both clean to "weight"/"bias"
    with pytest.raises(GradWatchError, match="duplicate"):
        GradWatch(model, WatchConfig())


# -- properties -----------------------------------------------------------------------------------

SHAPES = [(1,), (7,), (16, 16), (3, 100), (256, 257), (65537,), (90, 1000)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@settings(max_examples=60, deadline=None)
@given(
    params=st.lists(
        st.tuples(
            st.sampled_from(SHAPES),
            st.sampled_from(DTYPES),
            st.floats(0.0, 1.0),
            st.integers(0, 10),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_watch_norms_exact(params, seed: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    model = nn.ParameterDict()
    for i, (shape, dtype, where, spread, has_grad) in enumerate(params):
        lo, hi = EXP_RANGE[dtype]
        center = int(lo + where * (hi - lo))
        p = nn.Parameter(torch.zeros(shape, dtype=dtype))
        if has_grad:
            p.grad = values(shape, dtype, max(lo, center - spread), min(hi, center + 1), gen)
        model[f"{'ab'[i % 2]}{i}"] = p
    cfg = WatchConfig(groups={"a": ["a*"]}, ratios=[("a", "other")], isolated=["other"])
    with GradWatch(model, cfg) as watch:
        snap = watch.collect(0).result()
    check_against_reference(snap, model, cfg)
    # Formulas re-derived here from the (just verified) per-parameter norms and references.
    norms = list(snap.param_norms.values())
    v = sum(1 for x in norms if x < cfg.vanishing_threshold)
    e = sum(1 for x in norms if x > cfg.exploding_threshold)
    assert snap.health == pytest.approx(
        ref_health(len(norms), v, e, snap.global_norm), abs=1e-12, nan_ok=True
    )
    grads = grads_of(model)
    a = [g for k, g in grads.items() if k.startswith("a")]
    b = [g for k, g in grads.items() if not k.startswith("a")]
    na, nb = ref_norm(a), ref_norm(b)
    ea, eb = sum(g.numel() for g in a), sum(g.numel() for g in b)
    for got, want in (
        (snap.ratios["a/other"], ref_ratio(na, ea, nb, eb)),
        (snap.raw_ratios["a/other"], ref_raw(na, nb)),
    ):
        if want == 0.0 or math.isnan(want):  # a norm at the 1e-8 cut-off may legitimately flip
            assert (got == want or (math.isnan(got) and math.isnan(want))) or min(
                na, nb
            ) == pytest.approx(1e-8, rel=1e-5)
        else:
            assert got == pytest.approx(want, rel=3e-6)
    assert snap.isolation_violated["other"] == (nb > cfg.isolation_threshold)


def test_low_precision_param_norms_not_rounded() -> None:
    model = nn.ParameterDict(
        {
            "bf": nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)),
            "hf": nn.Parameter(torch.zeros(70_001, dtype=torch.float16)),
        }
    )
    model["bf"].grad = torch.ones(3, dtype=torch.bfloat16)
    model["hf"].grad = torch.full((70_001,), 0.1, dtype=torch.float16)
    with GradWatch(model, WatchConfig()) as watch:
        snap = watch.collect(0).result()
    assert rel_err(snap.param_norms["bf"], math.sqrt(3)) <= REL
    hf = float(torch.tensor(0.1, dtype=torch.float16).double()) * math.sqrt(70_001)
    assert rel_err(snap.param_norms["hf"], hf) <= REL
    assert rel_err(snap.global_norm, math.sqrt(3 + hf**2)) <= REL


def test_config_from_environment_when_none_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_GROUPS", '{"s": ["seed.*"]}')
    monkeypatch.setenv("GRADWATCH_ISOLATED", '["s"]')
    model = Net()
    model(torch.randn(2, 16)).sum().backward()
    with GradWatch(model) as watch:
        snap = watch.collect(0).result()
    assert list(snap.groups) == ["s", "other"]
    assert snap.groups["s"].tensors == 2 and snap.isolation_violated == {"s": True}
    check_against_reference(snap, model, WatchConfig(groups={"s": ["seed.*"]}))


def test_set_isolated_switches_the_expectation_per_stage() -> None:
    """Isolation is a per-stage expectation: switched at run time, applied from the next collect
    (a pending result keeps the expectation of its collect), unknown groups refused by name."""
    torch.manual_seed(0)
    model = Net()
    model(torch.randn(4, 16)).pow(2).sum().backward()
    with GradWatch(model, example_config()) as watch:
        assert watch.isolated == ("host",)
        pending = watch.collect(step=0)
        watch.set_isolated([])  # the host trains again: blending stage
        assert pending.result().isolation_violated == {"host": True}
        assert watch.collect(step=1).result().isolation_violated == {}
        watch.set_isolated(["seed", "other"])
        snap = watch.collect(step=2).result()
        assert snap.isolation_violated == {"seed": True, "other": True}
        with pytest.raises(ValueError, match=r"set_isolated.*'nope'"):
            watch.set_isolated(["seed", "nope"])
        assert watch.isolated == ("seed", "other")  # a refused change changes nothing


def test_add_sink_receives_every_published_step_off_the_training_thread() -> None:
    import threading

    seen: list[tuple[int, float, str]] = []

    class Recorder:
        def write(self, snapshot: object) -> None:
            seen.append((snapshot.step, snapshot.global_norm, threading.current_thread().name))

    model = nn.Linear(3, 2)
    with GradWatch(model, WatchConfig(port=None)) as watch:
        watch.add_sink(Recorder())
        expected = []
        for step in range(3):
            model.zero_grad()
            model(torch.full((1, 3), float(step + 1))).sum().backward()
            expected.append(math.sqrt(math.fsum(
                float(x) ** 2 for p in model.parameters() for x in p.grad.flatten().tolist()
            )))
            watch.collect(step)
        assert watch.flush(10.0)
    assert [s for s, _, _ in seen] == [0, 1, 2]
    for (_, norm, thread), want in zip(seen, expected, strict=True):
        assert norm == pytest.approx(want, rel=1e-6)  # float32 gradients
        assert thread != threading.main_thread().name
