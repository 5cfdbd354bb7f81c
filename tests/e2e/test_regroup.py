"""Runs whose steps group the same samples into other microbatches (issue 29): gradient
accumulation against one large batch, and DDP ranks with local microbatches against one process
(tests/e2e/group_job.py). Clean pairs pass the fp32 preset with every activation, activation
gradient and loss compared; planted bugs are first found where they were planted; samples that
cannot be regrouped never pass; keys without payloads are identical when their bits agree
(fingerprints move with the pieces) and otherwise never pass."""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, compare_json, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = ROOT / "tests" / "e2e" / "group_job.py"



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("regroup")
    daemon = Daemon(tmp)
    try:
        env = dict(os.environ, NUMAUDIT_ADDR=daemon.address, NUMAUDIT_PHASES="fwd,bwd,grad,loss",
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        for var in ("NUMAUDIT_RUN", "NUMAUDIT_RENAME_IF_TAKEN", "NUMAUDIT_PAYLOAD_MAX_BYTES"):
            env.pop(var, None)
        single = dict(env, WORLD_SIZE="1")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(run_ok, [sys.executable, str(JOB), "acc1:acc1", "acc4:acc4",
                                       "acc4_bug:acc4_bug", "shuffled:shuffled"], single),
                    pool.submit(run_ok, [sys.executable, str(JOB), "acc4:acc4_nopay"],
                                dict(single, NUMAUDIT_PAYLOAD_MAX_BYTES="0"))]
            run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node=2", str(JOB), "ddp_local:ddp_local",
                  "ddp_local_bug:ddp_local_bug", "ddp_rr:ddp_rr", "ddp_rr1:ddp_rr1",
                    "ddp_rr_bug:ddp_rr_bug"], env)
            for job in jobs:
                job.result()
        yield daemon.db
    finally:
        daemon.stop()



