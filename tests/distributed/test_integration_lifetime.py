"""The framework callbacks bind to the model of each run and never outlive it: a run whose
training raised is closed (port freed) before the next run, which watches and clips its own
model, whether the callback is reused or a new one takes the same port."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs.framework_ddp_job import Regression, RegressionModel, quiet_trainer, training_args
from promserver import free_port
from torch import nn


def ref_norm(tensors: Any) -> float:
    """Independent float64 reference: fsum of exact squares."""
    return math.sqrt(
        math.fsum(float(x) ** 2 for t in tensors for x in t.detach().double().flatten().tolist())
    )


class _Loud(RegressionModel):
    """Gradients about 10x the regression's (the clip at 1.0 acts every step); the forward
    raises on call ``fail_at`` (0: never)."""

    def __init__(self, seed: int, fail_at: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("forward failed")
        out = super().forward(x, labels)
        return {**out, "loss": out["loss"] * 100.0}


def _hf_train(tmp_path: Path, model: nn.Module, callback: Any, max_steps: int) -> dict:
    """Train with the Trainer's clip at 1.0; record every step's float64 pre-clip reference,
    the post-clip norm and the Trainer's logged grad_norm."""
    import transformers

    seen: dict[str, list[float]] = {"pre": [], "post": [], "logged": []}

    class Recording(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            seen["pre"].append(ref_norm([p.grad for p in self.model.parameters()]))
            return loss

    class PostClip(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any):
            seen["post"].append(ref_norm([p.grad for p in model.parameters()]))

    args = training_args(tmp_path, max_steps=max_steps, logging_steps=1, max_grad_norm=1.0)
    trainer = Recording(
        model=model, args=args, train_dataset=Regression(), callbacks=[callback, PostClip()]
    )
    try:
        trainer.train()
    finally:
        seen["logged"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return seen


def _check_clipped(seen: dict) -> None:
    assert len(seen["pre"]) == 3 and all(r > 1.0 for r in seen["pre"])
    for post in seen["post"]:
        assert post <= 1.0 + 1e-5, seen  # the new model is clipped
    for logged, pre in zip(seen["logged"], seen["pre"], strict=True):
        assert abs(logged - pre) <= 1e-6 * pre, seen  # the pre-clip total, never 0.0


@pytest.mark.timeout(300)
def test_huggingface_callback_reused_after_a_raise_clips_the_new_model(tmp_path: Path) -> None:
    from gradwatch.integrations.huggingface import GradWatchCallback

    callback = GradWatchCallback(port=0)
    with pytest.raises(RuntimeError, match="forward failed"):
        _hf_train(tmp_path / "a", _Loud(seed=0, fail_at=2), callback, max_steps=3)
    stale = callback.watch
    assert stale is not None and callback.routed  # the Trainer never called on_train_end
    seen = _hf_train(tmp_path / "b", _Loud(seed=1), callback, max_steps=3)
    assert stale._closed
    _check_clipped(seen)
    assert callback.watch is None and not callback.routed


@pytest.mark.timeout(300)
def test_huggingface_new_callback_takes_the_port_of_a_run_that_raised(tmp_path: Path) -> None:
    from gradwatch.integrations.huggingface import GradWatchCallback

    port = free_port()
    first = GradWatchCallback(port=port)
    with pytest.raises(RuntimeError, match="forward failed"):
        _hf_train(tmp_path / "a", _Loud(seed=0, fail_at=2), first, max_steps=3)
    stale = first.watch
    assert stale is not None and stale.metrics_url is not None
    urls: list[str | None] = []

    class Second(GradWatchCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            super().on_train_begin(*args, **kwargs)
            assert self.watch is not None
            urls.append(self.watch.metrics_url)

    seen = _hf_train(tmp_path / "b", _Loud(seed=1), Second(port=port), max_steps=3)
    assert stale._closed and first.watch is None and not first.routed
    assert len(urls) == 1 and urls[0] is not None and urls[0].endswith(f":{port}/metrics")
    _check_clipped(seen)
    with pytest.raises(urllib.error.URLError):  # nothing claims to be collecting any more
        urllib.request.urlopen(stale.metrics_url, timeout=2)


def _lightning_module(fail_at: int) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(16, 8)
            self.seed = nn.Linear(8, 1)
            self.references: list[float] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx + 1 == fail_at:
                raise RuntimeError("step failed")
            out = self.seed(torch.tanh(self.backbone(batch["x"])))
            return nn.functional.mse_loss(out, batch["labels"])

        def on_before_optimizer_step(self, optimizer) -> None:  # type: ignore[no-untyped-def]
            self.references.append(ref_norm([p.grad for p in self.parameters()]))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reuse", [True, False])
def test_lightning_callback_after_a_raise_watches_the_new_module(
    tmp_path: Path, reuse: bool
) -> None:
    """Reused or new on the same port: the run that raised is closed, the next one measures its
    own module (each step against the float64 reference)."""
    from gradwatch.integrations.lightning import GradWatchCallback

    port = free_port()
    measured: list[float] = []

    class Probe(GradWatchCallback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
            assert self.watch is not None and self.watch.last is not None
            measured.append(self.watch.last.global_norm)

    first = Probe(port=port)
    loader = torch.utils.data.DataLoader(Regression(), batch_size=8)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="step failed"):
        quiet_trainer(tmp_path, max_steps=4, callbacks=[first]).fit(_lightning_module(3), loader)
    stale = first.watch
    measured.clear()
    second = first if reuse else Probe(port=port)
    torch.manual_seed(1)
    module = _lightning_module(0)
    quiet_trainer(tmp_path, max_steps=3, callbacks=[second]).fit(module, loader)
    assert first.watch is None and stale is None  # closed by on_exception
    assert len(module.references) == 3
    for got, ref in zip(measured, module.references, strict=True):
        assert abs(got - ref) <= 1e-6 * ref, (measured, module.references)


FRAMEWORK_JOB = Path(__file__).resolve().parents[1] / "helpers" / "jobs" / "framework_ddp_job.py"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_huggingface_new_callback_same_port_after_a_raise_on_two_ranks(tmp_path: Path) -> None:
    """2 gloo ranks: the Trainer's forward raises on every rank, then a new Trainer with a new
    callback on the same port trains: rank 0 binds the port (no PortInUseError, rank 1 does not
    lose its peer), the stale watcher is closed on both, the Trainer logs real pre-clip norms
    and gradwatch's last figure is the last logged one, the same on both ranks."""
    import json
    import os
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "GRADWATCH_TEST_PORT": str(port)}
    env.pop("GRADWATCH_PORT", None)
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--max_restarts=0", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
            str(FRAMEWORK_JOB), "hf-after-raise", str(tmp_path),
        ],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for res in seen:
        assert res["raised"] and res["stale_open"] and res["stale_closed"], res
        assert len(res["logged"]) == 3 and all(v > 0 for v in res["logged"]), res
        assert abs(res["history"] - res["logged"][-1]) <= 1e-12 * res["history"], res
    assert seen[0]["url"].endswith(f":{port}/metrics") and seen[1]["url"] is None
    assert seen[0]["logged"] == seen[1]["logged"]
