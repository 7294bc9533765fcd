"""The exporter process: serves the rendered exposition over HTTP(S), outside the training job.

Started by :class:`gradwatch.export.http.HTTPEndpoint` as a child running :func:`main` with
``--fd N --parent PID`` (as ``python -m gradwatch.export.server`` would), the listening socket
(bound by the training process) being fd ``N``. It imports neither torch nor
prometheus_client: everything a scrape costs is paid here, at low CPU priority, never under the
training interpreter's GIL.

Protocol on its standard streams (frames: a type byte, a 4-byte big-endian length, payload):

* stdin, from the training process: first a ``C`` frame (the :class:`WebSettings` as JSON),
  then ``E`` frames, each a new exposition: an 8-byte sequence number, the 4-byte length of the
  text format, the text format (``text/plain; version=0.0.4``), then the OpenMetrics format.
* stdout, to the training process: the 8-byte sequence number of each exposition once it is
  served (what ``Publishing.flush`` waits for).

It exits when stdin reaches EOF (the training process closed it, or died) and, on Linux, when
the thread that started it dies (``PR_SET_PDEATHSIG``): it never outlives the job.

Serving, in one asyncio loop:

* **Per-client limits.** A client is an IP address. Each gets ``MAX_SCRAPES_PER_SECOND``
  (bursts of ``SCRAPE_BURST``); more wait their turn, and one that would wait over
  ``MAX_SCRAPE_WAIT`` seconds (or beyond ``MAX_INFLIGHT_PER_CLIENT`` open requests) is held
  ``REFUSE_DELAY`` seconds and gets ``429``. One client's flood only delays that client, and
  every answer costs a looping client time, not this process CPU. No client is privileged (a
  ``User-Agent`` proves nothing).
* **Bounded reads.** The request head (TLS handshake included) must arrive within
  ``HEAD_TIMEOUT`` seconds and ``MAX_HEAD_BYTES``.
* **Bounded connections, per client and in all** (:class:`ConnectionLimits`): one client holds
  at most ``MAX_CONNECTIONS_PER_CLIENT`` open connections, and at most ``MAX_CONNECTIONS`` are
  open in all. A connection beyond either bound closes the oldest connection still waiting for
  its request head (of that client, or of the client holding the most), else it is closed at
  once. Idle connections, however many and from whichever address, so never keep a scrape out:
  a scrape sends its head at once and is served, as node_exporter bounds its parallel requests
  (``--web.max-requests``) and Prometheus its connections (``--web.max-connections``).
* ``GET`` and ``HEAD`` on any path (as prometheus_client), content negotiation of the text
  format and OpenMetrics, gzip, ``name[]`` filters; ``401`` with ``WWW-Authenticate: Basic``
  when basic-auth users are configured and the request does not carry a valid password
  (:class:`~gradwatch.export.webconfig.BasicAuth`: bcrypt, successful checks cached).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import os
import signal
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import BinaryIO
from urllib.parse import parse_qs, urlsplit

from gradwatch.export.webconfig import BasicAuth, WebSettings, tls_context

__all__ = [
    "HEAD_TIMEOUT",
    "LISTEN_BACKLOG",
    "MAX_CONNECTIONS",
    "MAX_CONNECTIONS_PER_CLIENT",
    "MAX_INFLIGHT_PER_CLIENT",
    "MAX_SCRAPES_PER_SECOND",
    "MAX_SCRAPE_WAIT",
    "REFUSE_DELAY",
    "SCRAPE_BURST",
    "ClientLimits",
    "ConnectionLimits",
    "RateLimit",
    "main",
]

#: Each client (IP address) is served at most this many scrapes per second on average, in
#: bursts of ``SCRAPE_BURST``; more wait their turn. Prometheus scrapes every 15-60 s, Grafana
#: and ``gradwatch top`` about once a second: only a runaway client ever waits.
MAX_SCRAPES_PER_SECOND = 5.0
SCRAPE_BURST = 5
#: A request that would wait longer than this for its client's turn is refused (``429``).
MAX_SCRAPE_WAIT = 5.0
#: Refusals are sent after this delay, so a client looping on them spins slowly.
REFUSE_DELAY = 1.0
#: Open requests one client may have; more are refused like an exceeded rate.
MAX_INFLIGHT_PER_CLIENT = 64
#: Open connections in all, and per client (IP address): see :class:`ConnectionLimits`.
MAX_CONNECTIONS = 2048
MAX_CONNECTIONS_PER_CLIENT = 256
#: The request line and headers (after the TLS handshake) must arrive within this many seconds
#: and this many bytes: a client sending a byte at a time cannot hold a connection for long.
HEAD_TIMEOUT = 10.0
MAX_HEAD_BYTES = 16 * 1024
#: Writing a response to a client that does not read gives up after this long.
WRITE_TIMEOUT = 10.0
#: Closing a connection (the TLS close_notify) gives up after this long.
CLOSE_TIMEOUT = 2.0
#: Connections the kernel queues before this process accepts them.
LISTEN_BACKLOG = 128
#: Nice increment of this process: the lowest priority, so that under CPU contention the
#: training job always comes first (serving a cached exposition needs little CPU; a middle
#: value still let client floods show in the step time, see docs/performance.md).
NICE = 19

FRAME_HEADER = struct.Struct(">cI")
SEQ = struct.Struct(">Q")
TEXT_LEN = struct.Struct(">I")
CONTENT_TYPE_TEXT = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_TEXT_1 = "text/plain; version=1.0.0; charset=utf-8"
CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_ESCAPINGS = ("allow-utf-8", "underscores", "dots", "values")


# -- limits ---------------------------------------------------------------------------------------


class RateLimit:
    """At most ``rate`` grants per second on average, bursts of ``burst`` (GCRA).

    :meth:`reserve` books the next free slot and says how long to wait for it; callers wait
    outside, so waiting requests cost nothing and are served in order.
    """

    def __init__(self, rate: float, burst: int, max_wait: float) -> None:
        self._interval = 1.0 / rate
        self._tolerance = self._interval * max(burst - 1, 0)
        self._max_wait = max_wait
        self._due = time.monotonic()

    @property
    def idle_since(self) -> float:
        """When this limit is back to a full burst."""
        return self._due

    def reserve(self) -> float | None:
        """Seconds to wait before serving, or None when that would exceed ``max_wait``."""
        now = time.monotonic()
        due = max(self._due, now)  # theoretical time of this grant without bursts
        wait = max(due - self._tolerance - now, 0.0)
        if wait > self._max_wait:
            return None
        self._due = due + self._interval
        return wait


@dataclass
class _Client:
    limit: RateLimit
    inflight: int = 0


@dataclass
class ClientLimits:
    """A :class:`RateLimit` and an open-request count per client address (one event loop)."""

    rate: float = MAX_SCRAPES_PER_SECOND
    burst: int = SCRAPE_BURST
    max_wait: float = MAX_SCRAPE_WAIT
    max_inflight: int = MAX_INFLIGHT_PER_CLIENT
    _clients: dict[str, _Client] = field(default_factory=dict)

    def enter(self, address: str) -> float | None:
        """Open a request of ``address``: seconds to wait, or None to refuse it.

        Every :meth:`enter` must be followed by one :meth:`leave`.
        """
        client = self._clients.get(address)
        if client is None:
            if len(self._clients) >= 4096:
                self._forget_idle()
            client = self._clients[address] = _Client(
                RateLimit(self.rate, self.burst, self.max_wait)
            )
        client.inflight += 1
        if client.inflight > self.max_inflight:
            return None
        return client.limit.reserve()

    def leave(self, address: str) -> None:
        client = self._clients.get(address)
        if client is not None:
            client.inflight -= 1

    def _forget_idle(self) -> None:
        now = time.monotonic()
        for address in [a for a, c in self._clients.items()
                        if c.inflight <= 0 and c.limit.idle_since < now]:  # fmt: skip
            del self._clients[address]


class Connection:
    """One open connection: idle (evictable) until its request head has arrived."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.idle = True

    def abort(self) -> None:
        self.writer.transport.abort()


