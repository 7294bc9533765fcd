"""The multi-process measurements: 2 ranks, gloo, CPU, spawned, one thread per rank.

* :func:`overhead`: the step time of DDP and FSDP2 jobs without gradwatch, with it, and with
  two floors (one all-reduce of a vector as long as gradwatch's packed one, which a collect that
  all-reduces pays; one read of every gradient, which any norm pays), in palindromic blocks so
  a linear drift cancels within a block.
* :func:`scrapers_during_training`: the step time of a DDP job while scrapers hammer rank 0's
  endpoint, in alternating windows with and without them.

The workers run in spawned processes, which import this module by name (``benchmarks`` must be
on ``sys.path``, which spawn passes on); rank 0 hands its results back through a file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from torch import nn

from benchmarks.cases import (
    SCRAPERS_TARGET,
    WRAPPERS,
    ModelSpec,
    ScrapersPlan,
    build_model,
    demo_net,
    wrap,
)
from benchmarks.results import (
    CollectiveCount,
    DistributedCase,
    DistributedFailure,
    ScrapersResult,
    StepMode,
    Timing,
)
from gradwatch.doctor.testing import OpCounter

WORLD = 2
#: One block: each mode twice, palindromic, so a linear drift cancels within a block.
BLOCK = (*StepMode, *reversed(StepMode))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


# -- step overhead ----------------------------------------------------------------------------


def _measure(spec: ModelSpec, wrapper: str, steps: int) -> DistributedCase:
    """One model under one wrapper, on this rank (the caller keeps rank 0's)."""
    import torch.distributed as dist

    from gradwatch import GradWatch, WatchConfig

    torch.manual_seed(0)
    model, width, batch = build_model(spec)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model = wrap(model, wrapper)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rank = dist.get_rank()
    # As deployed: rank 0 serves the endpoint, and its exporter thread materializes results.
    cfg = WatchConfig(port=0 if rank == 0 else None, bind_address="127.0.0.1",
                      collective_timeout_seconds=120)
    watch = GradWatch(model, cfg)
    gen = torch.Generator().manual_seed(10 + rank)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 1, generator=gen)

    def backward() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()

    # gradwatch's own collectives and payload, of one collect+result each: the first collect
    # (a divergence step where the layout has replicas: every `divergence_every`-th collect,
    # counted from the first) and the second (an ordinary collect; none under pure DDP
    # replication).
    backward()
    with OpCounter() as ops:
        watch.collect(0).result()
    first = CollectiveCount(ops.collectives, ops.collective_bytes)
    with OpCounter() as ops:
        watch.collect(1).result()
    own = CollectiveCount(ops.collectives, ops.collective_bytes)
    divergence = (first if watch._resolved.layout.replicas > 1 and watch.config.divergence_every > 0
                  else None)
    # The all-reduce floor: what a collect that all-reduces adds at least (every collect under
    # FSDP2, the divergence steps under DDP): one all-reduce of a float64 vector as long as the
    # packed one, on a group of its own. Sized by the layout, not by the payload counted above,
    # which is 0 under DDP.
    floor_group = dist.new_group()
    floor_buffer = torch.zeros(watch._resolved.layout.packed_length, dtype=torch.float64)
    waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="floor-waiter")
    call_times: list[float] = []  # the collect() call on the training thread

    def step(i: int, mode: StepMode) -> None:
        backward()
        pending = None
        if mode in (StepMode.COLLECT, StepMode.COLLECT_RESULT):
            started = time.perf_counter()
            pending = watch.collect(i)
            call_times.append(time.perf_counter() - started)
        work = None
        if mode is StepMode.FLOOR_ALL_REDUCE:
            work = dist.all_reduce(floor_buffer.clone(), group=floor_group, async_op=True)
        elif mode is StepMode.FLOOR_READ:
            torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        if pending is not None and mode is StepMode.COLLECT_RESULT:
            pending.result()  # all of gradwatch's work on the training thread
        if work is not None:
            waiter.submit(work.wait)  # awaited off the training thread, like `collect`'s

    for i in range(2 * len(BLOCK)):  # warm-up
        step(10 + i, BLOCK[i % len(BLOCK)])
    times: dict[StepMode, list[float]] = {m: [] for m in StepMode}
    blocks = max(1, steps // len(BLOCK))
    for i in range(blocks * len(BLOCK)):
        mode = BLOCK[i % len(BLOCK)]
        dist.barrier()
        t0 = time.perf_counter()
        step(100 + i, mode)
        times[mode].append(time.perf_counter() - t0)
    counted = {}
    for mode in (StepMode.PLAIN, StepMode.COLLECT_RESULT):
        dist.barrier()
        with OpCounter() as ops:
            step(10_000, mode)
        counted[mode] = CollectiveCount(ops.collectives, ops.collective_bytes)
    watch.close()
    waiter.shutdown()
    return DistributedCase(
        wrapper=wrapper, model=spec.label, n_params=n_params,
        n_tensors=len(watch.parameter_names),
        step_times={m: tuple(ts) for m, ts in times.items()},
        counts_plain=counted[StepMode.PLAIN], counts_watched=counted[StepMode.COLLECT_RESULT],
        gradwatch_counts=own, collect_call=Timing.of(call_times),
        divergence_counts=divergence, divergence_every=watch.config.divergence_every)


def _overhead_worker(rank: int, port: int, wrapper: str, specs: Sequence[ModelSpec],
                     steps: int, out: str) -> None:
    import torch.distributed as dist

    _init(rank, port)
    try:
        found = [_measure(spec, wrapper, spec.steps_for(wrapper, steps)) for spec in specs]
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(found))
    finally:
        dist.destroy_process_group()


