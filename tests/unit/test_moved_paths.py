"""The module paths of the flat layout keep working for one release: ``import gradwatch.stats``
gives the module now at ``gradwatch.norms.stats`` (the same object, so a patch through the old
name patches the code that runs) with a ``DeprecationWarning`` naming the new path, and
``gradwatch.sinks`` (public API, now kept in ``gradwatch.export.sinks``) without one."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from unittest import mock

import pytest

import gradwatch
from gradwatch._moved import MOVED, MovedPathFinder, new_path

#: The old paths the README, the docs and the examples have shown.
DOCUMENTED = (
    "gradwatch.stats",
    "gradwatch.ddp_hook",
    "gradwatch.history",
    "gradwatch.testing",
    "gradwatch.timing",
    "gradwatch.guard",
    "gradwatch.clip",
    "gradwatch.summary",
    "gradwatch.spikes",
    "gradwatch.rows",
    "gradwatch.audit",
    "gradwatch.rankview",
    "gradwatch.collective",
)


def _import_fresh(name: str) -> object:
    """``name`` imported as if for the first time in this process (the alias only)."""
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_module_at_its_new_path(old: str) -> None:
    new = MOVED[old]
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}") as caught:
        module = _import_fresh(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # the real module untouched
    assert caught[0].filename == __file__  # the warning points at the importing line


def test_the_documented_old_paths_are_kept() -> None:
    assert not [p for p in DOCUMENTED if p not in MOVED]


def test_names_through_an_old_path_are_the_public_objects() -> None:
    sys.modules.pop("gradwatch.ddp_hook", None)
    sys.modules.pop("gradwatch.stats", None)
    with pytest.warns(DeprecationWarning):
        from gradwatch.ddp_hook import ddp_comm_hook
        from gradwatch.stats import total_norm
    assert ddp_comm_hook is gradwatch.ddp_comm_hook
    assert total_norm is gradwatch.total_norm


def test_a_patch_through_an_old_path_patches_the_module_that_runs() -> None:
    from gradwatch.analysis import spikes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mock.patch("gradwatch.spikes.SHIFT_SCORE", 123.0):
            assert spikes.SHIFT_SCORE == 123.0
    assert spikes.SHIFT_SCORE != 123.0


def test_sinks_is_public_and_not_deprecated() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        public = _import_fresh("gradwatch.sinks")
        scalars = _import_fresh("gradwatch.sinks.scalars")
        from gradwatch.sinks import StepScalars, sinks_from_config
    assert public is importlib.import_module("gradwatch.export.sinks")
    assert scalars is importlib.import_module("gradwatch.export.sinks.scalars")
    assert StepScalars is scalars.StepScalars
    assert callable(sinks_from_config)


def test_the_finder_answers_for_old_paths_only() -> None:
    assert new_path("gradwatch.stats") == ("gradwatch.norms.stats", True)
    assert new_path("gradwatch.sinks.wandb") == ("gradwatch.export.sinks.wandb", False)
    assert new_path("gradwatch.norms.stats") is None
    assert new_path("gradwatch.sinksx") is None
    assert MovedPathFinder().find_spec("gradwatch.watcher") is None
    assert sum(isinstance(f, MovedPathFinder) for f in sys.meta_path) == 1


def test_an_old_path_works_in_a_fresh_interpreter() -> None:
    """The finder is installed by ``import gradwatch`` itself, before any gradwatch module."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    import gradwatch.testing as t\n"
        "import gradwatch.doctor.testing as n\n"
        "assert t is n and w and issubclass(w[0].category, DeprecationWarning), w\n"
        "print(w[0].message)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "gradwatch.testing moved to gradwatch.doctor.testing" in done.stdout


@pytest.mark.parametrize(
    ("package", "module", "name"),
    [
        ("gradwatch.reduce", "gradwatch.reduce.packing", "Reducer"),
        ("gradwatch.step", "gradwatch.step.collector", "Collector"),
        ("gradwatch.doctor", "gradwatch.doctor.checks", "run_checks"),
    ],
)
def test_a_package_named_like_a_former_module_forwards_its_names(
    package: str, module: str, name: str
) -> None:
    """``gradwatch.reduce`` was a module and is now a package: the former module's names still
    resolve through it, with a warning, and its own modules import as usual, without one."""
    pkg = importlib.import_module(package)
    vars(pkg).pop(name, None)  # as if never asked in this process
    with pytest.warns(DeprecationWarning, match=rf"{package}.{name} moved to {module}.{name}"):
        value = getattr(pkg, name)
    assert value is getattr(importlib.import_module(module), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert getattr(pkg, name) is value  # asked again: no second warning
        sub = module.rpartition(".")[2]
        assert getattr(importlib.import_module(package), sub) is importlib.import_module(module)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        pkg.not_a_name  # noqa: B018
