"""``gradwatch demo``: a 2-rank torchrun training job watched by gradwatch, shown live.

The parent (this module) launches ``python -m torch.distributed.run --standalone
--nproc_per_node N -m gradwatch.cli.demo_job`` (gloo, CPU; the job and its phases are described
in :mod:`gradwatch.cli.demo_job`) and shows what the job's metrics endpoint says, by scraping it
with the same code as ``gradwatch top`` (:mod:`gradwatch.cli.endpoint`, drawn by
:mod:`gradwatch.cli.render`): it sees the run as Prometheus would, not through a side channel.
Everything else the parent and the job say to each other (the job's command line, the ready,
error and summary messages, the ack) is typed in :mod:`gradwatch.cli.demo_protocol`, with the
defaults both sides share.

Design choices:

* **Learning the endpoint.** Rank 0 writes the ready message (the metrics URL, the real port
  when ``--port 0``) into a private temporary directory passed to the job, and an error message
  if it cannot serve. A taken ``--port`` is found before torchrun starts (a bind test), and if
  it is taken in the meantime, rank 0's ``PortInUseError`` is reported the same way: a message
  naming the port and ``--port``, exit status 2.
* **Output.** torchrun's and the ranks' output goes to ``job.log`` in that directory (it would
  tear the live table apart); its last lines are printed if the job fails. On a terminal the
  parent shows a live table (progress bar, phase, norms with trends, ratio, health, anomaly
  counters, URL) refreshed from scrapes every ``REFRESH`` seconds; otherwise (pipes, CI) it
  prints a plain line at every tenth of the run and whenever an anomaly counter moves.
* **Injected steps are seen reliably.** The job pauses ``DEFAULT_ANOMALY_PAUSE`` s after an
  injected step, so the live view shows its NaN/huge norms; the counters keep them anyway. The
  summary comes from the job's summary message, which rank 0 builds from every snapshot it saw
  (a scrape can miss a step; the job cannot), plus a final scrape of the counters: rank 0 keeps
  serving until the parent has made that scrape (the ack), so the summary shows what the
  endpoint reported too. Both classify steps with :class:`gradwatch.Snapshot`, so they agree.
* **Pace.** The demo model is small (~0.55M parameters, one thread per rank), so a step is
  quick; ``--step-sleep`` slows it so a person can follow the table. Starting torchrun's ranks
  (Python processes importing torch) is a fixed cost of every run, whatever ``--steps``.
* **Linger.** ``--linger S`` keeps rank 0 serving S seconds after the last step (the summary is
  printed when training ends, before that window), so ``gradwatch top`` or ``curl`` can look at
  the endpoint of a finished run; the job then exits and the endpoint closes with it. The first
  line says how long the training takes and whether the endpoint stays; without ``--linger``
  the last line says that it closes and how to keep it.
* **Stopping.** torchrun runs in its own session, so a Ctrl-C reaches the parent only; the
  parent forwards SIGINT (SIGTERM for a SIGTERM) to torchrun's process group, waits
  ``STOP_TIMEOUT`` s, then SIGKILLs the group, and exits 130 (143 for SIGTERM). The ranks also
  watch the parent's pid and stop together if it disappears.

Exit status: 0 when the run completed; 1 when torchrun failed; 2 when the port is taken;
130/143 when interrupted.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gradwatch.cli.demo_protocol import (
    DEFAULT_ANOMALY_PAUSE,
    DEFAULT_BIND,
    DEFAULT_STEP_SLEEP,
    DEFAULT_STEPS,
    JobArgs,
    Ready,
    Summary,
    Workdir,
)
from gradwatch.cli.endpoint import EndpointView, ScrapeError, scrape
from gradwatch.cli.phases import phase_of
from gradwatch.cli.render import (
    UNDEFINED,
    Trends,
    anomalies_text,
    fmt,
    fmt_ratio,
    isolation_text,
    render_view,
)
from gradwatch.config import DEFAULT_DEMO_PORT

#: Seconds between two scrapes of the job's endpoint.
REFRESH = 0.25
#: How long to wait for rank 0 to start serving (torchrun start, imports, rendezvous).
STARTUP_TIMEOUT = 180.0
#: How long to wait for the endpoint to publish the last step before the final scrape.
FINAL_SCRAPE_TIMEOUT = 5.0
#: After forwarding a signal, how long torchrun gets to stop its ranks before SIGKILL.
STOP_TIMEOUT = 10.0
#: Lines of job.log shown when the job fails.
LOG_TAIL = 40

PHASE_TEXT = {
    "host": "host trains (seed not grown yet)",
    "seed": "seed trains, host frozen (no gradient reaches it)",
    "blend": "host and seed train together",
}


class _Terminated(Exception):
    """Raised by the parent's SIGTERM handler to unwind like a Ctrl-C."""


