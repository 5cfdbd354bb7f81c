"""The rough edges a first hour with numaudit meets (issue 41), one test each: a run-name typo
gets the nearest names; a port in use is said plainly and leaves no store; a run with more steps
gets a `--steps` hint; `auditor watch` ends as `auditor compare` does; Ctrl-C is quiet from the
command's first instant; gradients of different parameters are not inherited from one another;
mesh advice only where the job has a mesh; an exactly equal loss is identical."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.wire.labels import UNPASSED_MESH_LABEL
from tests.auditor.cli.three_runs import cli, runs
from tests.auditor.synth import RunBuilder, mlp_run, write_runs

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return write_runs(tmp_path_factory.mktemp("first-hour") / "audit.db", *runs(),
                      mlp_run("longer", world=2, steps=2))


def test_a_run_name_typo_names_the_nearest_runs(db):
    res = cli("compare", "reff", "bumpd", "--db", db)
    assert res.exit_code == 2
    assert "'reff': did you mean 'ref'?" in res.output
    assert "'bumpd': did you mean 'bumped'?" in res.output
    res = cli("show", "zzz", "--db", db)
    assert res.exit_code == 2 and "the runs there: 'ref', 'same', 'bumped'" in res.output


def test_a_port_in_use_is_said_plainly_and_creates_nothing(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", "serve", "--listen",
                               f"127.0.0.1:{port}", "--db", str(tmp_path / "audit.db")],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"auditor: error: listen: 127.0.0.1:{port}: address already in use (another auditor "
        "or another program listens there: stop it, or give another port; --listen "
        "127.0.0.1:0 picks a free one)")
    assert "Failed to add port" not in proc.stderr  # gRPC's own line never came
    assert list(tmp_path.iterdir()) == []


def test_a_run_with_more_steps_gets_a_steps_hint(db):
    report = compare_runs(db, "ref", "longer")
    assert report.exit_code == 1  # step 1's keys are missing in ref
    [hint] = [w for w in report.warnings if "--steps" in w]
    assert hint == ("longer has steps 1 that ref has not (ref: steps 0), so their keys read "
                    "missing_in_ref: `--steps :1` compares only the steps both runs have")
    assert compare_runs(db, "ref", "same").warnings == []
    res = cli("compare", "longer", "ref", "--db", db)
    assert "`--steps :1` compares only the steps both runs have" in " ".join(res.output.split())


def test_watch_ends_with_the_summary_and_first_divergence_of_compare(db):
    watched = subprocess.run([sys.executable, "-m", "numaudit.auditor", "watch", "ref", "bumped",
                              "--db", str(db), "--poll", "0.1"], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
    compared = cli("compare", "ref", "bumped", "--db", db)
    assert watched.returncode == compared.exit_code == 1, watched.stderr
    report = compared.output
    summary = report.splitlines()[2]
    assert summary.endswith("breach the policy")
    tail = watched.stdout.split("\n\n", 1)[1]  # after the findings it printed as they came
    assert tail.splitlines()[2] == summary
    first = report.split("First divergence", 1)[1].split("\n\n", 1)[0]
    assert first in tail
    assert "[watch] done: both runs finished, 22 keys compared" in watched.stderr


STARTED = ("import sys, runpy; sys.stderr.write('started\\n'); sys.stderr.flush(); "
           "sys.argv = ['auditor'] + sys.argv[1:]; runpy.run_module('auditor', "
           "run_name='__main__')")
"""`python -m numaudit.auditor ARGS`, saying "started" once the interpreter is up (before then a
Ctrl-C is the interpreter's own start-up failing, whatever the program)."""


@pytest.mark.parametrize("after_s", [0.1, 0.3, 0.6])
def test_ctrl_c_is_quiet_from_the_first_instant(db, after_s):
    """SIGINT while the command is still importing (about a second here) or already running:
    one line, status 130, no traceback, whenever it comes. (The interpreter's own start-up and
    the milliseconds in which it finds the package come before any of the command's code.)"""
    proc = subprocess.Popen([sys.executable, "-c", STARTED, "watch", "a", "b", "--db", str(db),
                             "--wait"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline() == "started\n"
    time.sleep(after_s)
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1] in ("auditor: interrupted", "auditor: watch interrupted")


def _replicated_grads(name: str, world: int, bad_rank: int | None) -> RunBuilder:
    """Two parameters' gradients, held whole by every rank (DDP); rank `bad_rank` keeps its
    own (an all-reduce skipped there)."""
    b = RunBuilder(name, world_size=world)
    g = torch.Generator().manual_seed(0)
    for site in ("a.weight", "b.weight"):
        grad = torch.randn(4, 4, generator=g)
        for r in range(world):
            t = grad + 1.0 if r == bad_rank else grad
            lay = PieceLayout((4, 4), (0, 0), (4, 4), replica=world > 1)
            b.add(r, t, lay, step=0, microbatch=-1, phase="grad", site=site, role="value")
    return b


def test_gradients_of_different_parameters_are_not_inherited_from_each_other(tmp_path):
    cand = _replicated_grads("cand", 2, bad_rank=1)
    db = write_runs(tmp_path / "audit.db", _replicated_grads("ref", 1, None), cand)
    report = compare_runs(db, "ref", "cand")
    found = [f for f in report.findings() if f.verdict == "replica_divergence"]
    assert [f.key.site for f in found] == ["a.weight", "b.weight"]
    for f in found:  # each its own missing all-reduce, not the other parameter's
        assert f.cause.kind == "introduced" and f.cause.previous is None, f.cause
        assert "already has diverging replicas" not in f.cause.reason
    # a plain DDP job registers no mesh and has none: no advice to pass one
    assert "pass the device mesh" not in found[0].cause.reason
    cand.register = {"labels": {UNPASSED_MESH_LABEL: "1"}}
    with_mesh = write_runs(tmp_path / "mesh.db", _replicated_grads("ref", 1, None), cand)
    [f, _] = [f for f in compare_runs(with_mesh, "ref", "cand").findings()
              if f.verdict == "replica_divergence"]
    assert "(pass the device mesh to attach)" in f.cause.reason


def test_an_exactly_equal_loss_is_identical(tmp_path):
    """A per-rank mean loss over 2 dp ranks whose mean is the single process's loss, exactly:
    identical (it read `close rel_l2 0 vs 3.62e-06`)."""
    ref = RunBuilder("ref")
    ref.add_full(torch.tensor(0.5), step=0, microbatch=0, phase="loss", site="loss",
                 role="value", payload=True)
    dp = RunBuilder("dp", world_size=2)
    for r, value in enumerate((0.25, 0.75)):
        lay = PieceLayout((), (), (), reduce="mean", reduce_index=r, reduce_count=2)
        dp.add(r, torch.tensor(value), lay, step=0, microbatch=0, phase="loss", site="loss",
               role="value", payload=True)
    db = write_runs(tmp_path / "audit.db", ref, dp)
    [f] = compare_runs(db, "ref", "dp", preset_policy("fp32")).findings()
    assert f.verdict == "identical", f.headline()
