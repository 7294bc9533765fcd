"""What the benchmarks measure: the workloads, the compared methods, the targets, the run plans.

Gradients are built synthetically (seeded, 1-D, contiguous) and handed to gradwatch through a
module holding one parameter per gradient, so every method reads the very same tensors. The
distributed models are the one ``make demo`` trains and a plain MLP. Nothing here times anything
(:mod:`benchmarks.measure` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.results import NormMethod, Target

# -- targets ----------------------------------------------------------------------------------

#: fp32, 48 x 1M + 200 small: collect()+result() <= 1.25x get_total_norm(...).item()
MIXED_FP32_TARGET = Target(1.25, "x")
#: bf16, same sizes: <= 1.2x PyTorch's float32-output _foreach_norm (plain get_total_norm rounds
#: its bf16 norms to bf16, which gradwatch's 1e-6 exactness rules out)
MIXED_BF16_TARGET = Target(1.2, "x")
#: at 200M elements: >= 3x faster than float64 copies of every gradient
FLOAT64_COPIES_TARGET = Target(3, "x", at_most=False)
#: watch.clip_grad_norm_ within +10% of torch.nn.utils.clip_grad_norm_
CLIP_TARGET = Target(10, "%")
#: a 2-rank DDP step with gradwatch collecting every step within +3% of the step without it
DDP_OVERHEAD_TARGET = Target(3, "%")
#: a 2-rank DDP step with the per-rank view (rank_view=True) within +2% of the step watched
#: without it
RANK_VIEW_TARGET = Target(2, "%")
#: the guarded DDP step (watch.guard, fused optimizer) within +2% of the unguarded one
GUARD_TARGET = Target(2, "%")
#: the DDP step with update_stats within +2% of the step without it; memory added (the
#: update meter's persistent buffers) at most 1% of the parameters' bytes
UPDATE_STATS_TARGET = Target(2, "%")
UPDATE_STATS_MEMORY_TARGET = Target(1, "%")
#: a 2-rank DDP step with 20 scrapers on the endpoint within +5% of the step without them
SCRAPERS_TARGET = Target(5, "%")
#: Spike detection's host cost in ``result()``, as a share of ``result()`` (10,000 parameters).
SPIKE_TARGET = Target(5, "%")
#: Groups of the spike-detection case (the figure docs/metrics.md counts series for).
SPIKE_GROUPS = 10
#: the float64-copies target applies from this many gradient elements
FLOAT64_COPIES_ELEMENTS = 200_000_000
#: host reads of one collect()+result() at most this many, whatever the number of parameters
#: (a per-parameter ``.item()`` loop makes one per parameter: on a GPU each waits for the device)
HOST_READS_TARGET = Target(2, " host reads")
#: the per-collect cases held to it: from this many tensors (a model's parameters)
HOST_READS_TENSORS = 1_000


# -- gradients --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NormCase:
    """``n_tensors`` gradients sharing ``total`` elements (see :func:`split_sizes`)."""

    n_tensors: int
    total: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        return f"{self.n_tensors} x, {self.total / 1e6:g}M {dtype_name(self.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def split_sizes(n_tensors: int, total: int) -> list[int]:
    """Half the tensors small (bias/norm-like, <= 1024 elements), the rest share the bulk."""
    n_small = n_tensors // 2
    small = max(1, min(1024, total // (8 * n_tensors)))
    n_large = n_tensors - n_small
    bulk = total - n_small * small
    base = bulk // n_large
    sizes = [small] * n_small + [base] * n_large
    sizes[-1] += bulk - base * n_large
    return sizes


def mixed_label(big: int) -> str:
    """How the report names :func:`mixed_sizes`."""
    return f"48 x {big / 1e6:g}M + 200 small"


def mixed_sizes(big: int) -> list[int]:
    """48 tensors of ``big`` elements and 200 small ones (16-4,096 elements): a transformer's
    weight matrices and its biases and norms."""
    g = torch.Generator().manual_seed(1)
    return [big] * 48 + [int(s) for s in torch.randint(16, 4097, (200,), generator=g)]


def make_grads(sizes: Sequence[int], dtype: torch.dtype, seed: int = 0,
               device: str = "cpu") -> list[Tensor]:
    # Magnitudes vary across tensors (1e-3 to 7e-3), as real gradients do.
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * (1e-3 * (1 + i % 7))).to(device, dtype)
            for i, s in enumerate(sizes)]


def gradient_bytes(grads: Sequence[Tensor]) -> int:
    return sum(g.numel() * g.element_size() for g in grads)


class GradHolder(nn.Module):
    """A module holding one parameter per gradient, with ``.grad`` set to it."""

    def __init__(self, grads: Sequence[Tensor]) -> None:
        super().__init__()
        self.ps = nn.ParameterList(
            nn.Parameter(torch.empty(g.shape, dtype=g.dtype, device=g.device)) for g in grads
        )
        for p, g in zip(self.ps, grads, strict=True):
            p.grad = g


def float64_reference(grads: Sequence[Tensor]) -> float:
    return math.sqrt(math.fsum(float(g.double().square().sum()) for g in grads))


# -- the compared methods ---------------------------------------------------------------------


def _lightning_grad_norm() -> Callable[[nn.Module, float], dict[str, Tensor]]:
    try:
        from lightning.pytorch.utilities import grad_norm

        return grad_norm  # type: ignore[no-any-return]
    except Exception:  # same code as Lightning 2.x, when Lightning is not installed
        def grad_norm(module: nn.Module, norm_type: float) -> dict[str, Tensor]:
            norms = {f"grad_{norm_type}_norm/{name}": p.grad.data.norm(norm_type)
                     for name, p in module.named_parameters() if p.grad is not None}
            norms[f"grad_{norm_type}_norm_total"] = torch.tensor(
                list(norms.values())).norm(norm_type)
            return norms

        return grad_norm


NormFn = Callable[[], "float | None"]


def norm_methods(grads: list[Tensor], collect_result: Callable[[], float],
                 model: nn.Module) -> dict[NormMethod, NormFn]:
    """Every way to get the total norm of ``grads`` as a Python float, in the report's order.

    ``collect_result`` is gradwatch's (``watch.collect(step).result().global_norm``); the
    read-limit methods return None (they read every byte and compute no norm).
    """
    grad_norm = _lightning_grad_norm()

    def get_total_norm() -> float:
        return torch.nn.utils.get_total_norm(grads).item()

    def item_loop() -> float:
        return math.sqrt(sum(g.norm().item() ** 2 for g in grads))

    def float64_copies() -> float:
        norms = torch._foreach_norm([g.double() for g in grads])
        return torch.stack(norms).square().sum().sqrt().item()

    def lightning() -> float:
        return grad_norm(model, 2.0)["grad_2.0_norm_total"].item()

    def foreach_norm_f32() -> float:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.stack(norms).square().sum().sqrt().item()

    def read_sum() -> None:
        for g in grads:
            g.sum()

    def read_foreach_max() -> None:
        torch._foreach_max(grads)

    out: dict[NormMethod, NormFn] = {
        NormMethod.GRADWATCH: collect_result,
        NormMethod.GET_TOTAL_NORM: get_total_norm,
        NormMethod.ITEM_LOOP: item_loop,
        NormMethod.FLOAT64_COPIES: float64_copies,
        NormMethod.LIGHTNING: lightning,
    }
    if grads[0].dtype != torch.float32:
        out[NormMethod.FOREACH_NORM_F32] = foreach_norm_f32
    out[NormMethod.READ_SUM] = read_sum
    out[NormMethod.READ_FOREACH_MAX] = read_foreach_max
    return out


def mixed_baseline(dtype: torch.dtype) -> tuple[NormMethod, Target]:
    """The method gradwatch is held to on the mixed sizes, and the bound."""
    if dtype == torch.float32:
        return NormMethod.GET_TOTAL_NORM, MIXED_FP32_TARGET
    return NormMethod.FOREACH_NORM_F32, MIXED_BF16_TARGET


# -- the endpoint -----------------------------------------------------------------------------

#: Sequential GETs are spaced this many times the endpoint's minimum interval apart, so none
#: ever waits for its rate bound and the latency measured is the scrape's own.
SCRAPE_SPACING = 1.2
#: the parameter top-k settings whose scrapes are timed
SCRAPE_TOP_K = (50, 200)


def scrape_rate() -> float:
    """The endpoint's bound on scrapes per second."""
    from gradwatch.export import MAX_SCRAPES_PER_SECOND

    return float(MAX_SCRAPES_PER_SECOND)


