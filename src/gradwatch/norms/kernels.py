"""Tensor kernels compiled by inductor off the training thread, and used once they are ready.

Some per-step figures cost several eager passes over memory where one fused loop would read
each element once (a float64-accumulating norm of float32/bf16 gradients, an optimizer step
inverted from its state). ``torch.compile`` writes that loop, but compiling takes seconds per
layout, which a training step must never wait for. A :class:`KernelCache` therefore compiles
each (function, layout) pair on one daemon thread shared by the process and answers ``None``
until it is ready: the caller runs its eager path meanwhile, and for good when compiling failed
(logged once per cause, never raised). The eager and compiled paths compute the same figures;
callers document how close their results are.

Modes (``WatchConfig.compile_kernels``):

* ``"background"``: compile off the training thread; eager until ready.
* ``"wait"``: compile on first use, on the calling thread (benchmarks and tests that must time
  the compiled kernel from the first call).
* ``"off"``: never compile.

What compiling costs the job: one CPU thread for seconds per layout (inductor writes and builds
C++; ``compile_threads=1`` keeps it to this thread), files in inductor's cache directory, and
dynamo's process-wide compile lock while it compiles, so a ``torch.compile`` of the user's own
that starts meanwhile waits for it.

:func:`compile_traced` (a ``KernelCache``'s ``compiler``) compiles without dynamo: traced to an
aten graph and compiled by inductor, called without guards, never recompiled, nothing added to
dynamo's caches or recompile counts; for callers that key by the exact layout and check it on
every call (:mod:`gradwatch.norms.fused`, :mod:`gradwatch.norms.fused_updates`).

Sync behaviour: none. Compiling runs on example tensors of the layout (``empty_strided``), never
on the caller's tensors, and the compiled call on CPU tensors has no host read.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)

CompileMode = Literal["background", "wait", "off"]
COMPILE_MODES: tuple[str, ...] = ("background", "wait", "off")

# Inductor's options for every kernel: one compile worker (no process pool in the user's job).
COMPILE_OPTIONS: dict[str, Any] = {"compile_threads": 1}
# compile_traced's kernels: no size, stride or alignment checks in the wrapper (the caller's
# key is the exact layout; the checks cost a microsecond per argument on every call), and each
# bf16/fp16 op rounded to its dtype as eager's is (inductor otherwise keeps float32 between).
TRACED_OPTIONS: dict[str, Any] = {**COMPILE_OPTIONS, "size_asserts": False,
                                  "alignment_asserts": False, "emulate_precision_casts": True}

Compiler = Callable[[Callable[..., Any], Callable[[], tuple]], Callable[..., Any]]

_jobs: queue.SimpleQueue[tuple[Future, Callable[..., Any], Callable[[], tuple], Compiler]] = (
    queue.SimpleQueue())
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()
_running: list[Future] = []  # the compile in hand, if any
_exiting = threading.Event()
_logged_failures: set[str] = set()

#: How long an ending process waits for the compile in hand (see :func:`_quiesce_at_exit`).
EXIT_WAIT_SECONDS = 60.0


def _work() -> None:
    while True:
        future, fn, example, compiler = _jobs.get()
        if _exiting.is_set() or not future.set_running_or_notify_cancel():
            future.cancel()
            continue
        _running.append(future)
        try:
            future.set_result(compiler(fn, example))
        except Exception as error:
            future.set_exception(error)
        finally:
            _running.clear()


def wait_idle(timeout: float) -> bool:
    """Wait, at most ``timeout`` seconds, until the compile thread has nothing queued or in
    hand; True when it is idle. For benchmarks, so that no compile of one measurement runs
    beside the next: a training loop never calls it."""
    import time

    deadline = time.monotonic() + timeout
    while not _jobs.empty() or _running:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _quiesce_at_exit(timeout: float = EXIT_WAIT_SECONDS) -> None:
    """At interpreter exit: drop the compiles not started and wait (at most ``timeout``
    seconds) for the one in hand. A daemon thread still inside torch's compiler when the
    interpreter finalizes is ended by unwinding through C++ frames, which aborts the process
    ("terminate called without an active exception", exit status 134): a job that ended well
    would be reported as failed. Idle, the thread waits on the queue, where ending it is safe."""
    _exiting.set()
    while True:
        try:
            _jobs.get_nowait()[0].cancel()
        except queue.Empty:
            break
    for future in list(_running):
        log.warning("gradwatch: waiting up to %.0f s for a kernel compile to end before the "
                    "process exits (compile_kernels='off' never compiles)", timeout)
        with contextlib.suppress(TimeoutError, CancelledError):
            future.exception(timeout=timeout)


atexit.register(_quiesce_at_exit)


def submit(fn: Callable[..., Any], example: Callable[[], tuple],
           compiler: Compiler | None = None) -> Future:
    """Compile ``fn`` for ``example``'s layout with ``compiler`` (:func:`compile_traced` by
    default) on the process's one compile thread: a daemon (a ``ThreadPoolExecutor``'s
    workers are joined at exit, which would keep a finished job alive until a compile ends)."""
    global _worker
    future: Future = Future()
    if _exiting.is_set():
        future.cancel()
        return future
    _jobs.put((future, fn, example, compiler or compile_traced))
    with _worker_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="gradwatch-compile", daemon=True)
            _worker.start()
    return future


def compile_traced(fn: Callable[..., Any], example: Callable[[], tuple],
                   cpp_wrapper: bool = False) -> TracedKernel:
    """``fn`` traced to an aten graph for the layout of ``example()``'s arguments (tensors, lists
    of tensors, None: no other value) and compiled by inductor, without dynamo: the result is
    called with arguments of that pytree structure and exactly that layout, and checks neither
    (no guards: a call costs a few microseconds, where a ``torch.compile``'d function spends
    tens on its guards; nothing ever recompiles). The caller keys it by :func:`tensor_layout`
    and never calls it with another layout. Compiles under dynamo's compile lock (a
    ``torch.compile`` of the user's own waits meanwhile) and in inference mode, and runs once
    on the example.

    The graph takes the flattened tensors and is traced with inductor's decompositions, as
    ``torch.compile`` would hand it over; it is compiled by ``compile_fx_inner`` alone, so a
    call runs inductor's generated code directly, without AOTAutograd's runtime wrappers
    (autograd, pytree and dynamo context on every call: about half of a small kernel's
    host time). The traced functions are pure (no input is mutated), so no functionalization
    is needed.

    ``cpp_wrapper``: the generated code that allocates the kernel's buffers and calls it is
    C++ (inductor's ``cpp_wrapper``) instead of Python: a call spends no Python per buffer
    (what a kernel with many per-view results, the update figures', saves on every call; it
    compiles slower). Its graph takes tensors only, so a ``None`` argument is left out of the
    call (its place is part of the layout); so are the Python wrapper's graphs."""
    import torch
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._pytree import tree_flatten, tree_unflatten

    args = example()
    leaves, spec = tree_flatten(args)
    present = [i for i, leaf in enumerate(leaves) if leaf is not None]
    tensors = [leaves[i] for i in present]

    def flat(*given: Tensor) -> tuple[Tensor]:
        full: list[Any] = [None] * len(leaves)
        for i, t in zip(present, given, strict=True):
            full[i] = t
        return (fn(*tree_unflatten(full, spec)),)

    with _compile_lock(), torch.no_grad(), inductor_config.patch(TRACED_OPTIONS):
        graph = make_fx(flat, decomposition_table=select_decomp_table())(*tensors)
        compiled = compile_fx_inner(graph, tensors, cpp_wrapper=cpp_wrapper)
        compiled(list(tensors))  # the first call by inductor's own entry: it ends its compile
        kernel = TracedKernel(compiled, spec, len(present) < len(leaves))
        kernel(*args)
    return kernel


def compile_traced_cpp(fn: Callable[..., Any], example: Callable[[], tuple]) -> TracedKernel:
    """:func:`compile_traced` with a C++ wrapper (a :class:`KernelCache` compiler)."""
    return compile_traced(fn, example, cpp_wrapper=True)


class TracedKernel:
    """A :func:`compile_traced` kernel: called with its function's arguments, it hands their
    tensors to the compiled graph as one flat list (inductor's boxed calling convention: the
    list is consumed) and returns the function's one result. A single list of tensors, the
    common argument, is passed on as is without flattening.

    The call goes to the compiled graph's generated code (its ``current_callable``) directly:
    inductor's ``CompiledFxGraph.__call__`` around it only records debug and autotune-cache
    state, none of which a CPU graph traced without dynamo uses after its first call (made by
    :func:`compile_traced`), and costs about a microsecond per call. While the autograd
    profiler is on, calls go through it (it labels the call in the trace)."""

    __slots__ = ("_compiled", "_direct", "_no_none", "_one_list", "_spec")

    def __init__(self, compiled: Callable[[list[Any]], Sequence[Any]], spec: Any,
                 drops_none: bool = False) -> None:
        from torch.utils._pytree import tree_flatten

        self._compiled = compiled
        self._no_none = drops_none  # the graph takes the tensor leaves only
        direct = getattr(compiled, "current_callable", None)
        self._direct: Callable[[list[Any]], Sequence[Any]] = (
            direct if callable(direct) else compiled)
        self._spec = spec
        probe = ([object()] * spec.num_leaves,)
        self._one_list = tree_flatten(probe)[1] == spec

    def __call__(self, *args: Any) -> Any:
        run = self._compiled if _profiler_on() else self._direct
        if self._one_list:
            return run(list(args[0]))[0]
        from torch.utils._pytree import tree_leaves

        leaves = tree_leaves(args)
        if self._no_none:
            leaves = [leaf for leaf in leaves if leaf is not None]
        return run(leaves)[0]

    def call_leaves(self, leaves: list[Any]) -> Any:
        """The call with the graph's inputs already flat: ``leaves`` are the tensor leaves of
        the arguments in :func:`~torch.utils._pytree.tree_leaves` order (no ``None``), as
        :meth:`__call__` would pass them (a caller repeating one call builds them once;
        copied here, as the graph consumes its list)."""
        run = self._compiled if _profiler_on() else self._direct
        return run(list(leaves))[0]


def _profiler_on() -> bool:
    """Is torch's autograd profiler recording (its flag, read without a call into C++)?"""
    return bool(_autograd_profiler()._is_profiler_enabled)


@functools.cache
def _autograd_profiler() -> Any:
    from torch.autograd import profiler

    return profiler


def _compile_lock() -> Any:
    """Dynamo's process-wide compile lock (a null context where this torch has none)."""
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:  # pragma: no cover - a torch without it
        return contextlib.nullcontext()
    return compile_lock


def tensor_layout(tensors: Sequence[Tensor | None]) -> tuple:
    """What dynamo's guards read of each tensor argument (dtype, device, shape, strides, and
    whether it requires grad): a kernel keyed by it is never recompiled on the caller's
    thread. Call compiled kernels under ``torch.no_grad()`` (grad mode is guarded too)."""
    return tuple(None if t is None else (t.dtype, t.device, tuple(t.shape), t.stride(),
                                         t.requires_grad) for t in tensors)


def compiled_calls_allowed() -> bool:
    """False while a ``TorchDispatchMode`` is active (gradwatch's op counters, a user's
    tracing mode): dynamo would trace under it; the eager path is what such a mode observes."""
    import torch

    return torch._C._len_torch_dispatch_stack() == 0


def _log_failure(name: str, error: BaseException) -> None:
    cause = f"{name}: {type(error).__name__}"
    if cause in _logged_failures:
        return
    _logged_failures.add(cause)
    log.warning("gradwatch: compiling %s failed (%s: %s); its eager path stays in use. "
                "Set compile_kernels='off' to stop trying.", name, type(error).__name__, error)


class KernelCache:
    """Compiled kernels per (function, layout key), built in ``mode`` (see the module docstring)
    by ``compiler`` (:func:`compile_traced` by default: no guards, so the callers key by the
    exact layout and check it before every call).

    :meth:`get` never blocks in ``"background"`` mode and never raises: a failed compile is
    logged once and its key stays eager. ``failed``, ``ready`` and ``pending`` count the keys
    in each state (``gradwatch doctor`` and the tests read them). ``limit``: at most this many
    keys are ever compiled (None: no limit); a key seen after that stays eager, logged once (a
    layout that changes every step, say a mixture of experts whose routed experts alone have
    gradients, would otherwise keep the compile thread busy for good and the kernels piling up).
    """

    def __init__(self, mode: CompileMode = "background",
                 compiler: Compiler | None = None, limit: int | None = None) -> None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile_kernels must be one of {COMPILE_MODES}, got {mode!r}")
        self.mode: CompileMode = mode
        self.limit = limit
        self._compiler: Compiler = compiler or compile_traced
        self._entries: dict[Hashable, Future | Callable[..., Any] | None] = {}
        self._over_limit_logged = False

    def get(self, fn: Callable[..., Any], key: Hashable,
            example: Callable[[], tuple]) -> Callable[..., Any] | None:
        """The compiled ``fn`` for ``key`` if it is ready, else None (and compiling starts on
        first sight of ``key``). ``example`` builds arguments of the layout ``key`` names."""
        if self.mode == "off":
            return None
        full_key = (fn.__module__, fn.__qualname__, key)
        entry = self._entries.get(full_key, _MISSING)
        if entry is _MISSING and self.limit is not None and len(self._entries) >= self.limit:
            if not self._over_limit_logged:
                self._over_limit_logged = True
                log.warning("gradwatch: %d kernel layouts compiled, the limit; new layouts "
                            "(%s) stay on their eager path", self.limit, fn.__qualname__)
            return None
        if entry is _MISSING:
            if self.mode == "wait":
                entry = self._compile_or_none(fn, example)
                self._entries[full_key] = entry
                return entry
            self._entries[full_key] = submit(fn, example, self._compiler)
            return None
        if isinstance(entry, Future):
            if not entry.done():
                return None
            if entry.cancelled():  # the process is exiting: no compile will start
                self._entries[full_key] = None
                return None
            error = entry.exception()
            if error is not None:
                _log_failure(fn.__qualname__, error)
                self._entries[full_key] = None
                return None
            entry = entry.result()
            self._entries[full_key] = entry
        return entry  # type: ignore[return-value]

    def _compile_or_none(self, fn: Callable[..., Any],
                         example: Callable[[], tuple]) -> Callable[..., Any] | None:
        try:
            return self._compiler(fn, example)
        except Exception as error:
            _log_failure(fn.__qualname__, error)
            return None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds each) for the compiles started so far; True when
        none is still pending. For benchmarks and tests: a training loop never calls it."""
        for entry in list(self._entries.values()):
            if isinstance(entry, Future):
                try:
                    entry.exception(timeout=timeout)
                except TimeoutError:
                    return False
                except CancelledError:
                    continue
        return True

    def _count(self, state: str) -> int:
        n = 0
        for entry in self._entries.values():
            if isinstance(entry, Future):
                done = entry.done()
                kind = "pending" if not done else (
                    "failed" if entry.cancelled() or entry.exception() is not None else "ready")
            else:
                kind = "failed" if entry is None else "ready"
            n += kind == state
        return n

    @property
    def ready(self) -> int:
        return self._count("ready")

    @property
    def pending(self) -> int:
        return self._count("pending")

    @property
    def failed(self) -> int:
        return self._count("failed")


_MISSING: Any = object()
