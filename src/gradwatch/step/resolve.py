"""Construction of a watcher: resolve the model, its DDP module and the reducer, once.

Collective on every rank when a process group is initialized (the reducer's handshake, see
:mod:`gradwatch.reduce.handshake`). The result, :class:`Resolved`, is what the later stages
(:mod:`gradwatch.step.collector`, :mod:`gradwatch.analysis.summary`) read; nothing in it changes
after
construction.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.config import OTHER_GROUP, WatchConfig, check_history_path
from gradwatch.errors import GradWatchError, UnsupportedParallelismError
from gradwatch.norms.gradients import GradientReader
from gradwatch.norms.model import (
    ParameterSlots,
    ddp_reduces_every_gradient,
    describe_parallelism,
    empty_groups,
    find_ddp,
    group_membership,
    group_of,
    named_parameters,
    wrapping_ddp,
)
from gradwatch.norms.updates import UpdateMeter
from gradwatch.reduce.layout import Layout, piece_of
from gradwatch.reduce.packing import Reducer, gradient_device
from gradwatch.stacks.ddp_hook import GradWatchCommHook, LocalView, attach, detach
from gradwatch.stacks.fsdp1 import Fsdp1GradientReader, Fsdp1Model
from gradwatch.stacks.fsdp1 import resolve as resolve_fsdp1
from gradwatch.stacks.main_grad import reject_distributed_optimizer
from gradwatch.stacks.zero import ZeroGradients, find_engine
from gradwatch.step.ranktimer import RankTimer, cuda_clock

log = logging.getLogger("gradwatch")


def _version() -> str:
    from gradwatch.version import __version__

    return __version__


@dataclass
class Resolved:
    """One model, resolved: its parameters in local order, where each lives, the global layout
    the ranks agreed on, the groups, and the per-rank view's hook (None when off)."""

    params: list[Tensor]
    local_names: list[str]
    slots: ParameterSlots
    rank: int
    world_size: int
    gradients: GradientReader | ZeroGradients | Fsdp1GradientReader
    reducer: Reducer
    layout: Layout
    groups_of: list[str]
    group_order: list[str]
    parallelism: str
    view_groups: tuple[str, ...]
    comm_hook: GradWatchCommHook | None
    local_view: LocalView | None
    # A DeepSpeed engine's gradient source (gradwatch.stacks.zero): its gradients are read from its
    # partitions, not from .grad; None otherwise.
    zero: ZeroGradients | None = None
    fsdp1: Fsdp1Model | None = None  # FSDP1 units (gradwatch.stacks.fsdp1), None otherwise
    # update_stats (gradwatch.norms.updates): this rank's optimizer-update figures; None when off
    updates: UpdateMeter | None = None
    timer: RankTimer | None = None  # this rank's working time (WatchConfig.rank_timing)


