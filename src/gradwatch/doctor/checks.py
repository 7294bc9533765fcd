"""The checks of ``gradwatch doctor``: proof, on the user's own hardware, that gradwatch is exact,
makes no device sync in ``collect()``, allocates nothing gradient-sized, what it costs, and that
its threading, collective and endpoint work there.

Each check returns a :class:`Check` (PASS/FAIL/SKIP/INCONCLUSIVE, the measured figure and the
threshold it is held to). A verdict never contradicts its own detail: a figure measured on a
machine too busy to judge it (a cost check whose median/best spread exceeds
:data:`NOISE_BOUND`) is INCONCLUSIVE, whatever the figure, never PASS or FAIL.
:func:`run_checks` runs them all on one device; the command (:mod:`gradwatch.cli.doctor`)
prints them. The references are independent of gradwatch's engine:
a float64 norm computed chunk by chunk on the CPU, each chunk rescaled by its max-abs and the
chunk norms combined by ``math.hypot``, so it is exact over float64's whole finite range.

Thresholds (docs/gpu.md justifies them): relative error <= 1e-6 for 32-bit and narrower
gradients and <= 1e-12 for float64; zero device synchronizations in a warm ``collect()`` (CUDA:
``torch.cuda.set_sync_debug_mode("error")``; CPU: no scalar read, no tensor built from Python
data, no blocking host copy into the reducer's vector, at most the one bulk read of the repair
list, which on a CPU is a memory read, not a device wait); peak extra memory of a warm
``collect()`` under 1% of the gradients; cost ``collect()+result()`` <= 1.2x
``get_total_norm(...).item()`` on CUDA. On CPU the cost bound is a 2x sanity bound (the
benchmarks hold the tighter CPU targets, docs/performance.md): a shared CPU's noise must not
fail a health check.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.config import WatchConfig
from gradwatch.doctor.cuda import cuda_checks
from gradwatch.doctor.kernels import check_kernels
from gradwatch.doctor.options import (
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIP,
    Check,
    DoctorOptions,
    dtype_name,
    environment,
)
from gradwatch.doctor.testing import OpCounter, count_blocking_copies, count_host_reads
from gradwatch.doctor.timing import interleaved
from gradwatch.watcher import GradWatch

__all__ = [
    "check_cost",
    "check_distributed",
    "check_endpoint",
    "check_exactness",
    "check_memory",
    "check_syncs",
    "check_threading",
    "reference_norm",
    "run_checks",
]


#: Relative error bound against the float64 reference, per gradient dtype.
EXACT_BOUND = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float16: 1e-6}
MEMORY_FRACTION = 0.01  # peak extra memory of a warm collect(), as a fraction of the gradients
COST_BOUND = {"cuda": 1.2, "cpu": 2.0}  # x get_total_norm / x torch's clip_grad_norm_
_CHUNK = 1 << 20
log = logging.getLogger("gradwatch")


# -- references and helpers ------------------------------------------------------------------


def reference_norm(tensors: Sequence[Tensor]) -> float:
    """The float64 L2 norm of all elements, independent of gradwatch: chunks of 1M elements
    copied to the CPU in float64, each rescaled by its max-abs, combined by ``math.hypot``.
    NaN if any element is NaN, +inf if any is infinite."""
    parts: list[float] = []
    inf = False
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), _CHUNK):
            chunk = flat[start : start + _CHUNK].to("cpu", torch.float64).abs()
            top = float(chunk.max()) if chunk.numel() else 0.0
            if math.isnan(top) or bool(chunk.isnan().any()):
                return math.nan
            if math.isinf(top):
                inf = True
                continue
            if top > 0.0:
                parts.append(top * math.sqrt(float(((chunk / top) ** 2).sum())))
    return math.inf if inf else math.hypot(*parts)


def _rel_err(got: float, want: float) -> float:
    if math.isnan(got) and math.isnan(want):
        return 0.0
    if math.isinf(want) or math.isinf(got):
        return 0.0 if got == want else math.inf
    if want == 0.0:
        return 0.0 if got == 0.0 else math.inf
    return abs(got - want) / abs(want)


class _Holder(nn.Module):
    """One parameter per gradient, ``.grad`` set to it (names ``p0``, ``p1``, ...)."""

    def __init__(self, grads: Sequence[Tensor], prefix: str = "p") -> None:
        super().__init__()
        for i, g in enumerate(grads):
            p = nn.Parameter(torch.empty(0, dtype=g.dtype, device=g.device))
            p.data = torch.empty_like(g)
            p.grad = g
            self.register_parameter(f"{prefix}{i}", p)


def _config(**overrides: Any) -> WatchConfig:
    """The checks' configuration: defaults and ``overrides`` only. Every field is given
    explicitly, so the job's ``GRADWATCH_*`` environment (read by ``WatchConfig()``) cannot
    change what a check measures: ``GRADWATCH_EVERY_N_STEPS=10`` would turn the measured
    collect into a skipped one (a vacuous PASS), ``GRADWATCH_PORT`` would start an endpoint
    inside the timed calls. Only the endpoint check reads the configured port. Kernels are not
    compiled (``kernels`` checks them): the checks time the eager paths, nothing compiling
    beside them."""
    fields = {
        name: info.get_default(call_default_factory=True)
        for name, info in WatchConfig.model_fields.items()
    }
    return WatchConfig(**{**fields, "compile_kernels": "off", **overrides})


@contextlib.contextmanager
def _watching(grads: Sequence[Tensor], **config: Any) -> Iterator[GradWatch]:
    watch = GradWatch(_Holder(grads), _config(**config))
    try:
        yield watch
    finally:
        watch.close()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Local checks run before any process group exists: silence gradwatch's warning that
    WORLD_SIZE > 1 has no process group (true, and intended, for these single-process checks)."""
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mixed(dtype: torch.dtype, device: torch.device, big: int, seed: int = 0) -> list[Tensor]:
    """48 tensors of ``big`` elements and 200 small ones (16-4,096): the benchmark's case
    (benchmarks/cases.py ``mixed_sizes``), magnitudes 1e-3 to 7e-3."""
    g = torch.Generator().manual_seed(1)
    sizes = [big] * 48 + [int(s) for s in torch.randint(16, 4097, (200,), generator=g)]
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(s, generator=g) * (1e-3 * (1 + i % 7))).to(device, dtype)
        for i, s in enumerate(sizes)
    ]


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB"


