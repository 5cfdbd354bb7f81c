"""Conventions that make two correct runs look different (DESIGN.md, "Comparing across
parallelisms"): reductions over the batch, loss normalizations; and what stays a breach.

Real tensors, digested by the agent's code, stored through the ingest path (tests/auditor/synth).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import parse_policy, preset_policy
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.report.text import to_text
from numaudit.protos import numaudit_pb2 as pb
from tests.auditor.synth import RunBuilder, write_runs

MEAN, SUM = pb.REDUCTION_MEAN, pb.REDUCTION_SUM


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


def _reduced(b: RunBuilder, rank: int, t: torch.Tensor, *, kind=MEAN, index: int, count: int,
             weight: float = 1.0, **key) -> None:
    """A per-rank reduction (a loss) as the agent records it: the whole value, one addend."""
    b.add(rank, t, **key)
    lay = b.records[rank][-1].layout
    lay.reduce, lay.reduce_index, lay.reduce_count, lay.reduce_weight = kind, index, count, weight


def _loss_runs(db: Path, sizes=(4, 4), *, payload=False, kind=MEAN, drop_rank=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), 16, generator=g)
    ref = RunBuilder("ref")
    key = dict(step=0, microbatch=0, phase="loss", site="loss", role="value", payload=payload)
    whole = x.pow(2).mean(dim=1)
    ref.add_full((whole.mean() if kind == MEAN else whole.sum()).reshape(()), **key)
    cand = RunBuilder("dp", world_size=len(sizes))
    start = 0
    for r, n in enumerate(sizes):
        part = whole[start:start + n]
        start += n
        if r == drop_rank:
            continue
        _reduced(cand, r, (part.mean() if kind == MEAN else part.sum()).reshape(()), kind=kind,
                 index=r, count=len(sizes), weight=float(n), **key)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "dp", preset_policy("fp32"))


@pytest.mark.parametrize("sizes", [(4, 4), (3, 5), (2, 3, 3)])
@pytest.mark.parametrize("payload", [False, True])
def test_per_rank_mean_loss_matches_the_single_process_loss(db, sizes, payload):
    report = _loss_runs(db, sizes, payload=payload)
    assert report.exit_code == 0, to_text(report)
    f = next(report.findings())
    assert f.verdict in ("identical", "close") and f.shape == []
    if payload:
        assert "payload" in f.metrics


def test_per_rank_sum_adds_up(db):
    report = _loss_runs(db, (3, 5), kind=SUM)
    assert report.exit_code == 0, to_text(report)


def test_missing_addend_is_incomplete_naming_the_dp_rank(db):
    report = _loss_runs(db, (4, 4, 4), drop_rank=1)
    f = next(report.findings())
    assert f.verdict == "incomplete" and f.breach
    assert "dp ranks 1 (of 3)" in f.detail


def test_replicas_of_one_addend_must_agree(db):
    ref = RunBuilder("ref")
    key = dict(step=0, microbatch=0, phase="loss", site="loss", role="value")
    ref.add_full(torch.tensor(1.5), **key)
    cand = RunBuilder("tp", world_size=4)  # dp=2 x tp=2: each dp rank's loss seen by 2 tp ranks
    for r, (idx, v) in enumerate([(0, 1.0), (0, 1.0), (1, 2.0), (1, 2.5)]):
        _reduced(cand, r, torch.tensor(v), index=idx, count=2, **key)
    write_runs(db, ref, cand)
    f = next(compare_runs(db, "ref", "tp").findings())
    assert f.verdict == "replica_divergence" and "ranks 3" in f.detail


def _bwd_runs(db, cand_factor: float, cand_scale: float | None, *, payload=False,
              ref_scales=(0.0,)):
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(8, 32, generator=g)
    gw = torch.randn(32, 32, generator=g)
    ref = RunBuilder("ref", world_size=len(ref_scales))
    ref.records = {}
    ref.add_full(gy, step=0, microbatch=0, phase="bwd", site="layers.0", role="grad_output",
                 payload=payload)
    ref.add_full(gw, step=0, microbatch=-1, phase="grad", site="layers.0.weight", role="value",
                 payload=payload)
    if len(ref_scales) > 1:  # sessions that disagree on the scale
        ref.records[1] = []
    ref.register = {}
    cand = RunBuilder("dp")
    cand.register = {"grad_scale": cand_scale} if cand_scale else {}
    cand.add_full(gy * cand_factor, step=0, microbatch=0, phase="bwd", site="layers.0",
                  role="grad_output", payload=payload)
    cand.add_full(gw, step=0, microbatch=-1, phase="grad", site="layers.0.weight", role="value",
                  payload=payload)
    write_runs(db, cand)
    if len(ref_scales) > 1:
        for rank, s in enumerate(ref_scales):
            one = RunBuilder("ref", world_size=len(ref_scales))
            one.records = {rank: ref.records.get(rank, [])}
            one.register = {"grad_scale": s}
            _write_rank(db, one, rank)
    else:
        write_runs(db, ref)
    return compare_runs(db, "ref", "dp", preset_policy("fp32"))


def _write_rank(db, b: RunBuilder, rank: int) -> None:
    """Register and fill only ``rank`` of a run (ranks with their own RegisterRequest fields)."""
    import itertools

    from numaudit.auditor.store.writer import StoreWriter
    from numaudit.wire import limits
    writer = StoreWriter(db, synchronous="NORMAL")
    try:
        sid = f"{b.name}-only-{rank}"
        req = pb.RegisterRequest(schema_version=limits.CURRENT_SCHEMA_VERSION, run=b.name,
                                 session_id=sid, rank=rank, world_size=b.world_size,
                                 torch_version="2.13.0", dtype="float32", host="synth",
                                 local_rank=rank, **b.register)
        writer.submit(lambda s: s.register(req)).result()
        recs = b.records.get(rank, [])
        if recs:
            batch = pb.RecordBatch(schema_version=limits.CURRENT_SCHEMA_VERSION, session_id=sid,
                                   seq=1, records=recs)
            writer.submit(lambda s: s.ingest(batch)).result()
        writer.submit(lambda s: s.close_session(pb.CloseSessionRequest(
            schema_version=limits.CURRENT_SCHEMA_VERSION, session_id=sid,
            records_sent=len(recs)))).result()
    finally:
        writer.close()
    del itertools


@pytest.mark.parametrize("payload", [False, True])
def test_activation_gradients_compare_after_the_declared_normalization(db, payload):
    report = _bwd_runs(db, 2.0, 2.0, payload=payload)
    assert report.exit_code == 0, to_text(report)
    bwd = next(f for f in report.findings() if f.key.phase == "bwd")
    assert any("x2 the runs' loss normalizations imply" in n for n in bwd.notes)


def test_an_unexplained_factor_is_a_breach_said_as_a_scaling(db):
    report = _bwd_runs(db, 4.0, 2.0)  # declared x2, observed x4
    assert report.exit_code == 1
    f = report.first
    assert f.key.phase == "bwd" and f.metrics["scaled_by"] == pytest.approx(2.0, rel=1e-6)
    assert "scaled by 2.00" in f.headline()
    assert "scaled by 2.00" in to_text(report)
    # parameter gradients are compared as they are
    grad = next(x for x in report.findings() if x.key.phase == "grad")
    assert grad.verdict == "identical"


def test_undeclared_factor_x4_headline_says_scaled_not_rel_l2(db):
    report = _bwd_runs(db, 4.0, None)
    assert report.exit_code == 1
    assert "scaled by 4.00" in report.first.headline()
    assert "— scaled by 4.00 (rel_l2" in to_text(report).replace("\n", " ")


def test_a_run_whose_ranks_disagree_on_the_scale_is_compared_unscaled_with_a_warning(db):
    report = _bwd_runs(db, 1.0, None, ref_scales=(1.0, 2.0))
    assert any("compared unscaled" in w for w in report.warnings)
    assert report.exit_code == 0, to_text(report)


def test_small_exact_x2_copy_is_judged_exactly_not_by_sketch_noise(db):
    for n in (32, 256):
        d = db.parent / f"x2-{n}.db"
        g = torch.Generator().manual_seed(n)
        t = torch.randn(n, generator=g)
        ref, cand = RunBuilder("ref"), RunBuilder("cand")
        cand.register = {"grad_scale": 2.0}
        ref.add_full(t, step=0, microbatch=0, phase="bwd", site="m", role="grad_output")
        cand.add_full(2 * t, step=0, microbatch=0, phase="bwd", site="m", role="grad_output")
        write_runs(d, ref, cand)
        report = compare_runs(d, "ref", "cand", preset_policy("fp32"))
        assert report.exit_code == 0, to_text(report)
        f = next(report.findings())
        assert f.value == 0.0  # 2 x the sketch is exact in float64


def _small_gradient_pair(db, payload: bool):
    """An embedding-like gradient whose error hides under rel_l2's atol term (issue 9: rel-L2
    0.0296 under the fp32 threshold 0.0299 while thousands of elements fail assert_close)."""
    g = torch.Generator().manual_seed(3)
    n = 96 * 128
    a = (torch.randn(n, generator=g) * 3.4e-4).double()
    b = torch.randn(n, generator=g).double() * 0.8e-5
    b[a.abs().argmax()] = 5e-5  # the error reaches the largest element: the extremes move
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    ref.add_full((a + b).float().reshape(96, 128), step=0, microbatch=-1, phase="grad",
                 site="emb.weight", role="value", payload=payload)
    cand.add_full(a.float().reshape(96, 128), step=0, microbatch=-1, phase="grad",
                  site="emb.weight", role="value", payload=payload)
    write_runs(db, ref, cand)
    r, c = (a + b).float().double(), a.float().double()
    rel = float((c - r).norm() / r.norm())
    thr = 1.3e-6 + 1e-5 * n ** 0.5 / float(r.norm())
    assert rel < thr  # rel_l2 alone lets it through
    fails = int(((c - r).abs() > 1e-5 + 1.3e-6 * r.abs()).sum())
    assert fails > 1000
    return compare_runs(db, "ref", "cand", preset_policy("fp32")), fails


@pytest.mark.parametrize("payload", [True, False])
def test_fp32_preset_catches_what_rel_l2_lets_through(db, payload):
    report, fails = _small_gradient_pair(db, payload)
    f = report.first
    assert f is not None and f.verdict == "diverged", to_text(report)
    if payload:
        assert f.metric == "allclose" and f.metrics["payload"]["mismatched"] == fails
        assert f"{fails} of 12288 elements fail assert_close" in f.headline()
    else:
        assert f.metric == "max_abs" and any("extremes differ" in n for n in f.notes)
    # the same pair under the rel_l2-only defaults passes: the preset is what catches it
    assert compare_runs(db, "ref", "cand").exit_code == 0
    to_json(report)


def _two_dp_runs(db: Path, cand_addends, cand_weights=(4.0, 4.0)):
    ref, cand = RunBuilder("ref", world_size=2), RunBuilder("cand", world_size=2)
    key = dict(step=0, microbatch=0, phase="loss", site="loss", role="value")
    for r, v in enumerate((1.25, 2.5)):
        _reduced(ref, r, torch.tensor(v), index=r, count=2, weight=4.0, **key)
    for r, (v, w) in enumerate(zip(cand_addends, cand_weights)):
        _reduced(cand, r, torch.tensor(v), index=r, count=2, weight=w, **key)
    write_runs(db, ref, cand)
    return next(compare_runs(db, "ref", "cand", preset_policy("bitwise")).findings())


def test_reductions_with_bitwise_equal_addends_are_identical(db):
    """Both runs reduce over 2 dp ranks: pairwise-equal addends and weights combine to equal
    bits, so the key is identical (exact), not merely close."""
    f = _two_dp_runs(db, (1.25, 2.5))
    assert f.verdict == "identical" and f.metrics["exact"] is True


@pytest.mark.parametrize("addends, weights", [((2.5, 1.25), (4.0, 4.0)),   # swapped dp ranks
                                              ((1.25, 2.5), (3.0, 5.0))])  # other batch split
def test_reductions_whose_addends_differ_are_not_identical(db, addends, weights):
    f = _two_dp_runs(db.with_name(f"{addends[0]}-{weights[0]}.db"), addends, weights)
    assert f.verdict != "identical"


# -- exact factors under the exact metric (issue 37: DualPipeV scale_grads vs loss / M) --------

def _scaled_bwd_runs(db: Path, *, payload: bool, zeros: bool, factor: float = 4.0,
                     nudge: bool = False, ref_register=None, cand_register=None):
    """A reference that declared grad_scale 1/4 (each microbatch's loss divided by 4
    accumulation steps) against a candidate whose activation gradients are x4 (a pipeline
    schedule backpropagating each microbatch's loss as is), compared under the bitwise preset.
    `zeros`: some elements are exactly 0 (a ReLU's gradient); `nudge`: one element of the
    candidate is one float32 ulp off the scaled reference."""
    g = torch.Generator().manual_seed(7)
    ref, cand = RunBuilder("acc"), RunBuilder("pp")
    ref.register = ref_register or {"grad_scale": 0.25, "grad_scale_source": "declared: grad_scale"}
    cand.register = cand_register or {"grad_scale": 1.0,
                                      "grad_scale_source": "inferred: one data-parallel rank"}
    gw = torch.randn(16, 16, generator=g)
    for site in ("layers.0", "layers.1"):
        gy = torch.randn(8, 64 if payload else 4096, generator=g)
        if zeros:
            gy[gy < -1] = 0.0
        c = gy * factor
        if nudge and site == "layers.1":
            c.view(-1)[5] = torch.nextafter(c.view(-1)[5], torch.tensor(1e9))
        key = dict(step=0, microbatch=0, phase="bwd", site=site, role="grad_output",
                   payload=payload)
        ref.add_full(gy, **key)
        cand.add_full(c, **key)
    for b in (ref, cand):
        b.add_full(gw, step=0, microbatch=-1, phase="grad", site="layers.0.weight", role="value")
    write_runs(db, ref, cand)
    return compare_runs(db, "acc", "pp", preset_policy("bitwise"))


@pytest.mark.parametrize("payload, zeros", [(True, True), (False, False), (False, True)])
def test_an_exact_declared_factor_passes_the_bitwise_preset_named_in_the_warnings(
        db, payload, zeros):
    """Before, every activation gradient breached: unequal fingerprints decided under the exact
    metric before the factor was applied."""
    report = _scaled_bwd_runs(db, payload=payload, zeros=zeros)
    assert report.exit_code == 0, to_text(report)
    [said] = [w for w in report.warnings if "compared by the exact metric" in w]
    assert said.startswith("activation gradients (phase bwd): 2 compared by the exact metric "
                           "are exactly acc's x4 in pp (2 "), said
    # every element normal: the fingerprint moves with x4; else the bytes, else the digests
    proof = ("bit for bit" if not zeros else "from both runs' bytes" if payload else
             "from sketches and moments equal to the last bit (uncertain")
    assert proof in said, said
    assert "grad_scale 1 of pp over 0.25 of acc" in said, said
    bwd = next(f for f in report.findings() if f.key.phase == "bwd")
    assert bwd.verdict == "close" and bwd.value == 0.0
    assert bwd.uncertain == (not payload and zeros)
    if not payload and zeros:  # the digests cannot prove every bit: a policy may refuse that
        strict = parse_policy('preset = "bitwise"\non_uncertain = "breach"\n')
        assert compare_runs(db, "acc", "pp", strict).exit_code == 1


@pytest.mark.parametrize("payload", [True, False])
def test_an_exact_factor_with_one_element_off_still_breaches_the_bitwise_preset(db, payload):
    report = _scaled_bwd_runs(db, payload=payload, zeros=False, nudge=True)
    assert report.exit_code == 1
    assert report.first.key.site == "layers.1" and report.first.key.phase == "bwd"
    said = " ".join(report.warnings)
    assert "1 compared by the exact metric" in said, said


def test_an_inferred_scale_is_taken_under_the_bitwise_preset_too(db):
    """Agents inferred x2 for the candidate's 2 dp ranks (a per-rank mean loss); its activation
    gradients are the reference's (a loss normalized by the whole batch, gradients summed): the
    scale is read from the evidence under the exact metric as under any other."""
    report = _scaled_bwd_runs(
        db, payload=False, zeros=True, factor=1.0,
        ref_register={"grad_scale": 1.0, "grad_scale_source": "inferred: one data-parallel rank"},
        cand_register={"grad_scale": 2.0, "grad_scale_source": "inferred: per-rank mean loss "
                                                                "with gradients averaged over 2 "
                                                                "dp ranks (DDP/FSDP default)"})
    assert report.exit_code == 0, to_text(report)
    assert any("compared after the x1 inferred from the evidence" in w
               for w in report.warnings), report.warnings
    assert {f.verdict for f in report.findings()} == {"identical"}
