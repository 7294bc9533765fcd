"""Training-loop integration: clip-and-watch, attach, AMP, enablement, anomaly logs, callbacks."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from jobs.framework_ddp_job import Regression, RegressionModel, quiet_trainer, training_args
from promserver import free_port
from torch import nn

import gradwatch
from gradwatch import GradWatch, NoOpWatch, WatchConfig


def ref_norm(tensors) -> float:
    """Independent float64 reference: fsum of exact squares."""
    return math.sqrt(
        math.fsum(float(x) ** 2 for t in tensors for x in t.detach().double().flatten().tolist())
    )


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict(
        {
            "backbone": nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)),
            "seed": nn.Linear(8, 8),
            "head": nn.Linear(8, 1),
        }
    )


def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m["head"](m["seed"](m["backbone"](x)))


def backward(m: nn.Module, scale: float = 1.0, seed: int = 1) -> None:
    torch.manual_seed(seed)
    x = torch.randn(32, 16)
    (forward(m, x).pow(2).mean() * scale).backward()


CFG = WatchConfig(groups={"host": ["backbone.*"], "seed": ["seed.*"]}, ratios=[("seed", "host")])


@pytest.mark.parametrize("max_norm", [0.01, 1.0, 1e6])
def test_clip_matches_torch(max_norm: float) -> None:
    a = make_model()
    b = copy.deepcopy(a)
    backward(a, scale=50.0)
    backward(b, scale=50.0)
    pre = ref_norm([p.grad for p in a.parameters()])
    with GradWatch(a, CFG) as watch:
        total = watch.clip_grad_norm_(max_norm, step=3)
        expected = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm)
        assert total.dtype == torch.float64 and total.dim() == 0
        assert abs(float(total) - pre) <= 1e-6 * pre
        assert abs(float(total) - float(expected)) <= 1e-6 * pre
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-6, atol=0)
        snap = watch.last
        assert snap is not None and snap.step == 3
        assert abs(snap.global_norm - pre) <= 1e-6 * pre  # the snapshot holds pre-clip norms
        assert snap.clip_coef == pytest.approx(min(1.0, max_norm / (pre + 1e-6)), rel=1e-6)


def test_clip_scales_sparse_complex_mixed_dtype_and_large_gradients_like_torch() -> None:
    """Every kind of gradient is clipped in place, by the same factor as torch's function."""

    def build() -> nn.ParameterDict:
        torch.manual_seed(5)
        return nn.ParameterDict(
            {
                "emb": nn.Parameter(torch.randn(50, 4)),
                "cplx": nn.Parameter(torch.randn(6, dtype=torch.complex64)),
                "f64": nn.Parameter(torch.randn(7, dtype=torch.float64)),
                "big": nn.Parameter(torch.randn(70_000)),  # the row path
                "bf": nn.Parameter(torch.randn(300).to(torch.bfloat16)),
            }
        )

    def grads(m: nn.ParameterDict) -> None:
        gen = torch.Generator().manual_seed(9)
        idx = torch.tensor([[1, 3, 3, 7]])
        m["emb"].grad = torch.sparse_coo_tensor(idx, torch.randn(4, 4, generator=gen), (50, 4))
        for name in ("cplx", "f64", "big", "bf"):
            p = m[name]
            p.grad = (torch.randn(p.shape, generator=gen, dtype=torch.float64) * 30).to(p.dtype)
            if p.is_complex():
                p.grad = p.grad * (1 + 2j)

    a, b = build(), build()
    grads(a)
    grads(b)
    with GradWatch(a, WatchConfig()) as watch:
        total = watch.clip_grad_norm_(1.0, step=0)
    # torch's clip_grad_norm_ cannot norm sparse gradients at all: the float64 reference
    # (over b's unclipped gradients) gives the total and the factor, like torch's formula.
    dense = [torch.view_as_real(b["cplx"].grad)] + [b[n].grad for n in ("f64", "big", "bf")]
    pre = ref_norm([*dense, b["emb"].grad.coalesce().values()])
    coef = min(1.0, 1.0 / (pre + 1e-6))
    assert abs(float(total) - pre) <= 1e-6 * pre
    for name in ("cplx", "f64", "big", "bf"):
        want = (b[name].grad.to(torch.complex128 if name == "cplx" else torch.float64) * coef)
        tol = 1e-2 if name == "bf" else 1e-6  # bf16 holds 3 digits of the scaled value
        torch.testing.assert_close(a[name].grad.to(want.dtype), want, rtol=tol, atol=0)
    ga, gb = a["emb"].grad.coalesce(), b["emb"].grad.coalesce()
    torch.testing.assert_close(ga.values(), gb.values() * coef, rtol=1e-6, atol=0)
    assert float(total) > 1.0 and float(a["big"].grad.norm()) < 1.0  # it did clip


