"""The folder tree is the architecture: these tests keep its dependencies pointing one way.

CLI -> daemon -> compare/store -> wire -> protos; renderers read the comparison's report model;
the store knows no service; the rank side (`agents`) loads nothing of the daemon's package, and
inside it capture and delivery both use the digest, never each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layout.imports import cycles, import_graph

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agents", "auditor", "protos", "wire", "bench", "examples")
ROOT_FOLDERS = ("agents", "auditor", "protos", "wire")
"""Imported as `numaudit.<folder>` (numaudit/__init__.py, setup.py)."""

# what each layer must never import (prefixes of dotted module names, as tests/layout/imports.py
# names them: the repository's folders, `auditor.store` for `numaudit.auditor.store`)
FORBIDDEN = {
    "agents": ("auditor",),
    "wire": ("agents", "auditor", "bench", "examples"),
    "protos": ("agents", "auditor", "wire", "bench", "examples"),
    "auditor.store": ("auditor.daemon", "auditor.compare", "auditor.report", "auditor.cli"),
    "auditor.compare": ("auditor.daemon", "auditor.report", "auditor.cli"),
    "auditor.report": ("auditor.daemon", "auditor.cli", "auditor.compare.engine",
                       "auditor.compare.evaluation", "auditor.compare.measure.verdicts",
                       "auditor.compare.measure.slow", "auditor.compare.live"),
    "auditor.daemon": ("auditor.cli",),
    # inside the rank side: capture -> digest <- delivery, the agent wiring the two ends together
    # (the capturer's sink is the sender's submit); the kernels are the digest's implementation
    "agents.digest": ("agents.capture", "agents.delivery"),
    "agents.kernels": ("agents.capture", "agents.delivery"),
    "agents.capture": ("agents.delivery",),
    "agents.delivery": ("agents.capture",),
}
COMPARE_STAGES = ("digests", "read", "policy", "merge", "measure", "explain", "conventions",
                  "noise", "ops")
"""auditor/compare/'s subpackages in pipeline order (its __init__ says what each owns): a stage
imports only the stages before it, never a later one nor the drivers at the top (`engine`,
`evaluation`, `live`); the report model (`result`) is read by `ops` alone, which attaches the
operations to it."""
MAX_LINES = 550
"""No module over ~500 lines (the issue's bound, with a little slack)."""
OVER_THE_CAP: dict[str, int] = {}
"""Modules still over MAX_LINES, with their length when the cap was extended to agents/ and
wire/ (issue 42): an entry may only shrink, and goes once its module is under the cap."""
CHECKPOINT_MAY_USE = {"agents.agent", "agents.config", "agents.identity", "agents.layout",
                      "agents.capture.sites", "agents.capture.state", "agents.pickles"}
"""What `auditor checkpoint` may take from the rank side: the agent as a library (an Agent per
reader streams the files' digests as phase `state`), its state-dict flattening and its bounded
unpickler; nothing of the delivery, the hooks or the kernels directly."""


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


def test_comparison_stages_import_only_earlier_stages(graph):
    def stage(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["auditor", "compare"] else None

    top = {"auditor.compare." + name for name in ("engine", "evaluation", "live", "result")}
    allowed = {s: set(COMPARE_STAGES[:k + 1]) for k, s in enumerate(COMPARE_STAGES)}
    bad = []
    for m, targets in graph.items():
        s = stage(m)
        if s not in allowed:
            continue
        for t in targets:
            if t in top:
                if not (s == "ops" and t == "auditor.compare.result"):
                    bad.append(f"{m} imports the driver {t}")
            elif stage(t) is not None and stage(t) not in allowed[s]:
                bad.append(f"{m} ({s}) imports {t}, a later stage")
    assert sorted(bad) == []
    on_disk = sorted(p.name for p in (ROOT / "auditor" / "compare").iterdir()
                     if (p / "__init__.py").exists())
    assert on_disk == sorted(COMPARE_STAGES)


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for d in ("agents", "auditor", "wire")
           for p in (ROOT / d).rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    grown = {m: n for m, n in big.items() if n > OVER_THE_CAP.get(m, MAX_LINES)}
    assert grown == {}, "over the cap (or grown past their allow-list entry)"
    assert sorted(big) == sorted(OVER_THE_CAP), "an allow-list entry to remove: under the cap now"


def test_checkpoint_reading_uses_only_the_agents_library_surface(graph):
    used = {t for m, targets in graph.items() if _under(m, "auditor.checkpoint")
            for t in targets if _under(t, "agents")}
    assert used <= CHECKPOINT_MAY_USE, sorted(used - CHECKPOINT_MAY_USE)


def test_only_checkpoint_reading_and_the_cli_import_the_agent(graph):
    """The daemon, the store and the comparison never load the rank side (the CLI reads the
    agent's configuration names for --help)."""
    bad = sorted(f"{m} imports {t}" for m, targets in graph.items()
                 if _under(m, "auditor") and not _under(m, "auditor.checkpoint")
                 and not _under(m, "auditor.cli") for t in targets if _under(t, "agents"))
    assert bad == []


def test_every_subpackage_says_what_it_owns():
    for init in [*(ROOT / "auditor").glob("*/__init__.py"),
                 *(ROOT / "agents").glob("*/__init__.py")]:
        text = init.read_text()
        assert text.lstrip().startswith('"""') and "Owns" in text, init


def test_every_import_goes_through_the_one_import_root():
    """`numaudit.agents`, never `agents`: an installed numaudit has no top-level `agents`
    (a name other packages take), and in a checkout both would load, twice, as two modules."""
    import ast

    bare = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if path.relative_to(ROOT).parts[0] in (".venv", "build"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                     if n.split(".")[0] in ROOT_FOLDERS]
    assert bare == []


def test_the_users_door_loads_no_torch_and_names_the_agents_api():
    """`import numaudit` and `numaudit.agents` (the node sidecar's package) load no torch until
    a name is used, and `numaudit.agents` exports what a training script uses (README,
    docs/agent.md): resolving them is tests/agents/test_agent.py's."""
    import subprocess
    import sys

    code = ("import sys, numaudit, numaudit.agents as a; assert 'torch' not in sys.modules; "
            "assert sorted(a.__all__) == sorted(a.USER_API) == sorted(numaudit.__all__); "
            "print(sorted(a.__all__))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("['Agent', 'AgentConfig', 'Backlog', 'RaggedRows', "
                                   "'agent_loss', 'attach', 'ragged_rows', 'watch_stages']")


def test_checker_finds_a_cycle_and_a_forbidden_import(tmp_path):
    """The checker itself: a two-module cycle, a lazy import inside a function, and a circle
    through type-only imports are seen."""
    pkg = tmp_path / "demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from demo import b\n")
    (pkg / "b.py").write_text("def f():\n    from demo.a import x\n")
    (pkg / "c.py").write_text("import demo.b as bee\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from demo.e import E\n")
    (pkg / "e.py").write_text("from demo import d\n")
    g = import_graph(tmp_path, ("demo",))
    assert g["demo.a"] == {"demo.b"} and g["demo.b"] == {"demo.a"} and g["demo.c"] == {"demo.b"}
    assert g["demo.d"] == {"demo.e"}
    assert cycles(g) == [["demo.a", "demo.b"], ["demo.d", "demo.e"]]
