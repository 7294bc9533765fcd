"""Resolving a module, once, at construction: its parameters, their names and groups, and the
parallelism it is trained with.

* Names are those of the unwrapped model: the segments wrappers add (:data:`WRAPPER_SEGMENTS`)
  are removed, so ``DDP(compile(model))`` and ``model`` name their parameters alike, and two
  parameters that clean to one name are refused (:func:`named_parameters`).
* A parameter belongs to the first group (in configuration order) with a matching ``fnmatch``
  pattern, else to :data:`~gradwatch.config.OTHER_GROUP` (:func:`group_membership`).
* :func:`describe_parallelism` labels the parallelism (FSDP1 units: :mod:`gradwatch.stacks.fsdp1`).

Nothing here runs per collect.
"""

from __future__ import annotations

import fnmatch
import gc
import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.config import OTHER_GROUP
from gradwatch.errors import GradWatchError

log = logging.getLogger("gradwatch")

#: Name segments added by wrappers; stripped so names are those of the unwrapped model.
WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def clean_name(name: str) -> str:
    """``module._orig_mod.layer.0.weight`` -> ``layer.0.weight``."""
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def named_parameters(model: nn.Module) -> tuple[list[str], list[Tensor]]:
    """The parameters of ``model`` and their clean names, in ``named_parameters`` order.

    Raises :class:`GradWatchError` when two parameters clean to the same name (the names are
    the parameters' identities across ranks and in the metrics).
    """
    names: list[str] = []
    params: list[Tensor] = []
    for name, p in model.named_parameters():
        params.append(p)
        names.append(clean_name(name))
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise GradWatchError(f"gradwatch: duplicate parameter names after unwrapping: {dup}")
    return names, params


class ParameterSlots:
    """Where each resolved parameter lives (its module's ``_parameters`` dict and key), so a
    parameter replaced after construction is found at the next collect.

    Replacing a module's parameter (``to_empty()`` from ``meta`` on a plain module,
    ``load_state_dict(assign=True)``, ``module.weight = nn.Parameter(...)``) leaves gradwatch
    holding the old object, whose ``.grad`` never changes again. The check per collect is one
    dict lookup and one identity test per parameter, both in C (``map``), the same order of
    cost as reading the ``.grad`` attributes. ``swap_tensors``-style conversions keep the
    objects (their contents change), so they need no check. A plain tensor found in place of a
    DTensor parameter is FSDP2's unsharded registration between forward and reshard, not a
    replacement.
    """

    def __init__(self, model: nn.Module, params: Sequence[Tensor], names: Sequence[str]) -> None:
        where: dict[int, tuple[dict[str, Any], str]] = {}
        for module in model.modules():
            for key, p in module._parameters.items():
                if p is not None:
                    where.setdefault(id(p), (module._parameters, key))
        self._params = list(params)
        self._names = list(names)
        self._dicts = [where[id(p)][0] for p in params]
        self._keys = [where[id(p)][1] for p in params]

    def current(self) -> list[Tensor]:
        """The parameters the modules hold now (what a fallback must act on)."""
        return [p for p in map(dict.get, self._dicts, self._keys) if p is not None]

    def first_replaced(self) -> str | None:
        """The name of the first parameter no longer held by its module, or None."""
        # One C-level pass in the common case (nothing replaced), no list built
        if all(map(operator.is_, map(dict.get, self._dicts, self._keys), self._params)):
            return None
        current = list(map(dict.get, self._dicts, self._keys))
        for name, now, held in zip(self._names, current, self._params, strict=True):
            if now is held:
                continue
            if hasattr(held, "_local_tensor") and not hasattr(now, "_local_tensor") and (
                now is not None
            ):
                continue  # FSDP2 registers its unsharded parameter between forward and reshard
            return name
        return None


def group_of(name: str, groups: Mapping[str, Sequence[str]]) -> str:
    """The first group (in ``groups`` order) with a pattern matching ``name``, else
    :data:`~gradwatch.config.OTHER_GROUP`. Case-sensitive ``fnmatch``."""
    for group, patterns in groups.items():
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            return group
    return OTHER_GROUP


def group_membership(
    names: Sequence[str], groups: Mapping[str, Sequence[str]]
) -> tuple[list[str], list[str]]:
    """``(groups_of, group_order)``: the group of each name, and the groups every snapshot
    shows: the configured ones, then ``"other"`` when some name matched no pattern."""
    groups_of = [group_of(n, groups) for n in names]
    order = list(groups)
    if OTHER_GROUP in groups_of:
        order.append(OTHER_GROUP)
    return groups_of, order


