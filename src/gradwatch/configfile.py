"""Configuration files and provenance: ``WatchConfig`` from a file, the environment and code.

A file is optional and flat: the keys are :class:`~gradwatch.config.WatchConfig` field names,
in TOML (``.toml``, read with the standard library's :mod:`tomllib`), YAML (``.yaml``/``.yml``,
needs ``pyyaml``: ``pip install 'torch-gradwatch[cli]'``) or JSON (``.json``).

Precedence, lowest first: **defaults < file < GRADWATCH_* environment < arguments in code**.
The file is the checked-in baseline; a launcher's environment (torchrun, a Kubernetes
manifest) overrides it per run without editing it; and what the training script passes
explicitly wins, as it does without a file (``WatchConfig(port=0)`` beats ``GRADWATCH_PORT``).

:func:`resolve_config` also says where each value came from, which ``gradwatch config`` prints.
Every problem is a :class:`ConfigError` naming the field, the key or the file: an unknown key in
a file is an error (a typo must not silently fall back to a default), like an unknown keyword
argument of ``WatchConfig``.

The environment side (the ``GRADWATCH_`` prefix, decoding, typo detection, the "did you mean"
hint) belongs to :mod:`gradwatch.config`; this module adds the file and the provenance.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gradwatch.config import (
    ENV_PREFIX,
    WatchConfig,
    did_you_mean,
    env_settings,
    env_var,
    unknown_env_vars,
)
from gradwatch.errors import GradWatchError

# ENV_PREFIX, env_var and unknown_env_vars are defined in gradwatch.config and stay importable
# from here, where they were first published.
__all__ = [
    "ENV_PREFIX",
    "ConfigError",
    "ResolvedConfig",
    "env_var",
    "load_config",
    "read_config_file",
    "resolve_config",
    "unknown_env_vars",
]

#: File suffix -> format.
FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}


class ConfigError(GradWatchError, ValueError):
    """An invalid configuration: a bad value (naming the field and where it came from), an
    unknown key in a file, or a file that cannot be read or parsed."""


@dataclass(frozen=True)
class ResolvedConfig:
    """The effective configuration and, per field, where its value came from.

    Attributes:
        config: the validated :class:`WatchConfig`.
        sources: field name -> ``"default"``, ``"env GRADWATCH_<FIELD>"``, ``"file <path>"`` or
            ``"code"``; every field is present, in declaration order.
    """

    config: WatchConfig
    sources: Mapping[str, str]


def _fields() -> list[str]:
    return list(WatchConfig.model_fields)


def _unknown_key_message(key: str, where: str) -> str:
    hint = did_you_mean(key, _fields())
    return f"{where}: unknown key {key!r}{hint}; known keys: {', '.join(_fields())}"


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings of a TOML, YAML or JSON file, checked against the field names.

    Raises :class:`ConfigError` when the file is missing or unreadable, malformed, not a mapping
    at the top level, has an unknown suffix or an unknown key. Values are not validated here
    (see :func:`resolve_config`). An empty YAML file is an empty mapping.
    """
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(
            f"config file {path}: unknown format {path.suffix or '(no suffix)'!r}; "
            "use .toml, .yaml, .yml or .json"
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from exc
    data: Any
    try:
        if fmt == "toml":
            text = raw.decode("utf-8")
            toml = _toml_module(path)
            try:
                data = toml.loads(text)
            except toml.TOMLDecodeError as exc:
                key = _toml_duplicate(str(exc), text)
                if key is None:
                    raise
                raise ConfigError(f"config file {path}: duplicate key {key}") from exc
        elif fmt == "yaml":
            try:
                import yaml
            except ImportError as exc:
                raise ConfigError(
                    f"config file {path}: YAML needs pyyaml: pip install 'torch-gradwatch[cli]'"
                ) from exc
            data = yaml.load(raw, Loader=_unique_keys_loader(yaml, path))  # a SafeLoader
            if data is None:
                data = {}
        else:
            data = json.loads(raw, object_pairs_hook=lambda pairs: _unique_json(pairs, path))
    except ConfigError:
        raise
    except Exception as exc:  # tomllib/yaml/json errors, UnicodeDecodeError
        detail = str(exc).strip().splitlines()
        raise ConfigError(
            f"config file {path}: malformed {fmt.upper()}: {' '.join(detail) or type(exc).__name__}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path}: the top level must be a mapping of settings, "
            f"not {type(data).__name__}"
        )
    known = set(_fields())
    for key in data:
        if key not in known:
            raise ConfigError(_unknown_key_message(str(key), f"config file {path}"))
    return dict(data)


def _unique_json(pairs: list[tuple[str, Any]], path: Path) -> dict[str, Any]:
    """``json.loads`` hook: a repeated key is an error naming it (JSON keeps the last value)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"config file {path}: duplicate key {key!r}")
        out[key] = value
    return out


def _unique_keys_loader(yaml: Any, path: Path) -> Any:
    """A ``yaml.SafeLoader`` that refuses a repeated mapping key, naming it and its line (YAML
    loaders silently keep the last value)."""

    class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc, name-defined]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                except TypeError:  # unhashable: the base loader reports it
                    break
                if repeated:
                    raise ConfigError(
                        f"config file {path}: duplicate key {key!r} "
                        f"(line {key_node.start_mark.line + 1})"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _toml_duplicate(message: str, text: str) -> str | None:
    """The key a TOML "Cannot overwrite/declare" error is about (tomllib names only the line),
    as ``'key' (line n)``; None for other errors."""
    match = re.search(r"Cannot (?:overwrite|declare|mutate)\b.*\(at line (\d+)", message)
    if match is None:
        return None
    line_no = int(match.group(1))
    lines = text.splitlines()
    line = lines[line_no - 1].strip() if 0 < line_no <= len(lines) else ""
    key = line.strip("[]").strip() if line.startswith("[") else line.split("=", 1)[0].strip()
    return f"{key!r} (line {line_no})"


def _toml_module(path: Path) -> Any:
    """tomllib (Python 3.11+), or the tomli backport it came from on Python 3.10."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # pragma: no cover - Python 3.10
        import tomli
    except ImportError as exc:  # pragma: no cover
        raise ConfigError(
            f"config file {path}: TOML needs Python 3.11+ or the tomli package (pip install tomli)"
        ) from exc
    return tomli  # pragma: no cover


def resolve_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ResolvedConfig:
    """The effective configuration of ``path`` (optional), ``GRADWATCH_*`` and ``overrides``.

    Precedence: defaults < file < environment < ``overrides`` (see the module docstring).
    Raises :class:`ConfigError`; a bad value's message names the field and its source, e.g.
    ``port: Input should be a valid integer ... (from env GRADWATCH_PORT='abc')``.
    """
    file_values = read_config_file(path) if path is not None else {}
    unknown = [k for k in overrides if k not in WatchConfig.model_fields]
    if unknown:
        raise ConfigError(_unknown_key_message(unknown[0], "arguments"))
    env_values = env_settings(exclude=overrides)
    merged = {**file_values, **env_values, **overrides}
    sources: dict[str, str] = {}
    for name in _fields():
        if name in overrides:
            sources[name] = "code"
        elif name in env_values:
            sources[name] = f"env {env_var(name)}"
        elif name in file_values:
            sources[name] = f"file {path}"
        else:
            sources[name] = "default"
    try:
        config = WatchConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, sources)) from None
    return ResolvedConfig(config=config, sources=sources)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> WatchConfig:
    """:func:`resolve_config` without the provenance: ``load_config("gradwatch.toml", port=0)``."""
    return resolve_config(path, **overrides).config


def _explain(exc: ValidationError, sources: Mapping[str, str]) -> str:
    """One line per validation error, naming the field, its source and the offending input."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = err.get("loc") or ()
        msg = str(err.get("msg", "invalid value"))
        if loc and isinstance(loc[0], str) and loc[0] in sources:
            field = loc[0]
            where = ".".join(str(p) for p in loc)
            source = sources[field]
            shown = _shown_input(source, field, err.get("input"))
            lines.append(f"invalid value for {where}: {msg} (from {source}{shown})")
        else:  # a check across fields: its message names them
            lines.append(f"invalid configuration: {msg.removeprefix('Value error, ')}")
    return "\n".join(lines)


def _shown_input(source: str, field: str, value: Any) -> str:
    if source.startswith("env "):
        raw = os.environ.get(env_var(field))
        if raw is None:  # set in another case: GRADWATCH_ variables are case-insensitive
            raw = next((v for k, v in os.environ.items() if k.upper() == env_var(field)), None)
        return f"={raw!r}" if raw is not None else ""
    if source == "default":
        return ""
    text = repr(value)
    return f", value {text if len(text) <= 80 else text[:77] + '...'}"
