"""The code map in docs/design.md is true: one table per package, bottom to top; every module of
``src/gradwatch`` has its line in exactly one table; no module imports what its package's
"Never imports" line or its own line forbids; an import from another package points to a table
above its own (imports point down between packages); and no modules import each other in a
cycle. Lazy imports (inside functions) and type-only ones (under ``TYPE_CHECKING``) count too.

The rules are read from the map itself, so the document and the check cannot drift apart. A
cell lists backticked gradwatch modules or packages (``export`` is the whole
``gradwatch.export`` package, ``norms.stats`` one module) and the words ``torch`` and
``prometheus_client``; "anything of gradwatch" or "every other gradwatch module" forbids all of
the package, "any other gradwatch module but `x`" all but ``x``; names after "lazily only:" may
be imported inside functions, not at module level; "—" adds nothing.
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
#: At most this many modules at the top of the package, and at least this many subpackages.
MAX_TOP_LEVEL_MODULES = 10
MIN_SUBPACKAGES = 5


@dataclass(frozen=True)
class Rule:
    module: str  # dotted, e.g. "gradwatch.export.http"
    table: int  # position of its package's table, bottom (0) to top
    forbidden: frozenset[str]
    top_level_only: frozenset[str] = field(default_factory=frozenset)
    no_gradwatch_but: frozenset[str] | None = None
    externals: frozenset[str] = frozenset()  # third-party packages it must not import

    @property
    def no_torch(self) -> bool:
        return "torch" in self.externals


@dataclass(frozen=True)
class Table:
    title: str
    index: int
    never: frozenset[str]  # dotted packages and modules no module of the table imports
    modules: tuple[str, ...]  # paths relative to the package, as the rows name them


def _dotted(name: str) -> str:
    return "gradwatch." + name.removesuffix(".py").removesuffix("/").replace("/", ".")


def _rule(path: str, table: Table, cell: str) -> Rule:
    everywhere, _, lazy = cell.partition("lazily only:")
    externals = frozenset(
        w for w in EXTERNALS if re.search(rf"(^|[^`\w]){w}\b", everywhere) is not None
    )
    but: frozenset[str] | None = None
    if "anything of gradwatch" in everywhere or "every other gradwatch module" in everywhere:
        but = frozenset()
    elif "any other gradwatch module but" in everywhere:
        before, _, allowed = everywhere.partition("any other gradwatch module but")
        but = frozenset(_dotted(n) for n in _TICKED.findall(allowed))
        everywhere = before
    return Rule(
        module=_dotted(path),
        table=table.index,
        forbidden=table.never | frozenset(_dotted(n) for n in _TICKED.findall(everywhere)),
        top_level_only=frozenset(_dotted(n) for n in _TICKED.findall(lazy)),
        no_gradwatch_but=but,
        externals=externals,
    )


def tables() -> list[Table]:
    """The package tables of the code map, bottom to top."""
    section = DESIGN.read_text().split("## Code map", 1)[1].split("\n## ", 1)[0]
    found: list[Table] = []
    for block in section.split("\n### ")[1:]:
        title = block.split("\n", 1)[0]
        never_text = block.split("Never imports:", 1)[1].split("\n\n", 1)[0]
        modules = tuple(
            cells[0].strip("`")
            for line in block.splitlines()
            if line.startswith("| `")
            for cells in [[c.strip() for c in line.strip().strip("|").split("|")]]
        )
        never = frozenset(_dotted(n) for n in _TICKED.findall(never_text))
        found.append(Table(title, len(found), never, modules))
    return found


def code_map() -> dict[str, Rule]:
    """module file path relative to the package (``export/http.py``) -> its rule."""
    rules: dict[str, Rule] = {}
    section = DESIGN.read_text().split("## Code map", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("\n### ")[1:]
    for table, block in zip(tables(), blocks, strict=True):
        for line in block.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 3 and cells[0].startswith("`"):
                path = cells[0].strip("`")
                assert path not in rules, f"{path} is listed twice in the code map"
                rules[path] = _rule(path, table, cells[2])
    return rules


def modules() -> list[str]:
    """Every module of the package as the map names it (``__init__.py`` files aside)."""
    return sorted(
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py"
    )


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ALL_MODULES = {_module_name(p) for p in PACKAGE.rglob("*.py")}


@dataclass(frozen=True)
class Import:
    name: str  # the gradwatch module (or package) imported, dotted
    module_level: bool  # run when the importing module is imported
    type_only: bool  # under ``if TYPE_CHECKING:``


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> list[Import]:
    """Every import statement of ``path`` (lazy and type-only ones too), resolved to modules:
    ``from gradwatch.reduce import layout`` imports ``gradwatch.reduce.layout``, ``from
    gradwatch import __version__`` the package's face, ``gradwatch``."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    return imports_of_source(path.read_text(), package)


