"""DeepSpeed ZeRO stages 0-3: the reduced, averaged gradients the optimizer will use, read where
DeepSpeed keeps them, one local piece per original parameter.

After ``engine.backward(loss)`` on a gradient-accumulation boundary and before
``engine.step()``, ``param.grad`` is ``None`` under ZeRO 1-3: the reduced gradients live in the
optimizer's partitions. :class:`ZeroGradients` reads, per original parameter, the slice this
rank holds, without gathering anything:

* **stage 0** (no ZeRO optimizer): ``param.grad`` after the engine's all-reduce (averaged over
  the data-parallel ranks), identical on every rank: one ``"whole"`` piece per parameter,
  counted once (rank 0 contributes). With bf16/fp16 the engine wraps the optimizer in its
  ``FP16_Optimizer``: the same ``param.grad`` (low precision), unscaled by its loss scale.
* **stages 1 and 2** (``DeepSpeedZeroOptimizer``): each trainable parameter linked to this
  rank's flat fp32 partition carries DeepSpeed's slice mapping ``param._hp_mapping``
  (``lp_fragment_address``: offset and length of the slice in the flattened parameter, the
  mapping universal checkpointing uses); the gradient of that slice is
  ``_hp_mapping.get_lp_grad_fragment(param._index_in_param_group)``, a view of the optimizer's
  ``averaged_gradients`` (which ``step()`` flattens, casts to fp32, unscales and clips).
* **stage 3** (``DeepSpeedZeroOptimizer_Stage3``): each parameter's gradient partition is a
  view of the optimizer's flat gradient buffer (its private ``__param_id_to_grad_partition``,
  what ``deepspeed.utils.safe_get_local_grad`` reads, without that function's fp32 copy); the
  partition holds ``partition_numel()`` elements from offset ``rank x partition_numel()``, of
  which those past ``ds_numel`` are padding and never count.

Every piece is keyed by its offset in the flattened parameter (``("zero", offset)``) with its
explicit local numel, so the handshake checks that the slices tile each parameter exactly
once and elects each slice's only holder as its contributor: the one all-reduce of a collect
sums disjoint squares. The loss scale of DeepSpeed's fp16 optimizers is divided out (squares
by ``scale**2``), so figures are of unscaled gradients, like ``get_global_grad_norm()``.

Refused at construction (:class:`~gradwatch.errors.UnsupportedParallelismError`, naming the
case and the fix): ZeRO-Offload / ZeRO-Infinity (``offload_optimizer`` / ``offload_param`` to
cpu or nvme), an engine whose optimizer is not the one its stage uses (e.g. ``BF16_Optimizer``,
which stage 1 picks for bf16 parameters with fp32 gradient accumulation), pipeline engines,
mixture-of-experts layers and a data-parallel group smaller than the world (model or sequence
parallelism). Off a gradient-accumulation boundary the engine has no reduced gradients:
:meth:`ZeroGradients.off_boundary` says so and the watcher returns a "not measured" result.

Importing this module never imports DeepSpeed: an engine is recognized only when the user's
program already imported it (:func:`find_engine`).
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradwatch.errors import GradWatchError, UnsupportedParallelismError
from gradwatch.norms.gradients import LocalGradients
from gradwatch.norms.model import named_parameters
from gradwatch.reduce.layout import LocalPiece

#: The name-mangled attribute of DeepSpeed's stage-3 optimizer mapping ``param.ds_id`` to its
#: gradient partition (a view of the flat gradient buffer).
STAGE3_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


def _engine_class() -> type | None:
    """DeepSpeed's engine class when the program imported DeepSpeed, else None (never imports
    it: importing gradwatch must not import DeepSpeed)."""
    if "deepspeed" not in sys.modules:
        return None
    module = sys.modules.get("deepspeed.runtime.engine")
    return getattr(module, "DeepSpeedEngine", None)


def is_engine(obj: Any) -> bool:
    """Is ``obj`` a ``deepspeed.DeepSpeedEngine``?"""
    cls = _engine_class()
    return cls is not None and isinstance(obj, cls)


def find_engine(model: Any) -> Any:
    """The DeepSpeed engine ``model`` is, or the live one training it, else None.

    Frameworks (the Hugging Face Trainer through accelerate, Lightning) hand callbacks the
    unwrapped module; the engine wrapping it is then looked for among the garbage collector's
    live objects (one scan, at construction, only when DeepSpeed is imported).
    """
    cls = _engine_class()
    if cls is None:
        return None
    if isinstance(model, cls):
        return model
    if not isinstance(model, nn.Module):
        return None
    objects = gc.get_objects()
    # Classes first, by issubclass (an isinstance check on every live object reads __class__,
    # which some live objects, deprecated torch aliases, warn about).
    types = {t for t in set(map(type, objects)) if issubclass(t, cls)}
    if not types:
        return None
    for obj in objects:
        if type(obj) not in types:
            continue
        inner = getattr(obj, "module", None)
        if isinstance(inner, nn.Module) and any(m is model for m in inner.modules()):
            return obj
    return None


def _refuse(why: str) -> UnsupportedParallelismError:
    return UnsupportedParallelismError(f"gradwatch: DeepSpeed {why}")


class ZeroGradients:
    """This rank's slices of the reduced gradients of a DeepSpeed engine, per original
    parameter (see the module docs). Built once; :meth:`read` per collect.

    Args:
        engine: the ``DeepSpeedEngine`` (after ``deepspeed.initialize``).
        model: the module whose parameter names are reported (default ``engine.module``);
            frameworks pass the unwrapped module they hand to callbacks.
    """

    def __init__(self, engine: Any, model: nn.Module | None = None) -> None:
        self.engine = engine
        self.module: nn.Module = model if model is not None else engine.module
        self.stage = int(engine.zero_optimization_stage())
        _check_engine(engine, self.stage)
        optimizer = engine.optimizer
        self.optimizer = optimizer
        self.kind = _optimizer_kind(optimizer, self.stage)
        group = _dp_group(engine, optimizer, self.kind)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.dp_size = dist.get_world_size(group) if dist.is_initialized() else 1
        if self.dp_size != world:
            raise _refuse(
                f"data-parallel group of {self.dp_size} ranks in a world of {world}: model, "
                "sequence or expert parallelism under DeepSpeed is not supported; gradwatch "
                "measures ZeRO over the whole world"
            )
        self.dp_rank = dist.get_rank(group) if dist.is_initialized() else 0
        # The watcher's names and order (gradwatch.norms.model): state_dict-style, wrappers removed.
        self.names, self.params = named_parameters(self.module)
        self._pieces, self._slices = self._describe()
        self._skipped_seen: int | None = None  # the engine's skip count at the last collect

    # -- construction -------------------------------------------------------------------------

    def _describe(self) -> tuple[list[LocalPiece], list[Any]]:
        """One piece per parameter, and how :meth:`read` finds its gradient slice."""
        pieces: list[LocalPiece] = []
        slices: list[Any] = []
        for name, p in zip(self.names, self.params, strict=True):
            if self.kind == "stage3":
                shape = tuple(p.ds_shape)
                size = int(p.partition_numel())
                start = self.dp_rank * size
                real = max(0, min(size, int(p.ds_numel) - start))
                pieces.append(LocalPiece(name, shape, ("zero", start if real else -1), real))
                slices.append((p.ds_id, real) if real and p.requires_grad else None)
            elif self.kind == "stage12":
                mapping = getattr(p, "_hp_mapping", None)
                shape = tuple(p.shape)
                if mapping is None or not p.requires_grad:
                    pieces.append(LocalPiece(name, shape, ("zero", -1), 0))
                    slices.append(None)
                    continue
                address = mapping.lp_fragment_address
                pieces.append(LocalPiece(name, shape, ("zero", int(address.start)),
                                         int(address.numel)))
                # The parameter, not its mapping: DeepSpeed relinks mappings (checkpoint loads).
                slices.append((p, int(address.start), int(address.numel)))
            else:
                pieces.append(LocalPiece(name, tuple(p.shape), ("whole",), p.numel()))
                slices.append(p)
        return pieces, slices

    def pieces(self) -> list[LocalPiece]:
        """The local pieces for the construction handshake, in :attr:`names` order."""
        return list(self._pieces)

    @property
    def label(self) -> str:
        """The parallelism label: ``zero{stage}x{ranks}``."""
        return f"zero{self.stage}x{self.dp_size}"

    # -- per collect --------------------------------------------------------------------------

    def off_boundary(self) -> str | None:
        """Why there is nothing to measure now (None: the reduced gradients are there).
        Identical on every rank (the accumulation schedule is the engine's configuration)."""
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            return (
                "collect() was called off a gradient-accumulation boundary (DeepSpeed reduces "
                f"gradients every {engine.gradient_accumulation_steps()} micro-steps); call it "
                "after engine.backward(loss) when engine.is_gradient_accumulation_boundary() "
                "and before engine.step()"
            )
        return None

    def update_targets(self) -> tuple[list[Tensor], dict[int, list[tuple[int, int, int]]]] | None:
        """What ``update_stats`` reads under ZeRO stages 1-3: per local piece, the fp32 master
        weights it holds (a view of the flat partition; an empty tensor for a piece without
        elements here), and per flat partition (by ``id``) the ``(piece position, start,
        numel)`` of each fragment the inner optimizer steps. Stage 0 with a torch optimizer
        steps the parameters themselves: ``([], {})`` (the plain path). None where the
        update cannot be read (DeepSpeed's fp16 optimizer at stage 0)."""
        if self.kind == "torch":
            return [], {}
        if self.kind == "stage3":
            return self._stage3_targets()
        if self.kind != "stage12":
            return None
        partitions = self.optimizer.single_partition_of_fp32_groups
        weights: list[Tensor] = []
        links: dict[int, list[tuple[int, int, int]]] = {}
        for position, where in enumerate(self._slices):
            mapping = None if where is None else getattr(where[0], "_hp_mapping", None)
            if mapping is None:
                weights.append(torch.zeros(0))
                continue
            flat = partitions[mapping.param_group_index]
            address = mapping.get_hp_fragment_address()
            start, numel = int(address.start), int(address.numel)
            weights.append(flat.detach().narrow(0, start, numel))
            links.setdefault(id(flat), []).append((position, start, numel))
        return weights, links

    def _stage3_targets(self) -> tuple[list[Tensor], dict[int, list[tuple[int, int, int]]]]:
        """Stage 3: each sub-group's fp32 flat partition is its parameters' partitions in
        order (``partition_numel`` each); a piece is the first ``real`` elements of its own."""
        where: dict[int, tuple[int, int]] = {}
        for i, group in enumerate(self.optimizer.fp16_groups):
            offset = 0
            for q in group:
                where[id(q)] = (i, offset)
                offset += int(q.partition_numel())
        partitions = self.optimizer.fp32_partitioned_groups_flat
        weights: list[Tensor] = []
        links: dict[int, list[tuple[int, int, int]]] = {}
        for position, (param, slot) in enumerate(zip(self.params, self._slices, strict=True)):
            found = where.get(id(param))
            if slot is None or found is None:
                weights.append(torch.zeros(0))
                continue
            i, start = found
            flat, numel = partitions[i], int(slot[1])
            weights.append(flat.detach().narrow(0, start, numel))
            links.setdefault(id(flat), []).append((position, start, numel))
        return weights, links

    def skips_since_last(self) -> int | None:
        """The optimizer steps the engine skipped on an overflow since the previous call (its
        ``skipped_steps``, a host integer DeepSpeed keeps); None on the first call and when
        this version keeps no count. Called once per collect."""
        count = getattr(self.engine, "skipped_steps", None)
        if not isinstance(count, int):
            return None
        previous, self._skipped_seen = self._skipped_seen, count
        return None if previous is None else count - previous

    def loss_scale(self) -> float | None:
        """The loss scale the gradients still carry (DeepSpeed's fp16 optimizers), else None."""
        if self.kind == "torch":
            return None
        scale = getattr(self.optimizer, "loss_scale", None)
        if scale is None:
            return None
        scale = float(scale)
        return None if scale == 1.0 else scale

    def read(self) -> LocalGradients:
        """This rank's gradient slice of every parameter (None: no slice here, or frozen).
        A Python loop of attribute reads and views; no copy, no collective."""
        if self.kind == "stage3":
            return LocalGradients(self._read_stage3())
        if self.kind == "stage12":
            return LocalGradients(self._read_stage12())
        return LocalGradients([p.grad if p.requires_grad else None for p in self._slices])

    def _read_stage12(self) -> list[Tensor | None]:
        out: list[Tensor | None] = []
        for where in self._slices:
            if where is None:
                out.append(None)
                continue
            param, start, numel = where
            try:
                grad = param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group)
            except (ValueError, KeyError) as exc:  # "only available ... before engine step"
                raise GradWatchError(
                    "gradwatch: DeepSpeed holds no reduced gradients now (" + str(exc) + "); "
                    "collect between engine.backward(loss) on an accumulation boundary and "
                    "engine.step()"
                ) from None
            if grad.numel() != numel:
                if grad.numel() < start + numel:
                    raise GradWatchError(
                        f"gradwatch: DeepSpeed's gradient slice has {grad.numel()} elements "
                        f"where its mapping says {numel}; this DeepSpeed version lays out "
                        "gradients differently"
                    )
                grad = grad.reshape(-1).narrow(0, start, numel)
            out.append(grad)
        return out

    def _read_stage3(self) -> list[Tensor | None]:
        parts = getattr(self.optimizer, STAGE3_GRAD_PARTITIONS, None)
        if parts is None:
            raise GradWatchError(
                "gradwatch: DeepSpeed's stage-3 optimizer has no gradient partitions "
                f"({STAGE3_GRAD_PARTITIONS}); this DeepSpeed version lays them out differently"
            )
        return [
            None if where is None else parts[where[0]].narrow(0, 0, where[1])
            for where in self._slices
        ]

    def clip_refusal(self) -> str | None:
        """Why :meth:`GradWatch.clip_grad_norm_` must not clip this engine (None: it may)."""
        clip = float(self.engine.gradient_clipping() or 0.0)
        if clip > 0:
            return (
                f"DeepSpeed clips the gradients itself (gradient_clipping={clip}): clipping "
                "them again here would clip twice. Keep DeepSpeed's clipping, collect() before "
                "engine.step() and audit it with watch.audit_norm(engine.get_global_grad_norm(), "
                "step=...) after the step; or set gradient_clipping to 0 to clip with gradwatch "
                "(watch.clip_grad_norm_(max_norm) or watch.clip_grad_norm_(\"auto\"))"
            )
        return None


