"""The :class:`GradWatch` facade: resolve parameters once, collect cheaply every step.

Construction (once, collective on every rank when a process group is initialized): unwrap the
model, name and group its parameters, describe the local pieces, agree on the global layout with
one handshake (:mod:`gradwatch.reduce`), and on global rank 0 open the metrics endpoint.

``collect(step)`` (training thread): read every ``.grad`` (a Python loop of attribute reads, no
tensor ops), compute all squared norms with a constant number of ops (:mod:`gradwatch.stats`),
pack them and issue one all-reduce. It returns a :class:`PendingSnapshot` at once; the host read
of the reduced vector and the host-side summary happen in ``result()``, which the exporter calls
from its own thread.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.config import OTHER_GROUP, WatchConfig
from gradwatch.errors import GradWatchError, UnsupportedParallelismError
from gradwatch.reduce import Reducer, ReducedVector, piece_of
from gradwatch.snapshot import Snapshot
from gradwatch.stats import NormEngine, as_real_values
from gradwatch.summary import summarize

log = logging.getLogger("gradwatch")

#: Name segments added by wrappers; stripped so names are those of the unwrapped model.
WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean_name(name: str) -> str:
    """``module._orig_mod.layer.0.weight`` -> ``layer.0.weight``."""
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def _version() -> str:
    from gradwatch import __version__

    return __version__


def _reject_fsdp1(model: nn.Module) -> None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return
    for module in model.modules():
        if isinstance(module, FullyShardedDataParallel):
            raise UnsupportedParallelismError(
                "gradwatch: FSDP1 (FullyShardedDataParallel) is not supported: its flat "
                "parameters hide per-parameter shards and it needs an accelerator this project "
                "cannot test on. Use FSDP2 (torch.distributed.fsdp.fully_shard), which gradwatch "
                "measures exactly."
            )


def describe_parallelism(
    model: nn.Module, params: list[Tensor], world_size: int, stage_group: Any
) -> str:
    """Short description such as ``ddp4``, ``fsdp2x2+tp2``, ``hsdp2x2``, ``pp2+ddp2``."""
    if world_size <= 1:
        return "single"
    parts: list[str] = []
    if stage_group is not None:
        parts.append(f"pp{dist.get_world_size(stage_group)}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        parts.append(f"ddp{dist.get_world_size(model.process_group)}")
    fsdp_dims: set[str] = set()
    hsdp = False
    try:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    mesh = group.mesh_info.mesh
                    fsdp_dims.update(mesh.mesh_dim_names or ())
                    hsdp = hsdp or mesh.ndim == 2
                break
    except Exception:  # noqa: BLE001 - description only; never fail construction over it
        pass
    seen: dict[str, int] = {}
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        for i, size in enumerate(mesh.shape):
            name = (mesh.mesh_dim_names or [f"dim{i}"] * mesh.ndim)[i]
            seen.setdefault(name, size)
    fsdp_sizes = [seen.pop(n) for n in list(seen) if n in fsdp_dims]
    if fsdp_sizes:
        parts.append(("hsdp" if hsdp else "fsdp2x") + "x".join(str(s) for s in fsdp_sizes))
    parts.extend(f"{name}{size}" for name, size in seen.items())
    return "+".join(parts) or f"replicated{world_size}"


class PendingSnapshot:
    """The not-yet-materialized statistics of one collected step.

    ``result()`` waits at most once (the collective and the device->host copy), builds the
    :class:`Snapshot` on the host and caches it; it is safe to call from any thread.
    """

    def __init__(self, step: int, builder: Any = None, snapshot: Snapshot | None = None) -> None:
        self.step = step
        self._builder = builder
        self._snapshot = snapshot
        self._lock = threading.Lock()

    def done(self) -> bool:
        return self._snapshot is not None

    def result(self) -> Snapshot:
        if self._snapshot is None:
            with self._lock:
                if self._snapshot is None:
                    self._snapshot = self._builder()
                    self._builder = None
        return self._snapshot


class GradWatch:
    """Gradient health of a (possibly distributed) model; see the package docs.

    Args:
        model: the module, possibly wrapped (DDP, ``fully_shard``, ``torch.compile``,
            activation checkpointing). Its parameters are resolved once, here.
        config: a :class:`WatchConfig`; ``None`` reads everything from ``GRADWATCH_*``.
        process_group: the data-parallel group of ``model`` (informational; every rank of the
            world must construct a GradWatch, because the reduction spans the world).
        stage_group: the group of ranks holding *different* parts of the model (pipeline
            stages, hand-split model parallelism); their parameter names must be disjoint.
    """

    def __init__(
        self,
        model: nn.Module,
        config: WatchConfig | None = None,
        *,
        process_group: Any = None,
        stage_group: Any = None,
    ) -> None:
        self.config = config if config is not None else WatchConfig()
        _reject_fsdp1(model)
        cfg = self.config
        self._params: list[Tensor] = []
        names: list[str] = []
        for name, p in model.named_parameters():
            self._params.append(p)
            names.append(clean_name(name))
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise GradWatchError(f"gradwatch: duplicate parameter names after unwrapping: {dup}")
        self._process_group = process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        pieces = [piece_of(n, p) for n, p in zip(names, self._params, strict=True)]
        self._reducer = Reducer(
            pieces,
            version=_version(),
            config_hash=cfg.layout_hash(),
            timeout_seconds=cfg.collective_timeout_seconds,
            stage_group=stage_group,
        )
        layout = self._reducer.layout
        self._layout = layout
        self._groups_of = [self._group_of(n) for n in layout.names]
        self._group_order = list(cfg.groups)
        if OTHER_GROUP in self._groups_of:
            self._group_order.append(OTHER_GROUP)
        self.parallelism = describe_parallelism(model, self._params, self.world_size, stage_group)
        self._engine = NormEngine()
        self._collections = 0
        self._last: Snapshot | None = None
        self._last_divergence = 0.0
        self._broken: str | None = None
        self._logged: set[str] = set()
        self._closed = False
        self._server: Any = None
        if self.rank == 0 and cfg.port is not None:
            from gradwatch.export import MetricsServer

            self._server = MetricsServer(
                cfg, world_size=self.world_size, parallelism=self.parallelism
            )

    # -- public API ---------------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` on the serving rank, ``None`` elsewhere."""
        return self._server.url if self._server is not None else None

    @property
    def last(self) -> Snapshot | None:
        """The last snapshot materialized by ``result()`` (None before the first)."""
        return self._last

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Every parameter of the whole model (all ranks and stages), in layout order."""
        return self._layout.names

    def collect(self, step: int, *, grad_scale: Tensor | float | None = None) -> PendingSnapshot:
        """Queue the statistics of the current gradients for ``step``; never waits on the device.

        A step the schedule skips (``step % every_n_steps != 0``) is a no-op returning the last
        snapshot, identically on every rank. ``grad_scale``: gradients are divided by it (an AMP
        loss scale; a device tensor keeps this sync-free). Errors are logged, never raised: a
        failed collect returns the last snapshot, and the watcher stops collecting, so the ranks'
        collective sequences cannot diverge.
        """
        if self._closed or self._broken or step % self.config.every_n_steps:
            return self._pending_last(step)
        started = time.perf_counter()
        try:
            pending = self._collect(step, grad_scale)
        except Exception as exc:  # noqa: BLE001 - never let monitoring crash training
            self._broken = f"{type(exc).__name__}: {exc}"
            log.error(
                "gradwatch: collect(step=%d) failed on rank %d; collection is disabled for the "
                "rest of this run: %s",
                step,
                self.rank,
                self._broken,
            )
            return self._pending_last(step)
        if self._server is not None:
            self._server.observe_collect_seconds(time.perf_counter() - started)
            self._server.submit(pending)
        return pending

    def close(self) -> None:
        """Stop the endpoint and release gradwatch's process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        self._reducer.close()

    def __enter__(self) -> GradWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _group_of(self, name: str) -> str:
        for group, patterns in self.config.groups.items():
            if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                return group
        return OTHER_GROUP

    def _local_grads(self) -> Iterator[Tensor | None]:
        for p in self._params:
            g = p.grad
            if g is None or not p.requires_grad:
                yield None
                continue
            local = getattr(g, "_local_tensor", None)
            if local is not None:
                g = local
            if g.layout != torch.strided or g.is_complex():
                g = as_real_values(g)
            yield g

    def _collect(self, step: int, grad_scale: Tensor | float | None) -> PendingSnapshot:
        grads = list(self._local_grads())
        sq = self._engine.squared_norms(grads, self._reducer.device)
        if grad_scale is not None:
            scale = torch.as_tensor(grad_scale, dtype=torch.float64).to(sq.device)
            sq = sq / (scale * scale)
        has_grad = torch.tensor([g is not None for g in grads], dtype=torch.float64)
        every = self.config.divergence_every
        measure = every > 0 and self._collections % every == 0 and self._layout.replicas > 1
        self._collections += 1
        reduced = self._reducer.pack_and_reduce(sq, has_grad, step, with_replicas=measure)
        timestamp = time.time()
        return PendingSnapshot(step, lambda: self._build(reduced, step, measure, timestamp))

    def _build(self, reduced: ReducedVector, step: int, measured: bool, ts: float) -> Snapshot:
        values = reduced.host_values()
        lay = self._layout
        n = lay.size
        if values[3 * n + lay.replicas] != step * lay.world_size:
            self._log_once(
                "step-mismatch",
                "gradwatch: ranks called collect() with different steps (rank %d: %d); the "
                "statistics of this collect mix steps",
                self.rank,
                step,
            )
        if measured:
            self._last_divergence = _relative_spread(values[3 * n : 3 * n + lay.replicas])
        snap = summarize(
            step=step,
            cfg=self.config,
            names=lay.names,
            groups_of=self._groups_of,
            numels=lay.numels,
            squares=values[:n],
            nonfinite_flags=values[n : 2 * n],
            has_grad=values[2 * n : 3 * n],
            group_order=self._group_order,
            world_size=lay.world_size,
            parallelism=self.parallelism,
            replica_divergence=self._last_divergence,
            timestamp=ts,
        )
        if self._last is None or snap.step >= self._last.step:
            self._last = snap
        return snap

    def _pending_last(self, step: int) -> PendingSnapshot:
        last = self._last if self._last is not None else Snapshot(step=step)
        return PendingSnapshot(last.step, snapshot=last)

    def _log_once(self, kind: str, msg: str, *args: object) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)


def _relative_spread(squares: list[float]) -> float:
    norms = [math.sqrt(s) for s in squares]
    if any(math.isnan(x) for x in norms):
        return math.nan
    top = max(norms, default=0.0)
    if top == 0.0 or math.isinf(top):
        return 0.0 if top == 0.0 else math.nan
    return (top - min(norms)) / top
