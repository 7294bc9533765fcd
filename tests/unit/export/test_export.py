"""The Prometheus exporter (gradwatch.export): exposition, consistency, publisher, server, TLS.

Values are compared to the snapshot exactly (NaN and infinities included) after parsing the
exposition with prometheus_client's own parser. Every test that starts a server closes it.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import gc
import gzip
import http.client
import logging
import math
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from exposition import parse
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from promserver import port_can_be_bound

from gradwatch import GradWatch, GradWatchError, PortInUseError, WatchConfig
from gradwatch.export import (
    COLLECT_SECONDS_BUCKETS,
    MAX_PARAM_SERIES,
    MAX_PENDING,
    MAX_SCRAPES_PER_SECOND,
    METRICS,
    METRICS_BY_NAME,
    SCRAPE_BURST,
    MetricSource,
    MetricsServer,
    Publishing,
    Sink,
    open_publishing,
    select_param_series,
    sinkworker,
)
from gradwatch.export import metrics as catalog
from gradwatch.export.history import HistoryWriter
from gradwatch.export.server import RateLimit
from gradwatch.export.sinkworker import RETRY_ATTEMPTS
from gradwatch.export.state import (
    Counts,
    PublishedState,
    SelfStats,
    snapshot_samples,
)
from gradwatch.snapshot import GroupStats, Snapshot
from scripts.gen_metrics_docs import metrics_reference_markdown

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"

pytestmark = pytest.mark.timeout(120)

Labels = tuple[tuple[str, str], ...]
Samples = dict[str, dict[Labels, float]]


# -- helpers --------------------------------------------------------------------------------------


def config(**overrides: Any) -> WatchConfig:
    base: dict[str, Any] = {
        "port": 0,
        "bind_address": "127.0.0.1",
        "groups": {"host": ["backbone.*"], "seed": ["seed.*"], "stem": ["stem.*"]},
        "ratios": [("seed", "host"), ("host", "other")],
        "isolated": ["stem"],
    }
    base.update(overrides)
    return WatchConfig(**base)


@pytest.fixture
def servers() -> Iterator[Callable[..., MetricsServer]]:
    """Factory of MetricsServers that are all closed at teardown."""
    started: list[MetricsServer] = []

    def make(cfg: WatchConfig | None = None, **kwargs: Any) -> MetricsServer:
        server = MetricsServer(
            cfg or config(),
            world_size=kwargs.pop("world_size", 2),
            parallelism=kwargs.pop("parallelism", "replicated2"),
        )
        started.append(server)
        return server

    yield make
    for server in started:
        server.close()


def http_get(url: str, context: ssl.SSLContext | None = None, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
        assert response.status == 200
        return response.read().decode()


def scrape(server: MetricsServer) -> Samples:
    return parse(http_get(server.url))


def wait_for_value(server: MetricsServer, name: str, expected: float, timeout: float = 5.0) -> None:
    """Scrape until ``name`` shows ``expected`` (the exporter renders changes within
    ``RENDER_INTERVAL``)."""
    deadline = time.monotonic() + timeout
    while True:
        got = scrape(server).get(name, {}).get((), None)
        if got == expected:
            return
        assert time.monotonic() < deadline, f"{name} is {got}, expected {expected}"
        time.sleep(0.02)


def same(a: float, b: float) -> bool:
    """Exact equality, NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


class Ready:
    """A pending result that is already materialized."""

    def __init__(self, snap: Snapshot) -> None:
        self.step = snap.step
        self._snap = snap

    def result(self) -> Snapshot:
        return self._snap


class Failing:
    def __init__(self, step: int, exc: Exception) -> None:
        self.step = step
        self._exc = exc

    def result(self) -> Snapshot:
        raise self._exc


class NotASnapshot:
    step = 0

    def result(self) -> Any:
        return object()


class Gated:
    """A pending result whose result() blocks until released (a slow collective)."""

    def __init__(self, snap: Snapshot) -> None:
        self.step = snap.step
        self._snap = snap
        self.entered = threading.Event()
        self.release = threading.Event()

    def result(self) -> Snapshot:
        self.entered.set()
        assert self.release.wait(30), "never released"
        return self._snap


def rich_snapshot(step: int = 7) -> Snapshot:
    """Every field set, with NaN, +Inf, -Inf and values whose decimal form is long."""
    return Snapshot(
        step=step,
        global_norm=math.nan,
        groups={
            "host": GroupStats(norm=1.2345678901234567, numel=123457, tensors=4, vanishing=1,
                               weight_norm=12.5, update_norm=0.0125, update_ratio=0.001,
                               stalled_fraction=0.0),
            "seed": GroupStats(norm=math.inf, numel=3, tensors=2, exploding=1, nonfinite=1,
                               weight_norm=0.0, update_norm=0.0, update_ratio=math.nan,
                               stalled_fraction=math.nan),
            "stem": GroupStats(norm=5e-324, numel=17, tensors=1, vanishing=1),
            "other": GroupStats(norm=0.1 + 0.2, numel=9, tensors=1),
        },
        param_norms={
            "backbone.0.weight": 1.0000000000000002,
            "backbone.0.bias": 0.5,
            "backbone.1.weight": 1e-300,
            "seed.w": math.inf,
            "seed.b": 0.25,
            "stem.w": 5e-324,
            "head.w": 0.1 + 0.2,
        },
        nonfinite_params=("seed.w",),
        ratios={"seed/host": math.nan, "host/other": -math.inf},
        raw_ratios={"seed/host": math.inf, "host/other": 0.0},
        health=0.1234567890123456789,
        isolation_violated={"stem": True},
        world_size=2,
        parallelism="replicated2",
        replica_divergence=2.220446049250313e-16,
        clip_coef=0.123456789,
        guard_skipped="spike",
        consecutive_skipped_steps=1,
        guard_score=7.5,
        skipped_steps={"nonfinite": 0, "spike": 1},
        adaptive_clip_threshold=1.25,
        amp_skipped=False,
        timestamp=1_700_000_000.123456,
        global_spike_score=math.nan,
        spike_scores={"host": 7.25, "seed": math.nan, "stem": -1.5, "other": 0.1 + 0.2},
        spiking_groups=("host",),
        slowest_rank=1,
        slowest_host="node-b",
        straggler_score=0.0476,
        work_seconds_min=0.01,
        work_seconds_median=0.0105,
        work_seconds_max=0.21,
        rank_view=True,
        nonfinite_origin_ranks=(3, 1),
        nonfinite_origin_count=2,
        nonfinite_origin_hosts=("node-b", "node-a"),
        nonfinite_origin_groups=("seed",),
        replica_grad_norm_min=0.5,
        replica_grad_norm_median=math.nan,
        replica_grad_norm_max=math.inf,
        replica_grad_norm_max_rank=1,
        replica_outlier_score=math.inf,
        replica_outlier_rank=1,
        gradient_noise_scale=123.456789,
        group_noise_scale={"host": math.nan, "seed": 1e-300},
    )


def expected_gauges(snap: Snapshot, ratio_pairs: dict[str, tuple[str, str]]) -> Samples:
    """What the exposition must show for ``snap``, written out independently of gradwatch.export."""

    def per_group(attr: str) -> dict[Labels, float]:
        return {(("group", g),): float(getattr(s, attr)) for g, s in snap.groups.items()}

    out: Samples = {
        "gradwatch_step": {(): float(snap.step)},
        "gradwatch_last_collect_timestamp_seconds": {(): snap.timestamp},
        "gradwatch_global_grad_norm": {(): snap.global_norm},
        "gradwatch_grad_norm": per_group("norm"),
        "gradwatch_group_parameters": per_group("numel"),
        "gradwatch_vanishing_tensors": per_group("vanishing"),
        "gradwatch_exploding_tensors": per_group("exploding"),
        "gradwatch_nonfinite_tensors": per_group("nonfinite"),
        "gradwatch_grad_norm_ratio": {
            (("denominator", ratio_pairs[k][1]), ("numerator", ratio_pairs[k][0])): v
            for k, v in snap.ratios.items()
        },
        "gradwatch_health_score": {(): snap.health},
        "gradwatch_isolation_violated": {
            (("group", g),): 1.0 if v else 0.0
            for g, v in snap.isolation_violated.items()
            if v is not None
        },
    }
    if snap.replica_divergence is not None:  # None: nothing measured it, no sample
        out["gradwatch_replica_divergence"] = {(): snap.replica_divergence}
    if snap.clip_coef is not None:
        out["gradwatch_clip_coef"] = {(): snap.clip_coef}
    if snap.rank_view:  # the per-rank view
        out["gradwatch_nonfinite_origin_ranks"] = {(): float(snap.nonfinite_origin_count or 0)}
        if snap.replica_grad_norm_max is not None:
            out["gradwatch_replica_grad_norm"] = {
                (("stat", "min"),): snap.replica_grad_norm_min,
                (("stat", "median"),): snap.replica_grad_norm_median,
                (("stat", "max"),): snap.replica_grad_norm_max,
            }
            out["gradwatch_replica_grad_norm_max_rank"] = {
                (): float(snap.replica_grad_norm_max_rank or 0)
            }
            out["gradwatch_replica_outlier_score"] = {(): snap.replica_outlier_score}
        if snap.gradient_noise_scale is not None:
            out["gradwatch_gradient_noise_scale"] = {(): snap.gradient_noise_scale}
            out["gradwatch_group_gradient_noise_scale"] = {
                (("group", g),): v for g, v in snap.group_noise_scale.items()
            }
    return {name: series for name, series in out.items() if series}  # empty: absent


