"""Issue 37, "Capture order on the wire", end to end: a model of mixed widths (tests/e2e/
order_job.py), whose LayerNorms' outputs travel as payloads and whose projections' do not, so
each microbatch's records are stored in another order than its hooks fired. One process against
DDP over 2 ranks (one torchrun job, gloo): the clean pair passes; a forward bug in the first
LayerNorm on rank 1 is the first divergence at that LayerNorm, rank-localized to rank 1; the
HTML report's heatmap rows are the modules in the order they ran."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, compare_json, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = ROOT / "tests" / "e2e" / "order_job.py"
FORWARD = ["emb"] + [f"blocks.{b}.{m}" for b in range(2)
                     for m in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2", "")] + ["head"]
FORWARD = [s.rstrip(".") for s in FORWARD]
"""Modules in the order their forward hooks fire (a block's own hook after its children's)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("order")
    daemon = Daemon(tmp)
    try:
        env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT), NUMAUDIT_PHASES="fwd,bwd,grad,loss,input")
        for var in ("NUMAUDIT_RUN", "NUMAUDIT_RENAME_IF_TAKEN", "NUMAUDIT_PAYLOAD_MAX_BYTES",
                    "NUMAUDIT_PAYLOAD", "NUMAUDIT_DEPTH"):
            env.pop(var, None)
        run_ok([sys.executable, str(JOB), "single:ref"], dict(env, WORLD_SIZE="1"))
        run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", str(JOB), "ddp:ddp", "ddp_ln_bug:bug"], env)
        yield daemon.db, tmp
    finally:
        daemon.stop()


def _stored_out_of_order(db) -> bool:
    """Whether the store holds some microbatch's fwd records in another order than captured
    (what makes this test meaningful: without capture numbers the order would be wrong)."""
    import sqlite3

    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT r.rank, r.microbatch, s.name, r.record_id, r.capture_order FROM records r"
            " JOIN sites s ON s.site_id = r.site_id JOIN runs u ON u.run_id = r.run_id"
            " WHERE u.name = 'bug' AND r.phase = 1").fetchall()
    groups: dict = {}
    for rank, mb, site, rid, order in rows:
        groups.setdefault((rank, mb), []).append((rid, order, site))
    return any([s for _, _, s in sorted(g)] != [s for _, _, s in sorted(g, key=lambda x: x[1])]
               for g in groups.values())


def test_the_clean_pair_passes(store):
    db, _ = store
    code, report = compare_json(db, "ref", "ddp")
    assert (code, report["summary"]["breaches"]) == (0, 0), report["summary"]
    fwd = [f for f in report["findings"] if f["key"]["phase"] == "fwd"]
    assert len(fwd) == 2 * len(FORWARD)  # every module of both microbatches compared
    assert not [w for w in report["warnings"] if "approximated" in w]


def test_a_bug_in_the_first_layernorm_on_one_rank_is_found_there(store):
    db, tmp = store
    assert _stored_out_of_order(db)
    html = tmp / "bug.html"
    code, report = compare_json(db, "ref", "bug", "--html-output", str(html))
    assert code == 1
    first = report["first_divergence"]
    assert (first["key"]["phase"], first["key"]["site"], first["key"]["step"],
            first["key"]["microbatch"]) == ("fwd", "blocks.0.ln1", 0, 0), first["key"]
    pieces = first["pieces"]
    assert pieces["side"] == "cand" and pieces["differ_count"] == 1, pieces
    assert [d["ranks"] for d in pieces["differ"]] == [[1]], pieces
    # the modules before it in execution order are identical
    before = [f for f in report["findings"] if f["key"]["phase"] == "fwd"
              and f["key"]["microbatch"] == 0 and f["order"] < first["order"]]
    assert {f["key"]["site"] for f in before} == {"emb"}
    assert all(f["verdict"] == "identical" for f in before)
    blob = re.search(r'<script type="application/json" id="numaudit-data">(.*?)</script>',
                     html.read_text(), re.S).group(1)
    rows = next(h["rows"] for h in json.loads(blob)["heatmaps"] if h["phase"] == "fwd")
    assert rows == FORWARD
    cause = first["cause"]
    assert cause["kind"] == "introduced" and "fwd emb output @ step 0 mb 0" in cause["reason"]
