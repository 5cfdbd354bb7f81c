"""The comparison engine on synthetic pairs of runs written through the real ingest path.

Every run here is made of real tensors, digested by the agent's code, stored by StoreWriter into
a SQLite file; each pair carries one known difference (issue 3, "Tests that must exist").
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.live import LiveComparison
from numaudit.auditor.compare.policy.load import parse_policy, preset_policy
from numaudit.auditor.report.text import to_text
from numaudit.auditor.store import Reader, UnknownRun
from tests.auditor.synth import RunBuilder, mlp_run, one_ulp, shards, write_runs


def _by_verdict(report, verdict):
    return [f for f in report.findings() if f.verdict == verdict]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


def test_different_shardings_of_identical_tensors_are_identical(db):
    write_runs(db, mlp_run("ref", world=1), mlp_run("dp4", world=4), mlp_run("dp3", world=3))
    for cand in ("dp4", "dp3"):  # 8 rows over 3 ranks: uneven shards
        report = compare_runs(db, "ref", cand, preset_policy("bitwise"))
        assert report.exit_code == 0
        assert set(report.counts[v] for v in ("close", "diverged", "incomplete")) == {0}
        assert report.counts["identical"] == len(report.comparison)
        assert report.first is None


def test_comparing_a_run_with_itself_is_all_identical(db):
    write_runs(db, mlp_run("ref", world=2, steps=2, payload=True))
    report = compare_runs(db, "ref", "ref", preset_policy("bitwise"))
    assert report.exit_code == 0
    assert report.counts["identical"] == len(report.comparison) > 0


def _ulp_at_layer1_mb1(kind, step, mb, site, t):
    return one_ulp(t, 5) if (kind, site, mb) == ("fwd", "layers.1", 1) else t


def test_one_ulp_breaches_bitwise_but_passes_fp32(db):
    write_runs(db, mlp_run("ref"), mlp_run("ulp", world=2, perturb=_ulp_at_layer1_mb1))
    exact = compare_runs(db, "ref", "ulp", preset_policy("bitwise"))
    assert exact.exit_code == 1
    first = exact.first
    assert (first.key.phase, first.key.site, first.key.microbatch) == ("fwd", "layers.1", 1)
    assert first.verdict == "diverged" and first.metric == "exact"
    assert first.cause.kind == "introduced"
    fp32 = compare_runs(db, "ref", "ulp", preset_policy("fp32"))
    assert fp32.exit_code == 0
    close = _by_verdict(fp32, "close")
    assert {f.key.site for f in close} == {"layers.1", "layers.2", "loss"} or \
        {f.key.site for f in close} >= {"layers.1"}
    f = next(f for f in close if f.key.site == "layers.1")
    # one element moved by one ulp: a relative L2 error around 1e-8, far below 1.3e-6
    assert 0 < f.value < 1e-6 < f.threshold
    assert f.metrics["exact"] is False


def test_scaled_gradient_diverges_and_is_introduced_by_reduction(db):
    def scale(kind, step, mb, site, t):
        return t * 1.01 if (kind, site) == ("grad", "layers.1.weight") else t

    write_runs(db, mlp_run("ref", world=2), mlp_run("scaled", world=4, perturb=scale))
    report = compare_runs(db, "ref", "scaled")
    assert report.exit_code == 1
    [f] = [f for f in report.findings(breaches_only=True)]
    assert (f.key.phase, f.key.site, f.verdict) == ("grad", "layers.1.weight", "diverged")
    assert f.value == pytest.approx(0.01, rel=0.2)
    assert not f.uncertain
    assert report.first.key == f.key
    assert f.cause.kind == "introduced" and "accumulation" in f.cause.reason
    assert f.ranks == {"ref": [0, 1], "cand": [0, 1, 2, 3]}


def test_swapped_microbatches_diverge_at_that_microbatch(db):
    ref = mlp_run("ref", microbatches=4)
    cand = mlp_run("swap", microbatches=4, world=2)
    # exchange microbatches 1 and 2 of the candidate (every record of them)
    for recs in cand.records.values():
        for r in recs:
            if r.key.microbatch in (1, 2):
                r.key.microbatch = 3 - r.key.microbatch
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "swap")
    assert report.exit_code == 1
    first = report.first
    assert (first.key.step, first.key.microbatch, first.key.phase) == (0, 1, "input")
    assert first.cause.kind == "introduced"
    bad_mbs = {f.key.microbatch for f in report.findings(breaches_only=True)}
    assert bad_mbs == {1, 2}


def _pipeline_runs(db: Path, *, stage1_grads_none: bool = False,
                   stage0_grads_none: bool = False, with_bwd: bool = True) -> None:
    """ref: 2 dp ranks, no pipeline; cand: 2 stages x 2 dp ranks, layers 0-1 | 2-3."""
    g = torch.Generator().manual_seed(3)
    weights = {f"layers.{i}.weight": torch.randn(4, 6, generator=g) for i in range(4)}
    grads = {k: torch.randn(4, 6, generator=g) for k in weights}
    acts = {i: torch.randn(8, 6, generator=g) for i in range(4)}
    ref = RunBuilder("ref", world_size=2)
    cand = RunBuilder("pp", world_size=4, stages={0: [0], 1: [0], 2: [1], 3: [1]})
    for i, h in acts.items():
        ref.add_sharded(h, [0, 1], step=0, microbatch=0, phase="fwd", site=f"layers.{i}")
        if with_bwd:
            ref.add_sharded(h * 2, [0, 1], step=0, microbatch=0, phase="bwd",
                            site=f"layers.{i}", role="grad_output")
        stage = 0 if i < 2 else 1
        ranks = [0, 1] if stage == 0 else [2, 3]
        cand.add_sharded(h, ranks, step=0, microbatch=0, phase="fwd", site=f"layers.{i}",
                         stage=stage)
        if with_bwd:
            cand.add_sharded(h * 2, ranks, step=0, microbatch=0, phase="bwd",
                             site=f"layers.{i}", role="grad_output", stage=stage)
    for name, gr in grads.items():
        i = int(name.split(".")[1])
        ref.add_sharded(gr, [0, 1], step=0, microbatch=-1, phase="grad", site=name, role="value")
        stage = 0 if i < 2 else 1
        ranks = [0, 1] if stage == 0 else [2, 3]
        if (stage == 1 and stage1_grads_none) or (stage == 0 and stage0_grads_none):
            for r in ranks:
                cand.add_none(r, step=0, site=name, stage=stage)
        else:
            cand.add_sharded(gr, ranks, step=0, microbatch=-1, phase="grad", site=name,
                             role="value", stage=stage)
    write_runs(db, ref, cand)


def test_missing_stage_gradients_are_one_grouped_graph_break(db):
    _pipeline_runs(db, stage1_grads_none=True)
    report = compare_runs(db, "ref", "pp")
    assert report.exit_code == 1
    none = _by_verdict(report, "grad_none")
    assert {f.key.site for f in none} == {"layers.2.weight", "layers.3.weight"}
    assert all(f.stage == 1 and f.ranks["cand"] == [2, 3] for f in none)
    [gb] = report.graph_breaks
    assert (gb.side, gb.kind, gb.scope, gb.stage, gb.params) == ("cand", "none", "stage", 1, 2)
    assert "stage 1: all 2 parameter gradients are None in pp" in gb.message
    # stage 1's input activation (layers.2) had its backward captured
    assert gb.boundary.startswith("gradients stop at stage 1 (the first without parameter "
                                  "gradients in pp): the backward of its input activation "
                                  "(layers.2) was captured")
    text = to_text(report, width=120)
    assert "Backward-graph breaks" in text and gb.message in text
    assert ("2 parameter gradients of step 0, stage 1: grad_none (None in pp) (the first "
            "divergence is its first), summarized under backward-graph breaks") in " ".join(
                text.split())
    assert "2 grad_none, summarized under backward-graph breaks" in to_text(report, width=120,
                                                                            verbose=True)


def test_a_break_inside_the_pipeline_names_the_stage_boundary(db):
    """Stage 0 without gradients while stage 1 has them: the cut is at the 0 -> 1 boundary."""
    _pipeline_runs(db, stage0_grads_none=True)
    [gb] = compare_runs(db, "ref", "pp").graph_breaks
    assert gb.stage == 0
    assert gb.boundary.startswith("gradients stop at stage 0 (the first without parameter "
                                  "gradients in pp), at the stage 0 -> 1 boundary (stage 1's "
                                  "parameters received gradients)")


def test_without_bwd_captures_the_boundary_does_not_guess(db):
    _pipeline_runs(db, stage1_grads_none=True, with_bwd=False)
    [gb] = compare_runs(db, "ref", "pp").graph_breaks
    assert "captured no activation gradients (phase bwd)" in gb.boundary
    assert "never reached" not in gb.boundary


def test_all_zero_gradients_in_one_run_are_reported(db):
    def zero(kind, step, mb, site, t):
        return torch.zeros_like(t) if (kind, site) == ("grad", "layers.2.weight") else t

    write_runs(db, mlp_run("ref", world=2), mlp_run("zero", world=2, perturb=zero))
    report = compare_runs(db, "ref", "zero")
    [f] = list(report.findings(breaches_only=True))
    assert (f.key.site, f.verdict) == ("layers.2.weight", "diverged")
    [gb] = report.graph_breaks
    assert (gb.side, gb.kind, gb.scope, gb.module) == ("cand", "zero", "module", "layers.2")
    assert "all zero in zero but not in ref" in gb.message


def test_pipeline_without_break_is_identical(db):
    _pipeline_runs(db, stage1_grads_none=False)
    report = compare_runs(db, "ref", "pp", preset_policy("bitwise"))
    assert report.exit_code == 0, to_text(report)
    assert {f.stage for f in report.findings()} == {0, 1}


def test_nan_is_nonfinite(db):
    def nan(kind, step, mb, site, t):
        if (kind, site, mb) == ("fwd", "layers.1", 0):
            t = t.clone()
            t[2, 3] = float("nan")
        return t

    write_runs(db, mlp_run("ref"), mlp_run("nan", world=2, perturb=nan))
    report = compare_runs(db, "ref", "nan")
    nonfinite = _by_verdict(report, "nonfinite")  # the NaN flows on into layers.2 and the loss
    assert {(f.key.site, f.key.microbatch) for f in nonfinite} == \
        {("layers.1", 0), ("layers.2", 0), ("loss", 0)}
    f = nonfinite[0]
    assert (f.key.site, f.key.microbatch) == ("layers.1", 0)
    assert f.breach and report.first.key == f.key and f.cause.kind == "introduced"
    assert nonfinite[1].cause.kind == "inherited"
    assert f.metrics["nonfinite"]["cand"]["nan"] == 1
    assert f.metrics["nonfinite"]["ref"]["nan"] == 0
    assert "1 NaN" in f.detail
    # a policy that allows non-finite values compares the finite parts instead
    allow = parse_policy('nonfinite = "allow"')
    rep2 = compare_runs(db, "ref", "nan", allow)
    assert not _by_verdict(rep2, "nonfinite")


def test_gap_in_shards_is_incomplete_and_names_ranks_and_region(db):
    t = torch.randn(8, 5)
    ref = RunBuilder("ref")
    ref.add_full(t, step=0, microbatch=0, phase="fwd", site="blk")
    cand = RunBuilder("gap", world_size=4)
    for r, (piece, lay) in enumerate(shards(t, 4)):
        if r != 2:
            cand.add(r, piece, lay, step=0, microbatch=0, phase="fwd", site="blk")
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "gap")
    [f] = report.findings()
    assert f.verdict == "incomplete" and f.breach
    assert "ranks 0-1, 3 cover 30 of 40 elements" in f.detail
    assert "within [4:6, 0:5]" in f.detail


def test_overlapping_shards_that_are_not_replicas_are_incomplete(db):
    t = torch.randn(4, 4)
    cand = RunBuilder("ovl", world_size=2)
    cand.add(0, t[:3], PieceLayout((4, 4), (0, 0), (3, 4)), step=0, microbatch=0, phase="fwd",
             site="blk")
    cand.add(1, t[1:], PieceLayout((4, 4), (1, 0), (3, 4)), step=0, microbatch=0, phase="fwd",
             site="blk")
    ref = RunBuilder("ref")
    ref.add_full(t, step=0, microbatch=0, phase="fwd", site="blk")
    write_runs(db, ref, cand)
    [f] = compare_runs(db, "ref", "ovl").findings()
    assert f.verdict == "incomplete" and "overlap" in f.detail and "ranks 0" in f.detail


def test_differing_replicas_are_replica_divergence(db):
    w = torch.randn(6, 3)
    bad = w.clone()
    bad[0, 0] += 1.0
    ref = RunBuilder("ref", world_size=2)
    ref.add_full(w, ranks=[0, 1], step=0, microbatch=-1, phase="param", site="w", role="value")
    cand = RunBuilder("rep", world_size=3)
    for r, t in ((0, w), (1, w), (2, bad)):
        cand.add(r, t, PieceLayout((6, 3), (0, 0), (6, 3), replica=True), step=0,
                 microbatch=-1, phase="param", site="w", role="value")
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "rep")
    [f] = report.findings()
    assert f.verdict == "replica_divergence" and f.breach
    assert "ranks 2 disagree with rank 0" in f.detail
    # within one run: the check needs no reference
    alone = compare_runs(db, "rep", "rep")
    assert [g.verdict for g in alone.findings()] == ["replica_divergence"]


def test_missing_keys_and_policy_expectations(db):
    ref = mlp_run("ref")
    cand = mlp_run("cand")
    cand.records[0] = [r for r in cand.records[0] if r.key.site != "layers.2"]
    extra = torch.ones(3)
    cand.add_full(extra, step=0, microbatch=0, phase="fwd", site="debug.probe")
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "cand")
    assert {f.key.site for f in _by_verdict(report, "missing_in_cand")} == {"layers.2"}
    assert {f.key.site for f in _by_verdict(report, "missing_in_ref")} == {"debug.probe"}
    policy = parse_policy("""
        [[rule]]
        match = "fwd:debug.*"
        action = "ignore"
        [[rule]]
        site = "layers.2"
        action = "expect_missing"
    """)
    report = compare_runs(db, "ref", "cand", policy)
    assert report.exit_code == 0
    assert report.counts["ignored"] == 1
    expected = _by_verdict(report, "missing_in_cand")
    assert expected and all(f.expected and not f.breach for f in expected)


def test_rename_rules_align_renamed_stage_modules(db):
    ref = mlp_run("ref")
    cand = mlp_run("cand")
    for recs in cand.records.values():
        for r in recs:
            if r.key.site.startswith("layers."):
                r.key.site = "stages.0." + r.key.site
    write_runs(db, ref, cand)
    assert compare_runs(db, "ref", "cand").counts["missing_in_ref"] > 0
    policy = parse_policy("""
        [[rename]]
        glob = "stages.*.layers.*"
        replace = "layers.\\\\2"
    """)
    report = compare_runs(db, "ref", "cand", policy)
    assert report.exit_code == 0, to_text(report)
    assert report.counts["identical"] == len(report.comparison)


def test_partial_sums_have_no_exact_comparison(db):
    t = torch.randn(4, 4, dtype=torch.float64)
    a = torch.randn(4, 4, dtype=torch.float64)
    ref = RunBuilder("ref")
    ref.add_full(t, step=0, microbatch=0, phase="fwd", site="mm")
    cand = RunBuilder("partial", world_size=2)
    for r, part in ((0, a), (1, t - a)):
        cand.add(r, part, PieceLayout((4, 4), (0, 0), (4, 4), partial=True), step=0,
                 microbatch=0, phase="fwd", site="mm")
    write_runs(db, ref, cand)
    [f] = compare_runs(db, "ref", "partial").findings()
    assert f.verdict == "close"
    assert f.metrics["exact"] is None and "Partial" in f.metrics["exact_unavailable"]
    assert f.value < 1e-12
    [g] = compare_runs(db, "ref", "partial", preset_policy("bitwise")).findings()
    assert g.verdict == "close" and any("exact comparison unavailable" in n for n in g.notes)


def test_fingerprints_made_with_other_seeds_are_never_compared(db):
    ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    x = torch.randn(3, 4)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b in (ref, cand):
        b.add_full(ids, step=0, microbatch=0, phase="input", site="tokens", role="value")
        b.add_full(x, step=0, microbatch=0, phase="fwd", site="embed")
    for r in cand.records[0]:
        r.digest.fingerprint_seed ^= 1  # as if another agent version had digested them
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "cand")
    by_site = {f.key.site: f for f in report.findings()}
    tokens, embed = by_site["tokens"], by_site["embed"]
    assert tokens.verdict == "diverged" and tokens.breach  # integers: nothing else to compare
    assert "different seeds" in tokens.notes[0]
    assert embed.verdict == "close" and embed.metrics["exact"] is None
    assert "other seeds" in embed.metrics["exact_unavailable"]


def test_sketch_relative_error_agrees_with_payload_exact(db):
    g = torch.Generator().manual_seed(7)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    ref.sketch_k = cand.sketch_k = 256
    scales = [1e-6, 1e-4, 1e-2, 0.3]
    for i, eps in enumerate(scales):
        t = torch.randn(64, 32, generator=g)
        d = torch.randn(64, 32, generator=g) * eps * t.norm() / math.sqrt(t.numel())
        ref.add_full(t, step=0, microbatch=0, phase="fwd", site=f"s{i}", payload=True)
        cand.add_full(t + d, step=0, microbatch=0, phase="fwd", site=f"s{i}", payload=True)
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "cand")
    comp = report.comparison
    seen = 0
    for i in range(len(comp)):
        if i not in comp.payload:
            continue
        exact = comp.payload[i]["rel_l2"]
        est, sigma = comp.rel_l2[i], comp.rel_sigma[i]
        assert abs(est - exact) <= 3 * sigma, (est, exact, sigma)
        assert sigma <= 0.1 * est  # k = 256: 1/sqrt(512) = 4.4% of the estimate
        seen += 1
    assert seen == len(scales)
    f = next(f for f in report.findings() if f.key.site == "s3")
    assert f.metrics["payload"]["max_abs"] > 0 and f.metrics["payload"]["ulp"] > 0
    assert f.metric == "rel_l2" and f.sigma is None  # decided on the exact value


def test_unknown_run_is_refused(db):
    write_runs(db, mlp_run("ref"))
    with pytest.raises(UnknownRun):
        compare_runs(db, "ref", "nope")


def test_live_comparison_reports_keys_as_they_complete(db):
    ref = mlp_run("ref", steps=2, world=2)
    write_runs(db, ref)
    # the candidate arrives in two parts: step 0 first, its sessions still open
    full = mlp_run("cand", steps=2, world=2, perturb=_ulp_at_layer1_mb1)
    part1 = RunBuilder("cand", world_size=2, close=False)
    part1.records = {r: [x for x in recs if x.key.step == 0] for r, recs in full.records.items()}
    part1.write(db)
    reader = Reader(db)
    try:
        live = LiveComparison(reader, "ref", "cand", preset_policy("bitwise"))
        events = live.poll()
        steps = {e.finding.key.step for e in events if e.finding}
        assert steps == {0}
        # every rank still open and not past step 0: replicated keys wait, shards are reported
        assert not any(e.first_divergence for e in events)
        assert not live.finished
        part2 = RunBuilder("cand", world_size=2)
        part2.records = {r: [x for x in recs if x.key.step == 1]
                         for r, recs in full.records.items()}
        part2.write(db)  # new sessions of the same ranks, closed
        events += live.poll() + live.flush()
    finally:
        reader.close()
    firsts = [e for e in events if e.first_divergence]
    assert len(firsts) == 1
    assert (firsts[0].finding.key.site, firsts[0].finding.key.microbatch) == ("layers.1", 1)
    keys = [e.finding.key for e in events if e.finding and not e.first_divergence]
    assert len(keys) == len(set(keys))
    total = compare_runs(db, "ref", "cand", preset_policy("bitwise"))
    assert len(keys) == len(list(total.findings()))


def test_digests_of_another_hash_scheme_never_pass(db):
    """A reference recorded by an agent with another hash scheme (version 1 seeds) against a
    candidate of this version: neither the fingerprint nor the sketch can compare, so even
    identical tensors are not reported within policy; the notes say why."""
    x = torch.randn(16, 8)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b in (ref, cand):
        b.add_full(x, step=0, microbatch=0, phase="fwd", site="embed")
    for r in ref.records[0]:
        r.digest.fingerprint_seed, r.digest.sketch_seed = 0x6E756D6175646974, 0x736B3031
    write_runs(db, ref, cand)
    [f] = compare_runs(db, "ref", "cand").findings()
    assert f.breach and f.verdict == "diverged" and f.uncertain
    assert f.metrics["exact"] is None and "other seeds" in f.metrics["exact_unavailable"]
    assert any("sketches not comparable" in n for n in f.notes)
    assert any("cannot be shown within policy" in n for n in f.notes)
    [g] = compare_runs(db, "ref", "cand", preset_policy("bitwise")).findings()
    assert g.breach


def test_a_version_2_reference_is_measured_by_its_sketch_never_by_fingerprint(db):
    """Fingerprint version 2 (before 2026-12-04) shares version 3's sketch: against a version-3
    candidate the fingerprints do not compare (exact is unavailable, never "identical"), the
    sketches still measure the distance; under the bitwise preset the key is at best "close"
    (within one rounding, said so), never "identical"."""
    from numaudit.agents.digest.hashing import FINGERPRINT_SEED_V2

    x = torch.randn(16, 8)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b in (ref, cand):
        b.add_full(x, step=0, microbatch=0, phase="fwd", site="embed")
    for r in ref.records[0]:
        r.digest.fingerprint_seed = FINGERPRINT_SEED_V2
    write_runs(db, ref, cand)
    [f] = compare_runs(db, "ref", "cand").findings()
    assert f.verdict == "close" and not f.breach, f
    assert f.metrics["exact"] is None and "other seeds" in f.metrics["exact_unavailable"]
    [g] = compare_runs(db, "ref", "cand", preset_policy("bitwise")).findings()
    assert g.verdict == "close", g
    assert any("exact comparison unavailable" in n for n in g.notes), g.notes


def _grouped_runs(bug: bool = False) -> tuple[RunBuilder, RunBuilder]:
    """One microbatch of 8 samples a step against two of 4 (gradient accumulation), with
    payloads so that the samples align by content; `bug` adds 1e-3 to step 1's second
    microbatch's `lin` output in the candidate."""
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, w = torch.randn(8, 6, generator=g), torch.randn(6, 6, generator=g)
        key = dict(step=step, phase="fwd", payload=True)
        ref.add_full(x, microbatch=0, site="emb", **key)
        ref.add_full(x @ w, microbatch=0, site="lin", **key)
        for mb in range(2):
            xs = x[4 * mb:4 * mb + 4]
            cand.add_full(xs, microbatch=mb, site="emb", **key)
            cand.add_full(xs @ w + (1e-3 if bug and (step, mb) == (1, 1) else 0.0),
                          microbatch=mb, site="lin", **key)
    return ref, cand