def overhead(specs: Sequence[ModelSpec], steps: dict[str, int],
             wrappers: Sequence[str] = WRAPPERS) -> list[DistributedCase | DistributedFailure]:
    """Every model under every wrapper; a wrapper whose job fails is reported, not raised."""
    import torch.multiprocessing as mp

    out: list[DistributedCase | DistributedFailure] = []
    for wrapper in wrappers:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.pickle")
            try:
                mp.spawn(_overhead_worker,
                         args=(_free_port(), wrapper, list(specs), steps[wrapper], path),
                         nprocs=WORLD, join=True)
                # our own child wrote it, into our own temporary directory
                out += pickle.loads(Path(path).read_bytes())
            except Exception as exc:  # report, don't lose the other sections
                out.append(DistributedFailure(wrapper, f"{type(exc).__name__}: {exc}"))
    return out


# -- scrapers during training -----------------------------------------------------------------


def _scrape_worker(rank: int, port: int, tmp: str) -> None:
    """Trains the demo model under DDP, ``collect`` every step, until rank 0 sees ``stop``;
    rank 0 serves the endpoint and writes each step's (start, end) monotonic stamps."""
    import torch.distributed as dist

    _init(rank, port)
    try:
        from gradwatch import GradWatch, WatchConfig

        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(demo_net(), find_unused_parameters=True)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        cfg = WatchConfig(port=0 if rank == 0 else None, bind_address="127.0.0.1",
                          param_metrics_top_k=50, collective_timeout_seconds=120)
        watch = GradWatch(model, cfg)
        if rank == 0:
            Path(tmp, "pid").write_text(str(os.getpid()))
            Path(tmp, "url.tmp").write_text(str(watch.metrics_url))
            os.replace(Path(tmp, "url.tmp"), Path(tmp, "url"))
        gen = torch.Generator().manual_seed(10 + rank)
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen)
        stamps: list[tuple[float, float]] = []
        stop_file = Path(tmp, "stop")
        i = 0
        while True:
            if i % 20 == 0:  # agree on stopping (outside the timed steps)
                flag = torch.tensor([float(rank == 0 and stop_file.exists())])
                dist.all_reduce(flag)
                if flag.item() > 0 or i > 2_000_000:
                    break
            t0 = time.monotonic()
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            watch.collect(i)  # rank 0's exporter thread materializes and publishes it
            opt.step()
            stamps.append((t0, time.monotonic()))
            i += 1
        watch.close()
        if rank == 0:
            Path(tmp, "steps.json").write_text(json.dumps(stamps))
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown. The rank that finishes first has twice been
    # aborted there (``terminate called without an active exception``, SIGABRT) after its work,
    # its close() and destroy_process_group() were done, with only its main thread left; the
    # cause is not found (docs/distributed.md, "Closing"). This section measures step time.
    sys.stderr.flush()
    os._exit(0)


