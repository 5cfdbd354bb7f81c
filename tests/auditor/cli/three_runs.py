"""The runs the CLI tests compare, shared by the SQLite and PostgreSQL variants: a reference,
the same job on twice the ranks, and one with a planted divergence at fwd layers.1 mb 1."""

from __future__ import annotations

from click.testing import CliRunner

from numaudit.auditor.cli import main
from tests.auditor.synth import mlp_run


def _bump(kind, step, mb, site, t):
    if (kind, site, mb) == ("fwd", "layers.1", 1):
        t = t.clone()
        t[0, 0] += 0.5
    return t


def runs():
    """"ref" (2 ranks), "same" (4 ranks, equal), "bumped" (2 ranks, fwd layers.1 mb 1 off)."""
    return (mlp_run("ref", world=2), mlp_run("same", world=4),
            mlp_run("bumped", world=2, perturb=_bump))


def cli(*args):
    """`auditor ARGS...` in process; arguments may be paths."""
    return CliRunner().invoke(main, [str(a) for a in args])
