"""The :class:`GradWatch` facade: resolve parameters once, collect cheaply every step.

Construction (once, collective on every rank when a process group is initialized): unwrap the
model, name and group its parameters, describe the local pieces, agree on the global layout with
one handshake (:mod:`gradwatch.reduce`), and on global rank 0 open the metrics endpoint.

``collect(step)`` (training thread): read every ``.grad`` (a Python loop of attribute reads, no
tensor ops), compute all squared norms with a constant number of ops (:mod:`gradwatch.stats`),
pack them and issue one all-reduce. It returns a :class:`PendingSnapshot` at once; the host read
of the reduced vector and the host-side summary happen in ``result()``, which the exporter calls
from its own thread (the publisher, which also appends to the history file when
``history_path`` is set, with or without an endpoint).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.amp import pending_scale
from gradwatch.config import OTHER_GROUP, WatchConfig
from gradwatch.errors import GradWatchError, GradWatchTimeoutError, UnsupportedParallelismError
from gradwatch.reduce import ReducedVector, Reducer, piece_of
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
    model: nn.Module,
    params: list[Tensor],
    world_size: int,
    stage_group: Any,
    process_group: Any = None,
) -> str:
    """Short description of the detected parallelism, for the snapshot and ``run_info``.

    Parts joined by ``+``, outermost first: ``pp{n}`` (``stage_group`` of n ranks), ``ddp{n}``
    (a ``DistributedDataParallel`` wrapper), ``fsdp2x{n}`` (FSDP2 sharding over n ranks) or
    ``hsdp{r}x{s}`` (FSDP2 with a replicate x shard mesh), then the other dims of the DTensor
    meshes by name (``tp2``; unnamed dims are ``mesh{n}``), then ``dp{n}`` when a
    ``process_group`` was given and no data-parallel wrapper was found. Examples: ``ddp4``,
    ``fsdp2x4``, ``fsdp2x2+tp2``, ``hsdp2x2``, ``pp2+ddp2``. ``replicated{n}`` when nothing was
    detected (plain replicas); ``single`` for one process. Description only: never raises.
    """
    if world_size <= 1:
        return "single"
    try:
        return _describe(model, params, world_size, stage_group, process_group)
    except Exception:  # description only; never fail construction over it
        log.debug("gradwatch: could not describe the parallelism", exc_info=True)
        return f"unknown{world_size}"


def _describe(
    model: nn.Module, params: list[Tensor], world_size: int, stage_group: Any, process_group: Any
) -> str:
    parts: list[str] = []
    if stage_group is not None:
        parts.append(f"pp{dist.get_world_size(stage_group)}")
    data_parallel = False
    for module in model.modules():
        if isinstance(module, nn.parallel.DistributedDataParallel):
            parts.append(f"ddp{dist.get_world_size(module.process_group)}")
            data_parallel = True
            break
    # FSDP2: the mesh of the first parameter group found (submodules before an empty root).
    fsdp_mesh: Any = None
    fsdp_part = ""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue  # e.g. a root whose parameters all belong to sharded children
        info = group.mesh_info
        fsdp_mesh = info.mesh
        shard = getattr(info, "shard_mesh_dim", None)
        replicate = getattr(info, "replicate_mesh_dim", None)
        if shard is not None and replicate is not None:
            fsdp_part = f"hsdp{fsdp_mesh.size(replicate)}x{fsdp_mesh.size(shard)}"
        elif shard is not None:
            fsdp_part = f"fsdp2x{fsdp_mesh.size(shard)}"
        elif replicate is not None:
            fsdp_part = f"ddp{fsdp_mesh.size(replicate)}"
        break
    if fsdp_part:
        parts.append(fsdp_part)
        data_parallel = True
    fsdp_names = set(fsdp_mesh.mesh_dim_names or ()) if fsdp_mesh is not None else set()
    others: dict[str, int] = {}
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or not hasattr(p, "_local_tensor"):
            continue
        if fsdp_mesh is not None and mesh == fsdp_mesh:
            continue
        dim_names = mesh.mesh_dim_names
        for i, size in enumerate(mesh.shape):
            name = dim_names[i] if dim_names else "mesh"
            if name in fsdp_names:
                continue
            others.setdefault(name, size)
    parts.extend(f"{name}{size}" for name, size in others.items())
    if not data_parallel and process_group is not None:
        size = dist.get_world_size(process_group)
        if size > 1:
            parts.append(f"dp{size}")
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
        self.rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
        self.world_size = dist.get_world_size() if distributed else 1
        if not distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            log.warning(
                "gradwatch: WORLD_SIZE=%s but no process group is initialized: statistics are "
                "this rank's only; call torch.distributed.init_process_group before GradWatch",
                os.environ["WORLD_SIZE"],
            )
        pieces = [piece_of(n, p) for n, p in zip(names, self._params, strict=True)]
        #: positions of DTensor parameters (FSDP2, TP): their gradients are read as local shards
        self._sparse_positions: list[int] = []  # set by _local_grads on every collect
        self._dtensor_positions = [
            i for i, p in enumerate(self._params) if hasattr(p, "_local_tensor")
        ]
        self._complex_positions = [i for i, p in enumerate(self._params) if p.is_complex()]
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
        self.parallelism = describe_parallelism(
            model, self._params, self.world_size, stage_group, process_group
        )
        self._engine = NormEngine()
        self._collections = 0
        self._last: Snapshot | None = None
        self._last_divergence = 0.0
        self._isolated: tuple[str, ...] = tuple(cfg.isolated)
        self._broken: str | None = None
        self._logged: set[str] = set()
        self._anomaly_log = RateLimitedLog(period_seconds=60.0)
        self._optimizer_steps = 0
        self._hooks: list[Any] = []
        self._closed = False
        self._publishing: Any = None  # gradwatch.export.Publishing on rank 0 (imported lazily)
        if self.rank == 0:
            self._start_publishing(cfg)

    # -- public API ---------------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` on the serving rank, ``None`` elsewhere."""
        return self._publishing.url if self._publishing is not None else None

    @property
    def last(self) -> Snapshot | None:
        """The snapshot of the last collected step (None before the first collect).

        Materializes the newest pending result if nobody did (waits for it, once).
        """
        latest = self._latest
        if latest is not None:
            try:
                return latest.result()
            except Exception as exc:  # a timed-out collective must not escape a property
                self._log_once("last", "gradwatch: the last collect failed: %s", exc)
        return self._last

    @property
    def isolated(self) -> tuple[str, ...]:
        """The groups currently expected to receive no gradient (see :meth:`set_isolated`)."""
        return self._isolated

    def set_isolated(self, groups: Iterable[str]) -> None:
        """Change which groups are expected to receive no gradient, from the next collect on.

        Isolation is a per-stage expectation, not a fixed rule: a host network is isolated
        while a new seed module trains alone, then trains again when the seed blends in.
        Host-side only (no collective, nothing re-agreed across ranks); it starts with
        ``WatchConfig.isolated``. Unknown group names raise ``ValueError`` naming them.
        """
        wanted = tuple(dict.fromkeys(groups))
        known = set(self.config.groups) | {OTHER_GROUP}
        unknown = [g for g in wanted if g not in known]
        if unknown:
            raise ValueError(
                f"gradwatch: set_isolated(groups=...) names unknown group(s) {unknown}; "
                f"known: {sorted(known)}"
            )
        self._isolated = wanted

    @property
    def parameter_names(self) -> tuple[str, ...]:
        """Every parameter of the whole model (all ranks and stages), in layout order."""
        return self._layout.names

    def collect(
        self, step: int, *, scaler: Any = None, optimizer: Any = None
    ) -> PendingSnapshot:
        """Queue the statistics of the current gradients for ``step``; never waits on the device.

        A step the schedule skips (``step % every_n_steps != 0``) is a no-op returning the last
        snapshot, identically on every rank. ``scaler``: a ``torch.amp.GradScaler``; norms are
        then of the unscaled gradients (divided by the scale on the device, unless
        ``scaler.unscale_`` already ran), and a non-finite step is reported as AMP-skipped.
        Errors are logged, never raised: a failed collect returns the last snapshot, and the
        watcher stops collecting, so the ranks' collective sequences cannot diverge.
        """
        return self._guarded(step, scaler, optimizer, None)[0]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        *,
        step: int | None = None,
        scaler: Any = None,
    ) -> Tensor:
        """Clip all gradients to a whole-model L2 norm of ``max_norm`` and collect, in one pass.

        Equals ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on one process,
        and the whole-model result under DDP, FSDP2, TP and pipeline stages (where torch's own
        function returns a rank-local norm): the norm comes from the same all-reduce that
        carries the statistics. Returns the pre-clip total norm, a 0-dim float64 tensor (no host
        sync; on gloo the all-reduce is awaited, as clipping needs it). Gradients are multiplied
        by ``clamp(max_norm / (total + 1e-6), max=1)`` with ``_foreach_mul_``, unconditionally,
        like ``clip_grads_with_norm_``. ``step`` defaults to gradwatch's own optimizer-step
        counter. The collected snapshot has pre-clip norms and ``clip_coef``. Steps the schedule
        skips are clipped by the whole-model norm too (same pass and all-reduce, no snapshot);
        only after an error disabled collection does torch's function clip (rank-local norm).
        """
        if norm_type != 2.0:
            raise ValueError(
                f"gradwatch: clip_grad_norm_ supports norm_type=2.0 only, got {norm_type}"
            )
        if step is None:
            step = self._optimizer_steps
        _, total = self._guarded(step, scaler, None, float(max_norm))
        if total is None:  # skipped by the schedule, or collection disabled after an error
            params = [p for p in self._params if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(
                params, max_norm, norm_type, error_if_nonfinite
            ).to(torch.float64)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"gradwatch: the total norm of gradients is non-finite ({float(total)}), so it "
                "cannot be clipped; set error_if_nonfinite=False to clip anyway"
            )
        return total

    def attach(self, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
        """Collect automatically before every ``every_n_steps``-th ``optimizer.step()``.

        The step number is gradwatch's own counter of optimizer steps (identical on every rank).
        A pre-step hook sees gradients *after* any clipping the loop did: to watch pre-clip norms
        and clip in one pass, call :meth:`clip_grad_norm_` instead of torch's (it records the
        step, so the hook does not collect twice). With a ``scaler``, collection happens in
        ``scaler.step(optimizer)`` (wrapped), so steps the scaler skips are seen too.
        """
        if scaler is not None and scaler.is_enabled():
            original = scaler.step

            def step_and_collect(opt: Any, *args: Any, **kwargs: Any) -> Any:
                if opt is optimizer:
                    self._hooked_collect(scaler, optimizer)
                return original(opt, *args, **kwargs)

            scaler.step = step_and_collect
            self._hooks.append(_Restore(scaler, "step"))
            return

        def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:
            self._hooked_collect(None, optimizer)

        self._hooks.append(optimizer.register_step_pre_hook(pre_hook))

    def _hooked_collect(self, scaler: Any, optimizer: Any) -> None:
        step = self._optimizer_steps
        self._optimizer_steps += 1
        if self._clipped_step == step:
            return  # clip_grad_norm_ already collected this step (pre-clip)
        self.collect(step, scaler=scaler, optimizer=optimizer)

    def _guarded(
        self, step: int, scaler: Any, optimizer: Any, max_norm: float | None
    ) -> tuple[PendingSnapshot, Tensor | None]:
        if max_norm is not None:
            self._clipped_step = step
        skipped = step % self.config.every_n_steps != 0
        if self._closed or self._broken or (skipped and max_norm is None):
            return self._pending_last(step), None
        started = time.perf_counter()
        try:
            # A skipped step that clips still needs the whole-model norm (a rank-local one is
            # wrong under FSDP2/TP/pipelines): same pass and all-reduce, no snapshot.
            pending, total = self._collect(step, scaler, optimizer, max_norm, record=not skipped)
        except Exception as exc:  # never let monitoring crash training
            self._broken = f"{type(exc).__name__}: {exc}"
            log.error(
                "gradwatch: collect(step=%d) failed on rank %d; collection is disabled for the "
                "rest of this run: %s",
                step,
                self.rank,
                self._broken,
            )
            return self._pending_last(step), None
        if skipped:
            return self._pending_last(step), total
        self._latest = pending
        if self._publishing is not None:
            self._publishing.observe_collect_seconds(time.perf_counter() - started)
            self._publishing.submit(pending)
        return pending, total

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every step collected so far reached the endpoint and the history file.

        Only global rank 0 publishes; elsewhere, and with neither ``port`` nor
        ``history_path``, returns True at once. False on timeout or after :meth:`close`.
        """
        if self._publishing is None:
            return not self._closed
        return bool(self._publishing.flush(timeout))

    def close(self) -> None:
        """Flush and stop the endpoint and the history (bounded wait), release gradwatch's
        process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        try:
            if self._publishing is not None:
                self._publishing.close()  # flushes first: pending steps reach every sink
        finally:
            self._reducer.close()

    def __enter__(self) -> GradWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _start_publishing(self, cfg: WatchConfig) -> None:
        """Global rank 0: the endpoint (``port``) and/or the history file (``history_path``),
        fed by one publisher thread (:func:`gradwatch.export.open_publishing`), so the training
        thread only ever queues a pending result."""
        from gradwatch.export import open_publishing

        self._publishing = open_publishing(
            cfg, world_size=self.world_size, parallelism=self.parallelism
        )

    def _group_of(self, name: str) -> str:
        for group, patterns in self.config.groups.items():
            if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                return group
        return OTHER_GROUP

    def _local_grads(self) -> list[Tensor | None]:
        """This rank's gradients as real strided tensors (None: no gradient, or frozen).

        One list comprehension for all parameters; DTensor positions (known from the
        parameters at construction) become their local shards; sparse and complex gradients
        (rare) become their values / real views. Per-parameter Python is kept to a few attribute
        reads: this runs on the training thread every collected step.
        """
        grads = [p.grad if p.requires_grad else None for p in self._params]
        for i in self._dtensor_positions:
            g = grads[i]
            if g is None:
                continue
            p = self._params[i]
            if g.placements != p.placements:
                # The layout (who counts which piece) was agreed from the parameter's
                # placements; a gradient placed otherwise (e.g. Partial) cannot be counted
                # exactly without a collective. Identical on every rank: all stop together.
                raise UnsupportedParallelismError(
                    f"gradwatch: a gradient has placements {g.placements} but its parameter "
                    f"{p.placements}; gradwatch measures gradients placed like their "
                    "parameters (FSDP2, parallelize_module) only"
                )
            grads[i] = g._local_tensor
        strided = torch.strided
        self._sparse_positions = [
            i for i, g in enumerate(grads) if g is not None and g.layout is not strided
        ]  # their values may be coalesced copies
        # A gradient has its parameter's dtype (autograd and the .grad setter enforce it), so
        # complex positions are known from the parameters, at construction.
        for i in sorted({*self._sparse_positions, *self._complex_positions}):
            g = grads[i]
            if g is not None:
                grads[i] = as_real_values(g)
        return grads

    def _collect(
        self,
        step: int,
        scaler: Any,
        optimizer: Any,
        max_norm: float | None,
        record: bool = True,
    ) -> tuple[PendingSnapshot, Tensor | None]:
        """One statistics pass and all-reduce. ``record=False`` (a clip on a step the schedule
        skips): no divergence measurement and no change to the collection count."""
        grads = self._local_grads()
        sq = self._engine.squared_norms(grads, self._reducer.device)
        scale = pending_scale(scaler, optimizer)
        if scale is not None:
            scale64 = scale.to(sq.device, torch.float64)
            sq = sq / (scale64 * scale64)
        has_grad = [g is not None for g in grads]
        every = self.config.divergence_every
        measure = (
            record and every > 0 and self._collections % every == 0 and self._layout.replicas > 1
        )
        self._collections += int(record)
        reduced = self._reducer.pack_and_reduce(sq, has_grad, step, with_replicas=measure)
        total = None
        if max_norm is not None:
            # Still-scaled gradients clip correctly too: coef is scale-free.
            total = self._clip(reduced, max_norm, grads)
        amp = scaler is not None and scaler.is_enabled()
        isolated = self._isolated  # the expectation at collect time, not at result() time
        timestamp = time.time()
        return (
            PendingSnapshot(
                step,
                lambda: self._build(
                    reduced, step, measure, timestamp, max_norm, amp, isolated
                ),
            ),
            total,
        )

    def _clip(
        self, reduced: ReducedVector, max_norm: float, grads: list[Tensor | None]
    ) -> Tensor:
        """Whole-model total norm from the reduced vector, then ``_foreach_mul_`` the gradients.

        ``grads``: this collect's local gradients (:meth:`_local_grads`: local shards, real
        views of complex gradients, which share their storage). Sparse gradients are scaled
        in place themselves (their values may be a coalesced copy). A replica that flagged
        NaN/Inf makes the total NaN, so every rank clips identically.
        """
        n = self._layout.size
        packed = reduced.device_tensor()
        squares = packed[:n]
        # sqrt(sum(s)) = sqrt(m) * sqrt(sum(s / m)): the sum of float64 squares of finite
        # gradients may overflow even when the norm does not (e.g. norms near 1e154).
        top = squares.max() if n else torch.zeros((), dtype=torch.float64, device=packed.device)
        scale = top.clamp_min(torch.finfo(torch.float64).tiny)
        scaled = (squares / scale).sum().sqrt() * scale.sqrt()
        total = torch.where(torch.isfinite(top), scaled, squares.sum().sqrt())
        total = torch.where(packed[n : 2 * n].sum() > 0, torch.nan, total)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        sparse = self._sparse_positions
        for i in sparse:
            g = self._params[i].grad
            g = getattr(g, "_local_tensor", g)
            g.mul_(coef.to(g.device, g.dtype))  # sparse: values scaled in place
        # The engine's plan already groups the tensors by (device, dtype).
        plan = self._engine.last_plan  # built for these very gradients in this collect
        assert plan is not None
        for bucket in plan.buckets:
            tensors = [grads[i] for i in bucket.positions]
            if sparse:
                skip = {id(grads[i]) for i in sparse}
                tensors = [t for t in tensors if id(t) not in skip]
            if tensors:
                torch._foreach_mul_(tensors, coef.to(bucket.device, bucket.dtype))
        return total

    def _build(
        self,
        reduced: ReducedVector,
        step: int,
        measured: bool,
        ts: float,
        max_norm: float | None,
        amp: bool,
        isolated: tuple[str, ...],
    ) -> Snapshot:
        try:
            values = reduced.host_values()
        except GradWatchTimeoutError as exc:
            # Another rank failed or skipped this collective: later ones would never match.
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
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
            isolated=isolated,
            world_size=lay.world_size,
            parallelism=self.parallelism,
            replica_divergence=self._last_divergence,
            timestamp=ts,
        )
        changes: dict[str, Any] = {}
        if max_norm is not None:
            # Same float64 formula as the device-side coefficient used for clipping.
            changes["clip_coef"] = min(1.0, max_norm / (snap.global_norm + 1e-6))
        if amp and not snap.is_finite:
            changes["amp_skipped"] = True
        if changes:
            snap = snap.replace(**changes)
        self._log_anomalies(snap)
        if self._last is None or snap.step >= self._last.step:
            self._last = snap
        return snap

    def _log_anomalies(self, snap: Snapshot) -> None:
        if snap.nonfinite_params and not snap.amp_skipped:
            names = list(snap.nonfinite_params)
            more = f" (+{len(names) - 20} more)" if len(names) > 20 else ""
            shown = ", ".join(names[:20]) + more
            self._anomaly_log.warning(
                "nonfinite",
                "gradwatch: step %d: non-finite gradients in %d parameter(s) (seen by rank %d "
                "of %d): %s",
                snap.step,
                len(names),
                self.rank,
                snap.world_size,
                shown,
            )
        for group, violated in snap.isolation_violated.items():
            if violated:
                self._anomaly_log.warning(
                    f"isolation:{group}",
                    "gradwatch: step %d: isolated group %r received gradient (norm %g > %g)",
                    snap.step,
                    group,
                    snap.groups[group].norm if group in snap.groups else math.nan,
                    self.config.isolation_threshold,
                )

    _clipped_step: int | None = None
    _latest: PendingSnapshot | None = None

    def _pending_last(self, step: int) -> PendingSnapshot:
        """What a skipped step returns: the last collected step's pending result."""
        if self._latest is not None:
            return self._latest
        return PendingSnapshot(step, snapshot=self._last or Snapshot(step=step))

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


class RateLimitedLog:
    """``logging`` warnings of each kind at most once per ``period_seconds`` (thread-safe)."""

    def __init__(self, period_seconds: float) -> None:
        self.period = period_seconds
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.period:
                return False
            self._last[kind] = now
        log.warning(msg, *args)
        return True


class _Restore:
    """Undo an instance attribute override (``attach`` wraps ``scaler.step``)."""

    def __init__(self, obj: Any, attr: str) -> None:
        self.obj, self.attr = obj, attr

    def remove(self) -> None:
        self.obj.__dict__.pop(self.attr, None)
