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
    try:
        assert harness.main(["--quick", "--no-distributed", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    for heading in ("## Machine", "## Per-collect cost", "## Issue 2 targets",
                    "## Issue 8 targets", "## Scrape latency", "## CUDA"):
        assert heading in text
    assert "Command: `python benchmarks/run.py" in text
    header, rows = _rows(text, "| case | method |")
    assert header == harness.COLUMNS
    methods = {r[1].split(")")[0] + ")" for r in rows}
    assert {"(a)", "(b)", "(c)", "(d)", "(e)", "(f)"} <= methods
    for r in rows:
        assert float(r[2]) > 0  # time ms
        assert float(r[3]) > 0 and float(r[4]) > 0
    header, rows = _rows(text, "| dtype | method |")
    assert header[:5] == ["dtype", "method", "time ms", "x target baseline",
                          "max rel err vs float64"]
    assert {r[0] for r in rows} == {"float32", "bfloat16"}
    for r in rows:
        assert float(r[2]) > 0
        assert float(r[4]) < 1e-2
    assert re.search(r"skipped: torch\.cuda|CUDA is available", text)
    scrape = text.split("## Scrape latency", 1)[1]
    assert "skipped: exporter not available" in scrape or "| parameters | top-k |" in scrape


@pytest.mark.distributed
def test_quick_distributed_section(tmp_path: Path) -> None:
    harness = _load_harness()
    table = harness.distributed(width=16, depth=1, steps=4, results={})
    header, rows = _rows(table, "| wrapper |")
    assert header[0] == "wrapper" and "overhead" in header
    assert [r[0] for r in rows] == ["ddp", "fsdp2"]
    for r in rows:
        assert float(r[3]) > 0 and float(r[4]) > 0, r
        assert r[7] == "1"  # one gradwatch collective per collect