@pytest.mark.parametrize("bug", [False, True])
def test_live_comparison_regroups_a_step_once_it_is_complete(db, bug):
    """`auditor watch` on runs that group samples otherwise: a step's keys wait until every
    rank of both runs is past it (until then they would read as shape differences and missing
    keys), then are regrouped and reported as `compare` reports them."""
    ref, cand = _grouped_runs(bug)
    write_runs(db, ref)

    def part(step: int) -> RunBuilder:
        out = RunBuilder("cand", close=False)
        out.records = {r: [x for x in recs if x.key.step == step]
                       for r, recs in cand.records.items()}
        return out

    part(0).write(db)
    reader = Reader(db)
    try:
        live = LiveComparison(reader, "ref", "cand", preset_policy("fp32"))
        assert not [e for e in live.poll() if e.finding]  # step 0 not complete in cand
        part(1).write(db)  # cand's rank moves past step 0: step 0 is complete
        events = live.poll()
        assert {e.finding.key.step for e in events if e.finding} == {0}
        assert any("cand's re-keyed into ref's microbatches" in e.status for e in events)
        events += live.flush()
    finally:
        reader.close()
    found = [e.finding for e in events if e.finding and not e.first_divergence]
    assert {(f.key.step, f.key.microbatch) for f in found} == {(0, 0), (1, 0)}
    total = compare_runs(db, "ref", "cand", preset_policy("fp32"))
    assert sorted((f.key.step, f.key.site, f.verdict) for f in found) == sorted(
        (f.key.step, f.key.site, f.verdict) for f in total.findings())
    firsts = [e.finding for e in events if e.first_divergence]
    if bug:
        assert [(f.key.step, f.key.site) for f in firsts] == [(1, "lin")]
    else:
        assert not firsts and not any(f.breach for f in found)
