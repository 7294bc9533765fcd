"""Configuration of a :class:`~gradwatch.GradWatch`: one pydantic-settings model.

Every field can be given in code or through a ``GRADWATCH_<FIELD>`` environment variable
(JSON for dicts and lists, e.g. ``GRADWATCH_GROUPS='{"host": ["backbone.*"]}'``).
Arguments given in code win over the environment, which wins over the defaults.

Invalid values are refused at construction with a :class:`pydantic.ValidationError` whose
location names the field, so a typo in a launcher script fails before the first step instead
of in the middle of a run.

This module also owns the environment as a source of settings, for every reader of it
(:mod:`gradwatch.configfile` layers a file under it and reports provenance): the one prefix
(:data:`ENV_PREFIX`, :func:`env_var`), the decoding (:func:`env_settings`), the detection of
misspelt variables (:func:`unknown_env_vars`) and the one "did you mean" hint
(:func:`did_you_mean`) of every configuration error.
"""

from __future__ import annotations

import datetime
import difflib
import fnmatch
import hashlib
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    FilePath,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

#: Prefix of every setting's environment variable: ``port`` is read from ``GRADWATCH_PORT``.
ENV_PREFIX = "GRADWATCH_"

#: Name of the implicit group of parameters that match no pattern.
OTHER_GROUP = "other"

#: Default port of the endpoint used by examples and the demo (`gradwatch demo`). Chosen
#: outside the well-known exporter range listed on the Prometheus wiki's port allocations page
#: at the time of writing; any port can be configured.
DEFAULT_DEMO_PORT = 9977

#: The largest integer setting: every count fits a C ``int64`` wherever it is used.
MAX_INT = 2**63 - 1
#: The longest ``collective_timeout_seconds`` (30 days): a ``timedelta`` and the backends'
#: millisecond timeouts hold it, so no later conversion can overflow.
MAX_TIMEOUT_SECONDS = 30 * 86400.0

#: The largest ``spike_window``: the detector sorts a window per series and step on the host.
MAX_SPIKE_WINDOW = 4096

#: A Prometheus label name.
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

GroupName = Annotated[StrictStr, Field(min_length=1)]
Threshold = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


# -- ratio bands ---------------------------------------------------------------------------------

#: Healthy band and dormant level of a normalized ratio when its entry gives none: the levels
#: of a host/seed pair (a small seed group learning at 5-20% of its host's per-element rate).
DEFAULT_RATIO_LOW = 0.05
DEFAULT_RATIO_HIGH = 0.2
DEFAULT_RATIO_DORMANT = 0.01

#: The longest ``run_id`` (a label value that long is already unwieldy in every UI).
MAX_RUN_ID_LENGTH = 128

BandLevel = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RatioSpec:
    """One entry of :attr:`WatchConfig.ratios`: a pair of groups and the ratio's band.

    Written as a pair ``["seed", "host"]`` (default band) or a mapping
    ``{"numerator": "attn", "denominator": "mlp", "low": 0.5, "high": 2, "dormant": 0.1}``
    (omitted levels take the defaults). ``low <= high`` and ``dormant <= low``, all finite and
    ``>= 0``; ``dormant`` 0 disables the dormant alert for this pair. Unpacks as
    ``numerator, denominator``, the pair of the old form.
    """

    numerator: GroupName
    denominator: GroupName
    low: BandLevel = DEFAULT_RATIO_LOW
    high: BandLevel = DEFAULT_RATIO_HIGH
    dormant: BandLevel = DEFAULT_RATIO_DORMANT

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            if len(value) != 2:
                raise ValueError(
                    "a ratio is a pair [numerator, denominator] or a mapping with numerator, "
                    "denominator and optional low, high, dormant"
                )
            return {"numerator": value[0], "denominator": value[1]}
        return value

    @model_validator(mode="after")
    def _check_band(self) -> RatioSpec:
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        if self.dormant > self.low:
            raise ValueError(f"dormant ({self.dormant}) is above low ({self.low})")
        return self

    @model_serializer(mode="plain")
    def _to_plain(self) -> list[str] | dict[str, Any]:
        """The pair when the band is the default (the form most configurations use)."""
        if (self.low, self.high, self.dormant) == (
            DEFAULT_RATIO_LOW,
            DEFAULT_RATIO_HIGH,
            DEFAULT_RATIO_DORMANT,
        ):
            return [self.numerator, self.denominator]
        return {
            "numerator": self.numerator,
            "denominator": self.denominator,
            "low": self.low,
            "high": self.high,
            "dormant": self.dormant,
        }

    @property
    def pair(self) -> tuple[str, str]:
        return (self.numerator, self.denominator)

    def __iter__(self) -> Iterator[str]:
        return iter(self.pair)