def assert_matches(actual: Samples, expected: Samples) -> None:
    for name, series in expected.items():
        assert name in actual, f"{name} missing"
        assert set(actual[name]) == set(series), (name, actual[name], series)
        for labels, value in series.items():
            got = actual[name][labels]
            assert same(got, value), f"{name}{dict(labels)}: exported {got!r}, snapshot {value!r}"


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


RATIO_PAIRS = {"seed/host": ("seed", "host"), "host/other": ("host", "other")}


# -- the exposition equals the snapshot -----------------------------------------------------------


def test_scrape_after_result_equals_the_snapshot_exactly(
    servers: Callable[..., MetricsServer],
) -> None:
    server = servers(config(param_metrics_top_k=3))
    snap = rich_snapshot(step=41)
    server.submit(Ready(snap))
    deadline = time.monotonic() + 10
    samples = scrape(server)
    while samples.get("gradwatch_step") != {(): 41.0}:  # poll until the step shows
        assert time.monotonic() < deadline, "step 41 never published"
        time.sleep(0.01)
        samples = scrape(server)
    assert_matches(samples, expected_gauges(snap, RATIO_PAIRS))
    assert samples["gradwatch_param_grad_norm"] == {
        (("param", "seed.w"),): math.inf,  # non-finite first
        (("param", "backbone.0.weight"),): 1.0000000000000002,
        (("param", "backbone.0.bias"),): 0.5,
        (("param", "head.w"),): 0.1 + 0.2,
    }