# -- distributed models -----------------------------------------------------------------------

#: The wrappers the distributed benchmark runs every model under.
WRAPPERS = ("ddp", "fsdp2")


@dataclass(frozen=True)
class ModelSpec:
    """A model of the distributed benchmark: the demo's (``kind="demo"``) or an MLP."""

    kind: str
    label: str
    width: int = 16
    depth: int = 0
    #: steps per wrapper when they differ from the plan's (short steps need more of them)
    steps: dict[str, int] = field(default_factory=dict)

    def steps_for(self, wrapper: str, default: int) -> int:
        return self.steps.get(wrapper, default)


def demo_net() -> nn.Module:
    """The model ``make demo`` trains (gradwatch.cli.demo_job.DemoNet), in its last phase
    ("blend": every trainable parameter gets a gradient)."""
    from gradwatch.cli.demo_job import DemoNet

    net = DemoNet()
    net.phase = "blend"
    return net


def describe_demo_model() -> str:
    from gradwatch.cli.demo_job import DEMO_BATCH

    params = [p for p in demo_net().parameters() if p.requires_grad]
    return (f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters in "
            f"{len(params)} tensors, batch {DEMO_BATCH}")


def build_model(spec: ModelSpec) -> tuple[nn.Module, int, int]:
    """(model, input width, batch) for a model spec."""
    if spec.kind == "demo":
        from gradwatch.cli.demo_job import DEMO_BATCH

        return demo_net(), 16, DEMO_BATCH
    layers: list[nn.Module] = []
    for _ in range(spec.depth):
        layers += [nn.Linear(spec.width, spec.width), nn.ReLU()]
    layers.append(nn.Linear(spec.width, 1))
    return nn.Sequential(*layers), spec.width, 32


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    if wrapper == "ddp":  # as the demo wraps it (its phases leave parameters unused)
        return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules())[1:]:
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            fully_shard(module)
    fully_shard(model)
    return model


