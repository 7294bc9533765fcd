"""torchrun job of tests/distributed/test_integrations.py: a framework trains a 2-rank DDP model
with the gradwatch callback, and each rank writes what the watcher saw to ``<out>/<rank>.json``.

Usage: ``torchrun --nproc_per_node=2 framework_ddp_job.py {huggingface|lightning|hf-clip|hf-noclip}
OUT``. The callbacks receive the unwrapped module while the framework trains its DDP wrapper.
``hf-clip``/``hf-noclip``: :func:`run_huggingface_clip` (also called in-process, 1 rank).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

GROUPS = {"host": ["backbone.*"], "seed": ["seed.*"]}


class Regression(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class RegressionModel(nn.Module):
    """A host backbone and a seed head, called the Hugging Face way (``labels`` in, a dict with
    the loss out)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(16, 8)
        self.seed = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.seed(torch.tanh(self.backbone(x)))
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def training_args(out_dir: Path, **settings: Any) -> Any:
    """Hugging Face ``TrainingArguments`` of a short CPU run, 8 examples per device, that
    writes nothing the tests do not read (no report, checkpoint or progress bar); ``settings``
    add to them."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=8, report_to=[], use_cpu=True,
        save_strategy="no", disable_tqdm=True, **settings,
    )


def quiet_trainer(root: Path, **settings: Any) -> Any:
    """A Lightning ``Trainer`` on CPU that writes and prints nothing the tests do not read (no
    logger, checkpoint, progress bar or model summary); ``settings`` add to it."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), **settings,
    )


