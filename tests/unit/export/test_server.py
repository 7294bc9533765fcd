"""The exporter process: scrapes cost the training process nothing per request, and the process
dies with the job (no orphan, port released) and is replaced if it dies alone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from promserver import port_can_be_bound

from gradwatch.config import WatchConfig
from gradwatch.export import MetricsServer
from gradwatch.export import http as export_http
from gradwatch.snapshot import GroupStats, Snapshot

SRC = Path(__file__).resolve().parents[3] / "src"

pytestmark = pytest.mark.timeout(120)


def snapshot(step: int) -> Snapshot:
    return Snapshot(
        step=step,
        global_norm=1.5,
        groups={"other": GroupStats(norm=1.5, numel=10, tensors=1)},
        health=1.0,
        timestamp=1000.0 + step,
    )


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    s = MetricsServer(
        WatchConfig(port=0, bind_address="127.0.0.1"), world_size=1, parallelism="single"
    )
    try:
        yield s
    finally:
        s.close()


def get(url: str, source: str = "127.0.0.1", timeout: float = 10.0) -> bytes:
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(
        parts.hostname, parts.port, timeout=timeout, source_address=(source, 0)
    )
    try:
        conn.request("GET", parts.path)
        response = conn.getresponse()
        assert response.status in (200, 429), response.status
        return response.read()
    finally:
        conn.close()


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1:2] == ["Z"] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


def test_scrapes_cost_renders_per_change_not_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 scrapes of one published step render it once: requests are served by the exporter
    process, and no thread of the training process handles them."""
    renders = [0]
    real = export_http.generate_latest

    def counting(registry):  # type: ignore[no-untyped-def]
        renders[0] += 1
        return real(registry)

    monkeypatch.setattr(export_http, "generate_latest", counting)
    s = MetricsServer(
        WatchConfig(port=0, bind_address="127.0.0.1"), world_size=1, parallelism="single"
    )
    try:
        s.publish(snapshot(1))
        before = renders[0]
        threads_before = {t.name for t in threading.enumerate()}
        errors: list[BaseException] = []

        def client(source: str) -> None:
            try:
                for _ in range(25):
                    body = get(s.url, source)
                    assert b"gradwatch_step 1.0" in body or b"too many" in body
            except BaseException as exc:
                errors.append(exc)

        clients = [threading.Thread(target=client, args=(f"127.0.0.{i + 1}",)) for i in range(8)]
        for c in clients:
            c.start()
        names_during = {t.name for t in threading.enumerate()}
        for c in clients:
            c.join(60)
        assert not errors, errors[:3]
        assert renders[0] - before <= 1, renders[0] - before
        served_here = {n for n in names_during - threads_before if "gradwatch" in n}
        assert not served_here, served_here
        assert s._http is not None and s._http.pid not in (None, os.getpid())
    finally:
        s.close()