# -- environment -------------------------------------------------------------------------------


def check_environment(device: torch.device) -> Check:
    env = environment(device)
    text = ", ".join(f"{k} {v}" for k, v in env.items() if v not in (None, []))
    return Check("environment", PASS, text, "informational")


def check_foreach_fp64(device: torch.device, dtype: torch.dtype) -> Check:
    """Is ``_foreach_norm(dtype=float64)`` available for this gradient dtype on this device,
    and exact on a tensor whose float32 square would overflow? (The accelerator path.)"""
    name = f"environment.foreach_norm_fp64[{dtype_name(dtype)}]"
    big = {torch.float16: 6e4, torch.bfloat16: 1e30, torch.float32: 1e30, torch.float64: 1e30}
    t = torch.full((1000,), big[dtype], dtype=dtype, device=device)
    try:
        (out,) = torch._foreach_norm([t], 2, dtype=torch.float64)
        got = float(out)
    except RuntimeError as exc:  # torch's NotImplementedError included
        return Check(name, FAIL, f"unavailable: {type(exc).__name__}", "available", str(exc))
    err = _rel_err(got, reference_norm([t]))
    status = PASS if err <= 1e-12 else FAIL
    return Check(name, status, f"available, rel err {err:.2g}", "available, rel err <= 1e-12")


# -- exactness ---------------------------------------------------------------------------------


