"""``gradwatch plot``: the real console script on a history written by HistoryWriter."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch import GroupStats, Snapshot
from gradwatch.export.history import HistoryWriter, rotated_path

TIMEOUT = 120


def run(
    *args: str, prelude: str = "", extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``gradwatch ARGS`` in a fresh interpreter (``prelude`` runs first, e.g. to hide a module;
    ``extra_env`` is added to the environment)."""
    code = f"{prelude}\nfrom gradwatch.cli.main import main\nmain()"
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"} | (extra_env or {})
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG signature and IHDR chunk (no imaging library needed)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def write_history(path: Path, steps: range, max_bytes: int = 64 * 1024 * 1024) -> None:
    """Healthy steps, a NaN step (7), an AMP-skipped Inf step (9), an exploding step (12), a
    dormant ratio of 0. As GradWatch counts them, a non-finite parameter is exploding too."""
    with HistoryWriter(path, max_bytes=max_bytes) as writer:
        for i in steps:
            norm, exploding, bad = 1.0 + 0.2 * math.sin(i / 3), 0, ()
            if i == 7:
                norm, exploding, bad = math.nan, 1, ("host.w",)
            if i == 9:
                norm, exploding, bad = math.inf, 1, ("host.w",)
            if i == 12:
                norm, exploding = 400.0, 1
            seed = 0.0 if i < 3 else 0.1 * norm
            host = GroupStats(
                norm=norm, numel=100, tensors=2, exploding=exploding, nonfinite=len(bad)
            )
            writer.append(
                Snapshot(
                    step=i,
                    global_norm=norm,
                    groups={"host": host, "seed": GroupStats(norm=seed, numel=10, tensors=1)},
                    ratios={"seed/host": 0.0 if i < 3 else (math.nan if bad else 0.12)},
                    nonfinite_params=bad,
                    health=0.0 if bad else (0.6 if exploding else 1.0),
                    amp_skipped=i == 9,
                    # the optimizer-step guard skipped the NaN step
                    guard_skipped="nonfinite" if i == 7 else None,
                    consecutive_skipped_steps=int(i == 7),
                    skipped_steps={"nonfinite": int(i >= 7), "spike": 0},
                )
            )


def test_plot_history_with_truncated_last_line(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    write_history(history, range(20))
    with open(history, "ab") as fh:
        fh.write(b'{"step": 20, "global_norm": 1.0, "gro')  # a crash mid-write
    out = tmp_path / "plots" / "out.png"
    proc = run("plot", str(history), "-o", str(out), "--width", "6", "--height", "4", "--dpi", "50")
    assert proc.returncode == 0, proc.stderr
    assert png_size(out) == (6 * 50, 4 * 50)
    # Snapshot's classification, as the Prometheus counters count: the NaN step 7 is non-finite
    # and exploding; the AMP-skipped Inf step 9 is not non-finite but is exploding; 12 explodes.
    assert "20 snapshots" in proc.stdout and "1 non-finite" in proc.stdout
    assert "3 exploding" in proc.stdout and "1 AMP-skipped" in proc.stdout
    assert "1 guard-skipped" in proc.stdout


def test_default_size_and_rotated_file_read_first(tmp_path: Path) -> None:
    history = tmp_path / "h.jsonl"
    write_history(history, range(200), max_bytes=8192)
    assert rotated_path(history).exists()
    proc = run("plot", str(history))  # -o defaults to h.png
    assert proc.returncode == 0, proc.stderr
    assert png_size(tmp_path / "h.png") == (12 * 100, 8 * 100)
    assert "-199" in proc.stdout  # the last step is there


@pytest.mark.parametrize("kind", ["missing", "empty", "garbage"])
def test_missing_or_empty_history_exits_2(tmp_path: Path, kind: str) -> None:
    history = tmp_path / "h.jsonl"
    if kind == "empty":
        history.write_text("")
    elif kind == "garbage":
        history.write_text('{"no": "step"}\nnot json\n{"step": "x"}\n')
    out = tmp_path / "o.png"
    proc = run("plot", str(history), "-o", str(out))
    assert proc.returncode == 2
    assert str(history) in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_without_matplotlib_exits_2_with_the_extra_named(tmp_path: Path) -> None:
    history = tmp_path / "h.jsonl"
    write_history(history, range(3))
    proc = run("plot", str(history), prelude="import sys; sys.modules['matplotlib'] = None")
    assert proc.returncode == 2
    assert "gradwatch[plot]" in proc.stderr and "Traceback" not in proc.stderr


# -- ratio bands from the job's configuration ---------------------------------------------------


def test_bands_come_from_the_configured_ratios(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import configured_bands, load_records, render_history

    history = tmp_path / "h.jsonl"
    write_history(history, range(20))
    records = load_records(history)
    monkeypatch.delenv("GRADWATCH_RATIOS", raising=False)
    assert configured_bands() == {}
    default = render_history(records, tmp_path / "a.png", width=4, height=3, dpi=40)
    assert default.bands == {"seed/host": (0.05, 0.2, 0.01)}  # the host/seed defaults
    monkeypatch.setenv(
        "GRADWATCH_RATIOS",
        '[{"numerator": "seed", "denominator": "host", "low": 0.3, "high": 3, "dormant": 0.1}]',
    )
    bands = configured_bands()
    assert bands == {"seed/host": (0.3, 3.0, 0.1)}
    drawn = render_history(records, tmp_path / "b.png", width=4, height=3, dpi=40, bands=bands)
    assert drawn.bands == {"seed/host": (0.3, 3.0, 0.1)}
    assert png_size(tmp_path / "b.png") == (160, 120)


def test_plot_with_configured_bands_and_a_bad_band(tmp_path: Path) -> None:
    history = tmp_path / "h.jsonl"
    write_history(history, range(20))
    out = tmp_path / "o.png"
    good = '[["seed", "host"], {"numerator": "host", "denominator": "seed", "low": 2, "high": 9}]'
    proc = run("plot", str(history), "-o", str(out), extra_env={"GRADWATCH_RATIOS": good})
    assert proc.returncode == 0, proc.stderr
    bad = '[{"numerator": "seed", "denominator": "host", "low": 0.3, "high": 0.2}]'
    proc = run("plot", str(history), "-o", str(tmp_path / "x.png"),
               extra_env={"GRADWATCH_RATIOS": bad})
    assert proc.returncode == 2
    assert "GRADWATCH_RATIOS" in proc.stderr and "low" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x.png").exists()