class ConnectionLimits:
    """Open connections per client address and in all (one event loop, no lock).

    :meth:`open` admits a connection, making room when a bound is reached by closing an idle
    one (no request head yet): the client's oldest, or at the total bound the oldest of the
    largest client that has one; False when there is none to close. Every admitted
    connection is given back by :meth:`close`.
    """

    def __init__(
        self, total: int = MAX_CONNECTIONS, per_client: int = MAX_CONNECTIONS_PER_CLIENT
    ) -> None:
        self.total = total
        self.per_client = per_client
        self._held: dict[str, dict[int, Connection]] = {}  # insertion order: oldest first
        self._count = 0
        self.evicted = 0

    @property
    def open_connections(self) -> int:
        return self._count

    def open(self, address: str, conn: Connection) -> bool:
        held = self._held.setdefault(address, {})
        if len(held) >= self.per_client and not self._evict(held):
            return False
        if self._count >= self.total:
            by_size = sorted(self._held.values(), key=len, reverse=True)
            if not any(self._evict(other) for other in by_size):
                return False
        held[id(conn)] = conn
        self._count += 1
        return True

    def close(self, address: str, conn: Connection) -> None:
        held = self._held.get(address)
        if held is not None and held.pop(id(conn), None) is not None:
            self._count -= 1
            if not held:
                del self._held[address]

    def _evict(self, held: dict[int, Connection]) -> bool:
        for key, conn in held.items():
            if conn.idle:
                del held[key]
                self._count -= 1
                self.evicted += 1
                conn.abort()
                return True
        return False


