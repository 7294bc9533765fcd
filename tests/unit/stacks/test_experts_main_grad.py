"""One process: the ``expert_parameters`` setting and its rules, gradients read from
``param.main_grad`` (exact, clipped in place, no gradient-sized temporary), and ``watch()``
turning a refused setup into a visible no-op. Multi-rank cases:
tests/distributed/test_experts_distributed.py."""

from __future__ import annotations

import json
import logging
import math
import os
import time
import urllib.request
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from allocations import OutputRecorder
from pydantic import ValidationError
from torch import nn

import gradwatch
from gradwatch import GradWatch, LayoutMismatchError, UnsupportedParallelismError, WatchConfig
from gradwatch.reduce.experts import check_expert_holders, expert_names
from gradwatch.watcher import RefusedWatch


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("GRADWATCH_"):
            monkeypatch.delenv(key)


# -- expert_parameters ----------------------------------------------------------------------------


def test_expert_parameters_validated_and_part_of_the_layout_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValidationError, match="expert_parameters"):
        WatchConfig(expert_parameters=[""])
    with pytest.raises(ValidationError, match="expert_parameters has duplicate patterns"):
        WatchConfig(expert_parameters=["experts.*", "experts.*"])
    with pytest.raises(ValidationError, match="expert_parameters"):
        WatchConfig(expert_parameters="experts.*")  # a list, not a bare string
    monkeypatch.setenv("GRADWATCH_EXPERT_PARAMETERS", json.dumps(["layers.*.experts.*"]))
    cfg = WatchConfig()
    assert cfg.expert_parameters == ["layers.*.experts.*"]
    assert cfg.layout_hash() != WatchConfig(expert_parameters=[]).layout_hash()


def test_expert_names_and_the_refusal_of_names_on_every_rank() -> None:
    names = ["dense.weight", "layers.0.experts.5.w1", "layers.0.experts.6.w1"]
    assert expert_names(names, ["layers.*.experts.*"]) == {
        "layers.0.experts.5.w1", "layers.0.experts.6.w1"}
    assert expert_names(names, []) == frozenset()
    experts = frozenset({"e.0", "e.1"})
    check_expert_holders(experts, [frozenset({"d", "e.0"}), frozenset({"d", "e.1"})], 2)
    check_expert_holders(experts, [frozenset({"d", "e.0", "e.1"})], 1)  # one rank: no EP
    with pytest.raises(LayoutMismatchError, match=r"\['e.0'\].*exactly the ranks that hold 'd'"):
        check_expert_holders(experts, [frozenset({"d", "e.0"}), frozenset({"d", "e.0", "e.1"})],
                             2)
    # Inside pipeline stages: stage 0's experts named alike on both of its ranks.
    stage0, stage1 = frozenset({"s0.d", "s0.e.0"}), frozenset({"s1.d", "s1.e.0"})
    with pytest.raises(LayoutMismatchError, match=r"s0\.e\.0"):
        check_expert_holders(frozenset({"s0.e.0", "s1.e.0"}), [stage0, stage1], 4)
    check_expert_holders(frozenset({"s0.e.0", "s0.e.1", "s1.e.0", "s1.e.1"}),
                         [frozenset({"s0.d", "s0.e.0"}), frozenset({"s0.d", "s0.e.1"}),
                          frozenset({"s1.d", "s1.e.0"}), frozenset({"s1.d", "s1.e.1"})], 4)


def test_declared_experts_on_one_process_are_measured() -> None:
    model = nn.ModuleDict({"dense": nn.Linear(3, 2), "experts": nn.Linear(2, 2)})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with GradWatch(model, WatchConfig(expert_parameters=["experts.*"])) as watch:
        snap = watch.collect(0).result()
    assert snap.global_norm == pytest.approx(math.sqrt(6 + 2 + 4 + 2), rel=1e-7)


# -- main_grad ------------------------------------------------------------------------------------


def megatron_layout(model: nn.Module, seed: int) -> torch.Tensor:
    """Megatron-Core's layout: one float32 buffer, ``main_grad`` views of it (reverse order),
    ``.grad`` None; filled with random gradients. Returns the buffer."""
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
    at = 0
    for p in reversed(params):
        p.main_grad = buffer[at:at + p.numel()].view(p.shape)
        at += p.numel()
    buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return buffer


def fsum_norm(t: torch.Tensor) -> float:
    return math.sqrt(math.fsum(x * x for x in t.double().tolist()))


def test_main_grad_read_exactly_without_gradient_sized_temporaries() -> None:
    model = nn.ParameterDict({
        "big": nn.Parameter(torch.zeros(1 << 20, dtype=torch.bfloat16)),
        "mid": nn.Parameter(torch.zeros(700, 300)),
        "small": nn.Parameter(torch.zeros(10)),
    })
    buffer = megatron_layout(model, 0)
    with GradWatch(model, WatchConfig()) as watch:
        watch.collect(0).result()  # the plan
        with OutputRecorder() as rec:
            snap = watch.collect(1).result()
    assert all(p.grad is None for p in model.values())
    for name, p in model.items():
        ref = fsum_norm(p.main_grad.flatten())
        assert abs(snap.param_norms[name] - ref) <= 1e-6 * ref
    assert abs(snap.global_norm - fsum_norm(buffer)) <= 1e-6 * fsum_norm(buffer)
    assert max(n for _, n, _ in rec.outputs) <= (1 << 20) // 64


