"""Pipeline schedules that infer shapes, with the user's own hook captures (issue 29).

One daemon; the one-process reference and one 2-rank torchrun job of three cases
(tests/e2e/pipeline_glue_job.py): GPipe on 2 stages, DualPipeV on 4 stages in a V, and DualPipeV
with stage 2 detaching its input. Each is compared with `auditor compare --preset fp32`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, Daemon

pytestmark = pytest.mark.timeout(400)
JOB = ROOT / "tests" / "e2e" / "pipeline_glue_job.py"
CASES = ("gpipe", "dualpipev", "dualpipev_detach")


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


class Runs:
    def __init__(self, daemon: Daemon, out: Path) -> None:
        self.daemon, self.out = daemon, out
        self._reports: dict[str, tuple[int, dict]] = {}

    def compare(self, cand: str) -> tuple[int, dict]:
        """`auditor compare ref CAND --preset fp32 --format json`: (exit code, report)."""
        if cand not in self._reports:
            path = self.out / f"{cand}.json"
            proc = subprocess.run(
                [sys.executable, "-m", "numaudit.auditor", "compare", "ref", cand, "--db",
                 str(self.daemon.db), "--preset", "fp32", "--format", "json", "-o", str(path)],
                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                text=True, timeout=120)
            assert proc.returncode in (0, 1), proc.stderr
            self._reports[cand] = proc.returncode, json.loads(path.read_text())
        return self._reports[cand]

    def summary(self, run: str, rank: int) -> dict:
        """The agent's close summary on that rank."""
        return json.loads((self.out / f"{run}-rank{rank}.json").read_text())

    def first_microbatch_records(self, run: str, rank: int) -> int:
        """Records that rank stored for step 0, microbatch 0."""
        with sqlite3.connect(self.daemon.db) as conn:
            (n,) = conn.execute(
                "SELECT count(*) FROM records r JOIN runs USING (run_id) WHERE runs.name = ? "
                "AND r.rank = ? AND r.step = 0 AND r.microbatch = 0", (run, rank)).fetchone()
        return n


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    tmp = tmp_path_factory.mktemp("glue")
    daemon = Daemon(tmp)
    try:
        env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, GLUE_OUT=str(tmp),
                   NUMAUDIT_PHASES="fwd,bwd,grad,loss,input", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        env.pop("NUMAUDIT_RUN", None)
        env.pop("NUMAUDIT_RENAME_IF_TAKEN", None)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ref = pool.submit(_run, [sys.executable, str(JOB), "ref:ref"],
                              dict(env, WORLD_SIZE="1"))
            _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node=2", str(JOB), *(f"{c}:{c}" for c in CASES)], env)
            ref.result()
        yield Runs(daemon, tmp)
    finally:
        daemon.stop()


@pytest.mark.parametrize("cand", ("gpipe", "dualpipev"))
def test_shape_inference_captures_never_become_microbatch_0(runs, cand):
    """The schedules infer shapes on step 0 by running each stage's module once outside its
    chunks, and the user's pre-hooks call agent.capture then too (on empty tensors after stage
    0). Those captures are not stored as microbatch 0: no conflict, and every key of the
    reference matches bitwise."""
    code, report = runs.compare(cand)
    summary = report["summary"]
    assert (code, summary["breaches"], summary["verdicts"]["conflict"]) == (0, 0, 0), summary
    assert summary["verdicts"]["identical"] == summary["keys"] == 386
    for rank in (0, 1):
        assert runs.summary(cand, rank)["conflicts"] == 0


@pytest.mark.parametrize("cand", CASES)
def test_skipped_shape_inference_captures_are_counted_per_rank(runs, cand):
    """What the agent left out on each rank is one microbatch's forward of its stages: the
    hooks' activations and their gradients, the user's captures and the last stage's loss,
    as many as it stored for microbatch 0 of step 0."""
    for rank in (0, 1):
        skipped = runs.summary(cand, rank)["not_captured"].get("pipeline_shape_inference")
        assert skipped == runs.first_microbatch_records(cand, rank) > 0, (rank, skipped)
    assert runs.summary("ref", 0)["not_captured"] == {}


def test_a_detach_in_dualpipev_is_explained_at_the_stage_boundary_it_cuts(runs):
    """Stage 2 (rank 1's second stage of the V) detaches its input: stages 0 and 1 get all-zero
    gradients, and the explanation is at stage 1 and the 1 -> 2 boundary, not at stage 0."""
    _, report = runs.compare("dualpipev_detach")
    breaks = {b["stage"]: b for b in report["graph_breaks"] if b["side"] == "cand"}
    assert set(breaks) == {0, 1} and all(b["kind"] == "zero" for b in breaks.values())
    assert breaks[0]["boundary"] == ""
    text = breaks[1]["boundary"]
    assert text.startswith("gradients stop at stage 1 (the first without non-zero parameter "
                           "gradients in dualpipev_detach"), text
    assert "at the stage 1 -> 2 boundary (stage 2's parameters received gradients)" in text
    assert re.search(r"activation gradients arriving at stage 1 are all zero \(\d+ of \d+ bwd "
                     r"captures\): the graph is cut at the boundary", text), text
    assert report["summary"]["verdicts"]["conflict"] == 0
