"""DeepSpeed support never imports DeepSpeed: importing gradwatch (and building a watcher of a
plain module) leaves it unimported, and without it nothing is taken for an engine."""

from __future__ import annotations

import subprocess
import sys

from torch import nn

from gradwatch.stacks.zero import find_engine, is_engine


def test_importing_gradwatch_never_imports_deepspeed() -> None:
    code = (
        "import sys, gradwatch, gradwatch.watcher, gradwatch.stacks.zero\n"
        "from gradwatch import GradWatch, WatchConfig\n"
        "import torch\n"
        "w = GradWatch(torch.nn.Linear(2, 2), WatchConfig())\n"
        "w.close()\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_nothing_is_an_engine_without_deepspeed_imported(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    model = nn.Linear(2, 2)
    assert not is_engine(model)
    assert find_engine(model) is None