def shown_groups(model: nn.Module, groups: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The groups a watcher's snapshots show for ``model`` (:func:`group_membership`'s
    order), without resolving it: what a watcher that measures nothing (disabled, refused)
    gives. The configured groups alone when the model's names cannot be read (a refused
    setup must not raise again here)."""
    try:
        return tuple(group_membership(named_parameters(model)[0], groups)[1])
    except (GradWatchError, RuntimeError, AttributeError, TypeError):  # duplicate names...
        return tuple(groups)


def empty_groups(groups_of: Sequence[str], groups: Mapping[str, Sequence[str]]) -> list[str]:
    """Configured groups that no parameter of the whole model joined: a typo in a pattern,
    which would otherwise read like a group that receives no gradient (dormant)."""
    joined = set(groups_of)
    return [g for g in groups if g not in joined]


def describe_parallelism(
    model: nn.Module,
    params: list[Tensor],
    world_size: int,
    stage_group: Any,
    process_group: Any = None,
) -> str:
    """Short description of the detected parallelism, for the snapshot and ``run_info``.

    Parts joined by ``+``, outermost first: ``pp{n}`` (``stage_group`` of n ranks), ``ddp{n}``
    (a ``DistributedDataParallel`` inside ``model``, or wrapping it: :func:`wrapping_ddp`),
    ``fsdp2x{n}`` (FSDP2 sharding over n ranks) or ``hsdp{r}x{s}``
    (FSDP2 with a replicate x shard mesh), then the other dims of the DTensor meshes by name
    (``tp2``; unnamed dims are ``mesh{n}``), then ``dp{n}`` when a ``process_group`` was given
    and no data-parallel wrapper was found. Examples: ``ddp4``, ``fsdp2x4``, ``fsdp2x2+tp2``,
    ``hsdp2x2``, ``pp2+ddp2``. ``replicated{n}`` when nothing was detected (plain replicas);
    ``single`` for one process. Description only: never raises.
    """
    if world_size <= 1:
        return "single"
    try:
        return _describe(model, params, world_size, stage_group, process_group)
    except (AttributeError, ImportError, TypeError, ValueError, KeyError, IndexError, RuntimeError):
        # description only, from torch internals laid out differently across versions:
        # never fail construction over it
        log.debug("gradwatch: could not describe the parallelism", exc_info=True)
        return f"unknown{world_size}"


def find_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` inside ``model``, else None."""
    for module in model.modules():
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return module
    return None


def wrapping_ddp(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """A live ``DistributedDataParallel`` whose module tree holds ``model``, else None.

    Frameworks hand their callbacks the unwrapped module while they train its DDP wrapper (the
    Hugging Face Trainer's ``model_wrapped``, Lightning's ``strategy.model``) and do not pass
    the wrapper, so it is looked for among the garbage collector's live objects: one scan, at
    construction, only when nothing inside ``model`` already tells the parallelism.
    """
    objects = gc.get_objects()
    # Classes first (a few hundred, against every live object): most processes hold no DDP at
    # all. issubclass(), not isinstance(): DDP is an ABC (Joinable), whose instance check
    # reads __class__, which some live objects (deprecated torch aliases) warn about.
    ddp_types = {
        t for t in set(map(type, objects)) if issubclass(t, nn.parallel.DistributedDataParallel)
    }
    if ddp_types:
        for obj in objects:
            if type(obj) in ddp_types and any(m is model for m in obj.module.modules()):
                return obj
    return None


def ddp_reduces_every_gradient(
    ddp: nn.parallel.DistributedDataParallel | None, params: Sequence[Tensor], world_size: int
) -> bool:
    """Does ``ddp`` all-reduce the gradient of every parameter in ``params`` over the whole
    world, so that after backward every rank holds the same gradients? False without DDP, when
    its process group is smaller than the world, when a communication hook is registered (a
    hook may skip the all-reduce: PostLocalSGD after its start step), or when one of ``params``
    is outside its module, ignored (``_ddp_params_and_buffers_to_ignore``, delayed all-reduce)
    or a DTensor. What lets a collect skip gradwatch's own all-reduce
    (:mod:`gradwatch.reduce.packing`).
    """
    if ddp is None or world_size < 2 or getattr(ddp, "_comm_hooks", None):
        return False
    try:
        if dist.get_world_size(ddp.process_group) != world_size:
            return False
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        # Frozen parameters count: DDP reduces none of them, and none gets a gradient.
        synced = {id(p) for n, p in ddp.module.named_parameters() if n not in ignored}
    except (AttributeError, TypeError, ValueError, RuntimeError):
        # a DDP this torch lays out differently: keep the collective
        log.debug("gradwatch: could not read the DDP module's parameters", exc_info=True)
        return False
    return all(id(p) in synced and not hasattr(p, "_local_tensor") for p in params)


def _describe(
    model: nn.Module, params: list[Tensor], world_size: int, stage_group: Any, process_group: Any
) -> str:
    parts: list[str] = []
    if stage_group is not None:
        parts.append(f"pp{dist.get_world_size(stage_group)}")
    ddp = find_ddp(model)
    fsdp_mesh, fsdp_part = _fsdp2(model)
    if ddp is None and fsdp_mesh is None:
        ddp = wrapping_ddp(model)
    if ddp is not None:
        parts.append(f"ddp{dist.get_world_size(ddp.process_group)}")
    if fsdp_part:
        parts.append(fsdp_part)
    data_parallel = ddp is not None or bool(fsdp_part)
    fsdp_names = set(fsdp_mesh.mesh_dim_names or ()) if fsdp_mesh is not None else set()
    fsdp_names |= _fsdp2_dim_names(model)  # e.g. the dp of experts sharded over (dp, ep)
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


def _fsdp2_dim_names(model: nn.Module) -> set[str]:
    """The mesh dim names of every FSDP2 parameter group (modules may shard over different
    meshes: torchtitan's experts over dp, the rest over the flattened dp x ep)."""
    from torch.distributed.fsdp import FSDPModule

    names: set[str] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                names.update(group.mesh_info.mesh.mesh_dim_names or ())
    return names


def _fsdp2(model: nn.Module) -> tuple[Any, str]:
    """``(mesh, label)`` of the first FSDP2 parameter group found (submodules before an empty
    root), or ``(None, "")``. Reads FSDP2's private state: there is no public accessor."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue  # e.g. a root whose parameters all belong to sharded children
        info = group.mesh_info
        mesh = info.mesh
        shard = getattr(info, "shard_mesh_dim", None)
        replicate = getattr(info, "replicate_mesh_dim", None)
        if shard is not None and replicate is not None:
            return mesh, f"hsdp{mesh.size(replicate)}x{mesh.size(shard)}"
        if shard is not None:
            return mesh, f"fsdp2x{mesh.size(shard)}"
        if replicate is not None:
            return mesh, f"ddp{mesh.size(replicate)}"
        return mesh, ""
    return None, ""
