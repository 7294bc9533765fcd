"""Soak: 20,000 collected steps of a small model with a scraper, injected NaNs and spikes and a
rotating history file. Resident memory grows by less than 20 MB, thread and file-descriptor
counts stay flat, and every collected step is accounted for in the exposition
(``collections_total + dropped + publish_errors == steps collected``)."""

from __future__ import annotations

import math
import os
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from gradwatch import GradWatch, WatchConfig

pytestmark = [pytest.mark.slow]

STEPS = 20_000
WARMUP = 2_000  # steps before the baseline: allocator pools, caches and the plan settle
RSS_GROWTH_LIMIT = 20 * 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def long_lived_threads() -> int:
    """Threads other than the HTTP server's per-request handlers (one per scrape in flight)."""
    return sum("process_request_thread" not in t.name for t in threading.enumerate())


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


@pytest.mark.timeout(240)
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_soak_20000_steps_memory_threads_fds_and_accounting(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    grads = [torch.randn_like(p) for p in model.parameters()]
    cfg = WatchConfig(
        port=0,
        bind_address="127.0.0.1",
        groups={"body": ["0.*"], "head": ["2.*"]},
        ratios=[("head", "body")],
        param_metrics_top_k=2,
        history_path=tmp_path / "history.jsonl",
        history_max_bytes=64 * 1024,  # rotates every hundred-odd steps
    )
    stop = threading.Event()
    scrapes = [0]
    errors: list[BaseException] = []
    with GradWatch(model, cfg) as watch:
        url = watch.metrics_url
        assert url is not None

        def scraper() -> None:
            try:
                while not stop.is_set():
                    scrape(url)
                    scrapes[0] += 1
                    stop.wait(0.05)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=scraper, daemon=True)
        thread.start()
        baseline: tuple[int, int, int] | None = None
        started = time.monotonic()
        for step in range(STEPS):
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g
            if step % 997 == 13:
                p.grad = torch.full_like(g, math.nan)  # injected NaN
            elif step % 501 == 7:
                p.grad = g * 1e6  # injected spike
            watch.collect(step)
            if step == WARMUP:
                assert watch.flush(30)
                baseline = (rss_bytes(), long_lived_threads(), fds())
        assert watch.flush(60)
        elapsed = time.monotonic() - started
        stop.set()
        thread.join(30)
        assert not errors, errors[0]
        final = scrape(url)
        end = (rss_bytes(), long_lived_threads() + 1, fds())  # + the joined scraper
    assert baseline is not None
    assert end[0] - baseline[0] < RSS_GROWTH_LIMIT, (end[0] - baseline[0]) / 2**20
    assert end[1] == baseline[1], "thread count changed"
    assert end[2] <= baseline[2] + 2, "file descriptors leak"  # a scrape's sockets may linger
    accounted = (
        final["gradwatch_collections_total"]
        + final["gradwatch_dropped_snapshots_total"]
        + final["gradwatch_publish_errors_total"]
    )
    assert accounted == STEPS
    assert final["gradwatch_nonfinite_steps_total"] > 0 and final["gradwatch_step"] == STEPS - 1
    assert scrapes[0] > 10  # the endpoint rate-limits scrapes
    assert elapsed < 150
    assert (tmp_path / "history.jsonl.1").exists()  # rotated
