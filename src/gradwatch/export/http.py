"""The endpoint, training-process side: bind, then feed an exporter process that serves.

:class:`HTTPEndpoint` binds the listening socket in the caller's thread (so a taken port raises
:class:`~gradwatch.errors.PortInUseError` at construction) and hands it to a small child
process, :mod:`gradwatch.export.server`, which does all the HTTP work (TLS, authentication,
per-client limits) outside this interpreter. What a scrape costs the training process is then
bounded by the number of changes, not of requests: a daemon thread (``gradwatch-exporter``)
renders the registry (both exposition formats) when its version changed, at most every
``RENDER_INTERVAL`` seconds, and sends the bytes down a pipe; any number of scrapes serve the
last one. The exposition is therefore as of the last published step (and the self-stats as of
that render).

The child dies with the job: it exits at EOF on its stdin (the pipe closes when this process
dies) and on Linux gets SIGTERM when the thread that started it ends (``PR_SET_PDEATHSIG``).
If it dies while the job runs, the listening socket (still held here) queues connections
while a new one is started, after a delay that grows with repeated failures. A child that
does not take a new exposition within ``SEND_TIMEOUT`` seconds is replaced the same way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import IO

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gradwatch.config import WatchConfig
from gradwatch.errors import PortInUseError
from gradwatch.export.server import FRAME_HEADER, LISTEN_BACKLOG, SEQ, encode_exposition
from gradwatch.export.webconfig import WebSettings, web_settings

__all__ = ["RENDER_INTERVAL", "SEND_TIMEOUT", "HTTPEndpoint"]

# One logger for the whole exporter: users filter or silence "gradwatch.export".
log = logging.getLogger("gradwatch.export")

#: The exposition is rendered at most this often (and only when something changed), so fast
#: steps cost at most a few renders a second whatever the scrapers do.
RENDER_INTERVAL = 0.1
#: A child that cannot take a new exposition for this long is stuck: it is replaced.
SEND_TIMEOUT = 2.0
#: Delays before restarting a child that died, growing with consecutive failures.
RESTART_DELAYS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# The exporter process runs gradwatch.export.server from this very gradwatch package (the one
# this process imported, wherever it came from), without adding anything to sys.path.
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
_BOOTSTRAP = """\
import importlib.util, sys
root = sys.argv[1]
spec = importlib.util.spec_from_file_location(
    "gradwatch", root + "/__init__.py", submodule_search_locations=[root])