def new_run_id(start_time: float) -> str:
    """A fresh run identity: the UTC start time and 6 random hex digits, e.g.
    ``20261123T145151Z-3fa2c1`` (readable in a legend, unique across restarts)."""
    stamp = datetime.datetime.fromtimestamp(start_time, datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{secrets.token_hex(3)}"


def _pairs_if_duplicated(pairs: list[tuple[str, Any]]) -> Any:
    """``json.loads`` hook: an object with a repeated key stays a list of pairs (instead of
    silently keeping the last value), so the field validators can report the duplicate."""
    keys = [k for k, _ in pairs]
    return dict(pairs) if len(set(keys)) == len(keys) else list(pairs)


class _EnvSource(EnvSettingsSource):
    """``GRADWATCH_*`` variables; fields given in code are not read at all (pydantic-settings
    would otherwise deep-merge an env dict into a dict given in code). Public access goes
    through :func:`env_settings`."""

    def __init__(self, settings_cls: type[BaseSettings], shadowed: set[str]) -> None:
        super().__init__(settings_cls)
        self._shadowed = shadowed

    def decode_complex_value(self, field_name: str, field: Any, value: Any) -> Any:
        try:
            return json.loads(value, object_pairs_hook=_pairs_if_duplicated)
        except ValueError:
            return value  # not JSON: validation reports it as a ValidationError on the field

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__call__().items() if k not in self._shadowed}


