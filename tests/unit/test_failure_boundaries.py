"""Broad exception handlers live only at the documented failure boundaries.

The boundaries are read from the "Failure boundaries" table of docs/design.md (its module and
function columns), so the document and the check cannot drift apart. A handler is broad when it
is bare or catches ``Exception`` or ``BaseException`` (alone or in a tuple), and so is
``contextlib.suppress`` of either. A broad handler whose last statement raises (bare ``raise``,
or a new error ``from`` the caught one) hides nothing and is allowed anywhere.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "gradwatch"
DESIGN = ROOT / "docs" / "design.md"
BROAD = frozenset({"Exception", "BaseException"})

#: (module file relative to the package, qualified function name, line)
Site = tuple[str, str, int]


def boundaries() -> set[tuple[str, str]]:
    """(module file, qualified function name) of every row of the design's table."""
    section = DESIGN.read_text().split("## Failure boundaries", 1)[1].split("\n## ", 1)[0]
    rows: set[tuple[str, str]] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[1].startswith("`"):
            rows.add((cells[0].strip("`"), cells[1].strip("`")))
    return rows


def _caught(node: ast.expr | None) -> set[str]:
    if node is None:
        return {"<bare>"}
    if isinstance(node, ast.Tuple):
        return set().union(*(_caught(e) for e in node.elts))
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def _reraises(handler: ast.ExceptHandler) -> bool:
    last = handler.body[-1]
    if not isinstance(last, ast.Raise):
        return False
    if last.exc is None:
        return True
    cause = last.cause
    return isinstance(cause, ast.Name) and handler.name is not None and cause.id == handler.name


def _suppresses_broadly(node: ast.With | ast.AsyncWith) -> bool:
    for item in node.items:
        call = item.context_expr
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "suppress" and any(_caught(arg) & BROAD for arg in call.args):
            return True
    return False


class _Finder(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module = module
        self.scope: list[str] = []
        self.found: list[Site] = []

    def _enter(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def _add(self, line: int) -> None:
        self.found.append((self.module, ".".join(self.scope) or "<module>", line))

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if _caught(node.type) & (BROAD | {"<bare>"}) and not _reraises(node):
            self._add(node.lineno)
        self.generic_visit(node)

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        if _suppresses_broadly(node):
            self._add(node.lineno)
        self.generic_visit(node)

    visit_AsyncWith = visit_With


def broad_handlers(source: str, module: str) -> list[Site]:
    """Every broad handler of ``source`` that does not end by raising."""
    finder = _Finder(module)
    finder.visit(ast.parse(source))
    return finder.found


def package_handlers() -> list[Site]:
    found: list[Site] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += broad_handlers(path.read_text(), path.relative_to(PACKAGE).as_posix())
    return found


def test_broad_handlers_only_at_documented_boundaries() -> None:
    allowed = boundaries()
    outside = [s for s in package_handlers() if (s[0], s[1]) not in allowed]
    assert not outside, (
        "broad except outside the failure boundaries of docs/design.md (catch the exceptions "
        "that can occur, or document a new boundary): "
        + ", ".join(f"{m}:{line} ({f})" for m, f, line in outside)
    )


def test_every_documented_boundary_exists() -> None:
    present = {(m, f) for m, f, _ in package_handlers()}
    stale = sorted(boundaries() - present)
    assert not stale, f"documented boundaries without a broad except: {stale}"


def test_the_table_is_read() -> None:
    rows = boundaries()
    assert ("step/collector.py", "Collector._collect") in rows
    assert ("export/http.py", "_Feed._run") in rows
    assert len(rows) >= 10


def test_the_finder_flags_broad_handlers_and_spares_reraising_ones() -> None:
    source = textwrap.dedent(
        """
        import contextlib

        class A:
            def swallow(self):
                try:
                    pass
                except Exception:
                    pass

            def bare(self):
                def inner():
                    try:
                        pass
                    except:
                        return None
                return inner

        def in_tuple():
            try:
                pass
            except (ValueError, BaseException) as exc:
                print(exc)

        def suppressed():
            with contextlib.suppress(OSError, Exception):
                pass

        def translated_without_cause():
            try:
                pass
            except Exception:
                raise RuntimeError("x")

        def cleanup():
            try:
                pass
            except BaseException:
                print("close")
                raise

        def translated(exc_name):
            try:
                pass
            except Exception as exc:
                raise RuntimeError("x") from exc

        def narrow():
            try:
                pass
            except (OSError, ValueError):
                pass
            with contextlib.suppress(OSError):
                pass
        """
    )
    found = {(f, line) for _, f, line in broad_handlers(source, "m.py")}
    assert {f for f, _ in found} == {
        "A.swallow",
        "A.bare.inner",
        "in_tuple",
        "suppressed",
        "translated_without_cause",
    }
    assert len(found) == 5
