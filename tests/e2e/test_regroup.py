"""Runs whose steps group the same samples into other microbatches (issues 29, 37): gradient
accumulation against one large batch, and DDP ranks with local microbatches against one process
(tests/e2e/group_job.py). Clean pairs pass the fp32 preset with every activation, activation
gradient and loss compared; planted bugs are first found where they were planted; samples that
cannot be regrouped never pass; keys without payloads are identical when their bits agree
(fingerprints move with the pieces), measured from per-sample digests when they differ, and
never pass without either; a declared grad_scale follows the re-keying."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest

from tests.e2e.helpers import ROOT, Daemon, compare_json, job_env, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = ROOT / "tests" / "e2e" / "group_job.py"



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("regroup")
    daemon = Daemon(tmp)
    try:
        env = job_env(daemon)
        single = dict(env, WORLD_SIZE="1")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            jobs = [pool.submit(run_ok, [sys.executable, str(JOB), "acc1:acc1", "acc4:acc4",
                                       "acc4_bug:acc4_bug", "shuffled:shuffled",
                                       "acc4_declared:acc4_declared", "wide_acc1:wide1",
                                       "wide_acc4:wide4", "wide_acc4_scaled:wide4_scaled",
                                       "wide_acc4_old:wide4_old"], single),
                    pool.submit(run_ok, [sys.executable, str(JOB), "acc4:acc4_nopay"],
                                dict(single, NUMAUDIT_PAYLOAD_MAX_BYTES="0"))]
            run_ok([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node=2", str(JOB), "ddp_local:ddp_local",
                  "ddp_local_bug:ddp_local_bug", "ddp_rr:ddp_rr", "ddp_rr1:ddp_rr1",
                    "ddp_rr_bug:ddp_rr_bug", "wide_ddp_local:wide_ddp",
                    "wide_ddp_local_bug:wide_ddp_bug"], env)
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
    ("acc4", "acc1 groups the step's 16 samples as 1 microbatch of 16, acc4 as 4 "
             "microbatches of 4"),
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


def _batch_keys(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["key"]["phase"] in ("fwd", "bwd")]


SAMPLED = "measured from per-sample digests"


@pytest.mark.parametrize("ref, cand, preset", [("acc1", "acc4_nopay", "fp32"),
                                               ("wide1", "wide4", "fp32"),
                                               ("wide1", "wide4", "bf16"),
                                               ("wide1", "wide_ddp", "fp32")])
def test_regrouped_keys_without_payloads_are_measured_from_per_sample_digests(store, ref, cand,
                                                                              preset):
    """Without the bytes, a re-keyed piece keeps its fingerprint (moved to its new place) but not
    its sketch: step 0, bitwise equal in both groupings, is identical key for key (DDP's
    activation gradients, scaled by its dp size, are compared after the scale); at step 1
    the weights differ by the accumulation's rounding, most keys' bits differ, and each of those
    is measured from both runs' per-sample digests, within policy: 4 accumulated microbatches of
    4 with payloads switched off, and of 2 whose activations are all over the 16 KiB of
    automatic payloads, and DDP-2 ranks with local microbatches of 2 (their samples aligned by
    the per-sample digests of the first activation: no payload to align them by), against one
    batch."""
    if cand == "wide_ddp":
        warnings = " ".join(compare_json(store, ref, cand)[1]["warnings"])
        assert "samples aligned by the per-sample digests of fwd tok" in warnings, warnings
    code, report = compare_json(store, ref, cand, preset=preset)
    assert (code, report["summary"]["breaches"]) == (0, 0), report["summary"]
    batch = _batch_keys(report)
    assert len(batch) == 40
    assert all(f["verdict"] == "identical" for f in batch if f["key"]["step"] == 0
               and (f["key"]["phase"] == "fwd" or cand != "wide_ddp"))
    later = [f for f in batch if f["key"]["step"] == 1]
    measured = [f for f in later if f["verdict"] == "close"]
    assert all(f["verdict"] in ("identical", "close") and not f["uncertain"] for f in later)
    assert len(measured) >= 15, [(f["key"]["site"], f["verdict"]) for f in later]
    assert all(any(SAMPLED in n for n in f["notes"]) and not f["metrics"].get("payload")
               for f in measured), [f["notes"] for f in measured]
    assert "re-keyed pieces took their fingerprints along" in " ".join(report["warnings"])


def test_a_one_percent_scale_is_found_at_its_module_without_payloads(store):
    """layers.1 scales its output by 1.01 in microbatch 2 of 4 (samples 4-5 of 8): measured from
    per-sample digests, the first divergence is there, introduced, under the fp32 preset, and
    the same digests tell the microbatch that differs from those that agree."""
    code, report = compare_json(store, "wide1", "wide4_scaled")
    first = report["first_divergence"]
    assert code == 1 and first["verdict"] == "diverged" and not first["uncertain"], first
    assert (first["key"]["site"], first["key"]["phase"], first["key"]["step"]) == (
        "layers.1", "fwd", 0)
    assert first["cause"]["kind"] == "introduced", first["cause"]
    assert any(SAMPLED in n for n in first["notes"]) and 0.003 < first["value"] < 0.01, first
    pieces = first["pieces"]  # microbatch 2 of 2 samples: rows 4-5 of the reference's batch
    assert (pieces["method"], pieces["differ_count"], pieces["agree"]) == ("samples", 1, 3)
    assert pieces["differ"][0]["box"].startswith("[4:6,"), pieces


def test_without_per_sample_digests_keys_whose_bits_differ_never_pass(store):
    """An agent of an earlier build sent no per-sample digests: each key whose bits differ
    breaches as uncertain instead of passing on moments (bitwise-equal ones stay identical)."""
    code, report = compare_json(store, "wide1", "wide4_old")
    assert code == 1 and report["summary"]["uncertain"] > 0, report["summary"]
    batch = _batch_keys(report)
    assert all(f["verdict"] == "identical" for f in batch if f["key"]["step"] == 0)
    assert all(f["verdict"] == "identical" or (f["breach"] and f["uncertain"]) for f in batch)


def test_a_declared_grad_scale_follows_the_re_keying(store):
    """acc4 divides its loss by its 4 accumulation steps and declares grad_scale=1/4 (relative
    to a mean over its own microbatch of 4, docs/parallelisms.md): re-keyed into acc1's
    microbatch of 16 the scale is 1/4 x 16/4 = 1, and every activation gradient passes."""
    code, report = compare_json(store, "acc1", "acc4_declared")
    assert (code, report["summary"]["breaches"]) == (0, 0), report["summary"]
    assert _phases(report) == {"fwd": 20, "bwd": 20, "loss": 2, "grad": 30}
    warnings = " ".join(report["warnings"])
    assert "its declared gradient scale x0.25 (declared: grad_scale) is relative to its own " \
           "microbatches of 4 samples; re-keyed into microbatches of 16 it is x1" in warnings


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


def test_a_bug_on_one_rank_is_found_there_without_payloads(store):
    """DDP-2 with local microbatches of 2 against one batch of 8, every activation over 16 KiB:
    rank 1's layers.0 adds 1e-3 in its local microbatch 1 (samples 6-7 of the step): the first
    divergence is there, introduced, on rank 1's piece only (by samples)."""
    code, report = compare_json(store, "wide1", "wide_ddp_bug")
    first = report["first_divergence"]
    assert code == 1 and first["verdict"] == "diverged", first
    assert (first["key"]["site"], first["key"]["phase"], first["key"]["step"]) == (
        "layers.0", "fwd", 0)
    assert first["cause"]["kind"] == "introduced", first["cause"]
    pieces = first["pieces"]
    assert pieces["method"] == "samples" and [d["ranks"] for d in pieces["differ"]] == [[1]]
    assert pieces["differ"][0]["box"].startswith("[6:8,"), pieces
