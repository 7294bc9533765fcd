"""What a benchmark run found, as typed values: the measurements feed them, the report reads them.

The vocabulary lives here too (:class:`NormMethod`, :class:`StepMode`, :class:`Target`), because
results are keyed by it. Plain Python, no torch: the report renders from these values alone, and
the spawned distributed workers pickle theirs back to the parent.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class NormMethod(Enum):
    """The compared ways to get the total gradient norm of a model as a Python float."""

    GRADWATCH = "gradwatch collect()+result()"
    GET_TOTAL_NORM = "get_total_norm(...).item()"
    #: bf16 only: PyTorch's own float32-output norm, the fair baseline for gradwatch's bf16 path
    FOREACH_NORM_F32 = "_foreach_norm(dtype=f32)+stack+item"
    ITEM_LOOP = "per-parameter .item() loop"
    FLOAT64_COPIES = "float64 copies + _foreach_norm"
    LIGHTNING = "Lightning grad_norm(model) dict"
    #: the read limit (no norm): one read of every gradient byte, two ways; the faster counts
    READ_SUM = "sum over each tensor"
    READ_FOREACH_MAX = "_foreach_max over the tensors"

    @property
    def is_read_limit(self) -> bool:
        return self in (NormMethod.READ_SUM, NormMethod.READ_FOREACH_MAX)


class StepMode(Enum):
    """The kinds of training step timed against each other in the distributed benchmark."""

    PLAIN = "plain"
    COLLECT = "collect"
    COLLECT_RESULT = "collect+result"
    #: floor: one async all-reduce of a vector as long as gradwatch's packed one, nothing else
    #: (what a collect that all-reduces pays at least)
    FLOOR_ALL_REDUCE = "all-reduce"
    #: floor: one read of every gradient (``get_total_norm``, no host read), nothing else
    FLOOR_READ = "read"

    @property
    def is_floor(self) -> bool:
        return self in (StepMode.FLOOR_ALL_REDUCE, StepMode.FLOOR_READ)

    @property
    def watched(self) -> str:
        """How gradwatch runs in this step, as the targets and notes phrase it."""
        if self is StepMode.COLLECT:
            return "`collect` only"
        if self is StepMode.COLLECT_RESULT:
            return "`collect`+`result()` on the training thread"
        return "without gradwatch"


@dataclass(frozen=True)
class Target:
    """A stated bound on a measured value: ``<= 1.25x``, ``>= 10x``, ``<= +3%``."""

    limit: float
    unit: str  # "x" (a time ratio) or "%" (extra time)
    at_most: bool = True

    def met(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit

    def __str__(self) -> str:
        sign = "+" if self.unit == "%" else ""
        return f"{'<=' if self.at_most else '>='} {sign}{self.limit:g}{self.unit}"


@dataclass(frozen=True)
class TargetCheck:
    """One row of the targets table: a measured value against its target."""

    area: str
    subject: str
    target: Target
    value: float
    shown: str  # the measured value as the table prints it (with its spread when it has one)
    #: the figures of the same run that bear on a miss (shown when the target is not met)
    figures: str = ""
    #: the heading of its known cause in docs/benchmarks.md (report.CAUSES)
    cause: str = ""

    @property
    def met(self) -> bool:
        return self.target.met(self.value)


@dataclass(frozen=True)
class Timing:
    """Wall times in seconds of repeated calls, and their median and quartiles."""

    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        if not samples:
            raise ValueError("a timing needs at least one sample")
        return cls(tuple(samples))

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """(p25, p75); a single sample is both."""
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def p90(self) -> float:
        if len(self.samples) < 2:
            return self.samples[0]
        return statistics.quantiles(self.samples, n=10)[-1]

    def __len__(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class Counts:
    """What one untimed call dispatched: host reads, aten ops, and its largest allocation."""

    host_syncs: int
    ops: int
    largest_bytes: int


@dataclass(frozen=True)
class CollectiveCount:
    """c10d collectives of one step and their payload (largest tensor argument of each)."""

    collectives: int
    bytes: int


# -- single process ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodResult:
    """One compared method on one set of gradients."""

    method: NormMethod
    timing: Timing
    rel_error: float | None  # against a float64 reference; None for the read limit (no norm)
    counts: Counts | None = None


@dataclass(frozen=True)
class NormCaseResult:
    """Every compared method on the same gradients, timed in the same interleaved rounds."""

    label: str  # e.g. "1000 x, 10M float32"
    n_tensors: int
    total_elements: int
    dtype: str
    nbytes: int
    methods: tuple[MethodResult, ...]
    rounds: int

    def get(self, method: NormMethod) -> MethodResult:
        for m in self.methods:
            if m.method is method:
                return m
        raise KeyError(method)

    def median(self, method: NormMethod) -> float:
        return self.get(method).timing.median

    @property
    def read_limit(self) -> MethodResult:
        """The faster of the two ways to read every gradient byte once."""
        return min((m for m in self.methods if m.method.is_read_limit),
                   key=lambda m: m.timing.median)

    def speedup(self, slower: NormMethod, than: NormMethod = NormMethod.GRADWATCH) -> float:
        """How many times faster ``than`` ran than ``slower`` (median over median)."""
        return self.median(slower) / self.median(than)


@dataclass(frozen=True)
class MixedSizesResult:
    """gradwatch against its target baseline on 48 large + 200 small tensors, one dtype."""

    case: NormCaseResult
    sizes: str  # e.g. "48 x 1M + 200 small"
    baseline: NormMethod
    target: Target

    @property
    def ratio(self) -> float:
        return self.case.median(NormMethod.GRADWATCH) / self.case.median(self.baseline)


@dataclass(frozen=True)
class ClipVariant:
    """One way of clipping, timed against ``torch.nn.utils.clip_grad_norm_``."""

    name: str
    timing: Timing


@dataclass(frozen=True)
class ClipAccuracy:
    """Relative error of the returned total norm against a float64 reference."""

    n_tensors: int
    tensor_elements: int
    torch_error: float
    gradwatch_error: float


@dataclass(frozen=True)
class ClipResult:
    dtype: str
    torch_clip: Timing
    variants: tuple[ClipVariant, ...]
    accuracy: ClipAccuracy
    target: Target
    #: seconds from the first clip until the engine's compiled kernels were ready (waited for
    #: before the timed rounds; see benchmarks.measure.ready_kernels)
    compile_s: float = 0.0

    def extra_pct(self, variant: ClipVariant) -> float:
        return (variant.timing.median / self.torch_clip.median - 1) * 100


@dataclass(frozen=True)
class ScrapeLatencyResult:
    """Scrapes of a single-process endpoint: one that renders a new step, two cached."""

    n_params: int
    top_k: int
    collect: Timing
    render: Timing
    cached: Timing
    body_bytes: int

    @property
    def scrapes(self) -> int:
        return len(self.render) + len(self.cached)


@dataclass(frozen=True)
class SpikeCostResult:
    """Spike detection's host cost against the ``result()`` it runs in (one process)."""

    n_params: int
    groups: int
    window: int
    result: Timing  # collect(...).result() with spike detection on, result() only
    score: Timing  # SpikeDetector.score on the same snapshots, windows full
    target: Target

    @property
    def share_pct(self) -> float:
        return self.score.median / self.result.median * 100


