"""The package's public surface: the contract names, and lazy imports (no torch for the CLI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gradwatch


def test_contract_names_are_exported() -> None:
    for name in ("GradWatch", "WatchConfig", "total_norm", "watch", "Snapshot", "NoOpWatch"):
        assert name in gradwatch.__all__
        assert getattr(gradwatch, name) is not None
    from gradwatch import GradWatch, WatchConfig, total_norm  # the documented import line

    assert GradWatch.__module__ == "gradwatch.watcher"
    assert WatchConfig.__module__ == "gradwatch.config"
    assert callable(total_norm)


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = gradwatch.no_such_name  # type: ignore[attr-defined]


def test_cli_and_config_do_not_import_torch() -> None:
    """`gradwatch top/config/plot` start without loading torch (seconds saved per command)."""
    code = (
        "import sys, gradwatch, gradwatch.cli.main\n"
        "from gradwatch import WatchConfig\n"
        "WatchConfig(port=0)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_all_lists_exactly_the_lazy_exports() -> None:
    assert sorted(gradwatch.__all__) == sorted([*gradwatch._EXPORTS, "__version__"])