def run_huggingface(out: Path) -> dict[str, Any]:
    import transformers

    from gradwatch.integrations.huggingface import GradWatchCallback

    seen: dict[str, Any] = {}

    class Probe(GradWatchCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            super().on_train_begin(*args, **kwargs)
            assert self.watch is not None
            seen["parallelism"] = self.watch.parallelism

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            assert self.watch is not None
            seen["world_size"] = self.watch.last.world_size if self.watch.last else None
            super().on_train_end(*args, **kwargs)

    args = training_args(out / "hf", max_steps=2, ddp_backend="gloo")
    trainer = transformers.Trainer(
        model=RegressionModel(),
        args=args,
        train_dataset=Regression(),
        callbacks=[Probe(groups=GROUPS)],
    )
    trainer.train()
    seen["wrapper"] = type(trainer.model_wrapped).__name__
    return seen


def _routing_callback(out: Path) -> tuple[Any, list[bool], Path]:
    """A Hugging Face callback writing this rank's history under ``out``, the list its
    ``on_train_begin`` appends to (whether it routed the Trainer's clip through gradwatch) and
    the history's path."""
    from gradwatch.integrations.huggingface import GradWatchCallback

    history = out / f"history-{os.environ.get('RANK', '0')}.jsonl"
    callback = GradWatchCallback(groups=GROUPS, history_path=str(history))
    routed: list[bool] = []
    original_begin = callback.on_train_begin

    def on_train_begin(*args: Any, **kwargs: Any) -> None:
        original_begin(*args, **kwargs)
        routed.append(callback.routed)

    callback.on_train_begin = on_train_begin  # type: ignore[method-assign]
    return callback, routed, history


def run_huggingface_clip(out: Path, max_grad_norm: float) -> dict[str, Any]:
    """Train with the callback and ``max_grad_norm``, recording a float64 reference of every
    step's pre-clip gradient norm (after backward, DDP's all-reduce included, before the
    Trainer clips), the Trainer's logged ``grad_norm`` and gradwatch's history; then train the
    same model without gradwatch. Returns the figures and the largest parameter difference."""
    import math

    import transformers

    from gradwatch.export.history import read_history

    references: list[float] = []

    class Recording(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            squares = (float(x) ** 2 for g in grads for x in g.double().flatten().tolist())
            references.append(math.sqrt(math.fsum(squares)))
            return loss

    def train(callbacks: list[Any], tag: str) -> tuple[Any, nn.Module]:
        torch.manual_seed(0)
        model = RegressionModel()
        args = training_args(
            out / tag, max_steps=3, logging_steps=1, learning_rate=0.5,
            ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
            max_grad_norm=max_grad_norm,
        )
        trainer = Recording(model=model, args=args, train_dataset=Regression(), callbacks=callbacks)
        trainer.train()
        return trainer, model

    callback, routed, history = _routing_callback(out)
    trainer, watched = train([callback], "watched")
    refs = list(references)
    references.clear()
    _, plain = train([], "plain")
    logged = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    records = read_history(history) if history.exists() else []
    diff = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(watched.parameters(), plain.parameters(), strict=True)
    )
    return {
        "references": refs,
        "plain_references": list(references),
        "logged": {str(k): v for k, v in logged.items()},
        "history": [[r["step"], r["global_norm"], r.get("clip_coef")] for r in records],
        "param_diff": diff,
        "routed": routed[0],
    }


def run_huggingface_deepspeed(out: Path) -> dict[str, Any]:
    """The Trainer under DeepSpeed ZeRO-2 on CPU (``DS_ACCELERATOR=cpu``, gloo, torch's Adam),
    clipping by DeepSpeed (``max_grad_norm`` -> ``gradient_clipping``): every step's float64
    reference of the averaged pre-clip gradient (DeepSpeed's full gradient, gathered in the
    engine's step before its optimizer step; here only), gradwatch's history, the Trainer's
    logged ``grad_norm`` (DeepSpeed's own norm) and the audit of it."""
    import math

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports DeepSpeed
    import deepspeed.comm.torch  # noqa: F401  (imported to replace its JIT-built CPU op)
    import transformers

    from gradwatch.export.history import read_history
    from gradwatch.integrations.huggingface import GradWatchCallback

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo carries everything
    from deepspeed.utils import safe_get_full_grad

    references: list[float] = []
    seen: dict[str, Any] = {}
    history = out / f"history-{os.environ.get('RANK', '0')}.jsonl"

    class Probe(GradWatchCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            super().on_train_begin(*args, **kwargs)
            assert self.watch is not None
            seen["parallelism"] = self.watch.parallelism
            engine = self.watch._resolved.zero.engine  # type: ignore[union-attr]
            wrapped = engine.step  # the callback's: collect, then DeepSpeed's step

            def step(*a: Any, **k: Any) -> Any:
                if engine.is_gradient_accumulation_boundary():
                    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
                    squares = (float(x) ** 2 for g in grads if g is not None
                               for x in g.double().flatten().tolist())
                    references.append(math.sqrt(math.fsum(squares)))
                return wrapped(*a, **k)

            engine.step = step

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            assert self.watch is not None
            self.watch.flush()
            stats = self.watch._reporter.stats
            # rank 0 publishes: DeepSpeed's norm audited against gradwatch's, per step
            seen["audits"] = None if stats is None else {
                src: list(v) for src, v in stats._audits.items()}
            super().on_train_end(*args, **kwargs)

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": 2},
    }
    torch.manual_seed(0)
    args = training_args(
        out / "hf-ds", max_steps=3, logging_steps=1, learning_rate=0.5, ddp_backend="gloo",
        max_grad_norm=0.5, deepspeed=ds_config,
    )
    callback = Probe(groups=GROUPS, history_path=str(history))
    trainer = transformers.Trainer(model=RegressionModel(), args=args,
                                   train_dataset=Regression(), callbacks=[callback])
    trainer.train()
    records = read_history(history) if history.exists() else []
    seen.update(
        references=references,
        logged={str(h["step"]): h["grad_norm"] for h in trainer.state.log_history
                if "grad_norm" in h},
        history=[[r["step"], r["global_norm"], r.get("clip_coef")] for r in records],
        wrapper=type(trainer.model_wrapped).__name__,
    )
    return seen


def run_huggingface_fsdp1(out: Path, use_orig_params: bool) -> dict[str, Any]:
    """The Trainer under FSDP1 (``fsdp_config={"version": 1}``, gloo, CPU), clipping at 0.5:
    every step's float64 reference of the full pre-clip gradient (every rank's shard gathered
    here, after backward, before the Trainer clips), gradwatch's history, the Trainer's logged
    ``grad_norm`` and whether the clip was routed through gradwatch."""
    import math

    import torch.distributed as dist
    import transformers

    from gradwatch.export.history import read_history

    references: list[float] = []
    post: list[float] = []

    def full_norm(model: nn.Module) -> float:
        local = [float(x) for p in model.parameters() if p.grad is not None
                 for x in p.grad.detach().double().flatten().tolist()]
        shards: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(shards, local)
        return math.sqrt(math.fsum(x * x for shard in shards for x in shard))

    class Recording(transformers.Trainer):
        def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            references.append(full_norm(self.model))
            return loss

    class PostClip(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            post.append(full_norm(trainer.model))

    callback, routed, history = _routing_callback(out)
    torch.manual_seed(0)
    args = training_args(
        out / "hf-fsdp1", max_steps=3, logging_steps=1, learning_rate=0.5, ddp_backend="gloo",
        max_grad_norm=0.5, fsdp="full_shard",
        fsdp_config={"version": 1, "use_orig_params": use_orig_params,
                     "sync_module_states": False},  # True needs an accelerator device
    )
    trainer = Recording(model=RegressionModel(), args=args, train_dataset=Regression(),
                        callbacks=[callback, PostClip()])
    trainer.train()
    records = read_history(history) if history.exists() else []
    return {
        "references": references,
        "post_clip": post,
        "logged": {str(h["step"]): h["grad_norm"] for h in trainer.state.log_history
                   if "grad_norm" in h},
        "history": [[r["step"], r["global_norm"], r.get("clip_coef")] for r in records],
        "wrapper": type(trainer.model_wrapped).__name__,
        "routed": routed[0],
    }


def run_huggingface_after_a_raise(out: Path) -> dict[str, Any]:
    """A Trainer whose forward raises at its second step on every rank (its callback's
    on_train_end never runs), then a new Trainer and a new callback on the same fixed port
    (``GRADWATCH_TEST_PORT``), clipping at 0.5: what the second run measured and logged."""
    import transformers

    from gradwatch.integrations.huggingface import GradWatchCallback

    port = int(os.environ["GRADWATCH_TEST_PORT"])

    class Failing(RegressionModel):
        calls = 0

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            type(self).calls += 1
            if type(self).calls == 2:
                raise RuntimeError("forward failed")
            return super().forward(x, labels)

    def train(model: nn.Module, callback: Any, tag: str, steps: int) -> Any:
        args = training_args(out / tag, max_steps=steps, logging_steps=1, learning_rate=0.5,
                             ddp_backend="gloo", max_grad_norm=0.5)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Regression(),
                                       callbacks=[callback])
        trainer.train()
        return trainer

    first = GradWatchCallback(groups=GROUPS, port=port)
    raised = False
    try:
        train(Failing(), first, "first", 3)
    except RuntimeError:
        raised = True
    stale = first.watch
    seen: dict[str, Any] = {"raised": raised, "stale_open": stale is not None}
    urls: list[Any] = []

    class Second(GradWatchCallback):
        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            super().on_train_begin(*args, **kwargs)
            assert self.watch is not None
            urls.append(self.watch.metrics_url)

        def on_train_end(self, *args: Any, **kwargs: Any) -> None:
            assert self.watch is not None
            seen["history"] = self.watch.last.global_norm if self.watch.last else None
            super().on_train_end(*args, **kwargs)

    torch.manual_seed(1)
    trainer = train(RegressionModel(), Second(groups=GROUPS, port=port), "second", 3)
    seen.update(
        stale_closed=stale is not None and stale._closed,
        url=urls[0] if urls else None,
        logged=[h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
    )
    return seen


def run_lightning(out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from gradwatch.integrations.lightning import GradWatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(16, 8)
            self.seed = nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self.seed(torch.tanh(self.backbone(batch["x"])))
            return nn.functional.mse_loss(out, batch["labels"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    seen: dict[str, Any] = {}

    class Probe(GradWatchCallback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            super().on_fit_start(trainer, pl_module)
            assert self.watch is not None
            seen["parallelism"] = self.watch.parallelism
            seen["wrapper"] = type(trainer.strategy.model).__name__

        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            assert self.watch is not None
            seen["world_size"] = self.watch.last.world_size if self.watch.last else None
            super().on_fit_end(trainer, pl_module)

    trainer = quiet_trainer(out / "pl", max_steps=2, devices=2, strategy="ddp",
                            callbacks=[Probe(groups=GROUPS)])
    trainer.fit(Module(), torch.utils.data.DataLoader(Regression(), batch_size=8))
    return seen


def main() -> None:
    framework, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    run = {
        "huggingface": run_huggingface,
        "lightning": run_lightning,
        "hf-clip": lambda o: run_huggingface_clip(o, 0.5),
        "hf-noclip": lambda o: run_huggingface_clip(o, 0.0),
        "hf-deepspeed": run_huggingface_deepspeed,
        "hf-fsdp1": lambda o: run_huggingface_fsdp1(o, use_orig_params=False),
        "hf-after-raise": run_huggingface_after_a_raise,
        "hf-fsdp1-orig": lambda o: run_huggingface_fsdp1(o, use_orig_params=True),
    }[framework]
    try:
        seen = run(out)
        Path(out, f"{os.environ['RANK']}.json").write_text(json.dumps(seen))
    finally:
        # As a torchrun script should: the frameworks leave the default group to the script, and
        # gloo groups still alive at interpreter exit can abort the process there.
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