def _check_engine(engine: Any, stage: int) -> None:
    """Refuse what gradwatch cannot measure exactly, naming the case and the fix."""
    for what, config in (("offload_optimizer", engine.zero_offload_optimizer()),
                         ("offload_param", engine.zero_offload_param())):
        device = getattr(config, "device", None)
        device = str(getattr(device, "value", device) or "none")  # an enum or its value
        if device != "none":
            raise _refuse(
                f"ZeRO-{'Infinity' if device == 'nvme' else 'Offload'} ({what} to {device}) is "
                "not supported: the reduced gradients then live in host or NVMe buffers that "
                f"gradwatch does not read; remove zero_optimization.{what} to watch this job"
            )
    if getattr(engine, "pipeline_parallelism", False) or type(engine).__name__ == "PipelineEngine":
        raise _refuse("pipeline engines are not supported: watch each stage's module with "
                      "GradWatch(module, stage_group=...) instead")
    if getattr(engine, "has_moe_layers", False):
        raise _refuse("mixture-of-experts layers (expert data-parallel groups) are not "
                      "supported under DeepSpeed")
    if engine.optimizer is None:
        raise _refuse("engine without an optimizer (deepspeed.initialize(optimizer=None) and no "
                      "optimizer in the config) has no gradients to measure")
    if stage not in (0, 1, 2, 3):
        raise _refuse(f"ZeRO stage {stage} is not supported")