class WatchConfig(BaseSettings):
    """What to watch and how.

    Attributes:
        groups: ordered mapping group name -> fnmatch globs on parameter names; the first group
            with a matching pattern wins. Parameters that match nothing form the group ``"other"``.
        ratios: pairs ``(numerator, denominator)`` of group names; each gives
            ``ratios["num/den"] = (n_norm/sqrt(n_numel)) / (d_norm/sqrt(d_numel) + 1e-8)``.
            An entry is a pair or a mapping that also carries the ratio's healthy band and
            dormant level (:class:`RatioSpec`); every entry unpacks as ``num, den``.
        isolated: groups expected to receive no gradient (``norm <= isolation_threshold``).
        vanishing_threshold: a parameter whose gradient L2 norm is below this is "vanishing".
        exploding_threshold: a parameter whose gradient L2 norm is above this is "exploding".
        isolation_threshold: an isolated group whose norm exceeds this violates isolation.
        every_n_steps: ``collect(step)`` does work only when ``step % every_n_steps == 0``.
        divergence_every: replica divergence is measured every this many collected steps (0: never).
        collective_timeout_seconds: how long one gradwatch collective may wait for the other
            ranks before it gives up with :class:`~gradwatch.errors.GradWatchTimeoutError`.
        always_reduce: all-reduce the statistics on every collect. By default a collect skips
            the all-reduce when DDP already made every rank's gradients the same (every
            parameter whole on every rank, reduced by DDP over the whole world) and the rank
            view is off; it still all-reduces on divergence steps, which also check that the
            ranks collected the same step (docs/distributed.md, *When gradwatch all-reduces*).
        port: ``None`` = no endpoint; ``0`` = an ephemeral port; otherwise that TCP port.
        bind_address: address the endpoint binds to (``0.0.0.0``, the exporter convention).
        certfile, keyfile, client_cafile: TLS for the endpoint (``client_cafile`` = mutual TLS).
        param_metrics_top_k: export ``gradwatch_param_grad_norm{param}`` for the k largest norms
            plus every non-finite parameter (capped, see docs/metrics.md).
        history_path: rank 0 appends one JSON line per snapshot to this file.
        history_max_bytes: the history file is rotated (one ``.1`` backup) past this size.
        enabled: ``False`` makes :func:`gradwatch.watch` return a no-op watcher and a
            directly constructed :class:`~gradwatch.GradWatch` inert.
        spike_window: spike detection compares each norm with the median and MAD of the last
            this many collected log-norms of the same series (:mod:`gradwatch.analysis.spikes`).
        spike_threshold: a norm this many robust deviations above its recent median is a
            spike; ``0`` disables spike detection.
        spike_warmup: samples a series' window needs before its spike score is defined.
        run_id: identity of this run, the ``run_id`` label of ``gradwatch_run_info``; ``None``
            (the default) generates one when the endpoint starts (:func:`new_run_id`).
        audit_tolerance: :meth:`~gradwatch.GradWatch.audit_norm` counts a reported norm as a
            disagreement when it differs from the exact one by more than this, relative.
        rank_view: under DDP, measure each rank's gradients before the all-reduce (a comm
            hook): non-finite origin ranks, replica spread, gradient noise scale. Off by
            default (its hook costs a DDP step more than the +2% it aims at, see
            docs/distributed.md); a no-op without DDP. Ranks must agree (checked by the
            handshake).
        update_stats: on collect steps, also measure what the optimizer did to the weights
            (:mod:`gradwatch.norms.updates`): per group and whole-model weight norm, the norm of
            the last optimizer step's update, their ratio and the fraction of elements whose
            intended update was rounded away (stalled), exact and in the same all-reduce.
            Read from the optimizer's state after its step (``torch.optim`` SGD, Adam, AdamW:
            for-loop, foreach and fused); no copy of the parameters. Ranks must agree
            (checked by the handshake).
        compile_kernels: fused kernels for CPU tensors (:mod:`gradwatch.norms.kernels`; the
            float64 norm of CPU float32 gradients above 8,192 elements, exact with no host
            read, :mod:`gradwatch.norms.fused`): ``"background"`` compiles them off the
            training thread (one CPU thread, seconds per layout), eager until ready;
            ``"wait"`` compiles on first use; ``"off"`` never. One-process jobs only (with
            more ranks the eager paths run). Per rank.
        rank_timing: name the slowest rank (``Snapshot.slowest_rank``, ``straggler_score``;
            :mod:`gradwatch.reduce.ranktiming`) from each rank's median working time, riding
            on the collects that all-reduce anyway (plain DDP: every ``divergence_every``),
            never a collective of its own. Off by default until its CUDA path is proven on a
            GPU (docs/operations.md, section 9). Ranks must agree.
        batch_size: samples (or tokens) per replica per step, the ``b`` of the gradient noise
            scale (``collect(step, batch_size=...)`` overrides it); None: the noise scale is
            in per-replica batches.
        expert_parameters: fnmatch patterns of the parameters that are *plain per-rank
            experts* (expert parallelism without DTensors): each is a whole tensor held only
            by the ranks of its expert-data-parallel group, under a name unique to its expert
            (e.g. ``"layers.*.experts.*"`` matching ``layers.0.experts.5.w1`` on the rank
            holding expert 5). Such a name may be absent from other ranks; one held by exactly
            the ranks of a non-expert parameter is refused (coinciding local names would read
            as replicas). DTensor experts need no declaration: their placements say where
            they live. Ranks must agree (checked by the handshake); see docs/distributed.md,
            *Expert parallelism*.
        sinks: tracker sinks rank 0 feeds with one row of scalars per published step
            (:mod:`gradwatch.export.sinks`): ``"tensorboard"`` (needs ``tensorboard_dir``),
            ``"wandb"`` (the active run, else a new one), ``"mlflow"`` (likewise).
        tensorboard_dir: the TensorBoard run directory of the ``"tensorboard"`` sink.
        sink_queue_size: steps waiting for one sink (the history file, a tracker, a sink
            added with ``add_sink``) in its own queue; past it the oldest waiting step is
            dropped and counted (``gradwatch_sink_dropped_steps_total``). No sink ever makes
            the endpoint or another sink wait.
        sink_timeout_seconds: a sink's write running longer is counted once in
            ``gradwatch_sink_errors_total`` and logged (a tracker server or file system that
            hangs).
        file_sd_path: rank 0 writes a Prometheus ``file_sd`` target for its endpoint here
            at start and removes it at close (:mod:`gradwatch.export.filesd`); an existing
            directory gets a file named after the Slurm job or the run. Needs ``port``.
        file_sd_labels: extra target labels of that entry (Slurm's are added when present).

    The optimizer-step guard (``watch.guard(optimizer)``, :mod:`gradwatch.step.guard`); ranks must
    agree (checked by the handshake):

    Attributes:
        skip_nonfinite: the guard skips a step whose gradients hold NaN or Inf anywhere in the
            whole model.
        skip_spike_score: the guard skips a step whose global spike score (the robust
            deviations of ``ln(global norm)`` above the median of its last ``spike_window``
            samples, computed on the device) exceeds this; ``None`` (the default): no spike
            skips.
        max_consecutive_skips: after this many consecutive skipped steps the guard stops
            skipping (it applies the next bad steps, ``gradwatch_guard_stopped`` is 1 and the
            alert fires) until a step it would not skip re-arms it.
        guard: the framework integrations (Hugging Face ``GradWatchCallback``, Lightning
            ``GradWatchCallback``) step the optimizer through ``watch.guard()``; in your own
            loop call ``watch.guard(optimizer)`` instead.
        guard_spike_statistic: ``"median_mad"`` (the score above) or ``"ema"``, the z-score of
            the adaptive clip's history (:mod:`gradwatch.step.adaptive`).
        on_max_consecutive_skips: at ``max_consecutive_skips``: ``"continue"`` (see above),
            ``"raise"`` (``GuardStopError``) or ``"exit"`` (code 75), on every rank.
        adaptive_clip_z, adaptive_clip_alpha, adaptive_clip_warmup: the threshold is the EMA
            (decay alpha) mean plus z EMA deviations, from ``warmup`` measured steps on.
        incident_path: rank 0 appends a JSON line per skipped or adaptively clipped step.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True)

    groups: dict[GroupName, list[StrictStr]] = Field(default_factory=dict)
    ratios: list[RatioSpec] = Field(default_factory=list)
    isolated: list[GroupName] = Field(default_factory=list)

    vanishing_threshold: Threshold = 1e-7
    exploding_threshold: Threshold = 100.0
    isolation_threshold: Threshold = 1e-6

    every_n_steps: int = Field(default=1, ge=1, le=MAX_INT)
    divergence_every: int = Field(default=100, ge=0, le=MAX_INT)
    collective_timeout_seconds: float = Field(
        default=300.0, gt=0.0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False
    )
    always_reduce: bool = False
    expert_parameters: list[Annotated[StrictStr, Field(min_length=1)]] = Field(
        default_factory=list
    )

    port: int | None = Field(default=None, ge=0, le=65535)
    bind_address: str = "0.0.0.0"
    certfile: FilePath | None = None
    keyfile: FilePath | None = None
    client_cafile: FilePath | None = None
    # Prometheus exporter-toolkit web config (tls_server_config, basic_auth_users); checked
    # when the endpoint starts (gradwatch.export.webconfig), exclusive with the TLS fields above.
    web_config_file: str | None = None
    param_metrics_top_k: int = Field(default=0, ge=0, le=MAX_INT)

    history_path: Path | None = None
    history_max_bytes: int = Field(default=64 * 1024 * 1024, ge=4096, le=MAX_INT)

    enabled: bool = True

    # -- spike detection (gradwatch.analysis.spikes) --
    spike_window: int = Field(default=128, ge=2, le=MAX_SPIKE_WINDOW)
    spike_threshold: float = Field(default=6.0, ge=0.0, allow_inf_nan=False)
    spike_warmup: int = Field(default=32, ge=1, le=MAX_SPIKE_WINDOW)

    # -- the optimizer-step guard (gradwatch.step.guard) --
    skip_nonfinite: bool = True
    skip_spike_score: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    max_consecutive_skips: int = Field(default=10, ge=1, le=MAX_INT)
    guard: bool = False
    guard_spike_statistic: Literal["median_mad", "ema"] = "median_mad"
    on_max_consecutive_skips: Literal["continue", "raise", "exit"] = "continue"

    adaptive_clip_z: float = Field(default=2.5, gt=0.0, allow_inf_nan=False)
    adaptive_clip_alpha: float = Field(default=0.97, gt=0.0, lt=1.0, allow_inf_nan=False)
    adaptive_clip_warmup: int = Field(default=25, ge=1, le=MAX_INT)
    incident_path: Path | None = None

    @field_validator("spike_warmup")
    @classmethod
    def _spike_warmup_fits_the_window(cls, value: int, info: ValidationInfo) -> int:
        # spike_window is absent from info.data when it was itself invalid
        return _spike_warmup_fits(value, info.data.get("spike_window"))

    # -- restarts and ratio bands: run identity (see also RatioSpec; checks: _checked_run_id) ---
    run_id: str | None = Field(default=None, min_length=1, max_length=MAX_RUN_ID_LENGTH)

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str | None) -> str | None:
        return value if value is None else _checked_run_id(value)

    # -- norm auditing (GradWatch.audit_norm, gradwatch.analysis.audit) --
    audit_tolerance: Threshold = 1e-3

    # -- the per-rank view (DDP comm hook; docs/distributed.md) --------------------------------
    rank_view: bool = False
    update_stats: bool = False
    compile_kernels: Literal["background", "wait", "off"] = "background"
    rank_timing: bool = False
    batch_size: int | None = Field(default=None, ge=1, le=MAX_INT)

    # -- tracker sinks (gradwatch.export.sinks) and discovery without Kubernetes (export.filesd)
    sinks: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    tensorboard_dir: Path | None = None
    sink_queue_size: int = Field(default=256, ge=1, le=1_000_000)
    sink_timeout_seconds: float = Field(
        default=30.0, gt=0.0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False
    )
    file_sd_path: Path | None = None
    file_sd_labels: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_sinks_and_discovery(self) -> WatchConfig:
        _validate_sinks_and_discovery(self)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        given = set(getattr(init_settings, "init_kwargs", {}))
        env = _EnvSource(settings_cls, given)
        return (init_settings, env, dotenv_settings, file_secret_settings)

    @field_validator("groups", mode="before")
    @classmethod
    def _groups_from_pairs(cls, value: Any) -> Any:
        return _groups_as_mapping(value)

    @field_validator("groups")
    @classmethod
    def _check_groups(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        _validate_groups(value)
        return value

    @field_validator("history_path", mode="before")
    @classmethod
    def _history_path_not_empty(cls, value: Any) -> Any:
        """An empty path would become the current directory (``Path("")`` is ``.``)."""
        if isinstance(value, str) and not value.strip():
            raise ValueError("history_path is empty; unset it (no history) or name a file")
        return value

    @field_validator("incident_path", mode="before")
    @classmethod
    def _incident_path_not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("incident_path is empty; unset it (no incident file) or name a file")
        return value

    @field_validator("bind_address")
    @classmethod
    def _check_bind_address(cls, value: str) -> str:
        _validate_bind_address(value)
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> WatchConfig:
        _validate_cross_fields(self)
        return self

    def layout_hash(self) -> str:
        """Digest of the fields every rank must agree on (checked in the construction handshake):
        :data:`LAYOUT_HASH_FIELDS`, serialized as JSON with sorted keys, SHA-256, 16 hex digits.
        """
        fields = set(LAYOUT_HASH_FIELDS)
        payload = json.dumps(self.model_dump(include=fields, mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


#: The fields every rank must agree on (:meth:`WatchConfig.layout_hash`). Endpoint and history
#: settings are rank-0 business and excluded; grouping, thresholds and the schedule change what
#: the collective carries or when it runs, so they are included.
LAYOUT_HASH_FIELDS = (
    "groups",
    "ratios",
    "isolated",
    "vanishing_threshold",
    "exploding_threshold",
    "isolation_threshold",
    "every_n_steps",
    "divergence_every",
    "always_reduce",  # which collects all-reduce
    "rank_view",  # the packed vector's rank-view section
    "update_stats",  # the packed vector's update section
    "rank_timing",  # the packed vector's timing section
    "expert_parameters",  # which names may be held by some ranks only
    # the optimizer-step guard: every rank must take the same skip decisions
    "skip_nonfinite",
    "skip_spike_score",
    "max_consecutive_skips",
    "guard",
    "spike_window",
    "spike_warmup",
    "guard_spike_statistic",
    "on_max_consecutive_skips",  # every rank stops alike
    # the adaptive clip threshold: every rank must clip by the same one
    "adaptive_clip_z",
    "adaptive_clip_alpha",
    "adaptive_clip_warmup",
)


# -- WatchConfig's checks: each raises ValueError, which pydantic reports on the field (or on the
# model, for the cross-field checks) -------------------------------------------------------------


def _spike_warmup_fits(warmup: int, window: int | None) -> int:
    if window is not None and warmup > window:
        raise ValueError(
            f"spike_warmup ({warmup}) must not exceed spike_window ({window}): the window "
            "never holds more samples"
        )
    return warmup


def _checked_run_id(value: str) -> str:
    """Any text is a valid label value (the exposition escapes quotes, backslashes and
    newlines); only an empty, blank-padded, overlong or non-UTF-8 id is refused."""
    if value.strip() != value or not value.strip():
        raise ValueError(f"run_id {value!r} is blank or has surrounding blanks")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"run_id {value!r} is not valid UTF-8 text") from exc
    return value


def _groups_as_mapping(value: Any) -> Any:
    """Accept a list of ``(name, patterns)`` pairs too, so duplicates can be reported."""
    if isinstance(value, list | tuple):
        seen: dict[Any, Any] = {}
        for item in value:
            if not isinstance(item, list | tuple) or len(item) != 2:
                raise ValueError("groups must be a mapping or a list of (name, patterns) pairs")
            name, patterns = item
            if name in seen:
                raise ValueError(f"duplicate group name {name!r}")
            seen[name] = patterns
        return seen
    return value


def _validate_groups(groups: dict[str, list[str]]) -> None:
    for name, patterns in groups.items():
        if name.strip() != name or not name.strip():
            raise ValueError(f"group name {name!r} is empty or has surrounding blanks")
        if name == OTHER_GROUP:
            raise ValueError(
                f"group name {OTHER_GROUP!r} is reserved for parameters that match no pattern"
            )
        if "/" in name:
            raise ValueError(f"group name {name!r} must not contain '/' (used in ratio keys)")
        if not patterns:
            raise ValueError(f"group {name!r} has no patterns")
        if any(not p for p in patterns):
            raise ValueError(f"group {name!r} has an empty pattern")


def _validate_bind_address(value: str) -> None:
    if value == "localhost":
        return
    try:
        ipaddress.ip_address(value)
    except ValueError as exc:
        raise ValueError(f"bind_address {value!r} is not an IP address") from exc


def _validate_sinks_and_discovery(config: WatchConfig) -> None:
    if len(set(config.sinks)) != len(config.sinks):
        raise ValueError(f"sinks has duplicates: {config.sinks}")
    if ("tensorboard" in config.sinks) != (config.tensorboard_dir is not None):
        raise ValueError(
            "sinks and tensorboard_dir go together: the 'tensorboard' sink writes to "
            "tensorboard_dir, which nothing else uses"
        )
    if config.file_sd_path is not None and config.port is None:
        raise ValueError("file_sd_path needs port: the target it writes is the endpoint")
    for name in config.file_sd_labels:
        if not _LABEL_NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(
                f"file_sd_labels: {name!r} is not a Prometheus label name "
                "([a-zA-Z_][a-zA-Z0-9_]*, not starting with '__')"
            )


def _validate_cross_fields(config: WatchConfig) -> None:
    known = set(config.groups) | {OTHER_GROUP}
    for i, (num, den) in enumerate(config.ratios):
        for name in (num, den):
            if name not in known:
                raise ValueError(
                    f"ratios[{i}] names unknown group {name!r}; known: {sorted(known)}"
                )
        if num == den:
            raise ValueError(f"ratios[{i}] divides group {num!r} by itself")
    if len({r.pair for r in config.ratios}) != len(config.ratios):
        raise ValueError("ratios has duplicate pairs")
    for name in config.isolated:
        if name not in known:
            raise ValueError(f"isolated names unknown group {name!r}; known: {sorted(known)}")
    if len(set(config.isolated)) != len(config.isolated):
        raise ValueError("isolated has duplicate group names")
    if len(set(config.expert_parameters)) != len(config.expert_parameters):
        raise ValueError("expert_parameters has duplicate patterns")
    if not config.vanishing_threshold < config.exploding_threshold:
        raise ValueError(
            "vanishing_threshold must be below exploding_threshold "
            f"({config.vanishing_threshold} >= {config.exploding_threshold})"
        )
    if (config.certfile is None) != (config.keyfile is None):
        raise ValueError("certfile and keyfile must be given together")
    if config.client_cafile is not None and config.certfile is None:
        raise ValueError("client_cafile (mutual TLS) needs certfile and keyfile")


def check_history_path(path: Path) -> None:
    """Raise ``ValueError`` naming ``history_path`` unless ``path`` can be a history file: not
    a directory, not an unwritable file, and its directory exists and is writable or can be
    created (the writer creates missing parents): the nearest existing ancestor is a writable
    directory.

    Checked where the file will be written (global rank 0, at construction), not by
    :class:`WatchConfig` validation, which runs on every rank and node."""
    where = f"history_path {str(path)!r} ({env_var('history_path')})"
    if path.is_dir():
        raise ValueError(f"{where} is a directory; name a file in it")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{where}: the file exists and is not writable")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{where}: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{where}: directory {str(ancestor)!r} is not writable")


def ratio_key(numerator: str, denominator: str) -> str:
    """Key of a ratio in :attr:`Snapshot.ratios`: ``"numerator/denominator"``."""
    return f"{numerator}/{denominator}"


def env_var(field: str) -> str:
    """The environment variable of a field: ``port`` -> ``GRADWATCH_PORT``."""
    return ENV_PREFIX + field.upper()


def env_settings(exclude: Collection[str] = ()) -> dict[str, Any]:
    """The settings ``GRADWATCH_*`` variables give, decoded as :class:`WatchConfig` reads them
    (JSON for dicts and lists; a value that is no JSON is kept as text for validation to
    report), leaving out the fields in ``exclude`` (those given in code win without a merge)."""
    return _EnvSource(WatchConfig, set(exclude))()


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """``GRADWATCH_*`` variables that are no setting (typos): pydantic-settings ignores them,
    so a caller that wants the typo reported must ask (``gradwatch config`` warns)."""
    environ = os.environ if environ is None else environ
    known = {env_var(f) for f in WatchConfig.model_fields}
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)


def did_you_mean(word: str, choices: Iterable[str], *, show: Callable[[str], str] = repr) -> str:
    """`` (did you mean 'port'?)`` for the choice closest to a misspelt ``word``, or ``""``
    when none is close; ``show`` renders the choice (``str`` for variable names)."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


