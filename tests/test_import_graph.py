"""No import circle in the core or in any plugin distribution, type-only imports included.

Every ``import`` statement of a package's modules counts: at the top, under
``if TYPE_CHECKING:`` and inside functions alike (a circle broken only by importing late is still
a circle a reader has to untangle). ``from package import name`` is an edge to the submodule
``package.name`` when there is one, else to the package itself. A package's ``__init__`` is the
module ``package``; a submodule does not depend on its package's ``__init__`` merely by living
in it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _packages() -> list[tuple[Path, str]]:
    """(directory holding the package, package name) of the core and every distribution."""
    found = [(ROOT, "relax_core")]
    for dist in sorted(
        [*ROOT.glob("plugins/*"), *ROOT.glob("contrib/*"), *ROOT.glob("tests/plugins/*")]
    ):
        for init in sorted(dist.glob("*/__init__.py")):
            if init.parent.name != "tests":
                found.append((dist, init.parent.name))
    return found


def _modules(base: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((base / package).rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ``modules`` that ``name`` (a dotted import target) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(base: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in its source)."""
    modules = _modules(base, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                origin = node.module or ""
                if node.level:
                    here = module if is_package else module.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        here = here.rpartition(".")[0]
                    origin = f"{here}.{origin}" if origin else here
                targets = [
                    f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                    for a in node.names
                ]
            for target in targets:
                owner = _owner(target, modules)
                if owner is not None and owner != module:
                    graph[module].add(owner)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_a_circle_through_a_type_only_import(tmp_path: Path) -> None:
    # Guards the test below against passing vacuously: a circle closed only under
    # TYPE_CHECKING, and one closed by a function-level import, are both found.
    pkg = tmp_path / "loop"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from loop.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loop.a import A\nB = 1\n"
    )
    (pkg / "c.py").write_text("def f():\n    from .d import D\n")
    (pkg / "d.py").write_text("from loop import c\nD = 1\n")
    assert circles(import_graph(tmp_path, "loop")) == [["loop.a", "loop.b"], ["loop.c", "loop.d"]]


@pytest.mark.parametrize(("base", "package"), _packages(), ids=[name for _, name in _packages()])
def test_no_import_circle(base: Path, package: str) -> None:
    graph = import_graph(base, package)
    assert len(graph) > 1 or package != "relax_core"
    assert circles(graph) == []