def _exact_cases(device: torch.device, dtypes: Sequence[torch.dtype]) -> list[tuple[str, list]]:
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    small = [torch.full((37,), 0.5), torch.linspace(-1, 1, 700)]
    cases: list[tuple[str, torch.dtype, list[tuple[int, float]]]] = [
        ("float32 elements of 1e20", f32, [(1 << 20, 1e20), (70_000, 3e19), (100, 1e20)]),
        ("float32 elements of 1e-25", f32, [(1 << 20, 1e-25), (70_000, 2e-25), (100, 1e-25)]),
        ("bfloat16 constants over 2^24 elements", bf16, [((1 << 24) + 3, 1.5), (1000, 0.75)]),
        ("float16 near its max", f16, [(1 << 20, 65000.0), (5000, 60000.0)]),
        ("float64 elements of 1e160", f64, [(1 << 18, 1e160), (300, 3e159)]),
        ("float64 elements of 1e-160", f64, [(1 << 18, 1e-160), (300, 2e-160)]),
    ]
    out = []
    for label, dtype, parts in cases:
        if dtype not in dtypes:
            continue
        grads = [torch.full((n,), v, dtype=dtype, device=device) for n, v in parts]
        grads += [s.to(device, dtype) for s in small]
        out.append((label, grads))
    return out


def check_exactness(device: torch.device, dtypes: Sequence[torch.dtype]) -> list[Check]:
    """Global and per-parameter norms of the hard cases against :func:`reference_norm`."""
    checks = []
    for label, grads in _exact_cases(device, dtypes):
        bound = EXACT_BOUND[grads[0].dtype]
        name = f"exactness[{label}]"
        with _watching(grads) as watch:
            snap = watch.collect(0).result()
        errs = [_rel_err(snap.global_norm, reference_norm(grads))]
        errs += [
            _rel_err(snap.param_norms[f"p{i}"], reference_norm([g])) for i, g in enumerate(grads)
        ]
        worst = max(errs)
        status = PASS if worst <= bound else FAIL
        checks.append(Check(name, status, f"rel err {worst:.2g}", f"<= {bound:g}"))
    checks += [_check_nonfinite(device, dtype) for dtype in dtypes]
    return checks


def _check_nonfinite(device: torch.device, dtype: torch.dtype) -> Check:
    """NaN/Inf at the first, a middle and the last element of large and small tensors of
    ``dtype`` (each dtype has its own path: float64 is rescaled on accelerators): exactly
    those parameters flagged, NaN norms where a NaN is, +inf where only an Inf is."""
    grads = [torch.ones(n, dtype=dtype, device=device) for n in (1 << 20, 1 << 20, 300, 5000, 10)]
    grads[0][-1] = math.nan  # last element of a large tensor (a partial row)
    grads[1][(1 << 19) + 7] = math.inf  # the middle of a row
    grads[2][0] = math.nan  # first element of a small (packed) tensor
    grads[3][4999] = -math.inf
    want_flagged = ["p0", "p1", "p2", "p3"]
    with _watching(grads) as watch:
        snap = watch.collect(0).result()
    problems = []
    if sorted(snap.nonfinite_params) != want_flagged:
        problems.append(f"flagged {sorted(snap.nonfinite_params)}, expected {want_flagged}")
    for i, g in enumerate(grads):
        want, got = reference_norm([g]), snap.param_norms[f"p{i}"]
        if _rel_err(got, want) > 0 and not (math.isnan(want) and math.isnan(got)):
            problems.append(f"p{i} norm {got} expected {want}")
    if not math.isnan(snap.global_norm):
        problems.append(f"global norm {snap.global_norm}, expected nan")
    measured = "positions flagged exactly" if not problems else "; ".join(problems)
    return Check(
        f"exactness[NaN/Inf positions, {dtype_name(dtype)}]",
        FAIL if problems else PASS,
        measured,
        "flags and NaN/Inf norms exact",
    )


# -- syncs, memory -----------------------------------------------------------------------------


def _warm(watch: GradWatch, steps: int = 3) -> None:
    for s in range(steps):
        watch.collect(s).result()


