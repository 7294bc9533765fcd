"""The building blocks of docs/performance.md: number formats, markdown tables, verdicts, the
links to the hand-written methods page, and the machine a run ran on."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from benchmarks.results import Timing


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:.3f}" if ms < 10 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def fmt_spread(t: Timing) -> str:
    lo, hi = t.quartiles
    return f"{fmt_ms(lo)}-{fmt_ms(hi)}"


def fmt_timing(t: Timing) -> str:
    """``median (p25-p75)`` in milliseconds."""
    return f"{fmt_ms(t.median)} ({fmt_spread(t)})"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "**NOT MET**"


#: The hand-written page that says how each section measures and why a target can be missed.
METHODS_PAGE = "benchmarks.md"


def anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def method_link(heading: str) -> str:
    """The line under a section: where docs/benchmarks.md says how it is measured."""
    return f"Method: [{METHODS_PAGE}]({METHODS_PAGE}#{anchor(heading)}).\n"


def machine() -> str:
    """The machine, for the report: CPU (``lscpu``), memory, versions, load."""
    import torch

    info: dict[str, str] = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except OSError:
        pass
    load = os.getloadavg()
    return "\n".join([
        f"* CPU (`lscpu`): {info.get('Model name', '?')}, {info.get('CPU(s)', os.cpu_count())} "
        f"logical CPUs ({info.get('Core(s) per socket', '?')} cores per socket, "
        f"{info.get('Thread(s) per core', '?')} thread(s) per core), "
        f"{info.get('Hypervisor vendor', 'no') + ' VM' if info.get('Hypervisor vendor') else ''}"
        f", {mem} RAM",
        f"* Python {platform.python_version()}, torch {torch.__version__}; threads: 1 per "
        "single-process case, 1 per rank",
        f"* load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    ])
