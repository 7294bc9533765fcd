"""Generate the documentation images in docs/img/ (run from the repository root).

* ``docs/img/plot.png``: ``gradwatch plot`` of a synthetic history written with
  :class:`gradwatch.export.history.HistoryWriter` from made-up snapshots that tell the demo's
  story: a
  "host" backbone trains alone (the "seed" module has no gradient: ratio 0), then the seed
  trains with the host frozen (isolated: the ratio is undefined, a gap), then both blend and
  the seed's share fades towards dormant; one step has a NaN gradient and one explodes.
  Deterministic (no randomness), so regenerating does not churn the file.
* ``docs/img/top.png``: the text of ``docs/img/top.txt`` (a captured ``gradwatch top`` screen,
  written by whoever captures it; ANSI colour codes are stripped) drawn in a monospace font on a
  dark background. Skipped, with a note, when the text file does not exist.

Usage: ``.venv/bin/python scripts/make_readme_images.py [--out docs/img]`` (needs the ``plot``
extra: matplotlib).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

from gradwatch import GroupStats, Snapshot
from gradwatch.analysis.summary import normalized_ratio
from gradwatch.cli.plot import load_records, render_history
from gradwatch.export.history import HistoryWriter

STEPS = 300
SEED_AT = 75  # the seed starts training, host frozen
BLEND_AT = 190  # host and seed train together
NAN_AT = 140
EXPLODE_AT = 240

# Parameter counts of the made-up model (for the normalized ratio).
NUMEL = {"host": 400_000, "seed": 20_000, "head": 5_000}

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def synthetic_snapshots() -> list[Snapshot]:
    """The story above as snapshots (plain numbers, as GradWatch would produce them)."""
    snaps = []
    for step in range(STEPS):
        t = step / STEPS
        wiggle = 1.0 + 0.15 * math.sin(step / 4.0) + 0.05 * math.cos(step / 1.7)
        host = 2.0 * math.exp(-1.5 * t) * wiggle
        seed = 0.0
        head = 0.3 * wiggle
        if SEED_AT <= step < BLEND_AT:  # the seed alone: host frozen, ratio undefined
            seed = 0.09 * wiggle * (1.0 + 0.5 * math.sin(step / 9.0))
            host = 0.0
        elif step >= BLEND_AT:  # blended: the seed's share fades towards dormant
            seed = host * 0.03 * math.exp(-(step - BLEND_AT) / 60) * (1 + 0.3 * math.sin(step / 7))
        exploding = {"host": 0, "seed": 0, "head": 0}
        nonfinite: tuple[str, ...] = ()
        if step == EXPLODE_AT:
            host *= 400.0
            exploding["host"] = 2
        norms = {"host": host, "seed": seed, "head": head}
        if step == NAN_AT:
            norms["seed"] = math.nan
            nonfinite = ("seed.proj.weight",)
        total = math.sqrt(sum(v * v for v in norms.values()))
        groups = {
            g: GroupStats(
                norm=v,
                numel=NUMEL[g] if v != 0.0 else 0,
                tensors=4 if v != 0.0 else 0,
                exploding=exploding[g] + (1 if g == "seed" and nonfinite else 0),
                nonfinite=1 if g == "seed" and nonfinite else 0,
            )
            for g, v in norms.items()
        }
        ratio = normalized_ratio(
            norms["seed"], groups["seed"].numel, norms["host"], groups["host"].numel
        )
        n_tensors = sum(s.tensors for s in groups.values()) or 1
        bad = sum(s.exploding for s in groups.values())
        health = 0.0 if nonfinite else max(0.0, min(1.0, 1.0 - 0.8 * bad / n_tensors))
        snaps.append(
            Snapshot(
                step=step,
                global_norm=math.nan if nonfinite else total,
                groups=groups,
                nonfinite_params=nonfinite,
                ratios={"seed/host": ratio},
                health=health,
                isolation_violated={"host": False},
                timestamp=1_700_000_000.0 + step,
            )
        )
    return snaps


def make_plot(out_dir: Path) -> Path:
    """docs/img/plot.png through the same code as ``gradwatch plot``."""
    with tempfile.TemporaryDirectory() as tmp:
        history = Path(tmp) / "history.jsonl"
        with HistoryWriter(history) as writer:
            for snap in synthetic_snapshots():
                writer.write(snap)
        records = load_records(history)
    out = out_dir / "plot.png"
    render_history(records, out, width=12, height=8, dpi=100)
    return out


def make_top(out_dir: Path, font_size: float = 11.0) -> Path | None:
    """docs/img/top.png from docs/img/top.txt (None when there is no text file)."""
    source = out_dir / "top.txt"
    if not source.exists():
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    text = _ANSI.sub("", source.read_text(encoding="utf-8")).expandtabs().rstrip("\n")
    lines = text.splitlines() or [""]
    cols = max(len(line) for line in lines)
    pad = 0.25  # inches
    char_w = 0.6 * font_size / 72  # DejaVu Sans Mono advance: 0.6 em
    line_h = 1.2 * font_size / 72
    width = cols * char_w + 2 * pad
    height = len(lines) * line_h + 2 * pad
    fig = Figure(figsize=(width, height), dpi=150, facecolor="#1e1e1e")
    FigureCanvasAgg(fig)
    fig.text(
        pad / width,
        1 - pad / height,
        "\n".join(lines),
        family="DejaVu Sans Mono",
        size=font_size,
        color="#d8d8d8",
        va="top",
        ha="left",
        linespacing=1.2,
    )
    out = out_dir / "top.png"
    fig.savefig(out, facecolor=fig.get_facecolor())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="output directory")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {make_plot(args.out)}")
    top = make_top(args.out)
    if top is None:
        print(f"skipped top.png: no {args.out / 'top.txt'} (capture a `gradwatch top` screen)")
    else:
        print(f"wrote {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