def check_syncs(device: torch.device, dtypes: Sequence[torch.dtype] = (torch.float32,)) -> Check:
    """Zero device synchronizations in a warm ``collect()``, on the float32 mix plus, for each
    other gradient dtype of ``dtypes``, a few tensors of it (every dtype's path: float64's
    rescaling on accelerators included)."""
    grads = _mixed(torch.float32, device, 1 << 16)
    for dtype in dtypes:
        if dtype != torch.float32:
            grads += [g.to(dtype) for g in _mixed(torch.float32, device, 70_000)[46:52]]
    with _watching(grads) as watch:
        _warm(watch)
        if device.type == "cuda":
            threshold = "0 synchronizations in collect()"
            _sync(device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                pending = watch.collect(10)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            # collect() never raises (monitoring must not crash training): a synchronizing
            # call inside it fails the step, and its result says why.
            try:
                pending.result()
            except RuntimeError as exc:  # the step that synchronized was not measured
                return Check("syncs", FAIL, _one_line(exc), threshold)
            return Check("syncs", PASS, "0 synchronizations", threshold)
        with count_host_reads() as reads, count_blocking_copies() as copies, OpCounter() as ops:
            pending = watch.collect(10)
        pending.result()
    bulk = sum(reads.values())
    measured = (
        f"{ops.scalar_reads} scalar reads, {copies.python_tensors} Python-built tensors, "
        f"{copies.blocking_copies} blocking host copies, {bulk} bulk reads"
    )
    ok = ops.scalar_reads == 0 and copies.total == 0 and bulk <= 1
    threshold = "0 scalar reads, 0 Python-built tensors, 0 blocking copies, <= 1 bulk read (CPU)"
    return Check("syncs", PASS if ok else FAIL, measured, threshold, copies.describe())


def check_memory(device: torch.device, quick: bool) -> Check:
    """Peak extra memory of a warm ``collect()`` above the gradients (CUDA: the allocator's
    peak; CPU: the largest memory one op allocated, kernels' internal allocations included)."""
    grads = _mixed(torch.float32, device, (1 << 18) if quick else (1 << 20))
    total = _nbytes(grads)
    bound = MEMORY_FRACTION * total
    with _watching(grads) as watch:
        _warm(watch)
        if device.type == "cuda":
            _sync(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            pending = watch.collect(10)
            _sync(device)
            extra = torch.cuda.max_memory_allocated(device) - base
            pending.result()
            what = "peak allocated above the gradients"
        else:
            from gradwatch.doctor.testing import largest_allocation

            with OpCounter() as ops:
                watch.collect(10).result()
            extra = max(ops.largest_bytes, largest_allocation(lambda: watch.collect(11)))
            what = f"largest temporary ({ops.largest_op or 'profiler'})"
    status = PASS if extra < bound else FAIL
    return Check(
        "memory",
        status,
        f"{_mib(extra)} ({100 * extra / total:.3g}% of {_mib(total)} of gradients)",
        f"< 1% of the gradients ({_mib(bound)})",
        what,
    )


# -- cost ----------------------------------------------------------------------------------------


#: A method whose median time exceeds its best by more than this factor was measured on a
#: machine too busy to judge speed: its cost verdict is INCONCLUSIVE (figures still shown).
NOISE_BOUND = 1.5


def _best_times(
    fns: dict[str, Callable[[], Any]], rounds: int, device: torch.device, budget: float
) -> tuple[dict[str, float], float]:
    """Best time of each method over interleaved rounds
    (:func:`gradwatch.doctor.timing.interleaved`:
    at least 3, at most ``rounds``, no new round after ``budget`` seconds, so the doctor's
    one-minute budget holds on a slow or busy machine), and the worst median/best spread.
    The best, not the median: the doctor measures what the hardware can do, and a shared or
    loaded machine inflates medians (the benchmarks report medians and their spread,
    docs/performance.md)."""
    times = interleaved(fns, (3, rounds), budget, sync=lambda: _sync(device))
    best = {k: min(v) for k, v in times.items()}
    spread = max(sorted(v)[len(v) // 2] / min(v) for v in times.values())
    return best, spread


def _verdict(ratio: float, bound: float, spread: float) -> str:
    """PASS or FAIL against ``bound``, when the timings allow a verdict (a median/best spread
    of at most :data:`NOISE_BOUND`); INCONCLUSIVE otherwise, whichever way the ratio points."""
    if spread > NOISE_BOUND:
        return INCONCLUSIVE
    return PASS if ratio <= bound else FAIL


def check_cost(device: torch.device, dtype: torch.dtype, quick: bool) -> list[Check]:
    """``collect()+result()`` vs ``get_total_norm(...).item()``, gradwatch's clip vs torch's, on
    the same tensors, and the read bandwidth they imply against a plain one-pass read."""
    # The benchmarks' case at full size even with --quick (fewer rounds only): at smaller sizes
    # fixed per-call costs dominate and the ratio would describe the case, not the device.
    grads = _mixed(dtype, device, 1 << 20)
    total = _nbytes(grads)
    bound = COST_BOUND["cuda" if device.type == "cuda" else "cpu"]
    huge = 1e30  # max_norm: coefficient 1, so repeated clips leave the gradients unchanged
    model = _Holder(grads)
    params = list(model.parameters())
    watch = GradWatch(model, _config())
    step = iter(range(1, 1 << 30))
    baseline_name = "get_total_norm"

    def baseline() -> float:
        return torch.nn.utils.get_total_norm(grads).item()

    if dtype != torch.float32 and device.type == "cpu":
        # On CPU torch norms bf16/fp16 in their own precision (relative error ~4e-4); the
        # benchmarks' CPU baseline for them accumulates in float32, as gradwatch does.
        baseline_name = "_foreach_norm(dtype=f32)"

        def baseline() -> float:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            return torch.linalg.vector_norm(torch.stack(norms)).item()

    # On CPU one thread, as the benchmarks measure single-process cases (benchmarks/run.py):
    # the figures are comparable with docs/performance.md's, and an intra-op pool shared with
    # other processes would time the machine's load rather than the method.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        pairs: list[dict[str, Callable[[], Any]]] = [
            {
                "gradwatch": lambda: watch.collect(next(step)).result(),
                "get_total_norm": baseline,
            },
            {
                "gradwatch_clip": lambda: watch.clip_grad_norm_(huge, step=next(step)),
                "torch_clip": lambda: torch.nn.utils.clip_grad_norm_(params, huge),
            },
            {"read": lambda: torch._foreach_max(grads)},
        ]
        # Each comparison interleaves its own pair only: an op that allocates and frees large
        # temporaries (a float32 copy per tensor) slows whatever runs after it on a CPU, which
        # would charge one method for another's allocations.
        t: dict[str, float] = {}
        spreads: list[float] = []
        for fns in pairs:  # the harness warms each method first: plans, buffers, caches
            best, spread = _best_times(fns, 7 if quick else 15, device, 1.5 if quick else 3.0)
            t.update(best)
            spreads.append(spread)
    finally:
        torch.set_num_threads(threads)
        watch.close()
    gbps = total / t["read"] / 1e9
    dn = dtype_name(dtype)
    norm_ratio = t["gradwatch"] / t["get_total_norm"]
    clip_ratio = t["gradwatch_clip"] / t["torch_clip"]
    detail = (
        f"{len(grads)} tensors, {_mib(total)}{', 1 thread' if device.type == 'cpu' else ''}; "
        f"gradwatch reads at "
        f"{total / t['gradwatch'] / 1e9:.3g} GB/s, a plain one-pass read at {gbps:.3g} GB/s "
        f"({t['gradwatch'] / t['read']:.3g}x the read); median/best spread {spreads[0]:.3g} "
        f"(a verdict needs <= {NOISE_BOUND:g})"
    )
    return [
        Check(
            f"cost[{dn}, collect()+result() vs {baseline_name}]",
            _verdict(norm_ratio, bound, spreads[0]),
            f"{norm_ratio:.3g}x ({1e3 * t['gradwatch']:.3g} vs {1e3 * t['get_total_norm']:.3g} ms"
            f" best of rounds)",
            f"<= {bound:g}x",
            detail,
        ),
        Check(
            f"cost[{dn}, clip_grad_norm_ vs torch's]",
            _verdict(clip_ratio, bound, spreads[1]),
            f"{clip_ratio:.3g}x ({1e3 * t['gradwatch_clip']:.3g} vs {1e3 * t['torch_clip']:.3g} ms"
            f" best of rounds)",
            f"<= {bound:g}x",
            f"median/best spread {spreads[1]:.3g} (a verdict needs <= {NOISE_BOUND:g})",
        ),
    ]


# -- threading, endpoint --------------------------------------------------------------------------


def check_threading(device: torch.device) -> Check:
    """A result materialized on another thread (as the publisher does) reads exactly what a
    result on the training thread reads, with the training stream still busy."""
    grads = _mixed(torch.float32, device, 1 << 18, seed=3)
    with _watching(grads) as watch:
        _warm(watch)
        other = watch.collect(10)
        box: dict[str, Any] = {}

        def read() -> None:
            try:
                box["snap"] = other.result()
            except Exception as exc:  # reported, not raised in the thread
                box["error"] = exc

        thread = threading.Thread(target=read, name="gradwatch-doctor-publisher")
        thread.start()
        if device.type == "cuda":  # keep the training stream busy while the thread reads
            x = torch.randn(2048, 2048, device=device)
            for _ in range(10):
                x = x @ x / 2048
        mine = watch.collect(10).result()
        thread.join(60)
    if thread.is_alive() or "error" in box:
        why = "no result within 60 s" if thread.is_alive() else repr(box["error"])
        return Check("threading", FAIL, why, "identical values")
    theirs = box["snap"]
    same = theirs.global_norm == mine.global_norm and theirs.param_norms == mine.param_norms
    return Check(
        "threading",
        PASS if same else FAIL,
        "identical" if same else f"{theirs.global_norm!r} vs {mine.global_norm!r}",
        "identical values",
    )


def check_endpoint(device: torch.device) -> Check:
    """Bind the configured port (``GRADWATCH_PORT`` and ``GRADWATCH_BIND_ADDRESS``, as the
    job's ``WatchConfig()`` reads them; without a configured port an ephemeral one on
    127.0.0.1), publish one step, scrape it, parse it with prometheus_client's text parser and
    compare the served global norm with the snapshot's. TLS and web-config settings are not
    applied (the scrape is plain HTTP)."""
    threshold = "binds the configured port, parses, serves the global norm"
    if int(os.environ.get("RANK", "0")) != 0:
        return Check("endpoint", SKIP, "not rank 0", "rank 0 serves")
    from prometheus_client.parser import text_string_to_metric_families

    from gradwatch.export.metrics import GRAD_NORM

    configured = WatchConfig()  # defaults < GRADWATCH_* environment, as the job gets them
    port, address = configured.port, configured.bind_address
    if not port:
        port, address = 0, "127.0.0.1"
    where = f"{address}:{port or 'ephemeral'}"
    grads = _mixed(torch.float32, device, 1 << 12, seed=5)
    with _watching(grads, port=port, bind_address=address) as watch:
        url = watch.metrics_url
        if url is None:
            return Check("endpoint", FAIL, f"could not bind {where}", threshold)
        snap = watch.collect(0).result()
        if not watch.flush(10.0):
            return Check("endpoint", FAIL, "the publisher did not publish in 10 s", "served")
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    family = families.get(GRAD_NORM.name)
    served = [s.value for s in family.samples] if family is not None else []
    ok = bool(served) and any(_rel_err(v, snap.global_norm) <= 1e-12 for v in served)
    measured = f"{len(families)} metric families parsed from {url} (bound {where})"
    if not ok:
        measured += f"; {GRAD_NORM.name} {served} vs snapshot {snap.global_norm}"
    return Check("endpoint", PASS if ok else FAIL, measured, threshold)


# -- distributed --------------------------------------------------------------------------------


def _rank_grads(rank: int, quick: bool) -> list[Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    n = 4 if quick else 8
    return [torch.randn(1000 * (i + 1), generator=g) * 10.0 ** (i - rank) for i in range(n)]


def check_distributed(device: torch.device, options: DoctorOptions) -> Check:
    """Under torchrun: one collect across every rank with the job's backend (NCCL on GPU)
    equals the single-process reference and uses one collective, and so does a clip (on NCCL
    the collect takes gradwatch's host gloo group, the clip the device). Each rank holds different
    parameters (a stage group over the world), so the sum really crosses ranks. The
    rendezvous, the handshake and the collective are bounded by ``options.timeout``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    threshold = "rel err <= 1e-6, 1 collective"
    if world <= 1:
        return Check("distributed", SKIP, "not launched under torchrun", threshold)
    backend = "nccl" if device.type == "cuda" else "gloo"
    rank = int(os.environ.get("RANK", "0"))
    timeout = timedelta(seconds=options.timeout)
    try:
        kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError, OSError) as exc:  # c10d's DistError kinds are RuntimeErrors
        return Check("distributed", FAIL, f"rendezvous failed: {_one_line(exc)}", threshold)
    try:
        grads = [g.to(device) for g in _rank_grads(rank, options.quick)]
        reference = reference_norm([g for r in range(world) for g in _rank_grads(r, options.quick)])
        try:
            watch = GradWatch(
                _Holder(grads, prefix=f"rank{rank}_p"),
                _config(collective_timeout_seconds=options.timeout),
                stage_group=dist.group.WORLD,
            )
        except RuntimeError as exc:  # LayoutMismatchError, GradWatchTimeoutError, c10d: named
            return Check(
                "distributed", FAIL, f"handshake failed: {_one_line(exc)}", threshold, backend
            )
        try:
            _warm(watch, 1)
            # Collectives issued by this collect, on the training thread or (NCCL: the
            # monitoring path) by gradwatch's host thread, which a dispatch mode does not see.
            issued = watch._reducer.issued
            pending = watch.collect(5)
            collectives = watch._reducer.issued - issued
            snap = pending.result()
            # The clip keeps the job's backend (on NCCL: the device path): same norm.
            clip_total = float(watch.clip_grad_norm_(1e30, step=6))
        finally:
            watch.close()
    except RuntimeError as exc:  # gradwatch's and c10d's errors; the rest reaches run_checks
        return Check("distributed", FAIL, f"collect failed: {_one_line(exc)}", threshold, backend)
    finally:
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()
    err = max(_rel_err(snap.global_norm, reference), _rel_err(clip_total, reference))
    ok = err <= 1e-6 and collectives == 1 and snap.world_size == world
    measured = f"rel err {err:.2g}, {collectives} collective(s), {world} ranks"
    return Check("distributed", PASS if ok else FAIL, measured, threshold, backend)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:300] if text else type(exc).__name__


# -- all of them ---------------------------------------------------------------------------------


def _family(step: str) -> str:
    return "environment" if step.startswith("foreach_norm") else step.split("[", 1)[0]


def run_checks(
    options: DoctorOptions, progress: Callable[[Check], None] | None = None
) -> list[Check]:
    """Every check on ``options.device``, in table order. A check that raises is a FAIL naming
    the exception (the doctor itself never crashes on what it measures)."""
    device = options.device
    cost_dtypes = [d for d in (torch.float32, torch.bfloat16) if d in options.dtypes]
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("environment", lambda: check_environment(device)),
        *[
            (f"foreach_norm_fp64[{dtype_name(d)}]", lambda d=d: check_foreach_fp64(device, d))
            for d in options.dtypes
        ],
        ("exactness", lambda: check_exactness(device, options.dtypes)),
        ("syncs", lambda: check_syncs(device, options.dtypes)),
        ("memory", lambda: check_memory(device, options.quick)),
        *[
            (f"cost[{dtype_name(d)}]", lambda d=d: check_cost(device, d, options.quick))
            for d in cost_dtypes
        ],
        ("threading", lambda: check_threading(device)),
        ("kernels", lambda: check_kernels(device)),
        ("endpoint", lambda: check_endpoint(device)),
        *cuda_checks(device),
    ]
    if options.only:
        steps = [(n, f) for n, f in steps if _family(n) in options.only]
    checks: list[Check] = []

    def add(result: Check | list[Check]) -> None:
        for c in result if isinstance(result, list) else [result]:
            checks.append(c)
            if progress is not None:
                progress(c)

    with _quiet():
        for name, step in steps:
            try:
                add(step())
            except Exception as exc:
                add(Check(name, FAIL, f"raised {_one_line(exc)}", "no error"))
    if options.only and "distributed" not in options.only:
        return checks
    try:  # last: it alone creates a process group
        add(check_distributed(device, options))
    except Exception as exc:
        add(Check("distributed", FAIL, f"raised {_one_line(exc)}", "no error"))
    return checks


