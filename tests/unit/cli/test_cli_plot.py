"""``gradwatch plot``: the real console script on a history written by HistoryWriter."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

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




def update_records() -> list[dict[str, Any]]:
    """Histories written with update_stats: the first collect has no update (None), step 4
    read a measured 0 (a skipped step), group ``b`` stalls (bf16-like) and its ratio is
    undefined (NaN) at step 6; the records go through the history file's encoding."""
    import json

    from gradwatch.export.history import decode_record, encode_record

    out = []
    for i in range(8):
        update = None if i == 0 else (0.0 if i == 4 else 0.01 * (i + 1))
        stalled_b = None if update is None else 0.5 + 0.05 * i
        ratio_b = None if update is None else (math.nan if i == 6 else 0.002 * i)
        snap = Snapshot(
            step=i, global_norm=1.0,
            groups={
                "a": GroupStats(norm=1.0, numel=10, tensors=1, weight_norm=3.0,
                                update_norm=update, update_ratio=None if update is None
                                else update / 3.0, stalled_fraction=None if update is None
                                else 0.0),
                "b": GroupStats(norm=1.0, numel=10, tensors=1, weight_norm=4.0,
                                update_norm=update, update_ratio=ratio_b,
                                stalled_fraction=stalled_b),
            },
            weight_norm=5.0 + i, update_norm=update,
            update_ratio=None if update is None else update / (5.0 + i),
            stalled_fraction=None if update is None else 0.25,
        )  # fmt: skip
        out.append(decode_record(json.loads(json.dumps(encode_record(snap.to_dict())))))
    return out


def lines_of(ax: Any) -> dict[str, list[float]]:
    return {line.get_label(): [float(v) for v in line.get_ydata()] for line in ax.get_lines()
            if not line.get_label().startswith("_")}  # fmt: skip


def test_plot_draws_the_update_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import PANELS, draw_history, render_history

    records = update_records()
    fig, summary = draw_history(records, width=8, height=9, dpi=40)
    assert summary.panels == ("norms", "ratios", "weights", "updates", "health")
    assert set(PANELS) >= set(summary.panels)
    weights, updates = fig.axes[2], fig.axes[3]
    assert weights.get_ylabel() == "weights, update" and weights.get_yscale() == "log"
    drawn = lines_of(weights)
    assert drawn["weight norm"] == [5.0 + i for i in range(8)]
    update = drawn["update norm"]
    assert math.isnan(update[0]) and math.isnan(update[4])  # None: a gap; 0: not on a log axis
    assert update[1:4] == pytest.approx([0.02, 0.03, 0.04])
    marked = next(line for line in weights.get_lines() if line.get_label() == "no update (1)")
    assert [float(x) for x in marked.get_xdata()] == [4.0]  # the measured 0 is marked
    ratios = lines_of(updates)
    assert set(ratios) == {"ratio model", "ratio a", "ratio b"}
    assert ratios["ratio model"][2] == pytest.approx(0.03 / 7.0)
    assert math.isnan(ratios["ratio b"][6]) and math.isnan(ratios["ratio b"][0])
    stalled_axis = [ax for ax in fig.axes if ax.get_ylabel() == "stalled fraction"]
    assert len(stalled_axis) == 1
    stalled = lines_of(stalled_axis[0])
    assert stalled["stalled b"][3] == pytest.approx(0.65)
    assert stalled["stalled a"][3] == 0.0 and stalled["stalled model"][5] == 0.25
    out = render_history(records, tmp_path / "u.png", width=8, height=9, dpi=40)
    assert out.panels == summary.panels and png_size(tmp_path / "u.png") == (320, 360)


def test_plot_without_update_figures_draws_no_update_panel() -> None:
    pytest.importorskip("matplotlib")
    from gradwatch.cli.plot import draw_history
    from gradwatch.cli.plot_updates import update_series

    records = update_records()
    for r in records:
        for key in ("weight_norm", "update_norm", "update_ratio", "stalled_fraction"):
            r[key] = None
            for stats in r["groups"].values():
                stats[key] = "0.5" if key == "weight_norm" else None  # not a figure: skipped
    assert update_series(records) is None
    assert draw_history(records, width=6, height=4, dpi=40)[1].panels == (
        "norms", "ratios", "health")