def test_clip_nonfinite_error_and_nan_total() -> None:
    m = make_model()
    backward(m)
    m["seed"].weight.grad[0, 0] = float("nan")
    with GradWatch(m, CFG) as watch, pytest.raises(RuntimeError, match="non-finite"):
        watch.clip_grad_norm_(1.0, error_if_nonfinite=True, step=1)
    m2 = make_model()
    backward(m2)
    m2["seed"].weight.grad[0, 0] = float("inf")
    with GradWatch(m2, CFG) as watch:
        total = watch.clip_grad_norm_(1.0, step=1)
        assert not math.isfinite(float(total))
        assert watch.last.nonfinite_params == ("seed.weight",)


def test_clip_rejects_other_norm_types() -> None:
    m = make_model()
    backward(m)
    with GradWatch(m, CFG) as watch, pytest.raises(ValueError, match="norm_type"):
        watch.clip_grad_norm_(1.0, norm_type=1.0)


def test_clip_more_exact_than_torch_on_large_tensors() -> None:
    """On 2^22-element constant-ish gradients torch's float32 norm drifts; gradwatch's does not."""
    p = nn.Parameter(torch.zeros(1 << 22))
    p.grad = torch.full_like(p, 0.1) + torch.linspace(0, 1e-3, p.numel())
    model = nn.Module()
    model.w = p
    reference = ref_norm([p.grad])
    torch_total = float(torch.nn.utils.get_total_norm([p.grad]))
    with GradWatch(model, WatchConfig()) as watch:
        ours = float(watch.clip_grad_norm_(1e9, step=0))
    assert abs(ours - reference) / reference <= 1e-6
    # Recorded in docs/integrations.md: torch's relative error on this tensor.
    assert abs(torch_total - reference) / reference > abs(ours - reference) / reference


def test_attach_collects_every_n_steps_with_own_counter() -> None:
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with GradWatch(m, CFG.model_copy(update={"every_n_steps": 2})) as watch:
        watch.attach(opt)
        seen = []
        for i in range(5):
            opt.zero_grad()
            backward(m, seed=i)
            expected = ref_norm([p.grad for p in m.parameters()])
            opt.step()
            snap = watch.last
            seen.append(snap.step)
            if i % 2 == 0:
                assert abs(snap.global_norm - expected) <= 1e-6 * expected
        assert seen == [0, 0, 2, 2, 4]


def test_attach_after_manual_collects_continues_the_step_numbers() -> None:
    """collect(step=0..1) then attach(opt): the hook numbers the next optimizer steps 2, 3, never
    0 again (a repeated step would overwrite history and metrics of an earlier one)."""
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with GradWatch(m, CFG) as watch:
        steps = []
        for i in range(4):
            opt.zero_grad()
            backward(m, seed=i)
            if i == 2:
                watch.attach(opt)
            if i < 2:
                watch.collect(i)
            opt.step()
            steps.append(watch.last.step)
        assert steps == [0, 1, 2, 3]


def test_attach_and_clip_collect_once_per_step() -> None:
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    with GradWatch(m, CFG) as watch:
        watch.attach(opt)
        opt.zero_grad()
        backward(m)
        pre = ref_norm([p.grad for p in m.parameters()])
        watch.clip_grad_norm_(1e-3)
        collections = watch._collector.attempts
        opt.step()
        assert watch._collector.attempts == collections  # the pre-hook did not collect again
        assert abs(watch.last.global_norm - pre) <= 1e-6 * pre  # pre-clip figures kept


def test_amp_scaled_unscaled_and_skipped_steps() -> None:
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with GradWatch(m, CFG) as watch:
        opt.zero_grad()
        torch.manual_seed(1)
        loss = forward(m, torch.randn(32, 16)).pow(2).mean()
        scaler.scale(loss).backward()
        unscaled = ref_norm([p.grad for p in m.parameters()]) / 2.0**16
        scaled_view = watch.collect(step=1, scaler=scaler).result()
        assert abs(scaled_view.global_norm - unscaled) <= 1e-6 * unscaled
        scaler.unscale_(opt)  # now the grads are unscaled in place: no double unscale
        after = watch.collect(step=2, scaler=scaler, optimizer=opt).result()
        assert abs(after.global_norm - unscaled) <= 1e-6 * unscaled
        assert not after.amp_skipped
        m["seed"].weight.grad[0, 0] = float("inf")
        skipped = watch.collect(step=3, scaler=scaler, optimizer=opt).result()
        assert skipped.amp_skipped and skipped.nonfinite_params == ("seed.weight",)


