"""Static import graph of the project's packages, for the layout tests.

Reads every module with `ast` and resolves each import to the project module it loads: `from
a.b import c` is module `a.b.c` when that file exists, else the package `a.b`; `numaudit.a.b` is
the repository's `a.b` (the one import root, numaudit/__init__.py). Every import counts: one
inside a function (a lazy import is still a dependency) and one under `if TYPE_CHECKING:` (it
never runs, but a reader follows it, and a circle through types is still a circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT_PACKAGE = "numaudit."
"""The import root: `numaudit.agents.x` is the repository's module `agents.x`."""


def project_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the given top-level packages."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a project module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = project_modules(root, packages)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name.removeprefix(ROOT_PACKAGE) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if base == "numaudit" and not node.level:  # from numaudit import agents
                    base = ""
                base = base.removeprefix(ROOT_PACKAGE)
                if node.level:  # relative: resolve against this module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [name if (name := f"{base}.{a.name}".lstrip(".")) in modules else base
                           for a in node.names]
            for t in targets:
                r = _resolve(t, modules)
                if r is not None and r != mod:
                    graph[mod].add(r)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