class _Scrapers:
    """The clients of a window with scrapers, tallying what they got: ``n`` threads GETting
    ``url`` back to back with a ``Prometheus/`` User-Agent, ``n_ordinary`` more without, and
    one thread keeping ``n_slowloris`` connections that send their request head a byte at a
    time (reconnecting when the server cuts them)."""

    def __init__(self, url: str, n: int, n_slowloris: int = 0, n_ordinary: int = 0) -> None:
        self.url = url
        self.n = n
        self.n_slowloris = n_slowloris
        self.n_ordinary = n_ordinary
        self.served = 0
        self.refused = 0  # 429s and failed requests
        self.cut = 0  # slow connections the server closed
        self.latencies: list[float] = []
        self._lock = threading.Lock()

    def run_for(self, seconds: float) -> None:
        stop = threading.Event()
        prometheus = {"User-Agent": "Prometheus/2.45.3"}
        threads = [threading.Thread(target=self._loop, args=(stop, prometheus), daemon=True)
                   for _ in range(self.n)]
        threads += [threading.Thread(target=self._loop, args=(stop, {}), daemon=True)
                    for _ in range(self.n_ordinary)]
        if self.n_slowloris:
            threads.append(threading.Thread(target=self._slowloris, args=(stop,), daemon=True))
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=60)

    def _loop(self, stop: threading.Event, headers: dict[str, str]) -> None:
        while not stop.is_set():
            t = time.monotonic()
            try:
                request = urllib.request.Request(self.url, headers=headers)
                with urllib.request.urlopen(request, timeout=30) as resp:
                    resp.read()
                ok = True
            except OSError:  # urllib's HTTPError (a 429 included) is one too
                ok = False
            with self._lock:
                if ok:
                    self.served += 1
                    self.latencies.append(time.monotonic() - t)
                else:
                    self.refused += 1

    def _slowloris(self, stop: threading.Event) -> None:
        parts = urllib.parse.urlsplit(self.url)
        address = (parts.hostname, parts.port)
        conns: list[socket.socket | None] = [None] * self.n_slowloris
        try:
            while not stop.is_set():
                for i, conn in enumerate(conns):
                    try:
                        if conn is None:
                            conn = conns[i] = socket.create_connection(address, timeout=5)
                            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                        conn.sendall(b"X")
                    except OSError:  # cut by the server (or refused): open another
                        if conn is not None:
                            conn.close()
                            with self._lock:
                                self.cut += 1
                        conns[i] = None
                stop.wait(1.0)
        finally:
            for conn in conns:
                if conn is not None:
                    conn.close()



def _client_process(conn: Connection, url: str, plan: ScrapersPlan) -> None:
    """The clients, in a process of their own at ``plan.client_nice``: for each number of
    seconds received, run them that long and send back (served, refused, cut, latencies, CPU
    seconds of this process); stop at ``None``."""
    os.nice(plan.client_nice)
    scrapers = _Scrapers(url, plan.n_scrapers, plan.n_slowloris, plan.n_ordinary)
    conn.send("ready")
    while (seconds := conn.recv()) is not None:
        cpu0 = time.process_time()
        scrapers.run_for(seconds)
        conn.send((scrapers.served, scrapers.refused, scrapers.cut, scrapers.latencies,
                   time.process_time() - cpu0))
        scrapers.served = scrapers.refused = scrapers.cut = 0
        scrapers.latencies = []


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux ``/proc``), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in task.read_text().split()]
    return out