# -- distributed ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Overhead:
    """Extra step time of a step mode over plain steps, in percent: the median and quartiles
    over blocks of ``(sum of its two steps) / (sum of the two plain steps) - 1``."""

    median_pct: float
    p25_pct: float
    p75_pct: float


@dataclass(frozen=True)
class DistributedCase:
    """Rank 0's measurements of one model under one wrapper (2 ranks)."""

    wrapper: str  # "ddp" or "fsdp2"
    model: str
    n_params: int
    n_tensors: int
    #: per-step seconds of each mode, in the order they ran (pairs within blocks matter)
    step_times: dict[StepMode, tuple[float, ...]]
    counts_plain: CollectiveCount
    counts_watched: CollectiveCount
    gradwatch_counts: CollectiveCount  # of one ordinary collect()+result() alone
    collect_call: Timing  # the collect() call on the training thread
    #: of one collect()+result() on a divergence step (every ``divergence_every``-th collect);
    #: None when the layout has no replicas (no such step)
    divergence_counts: CollectiveCount | None = None
    divergence_every: int = 0

    def timing(self, mode: StepMode) -> Timing:
        return Timing.of(self.step_times[mode])

    @property
    def steps(self) -> int:
        return sum(len(t) for t in self.step_times.values())

    def overhead(self, mode: StepMode) -> Overhead:
        plain, other = self.step_times[StepMode.PLAIN], self.step_times[mode]
        paired = Timing.of([
            (other[2 * k] + other[2 * k + 1]) / (plain[2 * k] + plain[2 * k + 1]) - 1
            for k in range(min(len(plain), len(other)) // 2)
        ])
        p25, p75 = paired.quartiles
        return Overhead(paired.median * 100, p25 * 100, p75 * 100)

    def extra_ms(self, mode: StepMode) -> float:
        """Median step time over the plain steps' median, in milliseconds."""
        return (self.timing(mode).median - self.timing(StepMode.PLAIN).median) * 1e3


class RankViewMode(Enum):
    """The kinds of DDP step the per-rank view's benchmark times against each other."""

    #: the default: under pure replication an ordinary collect makes no all-reduce (DDP's
    #: built-in one reduced the gradients)
    WATCHED = ("gradwatch without the per-rank view (default: no all-reduce under pure "
               "replication)")
    #: one all-reduce per collect, what the default's saving is measured against
    ALWAYS_REDUCE = "gradwatch without the view, `always_reduce=True` (one all-reduce per collect)"
    #: as ``ALWAYS_REDUCE``, the comm hook in place of DDP's built-in reduction: the same
    #: all-reduces as ``RANK_VIEW``, so the two differ by the view's own measurement alone
    HOOK_ONLY = "gradwatch's comm hook registered, measuring nothing (`always_reduce=True`)"
    RANK_VIEW = "gradwatch with `rank_view=True` (one all-reduce per collect)"
    #: prototype: the post-reduction statistics in the hook's completion callback
    IN_CALLBACK = "`rank_view=True`, post-reduction pass in the hook's callback (prototype)"


@dataclass(frozen=True)
class Fsdp1Result:
    """gradwatch under FSDP1 against FSDP1's own ``clip_grad_norm_`` on the same gradients
    (``benchmarks/fsdp1_bench.py``): rank 0's wall times of each call."""

    use_orig_params: bool
    layers: int  # FSDP1 units holding parameters
    n_params: int
    n_tensors: int
    fsdp: Timing  # FullyShardedDataParallel.clip_grad_norm_
    collect: Timing  # watch.collect(step).result()
    clip: Timing  # watch.clip_grad_norm_

    def ratio(self, mine: Timing) -> float:
        """Median of ``mine`` over the median of FSDP's own call."""
        return mine.median / self.fsdp.median


@dataclass(frozen=True)
class RankViewResult:
    """Rank 0's step times of every :class:`RankViewMode` (2 ranks, DDP, demo model), in
    palindromic blocks (each mode once, then in reverse order)."""

    model: str
    n_params: int
    blocks: int
    #: per-step seconds of each mode, in the order they ran (two per block)
    step_times: dict[RankViewMode, tuple[float, ...]]
    buckets: int  # DDP buckets of one backward
    hook_ops: int  # aten ops the rank view's measurement dispatched over those buckets
    #: the documented loop (``collect`` only, rank 0's exporter thread builds the results)
    #: instead of ``result()`` on the training thread
    collect_only: bool = False

    def timing(self, mode: RankViewMode) -> Timing:
        return Timing.of(self.step_times[mode])

    @property
    def loop(self) -> str:
        """Where ``result()`` ran, as the DDP overhead rows name it."""
        if self.collect_only:
            return "`collect` only"
        return "`collect`+`result()` on the training thread"

    def ratio(self, mode: RankViewMode, over: RankViewMode) -> PairedRatio:
        """``mode``'s extra step time over ``over``'s, in percent: median and quartiles over
        blocks of (sum of its two steps) / (sum of ``over``'s two) - 1, and a 95% bootstrap
        interval of that median (1,000 resamples of the blocks, seeded: the report is
        reproducible from the samples)."""
        return paired_ratio(self.step_times[mode], self.step_times[over])


def paired_ratio(b: Sequence[float], a: Sequence[float]) -> PairedRatio:
    """Steps ``b``'s extra time over steps ``a``'s, in percent, both timed two per palindromic
    block: median and quartiles over blocks of (sum of b's two) / (sum of a's two) - 1, and a
    95% bootstrap interval of that median (1,000 resamples of the blocks, seeded: the report
    is reproducible from the samples)."""
    ratios = [
        (b[2 * k] + b[2 * k + 1]) / (a[2 * k] + a[2 * k + 1]) - 1
        for k in range(min(len(a), len(b)) // 2)
    ]
    paired = Timing.of(ratios)
    p25, p75 = paired.quartiles
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(1000))
    return PairedRatio(paired.median * 100, p25 * 100, p75 * 100,
                       medians[25] * 100, medians[974] * 100)


@dataclass(frozen=True)
class PairedRatio(Overhead):
    """An :class:`Overhead`, with a 95% bootstrap interval of its median (percent): the
    interquartile range is the spread of single blocks, the interval the uncertainty of the
    median itself."""

    ci_low_pct: float = math.nan
    ci_high_pct: float = math.nan

    @property
    def beyond_noise(self) -> int:
        """-1: cheaper (the whole interval below 0), +1: dearer, 0: no difference shown."""
        if self.ci_high_pct < 0:
            return -1
        return 1 if self.ci_low_pct > 0 else 0


class GuardMode(Enum):
    """The kinds of DDP step the guard's benchmark times against each other."""

    WATCHED = "gradwatch `collect`, then the fused optimizer's step (unguarded)"
    COLLECTIVE = (
        "the unguarded step plus a bare gloo all-reduce of the packed vector's size, awaited "
        "(the guard's collective alone: the floor)"
    )
    GUARDED_NONFINITE = (
        "`watch.guard(optimizer).step()`, `skip_nonfinite` (the default): collect, decide, "
        "fused step with `found_inf`"
    )
    GUARDED = (
        "`watch.guard(optimizer).step()`, `skip_nonfinite` and `skip_spike_score=6` with "
        "`guard_spike_statistic=\"ema\"`: collect, decide, fused step with `found_inf`"
    )


@dataclass(frozen=True)
class GuardResult:
    """Rank 0's step times of every :class:`GuardMode` (2 ranks, DDP, demo model, fused
    AdamW), in palindromic blocks; per kind, the aten ops and the collectives of one warm
    optimizer step (collect, decision, fused step; the floor's all-reduce) and the host scalar
    reads of the guarded ones; the packed vector's length (float64 entries); the steps each
    guarded kind skipped (warm-up and timed blocks)."""

    model: str
    blocks: int
    step_times: dict[GuardMode, tuple[float, ...]]
    scalar_reads: int
    ops: dict[GuardMode, int]
    collectives: dict[GuardMode, int] = field(default_factory=dict)
    packed_length: int = 0
    skipped: dict[GuardMode, int] = field(default_factory=dict)  # steps the guard skipped
    #: the same steps' optimizer phase (collect, all-reduce, decision, fused step)
    optimizer_times: dict[GuardMode, tuple[float, ...]] = field(default_factory=dict)

    def optimizer_ms(self, mode: GuardMode) -> float:
        """The median optimizer phase of ``mode``'s timed steps, in ms (NaN: not recorded)."""
        times = self.optimizer_times.get(mode)
        return statistics.median(times) * 1e3 if times else math.nan

    def timing(self, mode: GuardMode) -> Timing:
        return Timing.of(self.step_times[mode])

    def ratio(self, mode: GuardMode = GuardMode.GUARDED,
              base: GuardMode = GuardMode.WATCHED) -> PairedRatio:
        """The ``mode`` step's extra time over the ``base`` one, by default the unguarded
        step (see :func:`paired_ratio`)."""
        return paired_ratio(self.step_times[mode], self.step_times[base])

    def extra_ops(self, mode: GuardMode) -> int:
        """The ``mode`` step's aten ops over the unguarded step's."""
        return self.ops[mode] - self.ops[GuardMode.WATCHED]


class UpdateStatsMode(Enum):
    """The kinds of DDP step the update-stats benchmark times against each other."""

    WATCHED = "gradwatch `collect`, then AdamW's step (without update stats)"
    UPDATES = "the same with `update_stats=True` (the update measured in the step's post-hook)"
    FLOOR = ("the step without update stats plus a bare post-hook: one compiled pass reading "
             "every parameter, `exp_avg` and `exp_avg_sq` once into one float64 scalar (the floor)")
    ARITHMETIC_FLOOR = ("the same hook, its pass also adding Adam's per-element quotient "
                        "`m / (sqrt(v) + eps)` to each weight (the arithmetic floor)")


@dataclass(frozen=True)
class UpdateStatsResult:
    """Rank 0's step times of the :class:`UpdateStatsMode` kinds (2 ranks, DDP, demo model,
    AdamW), in palindromic blocks; the host scalar reads update stats add to one warm step;
    the meter's persistent bytes and each kind's largest allocation of one warm step, against
    the parameters' bytes."""

    model: str
    blocks: int
    step_times: dict[UpdateStatsMode, tuple[float, ...]]
    scalar_reads: int
    parameter_bytes: int
    persistent_bytes: int
    largest_allocation: dict[UpdateStatsMode, int]
    #: seconds from the first step to the compiled kernels ready (rank 0), and their counts
    compile_seconds: float = float("nan")
    kernels_ready: int = 0
    kernels_failed: int = 0
    #: aten ops one warm step dispatches (profiler), per kind; scalar reads update stats add
    ops_per_step: dict[UpdateStatsMode, int] = field(default_factory=dict)
    profiled_scalar_reads: int = 0
    #: median CPU time of the training thread per step (ms), per kind
    thread_ms: dict[UpdateStatsMode, float] = field(default_factory=dict)

    def timing(self, mode: UpdateStatsMode) -> Timing:
        return Timing.of(self.step_times[mode])

    def ratio(self, mode: UpdateStatsMode = UpdateStatsMode.UPDATES) -> PairedRatio:
        """The step of ``mode`` (with update stats by default; a floor: that floor hook's)
        over the step without update stats (see :func:`paired_ratio`)."""
        return paired_ratio(self.step_times[mode], self.step_times[UpdateStatsMode.WATCHED])

    @property
    def persistent_pct(self) -> float:
        """The meter's persistent memory in percent of the parameters' bytes."""
        return 100.0 * self.persistent_bytes / self.parameter_bytes


@dataclass(frozen=True)
class DistributedFailure:
    """A wrapper whose run failed: reported, so the other sections are not lost."""

    wrapper: str
    error: str


@dataclass(frozen=True)
class ScrapersResult:
    """Step times of a 2-rank DDP job in windows with and without scrapers."""

    n_scrapers: int
    cycles: int
    seconds_with: float  # total length of the windows with scrapers
    without: Timing
    with_scrapers: Timing
    served: int
    refused: int  # 429s and failed requests
    latency: Timing | None  # of the served scrapes
    client_cpu_seconds: float
    target: Target | None  # None: shown for context, not judged
    n_slowloris: int = 0
    n_ordinary: int = 0
    slowloris_cut: int = 0  # slow connections the server closed
    client_nice: int = 0
    exporter_cpu_seconds: float = 0.0  # of the exporter process, in the windows with clients

    @property
    def clients(self) -> str:
        if not (self.n_slowloris or self.n_ordinary):
            return str(self.n_scrapers)
        return (f"{self.n_scrapers} `Prometheus/` loops + {self.n_slowloris} slowloris + "
                f"{self.n_ordinary} ordinary")

    @property
    def slowdown_pct(self) -> float:
        return (self.with_scrapers.median / self.without.median - 1) * 100


@dataclass(frozen=True)
class Failure:
    """A section that raised: its message stands in for its table."""

    error: str


# -- a whole run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScaleResult:
    """One simulated world of the scale section: the handshake's layout step."""

    case: str
    world: int
    n_params: int
    mesh: str
    distinct: int  # distinct descriptions (digest groups)
    seconds: float  # the layout step on one core
    peak_bytes: int  # its peak Python memory (tracemalloc)
    sent_bytes: int  # handshake bytes per rank
    received_bytes: int
    #: what an all-gather of every rank's full JSON description would receive per rank
    gather_all_received_bytes: int
    packed_bytes: int  # the per-step all-reduce vector
    replicas: int  # replica slots in it
    agreed: bool = False  # phase 0 alone (every rank agrees), else the records path
    #: the per-step vector with ``rank_timing``, and its timing section alone (per rank)
    timed_packed_bytes: int = 0
    timing_bytes: int = 0


@dataclass
class RunResults:
    """Everything one run measured, and how it ran (filled section by section)."""

    command: str
    rounds: tuple[int, int]
    norm_cases: list[NormCaseResult] = field(default_factory=list)
    mixed: list[MixedSizesResult] = field(default_factory=list)
    clipping: list[ClipResult] = field(default_factory=list)
    scrape_latency: list[ScrapeLatencyResult] = field(default_factory=list)
    spike_cost: SpikeCostResult | None = None  # None: not measured
    distributed: list[DistributedCase | DistributedFailure] | None = None  # None: skipped
    scrapers: list[ScrapersResult | Failure] | None = None  # None: skipped
    rank_view: RankViewResult | Failure | None = None  # None: skipped
    #: the same comparisons in the documented loop (``collect`` only; rank 0's exporter thread
    #: builds the results)
    rank_view_loop: RankViewResult | Failure | None = None  # None: skipped
    fsdp1: list[Fsdp1Result] | Failure | None = None  # None: skipped
    guard: GuardResult | Failure | None = None  # None: skipped
    updates: UpdateStatsResult | Failure | None = None  # None: skipped
    cuda_device: str | None = None  # None: no GPU
    cuda_cases: list[NormCaseResult] = field(default_factory=list)
    demo_model: str = ""  # the demo model's size, as the distributed section describes it
    section_seconds: dict[str, float] = field(default_factory=dict)
    total_seconds: float = 0.0
    load_start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    machine: str = ""
    scale: list[ScaleResult] = field(default_factory=list)
    #: benchmarks.zero_bench.ZeroNormResult, or its Failure; None: skipped
    zero: Any = None
    #: benchmarks.shapes.ShapeResult per shape (collect against torch's own norm)
    shapes: list[Any] = field(default_factory=list)
    #: benchmarks.shapes.CollectCallResult (host time per collect); None: not measured
    collect_call: Any = None
    #: benchmarks.divergence_bench.DivergenceResult; None: skipped
    divergence: Any = None
    #: benchmarks.ranktiming_bench.RankTimingResult, or its Failure; None: skipped
    rank_timing: Any = None
