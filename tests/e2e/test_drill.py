"""Drill-down live (issue 43): `auditor watch --escalate` asks two running jobs for a flagged
module's operations, and names the operation for step 1 without a rerun. Real processes as a
user starts them: `auditor serve`, the two runs, `auditor watch`, `auditor compare`. (The
tensor-parallel block whose all-reduce is absent runs in the parallelism matrix's job:
tests/e2e/test_parallelisms.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, compare_json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _job(name: str, scale: float, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "e2e" / "drill_live_job.py"), "--name", name,
         "--scale", str(scale)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=dict(os.environ, NUMAUDIT_ADDR=address, OMP_NUM_THREADS="1"))


def test_watch_escalate_names_the_operation_for_step_1_without_a_rerun(tmp_path):
    daemon = Daemon(tmp_path)
    try:
        watch = subprocess.Popen(
            [sys.executable, "-m", "numaudit.auditor", "watch", "ref", "cand", "--escalate",
             "--address", daemon.address, "--wait", "--poll", "0.2", "--preset", "fp32",
             "--format", "json"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        jobs = [_job("ref", 1.0, daemon.address), _job("cand", 0.5, daemon.address)]
        outs = [job.communicate(timeout=200)[0] for job in jobs]
        out, err = watch.communicate(timeout=120)
    finally:
        assert daemon.stop() == 0
    assert all(job.returncode == 0 for job in jobs), outs
    assert all("applied [(" in o and ", 1)]" in o for o in outs), outs  # step 1, both runs
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    directives = [e["directive"] for e in events if e["event"] == "directive"]
    assert directives[0]["step"] == 1 and directives[0]["ops"] == ["mlp.w2", "mlp"], directives
    drills = [e["drill"] for e in events if e["event"] == "drill"]
    assert drills and drills[0]["step"] == 1 and drills[0]["differ"] >= 2, drills
    first = drills[0]["findings"][0]
    assert (first["phase"], first["module"], first["kind"]) == ("fwd", "mlp", "introduced")
    assert first["op"].startswith("aten.mul") and "float argument 0 differs" in first["reason"]
    summary = events[-1]
    assert summary["event"] == "summary" and summary["summary"]["exit_code"] == 1
    # the store keeps the operations: the report the watch ends with names them too
    code, report = compare_json(daemon.db, "ref", "cand")
    assert report["ops"]["findings"][0]["op"].startswith("aten.mul")
