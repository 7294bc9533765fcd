"""What ``gradwatch demo`` shows: while its job runs, a live table refreshed from scrapes on a
terminal and plain progress lines otherwise (pipes, CI); at the end, the summary lines. The
parent (:mod:`gradwatch.cli.demo`) owns the run; this module only draws it, with
:mod:`gradwatch.cli.render`'s parts (the ``gradwatch top`` table)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gradwatch.cli.demo_protocol import DemoOptions, LastStep, Summary
from gradwatch.cli.endpoint import EndpointView
from gradwatch.cli.render import (
    UNDEFINED,
    Trends,
    anomalies_text,
    fmt,
    fmt_ratio,
    isolation_text,
    render_view,
    updates_text,
)
from gradwatch.export import metrics as catalog

PHASE_TEXT = {
    "host": "host trains (seed not grown yet)",
    "seed": "seed trains, host frozen (no gradient reaches it)",
    "blend": "host and seed train together",
}


class Display:
    """Where the parent shows the run: a live table (terminal) or plain lines."""

    def __init__(self, console: Console, opts: DemoOptions) -> None:
        self.console = console
        self.opts = opts
        self.trends = Trends()
        self.url: str | None = None

    def status(self, message: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def update(self, view: EndpointView | None, error: str | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Stop any live output."""

    def phase(self, step: int | None) -> str:
        if step is None:
            return "-"
        return self.opts.phase(step)


class LiveDisplay(Display):
    """A rich ``Live`` table redrawn after every scrape."""

    def __init__(self, console: Console, opts: DemoOptions) -> None:
        super().__init__(console, opts)
        self._started = time.monotonic()
        self._message = "starting torchrun ..."
        self._view: EndpointView | None = None
        self._error: str | None = None
        self._live = Live(self._render(), console=console, refresh_per_second=8, transient=False)
        self._live.start()

    def _render(self) -> RenderableType:
        steps = self.opts.steps
        done = 0 if self._view is None or self._view.step is None else self._view.step + 1
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            Text("training", style="bold"),
            ProgressBar(total=steps, completed=done, width=40),
            Text(f"{done}/{steps} steps"),
            Text(f"{time.monotonic() - self._started:.0f}s", style="dim"),
        )
        parts: list[RenderableType] = [
            Text(f"gradwatch demo: {self.opts.nproc} ranks (torchrun, gloo, CPU)", style="bold"),
            Text(f"metrics: {self.url or '(starting)'}"),
            bar,
        ]
        if self._view is not None:
            phase = self.phase(self._view.step)
            parts.append(Text(f"phase: {phase}: {PHASE_TEXT.get(phase, '')}", style="cyan"))
            parts.append(render_view(self._view, self.trends))
        if self._error:
            parts.append(Text(f"endpoint: {self._error}", style="yellow"))
        parts.append(Text(self._message, style="dim"))
        return Group(*parts)

    def status(self, message: str) -> None:
        self._message = message
        self._live.update(self._render(), refresh=True)

    def update(self, view: EndpointView | None, error: str | None) -> None:
        if view is not None:
            self._view = view
            self.trends.add(view)
        self._error = error
        self._live.update(self._render(), refresh=True)

    def close(self) -> None:
        self._live.stop()