def _phases(report: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in report["findings"]:
        out[f["key"]["phase"]] = out.get(f["key"]["phase"], 0) + 1
    return out


@pytest.mark.parametrize("cand, grouping", [
    ("acc4", "acc1 groups the step's 16 samples as 1 microbatch of 16, acc4 as 4 microbatches of 4"),
    ("ddp_local", "acc1 groups the step's 16 samples as 1 microbatch of 16, ddp_local as 2 "
                  "microbatches of 8")])
def test_accumulation_and_local_microbatches_compare_with_one_batch(store, cand, grouping):
    """Every activation, activation gradient and loss of the candidate is rebuilt into the
    reference's one microbatch and compared, and the report says how the runs group samples."""
    code, report = compare_json(store, "acc1", cand)
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    v = summary["verdicts"]
    assert v["missing_in_ref"] == v["missing_in_cand"] == 0, v
    # 2 steps x (10 modules fwd + 10 bwd + the loss) + 15 parameter gradients a step
    assert _phases(report) == {"fwd": 20, "bwd": 20, "loss": 2, "grad": 30}
    assert all(f["key"]["microbatch"] in (0, -1) for f in report["findings"])
    warnings = " ".join(report["warnings"])
    assert grouping in warnings and "samples aligned by the rows of fwd tok" in warnings


@pytest.mark.parametrize("cand, site, rank", [("acc4_bug", "layers.1", 0),
                                               ("ddp_local_bug", "layers.0", 1)])
def test_a_bug_in_one_microbatch_is_found_where_it_was_planted(store, cand, site, rank):
    """The module that adds 1e-3 in one (local) microbatch is the first divergence, introduced
    there, and the rank and the rows of the reference's batch it changed are named."""
    code, report = compare_json(store, "acc1", cand)
    first = report["first_divergence"]
    assert code == 1 and first["verdict"] == "diverged", first
    assert (first["key"]["site"], first["key"]["phase"], first["key"]["step"]) == (site, "fwd", 0)
    assert first["cause"]["kind"] == "introduced"
    pieces = first["pieces"]
    assert (pieces["method"], pieces["differ_count"]) == ("payload", 1), pieces
    differing = pieces["differ"][0]
    assert differing["ranks"] == [rank], pieces
    # acc4_bug's microbatch 2 = rows 8..11; ddp_local_bug's rank 1, local microbatch 1 = 12..15
    assert differing["box"].startswith("[8:12," if cand == "acc4_bug" else "[12:16,"), pieces


def test_regrouped_keys_without_payloads_are_identical_or_never_pass(store):
    """Without the bytes, a re-keyed piece keeps its fingerprint (moved to its new place) but not
    its sketch: step 0, bitwise equal in both groupings, is identical key for key; at step 1
    the weights differ by the accumulation's rounding, and each key whose bits differ breaches
    as uncertain instead of passing on moments."""
    code, report = compare_json(store, "acc1", "acc4_nopay")
    summary = report["summary"]
    assert code == 1 and summary["uncertain"] > 0, summary
    batch = [f for f in report["findings"] if f["key"]["phase"] in ("fwd", "bwd")]
    assert all(f["verdict"] == "identical" for f in batch if f["key"]["step"] == 0), [
        f["key"] for f in batch if f["key"]["step"] == 0 and f["verdict"] != "identical"]
    assert len([f for f in batch if f["key"]["step"] == 0]) == 20
    assert all(f["verdict"] == "identical" or (f["breach"] and f["uncertain"]) for f in batch)
    assert "re-keyed pieces took their fingerprints along" in " ".join(report["warnings"])


@pytest.mark.parametrize("cand, grouping", [
    ("ddp_rr", "acc1 groups the step's 16 samples as 1 microbatch of 16, ddp_rr as 2 "
               "microbatches of 8"),
    ("ddp_rr1", "acc1 groups the step's 16 samples as 1 microbatch of 16, ddp_rr1 as 1 "
                "microbatch of 16")])
def test_samples_dealt_round_robin_are_compared_sample_by_sample(store, cand, grouping):
    """DistributedSampler's dealing puts sequences 0, 2, 4, ... on rank 0: no piece holds
    consecutive samples of the reference's batch, so both runs are re-keyed into the whole step
    in their own orders and each row is compared with the reference's row of the same sample;
    the clean pair passes with every activation compared, whether or not the groupings differ."""
    code, report = compare_json(store, "acc1", cand)
    summary = report["summary"]
    assert (code, summary["breaches"]) == (0, 0), summary
    v = summary["verdicts"]
    assert v["missing_in_ref"] == v["missing_in_cand"] == 0, v
    assert _phases(report) == {"fwd": 20, "bwd": 20, "loss": 2, "grad": 30}
    warnings = " ".join(report["warnings"])
    assert grouping in warnings, warnings
    assert f"{cand}'s 2 dp ranks were dealt the samples in turn" in warnings


def test_a_bug_on_a_round_robin_rank_is_found_at_its_rows(store):
    """Rank 1's layers.1 adds 1e-3 in its local microbatch 0 of step 0: its samples 1, 3, 5, 7
    of the step; the first divergence is there, introduced, on rank 1's piece only."""
    code, report = compare_json(store, "acc1", "ddp_rr_bug")
    first = report["first_divergence"]
    assert code == 1 and first["verdict"] == "diverged", first
    assert (first["key"]["site"], first["key"]["phase"], first["key"]["step"]) == (
        "layers.1", "fwd", 0)
    assert first["cause"]["kind"] == "introduced", first["cause"]
    assert [d["ranks"] for d in first["pieces"]["differ"]] == [[1]], first["pieces"]


def test_samples_in_an_order_no_sampler_deals_are_a_finding_said_as_such(store):
    """The same sequences fed in another order (reversed) are not re-aligned: the activations
    breach, and the report says the samples were reordered rather than leaving the user to
    guess from the first module that differs."""
    code, report = compare_json(store, "acc1", "shuffled")
    assert code == 1
    warnings = " ".join(report["warnings"])
    assert "shuffled holds acc1's samples in another order (16 of 16 moved" in warnings, warnings
    assert "compared as they are" in warnings
    assert report["summary"]["verdicts"]["diverged"] > 0
