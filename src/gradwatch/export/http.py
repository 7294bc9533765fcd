"""The HTTP(S) side of the endpoint: bind, TLS, the scrape bound, the cache and the server.

:class:`HTTPEndpoint` serves one registry from a daemon thread (``gradwatch-http``) and one
thread per request. It knows nothing of snapshots: what a scrape shows is the Collector's
business (:mod:`gradwatch.export.collector`). What it adds to prometheus_client's WSGI app is
the cost bound: equal collector versions render once (a cache), and at most
``MAX_SCRAPES_PER_SECOND`` scrapes are served, so scrapers cannot take more than a few percent
of the training process's time (:class:`ScrapeApp`).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Hashable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

from gradwatch.config import WatchConfig
from gradwatch.errors import GradWatchError, PortInUseError

__all__ = [
    "MAX_SCRAPES_PER_SECOND",
    "MAX_SCRAPE_WAIT",
    "PROMETHEUS_USER_AGENT",
    "SCRAPE_BURST",
    "HTTPEndpoint",
    "RateLimit",
    "ScrapeApp",
]

# One logger for the whole exporter: users filter or silence "gradwatch.export".
log = logging.getLogger("gradwatch.export")

#: The endpoint serves at most this many scrapes per second (bursts of ``SCRAPE_BURST``); more
#: wait their turn. Prometheus scrapes every 15-60 s, an HA pair, Grafana and `gradwatch top`
#: stay far below this, so only a runaway client ever waits. A served scrape costs the training
#: process Python time under the GIL, plus its HTTP threads' wake-ups; the bound keeps steps at
#: most 5% slower with back-to-back scrapers (measured in docs/performance.md), hence 5/s.
MAX_SCRAPES_PER_SECOND = 5.0
SCRAPE_BURST = 5
#: Requests whose User-Agent starts with this (Prometheus's own scrapes) bypass the bound.
PROMETHEUS_USER_AGENT = "Prometheus/"
#: A request that would wait longer than this for its turn gets 503 at once instead of piling
#: up threads (at 5/s that is 25 requests queued).
MAX_SCRAPE_WAIT = 5.0

# A request thread that cannot read its request (a stalled client, a half-done TLS handshake)
# gives up after this long, so it cannot pile up threads forever.
_REQUEST_TIMEOUT = 30.0


class RateLimit:
    """At most ``rate`` grants per second on average, bursts of ``burst`` (GCRA).

    Thread-safe. :meth:`reserve` books the next free slot and says how long to wait for it;
    callers sleep outside the lock, so waiting requests cost no CPU and are served in order.
    """

    def __init__(self, rate: float, burst: int, max_wait: float) -> None:
        self._interval = 1.0 / rate
        self._tolerance = self._interval * max(burst - 1, 0)
        self._max_wait = max_wait
        self._lock = threading.Lock()
        self._due = time.monotonic()

    def reserve(self) -> float | None:
        """Seconds to wait before serving, or None when that would exceed ``max_wait``."""
        with self._lock:
            now = time.monotonic()
            due = max(self._due, now)  # theoretical time of this grant without bursts
            wait = max(due - self._tolerance - now, 0.0)
            if wait > self._max_wait:
                return None
            self._due = due + self._interval
            return wait


class ScrapeApp:
    """WSGI app: prometheus_client's, behind a rate bound and a rendered-exposition cache.

    Thread-safe (one thread per request). Why both: a scrape costs the serving process Python
    time (about half rendering, half HTTP), taken under the GIL from the training thread.
    Equal collector versions render equal bytes, so between two steps any number of scrapes
    render once; and at most ``MAX_SCRAPES_PER_SECOND`` are served, so even clients scraping
    back to back cannot take more than a few percent of the training thread's time. Requests
    with a query string (``name[]`` filters) bypass the cache.
    """

    def __init__(self, registry: CollectorRegistry, version: Callable[[], Hashable]) -> None:
        self._inner = make_wsgi_app(registry)
        self._version = version
        self._limit = RateLimit(MAX_SCRAPES_PER_SECOND, SCRAPE_BURST, MAX_SCRAPE_WAIT)
        self._lock = threading.Lock()
        self._cache_version: Hashable | None = None
        self._cache: dict[tuple[str, str], tuple[str, list[tuple[str, str]], bytes]] = {}

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        # Prometheus itself (its User-Agent) is never queued behind other clients: its scrapes
        # are already paced by its scrape_interval, and a queue filled by a runaway client must
        # not push them past their scrape_timeout (the series would go stale and page).
        if not environ.get("HTTP_USER_AGENT", "").startswith(PROMETHEUS_USER_AGENT):
            wait = self._limit.reserve()
            if wait is None:
                start_response("503 Service Unavailable", [("Retry-After", "1")])
                return [b"gradwatch: too many scrapes, retry later\n"]
            if wait > 0:
                time.sleep(wait)
        if environ.get("REQUEST_METHOD") != "GET" or environ.get("QUERY_STRING"):
            return self._inner(environ, start_response)
        # The version is read before rendering: a body rendered later is never older than its key.
        version = self._version()
        key = (environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""))
        with self._lock:
            hit = self._cache.get(key) if self._cache_version == version else None
        if hit is None:
            captured: list[Any] = []

            def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
                captured[:] = [status, list(headers)]
                return lambda data: None  # make_wsgi_app returns its body, never writes

            body = b"".join(self._inner(environ, capture))
            hit = (captured[0], captured[1], body)
            if hit[0].startswith("200"):
                with self._lock:
                    if self._cache_version != version:
                        self._cache_version, self._cache = version, {}
                    if len(self._cache) < 16:  # distinct Accept headers: a handful in practice
                        self._cache[key] = hit
        status, headers, body = hit
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return [body]


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (one line per scrape would flood the training log)."""

    timeout = _REQUEST_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HTTPServer(ThreadingMixIn, WSGIServer):
    """One daemon thread per request: a slow scrape never queues the others, nor holds exit."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up or fails the TLS handshake is its own problem: never print a
        # traceback into the training log (socketserver's default).
        log.debug("gradwatch: scrape from %s failed", client_address, exc_info=True)


def _tls_context(cfg: WatchConfig) -> ssl.SSLContext | None:
    """Load the TLS files before binding, so a bad certificate holds no port."""
    if cfg.certfile is None or cfg.keyfile is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile=str(cfg.certfile), keyfile=str(cfg.keyfile))
        if cfg.client_cafile is not None:
            ctx.load_verify_locations(cafile=str(cfg.client_cafile))
            ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: no client certificate, no scrape
    except (ssl.SSLError, OSError) as exc:
        raise GradWatchError(
            f"gradwatch: cannot load the TLS files of the metrics endpoint (certfile="
            f"{cfg.certfile}, keyfile={cfg.keyfile}, client_cafile={cfg.client_cafile}): {exc}"
        ) from exc
    return ctx


def _bind(cfg: WatchConfig, app: Callable[..., Any], tls: ssl.SSLContext | None) -> _HTTPServer:
    """Bind in the caller's thread; a taken port raises :class:`PortInUseError`.

    Built from ``make_wsgi_app`` and wsgiref rather than ``prometheus_client.start_http_server``
    for two reasons: the TLS context is loaded before the port is taken, and the TLS handshake
    runs in the request's thread (``do_handshake_on_connect=False``), whereas wrapping the
    listening socket makes ``accept()`` do the handshake, so one silent client would stall
    every scrape.
    """
    port = int(cfg.port or 0)
    infos = socket.getaddrinfo(
        cfg.bind_address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _, _, _, sockaddr = infos[0]
    server_class = type("_BoundHTTPServer", (_HTTPServer,), {"address_family": family})
    try:
        httpd = server_class((sockaddr[0], port), _QuietHandler)
    except OSError as exc:
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
    httpd.set_app(app)
    if tls is not None:
        httpd.socket = tls.wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    return httpd


def _url(httpd: _HTTPServer, tls: bool) -> tuple[str, int]:
    host, port = httpd.server_address[:2]
    address = ipaddress.ip_address(host)
    if address.is_unspecified:  # 0.0.0.0 / ::: reachable locally through the loopback
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    shown = f"[{address}]" if address.version == 6 else str(address)
    return f"{'https' if tls else 'http'}://{shown}:{port}/metrics", int(port)


class HTTPEndpoint:
    """Serves ``registry`` at ``http(s)://host:port/metrics`` from a daemon thread.

    Construction loads the TLS files (``certfile``/``keyfile``/``client_cafile``; a bad one
    raises :class:`~gradwatch.errors.GradWatchError` before any port is taken), binds in the
    caller's thread (``cfg.port``; 0 = ephemeral; a taken port raises
    :class:`~gradwatch.errors.PortInUseError`) and starts serving. ``version`` is the
    Collector's change counter, the key of the rendered-exposition cache.

    Attributes:
        url: ``http(s)://host:port/metrics``; ``host`` is the bound address (loopback when
            bound to all interfaces).
        port: the bound TCP port (an ephemeral one resolved).
    """

    def __init__(
        self, cfg: WatchConfig, registry: CollectorRegistry, version: Callable[[], Hashable]
    ) -> None:
        tls = _tls_context(cfg)
        self._httpd = _bind(cfg, ScrapeApp(registry, version), tls)
        try:
            self.url, self.port = _url(self._httpd, tls is not None)
            self._thread = threading.Thread(
                target=self._httpd.serve_forever,
                kwargs={"poll_interval": 0.25},  # bounds how long close() waits for the loop
                name="gradwatch-http",
                daemon=True,
            )
            self._thread.start()
        except BaseException:
            self._httpd.server_close()  # a failed construction holds no port
            raise

    def close(self, timeout: float) -> None:
        """Stop serving and release the port, waiting at most about ``timeout`` seconds."""
        deadline = time.monotonic() + max(timeout, 0.0)
        # shutdown() waits for serve_forever() to notice; do it in a helper thread so a wedged
        # server cannot hold close() (or interpreter exit) longer than the deadline.
        stopper = threading.Thread(
            target=self._httpd.shutdown, name="gradwatch-http-stop", daemon=True
        )
        stopper.start()
        stopper.join(max(deadline - time.monotonic(), 1.0))
        self._httpd.server_close()  # releases the port even if serve_forever() is unwinding
        self._thread.join(max(deadline - time.monotonic(), 0.1))