def imports_of_source(source: str, package: str) -> list[Import]:
    """:func:`imports` of ``source``, a module of the package ``package`` (dotted)."""
    tree = ast.parse(source)
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for n in child.body:
                    visit_one(n, False, True)
                for n in child.orelse:
                    visit_one(n, module_level, type_only)
                continue
            visit_one(child, module_level, type_only)

    def visit_one(node: ast.AST, module_level: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, module_level, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in ALL_MODULES]
            found.extend(Import(s, module_level, type_only) for s in subs)
            if len(subs) < len(node.names):
                found.append(Import(base, module_level, type_only))
        in_body = module_level and not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        )
        visit(node, in_body, type_only)

    visit(tree, True, False)
    return [i for i in found if _within(i.name, "gradwatch") or i.name.split(".")[0] in EXTERNALS]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _table_of(name: str, rules: dict[str, Rule], tabs: list[Table]) -> int | None:
    """The table of the gradwatch module or package ``name`` (dotted): its own line's, else the
    table whose modules it holds (a package); the face's for ``gradwatch`` itself."""
    if name == "gradwatch":
        return next(t.index for t in tabs if "watcher.py" in t.modules)
    for rule in rules.values():
        if _within(name, rule.module):
            return rule.table
    held = {r.table for r in rules.values() if _within(r.module, name)}
    return held.pop() if len(held) == 1 else None


def _files_of_table(table: Table) -> list[Path]:
    """The table's module files, plus the ``__init__.py`` of the packages it holds (the
    top-level one belongs to the face)."""
    files = [PACKAGE / m for m in table.modules]
    folders = {(PACKAGE / m).parent for m in table.modules}
    if "watcher.py" in table.modules:
        files.append(PACKAGE / "__init__.py")
    files += [f / "__init__.py" for f in sorted(folders) if f != PACKAGE]
    return files


def test_every_module_has_a_line_in_the_code_map() -> None:
    mapped = set(code_map())
    missing = [m for m in modules() if m not in mapped]
    stale = [m for m in mapped if m not in modules()]
    assert not missing, f"modules missing from the code map in docs/design.md: {missing}"
    assert not stale, f"the code map lists modules that do not exist: {stale}"


def test_every_package_is_one_table() -> None:
    """A subpackage's modules are all in one table (its own), so the table's rules are the
    package's."""
    where: dict[str, set[int]] = {}
    for path, rule in code_map().items():
        folder = path.rpartition("/")[0].split("/")[0]
        if folder:
            where.setdefault(folder, set()).add(rule.table)
    split = {folder: t for folder, t in where.items() if len(t) != 1}
    assert not split, f"packages spread over several tables of the code map: {split}"


@pytest.mark.parametrize("path", modules())
def test_module_imports_nothing_it_must_never_import(path: str) -> None:
    rule = code_map()[path]
    bad = []
    for imp in imports(PACKAGE / path):
        name = imp.name
        if any(_within(name, e) for e in rule.externals):
            bad.append(name)
        if any(_within(name, f) for f in rule.forbidden):
            bad.append(name)
        if imp.module_level and any(_within(name, f) for f in rule.top_level_only):
            bad.append(f"{name} (at module level)")
        if (
            rule.no_gradwatch_but is not None
            and _within(name, "gradwatch")
            and not any(_within(name, a) for a in rule.no_gradwatch_but)
        ):
            bad.append(name)
    assert not bad, f"{path} imports {sorted(set(bad))}, which the code map forbids"


