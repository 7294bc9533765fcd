"""Module paths that moved into the packages, still importable under their old names.

``import gradwatch.stats`` (or ``from gradwatch.ddp_hook import ddp_comm_hook``) gives the module
now at its new path (``gradwatch.norms.stats``), the very same module object, and warns with a
``DeprecationWarning`` naming the new path; the old names go away in the next release.
``gradwatch.sinks`` (and its modules) is public API, now kept in ``gradwatch.export.sinks``: it
resolves to the same modules without a warning.

One finder on ``sys.meta_path`` does this, so the old names need no file each. It is installed
first on the path: a module of ``gradwatch.sinks`` found through the package's ``__path__`` by
the ordinary finder would be a second copy under the old name. No import here but the standard
library's: the package's ``__init__`` installs it before anything else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import pkgutil
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

#: old dotted path -> new dotted path: every module of the flat layout that moved under its own
#: name. ``reduce``, ``step`` and ``doctor`` are not here: those names are now the packages, and
#: each package forwards the former module's names (:func:`old_module_names`).
MOVED: dict[str, str] = {
    f"gradwatch.{old}": f"gradwatch.{new}"
    for old, new in {
        "model": "norms.model",
        "gradients": "norms.gradients",
        "bands": "norms.bands",
        "rows": "norms.rows",
        "rescale": "norms.rescale",
        "stats": "norms.stats",
        "amp": "norms.amp",
        "hooks": "norms.hooks",
        "fsdp1": "stacks.fsdp1",
        "zero": "stacks.zero",
        "main_grad": "stacks.main_grad",
        "experts": "reduce.experts",
        "ddp_hook": "stacks.ddp_hook",
        "layout": "reduce.layout",
        "handshake": "reduce.handshake",
        "collective": "reduce.collective",
        "resolve": "step.resolve",
        "failures": "step.failures",
        "clip": "step.clip",
        "guard": "step.guard",
        "summary": "analysis.summary",
        "spikes": "analysis.spikes",
        "rankview": "analysis.rankview",
        "anomalies": "analysis.anomalies",
        "audit": "analysis.audit",
        "reporter": "analysis.reporter",
        "history": "export.history",
        "doctor_cuda": "doctor.cuda",
        "doctor_options": "doctor.options",
        "timing": "doctor.timing",
        "testing": "doctor.testing",
    }.items()
}
#: public package path -> where it lives (no warning: still public API)
KEPT = {"gradwatch.sinks": "gradwatch.export.sinks"}


def new_path(fullname: str) -> tuple[str, bool] | None:
    """``(new dotted path, deprecated)`` of an old module path, None for any other name."""
    if fullname in MOVED:
        return MOVED[fullname], True
    for old, new in KEPT.items():
        if fullname == old or fullname.startswith(old + "."):
            return new + fullname[len(old) :], False
    return None


def _warn_at_importer(message: str) -> None:
    """A DeprecationWarning attributed to the line that imported (the first frame outside the
    import machinery and this module), so the default filters show it for ``__main__`` and
    ``-W error::DeprecationWarning`` or pytest's filters catch it where the import is written."""
    frame = sys._getframe(1)
    while frame.f_back is not None and (
        frame.f_code.co_filename == __file__ or "importlib" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        DeprecationWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<unknown>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str, deprecated: bool) -> None:
        self.new = new
        self.deprecated = deprecated

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway module; exec_module puts the real one in its place

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        if self.deprecated:
            _warn_at_importer(
                f"{old} moved to {self.new}; importing it as {old} is deprecated and stops "
                "working in the next release"
            )
        # The import system returns whatever sys.modules holds under the name once this returns.
        sys.modules[old] = importlib.import_module(self.new)


class MovedPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of gradwatch (and nothing else)."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        found = new_path(fullname)
        if found is None:
            return None
        new, deprecated = found
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new, deprecated))


def old_module_names(package: str, path: list[str], module: str) -> Callable[[str], object]:
    """The ``__getattr__`` of a package that took the name of a former module (``gradwatch.
    reduce`` was the packing module, now ``gradwatch.reduce.packing``): a name of that module
    (``gradwatch.reduce.Reducer``), with a DeprecationWarning naming its new path. The package's
    own modules are left to the import system."""
    submodules = {m.name for m in pkgutil.iter_modules(path)}

    def __getattr__(name: str) -> object:
        if name.startswith("__") or name in submodules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        target = importlib.import_module(module)
        if not hasattr(target, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn_at_importer(
            f"{package}.{name} moved to {module}.{name}; importing it from {package} is "
            "deprecated and stops working in the next release"
        )
        value = getattr(target, name)
        setattr(sys.modules[package], name, value)  # once: ``from x import y`` asks twice
        return value

    return __getattr__


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per interpreter)."""
    if not any(isinstance(f, MovedPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedPathFinder())