def _optimizer_kind(optimizer: Any, stage: int) -> str:
    """``"torch"`` (stage 0, fp32), ``"fp16"`` (stage 0, DeepSpeed's FP16_Optimizer),
    ``"stage12"`` or ``"stage3"``; anything else is refused."""
    name = type(optimizer).__name__
    if stage == 0:
        if name in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
            return "fp16"
        from torch.optim import Optimizer

        if isinstance(optimizer, Optimizer):
            return "torch"
    elif stage in (1, 2) and name == "DeepSpeedZeroOptimizer":
        if getattr(optimizer, "cpu_offload", False):
            raise _refuse("ZeRO-Offload (offload_optimizer) is not supported")
        return "stage12"
    elif stage == 3 and name == "DeepSpeedZeroOptimizer_Stage3":
        return "stage3"
    hint = ""
    if name == "BF16_Optimizer":
        hint = (" (stage 1 picks it for bf16 parameters with fp32 gradient accumulation: set "
                "data_types.grad_accum_dtype to bf16, or use stage 2)")
    raise _refuse(
        f"ZeRO stage {stage} with optimizer {name} is not supported: gradwatch reads the "
        f"gradients of DeepSpeed's ZeRO optimizers (stage 0: the engine's all-reduced .grad){hint}"
    )


def _dp_group(engine: Any, optimizer: Any, kind: str) -> Any:
    """The data-parallel group the gradients are reduced over."""
    if kind in ("stage12", "stage3"):
        return optimizer.dp_process_group
    return getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group