def test_facade_scrape_after_result_equals_snapshot() -> None:
    """The real GradWatch on one process: collect, result(), poll the endpoint, compare."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    cfg = WatchConfig(
        port=0, bind_address="127.0.0.1", groups={"first": ["0.*"]}, ratios=[("first", "other")]
    )
    watch = GradWatch(model, cfg)
    try:
        url = watch.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        for step in range(3):
            model.zero_grad()
            model(torch.randn(32, 8)).pow(2).mean().backward()
            snap = watch.collect(step=step).result()
            deadline = time.monotonic() + 10
            samples = parse(http_get(url))
            while samples.get("gradwatch_step") != {(): float(step)}:
                assert time.monotonic() < deadline, f"step {step} never published"
                time.sleep(0.01)
                samples = parse(http_get(url))
            assert_matches(samples, expected_gauges(snap, {"first/other": ("first", "other")}))
            assert value(samples, "gradwatch_collections_total") == step + 1
            assert value(samples, "gradwatch_collect_seconds_count") == step + 1
    finally:
        watch.close()
    with pytest.raises(urllib.error.URLError):
        http_get(url, timeout=2)


def test_scrape_before_any_collection_shows_info_and_no_step(
    servers: Callable[..., MetricsServer],
) -> None:
    server = servers(world_size=4, parallelism="fsdp2x2+tp2")
    samples = scrape(server)
    assert "gradwatch_step" not in samples
    # Constants of the run (start time, configured ratio bands) are no measurement.
    gauges = {d.name for d in METRICS if d.type == "gauge" and d.source is not MetricSource.INFO}
    assert not gauges & set(samples), "gauges before any collection pretend to be data"
    assert samples["gradwatch_build_info"] == {
        (("torch_version", torch.__version__), ("version", _gradwatch_version())): 1.0
    }
    assert samples["gradwatch_run_info"] == {
        (("parallelism", "fsdp2x2+tp2"), ("run_id", server.run_id), ("world_size", "4")): 1.0
    }
    # Counters start at 0 so that increase() sees the first event.
    assert value(samples, "gradwatch_collections_total") == 0
    assert value(samples, "gradwatch_isolation_violations_total", group="stem") == 0
    assert server.published_step is None


def _gradwatch_version() -> str:
    import gradwatch

    return gradwatch.__version__


def test_every_metric_is_declared_typed_and_helped(servers: Callable[..., MetricsServer]) -> None:
    """The exposition and METRICS agree on names, types and labels, both ways."""
    server = servers(config(param_metrics_top_k=2))
    server.self_stats.set_collecting(True)  # what a GradWatch reports once it measured a step
    server.self_stats.add_audit("trainer", 1.0, True)  # what GradWatch.audit_norm adds
    server.self_stats.add_sink("history")  # what adding a sink does
    server.observe_collect_seconds(0.001)
    server.publish(rich_snapshot())  # returns once the exporter process serves all of the above
    text = http_get(server.url)
    families = list(text_string_to_metric_families(text))
    exposed: dict[str, Any] = {}
    for family in families:
        exposed_name = {"counter": family.name + "_total", "info": family.name + "_info"}.get(
            family.type, family.name
        )
        exposed[exposed_name] = family
    assert set(exposed) == set(METRICS_BY_NAME), "exposition and METRICS differ"
    for name, family in exposed.items():
        d = METRICS_BY_NAME[name]
        assert family.documentation == d.help and d.help, name
        # The text format (0.0.4) has no info type: prometheus_client writes it as a gauge.
        assert family.type == ("gauge" if d.type == "info" else d.type), name
        for s in family.samples:
            labels = set(s.labels) - ({"le"} if d.type == "histogram" else set())
            assert labels == set(d.labels), (name, s.labels)
    for line in text.splitlines():
        if line.startswith("# HELP"):
            assert len(line.split(" ", 3)) == 4, line


def test_nonfinite_values_are_exported_not_dropped(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    server.publish(rich_snapshot())
    text = http_get(server.url)
    assert "gradwatch_global_grad_norm NaN" in text
    assert 'gradwatch_grad_norm{group="seed"} +Inf' in text
    assert 'gradwatch_grad_norm_ratio{denominator="other",numerator="host"} -Inf' in text


def test_clip_coef_absent_when_not_clipped(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    server.publish(rich_snapshot(step=1))
    assert value(scrape(server), "gradwatch_clip_coef") == 0.123456789
    server.publish(rich_snapshot(step=2).replace(clip_coef=None))
    samples = scrape(server)
    assert "gradwatch_clip_coef" not in samples
    assert value(samples, "gradwatch_step") == 2


def test_counters_count_published_snapshots(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    healthy = Snapshot(
        step=0,
        global_norm=1.0,
        groups={"stem": GroupStats(norm=0.0)},
        isolation_violated={"stem": False},
    )
    nan_step = healthy.replace(
        step=1, global_norm=math.nan, nonfinite_params=("a",), groups={"x": GroupStats(exploding=1)}
    )
    amp_step = nan_step.replace(step=2, amp_skipped=True)
    exploding = healthy.replace(step=3, groups={"x": GroupStats(norm=1e9, exploding=2)})
    violating = healthy.replace(step=4, isolation_violated={"stem": True})
    inf_only = healthy.replace(step=5, global_norm=math.inf)  # is_finite is False
    for snap in (healthy, nan_step, amp_step, exploding, violating, violating, inf_only):
        server.publish(snap)
    samples = scrape(server)
    assert value(samples, "gradwatch_collections_total") == 7
    assert value(samples, "gradwatch_nonfinite_steps_total") == 2  # nan_step, inf_only
    assert value(samples, "gradwatch_amp_skipped_steps_total") == 1
    # exploding includes non-finite: nan_step, amp_step (skipped by the scaler but exploding)
    # and exploding
    assert value(samples, "gradwatch_exploding_steps_total") == 3
    assert value(samples, "gradwatch_isolation_violations_total", group="stem") == 2
    assert value(samples, "gradwatch_isolation_violated", group="stem") == 0  # last step
    assert value(samples, "gradwatch_publish_errors_total") == 0


def test_collect_seconds_histogram(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    observed = [0.00005, 0.0001, 0.003, 0.003, 0.2, 7.0]
    for seconds in observed:
        server.observe_collect_seconds(seconds)
    server.observe_collect_seconds(math.nan)  # ignored, never raises
    assert server.flush(10)
    samples = scrape(server)
    buckets = samples["gradwatch_collect_seconds_bucket"]
    for bound in (*COLLECT_SECONDS_BUCKETS, math.inf):
        le = "+Inf" if bound == math.inf else repr(bound)
        assert buckets[(("le", le),)] == sum(1 for s in observed if s <= bound), le
    assert value(samples, "gradwatch_collect_seconds_count") == len(observed)
    assert value(samples, "gradwatch_collect_seconds_sum") == pytest.approx(sum(observed))


# -- per-parameter series -------------------------------------------------------------------------


def test_top_k_is_largest_finite_plus_every_nonfinite() -> None:
    snap = rich_snapshot()
    assert select_param_series(snap, 0) == []
    assert select_param_series(snap, 2) == [
        ("seed.w", math.inf),
        ("backbone.0.weight", 1.0000000000000002),
        ("backbone.0.bias", 0.5),
    ]
    # A name flagged non-finite comes first even if its norm were finite, ties by name.
    tie = Snapshot(
        step=0, param_norms={"b": 2.0, "a": 2.0, "c": 1.0, "z": 3.0}, nonfinite_params=("z",)
    )
    assert select_param_series(tie, 2) == [("z", 3.0), ("a", 2.0), ("b", 2.0)]


def test_top_k_is_capped_on_a_huge_model(servers: Callable[..., MetricsServer]) -> None:
    n = 10_000
    norms = {f"layer{i:05d}.weight": float(i) for i in range(n)}
    bad = [f"layer{i:05d}.weight" for i in range(0, n, 2)]  # 5,000 non-finite parameters
    for name in bad:
        norms[name] = math.nan
    snap = Snapshot(step=1, param_norms=norms, nonfinite_params=tuple(bad))
    server = servers(config(param_metrics_top_k=n))
    server.publish(snap)
    series = scrape(server)["gradwatch_param_grad_norm"]
    assert len(series) == MAX_PARAM_SERIES
    exported = {dict(labels)["param"] for labels in series}
    assert exported == set(sorted(bad)[:MAX_PARAM_SERIES])  # the non-finite ones win
    assert all(math.isnan(v) for v in series.values())
    # Few non-finite: the rest of the cap goes to the largest finite norms.
    snap2 = Snapshot(step=2, param_norms={k: float(i) for i, k in enumerate(norms)})
    server.publish(snap2)
    series2 = scrape(server)["gradwatch_param_grad_norm"]
    assert len(series2) == MAX_PARAM_SERIES
    assert min(series2.values()) == n - MAX_PARAM_SERIES


def test_no_param_series_by_default(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    server.publish(rich_snapshot())
    assert "gradwatch_param_grad_norm" not in scrape(server)


# -- consistency and the publisher ----------------------------------------------------------------


def uniform_snapshot(step: int) -> Snapshot:
    """Every gauge and every snapshot-derived counter equals ``step`` once published in order."""
    x = float(step)
    g = GroupStats(norm=x, numel=step, tensors=step, vanishing=step, exploding=step, nonfinite=step)
    return Snapshot(
        step=step,
        global_norm=x,
        groups={"host": g, "seed": g, "stem": g, "other": g},
        param_norms={"p": x, "q": x},
        ratios={"seed/host": x, "host/other": x},
        health=x,
        isolation_violated={"stem": True},
        replica_divergence=x,
        clip_coef=x,
        timestamp=x,
        global_spike_score=x,
        spike_scores=dict.fromkeys(("host", "seed", "stem", "other"), x),
        global_spike=True,  # every step a spike: the spike counters equal the step too
        spiking_groups=("host", "seed", "stem", "other"),
    )


# Series whose value is not the step in uniform_snapshot(step): the exporter's own, the
# constant info, the never-incremented counters and the 0/1 isolation flag.
NOT_STEP_VALUED = {
    "gradwatch_isolation_violated",
    "gradwatch_publish_errors_total",
    "gradwatch_dropped_snapshots_total",
    "gradwatch_collect_seconds_bucket",
    "gradwatch_collect_seconds_count",
    "gradwatch_collect_seconds_sum",
    "gradwatch_build_info",
    "gradwatch_run_info",
    "gradwatch_amp_skipped_steps_total",
    "gradwatch_skipped_steps_total",  # amp_overflow, no_update: never incremented here
    "gradwatch_nonfinite_steps_total",
    "gradwatch_no_gradient_steps_total",
    "gradwatch_nonfinite_group_steps_total",
    # the norm histograms' _count is the step (one observation per publish), not the rest
    "gradwatch_global_grad_norm_per_step_bucket",
    "gradwatch_global_grad_norm_per_step_sum",
    "gradwatch_grad_norm_per_step_bucket",
    "gradwatch_grad_norm_per_step_sum",
    "gradwatch_start_time_seconds",
    "gradwatch_grad_norm_ratio_band",
}


def _check_one_step(samples: Samples) -> float | None:
    """The step every step-valued series of one scrape shows (None before any publish)."""
    if "gradwatch_step" not in samples:
        return None
    values = {
        (name, labels): v
        for name, series in samples.items()
        if name not in NOT_STEP_VALUED
        for labels, v in series.items()
    }
    distinct = set(values.values())
    assert len(distinct) == 1, f"one scrape mixes steps: {sorted(distinct)[:5]}"
    assert len(values) == 33 + 15, sorted(values)  # every series, every time
    return distinct.pop()


def _hammer(
    scrape_once: Callable[[], Samples], publish: Callable[[int], None], seconds: float
) -> set[float]:
    """Scrape from 4 threads while publishing uniform snapshots; the steps seen."""
    stop = threading.Event()
    seen: set[float] = set()
    errors: list[BaseException] = []

    def scraper() -> None:
        try:
            while not stop.is_set():
                step = _check_one_step(scrape_once())
                if step is not None:
                    seen.add(step)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=scraper) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + seconds
        step = 0
        while time.monotonic() < deadline and not errors:
            step += 1
            publish(step)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[0]
    return seen


def test_one_scrape_never_mixes_two_steps(servers: Callable[..., MetricsServer]) -> None:
    """The Collector alone (no HTTP, no rate bound), with threads switching very often."""
    server = servers(config(param_metrics_top_k=5))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        seen = _hammer(
            lambda: parse(generate_latest(server.registry).decode()),
            # timeout=0: the state changes at once, without waiting for the exporter process
            lambda step: server.publish(uniform_snapshot(step), timeout=0),
            seconds=3.0,
        )
    finally:
        sys.setswitchinterval(interval)
    assert len(seen) > 50, "the scrapes did not overlap with publishing"


def test_one_http_scrape_never_mixes_two_steps(servers: Callable[..., MetricsServer]) -> None:
    """The same through the endpoint, fed by the publisher thread as in training."""
    server = servers(config(param_metrics_top_k=5))
    seen = _hammer(
        lambda: scrape(server),
        # flush after each submit: a dropped snapshot would (rightly) leave the counters
        # behind the step, which this test reads as step-valued
        lambda step: (server.submit(Ready(uniform_snapshot(step))), server.flush(10)),
        seconds=2.0,
    )
    assert len(seen) > 10, "the scrapes did not overlap with publishing"


def test_publishing_falls_behind_drops_the_oldest(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    first = Gated(uniform_snapshot(1))
    server.submit(first)
    assert first.entered.wait(10)  # the publisher is now stuck in result()
    later = [Ready(uniform_snapshot(step)) for step in range(2, 12)]
    started = time.perf_counter()
    for pending in later:
        server.submit(pending)
    assert time.perf_counter() - started < 0.5, "submit blocked"
    # The drops show on the endpoint while the publisher is still stuck (rendered on change).
    dropped = len(later) - MAX_PENDING
    wait_for_value(server, "gradwatch_dropped_snapshots_total", dropped)
    assert not server.flush(timeout=0.2)  # still stuck
    first.release.set()
    assert server.flush(timeout=10)
    samples = scrape(server)
    assert value(samples, "gradwatch_step") == 11  # the newest survive
    assert value(samples, "gradwatch_collections_total") == 1 + MAX_PENDING
    assert value(samples, "gradwatch_dropped_snapshots_total") == len(later) - MAX_PENDING


def test_publisher_errors_are_logged_once_per_kind_counted_and_survived(
    servers: Callable[..., MetricsServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = servers()
    caplog.set_level(logging.WARNING, logger="gradwatch.export")
    failing: list[Any] = [
        Failing(1, ValueError("boom")),
        Failing(2, ValueError("boom again")),
        Failing(3, TimeoutError("peer gone")),
        NotASnapshot(),  # publish() fails on what result() returned
        Failing(4, ValueError("third")),
        NotASnapshot(),
    ]
    for pending in failing:
        server.submit(pending)
        assert server.flush(10)  # one at a time: nothing is dropped
    server.submit(Ready(uniform_snapshot(5)))
    assert server.flush(10)
    samples = scrape(server)
    assert value(samples, "gradwatch_publish_errors_total") == len(failing)
    assert value(samples, "gradwatch_step") == 5
    assert value(samples, "gradwatch_collections_total") == 1
    records = [r for r in caplog.records if r.name == "gradwatch.export"]
    assert len(records) == 3, [r.getMessage() for r in records]
    messages = " ".join(r.getMessage() for r in records)
    for kind in ("ValueError", "TimeoutError", "AttributeError"):
        assert kind in messages


def test_submit_never_raises_and_is_ignored_after_close(
    servers: Callable[..., MetricsServer],
) -> None:
    server = servers()
    server.close()
    server.submit(Ready(uniform_snapshot(1)))
    server.observe_collect_seconds(0.1)
    assert server.closed
    assert not server.flush(0.1)


# -- the server -----------------------------------------------------------------------------------


def test_ephemeral_port(servers: Callable[..., MetricsServer]) -> None:
    a, b = servers(), servers()
    assert a.port != 0 and b.port != 0 and a.port != b.port
    assert a.url == f"http://127.0.0.1:{a.port}/metrics"
    assert "gradwatch_build_info" in scrape(a)


def test_port_in_use_names_the_port_and_the_variable(
    servers: Callable[..., MetricsServer],
) -> None:
    first = servers()
    with pytest.raises(PortInUseError) as info:
        servers(config(port=first.port))
    message = str(info.value)
    assert str(first.port) in message and "GRADWATCH_PORT" in message
    assert isinstance(info.value, OSError) and info.value.errno == errno.EADDRINUSE
    # Any listener counts, not only gradwatch's, and the wildcard address conflicts too.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(taken)):
            servers(config(port=taken))


def test_close_releases_the_port_and_is_idempotent(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    port, url = server.port, server.url
    server.publish(uniform_snapshot(1))
    publisher = server._publisher.thread
    server.close()
    server.close()
    assert not publisher.is_alive()
    with pytest.raises(urllib.error.URLError):
        http_get(url, timeout=2)
    again = servers(config(port=port))  # the same port, at once
    assert again.port == port
    assert "gradwatch_step" not in scrape(again)


def test_unclosed_server_is_closed_when_collected(servers: Callable[..., MetricsServer]) -> None:
    server = MetricsServer(config(), world_size=1, parallelism="single")
    port, publisher = server.port, server._publisher.thread
    assert not port_can_be_bound(port)
    del server
    gc.collect()
    publisher.join(10)
    assert not publisher.is_alive()
    assert port_can_be_bound(port)


EXIT_SCRIPT = """
import socket, time, weakref
from gradwatch.config import WatchConfig
from gradwatch.export import MetricsServer

