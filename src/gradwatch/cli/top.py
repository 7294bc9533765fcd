"""``gradwatch top URL``: a live terminal view of any gradwatch metrics endpoint.

Every ``--interval`` seconds it scrapes the endpoint (:mod:`gradwatch.cli.endpoint`) and draws
it (:mod:`gradwatch.cli.render`), the code ``gradwatch demo`` uses too: the step, the global norm
and health with trends, each group's norm with a sparkline of recent scrapes, the ratios, the
non-finite/exploding/spike step counters, the spike scores and the staleness (now minus
``gradwatch_last_collect_timestamp_seconds``: a job that stopped collecting shows it at once).
With the per-rank view (DDP, docs/distributed.md) it adds the replicas' local norm spread, the
outlier score (highlighted above the GradwatchReplicaOutlier alert's threshold), the gradient
noise scale with its unit, and the origin rank of the last non-finite step; an endpoint without
the view shows none of these lines.
Each trend point covers every step published since the previous refresh (from the counters and
the per-step norm histograms), so a one-step NaN (``!``) or spike (``^``) between two refreshes
stays in the trend line.

Design choices:

* **A dead endpoint is a state, not an error.** A failed scrape shows the status line
  ``unreachable: <reason>, retrying in Ns`` (no answer) or ``not a gradwatch endpoint:
  <reason>, retrying in Ns`` (an answer without gradwatch metrics, or an HTTP 404 or 405: a
  wrong port or path), above the last good frame, if any, and is retried at the next refresh
  (the last refresh of ``--count`` promises no retry); no traceback is ever printed
  for it. The per-scrape timeout is the interval (at least 0.5 s, at most 5 s), so a hung
  endpoint cannot stall the view.
* **Terminal or not.** On a terminal the view redraws in place (rich ``Live``). Otherwise
  (pipes, CI, ``--count`` in scripts) each refresh prints one plain-text frame, headed by
  ``--- refresh N ---``, without colors.
* ``--count N`` stops after N refreshes, with status 0 when the last one was read and
  :data:`EXIT_SCRAPE_FAILED` when it failed (``gradwatch top --count 1 URL`` is a health check
  for scripts). ``q`` (on a terminal) and Ctrl-C stop quietly with status 0: they are the normal
  ways to leave a live view.
* A URL without a scheme or path is completed: ``localhost:9977`` means
  ``http://localhost:9977/metrics``.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator
from typing import Annotated, TextIO

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from gradwatch.cli.endpoint import EndpointView, ScrapeError, normalize_url, scrape
from gradwatch.cli.render import Trends, render_view

#: Exit status of ``--count N`` when the last refresh could not read a gradwatch endpoint.
EXIT_SCRAPE_FAILED = 1
#: The key that leaves the live view.
QUIT_KEY = "q"


def scrape_timeout(interval: float) -> float:
    """Per-scrape timeout for a refresh interval: the interval, clamped to [0.5, 5] s."""
    return min(max(interval, 0.5), 5.0)


def render_frame(
    url: str,
    view: EndpointView | None,
    error: ScrapeError | None,
    trends: Trends,
    *,
    refresh: int,
    interval: float,
    now: float | None = None,
    final: bool = False,
) -> RenderableType:
    """One frame of ``gradwatch top``: header, then the status line or the endpoint's state.
    ``final``: the last refresh (``--count``), whose status line promises no retry."""
    now = time.time() if now is None else now
    head = Text("gradwatch top ", style="bold")
    head.append(url)
    head.append(
        f"   refresh {refresh} at {time.strftime('%H:%M:%S', time.localtime(now))}", style="dim"
    )
    parts: list[RenderableType] = [head]
    if error is not None:
        retry = "" if final else f", retrying in {interval:g}s"
        parts.append(Text(f"{error.kind}: {error}{retry}", style="bold red"))
        if view is not None:
            parts.append(Text("last successful scrape:", style="dim"))
    if view is not None:
        parts.append(render_view(view, trends, now=now))
    elif error is None:
        parts.append(Text("waiting for the first scrape ...", style="dim"))
    return Group(*parts)


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[bool]:
    """Unbuffered single keys from ``stream`` while the view runs, when it is a terminal (its
    settings restored on the way out); yields whether keys can be read."""
    try:
        fd = stream.fileno()
        interactive = os.isatty(fd)
    except (AttributeError, OSError, ValueError):  # replaced or closed stdin
        interactive = False
    if not interactive:
        yield False
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield True
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_quit(stream: TextIO, seconds: float) -> bool:
    """Sleep up to ``seconds``; True as soon as the quit key is pressed on ``stream``."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([stream], [], [], left)
        if not ready:
            return False
        key = os.read(stream.fileno(), 1).decode(errors="replace")
        if key == "" or key.lower() == QUIT_KEY:  # EOF: nobody can type any more
            return key != ""
    return False


def run_top(
    url: str, interval: float, count: int | None, console: Console, keys: TextIO | None = None
) -> bool:
    """Scrape and display until ``count`` refreshes are done (forever when None) or the quit
    key is pressed on ``keys`` (a terminal; default stdin). True when the last refresh read a
    gradwatch endpoint."""
    url = normalize_url(url)
    trends = Trends()
    last: EndpointView | None = None
    live: Live | None = None
    keys = sys.stdin if keys is None else keys
    refresh = 0
    error: ScrapeError | None = None
    with _keys(keys) as interactive:
        if console.is_terminal:
            live = Live(console=console, auto_refresh=False, transient=False)
            live.start()
        try:
            while True:
                started = time.monotonic()
                error = None
                try:
                    last = scrape(url, timeout=scrape_timeout(interval))
                    trends.add(last)
                except ScrapeError as exc:
                    error = exc
                refresh += 1
                final = count is not None and refresh >= count
                frame = render_frame(
                    url, last, error, trends, refresh=refresh, interval=interval, final=final
                )
                if live is not None:
                    live.update(frame, refresh=True)
                else:
                    console.print(f"--- refresh {refresh} ---", highlight=False)
                    console.print(frame, highlight=False)
                if final:
                    return error is None
                pause = max(0.0, interval - (time.monotonic() - started))
                if interactive:
                    if _wait_for_quit(keys, pause):
                        return True
                else:
                    time.sleep(pause)
        finally:
            if live is not None:
                live.stop()


def top(
    url: Annotated[str, typer.Argument(help="Metrics URL, e.g. http://127.0.0.1:9977/metrics")],
    interval: Annotated[float, typer.Option(min=0.05, help="Seconds between refreshes.")] = 1.0,
    count: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many refreshes (default: never).")
    ] = None,
) -> None:
    """Live view of a gradwatch endpoint: norms with trends, ratios, health, anomaly counters.
    Press q to quit."""
    console = Console(highlight=False, markup=False)
    ok = True
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        ok = run_top(url, interval, count, console)
    if not ok:
        raise typer.Exit(EXIT_SCRAPE_FAILED)


def register(app: typer.Typer) -> None:
    """Add the ``top`` command to ``app``."""
    app.command("top")(top)