@pytest.mark.parametrize("table", tables(), ids=lambda t: t.title.split(":")[0].strip("`"))
def test_imports_point_down_between_packages(table: Table) -> None:
    rules, tabs = code_map(), tables()
    upward = []
    for file in _files_of_table(table):
        for imp in imports(file):
            if not _within(imp.name, "gradwatch"):
                continue
            target = _table_of(imp.name, rules, tabs)
            if target is not None and target > table.index:
                upward.append(f"{file.relative_to(PACKAGE)} -> {imp.name}")
            if table.index > 0 and any(_within(imp.name, n) for n in table.never):
                upward.append(f"{file.relative_to(PACKAGE)} -> {imp.name} (never imports)")
    assert not upward, f"imports from a package above {table.title!r}: {sorted(set(upward))}"


def import_graph() -> dict[str, set[str]]:
    """module -> the gradwatch modules it imports, lazily or for types only included."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        graph[name] = {
            i.name for i in imports(path) if i.name in ALL_MODULES and i.name != name
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan,
    iterative): each is a set of modules that import each other in a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle() -> None:
    """No modules import each other in a cycle, at module level, lazily or for types only."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_lazy_and_type_only_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from gradwatch.reduce import layout\n"
        "from . import rows\n"
        "if TYPE_CHECKING:\n"
        "    from gradwatch.step.resolve import Resolved\n"
        "def f():\n"
        "    from gradwatch import __version__\n"
        "    import torch\n"
    )
    found = imports_of_source(source, "gradwatch.norms")
    assert Import("gradwatch.reduce.layout", True, False) in found
    assert Import("gradwatch.norms.rows", True, False) in found
    assert Import("gradwatch.step.resolve", False, True) in found
    assert Import("gradwatch", False, False) in found
    assert Import("torch", False, False) in found
    assert not [i for i in found if i.name == "typing"]


def test_the_rules_are_read() -> None:
    """The parser understands the map (a rule it silently dropped would pass everything)."""
    rules, tabs = code_map(), tables()
    assert len(tabs) >= MIN_SUBPACKAGES + 2
    assert rules["snapshot.py"].no_torch and rules["snapshot.py"].no_gradwatch_but == frozenset()
    assert rules["norms/stats.py"].no_gradwatch_but == frozenset(
        {"gradwatch.norms.bands", "gradwatch.norms.rows", "gradwatch.norms.rescale",
         "gradwatch.norms.repair", "gradwatch.norms.fused", "gradwatch.norms.kernels",
         "gradwatch.norms.layout"}
    )
    assert "gradwatch.export" in rules["reduce/packing.py"].forbidden
    assert "gradwatch.step" in rules["analysis/summary.py"].forbidden
    assert rules["watcher.py"].top_level_only == frozenset({"gradwatch.export"})
    assert rules["config.py"].no_gradwatch_but == frozenset({"gradwatch.errors"})
    assert sum(r.no_torch for r in rules.values()) >= 10
    assert rules["export/server.py"].externals == frozenset({"torch", "prometheus_client"})
    assert rules["errors.py"].table == 0
    assert rules["watcher.py"].table > rules["reduce/packing.py"].table
    assert rules["analysis/summary.py"].table > rules["norms/stats.py"].table
    assert rules["step/collector.py"].table > rules["analysis/summary.py"].table


def test_the_tree_shows_the_layers() -> None:
    """A handful of modules at the top of the package, the rest in subpackages."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    assert len(subpackages) >= MIN_SUBPACKAGES, subpackages


#: The size limits of the developers' guide.
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 300


def test_no_module_or_class_over_its_size_limit() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PACKAGE).as_posix()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_long.append(f"{rel}: class {node.name}: {lines} lines")
    assert not too_long, too_long