def test_main_grad_is_what_clipping_scales() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    buffer = megatron_layout(model, 1)
    before = fsum_norm(buffer)
    with GradWatch(model, WatchConfig(every_n_steps=2)) as watch:
        total = float(watch.clip_grad_norm_(before / 2, step=0))
        assert abs(total - before) <= 1e-6 * before
        assert abs(fsum_norm(buffer) - before / 2) <= 1e-5 * before
        # A step the schedule skips clips with the rank-local fallback: main_grad too.
        now = fsum_norm(buffer)
        watch.clip_grad_norm_(now / 2, step=1)
        assert abs(fsum_norm(buffer) - now / 2) <= 1e-5 * now
    assert all(p.grad is None for p in model.parameters())


def test_megatron_distributed_optimizer_refused() -> None:
    model = nn.Linear(3, 2)
    model.ddp_config = SimpleNamespace(use_distributed_optimizer=True)  # type: ignore[assignment]
    with pytest.raises(UnsupportedParallelismError, match="use_distributed_optimizer=True"):
        GradWatch(model, WatchConfig())


# -- watch() on a refused setup ----------------------------------------------------------------


def test_watch_on_a_refused_setup_is_a_visible_no_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = nn.Linear(3, 2)
    model.ddp_config = SimpleNamespace(use_distributed_optimizer=True)  # type: ignore[assignment]
    model.weight.grad = torch.ones(2, 3)
    monkeypatch.setenv("GRADWATCH_PORT", "0")
    with caplog.at_level(logging.ERROR, logger="gradwatch"):
        watch = gradwatch.watch(model)
    assert isinstance(watch, RefusedWatch)
    assert isinstance(watch.error, UnsupportedParallelismError)
    refusals = [r for r in caplog.records if "monitoring is off" in r.getMessage()]
    assert len(refusals) == 1
    try:
        assert watch.collect(0).result().step == 0
        assert float(watch.clip_grad_norm_(1.0)) == pytest.approx(math.sqrt(6))
        assert watch.metrics_url is not None
        text, deadline = "", time.monotonic() + 20  # the exporter renders asynchronously
        while "gradwatch_collecting" not in text and time.monotonic() < deadline:
            with urllib.request.urlopen(watch.metrics_url, timeout=5) as response:
                text = response.read().decode()
            time.sleep(0.05)
    finally:
        watch.close()
    assert "gradwatch_collecting 0.0" in text.splitlines()
    assert 'parallelism="refused"' in text
    assert len([r for r in caplog.records if "monitoring is off" in r.getMessage()]) == 1
    # Explicit construction keeps raising; invalid settings keep raising from watch().
    with pytest.raises(UnsupportedParallelismError):
        GradWatch(model, WatchConfig())
    monkeypatch.setenv("GRADWATCH_PORT", "abc")
    with pytest.raises(ValueError, match="port"):
        gradwatch.watch(model)


def test_watch_refused_without_a_port_serves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(3, 2)
    model.ddp_config = SimpleNamespace(use_distributed_optimizer=True)  # type: ignore[assignment]
    watch = gradwatch.watch(model)
    assert isinstance(watch, RefusedWatch) and watch.metrics_url is None
    watch.close()


# -- the handshake's rule for declared experts ---------------------------------------------------


def _world(per_rank: list[list[str]], stages: list | None = None) -> Any:
    from benchmarks.handshake_sim import simulate
    from gradwatch.reduce import handshake
    from gradwatch.reduce.layout import LocalPiece

    return simulate([
        handshake.describe([LocalPiece(n, (2,), ("whole",), 2) for n in names], version="v",
                           config_hash="c", stage_ranks=(stages or [None] * 9)[r], host=f"h{r}")
        for r, names in enumerate(per_rank)
    ])


def test_layout_counts_each_declared_expert_once_also_inside_pipeline_stages() -> None:
    from gradwatch.reduce.layout import derive_layout

    # pp2 x ep2: ranks (pp, ep) = 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1); stage groups {0,2}, {1,3}.
    per_rank = [[f"s{r // 2}.dense", f"s{r // 2}.experts.{2 * (r % 2)}",
                 f"s{r // 2}.experts.{2 * (r % 2) + 1}"] for r in range(4)]
    stages = [[0, 2], [1, 3], [0, 2], [1, 3]]
    layouts = [derive_layout(_world(per_rank, stages), r, ["*.experts.*"]) for r in range(4)]
    assert sorted(layouts[0].names) == sorted(
        ["s0.dense", "s1.dense"] + [f"s{s}.experts.{e}" for s in (0, 1) for e in range(4)])
    # Every expert once over the world, every dense layer once (its lowest holder).
    counted = [layouts[r].names[g] for r in range(4)
               for g, c in zip(layouts[r].local_to_global, layouts[r].contributes, strict=True)
               if c]
    assert sorted(counted) == sorted(layouts[0].names)
    with pytest.raises(LayoutMismatchError, match="expert_parameters"):
        derive_layout(_world(per_rank, stages), 0)  # undeclared: refused
    # Without stages: EP x replicas (edp2 x ep2), experts held by two ranks each.
    plain = [["dense", f"experts.{2 * (r % 2)}", f"experts.{2 * (r % 2) + 1}"]
             for r in range(4)]
    layouts = [derive_layout(_world(plain), r, ["experts.*"]) for r in range(4)]
    counted = [layouts[r].names[g] for r in range(4)
               for g, c in zip(layouts[r].local_to_global, layouts[r].contributes, strict=True)
               if c]
    assert sorted(counted) == ["dense"] + [f"experts.{e}" for e in range(4)]
    with pytest.raises(LayoutMismatchError, match="expert_parameters"):
        derive_layout(_world(plain), 0)
