"""Issue 11 end to end: expert activations as ragged pieces, one process vs DDP-2 vs EP-2.

`examples/tiny_moe.py` (a small MoE of its own, 8 experts, top-2, 6 tokens per rank, so most
experts get no tokens on some rank) runs once per configuration against one `auditor serve`:
a single process (the reference), DDP on 2 ranks, expert parallel on 2 ranks (all-to-all), expert
parallel with a routing bug in layer 2, and expert parallel whose experts' gradients are wrongly
summed over the ranks. The four 2-rank runs are one torchrun job (tests/e2e/moe_job.py runs them
one after another, each its own run name and agent), which spares three job start-ups. Every run
runs backward (`--backward`: autograd-aware all-to-alls) and captures every expert's input and
output rows and the gradients reaching them (grad_input, grad_output) as ragged pieces, and every
parameter's gradient; `auditor compare --preset fp32` must pass the clean pairs (expert parallel
bitwise wherever no sum over ranks is involved), put the routing bug in layer 2 and the reduction
bug at the experts' parameter gradients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .helpers import ROOT, Daemon

JOB = ROOT / "tests" / "e2e" / "moe_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BUG_LAYER = 2


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    daemon = Daemon(tmp)
    env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    try:
        # The single process (the reference) runs beside the 2-rank job: other run names, the
        # same daemon, and a core that job's start-up leaves free.
        single = subprocess.Popen([sys.executable, str(ROOT / "examples" / "tiny_moe.py"),
                                   "--name", "single", "--backward"], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            runs = ["ddp --backward", "ep --ep --backward",
                    f"ep_bug --ep --backward --skip-renorm-layer {BUG_LAYER}",
                    "ep_grad_bug --ep --backward --sum-expert-grads"]
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node=2", str(JOB), *runs], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
            _, err = single.communicate(timeout=120)
            assert single.returncode == 0, err[-3000:]
        finally:
            if single.poll() is None:
                single.kill()
                single.communicate()
    finally:
        assert daemon.stop() == 0
    return daemon.db, tmp


def compare(db, tmp, ref: str, cand: str) -> tuple[int, dict]:
    out = tmp / f"{ref}-{cand}.json"
    rc = subprocess.call([sys.executable, "-m", "numaudit.auditor", "compare", ref, cand,
                          "--db", str(db), "--preset", "fp32", "--format", "json", "-o", str(out)],
                         cwd=ROOT)
    return rc, json.loads(out.read_text())


def expert_findings(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["key"]["site"].endswith(".experts")]


@pytest.mark.parametrize("cand", ["ddp", "ep"])
def test_clean_pairs_pass_with_every_expert_captured(moe_store, cand):
    db, tmp = moe_store
    rc, report = compare(db, tmp, "single", cand)
    bad = [(f["key"], f["verdict"], f.get("message")) for f in report["findings"]
           if f["verdict"] not in ("identical", "close")]
    assert rc == 0 and not bad, bad
    experts = expert_findings(report)
    # 4 layers x 8 experts x (input, output, grad_input, grad_output), all present in both runs
    assert len(experts) == 4 * 8 * 4
    assert {(f["key"]["phase"], f["key"]["role"]) for f in experts} == {
        ("fwd", "input"), ("fwd", "output"), ("bwd", "grad_input"), ("bwd", "grad_output")}
    assert report["first_divergence"] is None
    if cand == "ep":  # each expert's rows meet in one piece, in the reference's order: bitwise
        assert all(f["verdict"] == "identical" for f in experts)
        expert_grads = [f for f in report["findings"] if f["key"]["phase"] == "grad"
                        and ".experts." in f["key"]["site"]]
        assert len(expert_grads) == 4 * 8 * 4  # up/down weight and bias of every expert
        assert all(f["verdict"] == "identical" for f in expert_grads)


def test_some_experts_have_no_tokens_on_some_rank(moe_store):
    """The clean pairs above include zero-row pieces next to non-empty ones (and empty experts)."""
    from numaudit.auditor.store import RECORD_COLUMNS, Reader

    db, _ = moe_store
    col = {c: i for i, c in enumerate(RECORD_COLUMNS)}
    reader = Reader(db)
    try:
        rows: dict[tuple, list[int]] = {}
        for r in reader.records("ddp"):
            if r[col["site"]].endswith(".experts") and r[col["ragged_parts"]] == 2:
                rows.setdefault((r[col["site"]], r[col["role"]], r[col["idx"]]), []).append(
                    json.loads(r[col["shape"]])[0])
    finally:
        reader.close()
    # input, output and the gradients reaching them (grad_input, grad_output)
    assert len(rows) == 4 * 8 * 4 and all(len(v) == 2 for v in rows.values())
    assert any(0 in v and sum(v) > 0 for v in rows.values())


def test_routing_bug_is_localized_to_its_layer(moe_store):
    db, tmp = moe_store
    rc, report = compare(db, tmp, "single", "ep_bug")
    assert rc == 1
    first = report["first_divergence"]
    assert first["key"]["site"].startswith(f"layers.{BUG_LAYER}."), first["key"]
    assert first["cause"]["kind"] == "introduced"
    assert first["key"]["phase"] == "fwd"
    # forward: nothing before the layer breaches (backward carries the difference upstream)
    breaching = {f["key"]["site"] for f in report["findings"]
                 if f["breach"] and f["key"]["phase"] == "fwd"}
    assert not any(s.startswith(tuple(f"layers.{i}." for i in range(BUG_LAYER)))
                   or s in {f"layers.{i}" for i in range(BUG_LAYER)} for s in breaching)


def test_expert_gradients_summed_over_ranks_breach_at_the_expert_parameters(moe_store):
    """Activations and activation gradients are untouched by the bug: only the experts'
    parameter gradients differ, and the cause says the difference arises in the reduction."""
    db, tmp = moe_store
    rc, report = compare(db, tmp, "single", "ep_grad_bug")
    assert rc == 1
    first = report["first_divergence"]
    assert first["key"]["phase"] == "grad" and ".experts." in first["key"]["site"], first["key"]
    assert first["cause"]["kind"] == "introduced"
    assert "gradient reduction" in first["cause"]["reason"], first["cause"]["reason"]
    breaching = [f for f in report["findings"] if f["breach"]]
    assert all(f["key"]["phase"] == "grad" and ".experts." in f["key"]["site"]
               for f in breaching)