# -- the exposition -------------------------------------------------------------------------------


@dataclass
class Exposition:
    """One rendered exposition in both formats; gzip and filters computed on demand."""

    seq: int
    text: bytes
    openmetrics: bytes
    _gzipped: dict[bool, bytes] = field(default_factory=dict)

    def body(self, openmetrics: bool) -> bytes:
        return self.openmetrics if openmetrics else self.text

    def gzipped(self, openmetrics: bool) -> bytes:
        out = self._gzipped.get(openmetrics)
        if out is None:
            out = self._gzipped[openmetrics] = gzip.compress(self.body(openmetrics), 6)
        return out


def filter_families(body: bytes, names: Iterable[str]) -> bytes:
    """``body`` with only the samples named ``names`` (and their families' metadata), like
    prometheus_client's ``name[]`` filter."""
    wanted = set(names)
    out: list[bytes] = []
    family: list[bytes] = []
    kept = False

    def close() -> None:
        if kept:
            out.extend(family)

    for line in body.splitlines(keepends=True):
        if line.startswith(b"# EOF"):
            close()
            family, kept = [], False
            out.append(line)
        elif line.startswith(b"# HELP "):
            close()
            family, kept = [line], False
        elif line.startswith(b"#"):
            family.append(line)
        else:
            name = line.split(b"{", 1)[0].split(b" ", 1)[0].decode()
            if name in wanted:
                family.append(line)
                kept = True
    close()
    return b"".join(out)


def negotiate(accept: str) -> tuple[bool, str]:
    """``(openmetrics, content type)`` for an ``Accept`` header, as prometheus_client does."""
    for accepted in (accept or "").split(","):
        tokens = [t.strip() for t in accepted.split(";")]
        params = dict(t.split("=", 1) for t in tokens[1:] if "=" in t)
        version = params.get("version", "")
        escaping = params.get("escaping", "underscores")
        if escaping not in _ESCAPINGS:
            escaping = "underscores"
        if tokens[0] == "application/openmetrics-text":
            if not version:
                return True, CONTENT_TYPE_OPENMETRICS
            if _version(version) >= (1, 0, 0):
                return True, (
                    f"application/openmetrics-text; version={version}; charset=utf-8; "
                    f"escaping={escaping}"
                )
        elif tokens[0] == "text/plain" and version and _version(version) >= (1, 0, 0):
            return False, f"{CONTENT_TYPE_TEXT_1}; escaping={escaping}"
    return False, CONTENT_TYPE_TEXT


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        return (0,)


