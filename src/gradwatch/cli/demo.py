"""``gradwatch demo``: a 2-rank torchrun training job watched by gradwatch, shown live.

The demo's parent: this module parses the command line once into a frozen
:class:`~gradwatch.cli.demo_protocol.DemoOptions`, launches ``python -m torch.distributed.run
--standalone --nproc_per_node N -m gradwatch.cli.demo_job --workdir DIR --parent-pid PID``
(gloo, CPU; the job is :mod:`gradwatch.cli.demo_job`), and shows what the job's endpoint says by
scraping it with ``gradwatch top``'s code (:mod:`gradwatch.cli.endpoint`; drawn by
:mod:`gradwatch.cli.demo_view`): it sees the run as Prometheus would. The options reach the job
whole, as ``options.json`` in the private work directory (``Workdir``), which also carries every
message back (ready, error, summary) and the parent's ack (:mod:`gradwatch.cli.demo_protocol`).
This module imports no torch: the command starts fast and only the job's ranks load it.

Design choices (ports, output, the final scrape and the ack, linger, stopping): docs/design.md,
"The demo". Exit status: 0 when the run completed; 1 when torchrun failed; 2 when the port is
taken; 130/143 when interrupted (SIGINT/SIGTERM, forwarded to torchrun's process group).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from gradwatch.cli.demo_protocol import (
    ANOMALY_PAUSE,
    DEFAULT_BIND,
    DEFAULT_STEP_SLEEP,
    DEFAULT_STEPS,
    MAX_NPROC,
    DemoOptionError,
    DemoOptions,
    JobError,
    Ready,
    Summary,
    Workdir,
)
from gradwatch.cli.demo_view import Display, LiveDisplay, PlainDisplay, summary_lines
from gradwatch.cli.endpoint import EndpointView, ScrapeError, scrape
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
#: What identifies the job's spike warnings in job.log (gradwatch.analysis.spikes' WARNING).
SPIKE_LOG_MARK = "gradient-norm spike"

# -- the parent -----------------------------------------------------------------------------


class _Terminated(Exception):
    """Raised by the parent's SIGTERM handler to unwind like a Ctrl-C."""


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


def expected_seconds(opts: DemoOptions) -> float:
    """How long the training takes, at least: every step's ``--step-sleep`` and the pause
    after each injected step (starting torchrun's ranks comes on top, a few seconds)."""
    injected = sum(at is not None for at in (opts.nan_at, opts.explode_at, opts.spike_at))
    return opts.steps * opts.step_sleep + injected * ANOMALY_PAUSE


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
    """The torchrun command line of the demo job (its options are ``workdir``'s
    ``options.json``; this process is the parent it watches)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(opts.nproc),
        "-m", "gradwatch.cli.demo_job",
        "--workdir", str(workdir), "--parent-pid", str(os.getpid()),
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


def spike_log_lines(log_path: Path) -> list[str]:
    """The spike warnings gradwatch logged in the job (rank 0's stderr, in job.log)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if SPIKE_LOG_MARK in line]


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
        self.display: Display = (
            LiveDisplay(console, opts) if console.is_terminal else PlainDisplay(console, opts)
        )
        self.url: str | None = None
        self.keep_workdir = False  # kept (with job.log) when the job failed

    def run(self) -> int:
        """Run to completion; returns the exit status (signals propagate to :meth:`stop`)."""
        for line in intro_lines(self.opts):
            self.console.print(line, soft_wrap=True)
        self.work.write(self.opts)
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
        plain = isinstance(self.display, PlainDisplay)
        if plain:
            self.display.status(f"starting torchrun: {self.opts.nproc} ranks, gloo, CPU")
        endpoint = self._wait_for_endpoint()
        if endpoint is None:
            return self._failed()
        self.url = self.display.url = endpoint.metrics_url
        self.display.status(f"metrics: {self.url}" if plain else "training (Ctrl-C to stop)")
        final, summary = self._watch()
        if summary is None:  # the job ended before finishing its steps
            return self._failed()
        self.display.status("training done")
        self.display.close()
        for line in summary_lines(self.opts, summary, final, self.url or "?"):
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
            endpoint = self.work.read(Ready)
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
            summary = self.work.read(Summary)
            if summary is not None:
                final = self._final_scrape(summary, view)
                self.work.ack()
                return final, summary
            time.sleep(REFRESH)
        return None, self.work.read(Summary)

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
        error = self.work.read(JobError)
        if error is not None and error.kind == "port_in_use":
            self.err.print(port_message(self.opts.port), style="red")
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


def demo(
    nproc: Annotated[
        int, typer.Option(min=1, max=MAX_NPROC, help="Ranks (torchrun processes).")
    ] = 2,
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
    try:  # the parameters are the fields (tests/unit/cli/test_demo_options.py): nothing restated
        opts = DemoOptions(**locals())
    except DemoOptionError as exc:
        raise typer.BadParameter(exc.problem, param_hint=exc.flag) from None
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