@dataclass
class DemoOptions:
    """The command line of ``gradwatch demo``, checked."""

    nproc: int
    steps: int
    port: int
    bind: str
    nan_at: int | None
    explode_at: int | None
    seed_at: int | None
    blend_at: int | None
    step_sleep: float
    linger: float
    spike_at: int | None = None
    nan_rank: int | None = None
    guard: bool = False


def port_in_use(port: int, bind: str) -> bool:
    """Whether binding ``bind:port`` fails with EADDRINUSE (bound the way the endpoint binds,
    with SO_REUSEADDR, so a port in TIME_WAIT is not reported)."""
    if port == 0:
        return False
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def port_message(port: int) -> str:
    return (
        f"gradwatch demo: port {port} is already in use (another demo, or another exporter?). "
        f"Choose another one with --port PORT, or --port 0 for an ephemeral one."
    )


def job_args(opts: DemoOptions, workdir: Path) -> JobArgs:
    """The demo job's arguments: ``opts``, the ack and this process as the parent to watch."""
    return JobArgs(
        workdir=workdir,
        steps=opts.steps,
        port=opts.port,
        bind=opts.bind,
        step_sleep=opts.step_sleep,
        anomaly_pause=DEFAULT_ANOMALY_PAUSE,
        linger=opts.linger,
        nan_at=() if opts.nan_at is None else (opts.nan_at,),
        explode_at=() if opts.explode_at is None else (opts.explode_at,),
        spike_at=() if opts.spike_at is None else (opts.spike_at,),
        seed_at=opts.seed_at,
        blend_at=opts.blend_at,
        ack=True,
        parent_pid=os.getpid(),
        nan_rank=opts.nan_rank,
        guard=opts.guard,
    )


def expected_seconds(opts: DemoOptions) -> float:
    """How long the training takes, at least: every step's ``--step-sleep`` and the pause
    after each injected step (starting torchrun's ranks comes on top, a few seconds)."""
    injected = sum(at is not None for at in (opts.nan_at, opts.explode_at, opts.spike_at))
    return opts.steps * opts.step_sleep + injected * DEFAULT_ANOMALY_PAUSE


def intro_lines(opts: DemoOptions) -> list[str]:
    """What the run will do and how long the endpoint stays: printed first."""
    keep = (
        f"rank 0 keeps serving {opts.linger:g} s after the last step (--linger)"
        if opts.linger > 0
        else "the endpoint closes when training ends: --linger SECONDS keeps it serving "
        "(e.g. gradwatch demo --linger 600, then gradwatch top URL)"
    )
    return [
        f"gradwatch demo: {opts.steps} steps on {opts.nproc} ranks, about "
        f"{expected_seconds(opts):.0f} s of training after startup (--steps, --step-sleep); "
        f"{keep}"
    ]


def job_command(opts: DemoOptions, workdir: Path) -> list[str]:
    """The torchrun command line of the demo job."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(opts.nproc),
        "-m", "gradwatch.cli.demo_job",
        *job_args(opts, workdir).to_argv(),
    ]  # fmt: skip


def stop_process_group(proc: subprocess.Popen[bytes], sig: int, timeout: float) -> None:
    """Send ``sig`` to ``proc``'s process group, wait up to ``timeout``, then SIGKILL it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5.0)
    # Ranks outliving torchrun (the group keeps the leader's id while any member lives).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# -- displays -------------------------------------------------------------------------------


class _Display:
    """Where the parent shows the run: a live table (terminal) or plain lines."""

    def __init__(self, console: Console, opts: DemoOptions) -> None:
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


class _LiveDisplay(_Display):
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


class _PlainDisplay(_Display):
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
        return (
            f"step {view.step}/{self.opts.steps} [{self.phase(view.step)}] "
            f"global norm {fmt(view.global_norm)} | {groups} | {ratios} | "
            f"health {fmt(view.health, 3)} | {anomalies_text(view).plain}"
            + (f"; {isolation.plain}" if isolation is not None else "")
        )


def _spike_count(view: EndpointView) -> int:
    """Every spike counter of ``view`` summed: moves whenever a spike was published."""
    return view.global_spikes + sum(s.spikes for s in view.groups.values())


#: What identifies the job's spike warnings in job.log (gradwatch.spikes' WARNING).
SPIKE_LOG_MARK = "gradient-norm spike"