def report():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", server.port)); s.listen(); s.close()
    print("closed", server.closed, "port-free", flush=True)

class Anchor:
    pass

# Exit runs weakref finalizers newest first: this one, older than the server's, runs after it.
anchor = Anchor()
weakref.finalize(anchor, report)

class Stuck:  # a collective whose peer died: result() would wait for minutes
    step = 1
    def result(self):
        time.sleep(600)

server = MetricsServer(WatchConfig(port=0, bind_address="127.0.0.1"), world_size=1,
                       parallelism="single")
server.submit(Stuck())
time.sleep(0.2)
print("started", server.port, flush=True)
"""


def test_interpreter_exit_closes_the_server_without_hanging() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert "closed True port-free" in proc.stdout, (proc.stdout, proc.stderr)
    assert elapsed < 30, f"exit took {elapsed:.1f}s"


def test_port_none_is_refused() -> None:
    with pytest.raises(ValueError, match="port"):
        MetricsServer(WatchConfig(port=None), world_size=1, parallelism="single")


def test_wildcard_bind_url_uses_loopback(servers: Callable[..., MetricsServer]) -> None:
    server = servers(config(bind_address="0.0.0.0"))
    assert server.url == f"http://127.0.0.1:{server.port}/metrics"
    assert "gradwatch_build_info" in scrape(server)


def get(url: str, headers: dict[str, str]) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(response.headers), response.read()


def test_openmetrics_and_gzip_as_prometheus_asks(servers: Callable[..., MetricsServer]) -> None:
    """Prometheus negotiates OpenMetrics and gzip: that exposition must equal the snapshot too."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as parse_openmetrics,
    )

    server = servers()
    snap = rich_snapshot()
    server.publish(snap)
    accept = (
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
        "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    )
    headers, body = get(server.url, {"Accept": accept, "Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    text = gzip.decompress(body).decode()
    assert text.endswith("# EOF\n")
    samples: Samples = {}
    for family in parse_openmetrics(text):
        for sample in family.samples:
            assert sample.timestamp is None
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    assert_matches(samples, expected_gauges(snap, RATIO_PAIRS))
    assert list(samples["gradwatch_build_info"].values()) == [1.0]


def test_cached_exposition_is_never_stale(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    server.publish(uniform_snapshot(1))
    first, again = http_get(server.url), http_get(server.url)
    assert first == again
    server.observe_collect_seconds(0.01)  # a self-metric change is a new exposition
    assert server.flush(10)  # rendered by the next publish, or at once when flushed
    assert value(scrape(server), "gradwatch_collect_seconds_count") == 1
    server.publish(uniform_snapshot(2))
    assert value(scrape(server), "gradwatch_step") == 2
    # A filtered scrape bypasses the cache and still works.
    filtered = parse(http_get(server.url + "?name[]=gradwatch_step"))
    assert set(filtered) == {"gradwatch_step"}


def test_rate_limit_grants_bursts_then_spaces_and_refuses_long_waits() -> None:
    limit = RateLimit(rate=10.0, burst=3, max_wait=0.45)
    waits = [limit.reserve() for _ in range(9)]
    assert waits[:3] == [0.0, 0.0, 0.0]
    for i, expected in enumerate((0.1, 0.2, 0.3, 0.4), start=3):
        assert waits[i] == pytest.approx(expected, abs=0.05)
    assert waits[7:] == [None, None]  # 0.5 s and beyond: refused, not booked
    time.sleep(0.25)
    assert limit.reserve() == pytest.approx(0.25, abs=0.05)


def test_back_to_back_scrapers_are_bounded_and_never_fail(
    servers: Callable[..., MetricsServer],
) -> None:
    """A runaway client cannot make the serving process scrape more than the bound."""
    server = servers()
    server.publish(uniform_snapshot(1))
    seconds, ok, failures = 2.0, [0], []
    stop_at = time.monotonic() + seconds

    def scraper() -> None:
        while time.monotonic() < stop_at:
            try:
                assert "gradwatch_step 1.0" in http_get(server.url)
                ok[0] += 1
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=scraper) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not failures, failures[:3]
    # Requests still waiting at stop_at (at most one per client) are served a little later.
    bound = MAX_SCRAPES_PER_SECOND * seconds + SCRAPE_BURST + len(threads)
    assert SCRAPE_BURST <= ok[0] <= bound


def fetch(
    url: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    source: str | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers, body)`` of one request, from the loopback address ``source``."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(
        parts.hostname, parts.port, timeout=timeout,
        source_address=(source, 0) if source else None,
    )  # fmt: skip
    try:
        conn.request(method, parts.path + (f"?{parts.query}" if parts.query else ""),
                     headers=headers or {})  # fmt: skip
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def test_prometheus_is_never_starved_by_runaway_clients(
    servers: Callable[..., MetricsServer],
) -> None:
    """Limits are per client: with 20 clients of another address scraping back to back (and
    claiming to be Prometheus: a User-Agent earns nothing), Prometheus's own scrapes are still
    served at once, so they never exceed their scrape_timeout; the runaway address waits."""
    server = servers()
    server.publish(uniform_snapshot(1))
    stop = threading.Event()
    spoofed = {"User-Agent": "Prometheus/2.45.3"}

    def runaway() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                fetch(server.url, headers=spoofed, source="127.0.0.2")

    threads = [threading.Thread(target=runaway) for _ in range(20)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # the runaway address's queue is now ~2 s deep
        latencies = []
        for _ in range(5):
            started = time.monotonic()
            status, _, body = fetch(server.url, headers=spoofed, source="127.0.0.1")
            assert status == 200 and b"gradwatch_step 1.0" in body
            latencies.append(time.monotonic() - started)
            time.sleep(0.2)  # Prometheus's own pace stays within its budget
        queued_started = time.monotonic()
        status, _, _ = fetch(server.url, headers=spoofed, source="127.0.0.2")
        queued = time.monotonic() - queued_started
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert max(latencies) < 0.5, latencies
    # The runaway address waits its turn, or is refused after a delay, whatever it claims.
    assert queued > 0.9 and status in (200, 429), (queued, status)


def test_one_client_exhausting_its_budget_leaves_others_theirs(
    servers: Callable[..., MetricsServer],
) -> None:
    """An eager viewer uses up its own budget (and gets 429 past it), never another's."""
    server = servers()
    server.publish(uniform_snapshot(1))
    results: list[int] = []
    lock = threading.Lock()

    def eager() -> None:
        status, headers, _ = fetch(server.url, source="127.0.0.3", timeout=30)
        with lock:
            results.append(status)
        if status == 429:
            assert headers.get("Retry-After") == "1"

    threads = [threading.Thread(target=eager) for _ in range(60)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    started = time.monotonic()
    status, _, _ = fetch(server.url, source="127.0.0.1")
    other = time.monotonic() - started
    for t in threads:
        t.join(30)
    assert status == 200 and other < 0.5, other
    assert 429 in results  # the eager client did exceed its own bound


def test_head_is_answered_without_a_body(servers: Callable[..., MetricsServer]) -> None:
    server = servers()
    server.publish(uniform_snapshot(1))
    status, headers, body = fetch(server.url, method="HEAD")
    _, _, full = fetch(server.url)
    assert status == 200 and body == b""
    assert int(headers["Content-Length"]) == len(full)
    assert headers["Content-Type"].startswith("text/plain")
    status, headers, _ = fetch(server.url, method="POST")
    assert status == 405


def test_listen_backlog_is_not_tiny(servers: Callable[..., MetricsServer]) -> None:
    """128 connections opened at once all get served (a backlog of 5 would reset some)."""
    server = servers()
    server.publish(uniform_snapshot(1))
    from gradwatch.export import LISTEN_BACKLOG

    assert LISTEN_BACKLOG >= 128
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(128)]
    try:
        for s in socks:
            s.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in socks[:10]:  # the first ones within their client's burst: answered
            assert s.recv(64).startswith(b"HTTP/1.1 ")
    finally:
        for s in socks:
            s.close()


def test_a_slow_request_head_is_cut_off(
    servers: Callable[..., MetricsServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slowloris: a client sending its head a byte at a time is disconnected once the head
    timeout passes, and never delays other scrapes meanwhile."""
    from gradwatch.export import HEAD_TIMEOUT

    server = servers()
    server.publish(uniform_snapshot(1))
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(50)]
    started = time.monotonic()
    try:
        closed_at = None
        while time.monotonic() - started < HEAD_TIMEOUT + 5:
            for s in slow:
                with contextlib.suppress(OSError):
                    s.send(b"G")
            assert "gradwatch_step 1.0" in http_get(server.url, timeout=2)
            try:
                slow[0].settimeout(0.01)
                if slow[0].recv(1) == b"":
                    closed_at = time.monotonic() - started
                    break
            except TimeoutError:
                pass
            except OSError:
                closed_at = time.monotonic() - started
                break
            time.sleep(0.5)
    finally:
        for s in slow:
            s.close()
    assert closed_at is not None and closed_at <= HEAD_TIMEOUT + 2, closed_at


# -- TLS ------------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=gradwatch test CA", cwd=d)  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=gradwatch test {name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}


def test_tls_endpoint_serves_https(
    pki: dict[str, Path], servers: Callable[..., MetricsServer]
) -> None:
    server = servers(config(certfile=pki["server_pem"], keyfile=pki["server_key"]))
    assert server.url == f"https://127.0.0.1:{server.port}/metrics"
    server.publish(rich_snapshot(step=3))
    ctx = ssl.create_default_context(cafile=str(pki["ca_pem"]))
    assert value(parse(http_get(server.url, ctx)), "gradwatch_step") == 3
    with pytest.raises(urllib.error.URLError):  # an untrusted certificate is refused
        http_get(server.url, ssl.create_default_context(), timeout=5)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP gets nothing
        http_get(server.url.replace("https://", "http://"), timeout=5)
    # A client that connects and never speaks does not stall other scrapes.
    with socket.create_connection(("127.0.0.1", server.port)):
        assert value(parse(http_get(server.url, ctx)), "gradwatch_step") == 3


def test_mutual_tls_requires_a_client_certificate(
    pki: dict[str, Path], servers: Callable[..., MetricsServer]
) -> None:
    server = servers(
        config(certfile=pki["server_pem"], keyfile=pki["server_key"], client_cafile=pki["ca_pem"])
    )
    anonymous = ssl.create_default_context(cafile=str(pki["ca_pem"]))
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        http_get(server.url, anonymous, timeout=5)
    authenticated = ssl.create_default_context(cafile=str(pki["ca_pem"]))
    authenticated.load_cert_chain(pki["client_pem"], pki["client_key"])
    assert "gradwatch_build_info" in parse(http_get(server.url, authenticated))


def test_unloadable_tls_files_fail_at_construction_without_taking_the_port(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(GradWatchError, match="TLS"):
        MetricsServer(
            config(port=port, certfile=garbage, keyfile=pki["server_key"]),
            world_size=1,
            parallelism="single",
        )
    assert port_can_be_bound(port)


# -- promtool and the generated reference ---------------------------------------------------------


@pytest.mark.parametrize("published", [False, True], ids=["before-collection", "full"])
def test_promtool_check_metrics_reports_nothing(
    published: bool, servers: Callable[..., MetricsServer]
) -> None:
    if not Path(PROMTOOL).exists():
        pytest.skip("promtool not installed")
    server = servers(config(param_metrics_top_k=3))
    if published:
        server.publish(rich_snapshot())
        server.observe_collect_seconds(0.002)
        assert server.flush(10)
    text = generate_latest(server.registry).decode()
    assert text == http_get(server.url)
    proc = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr


def test_docs_metrics_md_is_generated_from_the_code() -> None:
    doc = ROOT / "docs" / "metrics.md"
    assert doc.read_text() == metrics_reference_markdown(), (
        "docs/metrics.md is out of date: run `python scripts/gen_metrics_docs.py`"
    )
    for d in METRICS:  # every metric, type and label is in the table
        labels = ", ".join(f"`{label}`" for label in d.labels) or "-"
        assert f"| `{d.name}` | {d.type} | {labels} |" in doc.read_text()


def test_markdown_entry_point(tmp_path: Path) -> None:
    """scripts/gen_metrics_docs.py prints, writes and checks the generated reference."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "gen_metrics_docs.py"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    proc = run("--output", "-")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == metrics_reference_markdown()
    out = tmp_path / "metrics.md"
    assert run("--check", "--output", str(out)).returncode == 1  # missing: out of date
    assert run("--output", str(out)).returncode == 0
    assert out.read_text() == metrics_reference_markdown()
    assert run("--check", "--output", str(out)).returncode == 0
    assert run("--check").returncode == 0, "docs/metrics.md is out of date"


# -- the catalog's sources and the Sink protocol ---------------------------------------------------


def test_every_metric_names_the_source_that_provides_it() -> None:
    """Each source provides exactly the metrics the catalog assigns to it, no more."""
    by_source = {source: {d for d in METRICS if d.source is source} for source in MetricSource}
    assert all(isinstance(d.source, MetricSource) for d in METRICS)
    assert set().union(*by_source.values()) == set(METRICS_BY_NAME.values())
    snap = rich_snapshot()  # clip_coef set: every snapshot metric present
    assert set(snapshot_samples(snap, {}, top_k=3)) == by_source[MetricSource.SNAPSHOT]
    assert set(Counts().samples()) == by_source[MetricSource.COUNTS]
    stats = SelfStats()
    assert catalog.COLLECTING not in stats.view().samples()  # no watcher reported yet
    stats.set_collecting(True)
    assert catalog.REPORTED_NORM_RATIO not in stats.view().samples()  # nothing audited yet
    stats.add_audit("trainer", 1.0, True)
    assert catalog.SINK_ERRORS_TOTAL not in stats.view().samples()  # no sink yet
    stats.add_sink("history")
    assert set(stats.view().samples()) == by_source[MetricSource.SELF_STATS]
    assert {d.name for d in by_source[MetricSource.INFO]} == {
        "gradwatch_build_info",
        "gradwatch_run_info",
        "gradwatch_start_time_seconds",
        "gradwatch_grad_norm_ratio_band",
    }
    assert {d.type for d in by_source[MetricSource.SNAPSHOT]} == {"gauge"}
    # Running totals are counters; the one gauge is the last non-finite origin (an event kept
    # across steps, so it lives with the counts rather than with one snapshot).
    assert {d.type for d in by_source[MetricSource.COUNTS] - {catalog.LAST_NONFINITE_ORIGIN}} == {
        "counter",
        "histogram",
    }


def test_every_definition_is_named_after_its_metric() -> None:
    """``catalog.<NAME>`` is the definition of ``gradwatch_<name>``: one object per metric, in
    METRICS once, and the buckets of each histogram are its own."""
    assert len(set(METRICS)) == len(METRICS) == len(METRICS_BY_NAME)
    for d in METRICS:
        assert getattr(catalog, d.name.removeprefix("gradwatch_").upper()) is d, d.name
        assert bool(d.buckets) == (d.type == "histogram"), d.name
    assert catalog.COLLECT_SECONDS.buckets == COLLECT_SECONDS_BUCKETS


#: The modules the catalog's definitions are written in.
CATALOG_MODULES = (
    "gradwatch/export/metrics.py",
    "gradwatch/export/optimizer_metrics.py",
    "gradwatch/export/rankmetrics.py",
)


def test_no_module_joins_by_a_metric_name_string() -> None:
    """Outside the catalog, code refers to a metric by its definition, never by its name: no
    string constant of the package (prose aside) is a catalog name."""
    names = set(METRICS_BY_NAME)
    found = []
    for path in sorted((SRC / "gradwatch").rglob("*.py")):
        if path.relative_to(SRC).as_posix() in CATALOG_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value}")
    assert not found, found


def test_counts_use_the_snapshots_step_classification() -> None:
    """The counters add Snapshot.nonfinite_step / amp_skipped / exploding_step, nothing else."""
    nan_step = Snapshot(
        step=1, global_norm=math.nan, nonfinite_params=("a",), groups={"x": GroupStats(exploding=1)}
    )
    cases = [
        Snapshot(step=0, global_norm=1.0),
        nan_step,
        nan_step.replace(amp_skipped=True),
        Snapshot(step=3, global_norm=math.inf),
        Snapshot(step=4, groups={"x": GroupStats(norm=1e9, exploding=2)}),
    ]
    counts = Counts()
    for snap in cases:
        counts = counts.after(snap)
    assert counts.collections == len(cases)
    assert counts.nonfinite_steps == sum(s.nonfinite_step for s in cases) == 2
    assert counts.amp_skipped_steps == sum(s.amp_skipped for s in cases) == 1
    assert counts.exploding_steps == sum(s.exploding_step for s in cases) == 3


#: The exposition of the fixed sequence in the test below, recorded before the exporter became
#: a package: a refactoring of the exporter must leave it byte for byte identical.
GOLDEN_EXPOSITION = """\
# HELP gradwatch_step Training step of the last published snapshot.
# TYPE gradwatch_step gauge
gradwatch_step 7.0
# HELP gradwatch_last_collect_timestamp_seconds Wall-clock time (Unix seconds) of the collect() call of the last published snapshot.
# TYPE gradwatch_last_collect_timestamp_seconds gauge
gradwatch_last_collect_timestamp_seconds 1.700000000123456e+09
# HELP gradwatch_global_grad_norm L2 norm of all gradients of the whole model at the last published step.
# TYPE gradwatch_global_grad_norm gauge
gradwatch_global_grad_norm NaN
# HELP gradwatch_grad_norm L2 norm of the gradients of one parameter group at the last published step.
# TYPE gradwatch_grad_norm gauge
gradwatch_grad_norm{group="host"} 1.2345678901234567
gradwatch_grad_norm{group="seed"} +Inf
gradwatch_grad_norm{group="stem"} 5e-324
gradwatch_grad_norm{group="other"} 0.30000000000000004
# HELP gradwatch_grad_norm_ratio Normalized gradient-norm ratio of two groups: (n_norm/sqrt(n_numel)) / (d_norm/sqrt(d_numel) + 1e-8).
# TYPE gradwatch_grad_norm_ratio gauge
gradwatch_grad_norm_ratio{denominator="host",numerator="seed"} NaN
gradwatch_grad_norm_ratio{denominator="other",numerator="host"} -Inf
# HELP gradwatch_group_parameters Number of gradient elements (numel) of the group's parameters that had a gradient.
# TYPE gradwatch_group_parameters gauge
gradwatch_group_parameters{group="host"} 123457.0
gradwatch_group_parameters{group="seed"} 3.0
gradwatch_group_parameters{group="stem"} 17.0
gradwatch_group_parameters{group="other"} 9.0
# HELP gradwatch_vanishing_tensors Parameters of the group whose gradient L2 norm is below vanishing_threshold.
# TYPE gradwatch_vanishing_tensors gauge
gradwatch_vanishing_tensors{group="host"} 1.0
gradwatch_vanishing_tensors{group="seed"} 0.0
gradwatch_vanishing_tensors{group="stem"} 1.0
gradwatch_vanishing_tensors{group="other"} 0.0
# HELP gradwatch_exploding_tensors Parameters of the group whose gradient L2 norm is above exploding_threshold or non-finite.
# TYPE gradwatch_exploding_tensors gauge
gradwatch_exploding_tensors{group="host"} 0.0
gradwatch_exploding_tensors{group="seed"} 1.0
gradwatch_exploding_tensors{group="stem"} 0.0
gradwatch_exploding_tensors{group="other"} 0.0
# HELP gradwatch_nonfinite_tensors Parameters of the group whose gradient holds NaN or Inf.
# TYPE gradwatch_nonfinite_tensors gauge
gradwatch_nonfinite_tensors{group="host"} 0.0
gradwatch_nonfinite_tensors{group="seed"} 1.0
gradwatch_nonfinite_tensors{group="stem"} 0.0
gradwatch_nonfinite_tensors{group="other"} 0.0
# HELP gradwatch_health_score Gradient health in [0, 1]: clamp(1 - 0.5*vanishing/n - 0.8*exploding/n); 0 when the global norm is non-finite.
# TYPE gradwatch_health_score gauge
gradwatch_health_score 0.12345678901234568
# HELP gradwatch_isolation_violated 1 when an isolated group's gradient norm exceeds isolation_threshold (or is non-finite) at the last published step, else 0.
# TYPE gradwatch_isolation_violated gauge
gradwatch_isolation_violated{group="stem"} 1.0
# HELP gradwatch_replica_divergence Relative spread (max - min) / max of the data-parallel replicas' global norms at the last measurement.
# TYPE gradwatch_replica_divergence gauge
gradwatch_replica_divergence 2.220446049250313e-16
# HELP gradwatch_clip_coef Clip coefficient min(1, max_norm / (norm + 1e-6)) applied by GradWatch.clip_grad_norm_ at the last published step.
# TYPE gradwatch_clip_coef gauge
gradwatch_clip_coef 0.123456789
# HELP gradwatch_param_grad_norm Gradient L2 norm of one parameter: the param_metrics_top_k largest finite norms plus every non-finite one.
# TYPE gradwatch_param_grad_norm gauge
gradwatch_param_grad_norm{param="seed.w"} +Inf
gradwatch_param_grad_norm{param="backbone.0.weight"} 1.0000000000000002
gradwatch_param_grad_norm{param="backbone.0.bias"} 0.5
gradwatch_param_grad_norm{param="head.w"} 0.30000000000000004
# HELP gradwatch_nonfinite_origin_ranks Ranks whose local gradients were already NaN or Inf before the data-parallel reduction, at the last published step.
# TYPE gradwatch_nonfinite_origin_ranks gauge
gradwatch_nonfinite_origin_ranks 2.0
# HELP gradwatch_replica_grad_norm Spread of the data-parallel replicas' local gradient L2 norms before the reduction (stat: min, median, max) at the last published step.
# TYPE gradwatch_replica_grad_norm gauge
gradwatch_replica_grad_norm{stat="min"} 0.5
gradwatch_replica_grad_norm{stat="median"} NaN
gradwatch_replica_grad_norm{stat="max"} +Inf
# HELP gradwatch_replica_grad_norm_max_rank Rank holding the largest local gradient norm (the lowest rank of that replica) at the last published step.
# TYPE gradwatch_replica_grad_norm_max_rank gauge
gradwatch_replica_grad_norm_max_rank 1.0
# HELP gradwatch_replica_outlier_score Largest relative deviation of a replica's local gradient norm from the replicas' median, max |x - median| / median, at the last published step.
# TYPE gradwatch_replica_outlier_score gauge
gradwatch_replica_outlier_score +Inf
# HELP gradwatch_gradient_noise_scale Gradient noise scale B_simple = tr(Sigma) / |G|^2 of the whole model, averaged over the last 40 steps, in samples (the unit of batch_size; per-replica batches when batch_size is unset).
# TYPE gradwatch_gradient_noise_scale gauge
gradwatch_gradient_noise_scale 123.456789
# HELP gradwatch_group_gradient_noise_scale Gradient noise scale B_simple of one parameter group, averaged over the last 40 steps, in samples (the unit of batch_size; per-replica batches when batch_size is unset).
# TYPE gradwatch_group_gradient_noise_scale gauge
gradwatch_group_gradient_noise_scale{group="host"} NaN
gradwatch_group_gradient_noise_scale{group="seed"} 1e-300
# HELP gradwatch_last_nonfinite_origin Step of the last step whose non-finite gradients started on this rank before the reduction.
# TYPE gradwatch_last_nonfinite_origin gauge
gradwatch_last_nonfinite_origin{host="node-a",rank="1"} 7.0
gradwatch_last_nonfinite_origin{host="node-b",rank="3"} 7.0
# HELP gradwatch_collections_total Snapshots published (collected steps that reached the exporter).
# TYPE gradwatch_collections_total counter
gradwatch_collections_total 2.0
# HELP gradwatch_nonfinite_steps_total Published snapshots with a NaN or Inf gradient, except steps the AMP GradScaler skipped.
# TYPE gradwatch_nonfinite_steps_total counter
gradwatch_nonfinite_steps_total 1.0
# HELP gradwatch_no_gradient_steps_total Published snapshots of steps on which no parameter had a gradient at all.
# TYPE gradwatch_no_gradient_steps_total counter
gradwatch_no_gradient_steps_total 0.0
# HELP gradwatch_amp_skipped_steps_total Published snapshots of steps the AMP GradScaler skipped (non-finite gradients under loss scaling).
# TYPE gradwatch_amp_skipped_steps_total counter
gradwatch_amp_skipped_steps_total 0.0
# HELP gradwatch_exploding_steps_total Published snapshots with at least one exploding parameter (non-finite ones included).
# TYPE gradwatch_exploding_steps_total counter
gradwatch_exploding_steps_total 2.0
# HELP gradwatch_isolation_violations_total Published snapshots in which the isolated group violated isolation.
# TYPE gradwatch_isolation_violations_total counter
gradwatch_isolation_violations_total{group="stem"} 2.0
# HELP gradwatch_publish_errors_total Collected steps that failed to materialize or to publish on the endpoint (logged once per kind).
# TYPE gradwatch_publish_errors_total counter
gradwatch_publish_errors_total 1.0
# HELP gradwatch_dropped_snapshots_total Collected steps never published because publishing fell behind.
# TYPE gradwatch_dropped_snapshots_total counter
gradwatch_dropped_snapshots_total 0.0
# HELP gradwatch_collect_seconds Time the training thread spent in GradWatch.collect() (gradwatch's self-cost).
# TYPE gradwatch_collect_seconds histogram
gradwatch_collect_seconds_bucket{le="0.0001"} 1.0
gradwatch_collect_seconds_bucket{le="0.00025"} 1.0
gradwatch_collect_seconds_bucket{le="0.0005"} 1.0
gradwatch_collect_seconds_bucket{le="0.001"} 1.0
gradwatch_collect_seconds_bucket{le="0.0025"} 1.0
gradwatch_collect_seconds_bucket{le="0.005"} 2.0
gradwatch_collect_seconds_bucket{le="0.01"} 2.0
gradwatch_collect_seconds_bucket{le="0.025"} 2.0
gradwatch_collect_seconds_bucket{le="0.05"} 2.0
gradwatch_collect_seconds_bucket{le="0.1"} 2.0
gradwatch_collect_seconds_bucket{le="0.25"} 3.0
gradwatch_collect_seconds_bucket{le="0.5"} 3.0
gradwatch_collect_seconds_bucket{le="1.0"} 3.0
gradwatch_collect_seconds_bucket{le="2.5"} 3.0
gradwatch_collect_seconds_bucket{le="+Inf"} 4.0
gradwatch_collect_seconds_count 4.0
gradwatch_collect_seconds_sum 7.20305
# HELP gradwatch_build_info Versions of gradwatch and torch in the job (value 1).
# TYPE gradwatch_build_info gauge
gradwatch_build_info{torch_version="TORCH",version="GRADWATCH"} 1.0
# HELP gradwatch_run_info World size, detected parallelism and run identity of the job (value 1).
# TYPE gradwatch_run_info gauge
gradwatch_run_info{parallelism="replicated2",run_id="RUN",world_size="2"} 1.0
# HELP gradwatch_start_time_seconds Wall-clock time (Unix seconds) at which this run's gradwatch started.
# TYPE gradwatch_start_time_seconds gauge
gradwatch_start_time_seconds T
# HELP gradwatch_grad_norm_ratio_band Configured healthy band (bound low/high) and dormant level (bound dormant) of a normalized gradient-norm ratio.
# TYPE gradwatch_grad_norm_ratio_band gauge
gradwatch_grad_norm_ratio_band{bound="low",denominator="host",numerator="seed"} 0.05
gradwatch_grad_norm_ratio_band{bound="high",denominator="host",numerator="seed"} 0.2
gradwatch_grad_norm_ratio_band{bound="dormant",denominator="host",numerator="seed"} 0.01
gradwatch_grad_norm_ratio_band{bound="low",denominator="other",numerator="host"} 0.05
gradwatch_grad_norm_ratio_band{bound="high",denominator="other",numerator="host"} 0.2
gradwatch_grad_norm_ratio_band{bound="dormant",denominator="other",numerator="host"} 0.01
"""  # noqa: E501


def test_collector_output_is_unchanged_on_a_fixed_snapshot(
    servers: Callable[..., MetricsServer],
) -> None:
    import gradwatch

    server = servers(config(param_metrics_top_k=3))
    server.publish(uniform_snapshot(3))
    server.publish(rich_snapshot(7))
    for seconds in (0.00005, 0.003, 0.2, 7.0):
        server.observe_collect_seconds(seconds)
    server.submit(Failing(8, ValueError("boom")))
    assert server.flush(10)
    assert server.registry is not None
    text = generate_latest(server.registry).decode()
    text = text.replace(f'version="{gradwatch.__version__}"', 'version="GRADWATCH"')
    text = text.replace(f'torch_version="{torch.__version__}"', 'torch_version="TORCH"')
    text = text.replace(f'run_id="{server.run_id}"', 'run_id="RUN"')
    text = text.replace(
        f"gradwatch_start_time_seconds {floatToGoString(server.start_time)}",
        "gradwatch_start_time_seconds T",
    )
    assert _without_families(text, SPIKE_FAMILIES) == GOLDEN_EXPOSITION


#: Families added after the golden exposition was recorded (tested in test_spikes.py and below).
SPIKE_FAMILIES = (
    "gradwatch_slowest_rank",  # which rank is slow: tests/unit/reduce/test_ranktiming.py
    "gradwatch_straggler_score",
    "gradwatch_rank_work_seconds",
    "gradwatch_global_grad_norm_spike_score",
    "gradwatch_grad_norm_spike_score",
    "gradwatch_global_grad_norm_spikes",
    "gradwatch_grad_norm_spikes",
    "gradwatch_nonfinite_group_steps",
    "gradwatch_global_grad_norm_per_step",
    "gradwatch_grad_norm_per_step",
    # the optimizer-step guard (tested in test_guard_metrics_come_from_the_guarded_snapshots)
    "gradwatch_skipped_steps",
    "gradwatch_consecutive_skipped_steps",
    "gradwatch_guard_stopped",
    "gradwatch_guard_score",
    # what acted on a step (tested in test_adaptive_and_guard_score_gauges)
    "gradwatch_adaptive_clip_threshold",
    # optimizer-update health (tested in test_update_metrics_read_the_measured_groups_only)
    "gradwatch_weight_norm",
    "gradwatch_update_norm",
    "gradwatch_update_ratio",
    "gradwatch_stalled_update_fraction",
)


def _without_families(text: str, families: tuple[str, ...]) -> str:
    """``text`` without the HELP, TYPE and sample lines of ``families``."""

    def family(line: str) -> str:
        if line.startswith("# "):
            return line.split(" ", 3)[2]
        return line.split("{", 1)[0].split(" ", 1)[0]

    def of(name: str, fam: str) -> bool:
        return any(name == fam + suffix for suffix in ("", "_total", "_bucket", "_count", "_sum"))

    kept = [ln for ln in text.splitlines() if not any(of(family(ln), f) for f in families)]
    return "\n".join(kept) + "\n"


class Recorder:
    """A user sink: records what it receives, from which thread, and its close."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.threads: set[str] = set()
        self.closed_after: int | None = None

    def write(self, snapshot: Snapshot) -> None:
        assert self.closed_after is None, "written after close"
        self.steps.append(snapshot.step)
        self.threads.add(threading.current_thread().name)

    def close(self) -> None:
        assert self.closed_after is None, "closed twice"
        self.closed_after = len(self.steps)


class Broken:
    """A user sink that always raises (no ``action``: the log names its class)."""

    def __init__(self) -> None:
        self.calls = 0

    def write(self, snapshot: Snapshot) -> None:
        self.calls += 1
        raise RuntimeError("sink is broken")


def test_open_publishing_only_when_there_is_something_to_feed(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"world_size": 1, "parallelism": "single"}
    assert open_publishing(WatchConfig(), **kwargs) is None
    with open_publishing(WatchConfig(history_path=tmp_path / "h.jsonl"), **kwargs) as pub:
        assert pub is not None and pub.url is None and pub.registry is None
        assert [type(s) for s in pub.sinks] == [HistoryWriter]
        assert isinstance(pub.sinks[0], Sink)
    with open_publishing(WatchConfig(), extra_sinks=[Recorder()], **kwargs) as pub:
        assert pub is not None and pub.url is None
    with open_publishing(config(), extra_sinks=[Recorder()], **kwargs) as pub:
        assert pub is not None and pub.url is not None and pub.url.endswith("/metrics")
        assert [type(s).__name__ for s in pub.sinks] == ["PublishedState", "Recorder"]


def test_a_user_sink_receives_every_published_snapshot_then_is_closed() -> None:
    recorder, late = Recorder(), Recorder()
    pub = open_publishing(WatchConfig(), world_size=1, parallelism="single", extra_sinks=[recorder])
    assert pub is not None
    try:
        for step in range(1, MAX_PENDING + 1):  # no more than MAX_PENDING: nothing dropped
            pub.submit(Ready(uniform_snapshot(step)))
        assert pub.flush(10)
        pub.add_sink(late)
        pub.submit(Ready(uniform_snapshot(MAX_PENDING + 1)))
        assert pub.flush(10)
    finally:
        pub.close()
    assert recorder.steps == list(range(1, MAX_PENDING + 2))
    assert recorder.threads == {"gradwatch-sink-Recorder"}  # its own thread, never training's
    assert late.threads == {"gradwatch-sink-Recorder_2"}
    assert late.steps == [MAX_PENDING + 1]  # from the next published snapshot on
    assert recorder.closed_after == len(recorder.steps) and late.closed_after == 1
    pub.close()  # idempotent: sinks are closed once


def test_a_failing_user_sink_is_counted_and_does_not_stop_other_sinks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sinkworker, "RETRY_FIRST_SECONDS", 0.001)
    monkeypatch.setattr(sinkworker, "RETRY_MAX_SECONDS", 0.01)
    caplog.set_level(logging.WARNING, logger="gradwatch.export")
    broken, recorder = Broken(), Recorder()
    server = MetricsServer(config(), world_size=1, parallelism="single", sinks=[broken, recorder])
    try:
        broken_worker = server._publisher.workers[0]
        for step in (1, 2, 3):
            server.submit(Ready(uniform_snapshot(step)))
            server.flush(10)  # False while the broken sink backs off: not waited for
            assert broken_worker.flush(time.monotonic() + 10, wait_failing=True)
        assert server._http is not None and server._http.sync(10)
        samples = scrape(server)
    finally:
        server.close()
    # every step tried RETRY_ATTEMPTS times, then given up and counted as dropped
    assert broken.calls == 3 * RETRY_ATTEMPTS and recorder.steps == [1, 2, 3]
    assert value(samples, "gradwatch_sink_errors_total", sink="Broken") == 3 * RETRY_ATTEMPTS
    assert value(samples, "gradwatch_sink_dropped_steps_total", sink="Broken") == 3
    assert value(samples, "gradwatch_sink_errors_total", sink="Recorder") == 0
    assert value(samples, "gradwatch_sink_dropped_steps_total", sink="Recorder") == 0
    assert value(samples, "gradwatch_publish_errors_total") == 0  # the endpoint is fine
    assert value(samples, "gradwatch_step") == 3  # the endpoint's own sink went on too
    assert value(samples, "gradwatch_collections_total") == 3
    records = [r.getMessage() for r in caplog.records if r.name == "gradwatch.export"]
    # the first failure and the first lost step, once each; later ones are rate-limited
    failed = [m for m in records if "'Broken' sink failed to write a step" in m]
    lost = [m for m in records if "'Broken' sink lost 1 step(s)" in m]
    assert len(failed) == 1 and "(RuntimeError: sink is broken" in failed[0], records
    assert len(lost) == 1, records


def test_a_sink_that_fails_to_close_is_logged_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class BadClose(Recorder):
        def close(self) -> None:
            raise OSError("disk gone")

    after = Recorder()
    pub = Publishing(WatchConfig(), world_size=1, parallelism="single", sinks=[BadClose(), after])
    with caplog.at_level(logging.WARNING, logger="gradwatch.export"):
        pub.close()
    assert after.closed_after == 0  # the next sink is still closed
    assert any("disk gone" in r.getMessage() for r in caplog.records)


# -- restarts and ratio bands -------------------------------------------------------------------


def test_start_time_and_run_id_identify_the_run(servers: Callable[..., MetricsServer]) -> None:
    before = time.time()
    first = servers()
    second = servers()
    after = time.time()
    for server in (first, second):
        samples = scrape(server)
        assert before <= value(samples, "gradwatch_start_time_seconds") <= after
        assert value(samples, "gradwatch_start_time_seconds") == server.start_time
        ((labels, one),) = samples["gradwatch_run_info"].items()
        assert one == 1.0 and dict(labels)["run_id"] == server.run_id
    assert first.run_id != second.run_id  # generated: a restart is a new series
    assert first.start_time <= second.start_time


def test_run_id_with_characters_special_in_the_exposition_is_escaped(
    servers: Callable[..., MetricsServer],
) -> None:
    odd = 'retry "2"\\n\nü{x="y"}'
    server = servers(config(run_id=odd))
    assert server.run_id == odd
    text = http_get(server.url)
    (line,) = [x for x in text.splitlines() if x.startswith("gradwatch_run_info{")]
    assert 'run_id="retry \\"2\\"\\\\n\\nü{x=\\"y\\"}"' in line, line  # one line, escaped
    ((labels, _),) = parse(text)["gradwatch_run_info"].items()
    assert dict(labels)["run_id"] == odd  # and read back exactly


def test_ratio_bands_are_published_from_the_configuration(
    servers: Callable[..., MetricsServer],
) -> None:
    cfg = config(
        ratios=[
            ("seed", "host"),
            {"numerator": "host", "denominator": "other", "low": 0.5, "high": 2, "dormant": 0},
        ]
    )
    samples = scrape(servers(cfg))  # before any step: constants of the run
    assert samples["gradwatch_grad_norm_ratio_band"] == {
        (("bound", "low"), ("denominator", "host"), ("numerator", "seed")): 0.05,
        (("bound", "high"), ("denominator", "host"), ("numerator", "seed")): 0.2,
        (("bound", "dormant"), ("denominator", "host"), ("numerator", "seed")): 0.01,
        (("bound", "low"), ("denominator", "other"), ("numerator", "host")): 0.5,
        (("bound", "high"), ("denominator", "other"), ("numerator", "host")): 2.0,
        (("bound", "dormant"), ("denominator", "other"), ("numerator", "host")): 0.0,
    }


@pytest.mark.parametrize(
    ("denominator", "defined"),
    [
        (GroupStats(norm=2.0, numel=4, tensors=1), True),
        (GroupStats(norm=0.0, numel=4, tensors=1), False),  # zero gradient
        (GroupStats(norm=9e-9, numel=4, tensors=1), False),  # below the 1e-8 floor
        (GroupStats(norm=1e-8, numel=4, tensors=1), True),  # at the floor
        (GroupStats(), False),  # no parameter of the group had a gradient
        (GroupStats(norm=math.inf, numel=4, tensors=1, exploding=1, nonfinite=1), False),
        (GroupStats(norm=math.nan, numel=4, tensors=1, exploding=1, nonfinite=1), False),
        (None, False),  # the group is not in the snapshot at all
    ],
)
def test_undefined_ratio_is_exported_as_nan_not_zero(
    denominator: GroupStats | None, defined: bool
) -> None:
    groups = {"seed": GroupStats(norm=0.0, numel=2, tensors=1)}  # numerator: no gradient
    if denominator is not None:
        groups["host"] = denominator
    # What the snapshot holds for the pair (summary: 0.0 when either norm is below the floor).
    held = 0.0
    snap = Snapshot(step=1, global_norm=1.0, groups=groups, ratios={"seed/host": held})
    samples = snapshot_samples(snap, {"seed/host": ("seed", "host")}, top_k=0)
    ((labels, exported),) = samples[catalog.GRAD_NORM_RATIO]
    assert labels == ("seed", "host")
    if defined:
        assert exported == 0.0  # the numerator has no gradient: dormant, a real 0
    else:
        assert math.isnan(exported)


def test_guard_metrics_come_from_the_guarded_snapshots() -> None:
    """The skip counters keep the guard's totals (steps between published ones included) and
    the guard gauges are absent from an unguarded snapshot."""
    state = PublishedState(config())
    state.write(Snapshot(step=0))
    assert catalog.CONSECUTIVE_SKIPPED_STEPS not in state.current().samples
    # without the guard only AMP's reason, measured on every published snapshot
    assert state.current().count_samples[catalog.SKIPPED_STEPS_TOTAL] == (
        (("amp_overflow",), 0.0),
    )
    state.write(
        Snapshot(
            step=5,
            guard_skipped="nonfinite",
            consecutive_skipped_steps=2,
            guard_stopped=False,
            skipped_steps={"nonfinite": 2, "spike": 3},
        )
    )
    current = state.current()
    assert current.count_samples[catalog.SKIPPED_STEPS_TOTAL] == (
        (("nonfinite",), 2.0),
        (("spike",), 3.0),
        (("amp_overflow",), 0.0),
    )
    assert current.samples[catalog.CONSECUTIVE_SKIPPED_STEPS] == (((), 2.0),)
    assert current.samples[catalog.GUARD_STOPPED] == (((), 0.0),)
    state.write(Snapshot(step=6))  # an unguarded snapshot keeps the totals
    assert state.current().count_samples[catalog.SKIPPED_STEPS_TOTAL][1] == (("spike",), 3.0)


def test_adaptive_and_guard_score_gauges() -> None:
    """The adaptive threshold and the guard's score are the snapshot's figures, absent when
    undefined (never a 0 that was not measured)."""
    state = PublishedState(config())
    state.write(Snapshot(step=0))
    assert catalog.ADAPTIVE_CLIP_THRESHOLD not in state.current().samples
    assert catalog.GUARD_SCORE not in state.current().samples
    state.write(Snapshot(step=1, adaptive_clip_threshold=0.75, guard_score=-1.5))
    current = state.current()
    assert current.samples[catalog.ADAPTIVE_CLIP_THRESHOLD] == (((), 0.75),)
    assert current.samples[catalog.GUARD_SCORE] == (((), -1.5),)


def test_update_metrics_read_the_measured_groups_only() -> None:
    """The update gauges per group, absent where unmeasured (update_stats off, the first
    collect); the silent-skip and overflow reasons appear once they can be measured."""
    state = PublishedState(config())
    state.write(Snapshot(step=0, groups={"host": GroupStats(weight_norm=2.0)}))
    current = state.current()
    assert current.samples[catalog.WEIGHT_NORM] == ((("host",), 2.0),)
    for d in (catalog.UPDATE_NORM, catalog.UPDATE_RATIO, catalog.STALLED_UPDATE_FRACTION):
        assert d not in current.samples
    measured = GroupStats(weight_norm=2.0, update_norm=0.0, update_ratio=0.0,
                          stalled_fraction=math.nan)
    state.write(Snapshot(step=1, groups={"host": measured, "seed": GroupStats()},
                         update_norm=0.0, weight_norm=2.0, no_update_step=True,
                         deepspeed_skipped_steps=2))
    current = state.current()
    assert current.samples[catalog.UPDATE_NORM] == ((("host",), 0.0),)
    ((labels, stalled),) = current.samples[catalog.STALLED_UPDATE_FRACTION]
    assert labels == ("host",) and math.isnan(stalled)
    assert dict(current.count_samples[catalog.SKIPPED_STEPS_TOTAL]) == {
        ("amp_overflow",): 0.0, ("deepspeed_overflow",): 2.0, ("no_update",): 1.0,
    }


def test_a_timed_out_step_is_logged_in_one_line_an_unexpected_error_with_its_traceback(
    servers: Callable[..., MetricsServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A straggler's timeout is gradwatch's own error: its message says everything (the step,
    the setting that bounded the wait), so no 40-line traceback; a sink's bug keeps its own."""
    from gradwatch.errors import GradWatchTimeoutError

    server = servers()
    caplog.set_level(logging.WARNING, logger="gradwatch.export")
    try:
        raise GradWatchTimeoutError("gradwatch: step 1 ... (collective_timeout_seconds)")
    except GradWatchTimeoutError as exc:
        straggler = exc
    for pending in (Failing(1, straggler), Failing(2, ValueError("a bug"))):
        server.submit(pending)
        assert server.flush(10)
    records = {r.getMessage().split("(")[1].split(":")[0]: r for r in caplog.records}
    assert records["GradWatchTimeoutError"].exc_info is None
    assert "collective_timeout_seconds" in records["GradWatchTimeoutError"].getMessage()
    assert records["ValueError"].exc_info is not None