class PlainDisplay(Display):
    """Plain progress lines: at every tenth of the run and when an anomaly counter moves."""

    def __init__(self, console: Console, opts: DemoOptions) -> None:
        super().__init__(console, opts)
        self._next_milestone = 0
        self._counters: tuple[int, int, int] | None = None
        self._every = max(1, opts.steps // 10)
        self._last_error: str | None = None

    def status(self, message: str) -> None:
        self.console.print(message, soft_wrap=True, highlight=False)

    def update(self, view: EndpointView | None, error: str | None) -> None:
        if error and error != self._last_error:
            self.console.print(f"endpoint: {error}", soft_wrap=True, highlight=False)
        self._last_error = error
        if view is None or view.step is None:
            return
        counters = (view.nonfinite_steps, view.exploding_steps, _spike_count(view))
        if view.step >= self._next_milestone or counters != self._counters:
            self.console.print(self.line(view), soft_wrap=True, highlight=False)
            self._next_milestone = (view.step // self._every + 1) * self._every
            self._counters = counters

    def line(self, view: EndpointView) -> str:
        """One progress line: step, phase, norms, ratios, health, anomaly counters."""
        groups = " ".join(f"{g} {fmt(s.norm)}" for g, s in view.groups.items())
        ratios = " ".join(f"{k} {fmt_ratio(view, k)}" for k in view.ratios)
        isolation = isolation_text(view)
        updates = updates_text(view)
        return (
            f"step {view.step}/{self.opts.steps} [{self.phase(view.step)}] "
            f"global norm {fmt(view.global_norm)} | {groups} | {ratios} | "
            f"health {fmt(view.health, 3)} | {anomalies_text(view).plain}"
            + (f"; {isolation.plain}" if isolation is not None else "")
            + (f" | {updates.plain}" if updates is not None else "")
        )


def _spike_count(view: EndpointView) -> int:
    """Every spike counter of ``view`` summed: moves whenever a spike was published."""
    return view.global_spikes + sum(s.spikes for s in view.groups.values())


# -- the end of the run ---------------------------------------------------------------------


def _steps_text(steps: Sequence[int]) -> str:
    if not steps:
        return "0"
    shown = ", ".join(str(s) for s in steps[:20]) + (", ..." if len(steps) > 20 else "")
    return f"{len(steps)} (step{'s' if len(steps) > 1 else ''} {shown})"


def last_update_text(last: LastStep) -> str | None:
    """``updates at step 29: weight norm 12.3, update norm 0.0456, ratio 0.0037, stalled
    0%``: the last snapshot's whole-model update figures (``update_stats``); None without
    them. An update not measured at that step reads ``not measured``, an undefined ratio or
    fraction (NaN) ``undefined``."""
    if last.weight_norm is None:
        return None
    text = f"updates at step {last.step}: weight norm {fmt(last.weight_norm)}, "
    if last.update_norm is None:
        return text + "update not measured"
    ratio, stalled = last.update_ratio, last.stalled_fraction
    ratio_text = UNDEFINED if ratio is None or ratio != ratio else fmt(ratio)
    stalled_text = UNDEFINED if stalled is None or stalled != stalled else f"{stalled:.0%}"
    return (f"{text}update norm {fmt(last.update_norm)}, ratio {ratio_text}, "
            f"stalled {stalled_text}")


def summary_lines(
    opts: DemoOptions, summary: Summary, final: EndpointView | None, url: str
) -> list[str]:
    """The end-of-run summary: from the job's summary message and the final scrape."""
    seed_at, blend_at = opts.phases
    lines = [
        f"gradwatch demo finished: {summary.steps_run} steps on {summary.world_size} "
        f"ranks ({summary.parallelism}); phases: host 0-{seed_at - 1}, "
        f"seed {seed_at}-{blend_at - 1} (host frozen), blend {blend_at}-{opts.steps - 1}",
    ]
    last = summary.last
    if last is not None:
        groups = ", ".join(f"{g} {fmt(v)}" for g, v in last.groups.items())
        ratios = ", ".join(
            f"{k} {UNDEFINED if v != v and math.isfinite(last.global_norm) else fmt(v)}"
            for k, v in last.ratios.items()
        )
        lines.append(
            f"last step {last.step}: global norm {fmt(last.global_norm)}; {groups}; "
            f"{ratios}; health {fmt(last.health, 3)}"
        )
        update = last_update_text(last)
        if update is not None:
            lines.append(update)
    events = summary.events
    lines.append(f"non-finite steps: {_steps_text(events.nonfinite)}")
    for step, ranks in sorted(summary.nonfinite_origins.items()):
        lines.append(
            f"non-finite origin at step {step}: rank(s) {', '.join(map(str, ranks))} "
            "(local gradients before the all-reduce)"
        )
    lines.append(f"exploding steps: {_steps_text(events.exploding)} (non-finite included)")
    if events.amp_skipped:  # the demo uses no GradScaler; a job reusing this summary may
        lines.append(f"AMP-skipped steps: {_steps_text(events.amp_skipped)}")
    lines.append(f"spike steps: {_steps_text(events.spikes)} (adaptive spike detection)")
    if opts.guard:
        lines.append(
            f"guard-skipped steps: {_steps_text(events.skipped)} (optimizer update not applied)"
        )
    hmin = summary.health_min
    if hmin is not None:
        lines.append(f"health min: {fmt(hmin.value, 3)} at step {hmin.step}")
    for group, bad in summary.isolation_violation_steps.items():
        lines.append(f"isolation of {group}: {_steps_text(bad)} violating steps")
    if final is None:
        lines.append(f"endpoint {url}: no final scrape (the endpoint did not answer)")
        return lines
    lines.append(
        f"endpoint {url} (final scrape, step {final.step}): "
        f"{catalog.NONFINITE_STEPS_TOTAL.name} {final.nonfinite_steps}, "
        f"{catalog.EXPLODING_STEPS_TOTAL.name} {final.exploding_steps}, "
        f"{catalog.COLLECTIONS_TOTAL.name} {final.collections}, "
        f"{catalog.GLOBAL_GRAD_NORM_SPIKES_TOTAL.name} {final.global_spikes}"
        + "".join(
            f', {catalog.SKIPPED_STEPS_TOTAL.name}{{reason="{r}"}} {n}'
            for r, n in final.skipped_steps.items()
        )
        + "".join(
            f', {catalog.GRAD_NORM_SPIKES_TOTAL.name}{{group="{g}"}} {s.spikes}'
            for g, s in final.groups.items()
            if s.spikes
        )
    )
    updates = updates_text(final)
    if updates is not None:
        lines.append(f"endpoint: {updates.plain}")
    if final.nonfinite_origin:
        lines.append(
            f"endpoint: last non-finite origin (step {final.nonfinite_origin_step}): "
            + ", ".join(f"rank {r} ({h})" for r, h in final.nonfinite_origin)
        )
    return lines
