"""The documented examples run unchanged with the monitor on and off.

Every ```python block of the README's Usage section and of docs/integrations.md is either run
here, in a subprocess once with ``GRADWATCH_ENABLED=1`` and once with ``GRADWATCH_ENABLED=0``,
or listed in ``SKIPPED`` with the reason (a new block fails the inventory until it is placed).
A prelude supplies only what an example leaves to the reader (``MyModel``, ``loader``, a
``watch`` built the way section 3 builds it); the example's own text is run as written, except
that a fixed port becomes 0 (a free one), so the test never collides with another job.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from gradwatch import GradWatch, WatchConfig

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_TIMEOUT = 300.0

_MODEL = """
import torch
from torch import nn
import gradwatch

class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.seed = nn.Linear(8, 1)

    def forward(self, batch):
        return self.seed(torch.tanh(self.backbone(batch))).pow(2).mean()

loader = [torch.randn(4, 8) for _ in range(3)]
"""

#: A model with gradients and ``watch`` built from the environment (section 3's way).
_WATCHED = _MODEL + """
model = MyModel()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
watch = gradwatch.watch(model, groups={"host": ["backbone.*"], "seed": ["seed.*"]})
model(loader[0]).backward()
"""

#: (file, index among its python blocks) -> (prelude, epilogue).
RUN: dict[tuple[str, int], tuple[str, str]] = {
    # the README's Usage: MyModel, loader and an optimizer are the reader's
    ("README.md", 0): (_MODEL + "opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)\n",
                       ""),
    ("docs/integrations.md", 0): ("", ""),  # 1. a plain loop: self-contained
    ("docs/integrations.md", 1): (_WATCHED, "watch.close()\n"),  # 2. clip and watch
    ("docs/integrations.md", 2): (  # 2b. adaptive clipping, a checkpoint of its state
        _MODEL + "model = MyModel()\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
        "from gradwatch import GradWatch, WatchConfig\nloss_fn = lambda loss: loss\n"
        "resuming, ckpt, save = False, {}, lambda state: None\n",
        "",
    ),
    ("docs/integrations.md", 9): ("", ""),  # 6b. your own sink: self-contained
    ("docs/integrations.md", 10): (  # 7. auditing a reported norm
        _WATCHED + "step = 0\nwatch.collect(step)\nreported = torch.tensor(1.0)\n",
        "watch.flush()\nwatch.close()\n",
    ),
    ("docs/integrations.md", 12): (  # 8. the optimizer-step guard
        _MODEL + "model = MyModel()\nfrom gradwatch import GradWatch, WatchConfig\n", ""
    ),
}

#: Blocks not run here, and why (each is run by the test named, or cannot run on this host).
SKIPPED: dict[tuple[str, int], str] = {
    ("docs/integrations.md", 3): "DeepSpeed ZeRO on 2 ranks: tests/distributed/test_zero.py",
    ("docs/integrations.md", 4): "torchrun train.py: tests/distributed/test_integrations.py",
    ("docs/integrations.md", 5): "AMP on CUDA: no CUDA here (docs/gpu.md)",
    ("docs/integrations.md", 6): "the Hugging Face Trainer: tests/distributed/test_integrations.py",
    ("docs/integrations.md", 7): "Lightning: tests/distributed/test_integrations.py",
    ("docs/integrations.md", 8): "tracker sinks need a run: tests/unit/export/test_sinks.py",
    ("docs/integrations.md", 11): "FSDP2 on 2 ranks: tests/distributed/test_audit_distributed.py",
}


def python_blocks(path: str) -> list[str]:
    """The ```python blocks of ``path`` (for the README: of its Usage section only)."""
    text = (ROOT / path).read_text()
    if path == "README.md":
        text = text.split("## Usage", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def example_sources() -> dict[str, str]:
    """Name -> the code to run: prelude, the block as written (a fixed port made 0), epilogue."""
    out: dict[str, str] = {}
    for (path, index), (prelude, epilogue) in RUN.items():
        block = python_blocks(path)[index]
        block = re.sub(r"port=\d+", "port=0", block)
        out[f"{path}#{index}"] = prelude + block + epilogue
    return out


_DRIVER = textwrap.dedent(
    """
    import json, sys, traceback
    results = {}
    for name, code in json.loads(sys.stdin.read()).items():
        try:
            exec(compile(code, name, "exec"), {"__name__": "__example__"})
            results[name] = None
        except BaseException:
            results[name] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))
    """
)


def run_examples(enabled: bool) -> dict[str, str | None]:
    """Every example in one subprocess (one torch import), each in its own namespace."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    env["GRADWATCH_ENABLED"] = "1" if enabled else "0"
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(example_sources()),
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT,
        env=env,
        cwd=ROOT,
        check=False,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line.removeprefix("RESULTS "))


def test_every_documented_example_is_run_or_skipped_with_a_reason() -> None:
    for path in ("README.md", "docs/integrations.md"):
        found = {(path, i) for i in range(len(python_blocks(path)))}
        placed = {k for k in (*RUN, *SKIPPED) if k[0] == path}
        assert found == placed, f"{path}: place every python block in RUN or SKIPPED"


@pytest.mark.timeout(2 * EXAMPLE_TIMEOUT + 60)
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_documented_examples_run_unchanged(enabled: bool) -> None:
    results = run_examples(enabled)
    assert set(results) == set(example_sources())
    failed = {name: tb for name, tb in results.items() if tb is not None}
    assert not failed, "\n".join(f"{n}:\n{tb}" for n, tb in failed.items())


# -- a disabled watcher's snapshots: the enabled one's keys, no figure --------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4)
        self.seed = nn.Linear(4, 1)
        self.head = nn.Linear(1, 1)  # matches no pattern: the group "other"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.seed(self.backbone(x))).sum()


def _config(enabled: bool) -> WatchConfig:
    return WatchConfig(
        enabled=enabled,
        groups={"host": ["backbone.*"], "seed": ["seed.*"]},
        ratios=[("seed", "host"), ("other", "seed")],
        isolated=["host"],
    )


def test_disabled_snapshot_has_the_enabled_keys_and_no_figure() -> None:
    model = _Net()
    model(torch.randn(3, 4)).backward()
    with GradWatch(model, _config(True)) as on:
        measured = on.collect(0).result()
    off = GradWatch(model, _config(False))
    assert off.last is None  # nothing collected yet, as an enabled watcher
    total = off.clip_grad_norm_(1e9, step=4)
    squares = (float(p.grad.double().pow(2).sum()) for p in model.parameters())
    reference = math.sqrt(math.fsum(squares))
    assert float(total) == pytest.approx(reference, rel=1e-6)  # torch's clip still runs
    snap = off.last
    assert snap is not None and snap.step == 4 and not snap.measured
    assert list(snap.groups) == list(measured.groups) == ["host", "seed", "other"]
    assert set(snap.ratios) == set(measured.ratios) == set(snap.raw_ratios)
    assert set(snap.isolation_violated) == set(measured.isolation_violated)
    figures = [snap.global_norm, snap.health, *snap.ratios.values(), *snap.raw_ratios.values()]
    figures += [g.norm for g in snap.groups.values()]
    assert all(math.isnan(x) for x in figures)
    assert all(v is None for v in snap.isolation_violated.values())
    assert snap.replica_divergence is None and snap.clip_coef is None
    assert not snap.nonfinite_step and not snap.exploding_step  # counted as nothing
    pending = off.collect(5)
    assert pending.result() is off.last and off.last.step == 5


def test_refused_watcher_snapshots_have_the_enabled_keys_too() -> None:
    from gradwatch.watcher import RefusedWatch

    model = _Net()
    refused = RefusedWatch(model, _config(True), RuntimeError("unsupported"))
    try:
        snap = refused.collect(3).result()
    finally:
        refused.close()
    assert refused.last is snap and not snap.measured and snap.parallelism == "refused"
    assert list(snap.groups) == ["host", "seed", "other"]
    assert set(snap.ratios) == {"seed/host", "other/seed"}
    assert math.isnan(snap.global_norm) and math.isnan(snap.ratios["seed/host"])