def test_the_exporter_process_imports_no_torch() -> None:
    code = (
        "import sys, gradwatch.export.server\n"
        "heavy = [m for m in ('torch', 'pydantic', 'prometheus_client') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


KILLED_SCRIPT = """
import os, time
from gradwatch.config import WatchConfig
from gradwatch.export import MetricsServer

server = MetricsServer(WatchConfig(port=0, bind_address="127.0.0.1"), world_size=1,
                       parallelism="single")
print(server.port, server._http.pid, flush=True)
time.sleep(600)
"""


def test_sigkill_of_the_trainer_takes_the_exporter_and_the_port_with_it() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    trainer = subprocess.Popen(
        [sys.executable, "-c", KILLED_SCRIPT], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout is not None
        port_text, pid_text = trainer.stdout.readline().split()
        port, child = int(port_text), int(pid_text)
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
        assert not gone(child) and not port_can_be_bound(port)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        deadline = time.monotonic() + 5.0
        while not (gone(child) and port_can_be_bound(port)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(child), "the exporter process outlived the trainer"
        assert port_can_be_bound(port), "the port is still held"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)


def test_a_dead_exporter_is_replaced_and_scrapes_resume(server: MetricsServer) -> None:
    server.publish(snapshot(3))
    assert server._http is not None
    first = server._http.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        pid = server._http.pid
        if pid not in (None, first):
            break
        time.sleep(0.05)
    assert server._http.pid not in (None, first)
    # Scrapes queued in the listen backlog meanwhile are answered, with the current step.
    with urllib.request.urlopen(server.url, timeout=15) as response:
        assert b"gradwatch_step 3.0" in response.read()
    server.publish(snapshot(4))
    with urllib.request.urlopen(server.url, timeout=15) as response:
        assert b"gradwatch_step 4.0" in response.read()


def test_close_stops_the_exporter_process(server: MetricsServer) -> None:
    assert server._http is not None
    pid, port = server._http.pid, server.port
    assert pid is not None and port is not None
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 5.0
    assert gone(pid) and port_can_be_bound(port)


def test_a_stuck_exporter_never_blocks_publishing_and_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGSTOP the exporter process: publishing goes on (nothing waits on the pipe but the
    exporter thread, for at most SEND_TIMEOUT), then the stuck process is replaced."""
    monkeypatch.setattr(export_http, "_PIPE_SIZE", 4096)  # the smallest pipe: fills at once
    monkeypatch.setattr(export_http, "SEND_TIMEOUT", 0.5)
    s = MetricsServer(
        WatchConfig(port=0, bind_address="127.0.0.1", param_metrics_top_k=50),
        world_size=1,
        parallelism="single",
    )
    try:
        assert s._http is not None
        s.publish(snapshot(1))
        stuck = s._http.pid
        assert stuck is not None
        os.kill(stuck, signal.SIGSTOP)
        started = time.monotonic()
        for step in range(2, 40):
            s.submit(_Ready(snapshot(step)))
            assert s._publisher.flush(5.0)  # the publisher never waits for the exporter
            time.sleep(0.02)
        assert time.monotonic() - started < 10.0
        deadline = time.monotonic() + 15.0
        while s._http.pid in (None, stuck) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s._http.pid not in (None, stuck), "the stuck exporter was not replaced"
        assert gone(stuck)
        assert s.flush(15.0)
        with urllib.request.urlopen(s.url, timeout=15) as response:
            assert b"gradwatch_step 39.0" in response.read()
    finally:
        s.close()


class _Ready:
    def __init__(self, snap: Snapshot) -> None:
        self.step = snap.step
        self._snap = snap

    def result(self) -> Snapshot:
        return self._snap


# -- connection bounds: per client and in all; idle connections never keep a scrape out -------

IDLE_CONNECTIONS = 2100


@pytest.mark.timeout(180)
def test_scrapes_succeed_under_thousands_of_idle_connections_from_one_address(
    server: MetricsServer,
) -> None:
    """2,100 connections from 127.0.0.1 that never send a request, then 30 scrapes from the
    same address: the scrapes are served (idle connections beyond the per-client bound are
    closed, the oldest first, to make room). Loopback only, bounded, everything closed."""
    import socket

    from gradwatch.export.server import MAX_CONNECTIONS_PER_CLIENT

    server.publish(snapshot(1))
    get(server.url)  # the exporter is up and serving
    host, port = "127.0.0.1", server.port
    assert port is not None
    idle: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        for _ in range(IDLE_CONNECTIONS):
            if time.monotonic() > deadline:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            idle.append(sock)
            sock.settimeout(2.0)
            with contextlib.suppress(OSError):
                sock.connect((host, port))
        assert len(idle) == IDLE_CONNECTIONS, "could not open the idle connections in time"
        ok = 0
        for _ in range(30):
            with contextlib.suppress(OSError, AssertionError):
                ok += b"gradwatch_step 1.0" in get(server.url, "127.0.0.1", timeout=10.0)
        assert ok >= 27, f"{ok} of 30 scrapes served under {IDLE_CONNECTIONS} idle connections"
        # the idle ones were bounded: at most the per-client bound is still held open
        still_open = 0
        for sock in idle:
            sock.setblocking(False)
            try:
                still_open += sock.recv(1) == b"" and 0
            except BlockingIOError:
                still_open += 1  # nothing to read and not closed: held by the server
            except OSError:
                pass  # reset by the server
        assert still_open <= MAX_CONNECTIONS_PER_CLIENT + 5, still_open
    finally:
        for sock in idle:
            sock.close()


def test_connection_limits_evict_idle_connections_first() -> None:
    from gradwatch.export.server import ConnectionLimits

    class Fake:
        def __init__(self) -> None:
            self.idle = True
            self.aborted = False

        def abort(self) -> None:
            self.aborted = True

    limits = ConnectionLimits(total=4, per_client=2)
    a1, a2, a3 = Fake(), Fake(), Fake()
    assert limits.open("a", a1) and limits.open("a", a2)  # type: ignore[arg-type]
    assert limits.open("a", a3) and a1.aborted and not a2.aborted  # type: ignore[arg-type]
    a2.idle = a3.idle = False  # both sent their request: not evictable
    assert not limits.open("a", Fake())  # type: ignore[arg-type]
    b = [Fake() for _ in range(3)]
    assert limits.open("b", b[0]) and limits.open("b", b[1])  # type: ignore[arg-type]
    # the total (4) is reached: a new client evicts an idle one of the client holding the most
    assert limits.open("c", b[2]) and b[0].aborted  # type: ignore[arg-type]
    assert limits.open_connections == 4
    limits.close("a", a1)  # already evicted: no double count
    limits.close("a", a2)
    assert limits.open_connections == 3 and limits.evicted == 2
