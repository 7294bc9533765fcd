"""A real Prometheus server for end-to-end tests: loopback, temporary config and storage.

    with run_prometheus(["127.0.0.1:9977"], rule_files=[rules]) as prom:
        prom.wait_until(lambda: prom.query("gradwatch_step"), 20, "first scrape")
        prom.query("gradwatch_global_grad_norm")  # -> [{"metric": {...}, "value": [t, "1.5"]}]
        prom.alerts()

The server listens on a free port of 127.0.0.1, keeps its TSDB in a temporary directory, runs
in its own process group and is always stopped (SIGTERM, then SIGKILL) when the block exits,
whatever happens. Without a ``prometheus`` binary the calling test is skipped; the e2e guard in
conftest.py turns skipped e2e tests into a failure when ``REQUIRE_E2E=1`` (CI).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest
import yaml

DEFAULT_JOB = "gradwatch"


def prometheus_binary() -> str | None:
    """Path of the ``prometheus`` binary, or None."""
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (callers retry on a race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_can_be_bound(port: int) -> bool:
    """True if ``127.0.0.1:port`` can be bound and listened on right now (nothing holds it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy; return it. Exceptions count as
    "not yet" (connection refused, a series not scraped yet); the last one is reported."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
        except Exception as exc:
            last_error, value = exc, None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what} (last error: {last_error!r})"
            )
        time.sleep(every)


def sample_value(sample: dict[str, Any]) -> float:
    """The float of one instant-vector element of the query API (``"NaN"``/``"+Inf"`` too)."""
    return float(sample["value"][1])


class PromServer:
    """Handle on a running Prometheus. Thread-safe (each call is one HTTP request)."""

    def __init__(self, url: str, workdir: Path, log_path: Path, pid: int | None = None) -> None:
        self.url = url
        self.workdir = workdir
        self.log_path = log_path
        self.pid = pid  # the Prometheus process (a test may pause it: SIGSTOP/SIGCONT)

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns ``data``. An HTTP 4xx/5xx becomes an AssertionError
        carrying Prometheus's own error message (e.g. a PromQL parse error)."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            body = json.loads(http_get(f"{self.url}/api/v1/{path}{query}"))
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path} {params}: {exc} {exc.read().decode()}") from exc
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the result list of an instant vector (``at``: evaluation time)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = repr(at)
        data = self.api("query", **params)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of ``expr``, None when it has no result; more than one fails."""
        result = self.query(expr, at)
        if not result:
            return None
        assert len(result) == 1, (expr, result)
        return sample_value(result[0])

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def rules(self) -> list[dict[str, Any]]:
        return self.api("rules")["groups"]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str = "") -> Any:
        return wait_for(predicate, timeout, what or "a Prometheus condition")

    def wait_for_value(self, expr: str, expected: float, timeout: float = 20.0) -> float:
        """Wait until the single value of ``expr`` equals ``expected`` (NaN equals NaN)."""

        def matches() -> bool:
            got = self.value(expr)
            return got is not None and (
                got == expected or (math.isnan(got) and math.isnan(expected))
            )

        self.wait_until(matches, timeout, f"{expr} == {expected!r}")
        return expected

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_torchrun(
    script_args: Sequence[str], env: dict[str, str], log: Path, cwd: Path, nproc: int = 2
) -> subprocess.Popen[bytes]:
    """``python -m torch.distributed.run`` on loopback (no restarts) in a new session, its
    output in ``log``; stop it with :func:`stop_group`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={nproc}",
                "--max_restarts=0",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                *script_args,
            ],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def stop_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """Stop a process started with start_new_session=True, and its group."""
    if proc.poll() is None:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> bool:
    """True once /-/ready answers, False if the process exited first; raises on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with suppress(OSError):  # connection refused, reset: not listening yet
            if "Ready" in http_get(f"{url}/-/ready", 1.0):
                return True
        time.sleep(0.1)
    raise AssertionError(f"prometheus was not ready within {timeout:g} s")


@contextmanager
def run_prometheus(
    scrape_targets: Sequence[str],
    rule_files: Sequence[str | os.PathLike[str]] = (),
    interval: str = "1s",
    *,
    job: str = DEFAULT_JOB,
    scheme: str = "http",
    tls_config: dict[str, Any] | None = None,
    basic_auth: dict[str, str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    startup_timeout: float = 30.0,
    file_sd_files: Sequence[str] = (),
    flags: Sequence[str] = (),
) -> Iterator[PromServer]:
    """Run Prometheus scraping ``scrape_targets`` (``host:port``) as job ``job`` every
    ``interval`` (scrape and rule evaluation), with ``rule_files`` loaded; ``scheme``,
    ``tls_config`` and ``basic_auth`` go into the scrape config as Prometheus spells them.
    ``file_sd_files`` (globs) adds a ``file_sd_configs`` entry refreshed every ``interval``;
    ``flags`` are extra command-line flags (``--enable-feature=exemplar-storage``).

    ``workdir`` (default: a temporary directory, removed afterwards) holds the config, the
    TSDB and the log. The process is killed on exit from the block, and its log tail is
    printed when the block raises.
    """
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus)")
    with tempfile.TemporaryDirectory(prefix="gradwatch-prom-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        scrape: dict[str, Any] = {
            "job_name": job,
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "scheme": scheme,
            "static_configs": [{"targets": list(scrape_targets)}],
        }
        if file_sd_files:
            scrape["file_sd_configs"] = [
                {"files": list(file_sd_files), "refresh_interval": interval}
            ]
        if tls_config is not None:
            scrape["tls_config"] = tls_config
        if basic_auth is not None:  # {"username": ..., "password": ...}
            scrape["basic_auth"] = basic_auth
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(Path(f).resolve()) for f in rule_files],
            "scrape_configs": [scrape],
        }
        config_file = root / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        log_path = root / "prometheus.log"
        proc: subprocess.Popen[bytes] | None = None
        try:
            for attempt in range(3):  # the free port may be taken before Prometheus binds it
                port = free_port()
                with open(log_path, "ab") as log:
                    proc = subprocess.Popen(
                        [
                            binary,
                            f"--config.file={config_file}",
                            f"--storage.tsdb.path={root / 'tsdb'}",
                            f"--web.listen-address=127.0.0.1:{port}",
                            "--log.level=warn",
                            *flags,
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                server = PromServer(f"http://127.0.0.1:{port}", root, log_path, proc.pid)
                if _wait_ready(proc, server.url, startup_timeout):
                    break
                if attempt == 2:
                    raise AssertionError(
                        f"prometheus exited with {proc.returncode}:\n{server.log_tail()}"
                    )
                # Exited early: most likely another process took the port; try another one.
            try:
                yield server
            except BaseException:
                print(f"--- prometheus log ({log_path}) ---\n{server.log_tail()}")
                raise
        finally:
            if proc is not None:
                stop_group(proc)
