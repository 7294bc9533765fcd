"""What ``gradwatch demo`` shows while its job runs: a live table refreshed from scrapes on a
terminal, plain progress lines otherwise (pipes, CI)."""

from __future__ import annotations

import time
from typing import Protocol

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gradwatch.cli.endpoint import EndpointView
from gradwatch.cli.phases import phase_of
from gradwatch.cli.render import (
    Trends,
    anomalies_text,
    fmt,
    fmt_ratio,
    isolation_text,
    render_view,
)


class RunSize(Protocol):
    """What a display reads of the demo's options."""

    nproc: int
    steps: int


PHASE_TEXT = {
    "host": "host trains (seed not grown yet)",
    "seed": "seed trains, host frozen (no gradient reaches it)",
    "blend": "host and seed train together",
}


class Display:
    """Where the parent shows the run: a live table (terminal) or plain lines."""

    def __init__(self, console: Console, opts: RunSize) -> None:
        self.console = console
        self.opts = opts
        self.trends = Trends()
        self.url: str | None = None
        self.phases: tuple[int, int] = (0, 0)

    def status(self, message: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def update(self, view: EndpointView | None, error: str | None) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Stop any live output."""

    def phase(self, step: int | None) -> str:
        if step is None:
            return "-"
        return phase_of(step, *self.phases)


class LiveDisplay(Display):
    """A rich ``Live`` table redrawn after every scrape."""

    def __init__(self, console: Console, opts: RunSize) -> None:
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

    def __init__(self, console: Console, opts: RunSize) -> None:
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
        return (
            f"step {view.step}/{self.opts.steps} [{self.phase(view.step)}] "
            f"global norm {fmt(view.global_norm)} | {groups} | {ratios} | "
            f"health {fmt(view.health, 3)} | {anomalies_text(view).plain}"
            + (f"; {isolation.plain}" if isolation is not None else "")
        )


def _spike_count(view: EndpointView) -> int:
    """Every spike counter of ``view`` summed: moves whenever a spike was published."""
    return view.global_spikes + sum(s.spikes for s in view.groups.values())
