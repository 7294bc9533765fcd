"""``gradwatch top``'s status line: an HTTP 404 is "not a gradwatch endpoint" (gradwatch answers
every path, so something else is on that port), and the last refresh of ``--count`` promises no
retry."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
from rich.console import Console

from gradwatch.cli.endpoint import NOT_GRADWATCH, UNREACHABLE, ScrapeError, fetch
from gradwatch.cli.top import Trends, render_frame


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_error(404, "Not Found")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def not_found_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def _text(frame: object) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(frame)
    return console.export_text()


def test_a_404_is_not_a_gradwatch_endpoint(not_found_url: str) -> None:
    with pytest.raises(ScrapeError) as caught:
        fetch(not_found_url, timeout=5.0)
    assert caught.value.kind == NOT_GRADWATCH and "404" in str(caught.value)


def test_only_refreshes_that_will_retry_say_so() -> None:
    error = ScrapeError("connection refused", UNREACHABLE)
    trends = Trends()
    middle = _text(render_frame("u", None, error, trends, refresh=1, interval=1.0))
    last = _text(render_frame("u", None, error, trends, refresh=2, interval=1.0, final=True))
    assert "unreachable: connection refused, retrying in 1s" in middle
    assert "unreachable: connection refused" in last and "retrying" not in last
