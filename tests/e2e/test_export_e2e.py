"""End to end: a real Prometheus scrapes gradwatch's endpoint and stores the snapshots' values.

* One process: snapshots published through MetricsServer; the value Prometheus's query API
  returns for ``gradwatch_global_grad_norm`` (and a few others) equals the snapshot's, NaN too;
  and steps published between two scrapes (a spike, a NaN) are counted by the per-group
  counters and the per-step norm histogram Prometheus stores.
* A 2-rank gloo DDP job (tests/helpers/jobs/ddp_serve_job.py under torchrun) with gradwatch serving
  from rank 0: Prometheus's value equals the job's snapshot for that step; then 20 concurrent
  scrapers hammer the endpoint for 10 s during training: no scrape may fail, and every sample
  Prometheus stored during the run pairs a step with that step's norm. The step time with and
  without the scrapers is printed (a benchmark, not asserted).

Prometheus runs on loopback with a temporary config and storage, scrape and evaluation
interval 1 s. Every process is started in its own session and killed in teardown.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from promserver import PromServer, run_prometheus, start_torchrun, stop_group, tail
from tls import self_signed

from gradwatch.config import WatchConfig
from gradwatch.export import MetricsServer
from gradwatch.snapshot import GroupStats, Snapshot

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
JOB_SCRIPT = ROOT / "tests" / "helpers" / "jobs" / "ddp_serve_job.py"
SCRAPERS = 20
LOAD_SECONDS = 10.0
BASELINE_SECONDS = 5.0
#: the scrapers' address (Prometheus scrapes from 127.0.0.1)
LOAD_SOURCE = "127.0.0.2"


def same(a: float | None, b: float) -> bool:
    return a is not None and (a == b or (math.isnan(a) and math.isnan(b)))


# -- one process ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_prometheus_stores_exactly_the_published_values(tmp_path: Path) -> None:
    cfg = WatchConfig(
        port=0, bind_address="127.0.0.1", groups={"host": ["h.*"]}, ratios=[("host", "other")]
    )
    server = MetricsServer(cfg, world_size=1, parallelism="single")
    try:
        with run_prometheus([f"127.0.0.1:{server.port}"], workdir=tmp_path / "prom") as prom:
            prom.wait_until(lambda: prom.value("gradwatch_build_info") == 1, 30, "first scrape")
            assert prom.value('up{job="gradwatch"}') == 1
            assert prom.value("gradwatch_step") is None  # nothing collected: no step
            assert prom.value("gradwatch_collections_total") == 0
            cases = [
                (1, 1.2345678901234567, 0.1 + 0.2),
                (2, 3.0000000000000004e-7, 5e-324),
                (3, math.nan, math.inf),
                (4, 1.7976931348623157e308, 0.0),
            ]
            for step, norm, ratio in cases:
                snap = Snapshot(
                    step=step,
                    global_norm=norm,
                    # a defined denominator: the ratio is published as held, bit for bit
                    groups={
                        "host": GroupStats(norm=norm, numel=step),
                        "other": GroupStats(norm=1.0, numel=1, tensors=1),
                    },
                    ratios={"host/other": ratio},
                    timestamp=time.time(),
                )
                server.publish(snap)
                prom.wait_for_value("gradwatch_step", step, timeout=30)
                assert same(prom.value("gradwatch_global_grad_norm"), norm)
                assert same(prom.value('gradwatch_grad_norm{group="host"}'), norm)
                assert same(
                    prom.value('gradwatch_grad_norm_ratio{numerator="host",denominator="other"}'),
                    ratio,
                )
                assert prom.value("gradwatch_last_collect_timestamp_seconds") == snap.timestamp
                assert prom.value("gradwatch_collections_total") == step
            assert prom.value("gradwatch_nonfinite_steps_total") == 1
    finally:
        server.close()


@pytest.mark.timeout(120)
def test_prometheus_sees_every_step_between_two_scrapes(tmp_path: Path) -> None:
    """Eight steps published within one scrape interval, with a spike and a NaN in the seed
    group among them: the last step's gauges show neither, but the per-group spike and
    non-finite counters and the per-step norm histogram that Prometheus stores count them."""
    cfg = WatchConfig(port=0, bind_address="127.0.0.1", groups={"host": ["h.*"], "seed": ["s.*"]})
    server = MetricsServer(cfg, world_size=1, parallelism="single")
    try:
        with run_prometheus([f"127.0.0.1:{server.port}"], workdir=tmp_path / "prom") as prom:
            prom.wait_until(lambda: prom.value("gradwatch_build_info") == 1, 30, "first scrape")
            assert prom.value('gradwatch_grad_norm_spikes_total{group="seed"}') == 0
            seed_norms = [0.01, 0.011, 0.5, 0.012, math.nan, 0.01, 0.009, 0.011]
            for step, seed in enumerate(seed_norms):  # faster than one scrape interval
                snap = Snapshot(
                    step=step,
                    global_norm=math.hypot(1.0, seed),
                    groups={"host": GroupStats(norm=1.0), "seed": GroupStats(norm=seed)},
                    nonfinite_params=("s.w",) if math.isnan(seed) else (),
                    global_spike_score=0.0,
                    spike_scores={"host": 0.0, "seed": 30.0 if seed == 0.5 else 0.0},
                    spiking_groups=("seed",) if seed == 0.5 else (),
                    timestamp=time.time(),
                )
                server.publish(snap, timeout=0)
            server.publish(snap)  # the last one again, waiting until it is served
            prom.wait_for_value("gradwatch_step", len(seed_norms) - 1, timeout=30)
            assert prom.value('gradwatch_grad_norm_spike_score{group="seed"}') == 0.0
            assert prom.value('gradwatch_grad_norm_spikes_total{group="seed"}') == 1
            assert prom.value('gradwatch_grad_norm_spikes_total{group="host"}') == 0
            assert prom.value('gradwatch_nonfinite_group_steps_total{group="seed"}') == 1
            finite = [v for v in seed_norms if math.isfinite(v)] + [seed_norms[-1]]
            count = 'gradwatch_grad_norm_per_step_count{group="seed"}'
            assert prom.value(count) == len(finite)
            above = 'gradwatch_grad_norm_per_step_bucket{group="seed",le="0.3"}'
            assert prom.value(above) == len(finite) - 1  # the spike is above 0.3, the rest below
            q = 'histogram_quantile(1, gradwatch_grad_norm_per_step_bucket{group="seed"})'
            assert 0.3 <= (prom.value(q) or 0.0) <= 1.0  # the spike's bucket, (0.3, 1]
    finally:
        server.close()


# -- a 2-rank DDP job -----------------------------------------------------------------------------


def test_prometheus_scrapes_through_basic_auth_over_tls(tmp_path: Path) -> None:
    """The exporter-toolkit web config protecting gradwatch works with Prometheus's own
    ``basic_auth`` and ``tls_config`` scrape settings; a wrong password gets 401."""
    import base64
    import ssl

    import bcrypt
    import yaml

    cert, key = self_signed(tmp_path)
    password = "e2e-password"
    web = tmp_path / "web.yml"
    web.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {"cert_file": cert.name, "key_file": key.name},
                "basic_auth_users": {
                    "prometheus": bcrypt.hashpw(password.encode(), bcrypt.gensalt(10)).decode()
                },
            }
        )
    )
    cfg = WatchConfig(port=0, bind_address="127.0.0.1", web_config_file=str(web))
    with MetricsServer(cfg, world_size=1, parallelism="single") as server:
        assert server.url is not None and server.url.startswith("https://")
        server.publish(
            Snapshot(
                step=11,
                global_norm=3.25,
                groups={"other": GroupStats(norm=3.25, numel=1)},
                timestamp=time.time(),
            )
        )
        target = urllib.parse.urlsplit(server.url).netloc
        with run_prometheus(
            [target],
            scheme="https",
            tls_config={"ca_file": str(cert)},
            basic_auth={"username": "prometheus", "password": password},
            workdir=tmp_path / "prom",
        ) as prom:
            prom.wait_for_value("gradwatch_global_grad_norm", 3.25, timeout=30)
            (target_info,) = prom.targets()
            assert target_info["health"] == "up", target_info
            assert prom.value("gradwatch_step") == 11
        # A wrong password: 401 and nothing served.
        ctx = ssl.create_default_context(cafile=str(cert))
        request = urllib.request.Request(
            server.url,
            headers={"Authorization": "Basic " + base64.b64encode(b"prometheus:wrong").decode()},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10, context=ctx)
        assert info.value.code == 401
        assert info.value.headers["WWW-Authenticate"].startswith("Basic")
        assert b"gradwatch_" not in info.value.read()


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class Job:
    proc: subprocess.Popen[bytes]
    workdir: Path
    log: Path

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float) -> Any:
        """Poll ``predicate``; fail at once if the job died, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited ({self.proc.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.05)

    def flag(self, name: str) -> None:
        (self.workdir / name).touch()


@contextmanager
def ddp_job(workdir: Path, steps: int = 20) -> Iterator[Job]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    log = workdir.parent / "job.log"
    proc = start_torchrun([str(JOB_SCRIPT), str(workdir), f"--steps={steps}"], env, log, ROOT)
    try:
        yield Job(proc, workdir, log)
    except BaseException:
        print(f"--- job log ---\n{tail(log)}")
        raise
    finally:
        stop_group(proc)


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def scrape_load(url: str, scrapers: int, seconds: float) -> LoadResult:
    """``scrapers`` threads scraping ``url`` back to back for ``seconds``, from another loopback
    address than Prometheus's (limits are per client: they only delay each other)."""
    result = LoadResult()
    stop_at = time.monotonic() + seconds
    parts = urllib.parse.urlsplit(url)

    def scraper() -> None:
        while time.monotonic() < stop_at:
            conn = http.client.HTTPConnection(
                parts.hostname, parts.port, timeout=10, source_address=(LOAD_SOURCE, 0)
            )
            try:
                conn.request("GET", parts.path)
                response = conn.getresponse()
                body = response.read().decode()
                good = response.status == 200 and "\ngradwatch_step " in body
                problem = None if good else f"status {response.status}, step missing"
            except Exception as exc:  # every failure is a finding
                problem = repr(exc)
            finally:
                conn.close()
            with result.lock:
                if problem is None:
                    result.ok += 1
                else:
                    result.failures.append(problem)

    threads = [threading.Thread(target=scraper) for _ in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return result


def stored_pairs(prom: PromServer, window: str) -> list[tuple[int, float]]:
    """(step, global norm) of every scrape Prometheus stored in ``window``, by timestamp."""
    steps = prom.api("query", query=f"gradwatch_step[{window}]")["result"]
    norms = prom.api("query", query=f"gradwatch_global_grad_norm[{window}]")["result"]
    assert len(steps) == 1 and len(norms) == 1, (steps, norms)
    norm_at = {t: float(v) for t, v in norms[0]["values"]}
    pairs = [(int(float(v)), norm_at[t]) for t, v in steps[0]["values"]]
    assert len(pairs) == len(norm_at)  # both series come from the same scrapes
    return pairs


def median_ms(step_times: list[list[float]], start: float, end: float) -> float:
    inside = [d for t, d in step_times if start <= t and t + d <= end]
    assert len(inside) >= 5, f"only {len(inside)} steps in the window"
    return statistics.median(inside) * 1000.0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_job_scraped_by_prometheus_and_under_load(tmp_path: Path) -> None:
    work = tmp_path / "job"
    work.mkdir()
    with ddp_job(work) as job:
        ranks = job.wait_for(
            "both ranks to construct GradWatch",
            lambda: all((work / f"rank{r}.json").exists() for r in (0, 1)),
            180,
        ) and [read_json(work / f"rank{r}.json") for r in (0, 1)]
        url = ranks[0]["metrics_url"]
        assert url and url.startswith("http://127.0.0.1:"), ranks
        assert ranks[1]["metrics_url"] is None  # only global rank 0 serves
        phase1 = job.wait_for("phase 1", lambda: read_json(work / "phase1.json"), 120)
        target = urllib.parse.urlsplit(url).netloc
        with run_prometheus([target], workdir=tmp_path / "prom") as prom:
            last = phase1["last_step"]
            prom.wait_for_value("gradwatch_step", last, timeout=30)
            assert prom.value("gradwatch_global_grad_norm") == phase1["snapshots"][str(last)]
            (run_info,) = prom.query("gradwatch_run_info")
            assert run_info["metric"]["world_size"] == "2", run_info

            job.flag("resume")
            resumed = time.monotonic()
            time.sleep(BASELINE_SECONDS)
            load_start = time.monotonic()
            load = scrape_load(url, SCRAPERS, LOAD_SECONDS)
            load_end = time.monotonic()
            time.sleep(1.0)
            job.flag("stop")
            phase2 = job.wait_for("phase 2", lambda: read_json(work / "phase2.json"), 60)

            last2 = phase2["last_step"]
            prom.wait_for_value("gradwatch_step", last2, timeout=30)
            assert prom.value("gradwatch_global_grad_norm") == phase2["snapshots"][str(last2)]
            # Every scrape Prometheus stored, under load included, is one step's norm.
            snapshots = {int(k): v for k, v in phase1["snapshots"].items()}
            snapshots.update({int(k): v for k, v in phase2["snapshots"].items()})
            pairs = stored_pairs(prom, "5m")
            assert len(pairs) >= LOAD_SECONDS, pairs
            for step, norm in pairs:
                assert norm == snapshots[step], (step, norm, snapshots.get(step))
        job.flag("exit")
        assert job.proc.wait(timeout=60) == 0, tail(job.log)

    assert not load.failures, f"{len(load.failures)} failed scrapes, e.g. {load.failures[:3]}"
    assert load.ok >= SCRAPERS, load.ok
    # The benchmark (not a test): step time with and without the scrapers.
    base = median_ms(phase2["step_times"], resumed, load_start)
    loaded = median_ms(phase2["step_times"], load_start, load_end)
    print(
        f"\nbenchmark: {load.ok} scrapes in {LOAD_SECONDS:g} s by {SCRAPERS} scrapers "
        f"({load.ok / LOAD_SECONDS:.0f}/s); median step {base:.2f} ms without, "
        f"{loaded:.2f} ms with scrapers ({(loaded / base - 1) * 100:+.1f}%)"
    )
