"""``gradwatch demo`` and ``gradwatch top``: the real console script, run as subprocesses.

* Pure parts: sparklines, URL completion, parsing a fixture exposition and the exposition of a
  real :class:`~gradwatch.export.MetricsServer` (the metric names are a contract), trends, the
  rendered view (the demo's options and messages: ``tests/unit/cli/test_demo_options.py``).
* ``gradwatch top`` against a closed port (a status line, no traceback) and against an
  in-process endpoint (no torchrun).
* ``gradwatch demo`` with a taken port (fails fast, names the port and ``--port``) and bad
  options (usage error), neither of which starts torchrun.
* ``distributed``: a 30-step 2-rank demo with a NaN injected at step 20 (the progress lines,
  the summary and the endpoint's counter show it); a lingering demo watched by
  ``gradwatch top`` and then stopped with SIGINT (exit 130, endpoint closed, no rank left).

Every subprocess runs in its own session with a hard timeout; on timeout it gets SIGINT (the
demo forwards it to torchrun) and then SIGKILL. The demo's ranks also stop by themselves when
the demo process disappears.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console

from gradwatch.cli.endpoint import (
    EndpointView,
    ScrapeError,
    normalize_url,
    parse_exposition,
    scrape,
)
from gradwatch.cli.plot import spike_points
from gradwatch.cli.render import (
    BLOCKS,
    NONFINITE_MARK,
    ZERO_MARK,
    Trends,
    render_view,
    sparkline,
)
from gradwatch.cli.top import EXIT_SCRAPE_FAILED
from gradwatch.config import WatchConfig
from gradwatch.export import MetricsServer
from gradwatch.export.history import read_history
from gradwatch.snapshot import GroupStats, Snapshot

GRADWATCH = str(Path(sys.executable).with_name("gradwatch"))

FIXTURE = """\
# HELP gradwatch_step Training step of the last published snapshot.
# TYPE gradwatch_step gauge
gradwatch_step 20.0
# HELP gradwatch_last_collect_timestamp_seconds Wall-clock time.
# TYPE gradwatch_last_collect_timestamp_seconds gauge
gradwatch_last_collect_timestamp_seconds 1.7e+09
# HELP gradwatch_global_grad_norm L2 norm of all gradients.
# TYPE gradwatch_global_grad_norm gauge
gradwatch_global_grad_norm NaN
# HELP gradwatch_grad_norm L2 norm of one group.
# TYPE gradwatch_grad_norm gauge
gradwatch_grad_norm{group="host"} NaN
gradwatch_grad_norm{group="seed"} 0.25
# HELP gradwatch_grad_norm_ratio Ratio.
# TYPE gradwatch_grad_norm_ratio gauge
gradwatch_grad_norm_ratio{denominator="host",numerator="seed"} +Inf
# HELP gradwatch_group_parameters numel.
# TYPE gradwatch_group_parameters gauge
gradwatch_group_parameters{group="host"} 2145.0
gradwatch_group_parameters{group="seed"} 552.0
# HELP gradwatch_exploding_tensors exploding.
# TYPE gradwatch_exploding_tensors gauge
gradwatch_exploding_tensors{group="host"} 6.0
gradwatch_exploding_tensors{group="seed"} 0.0
# HELP gradwatch_nonfinite_tensors nonfinite.
# TYPE gradwatch_nonfinite_tensors gauge
gradwatch_nonfinite_tensors{group="host"} 6.0
gradwatch_nonfinite_tensors{group="seed"} 0.0
# HELP gradwatch_health_score health.
# TYPE gradwatch_health_score gauge
gradwatch_health_score 0.0
# HELP gradwatch_isolation_violated isolation.
# TYPE gradwatch_isolation_violated gauge
gradwatch_isolation_violated{group="stem"} 0.0
# HELP gradwatch_collections_total Snapshots published.
# TYPE gradwatch_collections_total counter
gradwatch_collections_total 21.0
# HELP gradwatch_nonfinite_steps_total non-finite steps.
# TYPE gradwatch_nonfinite_steps_total counter
gradwatch_nonfinite_steps_total 1.0
# HELP gradwatch_exploding_steps_total exploding steps.
# TYPE gradwatch_exploding_steps_total counter
gradwatch_exploding_steps_total 2.0
# HELP gradwatch_isolation_violations_total violations.
# TYPE gradwatch_isolation_violations_total counter
gradwatch_isolation_violations_total{group="stem"} 0.0
# HELP gradwatch_run_info World size and parallelism.
# TYPE gradwatch_run_info gauge
gradwatch_run_info{parallelism="ddp2",world_size="2"} 1.0
"""


# -- helpers --------------------------------------------------------------------------------


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGINT the process group (the demo forwards it to torchrun), then SIGKILL it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_cli(*args: str, timeout: float) -> Result:
    """``gradwatch ARGS`` to completion, killed (and the test failed) past ``timeout``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [GRADWATCH, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, err = proc.communicate()
        pytest.fail(f"gradwatch {' '.join(args)} took over {timeout}s\n{out}\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - start)


@dataclass
class Background:
    """A ``gradwatch`` process whose stdout lines are collected by a thread."""

    proc: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def wait_for(self, predicate: str, timeout: float) -> str:
        """The first stdout line containing ``predicate`` (fails past ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if predicate in line:
                    return line
            if self.proc.poll() is not None and not (
                self.reader is None or not self.reader.is_alive()
            ):
                break
            time.sleep(0.05)
        pytest.fail(f"no line with {predicate!r} in {timeout}s:\n" + "".join(self.lines))

    def start_reader(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()


@pytest.fixture
def background() -> Iterator[list[Background]]:
    """Starts ``gradwatch`` processes in the background; stops every one at teardown."""
    started: list[Background] = []
    yield started
    for bg in started:
        _stop(bg.proc)


def start_background(started: list[Background], *args: str) -> Background:
    proc = subprocess.Popen(
        [GRADWATCH, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    bg = Background(proc)
    started.append(bg)
    bg.start_reader()
    return bg


def job_processes(parent_pid: int) -> list[str]:
    """Command lines of demo ranks launched by ``parent_pid`` (``--parent-pid``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in cmd]
        if "gradwatch.cli.demo_job" in words and str(parent_pid) in words:
            found.append(" ".join(words))
    return found


# -- pure parts -----------------------------------------------------------------------------


def test_sparkline_linear_scale_and_marks() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == BLOCKS
    assert sparkline([]) == ""
    assert sparkline([3.0, 3.0]) == BLOCKS[3] * 2  # flat: mid height
    assert sparkline([0.0, math.nan, 1.0, math.inf]) == f"▁{NONFINITE_MARK}█{NONFINITE_MARK}"
    assert sparkline([-5.0, 0.5, 5.0], lo=0.0, hi=1.0) == "▁▅█"  # clamped to [lo, hi]


def test_sparkline_log_scale() -> None:
    assert sparkline([1.0, 10.0, 100.0], log=True) == "▁▅█"
    assert sparkline([1e-3, 1e6, 0.0], log=True) == f"▁█{ZERO_MARK}"  # a spike keeps the rest
    assert len(sparkline([0.1] * 30, log=True)) == 30


def test_normalize_url() -> None:
    assert normalize_url("localhost:9977") == "http://localhost:9977/metrics"
    assert normalize_url("http://h:1") == "http://h:1/metrics"
    assert normalize_url("https://h:1/custom") == "https://h:1/custom"


def test_parse_fixture_exposition() -> None:
    view = parse_exposition(FIXTURE)
    assert view.step == 20
    assert view.global_norm is not None and math.isnan(view.global_norm)
    assert list(view.groups) == ["host", "seed"]
    assert math.isnan(view.groups["host"].norm) and view.groups["seed"].norm == 0.25
    assert view.groups["host"].numel == 2145 and view.groups["host"].nonfinite == 6
    assert view.ratios == {"seed/host": math.inf}
    assert view.health == 0.0
    assert view.isolation_violated == {"stem": False}
    assert view.isolation_violations == {"stem": 0}
    assert (view.collections, view.nonfinite_steps, view.exploding_steps) == (21, 1, 2)
    assert (view.world_size, view.parallelism) == ("2", "ddp2")
    assert view.staleness(now=1.7e9 + 3) == pytest.approx(3.0)


def test_parse_rejects_other_expositions() -> None:
    with pytest.raises(ScrapeError, match="no gradwatch metrics"):
        parse_exposition("# TYPE up gauge\nup 1.0\n")
    with pytest.raises(ScrapeError, match="not a Prometheus exposition"):
        parse_exposition("<html>this is a web page</html>\n{{{")


def test_trends_take_one_point_per_new_step() -> None:
    trends = Trends(points=3)
    for step in (1, 1, 2, 3, 4):
        trends.add(EndpointView(step=step, global_norm=float(step), health=1.0))
    assert trends.get("global") == [2.0, 3.0, 4.0]  # repeated step 1 ignored; last 3 kept
    assert trends.add(EndpointView()) is False  # nothing published yet


def test_render_view_as_plain_text() -> None:
    view = parse_exposition(FIXTURE)
    trends = Trends()
    trends.add(view)
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(render_view(view, trends, now=1.7e9))
    text = out.getvalue()
    for expected in ("step 20", "host", "seed", "seed/host", "nan", "non-finite steps 1",
                     "exploding steps 2", "isolation violations: stem 0"):  # fmt: skip
        assert expected in text, (expected, text)


@pytest.fixture
def live_server() -> Iterator[MetricsServer]:
    """An in-process endpoint with one published NaN step (no torchrun)."""
    cfg = WatchConfig(
        port=0,
        bind_address="127.0.0.1",
        groups={"host": ["host.*"], "seed": ["seed.*"]},
        ratios=[("seed", "host")],
        isolated=["host"],
    )
    server = MetricsServer(cfg, world_size=2, parallelism="ddp2")
    snap = Snapshot(
        step=7,
        global_norm=math.nan,
        groups={
            "host": GroupStats(norm=0.0, numel=0),
            "seed": GroupStats(norm=math.nan, numel=10, tensors=2, exploding=1, nonfinite=1),
        },
        nonfinite_params=("seed.w",),
        ratios={"seed/host": 0.0},
        health=0.0,
        isolation_violated={"host": False},
        world_size=2,
        parallelism="ddp2",
        timestamp=time.time(),
    )
    server.publish(snap)
    yield server
    server.close()


def test_scrape_a_real_endpoint(live_server: MetricsServer) -> None:
    view = scrape(live_server.url)
    assert view.step == 7
    assert view.global_norm is not None and math.isnan(view.global_norm)
    assert set(view.groups) == {"host", "seed"}
    assert view.groups["seed"].nonfinite == 1
    assert view.nonfinite_steps == 1 and view.exploding_steps == 1 and view.collections == 1
    assert view.isolation_violated == {"host": False}
    # The denominator (host) had no gradient: the ratio is undefined, exported as NaN (never a
    # 0 that would read as dormant).
    assert set(view.ratios) == {"seed/host"} and math.isnan(view.ratios["seed/host"])
    assert view.version is not None and view.parallelism == "ddp2"


def test_scrape_a_closed_port_is_a_scrape_error() -> None:
    with pytest.raises(ScrapeError, match=r"(?i)refused"):
        scrape(f"http://127.0.0.1:{closed_port()}/metrics", timeout=1.0)


# -- gradwatch top (no torchrun) ------------------------------------------------------------


def test_top_unreachable_endpoint_prints_status_not_traceback() -> None:
    url = f"http://127.0.0.1:{closed_port()}/metrics"
    r = run_cli("top", url, "--count", "2", "--interval", "0.2", timeout=60)
    assert r.returncode == EXIT_SCRAPE_FAILED, r  # --count N as a health check fails
    assert r.stdout.count("unreachable: ") == 2, r.stdout
    assert r.stdout.count("retrying in 0.2s") == 1, r.stdout  # the last refresh retries nothing
    assert "Traceback" not in r.stdout + r.stderr


def test_top_tells_an_endpoint_that_is_not_gradwatch_from_an_unreachable_one() -> None:
    import http.server

    class NotGradwatch(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"# TYPE node_load1 gauge\nnode_load1 0.5\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotGradwatch)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        r = run_cli("top", url, "--count", "1", "--interval", "0.2", timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert r.returncode == EXIT_SCRAPE_FAILED, r
    assert "not a gradwatch endpoint: no gradwatch metrics at this URL" in r.stdout, r.stdout
    assert "unreachable" not in r.stdout


def test_top_quits_on_q_at_a_terminal() -> None:
    import pty

    controller, terminal = pty.openpty()
    url = f"http://127.0.0.1:{closed_port()}/metrics"
    proc = subprocess.Popen(
        [GRADWATCH, "top", url, "--interval", "0.2"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=_env(),
        start_new_session=True,
    )
    os.close(terminal)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"unreachable" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                seen += os.read(controller, 65536)
        assert b"unreachable" in seen, seen
        os.write(controller, b"q")
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        os.close(controller)


def test_top_in_process_endpoint(live_server: MetricsServer) -> None:
    r = run_cli("top", live_server.url, "--count", "2", "--interval", "0.2", timeout=60)
    assert r.returncode == 0, r
    assert r.stdout.count("--- refresh") == 2
    for expected in ("step 7", "host (isolated)", "seed", "nan", "non-finite steps 1", "ago"):
        assert expected in r.stdout, (expected, r.stdout)
    assert "Traceback" not in r.stderr


def test_top_ctrl_c_exits_quietly(background: list[Background]) -> None:
    top = start_background(background, "top", f"127.0.0.1:{closed_port()}", "--interval", "0.2")
    top.wait_for("unreachable", timeout=60)
    os.killpg(top.proc.pid, signal.SIGINT)
    assert top.proc.wait(20) == 0
    assert top.reader is not None
    top.reader.join(5)
    assert "Traceback" not in "".join(top.lines)


# -- gradwatch demo without torchrun --------------------------------------------------------


def test_demo_taken_port_fails_fast_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("demo", "--steps", "5", "--port", str(port), timeout=60)
    assert r.returncode == 2, r
    assert f"port {port} is already in use" in r.stderr and "--port" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_demo_refuses_an_injection_outside_the_run() -> None:
    r = run_cli("demo", "--steps", "30", "--nan-at", "30", "--port", "0", timeout=60)
    assert r.returncode == 2, r
    assert "--nan-at" in r.stderr
    r = run_cli("demo", "--steps", "30", "--spike-at", "-1", "--port", "0", timeout=60)
    assert r.returncode == 2, r
    assert "--spike-at" in r.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--nan-rank", "1"], "needs --nan-at"), (["--nan-at", "3", "--nan-rank", "2"], "[0, 2)")],
)
def test_demo_refuses_a_nan_rank_without_step_or_outside_the_world(
    args: list[str], words: str
) -> None:
    r = run_cli("demo", "--steps", "30", "--port", "0", *args, timeout=60)
    assert r.returncode == 2, r
    assert "--nan-rank" in r.stderr and words in r.stderr, r.stderr


# -- gradwatch demo with torchrun -----------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_demo_shows_an_injected_nan_step() -> None:
    r = run_cli("demo", "--steps", "30", "--nan-at", "20", "--port", "0", timeout=90)
    print(f"demo took {r.seconds:.1f}s")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = r.stdout
    assert "Traceback" not in out + r.stderr
    # progress lines (non-TTY): the injected step itself, with its NaN norm
    assert any(
        line.startswith("step 20/30") and "global norm nan" in line for line in out.splitlines()
    ), out
    assert "non-finite steps 1" in out
    # the summary (from the job's record) and the endpoint's own counter (final scrape)
    assert "gradwatch demo finished: 30 steps on 2 ranks" in out
    assert "non-finite steps: 1 (step 20)" in out
    assert "gradwatch_nonfinite_steps_total 1," in out
    assert "gradwatch_collections_total 30" in out
    # the job turns update_stats on: the progress lines and the summary show the update
    assert "updates at step 29: weight norm " in out, out
    assert any(
        line.startswith("step ") and " | updates: ratio " in line for line in out.splitlines()
    ), out
    # how long it runs and how to keep the endpoint: said first, and again at the end
    lines = out.splitlines()
    assert lines[0].startswith("gradwatch demo: 30 steps on 2 ranks, about 4 s of training")
    assert "--linger SECONDS keeps it serving" in lines[0], lines[0]
    assert "closes now; to keep it serving after the last step, run with --linger" in lines[-1]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_demo_guard_skips_the_injected_nan_step() -> None:
    """--guard: the job steps through watch.guard(); the NaN step is skipped on every rank
    (training goes on healthy), and the summary and the endpoint say so."""
    r = run_cli(
        "demo", "--steps", "30", "--nan-at", "20", "--guard", "--port", "0",
        "--step-sleep", "0.02", timeout=90,
    )  # fmt: skip
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = r.stdout
    assert "guard-skipped steps: 1 (step 20) (optimizer update not applied)" in out
    assert 'gradwatch_skipped_steps_total{reason="nonfinite"} 1' in out
    assert "non-finite steps: 1 (step 20)" in out  # only that step: the weights stayed finite


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_demo_names_the_nan_rank_as_the_origin() -> None:
    """--nan-rank 1: the NaN enters rank 1's local gradients before the all-reduce; the
    summary (the job's record) and the endpoint (final scrape) name rank 1, and the live line
    too."""
    r = run_cli(
        "demo", "--steps", "12", "--nan-at", "5", "--nan-rank", "1", "--port", "0",
        "--step-sleep", "0.02", timeout=90,
    )  # fmt: skip
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    out = r.stdout
    assert "non-finite steps: 1 (step 5)" in out
    assert "non-finite origin at step 5: rank(s) 1 (local gradients" in out
    assert "endpoint: last non-finite origin (step 5): rank 1 (" in out
    assert "(last at step 5 from rank 1)" in out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_top_watches_a_lingering_demo_then_ctrl_c_stops_it(
    background: list[Background],
) -> None:
    demo = start_background(
        background,
        "demo", "--steps", "20", "--nan-at", "5", "--nan-rank", "1", "--port", "0",
        "--step-sleep", "0.02", "--linger", "60",
    )  # fmt: skip
    url = demo.wait_for("metrics: ", timeout=60).split("metrics: ", 1)[1].strip()
    demo.wait_for("for 60s more", timeout=60)  # training done; still serving

    body = urllib.request.urlopen(url, timeout=5).read().decode()
    assert parse_exposition(body).nonfinite_steps >= 1

    r = run_cli("top", url, "--count", "2", "--interval", "0.3", timeout=60)
    assert r.returncode == 0, r
    assert r.stdout.count("--- refresh") == 2
    for expected in ("host", "seed", "stem (isolated)", "step 19", "non-finite steps 1"):
        assert expected in r.stdout, (expected, r.stdout)
    # the per-rank view (--nan-rank turns it on): the origin, the replica spread, the noise scale
    for expected in ("from rank 1)", "replicas: local norm min ", "outlier score ",
                     "gradient noise scale: model "):  # fmt: skip
        assert expected in r.stdout, (expected, r.stdout)

    assert job_processes(demo.proc.pid), "the demo's ranks should be running (lingering)"
    started = time.monotonic()
    os.killpg(demo.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert demo.proc.wait(30) == 130
    print(f"Ctrl-C stopped the demo in {time.monotonic() - started:.1f}s")
    deadline = time.monotonic() + 10
    while job_processes(demo.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job_processes(demo.proc.pid), "ranks left behind"
    with pytest.raises(ScrapeError):
        scrape(url, timeout=1.0)
    assert "Traceback" not in "".join(demo.lines)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_demo_shows_an_injected_spike(
    background: list[Background], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--spike-at 60``: a 30x step, below the exploding threshold. Spike detection finds it
    (the seed group has trained since step 25, past its warm-up): the summary and the endpoint's
    counter name it, the job logs the warning, ``gradwatch top`` shows the counter and ``gradwatch
    plot`` of the run's history (``GRADWATCH_HISTORY_PATH``) marks it."""
    history = tmp_path / "history.jsonl"
    monkeypatch.setenv("GRADWATCH_HISTORY_PATH", str(history))
    demo = start_background(
        background,
        "demo", "--steps", "100", "--spike-at", "60", "--port", "0", "--step-sleep", "0",
        "--linger", "60",
    )  # fmt: skip
    url = demo.wait_for("metrics: ", timeout=120).split("metrics: ", 1)[1].strip()
    demo.wait_for("for 60s more", timeout=120)
    out = "".join(demo.lines)
    assert "spike steps: 1 (step 60)" in out, out
    assert "exploding steps: 0" in out, out  # 30x stays under the fixed threshold
    assert 'gradwatch_grad_norm_spikes_total{group="seed"} 1' in out, out
    # the global norm spikes too: the stage change at step 25 re-based its window, which held
    # the host phase's (higher) level before
    warning = demo.wait_for(
        "job log: gradwatch: step 60: gradient-norm spike in group 'seed'", timeout=5
    )
    assert "robust deviations" in warning, warning
    demo.wait_for("job log: gradwatch: step 60: gradient-norm spike in the global norm", 5)
    assert "typical norm" in warning

    body = urllib.request.urlopen(url, timeout=5).read().decode()
    assert parse_exposition(body).groups["seed"].spikes == 1
    r = run_cli("top", url, "--count", "1", "--interval", "0.3", timeout=60)
    assert r.returncode == 0, r
    assert "spike steps: global 1, seed 1" in r.stdout, r.stdout
    assert "spike score: global" in r.stdout, r.stdout

    os.killpg(demo.proc.pid, signal.SIGINT)
    assert demo.proc.wait(30) == 130
    r = run_cli("plot", str(history), "-o", str(tmp_path / "run.png"), timeout=120)
    assert r.returncode == 0, r
    assert "1 spike step" in r.stdout, r.stdout
    records = read_history(history)
    assert [step for step, group, _ in spike_points(records) if group == "seed"] == [60]