def test_amp_attach_sees_skipped_steps() -> None:
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with GradWatch(m, CFG) as watch:
        watch.attach(opt, scaler=scaler)
        for i in range(3):
            opt.zero_grad()
            torch.manual_seed(i)
            scaler.scale(forward(m, torch.randn(8, 16)).pow(2).mean()).backward()
            if i == 1:
                m["seed"].bias.grad[0] = float("nan")
            scaler.step(opt)
            scaler.update()
            assert watch.last.step == i
            assert watch.last.amp_skipped == (i == 1)
    assert "step" not in scaler.__dict__  # close() restored the scaler


def test_watch_enablement_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWATCH_ENABLED", "0")
    m = make_model()
    ref = copy.deepcopy(m)
    backward(m)
    backward(ref)
    noop = gradwatch.watch(m)
    assert isinstance(noop, NoOpWatch)
    assert noop.metrics_url is None
    snap = noop.collect(step=1).result()
    assert not snap.measured and math.isnan(snap.global_norm)  # not measured: never 0.0
    total = noop.clip_grad_norm_(0.5)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    monkeypatch.setenv("GRADWATCH_ENABLED", "1")
    monkeypatch.setenv("GRADWATCH_GROUPS", '{"host": ["backbone.*"]}')
    with gradwatch.watch(m, exploding_threshold=5.0) as real:
        assert isinstance(real, GradWatch)
        assert real.config.groups == {"host": ["backbone.*"]}
        assert real.config.exploding_threshold == 5.0


def test_anomaly_logs_name_params_rank_and_group_once_per_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m = make_model()
    cfg = CFG.model_copy(update={"isolated": ["host"]})
    with GradWatch(m, cfg) as watch, caplog.at_level(logging.WARNING, logger="gradwatch"):
        backward(m)
        m["seed"].bias.grad[1] = float("nan")
        watch.collect(step=1).result()
        watch.collect(step=2).result()  # same anomalies again: rate-limited
    messages = [r.getMessage() for r in caplog.records]
    nonfinite = [msg for msg in messages if "non-finite" in msg]
    isolation = [msg for msg in messages if "isolated group" in msg]
    assert len(nonfinite) == 1 and "seed.bias" in nonfinite[0] and "rank 0" in nonfinite[0]
    assert len(isolation) == 1 and "'host'" in isolation[0]


# -- frameworks --------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_huggingface_trainer_callback(tmp_path) -> None:
    import transformers

    from gradwatch.integrations.huggingface import GradWatchCallback

    history = tmp_path / "gradwatch.jsonl"
    callback = GradWatchCallback(
        groups={"host": ["backbone.*"], "seed": ["seed.*"]},
        ratios=[("seed", "host")],
        history_path=str(history),
    )
    # max_grad_norm=0: no clipping, the callback then sees the Trainer's own gradients
    args = training_args(tmp_path, max_steps=4, logging_steps=1, max_grad_norm=0.0)
    model = RegressionModel()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Regression(), callbacks=[callback]
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "gradwatch/global_grad_norm" in h]
    assert len(logged) >= 3
    for entry in logged:
        assert entry["gradwatch/global_grad_norm"] > 0
        assert "gradwatch/grad_norm/seed" in entry and "gradwatch/ratio/seed/host" in entry
        assert entry["gradwatch/health"] == 1.0
    # gradwatch's steps are the Trainer's: its logs, gradwatch's history and metrics agree.
    from gradwatch.export.history import read_history

    assert [h["step"] for h in logged if "loss" in h] == [1, 2, 3, 4]  # not the final summary
    assert [r["step"] for r in read_history(history)] == [1, 2, 3, 4]