module = importlib.util.module_from_spec(spec)
sys.modules["gradwatch"] = module
spec.loader.exec_module(module)
from gradwatch.export.server import main
sys.exit(main(sys.argv[2:]))
"""
# The pipe holds a few expositions, so a child busy for a moment never makes a send wait.
_PIPE_SIZE = 1 << 20


def _bind(cfg: WatchConfig) -> socket.socket:
    """Bind and listen in the caller's thread; a taken port raises :class:`PortInUseError`."""
    port = int(cfg.port or 0)
    infos = socket.getaddrinfo(
        cfg.bind_address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds at once
        sock.bind((sockaddr[0], port, *sockaddr[2:]))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            err = PortInUseError(
                f"gradwatch: cannot serve metrics on {cfg.bind_address}:{port}: port {port} is "
                "already in use (another job or a GradWatch that was not closed?). Choose "
                "another port with GRADWATCH_PORT (or WatchConfig(port=...)), or 0 for an "
                "ephemeral one."
            )
            err.errno = errno.EADDRINUSE
            raise err from exc
        raise OSError(
            exc.errno,
            f"gradwatch: cannot serve metrics on {cfg.bind_address}:{port} "
            f"(GRADWATCH_BIND_ADDRESS / GRADWATCH_PORT): {exc.strerror}",
        ) from exc
    return sock


def _url(sock: socket.socket, tls: bool) -> tuple[str, int]:
    host, port = sock.getsockname()[:2]
    address = ipaddress.ip_address(host)
    if address.is_unspecified:  # 0.0.0.0 / ::: reachable locally through the loopback
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    shown = f"[{address}]" if address.version == 6 else str(address)
    return f"{'https' if tls else 'http'}://{shown}:{port}/metrics", int(port)


class HTTPEndpoint:
    """Serves ``registry`` at ``http(s)://host:port/metrics`` from an exporter process.

    Construction checks the TLS and authentication settings
    (:func:`~gradwatch.export.webconfig.web_settings`; a bad file raises
    :class:`~gradwatch.errors.GradWatchError` before any port is taken), binds in the caller's
    thread (``cfg.port``; 0 = ephemeral; a taken port raises
    :class:`~gradwatch.errors.PortInUseError`) and starts the exporter process. ``version`` is
    the Collector's change counter: equal versions render equal bytes.

    Attributes:
        url: ``http(s)://host:port/metrics``; ``host`` is the bound address (loopback when
            bound to all interfaces).
        port: the bound TCP port (an ephemeral one resolved).
    """

    def __init__(
        self, cfg: WatchConfig, registry: CollectorRegistry, version: Callable[[], Hashable]
    ) -> None:
        settings = web_settings(cfg)
        self._sock = _bind(cfg)
        try:
            self.url, self.port = _url(self._sock, settings.tls is not None)
            self._feed = _Feed(self._sock, settings, registry, version)
        except BaseException:
            self._sock.close()  # a failed construction holds no port
            raise

    @property
    def pid(self) -> int | None:
        """Process id of the current exporter process (None between two)."""
        return self._feed.pid

    def sync(self, timeout: float) -> bool:
        """Wait until the exporter process serves what the registry shows now; False on
        timeout (e.g. the process is being restarted)."""
        return self._feed.sync(timeout)

    def close(self, timeout: float) -> None:
        """Stop the exporter process and release the port, within about ``timeout`` seconds."""
        try:
            self._feed.close(timeout)
        finally:
            self._sock.close()


class _Feed:
    """The exporter process and the ``gradwatch-exporter`` thread that feeds it.

    The thread starts the process (so ``PR_SET_PDEATHSIG`` follows this thread, which lives as
    long as the endpoint), renders on change and sends frames with bounded waits; one
    ``gradwatch-exporter-acks`` thread per process reads its acknowledgements, blocked in a
    system call (no GIL time). :meth:`sync` and :meth:`close` may be called from any thread.
    """

    def __init__(
        self,
        sock: socket.socket,
        settings: WebSettings,
        registry: CollectorRegistry,
        version: Callable[[], Hashable],
    ) -> None:
        self._sock = sock
        self._settings = settings
        self._registry = registry
        self._version = version
        self._cond = threading.Condition()
        self._stopping = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._alive = False  # the current process has not hung up
        self._seq = 0  # last exposition sent
        self._acked = 0  # last exposition the process serves
        self._sync_wanted = 0
        self._sync_done = 0
        self._sync_taken = 0  # syncs the thread has taken up
        self._sync_pending: list[tuple[int, int]] = []  # (seq to be acked, sync number)
        self._failures = 0
        self._logged: set[str] = set()
        started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="gradwatch-exporter", daemon=True
        )
        self._thread.start()
        started.wait(30.0)
        if self._start_error is not None:
            self.close(1.0)
            raise self._start_error

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    # -- callers --------------------------------------------------------------------------------

    def sync(self, timeout: float) -> bool:
        with self._cond:
            if self._stopping:
                return False
            self._sync_wanted += 1
            target = self._sync_wanted
            self._cond.notify_all()
            return bool(
                self._cond.wait_for(
                    lambda: self._sync_done >= target or self._stopping, max(timeout, 0.0)
                )
                and self._sync_done >= target
            )

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        proc = self._proc
        if proc is not None:
            _terminate(proc)  # a send blocked on it fails at once
        if threading.current_thread() is not self._thread:
            self._thread.join(max(deadline - time.monotonic(), 0.2))
        proc = self._proc  # the thread may have started another one meanwhile
        if proc is not None:
            _terminate(proc)
            _reap(proc, max(deadline - time.monotonic(), 0.5))

    # -- the thread -------------------------------------------------------------------------------

    def _run(self, started: threading.Event) -> None:
        try:
            self._start()
        except BaseException as exc:  # reported by the constructor
            self._start_error = exc
            started.set()
            return
        started.set()
        sent: list[Hashable | None] = [None]  # the version the process has (None: nothing)
        restart_at = 0.0
        try:
            while not self._stopping:
                if not self._alive:
                    if restart_at == 0.0:
                        restart_at = time.monotonic() + self._lost_process()
                    if time.monotonic() >= restart_at:
                        restart_at = 0.0
                        sent[0] = None  # a new process has nothing yet
                        try:
                            self._start()
                        except Exception as exc:
                            self._log_once("start", "could not start the exporter: %s", exc)
                            self._alive_false()
                if self._alive:
                    try:
                        self._feed_once(sent)
                    except Exception as exc:  # e.g. a render failed: keep serving the last one
                        self._log_once(f"feed:{type(exc).__name__}",
                                       "could not render the exposition: %s", exc)  # fmt: skip
                with self._cond:
                    if not self._alive and restart_at:
                        self._cond.wait_for(
                            lambda: self._stopping, max(restart_at - time.monotonic(), 0.0)
                        )
                    else:
                        self._cond.wait_for(
                            lambda: (
                                self._stopping
                                or self._sync_wanted > self._sync_taken
                                or not self._alive
                            ),
                            RENDER_INTERVAL,
                        )
                    if self._stopping:
                        return
        finally:
            proc = self._proc
            if proc is not None:
                _terminate(proc)
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()

    def _feed_once(self, sent: list[Hashable | None]) -> None:
        """Send a new exposition if the registry changed; take up pending syncs."""
        with self._cond:
            wanted = self._sync_wanted
        version = self._version()
        if version != sent[0]:
            frame = encode_exposition(
                self._seq + 1, generate_latest(self._registry), generate_openmetrics(self._registry)
            )
            if not self._send(frame):
                return  # the process is being replaced; the next one gets a fresh render
            self._seq += 1
            sent[0] = version
        with self._cond:
            self._sync_taken = max(self._sync_taken, wanted)
            if wanted > self._sync_done:
                self._sync_pending.append((self._seq, wanted))
                self._resolve()

    def _start(self) -> None:
        """Start an exporter process on the listening socket and send it its settings."""
        fd = self._sock.fileno()
        argv = [sys.executable, "-c", _BOOTSTRAP, _PACKAGE_DIR, "--fd", str(fd)]
        proc = subprocess.Popen(
            [*argv, "--parent", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(fd,),
            bufsize=0,
        )
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError, AttributeError):
            fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        os.set_blocking(proc.stdin.fileno(), False)
        with self._cond:
            self._proc, self._alive = proc, True
        settings = self._settings.to_json().encode()
        if not self._send(FRAME_HEADER.pack(b"C", len(settings)) + settings):
            raise OSError("the exporter process did not take its settings")
        threading.Thread(
            target=self._read_acks,
            args=(proc, proc.stdout),
            name="gradwatch-exporter-acks",
            daemon=True,
        ).start()

    def _send(self, data: bytes) -> bool:
        """Write one whole frame within ``SEND_TIMEOUT``; on failure stop the process."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        fd = proc.stdin.fileno()
        view = memoryview(data)
        deadline = time.monotonic() + SEND_TIMEOUT
        try:
            while view:
                try:
                    n = os.write(fd, view)
                    view = view[n:]
                    continue
                except BlockingIOError:
                    pass
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    break
                select.select([], [fd], [], min(left, RENDER_INTERVAL))
        except OSError:  # EPIPE: the process died
            pass
        if view:
            # A frame cut short would corrupt the stream: this process is done for.
            if proc.poll() is None and not self._stopping:
                self._log_once("stuck", "the exporter process is not taking expositions; "
                               "replacing it")  # fmt: skip
            _terminate(proc)
            self._alive_false()
            return False
        return True

    def _read_acks(self, proc: subprocess.Popen[bytes], stream: IO[bytes]) -> None:
        try:
            while True:
                data = stream.read(SEQ.size)
                if not data or len(data) < SEQ.size:
                    break
                (seq,) = SEQ.unpack(data)
                with self._cond:
                    self._acked = max(self._acked, seq)
                    self._failures = 0  # it works: a later failure restarts quickly again
                    self._resolve()
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                stream.close()
            with self._cond:
                if self._proc is proc:
                    self._alive = False
                self._cond.notify_all()

    def _resolve(self) -> None:
        """Mark done the syncs whose exposition is acknowledged (holding ``_cond``)."""
        still = []
        for seq, number in self._sync_pending:
            if seq <= self._acked:
                self._sync_done = max(self._sync_done, number)
            else:
                still.append((seq, number))
        self._sync_pending = still
        self._cond.notify_all()

    def _alive_false(self) -> None:
        with self._cond:
            self._alive = False
            self._cond.notify_all()

    def _lost_process(self) -> float:
        """Reap the dead process, log, and return the delay before the next one."""
        if self._stopping:  # closing: the process was stopped on purpose
            return 0.0
        proc = self._proc
        code = None
        if proc is not None:
            _terminate(proc)
            _reap(proc, 1.0)
            code = proc.returncode
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        delay = RESTART_DELAYS[min(self._failures, len(RESTART_DELAYS) - 1)]
        self._failures += 1
        log.warning(
            "gradwatch: the metrics exporter process exited (code %s); scrapes wait in the "
            "listen queue while another starts in %.1fs",
            code,
            delay,
        )
        return delay

    def _log_once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("gradwatch: " + message, *args)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        if proc.poll() is None:
            proc.kill()


def _reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(timeout, 0.0))
