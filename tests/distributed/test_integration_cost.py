"""What the framework callbacks cost the training thread in a warm step: no tensor made from
Python data on the device, no blocking host<->device copy, no scalar read of a tensor (counted with
gradwatch.testing's dispatch-mode counters on the CPU, the module's device stood in for by the
meta device so that anything Lightning or gradwatch would put on an accelerator shows)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from jobs.framework_ddp_job import Regression, quiet_trainer
from torch import nn

from gradwatch.doctor.testing import OpCounter, count_blocking_copies, count_host_reads


def _module(guarded_nan_at: int = -1) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(16, 8)
            self.seed = nn.Linear(8, 1)
            self.references: list[float] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            out = self.seed(torch.tanh(self.backbone(batch["x"])))
            loss = nn.functional.mse_loss(out, batch["labels"])
            return loss * math.nan if batch_idx == guarded_nan_at else loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("guard", [False, True])
def test_lightning_warm_steps_put_nothing_on_the_device_and_read_nothing(
    tmp_path: Path, guard: bool
) -> None:
    """Each warm optimizer step of the callback (log the ready figures, collect, and with
    ``guard`` the guarded step) makes no tensor from Python data on the module's device, no
    blocking copy and no host read; the figures reach Lightning's logged metrics as the float64
    reference of their step."""
    from gradwatch.integrations.lightning import GradWatchCallback

    counted: list[dict[str, Any]] = []
    references: dict[int, float] = {}

    class Probe(GradWatchCallback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # type: ignore[no-untyped-def]
            references[trainer.global_step] = math.sqrt(math.fsum(
                float(x) ** 2 for p in pl_module.parameters()
                for x in p.grad.double().flatten().tolist()))
            device = pl_module._device
            pl_module._device = torch.device("meta")  # what Lightning builds figures on
            try:
                with count_blocking_copies() as copies, OpCounter() as ops, \
                        count_host_reads() as reads:
                    super().on_before_optimizer_step(trainer, pl_module, optimizer)
            finally:
                pl_module._device = device
            # Here, before Lightning reads back what was put on the stand-in device.
            # One Python-built tensor at most: the step's figures, in host memory (Lightning
            # makes one per logged number, on the module's device).
            if trainer.global_step >= 2:
                assert copies.blocking_copies == 0, copies.describe()
                assert copies.python_tensors <= 1, copies.describe()
            counted.append({"step": trainer.global_step, "copies": copies.blocking_copies,
                            "python": copies.python_tensors, "seen": copies.describe(),
                            "scalar_reads": ops.scalar_reads, "host_reads": sum(reads.values()),
                            "logged": getattr(self, "_logged", None)})

    callback = Probe(guard=guard)
    trainer = quiet_trainer(tmp_path, max_steps=5, callbacks=[callback])
    trainer.fit(_module(), torch.utils.data.DataLoader(Regression(), batch_size=8))
    warm = [c for c in counted if c["step"] >= 2]
    assert len(warm) == 3
    for c in warm:
        assert c["copies"] == 0 and c["scalar_reads"] == 0, c
        # Bulk reads of host memory only: the norm engine's repair mask of CPU gradients
        # (gradwatch.stats: gradients on an accelerator need none) and the previous step's
        # landed result (and guard reading) when the publisher has not built its snapshot yet.
        assert c["host_reads"] <= (3 if guard else 2), c
        assert c["python"] <= 1, c  # one CPU tensor holds the step's figures, in host memory
        assert c["logged"] == c["step"] - 1, c  # the previous step's figures, logged once
    metrics = trainer.logged_metrics
    step = int(metrics["gradwatch/step"])
    assert step == 3 and metrics["gradwatch/global_grad_norm"].device.type == "cpu"
    got = float(metrics["gradwatch/global_grad_norm"])
    assert abs(got - references[step]) <= 1e-6 * references[step], (got, references)
