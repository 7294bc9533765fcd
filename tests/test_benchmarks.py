"""The benchmark harness runs on tiny sizes and produces its tables (no timing assertions)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"


def _load_harness():  # type: ignore[no-untyped-def]
    # Importable as ``run`` from benchmarks/ (on sys.path, which spawn passes to its children),
    # because spawned distributed workers unpickle the worker function by module name.
    if str(RUN.parent) not in sys.path:
        sys.path.insert(0, str(RUN.parent))
    module = sys.modules.get("run")
    if module is not None and getattr(module, "__file__", None) == str(RUN):
        return module
    spec = importlib.util.spec_from_file_location("run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run"] = module
    spec.loader.exec_module(module)
    return module


def _rows(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return header, rows


def test_quick_harness_produces_tables(tmp_path: Path) -> None:
    import torch

    threads = torch.get_num_threads()
    harness = _load_harness()
    out = tmp_path / "perf.md"
    assert harness.main(["--quick", "--no-distributed", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # restored
    text = out.read_text()
    for heading in ("## Machine", "## Targets", "## Per-collect cost", "## Issue 2",
                    "## Issue 8 notes", "## Issue 6: clipping", "## Distributed",
                    "## Issue 4", "## Scrape latency", "## CUDA"):
        assert heading in text
    assert "Command: `python benchmarks/run.py --quick" in text
    header, rows = _rows(text, "| case | method |")
    assert header == harness.COLUMNS
    methods = {r[1].split(")")[0] + ")" for r in rows}
    assert {"(a)", "(b)", "(c)", "(d)", "(e)", "(f)"} <= methods
    for r in rows:
        assert float(r[2]) > 0  # time ms
        assert float(r[3]) > 0 and float(r[4]) > 0
        if not r[1].startswith("(f)"):
            assert float(r[5]) < 1e-2  # relative error vs float64
        int(r[6]), int(r[7])  # host syncs, ops
    header, rows = _rows(text, "| dtype | method | median ms | p25-p75 ms | x target")
    assert header[:6] == ["dtype", "method", "median ms", "p25-p75 ms", "x target baseline",
                          "rel err vs float64"]
    assert {r[0] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert float(r[2]) > 0
        assert float(r[5]) < 1e-2
    header, rows = _rows(text, "| dtype | method | median ms | p25-p75 ms | extra vs torch")
    assert len(rows) == 6
    header, rows = _rows(text, "| dtype | tensors | torch clip_grad_norm_")
    for r in rows:  # gradwatch's clip norm is the more exact one
        assert float(r[3]) <= float(r[2])
    header, rows = _rows(text, "| issue | target |")
    assert rows and all(r[3] in ("met", "**NOT MET**") for r in rows)
    assert re.search(r"skipped: `torch\.cuda\.is_available\(\)` is False|Device: ", text)
    header, rows = _rows(text, "| parameters | top-k |")
    assert [r[1] for r in rows] == ["50", "200"]


@pytest.mark.distributed
def test_quick_distributed_sections() -> None:
    harness = _load_harness()
    results: dict = {}
    table = harness.distributed([{"kind": "demo", "label": "demo"}],
                                {"ddp": 8, "fsdp2": 8}, results)
    header, rows = _rows(table, "| wrapper |")
    assert header[0] == "wrapper" and any("overhead" in h for h in header)
    assert [r[0] for r in rows] == ["ddp", "fsdp2"]
    for r in rows:
        assert not r[1].startswith("failed"), r
        assert float(r[3].split()[0]) > 0 and float(r[4].split()[0]) > 0, r
        assert float(r[6].split()[0]) > 0 and float(r[7].split()[0]) > 0, r  # the floors
        assert r[11].startswith("1 / ")  # one gradwatch collective per collect
    assert {"floor ddp demo all-reduce", "floor ddp demo read"} <= set(results)
    table = harness.scrapers_during_training(2, 0.3, 1, results)
    header, rows = _rows(table, "| scrapers |")
    assert rows[0][0] == "2" and int(rows[0][7].split()[0]) > 0  # scrapes were served