def spike_log_lines(log_path: Path) -> list[str]:
    """The spike warnings gradwatch logged in the job (rank 0's stderr, in job.log)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if SPIKE_LOG_MARK in line]


# -- the run --------------------------------------------------------------------------------


def _steps_text(steps: Sequence[int]) -> str:
    if not steps:
        return "0"
    shown = ", ".join(str(s) for s in steps[:20]) + (", ..." if len(steps) > 20 else "")
    return f"{len(steps)} (step{'s' if len(steps) > 1 else ''} {shown})"


def summary_lines(summary: Summary, final: EndpointView | None, url: str) -> list[str]:
    """The end-of-run summary: from the job's summary message and the final scrape."""
    seed_at, blend_at, steps = summary.seed_at, summary.blend_at, summary.steps
    lines = [
        f"gradwatch demo finished: {summary.steps_run} steps on {summary.world_size} "
        f"ranks ({summary.parallelism}); phases: host 0-{seed_at - 1}, "
        f"seed {seed_at}-{blend_at - 1} (host frozen), blend {blend_at}-{steps - 1}",
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
    if summary.guarded:
        lines.append(
            f"guard-skipped steps: {_steps_text(events.skipped)} (optimizer update not applied)"
        )
    hmin = summary.health_min
    if hmin is not None:
        lines.append(f"health min: {fmt(hmin.value, 3)} at step {hmin.step}")
    for group, bad in summary.isolation_violation_steps.items():
        lines.append(f"isolation of {group}: {_steps_text(bad)} violating steps")
    if final is not None:
        lines.append(
            f"endpoint {url} (final scrape, step {final.step}): "
            f"gradwatch_nonfinite_steps_total {final.nonfinite_steps}, "
            f"gradwatch_exploding_steps_total {final.exploding_steps}, "
            f"gradwatch_collections_total {final.collections}, "
            f"gradwatch_global_grad_norm_spikes_total {final.global_spikes}"
            + "".join(
                f', gradwatch_skipped_steps_total{{reason="{r}"}} {n}'
                for r, n in final.skipped_steps.items()
            )
            + "".join(
                f', gradwatch_grad_norm_spikes_total{{group="{g}"}} {s.spikes}'
                for g, s in final.groups.items()
                if s.spikes
            )
        )
        if final.nonfinite_origin:
            lines.append(
                f"endpoint: last non-finite origin (step {final.nonfinite_origin_step}): "
                + ", ".join(f"rank {r} ({h})" for r, h in final.nonfinite_origin)
            )
    else:
        lines.append(f"endpoint {url}: no final scrape (the endpoint did not answer)")
    return lines


class DemoRun:
    """One ``gradwatch demo`` run: launch, watch, summarize, stop."""

    def __init__(self, opts: DemoOptions, console: Console) -> None:
        self.opts = opts
        self.console = console
        self.err = Console(stderr=True, highlight=False, markup=False)
        self.workdir = Path(tempfile.mkdtemp(prefix="gradwatch-demo-"))
        self.work = Workdir(self.workdir)
        self.log_path = self.workdir / "job.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.display: _Display = (
            _LiveDisplay(console, opts) if console.is_terminal else _PlainDisplay(console, opts)
        )
        self.url: str | None = None
        self.keep_workdir = False  # kept (with job.log) when the job failed

    def run(self) -> int:
        """Run to completion; returns the exit status (signals propagate to :meth:`stop`)."""
        for line in intro_lines(self.opts):
            self.console.print(line, soft_wrap=True)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun would set, without its warning
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                job_command(self.opts, self.workdir),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the parent only; it forwards it
            )
        if isinstance(self.display, _PlainDisplay):
            self.display.status(f"starting torchrun: {self.opts.nproc} ranks, gloo, CPU")
        endpoint = self._wait_for_endpoint()
        if endpoint is None:
            return self._failed()
        self.url = self.display.url = endpoint.metrics_url
        self.display.phases = (endpoint.seed_at, endpoint.blend_at)
        if isinstance(self.display, _PlainDisplay):
            self.display.status(f"metrics: {self.url}")
        else:
            self.display.status("training (Ctrl-C to stop)")
        final, summary = self._watch()
        if summary is None:  # the job ended before finishing its steps
            return self._failed()
        self.display.status("training done")
        self.display.close()
        for line in summary_lines(summary, final, self.url or "?"):
            self.console.print(line, soft_wrap=True)
        for line in spike_log_lines(self.log_path):
            self.console.print(f"job log: {line}", soft_wrap=True)
        if self.opts.linger > 0 and self.proc.poll() is None:
            self.console.print(
                f"serving {self.url} for {self.opts.linger:g}s more (Ctrl-C to stop; "
                f"look at it with: gradwatch top {self.url})",
                soft_wrap=True,
            )
        elif self.opts.linger == 0:
            self.console.print(
                f"the endpoint {self.url} closes now; to keep it serving after the last step, "
                "run with --linger SECONDS",
                soft_wrap=True,
            )
        if self.proc.wait() != 0:
            return self._failed()
        return 0

    def _wait_for_endpoint(self) -> Ready | None:
        assert self.proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            endpoint = self.work.read_ready()
            if endpoint is not None:
                return endpoint
            if self.work.has_error() or self.proc.poll() is not None:
                return None
            time.sleep(0.1)
        self.err.print(f"gradwatch demo: rank 0 did not start serving in {STARTUP_TIMEOUT:g}s")
        stop_process_group(self.proc, signal.SIGTERM, STOP_TIMEOUT)
        return None

    def _scrape(self) -> tuple[EndpointView | None, str | None]:
        assert self.url is not None
        try:
            return scrape(self.url, timeout=2.0), None
        except ScrapeError as exc:
            return None, str(exc)

    def _watch(self) -> tuple[EndpointView | None, Summary | None]:
        """Scrape until the job ends or writes its summary; then the final scrape and the ack."""
        assert self.proc is not None
        while self.proc.poll() is None:
            view, error = self._scrape()
            self.display.update(view, error if self.proc.poll() is None else None)
            summary = self.work.read_summary()
            if summary is not None:
                final = self._final_scrape(summary, view)
                self.work.ack()
                return final, summary
            time.sleep(REFRESH)
        return None, self.work.read_summary()

    def _final_scrape(self, summary: Summary, view: EndpointView | None) -> EndpointView | None:
        """Scrape until the endpoint shows the last step the job collected (bounded)."""
        last = None if summary.last is None else summary.last.step
        deadline = time.monotonic() + FINAL_SCRAPE_TIMEOUT
        while True:
            if view is not None and (last is None or (view.step is not None and view.step >= last)):
                self.display.update(view, None)
                return view
            if time.monotonic() > deadline:
                return view
            time.sleep(0.05)
            view, _ = self._scrape()

    def _failed(self) -> int:
        """Report a failed job (its log's tail, or the taken port); returns the exit status."""
        self.display.close()
        if self.proc is not None and self.proc.poll() is None:  # torchrun still tearing down
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                stop_process_group(self.proc, signal.SIGTERM, STOP_TIMEOUT)
        error = self.work.read_error()
        if error is not None and error.kind == "port_in_use":
            self.err.print(port_message(error.port), style="red")
            return 2
        rc = self.proc.poll() if self.proc is not None else None
        self.err.print(
            f"gradwatch demo: the training job failed (torchrun exit status {rc}); "
            f"last lines of {self.log_path}:",
            style="red",
            soft_wrap=True,
        )
        self.err.print(Text(_tail(self.log_path, LOG_TAIL)), soft_wrap=True)
        if error is not None:
            self.err.print(error.message, soft_wrap=True)
        self.keep_workdir = True
        return 1

    def stop(self, sig: int) -> None:
        """Forward ``sig`` to torchrun's process group; SIGKILL after ``STOP_TIMEOUT``."""
        with contextlib.suppress(OSError):  # e.g. a broken pipe: stopping matters more
            self.display.close()
            if self.proc is not None:
                self.err.print(
                    f"gradwatch demo: stopping the job ({signal.Signals(sig).name} to torchrun)"
                )
        if self.proc is not None:
            try:
                stop_process_group(self.proc, sig, STOP_TIMEOUT)
            except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5.0)

    def cleanup(self) -> None:
        """Remove the private directory, unless a failure kept it for its ``job.log``."""
        if not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`_Terminated` (so the job is stopped too)."""

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check(opts: DemoOptions) -> None:
    """Refuse inconsistent options with a usage error naming the option."""
    for flag, value in (
        ("--nan-at", opts.nan_at),
        ("--explode-at", opts.explode_at),
        ("--spike-at", opts.spike_at),
    ):
        if value is not None and not 0 <= value < opts.steps:
            raise typer.BadParameter(f"must be in [0, {opts.steps}) (--steps)", param_hint=flag)
    for flag, value in (("--seed-at", opts.seed_at), ("--blend-at", opts.blend_at)):
        if value is not None and not 0 <= value <= opts.steps:
            raise typer.BadParameter(f"must be in [0, {opts.steps}]", param_hint=flag)
    if opts.seed_at is not None and opts.blend_at is not None and opts.blend_at < opts.seed_at:
        raise typer.BadParameter("must not be before --seed-at", param_hint="--blend-at")
    if opts.nan_rank is not None:
        hint = "--nan-rank"
        if opts.nan_at is None:
            raise typer.BadParameter("needs --nan-at (the step to inject at)", param_hint=hint)
        if not 0 <= opts.nan_rank < opts.nproc:
            raise typer.BadParameter(f"must be in [0, {opts.nproc}) (--nproc)", param_hint=hint)
    if not math.isfinite(opts.step_sleep) or not math.isfinite(opts.linger):
        raise typer.BadParameter("must be finite", param_hint="--step-sleep/--linger")


def demo(
    nproc: Annotated[int, typer.Option(min=1, max=64, help="Ranks (torchrun processes).")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = DEFAULT_STEPS,
    port: Annotated[
        int,
        typer.Option(min=0, max=65535, help="Metrics port of rank 0 (0 = an ephemeral one)."),
    ] = DEFAULT_DEMO_PORT,
    nan_at: Annotated[
        int | None, typer.Option(help="Multiply the gradients by NaN at this step.")
    ] = None,
    explode_at: Annotated[
        int | None, typer.Option(help="Multiply the gradients by 1e6 at this step.")
    ] = None,
    spike_at: Annotated[
        int | None,
        typer.Option(
            help="Multiply the gradients by 30 at this step: a spike below the exploding "
            "threshold, found by adaptive spike detection (also after a stage change)."
        ),
    ] = None,
    seed_at: Annotated[
        int | None,
        typer.Option(
            help="Step where the seed module starts training, host frozen (default: steps/4)."
        ),
    ] = None,
    blend_at: Annotated[
        int | None,
        typer.Option(
            help="Host and seed train together from this step (default: midway seed-at..end)."
        ),
    ] = None,
    step_sleep: Annotated[
        float, typer.Option(min=0.0, help="Seconds each step sleeps, so the run can be followed.")
    ] = DEFAULT_STEP_SLEEP,
    linger: Annotated[
        float, typer.Option(min=0.0, help="Keep serving this many seconds after the last step.")
    ] = 0.0,
    bind: Annotated[str, typer.Option(help="Address the endpoint binds to.")] = DEFAULT_BIND,
    nan_rank: Annotated[
        int | None,
        typer.Option(
            help="With --nan-at: the NaN enters this rank's local gradients only, before the "
            "all-reduce; the summary and the endpoint name it as the origin."
        ),
    ] = None,
    guard: Annotated[
        bool,
        typer.Option(
            "--guard",
            help="Step the optimizer through watch.guard(): non-finite and spiking steps "
            "(spike score above 6) are skipped on every rank, and counted.",
        ),
    ] = False,
) -> None:
    """Run a small torchrun DDP job watched by gradwatch and show its endpoint live.

    A model grows a "seed" module next to a "host" backbone: the host trains alone, then the seed with the host frozen (isolated), then both. Rank 0 serves the metrics; the table shows what it serves.
    """  # noqa: E501 (one line per paragraph: the help is rewrapped to the terminal)
    opts = DemoOptions(
        nproc, steps, port, bind, nan_at, explode_at, seed_at, blend_at, step_sleep, linger,
        spike_at=spike_at, nan_rank=nan_rank, guard=guard,
    )
    _check(opts)
    console = Console(highlight=False, markup=False)
    if port_in_use(port, bind):
        Console(stderr=True, markup=False).print(port_message(port), style="red", soft_wrap=True)
        raise typer.Exit(2)
    run = DemoRun(opts, console)
    code = 1
    try:
        with _sigterm_raises():
            try:
                code = run.run()
            except KeyboardInterrupt:
                run.stop(signal.SIGINT)
                code = 130
            except _Terminated:
                run.stop(signal.SIGTERM)
                code = 143
            except BrokenPipeError:  # whoever read our output is gone: stop, quietly
                code = 1
    finally:
        try:
            if run.proc is not None:  # an unexpected error or a broken pipe: leave no ranks
                _ensure_stopped(run.proc)
        finally:
            run.cleanup()
    raise typer.Exit(code)


def _ensure_stopped(proc: subprocess.Popen[bytes]) -> None:
    """Stop the job if it still runs (SIGTERM, then SIGKILL); a Ctrl-C here SIGKILLs at once."""
    try:
        if proc.poll() is None:
            stop_process_group(proc, signal.SIGTERM, STOP_TIMEOUT)
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def register(app: typer.Typer) -> None:
    """Add the ``demo`` command to ``app``."""
    app.command("demo")(demo)