def _lightning_module() -> type:
    """The tests' Lightning module: a backbone and a seed layer, MSE loss, SGD."""
    import lightning.pytorch as pl

    class Base(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(16, 8)
            self.seed = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            out = self.seed(torch.tanh(self.backbone(batch["x"])))
            return nn.functional.mse_loss(out, batch["labels"])

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Base


@pytest.mark.timeout(300)
def test_lightning_callback(tmp_path) -> None:

    from gradwatch.integrations.lightning import GradWatchCallback

    grads_seen: list[float] = []

    class Module(_lightning_module()):
        def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
            grads_seen.append(ref_norm([p.grad for p in self.parameters()]))

    callback = GradWatchCallback(groups={"host": ["backbone.*"], "seed": ["seed.*"]})
    trainer = quiet_trainer(
        tmp_path,
        max_steps=4,
        devices=1,
        gradient_clip_val=0.01,  # clipping happens after the hook: gradwatch sees pre-clip norms
        callbacks=[callback],
    )
    loader = torch.utils.data.DataLoader(Regression(), batch_size=8)
    trainer.fit(Module(), loader)
    metrics = trainer.logged_metrics
    assert "gradwatch/global_grad_norm" in metrics and "gradwatch/grad_norm/seed" in metrics
    # Logged figures are those of the previous step's pre-clip gradients.
    logged = float(metrics["gradwatch/global_grad_norm"])
    assert any(abs(logged - g) <= 1e-5 * g for g in grads_seen[:-1])


def test_clip_total_does_not_overflow_for_huge_float64_norms() -> None:
    """Sum of float64 squares overflows at norms near 1e154; the clip total must not."""
    model = nn.ParameterList(
        [nn.Parameter(torch.zeros(100, dtype=torch.float64)) for _ in range(2)]
    )
    for p in model:
        p.grad = torch.full((100,), 1e153, dtype=torch.float64)
    expected = math.sqrt(200.0) * 1e153  # exact: 200 equal elements
    with GradWatch(model, WatchConfig()) as watch:
        total = float(watch.clip_grad_norm_(1.0, step=0))
    assert abs(total - expected) <= 1e-12 * expected
    for p in model:
        assert float(p.grad[0]) == pytest.approx(1e153 / expected, rel=1e-12)


# -- frameworks under 2-rank DDP (torchrun) --------------------------------------------------

FRAMEWORK_JOB = Path(__file__).resolve().parents[1] / "helpers" / "jobs" / "framework_ddp_job.py"


def _run_framework_job(mode: str, out: Path, timeout: float) -> None:
    """``framework_ddp_job.py mode out`` under torchrun on 2 gloo ranks; fails with its output."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    env.pop("GRADWATCH_PORT", None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--max_restarts=0", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            str(FRAMEWORK_JOB), mode, str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("framework", ["huggingface", "lightning"])
def test_framework_ddp_reads_ddp2(tmp_path: Path, framework: str) -> None:
    """The Trainer and Lightning hand the callback the unwrapped module while their DDP wrapper
    trains it: the parallelism label reads ddp2, as for a model wrapped by the user."""
    _run_framework_job(framework, tmp_path, timeout=280)
    for rank in range(2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["wrapper"] == "DistributedDataParallel"
        assert seen["parallelism"] == "ddp2"
        assert seen["world_size"] == 2


def _check_pre_clip(seen: dict, max_grad_norm: float, world_size: int) -> None:
    """gradwatch's history norm of every step equals the float64 pre-clip reference and the
    Trainer's logged grad_norm; clipping (on or off) trains exactly as without gradwatch."""
    refs = seen["references"]
    assert len(refs) == 3 and seen["plain_references"] == pytest.approx(refs, rel=1e-6)
    history = seen["history"]
    assert [step for step, _, _ in history] == [1, 2, 3]
    for step, norm, clip_coef in history:
        ref = refs[step - 1]
        assert abs(norm - ref) <= 1e-6 * ref, (step, norm, ref)  # float32 rows: <= 5e-7
        logged = seen["logged"][str(step)]
        if max_grad_norm > 0:  # the Trainer logs the total gradwatch's clip returned
            assert abs(logged - norm) <= 1e-12 * norm, (step, logged, norm)
        else:  # the Trainer's own (torch's float32) norm of the same gradients
            assert abs(logged - norm) <= 1e-6 * norm, (step, logged, norm)
        if max_grad_norm > 0:
            assert clip_coef == pytest.approx(min(1.0, max_grad_norm / (ref + 1e-6)), rel=1e-6)
        else:
            assert clip_coef is None
    if max_grad_norm > 0:
        assert seen["routed"] is True
        assert any(r > max_grad_norm for r in refs)  # the clip acted: post-clip would read 0.5
    # Trained as without gradwatch: the same max_norm and coefficient formula; the coefficient
    # differs only by the norm's precision (gradwatch's float64 vs torch's float32 total).
    assert seen["param_diff"] <= 1e-5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("max_grad_norm", [0.5, 0.0])
def test_huggingface_trainer_pre_clip_exact(tmp_path: Path, max_grad_norm: float) -> None:
    """The real Trainer, clipping on (routed through GradWatch.clip_grad_norm_) and off
    (collected before the optimizer step): pre-clip norms, the Trainer's own grad_norm."""
    from jobs.framework_ddp_job import run_huggingface_clip

    seen = run_huggingface_clip(tmp_path, max_grad_norm)
    _check_pre_clip(seen, max_grad_norm, world_size=1)
    import accelerate

    assert "clip_grad_norm_" not in accelerate.Accelerator.__dict__ or (
        accelerate.Accelerator.clip_grad_norm_.__qualname__ == "Accelerator.clip_grad_norm_"
    )  # the route is removed at train end


def test_huggingface_route_declines_an_engine_that_clips(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under an accelerator path gradwatch cannot measure (DeepSpeed), the call goes to
    accelerate untouched and the callback warns once that figures are post-clip."""
    from gradwatch.integrations import huggingface as hf

    class FakeKind:
        value = "DEEPSPEED"

    class FakeAccelerator:
        distributed_type = FakeKind()

    model = RegressionModel()
    callback = hf.GradWatchCallback()
    callback.watch = GradWatch(model, WatchConfig())
    callback._params = frozenset(id(p) for p in model.parameters())
    params = list(model.parameters())
    assert not callback._takes(FakeAccelerator(), params, 1.0, 2)
    FakeKind.value = "MULTI_CPU"
    assert callback._takes(FakeAccelerator(), params, 1.0, 2)
    assert not callback._takes(FakeAccelerator(), params, math.inf, 2)  # no clip: not routed
    assert not callback._takes(FakeAccelerator(), params[:-1], 1.0, 2)  # another model
    callback.watch.close()

    class Args:
        max_grad_norm = 1.0

    class State:
        global_step = 0

    # At train start, an accelerator path gradwatch cannot route: one warning, no route, and
    # every step still collected (post-clip) before the optimizer step.
    monkeypatch.setattr(
        hf, "_cannot_route", lambda: "accelerate runs DEEPSPEED, whose engine clips"
    )
    callback = hf.GradWatchCallback()
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        callback.on_train_begin(Args(), State(), None, model=model)
        assert not callback.routed and callback.watch is not None
        for step in range(2):
            State.global_step = step
            callback.on_pre_optimizer_step(Args(), State(), None)
        assert callback.watch.last.step == 2
        callback.on_train_end(Args(), State(), None)
    warnings = [r.getMessage() for r in caplog.records if "post-clip" in r.getMessage()]
    assert len(warnings) == 1 and "DEEPSPEED" in warnings[0]


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["hf-clip", "hf-noclip"])
def test_huggingface_trainer_pre_clip_exact_ddp2(tmp_path: Path, mode: str) -> None:
    """The same under torchrun, 2 gloo ranks: the Trainer's DDP wrapper all-reduces, the
    routed clip uses the whole-model norm, rank 0's history equals the reference."""
    _run_framework_job(mode, tmp_path, timeout=380)
    seen = json.loads((tmp_path / "0.json").read_text())
    _check_pre_clip(seen, 0.5 if mode == "hf-clip" else 0.0, world_size=2)
    other = json.loads((tmp_path / "1.json").read_text())
    assert other["references"] == pytest.approx(seen["references"], rel=1e-12)  # all-reduced


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_huggingface_trainer_under_deepspeed_is_pre_clip_and_exact(tmp_path: Path) -> None:
    """The Trainer under DeepSpeed ZeRO-2 (CPU, 2 gloo ranks), DeepSpeed clipping at 0.5: the
    callback collects inside engine.step(), before DeepSpeed's optimizer step clips, so every
    step's figure is the pre-clip norm of the averaged gradient (float64 reference of
    DeepSpeed's own full gradient), equal to the Trainer's logged grad_norm (DeepSpeed's norm),
    which the audit agrees with."""
    _run_framework_job("hf-deepspeed", tmp_path, timeout=380)
    seen = json.loads((tmp_path / "0.json").read_text())
    assert seen["wrapper"] == "DeepSpeedEngine" and seen["parallelism"] == "zero2x2"
    refs = seen["references"]
    assert len(refs) == 3 and any(r > 0.5 for r in refs)  # DeepSpeed's clip acted
    assert [step for step, _, _ in seen["history"]] == [1, 2, 3]
    for step, norm, clip_coef in seen["history"]:
        ref = refs[step - 1]
        assert abs(norm - ref) <= 1e-6 * ref, (step, norm, ref)  # pre-clip, exact
        assert abs(seen["logged"][str(step)] - norm) <= 1e-6 * norm  # DeepSpeed's own norm
        assert clip_coef is None  # gradwatch did not clip: DeepSpeed did
    ratio, disagreements = seen["audits"]["deepspeed"]
    assert disagreements == 0 and abs(ratio - 1) <= 1e-6


@pytest.mark.timeout(300)
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_lightning_callback_audits_lightnings_logged_norm(tmp_path: Path, factor: float) -> None:
    """A module logging Lightning's grad_norm (total entry) is audited against gradwatch's exact
    norm of the same step: silent when right, counted when the logged value is off."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import grad_norm
    from prometheus_client.parser import text_string_to_metric_families

    from gradwatch.integrations.lightning import GradWatchCallback

    class Module(_lightning_module()):
        def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
            norms = grad_norm(self, norm_type=2)
            norms["grad_2.0_norm_total"] = norms["grad_2.0_norm_total"] * factor
            self.log_dict(norms)

    seen: dict[str, float] = {}

    class Probe(GradWatchCallback):
        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert self.watch is not None and self.watch.flush()
            want = 0.0 if factor == 1.0 else 4.0
            deadline = time.monotonic() + 10  # self-stats render within the render interval
            while seen.get("gradwatch_norm_audit_disagreements_total") != want:
                if time.monotonic() > deadline:
                    break
                with urllib.request.urlopen(self.watch.metrics_url, timeout=5) as response:
                    text = response.read().decode()
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.labels.get("source") == "lightning":
                            seen[s.name] = s.value
                time.sleep(0.05)
            super().on_fit_end(trainer, pl_module)

    trainer = quiet_trainer(
        tmp_path,
        max_steps=4,
        devices=1,
        callbacks=[Probe(port=0)],
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(Regression(), batch_size=8))
    assert "log" not in module.__dict__  # the wrapper is removed at fit end
    # Every step's logged value was judged (the last at flush), each against its own step.
    assert seen["gradwatch_reported_norm_ratio"] == pytest.approx(factor, rel=1e-5)
    assert seen["gradwatch_norm_audit_disagreements_total"] == (0.0 if factor == 1.0 else 4.0)


class _NanOnThirdCall(RegressionModel):
    """The Hugging Face regression model whose third training forward returns a NaN loss."""

    calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = super().forward(x, labels)
        type(self).calls += 1
        if type(self).calls == 3:
            out["loss"] = out["loss"] * math.nan
        return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_huggingface_callback_guard_skips_the_nan_step(
    tmp_path: Path, max_grad_norm: float
) -> None:
    """``WatchConfig.guard``: the Trainer's optimizer steps through the guard, which skips the
    NaN step (weights stay finite); with clipping routed or not."""
    import transformers

    from gradwatch.export.history import read_history
    from gradwatch.integrations.huggingface import GradWatchCallback

    history = tmp_path / "gradwatch.jsonl"
    callback = GradWatchCallback(guard=True, history_path=str(history))
    args = training_args(tmp_path, max_steps=5, logging_steps=1, max_grad_norm=max_grad_norm)
    _NanOnThirdCall.calls = 0
    model = _NanOnThirdCall()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Regression(), callbacks=[callback]
    )
    trainer.train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    records = read_history(history)
    assert [r["guard_skipped"] for r in records] == [None, None, "nonfinite", None, None]
    assert records[-1]["skipped_steps"] == {"nonfinite": 1, "spike": 0}


@pytest.mark.timeout(300)
def test_lightning_callback_guard_skips_the_nan_step(tmp_path: Path) -> None:

    from gradwatch.export.history import read_history
    from gradwatch.integrations.lightning import GradWatchCallback

    class Module(_lightning_module()):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = super().training_step(batch, batch_idx)
            return loss * math.nan if batch_idx == 2 else loss

    history = tmp_path / "gradwatch.jsonl"
    trainer = quiet_trainer(
        tmp_path, max_steps=5, devices=1,
        callbacks=[GradWatchCallback(guard=True, history_path=str(history))],
    )
    module = Module()
    trainer.fit(module, torch.utils.data.DataLoader(Regression(), batch_size=8))
    assert all(torch.isfinite(p).all() for p in module.parameters())
    records = read_history(history)
    assert [r["guard_skipped"] for r in records] == [None, None, "nonfinite", None, None]
