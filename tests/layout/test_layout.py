"""The folder tree is the architecture: these tests keep its dependencies pointing one way.

CLI -> daemon -> compare/store -> wire -> protos; renderers read the comparison's report model;
the store knows no service; the rank side (`agents`) loads nothing of the daemon's package.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layout.imports import cycles, import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agents", "auditor", "protos", "wire", "bench", "examples")

# what each layer must never import (prefixes of dotted module names)
FORBIDDEN = {
    "agents": ("auditor",),
    "wire": ("agents", "auditor", "bench", "examples"),
    "protos": ("agents", "auditor", "wire", "bench", "examples"),
    "auditor.store": ("auditor.daemon", "auditor.compare", "auditor.report", "auditor.cli"),
    "auditor.compare": ("auditor.daemon", "auditor.report", "auditor.cli"),
    "auditor.report": ("auditor.daemon", "auditor.cli", "auditor.compare.engine",
                       "auditor.compare.verdicts", "auditor.compare.slow",
                       "auditor.compare.live"),
    "auditor.daemon": ("auditor.cli",),
}
MAX_LINES = 550
"""No module of the auditor over ~500 lines (the issue's bound, with a little slack)."""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_import_cycles(graph):
    assert cycles(graph) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_dependencies_point_one_way(graph, layer):
    bad = sorted(f"{m} imports {t}" for m, targets in graph.items() if _under(m, layer)
                 for t in targets for banned in FORBIDDEN[layer] if _under(t, banned))
    assert bad == []


def test_auditor_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in (ROOT / "auditor").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def test_every_auditor_subpackage_says_what_it_owns():
    for init in (ROOT / "auditor").glob("*/__init__.py"):
        text = init.read_text()
        assert text.lstrip().startswith('"""') and "Owns" in text, init


def test_checker_finds_a_cycle_and_a_forbidden_import(tmp_path):
    """The checker itself: a two-module cycle and a lazy import inside a function are seen."""
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo import b\n")
    (pkg / "b.py").write_text("def f():\n    from demo.a import x\n")
    (pkg / "c.py").write_text("import demo.b as bee\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from demo import a\n")
    g = import_graph(tmp_path, ("demo",))
    assert g["demo.a"] == {"demo.b"} and g["demo.b"] == {"demo.a"} and g["demo.c"] == {"demo.b"}
    assert cycles(g) == [["demo.a", "demo.b"]]