def resolve(
    model: nn.Module, cfg: WatchConfig, *, process_group: Any = None, stage_group: Any = None
) -> Resolved:
    """Resolve ``model`` under ``cfg`` (see :class:`gradwatch.watcher.GradWatch` for the
    arguments); collective on every rank of an initialized process group."""
    # A DeepSpeed engine (gradwatch.stacks.zero): its gradients are read from its partitions
    zero = _zero_source(model)
    if zero is not None:
        model = zero.module
    # FSDP1 units (gradwatch.stacks.fsdp1): pieces are the original parameters' slices of the flat
    # shards, whatever the model's parameters are (flat ones or views)
    flat = resolve_fsdp1(model) if zero is None else None
    reject_distributed_optimizer(model)
    targets = zero.update_targets() if cfg.update_stats and zero is not None else None
    if cfg.update_stats and (flat is not None or (zero is not None and targets is None)):
        raise UnsupportedParallelismError(
            "gradwatch: update_stats=True reads the optimizer's state of the parameters it "
            "steps: FSDP1's flat parameters, DeepSpeed ZeRO stage 3 and DeepSpeed's fp16 "
            "optimizer are not supported (ZeRO stages 0-2 are)"
        )
    if flat is None:
        names, params = named_parameters(model)
    else:
        names, params = list(flat.held_names), list(flat.held_params)
    slots = ParameterSlots(model, params, names)
    on_meta = [n for n, p in zip(names, params, strict=True) if p.is_meta]
    if on_meta:
        log.warning(
            "gradwatch: parameter %r (and %d more) is on the meta device: if the model is "
            "materialized later (to_empty()), parameters it replaces are reported as "
            "replaced; construct GradWatch after to_empty() and initialization",
            on_meta[0],
            len(on_meta) - 1,
        )
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else int(os.environ.get("RANK", "0"))
    world_size = dist.get_world_size() if distributed else 1
    if rank == 0 and cfg.history_path is not None:
        try:
            check_history_path(cfg.history_path)
        except ValueError as exc:
            raise GradWatchError(f"gradwatch: {exc}") from None
    if not distributed and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.warning(
            "gradwatch: WORLD_SIZE=%s but no process group is initialized: statistics are "
            "this rank's only; call torch.distributed.init_process_group before GradWatch",
            os.environ["WORLD_SIZE"],
        )
    gradients: GradientReader | ZeroGradients | Fsdp1GradientReader = (
        zero if zero is not None else flat.reader if flat is not None else GradientReader(params)
    )
    # DeepSpeed and FSDP1 reduce the gradients themselves: no DDP to find
    ddp = _find_ddp(model, params, cfg, world_size) if zero is None and flat is None else None
    view_groups = (*cfg.groups, OTHER_GROUP)
    local_view, comm_hook = _attach_rank_view(ddp, params, names, cfg, view_groups)
    try:
        reducer = Reducer(
            zero.pieces() if zero is not None else list(flat.pieces) if flat is not None
            else [piece_of(n, p) for n, p in zip(names, params, strict=True)],
            version=_version(),
            config_hash=cfg.layout_hash(),
            timeout_seconds=cfg.collective_timeout_seconds,
            stage_group=stage_group,
            rank_view_groups=len(view_groups) if comm_hook is not None else 0,
            synced=not cfg.always_reduce and stage_group is None
            and (ddp_reduces_every_gradient(ddp, params, world_size)
                 or (flat is not None and flat.reduces_every_gradient(world_size))),
            device=gradient_device(params),
            experts=cfg.expert_parameters,
            update_groups=len(view_groups) if cfg.update_stats else 0,
            rank_timing=cfg.rank_timing and world_size > 1,
        )
    except BaseException:
        detach(comm_hook)
        raise
    layout = reducer.layout
    if comm_hook is not None and layout.rank_view_groups == 0:
        if rank == 0:
            log.warning(
                "gradwatch: the per-rank view is off: not every rank measures it (each rank "
                "needs a DDP module with gradwatch's comm hook and rank_view=True)"
            )
        detach(comm_hook)
        comm_hook = local_view = None
    if (rank == 0 and layout.rank_timing and layout.replicated_synced
            and cfg.divergence_every == 0 and layout.rank_view_groups == 0):
        log.warning(
            "gradwatch: rank_timing rides on the all-reduces gradwatch runs anyway; under this "
            "plain DDP setup that is the divergence step, and divergence_every=0 turns it off: "
            "which rank is slow stays unmeasured unless a guard makes every collect all-reduce"
        )
    groups_of, group_order = group_membership(layout.names, cfg.groups)
    if rank == 0:
        for group in empty_groups(groups_of, cfg.groups):
            log.warning(
                "gradwatch: group %r matches no parameter of the model (patterns %s); it "
                "will read 0 every step. Parameter names look like %r",
                group,
                list(cfg.groups[group]),
                layout.names[0] if layout.names else "",
            )
    updates = None
    if cfg.update_stats:
        position = {g: k for k, g in enumerate(view_groups)}
        weights, fragments = targets if targets is not None and targets[0] else (params, {})
        updates = UpdateMeter(
            weights, [position[group_of(n, cfg.groups)] for n in names], len(view_groups),
            layout.contributes, gradient_device(params) or torch.device("cpu"), fragments,
            cfg.compile_kernels, host_section=reducer.packs_on_host,
        )
    return Resolved(
        params=params,
        local_names=names if flat is None else list(flat.names),
        slots=slots,
        rank=rank,
        world_size=world_size,
        gradients=gradients,
        reducer=reducer,
        layout=layout,
        groups_of=groups_of,
        group_order=group_order,
        parallelism=zero.label if zero is not None else flat.parallelism(
            dist.get_world_size(stage_group) if stage_group is not None else None
        ) if flat is not None else describe_parallelism(
            model, params, world_size, stage_group, process_group
        ),
        view_groups=view_groups,
        comm_hook=comm_hook,
        local_view=local_view,
        zero=zero,
        fsdp1=flat,
        updates=updates,
        timer=RankTimer(params, model, cuda_clock(params)) if layout.rank_timing else None,
    )


def _zero_source(model: nn.Module) -> ZeroGradients | None:
    """The DeepSpeed engine's gradient source when ``model`` is one or is trained by one
    (only when the program imported DeepSpeed), else None."""
    engine = find_engine(model)
    if engine is None:
        return None
    return ZeroGradients(engine, None if model is engine else model)


def _find_ddp(
    model: nn.Module, params: list[Tensor], cfg: WatchConfig, world_size: int
) -> nn.parallel.DistributedDataParallel | None:
    """The DDP module training ``model`` (inside it, or wrapping it), when it matters: more
    than one rank, and the rank view or a collect without the all-reduce may use it."""
    if world_size < 2 or (cfg.always_reduce and not cfg.rank_view):
        return None
    ddp = find_ddp(model)
    if ddp is None and not any(hasattr(p, "_local_tensor") for p in params):
        ddp = wrapping_ddp(model)  # one scan of live objects; DTensor models take no DDP
    return ddp


def _attach_rank_view(
    ddp: nn.parallel.DistributedDataParallel | None,
    params: list[Tensor],
    names: list[str],
    cfg: WatchConfig,
    view_groups: tuple[str, ...],
) -> tuple[LocalView | None, GradWatchCommHook | None]:
    """Under DDP with ``rank_view``: measure this rank's gradients in DDP's comm hook."""
    if not cfg.rank_view or ddp is None:
        return None, None
    position = {g: k for k, g in enumerate(view_groups)}
    view = LocalView(
        params, [position[group_of(n, cfg.groups)] for n in names], len(view_groups)
    )
    hook = attach(ddp, view)
    return (view if hook is not None else None), hook