# -- groups no parameter can join, known without a model (gradwatch config) --

_WILDCARDS = frozenset("*?[")


def shadowed_groups(groups: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Groups that no parameter name of any model can join, each with the earlier pattern that
    takes its names first (a parameter joins the first group with a matching pattern).

    Conservative: a pattern counts as shadowed only when provably so: it has no wildcard and an
    earlier pattern matches it, or an earlier pattern is a literal prefix followed by one
    trailing ``*`` (``"*"``, ``"backbone.*"``) that the pattern's own literal prefix extends.
    Groups matching no parameter of one particular model are reported by
    :class:`~gradwatch.GradWatch` when it is built (that needs the model).
    """
    out: dict[str, str] = {}
    earlier: list[tuple[str, str]] = []  # (group, pattern)
    for group, patterns in groups.items():
        patterns = list(patterns)
        takers = [_taker(p, earlier) for p in patterns]
        if patterns and all(t is not None for t in takers):
            out[group] = ", ".join(f"{p!r} by {t}" for p, t in zip(patterns, takers, strict=True))
        earlier.extend((group, p) for p in patterns)
    return out


def _taker(pattern: str, earlier: list[tuple[str, str]]) -> str | None:
    """``"group 'g' ('pat')"`` of the first earlier pattern taking every name ``pattern`` can
    match, else None."""
    literal = "".join(_literal_prefix(pattern))
    for group, e in earlier:
        if not _WILDCARDS & set(pattern):
            taken = fnmatch.fnmatchcase(pattern, e)
        else:
            taken = e.endswith("*") and not _WILDCARDS & set(e[:-1]) and literal.startswith(e[:-1])
        if taken:
            return f"group {group!r} ({e!r})"
    return None


def _literal_prefix(pattern: str) -> Iterable[str]:
    for ch in pattern:
        if ch in _WILDCARDS:
            return
        yield ch