# -- run plans --------------------------------------------------------------------------------

#: What a full run may take on a quiet 2-core machine, every section included (the header of
#: docs/performance.md gives each section's time; docs/benchmarks.md, *Machine*, the budget).
WALL_TIME_BUDGET_S = 15 * 60


@dataclass(frozen=True)
class ScrapersPlan:
    """The clients of the scrapers-during-training section: ``n_scrapers`` looping GETs with
    a ``Prometheus/`` User-Agent, ``n_slowloris`` connections sending their request head a
    byte at a time, ``n_ordinary`` concurrent clients looping GETs; all on the loopback."""

    n_scrapers: int
    seconds_per_window: float
    cycles: int  # windows with scrapers (as many without)
    n_slowloris: int = 0
    n_ordinary: int = 0
    #: Nice value of the clients' process. On a dedicated machine the clients are elsewhere; here
    #: they share the job's two cores, and at 19 they stand in for remote machines (their own
    #: CPU is then not charged to the job); at 0 they compete with the job as equals.
    client_nice: int = 19
    judged: bool = True  # False: a row for context, not held to the target


@dataclass(frozen=True)
class Plan:
    """The sizes of one run: the full one for docs/performance.md, or the quick self-test."""

    norm_cases: tuple[NormCase, ...]
    rounds: tuple[int, int]  # (min, max) interleaved rounds of the per-collect cases
    budget_s: float  # time after which a case stops adding rounds past the minimum
    mixed_rounds: tuple[int, int]
    mixed_big: int  # elements of each of the 48 large tensors
    scrape_params: int
    scrape_rounds: int
    models: tuple[ModelSpec, ...]
    dist_steps: dict[str, int]
    scrapers: tuple[ScrapersPlan, ...]
    spike_rounds: int = 30  # result() calls timed by the spike-detection case
    scale_worlds: tuple[int, ...] = (8, 64, 1024, 16384)  # simulated ranks (benchmarks/scale.py)
    rank_view_blocks: int = 300  # palindromic blocks of the per-rank view section
    fsdp1_rounds: int = 60  # interleaved calls of each kind in the FSDP1 section
    fsdp1_width: int = 512  # of its Linear layers
    zero_rounds: int = 30  # alternating rounds of the DeepSpeed ZeRO-2 norm comparison
    guard_blocks: int = 900  # palindromic blocks of the guard section (a median to ~1%)
    update_blocks: int = 900  # palindromic blocks of the update-stats section
    rank_timing_blocks: int = 300  # palindromic blocks of the rank-timing section
    shapes: tuple[Any, ...] = ()  # benchmarks.shapes.Shape: the shapes section's shapes
    #: benchmarks.shapes.Shape: the 1,000-parameter model of the host time per collect
    collect_call: Any = None


