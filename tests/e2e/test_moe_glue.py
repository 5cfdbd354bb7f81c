"""A mixture of experts written the ordinary way (tests/e2e/moe_glue_job.py: each expert its own
module, hooked by the agent like any other, nothing declared) on DDP-2 against one process
(issue 29): each rank routes its own tokens, so experts' rows differ per rank and some ranks
never call some experts. The clean pair passes the fp32 preset with every expert compared, and
a bug in one expert on one rank is the first divergence, at that expert and rank."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, compare_json, job_env, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = ROOT / "tests" / "e2e" / "moe_glue_job.py"



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("moe_glue"))
    try:
        env = job_env(daemon)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ref = pool.submit(run_ok, [sys.executable, str(JOB), "ref:ref"],
                              dict(env, WORLD_SIZE="1"))
            run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", str(JOB), "ddp:ddp", "ddp_bug:ddp_bug",
                    "ddp_nopay:ddp_nopay", "ddp_bug_nopay:ddp_bug_nopay"], env)
            ref.result()
        yield daemon.db
    finally:
        daemon.stop()



def test_experts_with_rows_differing_per_rank_compare_without_a_declaration(store):
    code, report = compare_json(store, "ref", "ddp")
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    v = summary["verdicts"]
    assert v["incomplete"] == v["missing_in_ref"] == v["missing_in_cand"] == 0, v
    experts = {f["key"]["site"] for f in report["findings"]
               if f["key"]["phase"] == "fwd" and ".experts." in f["key"]["site"]}
    assert len(experts) >= 4, experts  # most experts got tokens, each compared
    assert any("hold different row counts on their dp ranks" in w for w in report["warnings"])


def test_a_bug_in_one_expert_on_one_rank_is_found_there(store):
    from tests.e2e.moe_glue_job import BUG_EXPERT

    code, report = compare_json(store, "ref", "ddp_bug")
    first = report["first_divergence"]
    assert code == 1 and first["verdict"] == "diverged", first
    assert (first["key"]["site"], first["key"]["phase"]) == (f"moe.experts.{BUG_EXPERT}", "fwd")
    assert first["cause"]["kind"] == "introduced", first["cause"]
    pieces = first["pieces"]
    assert [d["ranks"] for d in pieces["differ"]] == [[1]], pieces


def _by_key(report: dict) -> dict:
    return {(k["phase"], k["site"], k["role"], k["step"], k["microbatch"]): f
            for f in report["findings"] for k in [f["key"]]}


def test_without_payloads_experts_are_judged_by_their_moved_fingerprints(store):
    """No bytes at all: each rank's expert rows are placed after the ranks before it and their
    fingerprints moved there. Every key the run with payloads finds bitwise equal is identical
    here too; activation gradients that are exactly the reference's x2 (the dp size) are said
    so from the fingerprints; and a key whose bits differ (an expert's matmul over other row
    counts) has nothing to measure it by, so it breaches as uncertain, never passes."""
    _, with_bytes = compare_json(store, "ref", "ddp")
    code, report = compare_json(store, "ref", "ddp_nopay")
    paid, bare = _by_key(with_bytes), _by_key(report)
    assert paid.keys() == bare.keys()
    for key, f in paid.items():
        if f["verdict"] == "identical":
            assert bare[key]["verdict"] == "identical", (key, bare[key])
    identical = {k[1] for k, f in bare.items()
                 if k[0] == "fwd" and ".experts." in k[1] and f["verdict"] == "identical"}
    assert len(identical) >= 4, identical
    scaled = [k for k, f in bare.items() if k[0] == "bwd" and f["verdict"] == "close"
              and any(n.startswith("bit for bit the reference x2") for n in f["notes"])]
    assert len(scaled) >= 4, scaled
    for key, f in bare.items():
        if f["breach"]:  # only moved expert keys, only uncertain, only where bits differ
            assert f["uncertain"] and ".experts." in key[1] and key[0] in ("fwd", "bwd"), f
            assert paid[key]["verdict"] == "close", paid[key]
    assert code == (1 if report["summary"]["breaches"] else 0)
    assert any("their fingerprints moved with them" in w for w in report["warnings"])


def test_without_payloads_a_bug_in_one_expert_is_a_certain_breach_there(store):
    """The planted change moves the expert's moments far past the threshold: without bytes or
    sketch it is still a certain breach, introduced at that expert. Keys before it that breach
    are only the uncertain ones (bits differ, nothing to measure by how much)."""
    from tests.e2e.moe_glue_job import BUG_EXPERT

    code, report = compare_json(store, "ref", "ddp_bug_nopay")
    assert code == 1
    certain = [f for f in report["findings"] if f["breach"] and not f["uncertain"]]
    bug = [f for f in certain if (f["key"]["site"], f["key"]["phase"]) ==
           (f"moe.experts.{BUG_EXPERT}", "fwd")]
    assert bug and bug[0]["cause"]["kind"] == "introduced", bug
    assert min(f["key"]["step"] for f in certain) == bug[0]["key"]["step"]
