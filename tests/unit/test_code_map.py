"""The code map in docs/design.md is true: every module of ``src/gradwatch`` has its line, no
module imports what its line says it must never import, and imports point down only: a module
imports modules of its own layer or of a layer listed before it in the table, never after.

The rules are read from the map itself (its "never imports" column), so the document and the
check cannot drift apart. A cell lists backticked gradwatch modules (``export`` means the whole
``gradwatch.export`` package) and the words ``torch`` and ``prometheus_client``; "anything of
gradwatch" or "every other gradwatch module" forbids all of the package, "any other gradwatch
module but `x`" all but ``x``; names after "lazily only:" may be imported inside functions, not
at module level.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "gradwatch"
DESIGN = ROOT / "docs" / "design.md"
_TICKED = re.compile(r"`([a-z_./]+)`")
#: Third-party packages a line of the map may forbid by name (unticked words).
EXTERNALS = ("torch", "prometheus_client")


@dataclass(frozen=True)
class Rule:
    module: str  # dotted, e.g. "gradwatch.export.http"
    layer: int  # position of its layer, bottom (0) to top
    forbidden: frozenset[str]
    top_level_only: frozenset[str] = field(default_factory=frozenset)
    no_gradwatch_but: frozenset[str] | None = None
    externals: frozenset[str] = frozenset()  # third-party packages it must not import

    @property
    def no_torch(self) -> bool:
        return "torch" in self.externals


def _dotted(name: str) -> str:
    return "gradwatch." + name.removesuffix(".py").removesuffix("/").replace("/", ".")


def code_map() -> dict[str, Rule]:
    """module file path relative to the package (``export/http.py``, ``integrations/``) -> rule."""
    text = DESIGN.read_text()
    section = text.split("## Code map", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, Rule] = {}
    layers: list[str] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[1].startswith("`"):
            continue
        if cells[0] not in layers:
            layers.append(cells[0])
        path = cells[1].strip("`")
        never = cells[3]
        everywhere, _, lazy = never.partition("lazily only:")
        externals = frozenset(
            w for w in EXTERNALS if re.search(rf"(^|[^`\w]){w}\b", everywhere) is not None
        )
        but: frozenset[str] | None = None
        if "anything of gradwatch" in everywhere or "every other gradwatch module" in everywhere:
            but = frozenset()
        elif "any other gradwatch module but" in everywhere:
            allowed = everywhere.split("any other gradwatch module but", 1)[1]
            but = frozenset(_dotted(n) for n in _TICKED.findall(allowed))
            everywhere = everywhere.split("any other gradwatch module but", 1)[0]
        rules[path] = Rule(
            module=_dotted(path),
            layer=layers.index(cells[0]),
            forbidden=frozenset(_dotted(n) for n in _TICKED.findall(everywhere)),
            top_level_only=frozenset(_dotted(n) for n in _TICKED.findall(lazy)),
            no_gradwatch_but=but,
            externals=externals,
        )
    return rules


def modules() -> list[str]:
    """Every module of the package as the map names it (a subpackage of one job: its folder)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("integrations/"):
            rel = "integrations/"
        elif path.name == "__init__.py":
            continue
        names.append(rel)
    return sorted(set(names))


def imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for every import statement of ``path``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))  # `if TYPE_CHECKING:` imports are not run: not module level
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((a.name, id(node) in top) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, id(node) in top))
            if node.module == "gradwatch":  # from gradwatch import cli -> gradwatch.cli
                found.extend((f"gradwatch.{a.name}", id(node) in top) for a in node.names)
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_module_has_a_line_in_the_code_map() -> None:
    mapped = set(code_map())
    missing = [m for m in modules() if m not in mapped]
    stale = [m for m in mapped if m not in modules()]
    assert not missing, f"modules missing from the code map in docs/design.md: {missing}"
    assert not stale, f"the code map lists modules that do not exist: {stale}"


@pytest.mark.parametrize("path", modules())
def test_module_imports_nothing_it_must_never_import(path: str) -> None:
    rule = code_map()[path]
    files = sorted((PACKAGE / path).glob("*.py")) if path.endswith("/") else [PACKAGE / path]
    own_package = rule.module.rsplit(".", 1)[0]
    bad = []
    for file in files:
        for name, top_level in imports(file):
            if any(_within(name, e) for e in rule.externals):
                bad.append(name)
            if any(_within(name, f) for f in rule.forbidden):
                bad.append(name)
            if top_level and any(_within(name, f) for f in rule.top_level_only):
                bad.append(f"{name} (at module level)")
            if (
                rule.no_gradwatch_but is not None
                and _within(name, "gradwatch")
                and name != "gradwatch"
                and not _within(name, own_package if own_package != "gradwatch" else rule.module)
                and not any(_within(name, a) for a in rule.no_gradwatch_but)
            ):
                bad.append(name)
    assert not bad, f"{path} imports {sorted(set(bad))}, which the code map forbids"


def _rule_of(name: str, rules: dict[str, Rule]) -> Rule | None:
    """The rule of the module ``name`` (dotted) falls under: its own line, or its package's."""
    for rule in rules.values():
        if _within(name, rule.module):
            return rule
    return None


@pytest.mark.parametrize("path", modules())
def test_module_imports_point_down_only(path: str) -> None:
    rules = code_map()
    rule = rules[path]
    files = sorted((PACKAGE / path).glob("*.py")) if path.endswith("/") else [PACKAGE / path]
    upward = []
    for file in files:
        for name, _ in imports(file):
            if name == "gradwatch" or not _within(name, "gradwatch"):
                continue
            target = _rule_of(name, rules)
            if target is not None and target.layer > rule.layer:
                upward.append(name)
    assert not upward, f"{path} imports {sorted(set(upward))} from a layer above its own"


def test_the_rules_are_read() -> None:
    """The parser understands the map (a rule it silently dropped would pass everything)."""
    rules = code_map()
    assert rules["snapshot.py"].no_torch and rules["snapshot.py"].no_gradwatch_but == frozenset()
    assert rules["norms/stats.py"].no_gradwatch_but == frozenset(
        {"gradwatch.norms.bands", "gradwatch.norms.rows", "gradwatch.norms.rescale"}
    )
    assert "gradwatch.export" in rules["reduce/packing.py"].forbidden
    assert rules["watcher.py"].top_level_only == frozenset({"gradwatch.export"})
    assert rules["config.py"].no_gradwatch_but == frozenset({"gradwatch.errors"})
    assert sum(r.no_torch for r in rules.values()) >= 10
    assert rules["export/server.py"].externals == frozenset({"torch", "prometheus_client"})
    assert rules["errors.py"].layer == 0
    assert rules["watcher.py"].layer > rules["reduce/packing.py"].layer
    assert rules["analysis/summary.py"].layer > rules["norms/stats.py"].layer