def _shapes(quick: bool) -> tuple[Any, ...]:
    from benchmarks.shapes import FULL_SHAPES, QUICK_SHAPES

    return QUICK_SHAPES if quick else FULL_SHAPES


def _collect_call_shape(quick: bool) -> Any:
    from benchmarks.shapes import COLLECT_CALL_SHAPE, QUICK_COLLECT_CALL_SHAPE

    return QUICK_COLLECT_CALL_SHAPE if quick else COLLECT_CALL_SHAPE


def full_plan() -> Plan:
    f32, bf16 = torch.float32, torch.bfloat16
    return Plan(
        norm_cases=tuple(NormCase(n, total, dt) for dt in (f32, bf16)
                         for n, total in ((10, 1_000_000), (1_000, 1_000_000),
                                          (1_000, 10_000_000), (10_000, 10_000_000),
                                          (100, 200_000_000), (1_000, 200_000_000))),
        rounds=(5, 15), budget_s=3.0, mixed_rounds=(25, 81), mixed_big=1_000_000,
        scrape_params=10_000, scrape_rounds=15,
        # The demo model's steps take milliseconds: many more of them, for a tighter median.
        models=(ModelSpec("demo", "demo model", steps={"ddp": 1200, "fsdp2": 240}),
                ModelSpec("mlp", "MLP 4 x 1024", width=1024, depth=4)),
        dist_steps={"ddp": 300, "fsdp2": 120},
        shapes=_shapes(quick=False),
        collect_call=_collect_call_shape(quick=False),
        scrapers=(ScrapersPlan(20, 2.0, 5, n_slowloris=150, n_ordinary=200),
                  ScrapersPlan(20, 2.0, 5, n_slowloris=150, n_ordinary=200, client_nice=0,
                               judged=False)),
    )


def quick_plan() -> Plan:
    """Tiny sizes: the harness runs end to end in seconds; its figures mean nothing."""
    f32, bf16 = torch.float32, torch.bfloat16
    return Plan(
        norm_cases=(NormCase(10, 20_000, f32), NormCase(40, 100_000, bf16),
                    NormCase(1000, 200_000, f32)),
        rounds=(2, 3), budget_s=0.2, mixed_rounds=(2, 3), mixed_big=70_000,
        scrape_params=200, scrape_rounds=2,
        models=(ModelSpec("demo", "demo"),),
        dist_steps={"ddp": 8, "fsdp2": 8},
        scrapers=(ScrapersPlan(4, 0.3, 1, n_slowloris=4, n_ordinary=4),),
        spike_rounds=3,
        scale_worlds=(8,),
        shapes=_shapes(quick=True),
        collect_call=_collect_call_shape(quick=True),
        rank_view_blocks=2,
        fsdp1_rounds=2,
        fsdp1_width=16,
        zero_rounds=2,
        guard_blocks=2,
        update_blocks=2,
        rank_timing_blocks=2,
    )