# -- HTTP -----------------------------------------------------------------------------------------


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]


class BadRequest(Exception):
    pass


def parse_head(head: bytes) -> Request:
    """The request line and headers (``head`` ends with the blank line)."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as exc:  # pragma: no cover - latin-1 decodes anything
        raise BadRequest from exc
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest
        headers[name.lower()] = value.strip()
    return Request(parts[0], parts[1], headers)


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 405: "Method Not Allowed",
            429: "Too Many Requests", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}  # fmt: skip


class ExporterServer:
    """Serves the latest :class:`Exposition` on a listening socket (one asyncio loop)."""

    def __init__(self, settings: WebSettings) -> None:
        self.settings = settings
        self.exposition: Exposition | None = None  # replaced whole by the feed thread
        self.ready = threading.Event()  # set once the first exposition arrived
        self.limits = ClientLimits()
        self.connections = ConnectionLimits()
        self.auth = (
            BasicAuth(dict(settings.basic_auth_users)) if settings.basic_auth_users else None
        )

    async def serve(self, sock: socket.socket) -> None:
        ctx = tls_context(self.settings.tls) if self.settings.tls is not None else None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.ready.wait)  # connections queue in the backlog
        server = await asyncio.start_server(
            self._handle,
            sock=sock,
            ssl=ctx,
            ssl_handshake_timeout=HEAD_TIMEOUT if ctx is not None else None,
            backlog=LISTEN_BACKLOG,
            limit=MAX_HEAD_BYTES,
        )
        async with server:
            await server.serve_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        conn = Connection(writer)
        admitted = self.connections.open(address, conn)
        try:
            if admitted:
                await self._serve(reader, writer, address, conn)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client hung up, stalled or failed the handshake: its problem
        finally:
            self.connections.close(address, conn)
            writer.close()  # TLS: sends close_notify after what is buffered
            try:
                await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT)
            except (OSError, asyncio.TimeoutError, ssl.SSLError):
                writer.transport.abort()

    async def _serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        address: str,
        conn: Connection,
    ) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
            conn.idle = False  # a request: never evicted from now on
        except asyncio.LimitOverrunError:
            await self._send(writer, 431, b"request head too large\n")
            return
        try:
            request = parse_head(head)
        except BadRequest:
            await self._send(writer, 400, b"bad request\n")
            return
        wait = self.limits.enter(address)
        try:
            if wait is None:
                await asyncio.sleep(REFUSE_DELAY)
                await self._send(
                    writer,
                    429,
                    b"gradwatch: too many scrapes from this client, retry later\n",
                    [("Retry-After", "1")],
                    head_only=request.method == "HEAD",
                )
                return
            if wait > 0:
                await asyncio.sleep(wait)
            if self.auth is not None and not await self.auth.check(
                request.headers.get("authorization")
            ):
                await self._send(
                    writer,
                    401,
                    b"Unauthorized\n",
                    [("WWW-Authenticate", 'Basic realm="gradwatch"')],
                    head_only=request.method == "HEAD",
                )
                return
            await self._respond(writer, request)
        finally:
            self.limits.leave(address)

    async def _respond(self, writer: asyncio.StreamWriter, request: Request) -> None:
        if request.method == "OPTIONS":
            await self._send(writer, 200, b"", [("Allow", "OPTIONS,GET,HEAD")])
            return
        if request.method not in ("GET", "HEAD"):
            body = f"# HTTP 405: {request.method}; use OPTIONS, GET or HEAD\n".encode()
            await self._send(writer, 405, body, [("Allow", "OPTIONS,GET,HEAD")])
            return
        head_only = request.method == "HEAD"
        url = urlsplit(request.target)
        if url.path == "/favicon.ico":
            await self._send(writer, 200, b"", head_only=head_only)
            return
        exposition = self.exposition
        if exposition is None:  # pragma: no cover - serving starts after the first one
            await self._send(writer, 503, b"gradwatch: starting\n")
            return
        openmetrics, content_type = negotiate(request.headers.get("accept", ""))
        names = parse_qs(url.query).get("name[]")
        gz = any(
            part.split(";")[0].strip().lower() == "gzip"
            for part in request.headers.get("accept-encoding", "").split(",")
        )
        headers = [("Content-Type", content_type)]
        if names:
            body = filter_families(exposition.body(openmetrics), names)
            if gz:
                body = gzip.compress(body, 6)
        else:
            body = exposition.gzipped(openmetrics) if gz else exposition.body(openmetrics)
        if gz:
            headers.append(("Content-Encoding", "gzip"))
        await self._send(writer, 200, body, headers, head_only=head_only)

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        headers: Iterable[tuple[str, str]] = (),
        *,
        head_only: bool = False,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}"]
        lines += [f"{name}: {value}" for name, value in headers]
        lines += [f"{name}: {value}" for name, value in self.settings.headers.items()]
        lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer.write("\r\n".join(lines).encode("latin-1") + (b"" if head_only else body))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)


# -- the feed from the training process -----------------------------------------------------------


def read_frame(stream: BinaryIO) -> tuple[bytes, bytes] | None:
    """The next ``(type, payload)``, or None at EOF."""
    header = _read_exactly(stream, FRAME_HEADER.size)
    if header is None:
        return None
    kind, length = FRAME_HEADER.unpack(header)
    payload = _read_exactly(stream, length)
    if payload is None:
        return None
    return kind, payload


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    chunks: list[bytes] = []
    while n > 0:
        chunk = stream.read(n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def decode_exposition(payload: bytes) -> Exposition:
    (seq,) = SEQ.unpack_from(payload, 0)
    (text_len,) = TEXT_LEN.unpack_from(payload, SEQ.size)
    start = SEQ.size + TEXT_LEN.size
    return Exposition(seq, payload[start : start + text_len], payload[start + text_len :])


def encode_exposition(seq: int, text: bytes, openmetrics: bytes) -> bytes:
    payload = SEQ.pack(seq) + TEXT_LEN.pack(len(text)) + text + openmetrics
    return FRAME_HEADER.pack(b"E", len(payload)) + payload


def _feed(server: ExporterServer, stdin: BinaryIO, acks: BinaryIO) -> None:
    """Apply every exposition the training process sends; exit the process at EOF."""
    try:
        while True:
            frame = read_frame(stdin)
            if frame is None:
                break
            kind, payload = frame
            if kind != b"E":
                continue
            server.exposition = decode_exposition(payload)
            server.ready.set()
            acks.write(payload[: SEQ.size])
            acks.flush()
    except OSError:
        pass  # the training process is gone
    os._exit(0)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGTERM when the thread that started us dies; and never run without a parent."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no libc, or no prctl in it
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl: nobody would feed us
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradwatch.export.server")
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--parent", type=int, required=True, help="the training process")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    with contextlib.suppress(ImportError, OSError, ValueError):  # room for MAX_CONNECTIONS
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = MAX_CONNECTIONS + 64
        if soft < want and (hard == resource.RLIM_INFINITY or hard > soft):
            resource.setrlimit(
                resource.RLIMIT_NOFILE,
                (want if hard == resource.RLIM_INFINITY else min(want, hard), hard),
            )
    stdin = sys.stdin.buffer
    frame = read_frame(stdin)
    if frame is None or frame[0] != b"C":
        return 0
    settings = WebSettings.from_json(frame[1].decode())
    server = ExporterServer(settings)
    sock = socket.socket(fileno=args.fd)
    sock.setblocking(False)
    threading.Thread(
        target=_feed, args=(server, stdin, sys.stdout.buffer), name="feed", daemon=True
    ).start()
    try:
        asyncio.run(server.serve(sock))
    except (OSError, RuntimeError, ValueError) as exc:  # ssl errors are OSErrors
        print(f"gradwatch exporter: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
