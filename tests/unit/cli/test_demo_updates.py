"""``gradwatch demo`` shows the optimizer-update figures (its job turns ``update_stats`` on):
the plain progress lines, the end-of-run summary (the job's last snapshot and the final
scrape), and the job's record of them."""

from __future__ import annotations

import io
import math
from pathlib import Path

from rich.console import Console

from gradwatch import GroupStats, Snapshot
from gradwatch.cli.demo_protocol import DemoOptions, Summary, Workdir
from gradwatch.cli.demo_view import PlainDisplay, last_update_text, summary_lines
from gradwatch.cli.endpoint import parse_exposition

BASE = (
    "gradwatch_step 7\n"
    "gradwatch_global_grad_norm 1.5\n"
    'gradwatch_grad_norm{group="host"} 1.0\n'
    "gradwatch_health_score 1.0\n"
)
UPDATES = (
    'gradwatch_update_ratio{group="host"} 0.001\n'
    'gradwatch_update_ratio{group="seed"} NaN\n'
    'gradwatch_stalled_update_fraction{group="host"} 0.0\n'
    'gradwatch_stalled_update_fraction{group="seed"} 0.95\n'
)


def snapshot(step: int, update: float | None) -> Snapshot:
    return Snapshot(
        step=step, global_norm=1.5, groups={"host": GroupStats(norm=1.0, numel=4, tensors=1)},
        weight_norm=12.5, update_norm=update,
        update_ratio=None if update is None else update / 12.5,
        stalled_fraction=None if update is None else math.nan,
    )  # fmt: skip


def test_progress_lines_show_the_update_figures_when_the_endpoint_has_them() -> None:
    display = PlainDisplay(Console(file=io.StringIO()), DemoOptions(steps=30))
    with_updates = display.line(parse_exposition(BASE + UPDATES))
    assert with_updates.endswith(
        " | updates: ratio host 0.001, seed undefined; stalled host 0%, seed 95%"
    ), with_updates
    assert "updates" not in display.line(parse_exposition(BASE))


def test_the_summary_shows_the_last_update_and_the_final_scrape() -> None:
    summary = Summary()
    summary.add(snapshot(0, None))
    assert last_update_text(summary.last) == (  # type: ignore[arg-type]
        "updates at step 0: weight norm 12.5, update not measured"
    )
    summary.add(snapshot(1, 0.05))
    opts = DemoOptions(steps=2)
    lines = summary_lines(opts, summary, parse_exposition(BASE + UPDATES), "http://x/metrics")
    assert "updates at step 1: weight norm 12.5, update norm 0.05, ratio 0.004, stalled " \
        "undefined" in lines, lines
    assert ("endpoint: updates: ratio host 0.001, seed undefined; stalled host 0%, seed 95%"
            in lines), lines  # fmt: skip
    plain = Summary()
    plain.add(Snapshot(step=0, global_norm=1.0))
    without = summary_lines(opts, plain, parse_exposition(BASE), "http://x/metrics")
    assert not [line for line in without if "update" in line], without


def test_the_jobs_record_keeps_the_update_figures(tmp_path: Path) -> None:
    summary = Summary()
    summary.add(snapshot(3, 0.05))
    work = Workdir(tmp_path)
    work.write(summary)
    read = work.read(Summary)
    assert read is not None and read.last is not None
    assert (read.last.weight_norm, read.last.update_norm) == (12.5, 0.05)
    assert read.last.update_ratio == 0.004 and math.isnan(read.last.stalled_fraction or 0.0)