def scrapers_during_training(plan: ScrapersPlan) -> ScrapersResult:
    """Step time of a 2-rank DDP job while ``plan``'s clients hammer rank 0's endpoint,
    alternating windows with and without them (``plan.cycles`` of each). The clients run in a
    process of their own at ``plan.client_nice``; the exporter process's CPU time is read from
    ``/proc`` around the windows with clients."""
    import multiprocessing

    import torch.multiprocessing as mp

    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_scrape_worker, args=(_free_port(), tmp), nprocs=WORLD,
                                 join=False, start_method="spawn")
        clients: multiprocessing.process.BaseProcess | None = None
        try:
            deadline = time.monotonic() + 120
            while not Path(tmp, "url").exists():
                if time.monotonic() > deadline or not all(p.is_alive() for p in ctx.processes):
                    raise RuntimeError("the training job did not start")
                time.sleep(0.05)
            exporters = _children(int(Path(tmp, "pid").read_text()))
            here, there = spawn.Pipe()
            clients = spawn.Process(target=_client_process, daemon=True,
                                    args=(there, Path(tmp, "url").read_text(), plan))
            clients.start()
            if not here.poll(120) or here.recv() != "ready":
                raise RuntimeError("the client process did not start")
            time.sleep(1.0)  # warm-up steps
            windows: list[tuple[bool, float, float]] = []  # (with scrapers, start, end)
            served = refused = cut = 0
            latencies: list[float] = []
            client_cpu = exporter_cpu = 0.0
            for k in range(2 * plan.cycles):
                t0 = time.monotonic()
                if k % 2 == 0:
                    time.sleep(plan.seconds_per_window)
                else:
                    cpu0 = sum(_cpu_seconds(pid) for pid in exporters)
                    here.send(plan.seconds_per_window)
                    if not here.poll(120):
                        raise RuntimeError("the client process stopped answering")
                    n_served, n_refused, n_cut, lat, cpu = here.recv()
                    served, refused, cut = served + n_served, refused + n_refused, cut + n_cut
                    latencies += lat
                    client_cpu += cpu
                    exporter_cpu += sum(_cpu_seconds(pid) for pid in exporters) - cpu0
                windows.append((k % 2 == 1, t0, time.monotonic()))
            here.send(None)
            Path(tmp, "stop").touch()
            deadline = time.monotonic() + 120
            while not ctx.join(timeout=1.0):  # join() returns once any one rank has exited
                if time.monotonic() > deadline:
                    raise RuntimeError("the training job did not stop in 120 s")
            stamps = json.loads(Path(tmp, "steps.json").read_text())
        finally:
            if clients is not None:
                clients.join(timeout=10)
                if clients.is_alive():
                    clients.kill()
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
    # A step counts when it lies wholly inside a window (a window with scrapers lasts until
    # the last in-flight scrape returns).
    steps: dict[bool, list[float]] = {False: [], True: []}
    for s0, s1 in stamps:
        for scraped, w0, w1 in windows:
            if w0 <= s0 and s1 <= w1:
                steps[scraped].append(s1 - s0)
                break
    return ScrapersResult(
        n_scrapers=plan.n_scrapers, cycles=plan.cycles,
        seconds_with=sum(w1 - w0 for scraped, w0, w1 in windows if scraped),
        without=Timing.of(steps[False]), with_scrapers=Timing.of(steps[True]),
        served=served, refused=refused,
        latency=Timing.of(latencies) if latencies else None,
        client_cpu_seconds=client_cpu, target=SCRAPERS_TARGET if plan.judged else None,
        n_slowloris=plan.n_slowloris, n_ordinary=plan.n_ordinary, slowloris_cut=cut,
        client_nice=plan.client_nice, exporter_cpu_seconds=exporter_cpu)
