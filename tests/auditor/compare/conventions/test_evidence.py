"""What the evidence explains: a loss reduction inferred from the runs (compare/conventions.py),
a factor named by the runs' counts (compare/factors.py), tied parameters (compare/tied.py), a
module deeper than the agent's max_depth (compare/breaks.py), keys the policy excluded rather
than missed (compare/causes.py).

Real tensors, digested by the agent's code, stored through the ingest path (tests/auditor/synth),
compared by `compare_runs` and rendered by the reports users read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import parse_policy, preset_policy
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.report.text import to_text
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.labels import CAPTURE_DEPTH_LABEL, TIED_LABEL
from tests.auditor.synth import RunBuilder, write_runs

MEAN, SUM = pb.REDUCTION_MEAN, pb.REDUCTION_SUM
LOSS = dict(step=0, microbatch=0, phase="loss", site="loss", role="value")


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _flat(text: str) -> str:
    """A rendered report with its line wrapping undone."""
    return " ".join(text.split())


def _finding(report, phase: str, site: str | None = None):
    return next(f for f in report.findings() if f.key.phase == phase
                and (site is None or f.key.site == site))


def _json_finding(report, phase: str, site: str | None = None) -> dict:
    doc = json.loads(to_json(report))
    return next(f for f in doc["findings"] if f["key"]["phase"] == phase
                and (site is None or f["key"]["site"] == site))


def _grad(b: RunBuilder, t: torch.Tensor, site: str, ranks=(0,), phase: str = "grad",
          step: int = 0, payload: bool = False) -> None:
    """A parameter-keyed capture (grad, or optim_grad/update, which synth has no name for)."""
    wire = {"optim_grad": pb.PHASE_OPTIM_GRAD, "update": pb.PHASE_UPDATE}.get(phase)
    key = dict(step=step, microbatch=-1, phase="grad" if wire else phase, site=site,
               role="value", payload=payload)
    if len(ranks) > 1:
        b.add_sharded(t, list(ranks), **key)
    else:
        b.add_full(t, ranks=list(ranks), **key)
    if wire:
        for r in ranks:
            b.records[r][-1].key.phase = wire


# -- 1. loss reductions inferred from the evidence (compare/conventions.py) -------------------

def _reduced(b: RunBuilder, rank: int, t: torch.Tensor, *, kind: int, count: int,
             weight: float) -> None:
    """A per-rank loss as the agent records it: the whole value, one addend of dp rank `rank`."""
    b.add(rank, t.reshape(()), **LOSS)
    lay = b.records[rank][-1].layout
    lay.reduce, lay.reduce_index, lay.reduce_count, lay.reduce_weight = kind, rank, count, weight


def _loss_runs(db: Path, *, cand_loss, kind: int = MEAN, grad_factor: float = 1.0,
               grads: bool = True, cand_register: dict | None = None):
    """A single-process reference (mean loss over 8 rows) against 2 dp ranks of 4 rows each,
    whose per-rank losses are `cand_loss(rows, global_rows)`, recorded with reduce `kind`;
    parameter gradients equal, or the candidate's x `grad_factor` (none with `grads=False`)."""
    g = _gen(0)
    per_row = torch.randn(8, 16, generator=g).pow(2).mean(dim=1)
    gw = torch.randn(8, 8, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("dp", world_size=2)
    cand.register = dict(cand_register or {})
    ref.add_full(per_row.mean().reshape(()), **LOSS)
    for r in range(2):
        _reduced(cand, r, cand_loss(per_row[4 * r:4 * r + 4], 8), kind=kind, count=2,
                 weight=4.0)
    if grads:
        _grad(ref, gw, "layers.0.weight")
        _grad(cand, gw * grad_factor, "layers.0.weight", ranks=(0, 1))
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "dp", preset_policy("fp32"))


def _global_sum(rows: torch.Tensor, n: int) -> torch.Tensor:
    """torchtitan's normalization: each rank sums its rows over the whole batch's count."""
    return rows.sum() / n


def test_per_rank_sums_with_agreeing_gradients_pass_as_the_runs_convention(db):
    report = _loss_runs(db, cand_loss=_global_sum)
    assert report.exit_code == 0, to_text(report)
    said = [w for w in report.warnings if "per-rank losses are sums" in w]
    assert len(said) == 1, report.warnings
    assert said[0].startswith("dp's per-rank losses are sums over its 2 dp ranks, not means")
    assert "as a mean, the default for phase loss, x0.5" in said[0]
    loss = _json_finding(report, "loss")
    assert loss["verdict"] in ("identical", "close") and not loss["breach"]
    assert any("dp's per-rank losses are sums" in n and "inferred from the evidence" in n
               for n in loss["notes"]), loss["notes"]
    text = _flat(to_text(report))
    assert "per-rank losses are sums over its 2 dp ranks" in text


def test_gradients_that_differ_by_another_factor_leave_the_loss_its_convention(db):
    """The sum explains the losses exactly; the gradients are x1.5, which the loss's x0.5 (as
    a mean) is not: the gradients are the finding, and the loss keeps its convention."""
    report = _loss_runs(db, cand_loss=_global_sum, grad_factor=1.5)
    assert report.exit_code == 1
    [said] = [w for w in report.warnings if "per-rank losses are sums" in w]
    assert ("the parameter gradients differ (1 of 1, first grad layers.0.weight value @ step 0)"
            ", but none by that x0.5: what differs is in them, not in the loss's reduction"
            in said), said
    assert not _finding(report, "loss").breach
    first = report.first
    assert (first.key.phase, first.key.site) == ("grad", "layers.0.weight"), first.headline()
    assert "scaled by 1.50" in first.headline()


def test_gradients_that_carry_the_losss_factor_keep_the_loss_a_breach_said_why(db):
    """The gradients are x0.5, the very factor the mean leaves on the loss: the loss's scale
    reaches training, so the sum is no reporting convention and the loss is the finding."""
    report = _loss_runs(db, cand_loss=_global_sum, grad_factor=0.5)
    assert report.exit_code == 1
    assert not any("per-rank losses are sums" in w for w in report.warnings)
    loss = _finding(report, "loss")
    assert loss.breach and report.first.key.phase == "loss"
    [why] = [n for n in loss.notes if "not taken as a convention" in n]
    assert why.startswith("merged as a sum over its 2 dp ranks, dp's per-rank losses equal "
                          "ref's loss, but the parameter gradients are x0.5 too (1 of 1, first "
                          "grad layers.0.weight value @ step 0): the loss's scale reaches "
                          "training"), why
    assert "not taken as a convention" in _flat(to_text(report))


GLOBAL_MEAN = {"grad_scale": 1.0, "grad_scale_source": "declared: global_mean"}


@pytest.mark.parametrize("grad_factor", [1.0, 0.5])
def test_a_declared_global_normalization_is_taken_at_its_word_without_advice(db, grad_factor):
    """attach(loss_normalization="global_mean") (torchtitan's FSDP convention) says the per-rank
    losses add up: they are compared as sums with the declaration named and no advice to
    declare what was declared; gradients averaged on top of it (x0.5) are the finding, named
    as such, not the loss."""
    report = _loss_runs(db, cand_loss=_global_sum, grad_factor=grad_factor,
                        cand_register=GLOBAL_MEAN)
    [said] = [w for w in report.warnings if "per-rank losses are sums" in w]
    assert said.startswith("dp's per-rank losses are sums over its 2 dp ranks, as its declared "
                           "loss_normalization='global_mean' says"), said
    assert "declares it" not in _flat(to_text(report))
    assert not _finding(report, "loss").breach
    if grad_factor == 1.0:
        assert report.exit_code == 0, to_text(report)
    else:
        assert report.first.key.phase == "grad"
        assert any("averaged where the loss was already normalized globally" in n
                   for n in report.first.notes), report.first.notes


def test_per_rank_sums_without_gradients_stay_a_breach_said_why(db):
    """Without parameter gradients nothing shows the step matches: the loss stays a breach."""
    report = _loss_runs(db, cand_loss=_global_sum, grads=False)
    assert report.exit_code == 1
    [why] = [n for n in _finding(report, "loss").notes if "not taken as a convention" in n]
    assert "no parameter gradient (phase grad) was captured" in why, why


def test_per_rank_losses_neither_mean_nor_sum_are_a_breach(db):
    report = _loss_runs(db, cand_loss=lambda rows, n: rows.sum() / n * 1.3)
    assert report.exit_code == 1
    loss = _json_finding(report, "loss")
    assert loss["breach"]
    [why] = [n for n in loss["notes"] if "neither as a mean nor as a sum" in n]
    assert "over its 2 dp ranks do dp's per-rank losses make ref's loss" in why
    assert "mean x0.65" in why and "sum x1.3" in why
    assert not any("per-rank losses are sums" in w for w in report.warnings)


def test_a_declared_sum_is_left_as_declared(db):
    """capture(loss, reduce="sum"): addends that sum to the reference pass without any
    inference; addends that are means (their sum x2 the reference) are not re-read as a mean."""
    ok = _loss_runs(db, cand_loss=_global_sum, kind=SUM)
    assert ok.exit_code == 0, to_text(ok)
    assert not any("per-rank losses" in w for w in ok.warnings)
    assert not any("inferred" in n for n in _finding(ok, "loss").notes)
    bad = _loss_runs(db.with_name("means.db"), cand_loss=lambda rows, n: rows.mean(), kind=SUM)
    assert bad.exit_code == 1
    loss = _finding(bad, "loss")
    assert loss.breach and not any("per-rank losses" in n for n in loss.notes), loss.notes
    assert any("x2 = 2 dp ranks of dp" in n for n in loss.notes), loss.notes  # named, not excused
    assert not any("per-rank losses" in w for w in bad.warnings)


def test_a_loss_sum_and_an_inferred_activation_gradient_scale_are_both_said(db):
    """torchtitan's convention: each rank's loss normalized by the whole batch, gradients summed
    over ranks. The agents inferred x2 activation gradients for 2 dp ranks (a per-rank mean
    loss); the evidence shows x1 and per-rank sums. Both conventions are taken, both said, and
    the loss keys keep their note through the activation gradients' second evaluation."""
    g = _gen(9)
    per_row = torch.randn(8, 16, generator=g).pow(2).mean(dim=1)
    gy, gw = torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("dp", world_size=2)
    ref.register = {"grad_scale": 1.0, "grad_scale_source": "inferred: one process"}
    cand.register = {"grad_scale": 2.0, "grad_scale_source": "inferred: 2 dp ranks"}
    ref.add_full(per_row.mean().reshape(()), **LOSS)
    for r in range(2):
        _reduced(cand, r, _global_sum(per_row[4 * r:4 * r + 4], 8), kind=MEAN, count=2,
                 weight=4.0)
    bwd = dict(step=0, microbatch=0, phase="bwd", site="layers.0", role="grad_output")
    ref.add_full(gy, **bwd)
    cand.add_sharded(gy, [0, 1], **bwd)
    _grad(ref, gw, "layers.0.weight")
    _grad(cand, gw, "layers.0.weight", ranks=(0, 1))
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "dp", preset_policy("fp32"))
    assert report.exit_code == 0, to_text(report)
    assert any("per-rank losses are sums" in w for w in report.warnings), report.warnings
    assert any("activation gradients (phase bwd)" in w and "inferred from the evidence" in w
               for w in report.warnings), report.warnings
    assert any("per-rank losses are sums" in n for n in _finding(report, "loss").notes)


# -- 2. factors named at every verdict (compare/factors.py) -----------------------------------

def _scaled_grad_runs(db: Path, factor: float, *, labels: dict | None = None,
                      payload: bool = True):
    g = _gen(1)
    gw = torch.randn(16, 16, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("pp")
    cand.register = {"labels": labels} if labels else {}
    _grad(ref, gw, "layers.0.weight", payload=payload)
    _grad(cand, gw * factor, "layers.0.weight", payload=payload)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "pp", preset_policy("bitwise"))


def test_bitwise_names_an_exact_factor_from_the_bytes(db):
    """The bitwise preset decides from fingerprints alone; the factor is still measured and,
    with both runs' bytes, proven for every element."""
    report = _scaled_grad_runs(db, 4.0)
    assert report.exit_code == 1
    f = report.first
    assert f.metrics["scaled_by"] == 4.0
    [note] = [n for n in f.notes if "scaled by" in n]
    assert note.startswith("pp is ref scaled by 4 exactly (every element, from both runs' bytes)")
    assert "x4, a power of two no count of the runs' work explains" in note
    assert "scaled by 4 exactly" in _flat(to_text(report))
    assert any("scaled by 4 exactly" in n for n in _json_finding(report, "grad")["notes"])


def test_bitwise_without_payloads_names_the_factor_from_sketches(db):
    f = _scaled_grad_runs(db, 4.0, payload=False).first
    [note] = [n for n in f.notes if "scaled by" in n]
    assert note.startswith("pp is ref scaled by 4 (what remains after that factor:")
    assert "exactly" not in note


def test_a_factor_equal_to_the_pipeline_microbatches_is_named_so(db):
    report = _scaled_grad_runs(db, 4.0, labels={"pp_microbatches": "4"})
    [note] = [n for n in report.first.notes if "scaled by 4" in n]
    assert "x4 = 4 pp_microbatches of pp: " in note and "scale_grads=True" in note
    assert "power of two" not in note
    other = _scaled_grad_runs(db.with_name("8.db"), 8.0, labels={"pp_microbatches": "4"})
    [note8] = [n for n in other.first.notes if "scaled by 8" in n]
    assert "pp_microbatches" not in note8 and "a power of two" in note8


def test_gradients_summed_over_dp_ranks_are_named_by_the_dp_count(db):
    """4 dp ranks whose per-rank mean losses make the reference's loss, gradients summed where
    DDP averages: x4 is named as the candidate's 4 dp ranks, under fp32 from sketches."""
    g = _gen(10)
    rows, gw = torch.randn(16, generator=g), torch.randn(16, 16, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("ddp", world_size=4)
    ref.add_full(rows.mean().reshape(()), **LOSS)
    for r in range(4):
        _reduced(cand, r, rows[4 * r:4 * r + 4].mean(), kind=MEAN, count=4, weight=4.0)
    _grad(ref, gw, "layers.0.weight")
    _grad(cand, gw * 4, "layers.0.weight", ranks=(0, 1, 2, 3))
    write_runs(db, ref, cand)
    report = compare_runs(db, "ref", "ddp", preset_policy("fp32"))
    assert not _finding(report, "loss").breach
    f = report.first
    assert f.key.phase == "grad"
    [note] = [n for n in f.notes if "scaled by 4" in n]
    assert "x4 = 4 dp ranks of ddp: gradients summed over the dp ranks where they should be " \
           "averaged" in note


def _optimizer_runs(db: Path, *, update: float, optim_grad: float):
    g = _gen(2)
    og, up = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, k_og, k_up in ((ref, 1.0, 1.0), (cand, optim_grad, update)):
        _grad(b, og * k_og, "layers.0.weight", phase="optim_grad", payload=True)
        _grad(b, up * k_up, "layers.0.weight", phase="update", payload=True)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("bitwise"))


def test_an_update_scaled_while_optim_grad_matches_is_a_learning_rate(db):
    report = _optimizer_runs(db, update=2.0, optim_grad=1.0)
    assert report.exit_code == 1
    assert _finding(report, "optim_grad").verdict == "identical"
    up = _finding(report, "update")
    [note] = [n for n in up.notes if "scaled by 2" in n]
    assert "its optim_grad matched (identical)" in note and "learning rate" in note, note
    assert "loss normalization" not in note
    assert "no count of the runs' work" not in note  # the learning rate is the explanation
    # both scaled: the update inherits the optimizer's gradient, no learning rate is blamed
    both = _optimizer_runs(db.with_name("both.db"), update=2.0, optim_grad=2.0)
    [note] = [n for n in _finding(both, "update").notes if "scaled by 2" in n]
    assert "optim_grad) already differs" in note and "learning rate" not in note


def _cleared_runs(db: Path, *, frozen_only: bool = False):
    """Both runs captured their gradients after a zero_grad (None) while the optimizer consumed
    gradients that differ; `frozen_only`: one of the two parameters has its gradient."""
    g = _gen(4)
    og, gw = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, k in ((ref, 1.0), (cand, 1.5)):
        b.add_none(0, step=0, site="layers.0.weight")
        if frozen_only:
            _grad(b, gw, "layers.1.weight")
        else:
            b.add_none(0, step=0, site="layers.1.weight")
        _grad(b, og * k, "layers.0.weight", phase="optim_grad")
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_gradients_none_in_both_runs_are_not_taken_for_evidence(db):
    """None in both runs compares as identical; when every gradient of a step is None in both,
    the report warns that it says nothing of backward, and the optimizer's gradient, which
    differs, is not said to differ 'after the gradients matched'."""
    report = _cleared_runs(db)
    assert _finding(report, "grad").verdict == "identical"
    [warning] = [w for w in report.warnings if "None in both runs" in w]
    assert warning.startswith("every parameter gradient of step 0 is None in both runs (2 "
                              "gradients)") and "zero_grad" in warning, warning
    first = report.first
    assert first.key.phase == "optim_grad" and first.cause.kind == "unknown"
    assert "its grad is None in both runs" in first.cause.reason
    assert "matched before the optimizer" not in first.cause.reason
    # a frozen parameter (None in both) beside one with a gradient: no warning
    partly = _cleared_runs(db.with_name("partly.db"), frozen_only=True)
    assert not [w for w in partly.warnings if "None in both runs" in w]


# -- 3. tied parameters (compare/tied.py) -------------------------------------------------------

TIE = "output.weight=tok_embeddings.weight"


def _tied_runs(db: Path, *, ref_tied: bool):
    """cand ties the output head to the embedding (one parameter captured as tok_embeddings,
    its gradient the sum of both uses); ref holds two parameters, or ties them too and captured
    the parameter under its other name."""
    g = _gen(3)
    emb, out = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    cand.register = {"labels": {TIED_LABEL: TIE}}
    if ref_tied:
        ref.register = {"labels": {TIED_LABEL: "tok_embeddings.weight=output.weight"}}
        _grad(ref, emb + out, "output.weight")
    else:
        _grad(ref, emb, "tok_embeddings.weight")
        _grad(ref, out, "output.weight")
    _grad(cand, emb + out, "tok_embeddings.weight")
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_a_tie_in_one_run_explains_the_missing_alias_and_the_differing_gradient(db):
    report = _tied_runs(db, ref_tied=False)
    assert report.exit_code == 1
    missing = _json_finding(report, "grad", "output.weight")
    assert missing["verdict"] == "missing_in_cand"
    assert missing["detail"].startswith(
        "not captured under this name in cand: cand ties output.weight to "
        "tok_embeddings.weight (one parameter, captured once as tok_embeddings.weight)")
    assert "ref holds output.weight and tok_embeddings.weight as separate parameters" in \
        missing["detail"]
    emb = _finding(report, "grad", "tok_embeddings.weight")
    assert emb.verdict == "diverged"
    assert "tok_embeddings.weight is tied to output.weight in cand and not in ref" in \
        emb.cause.reason
    text = _flat(to_text(report, show_all=True))
    assert "cand ties output.weight to tok_embeddings.weight" in text


def test_a_tie_in_both_runs_under_other_names_suggests_a_rename(db):
    report = _tied_runs(db, ref_tied=True)
    out = _finding(report, "grad", "output.weight")
    assert out.verdict == "missing_in_cand"
    assert "ref ties them too but captured the parameter as output.weight" in out.detail
    assert out.detail.endswith("a policy rename can align them")
    emb = _finding(report, "grad", "tok_embeddings.weight")
    assert emb.verdict == "missing_in_ref"
    assert emb.detail.startswith("not captured under this name in ref: ref ties "
                                 "tok_embeddings.weight to output.weight")
    assert "a policy rename can align them" in emb.detail
    # the rename it suggests does align them
    renamed = parse_policy('preset = "fp32"\n[[rename]]\nside = "ref"\n'
                           'glob = "output.weight"\nreplace = "tok_embeddings.weight"\n')
    again = compare_runs(db, "ref", "cand", renamed)
    assert again.exit_code == 0, to_text(again)


def test_without_a_tie_label_a_missing_parameter_is_just_not_captured(db):
    g = _gen(4)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    _grad(ref, torch.randn(4, 4, generator=g), "output.weight")
    cand.register = {"labels": {TIED_LABEL: "lm_head.weight=tok_embeddings.weight"}}
    _grad(cand, torch.randn(4, 4, generator=g), "tok_embeddings.weight")
    write_runs(db, ref, cand)
    f = _finding(compare_runs(db, "ref", "cand"), "grad", "output.weight")
    assert f.detail == "not captured in cand"


# -- 4. a module deeper than the agent's max_depth (compare/breaks.py) -------------------------

def _deep_break_runs(db: Path, labels: dict, *, on: str = "cand"):
    """Both runs capture fwd and bwd of the depth-2 modules only; cand's gradient of a
    parameter of a depth-4 module (agents/capture/sites.py `depth`: dots + 1) is None while the
    other parameters got theirs."""
    g = _gen(5)
    acts = {m: torch.randn(4, 8, generator=g) for m in ("layers.0", "layers.1")}  # depth 2
    grads = {s: torch.randn(8, 8, generator=g)
             for s in ("layers.0.attention.wq.weight", "layers.1.weight")}
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    (cand if on == "cand" else ref).register = {"labels": labels}
    for b, is_cand in ((ref, False), (cand, True)):
        for m, a in acts.items():
            b.add_full(a, step=0, microbatch=0, phase="fwd", site=m, role="output")
        for m, a in reversed(acts.items()):
            b.add_full(a * 0.5, step=0, microbatch=0, phase="bwd", site=m, role="grad_output")
        for site, gw in grads.items():
            if is_cand and site == "layers.0.attention.wq.weight":
                b.add_none(0, step=0, site=site)
            else:
                _grad(b, gw, site)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_a_graph_break_deeper_than_max_depth_says_to_raise_it(db):
    report = _deep_break_runs(db, {CAPTURE_DEPTH_LABEL: "3"})  # the agent's default
    [gb] = report.graph_breaks
    assert (gb.side, gb.kind, gb.scope, gb.module) == \
        ("cand", "none", "module", "layers.0.attention.wq")
    assert ("cand captured activation gradients (phase bwd) of modules down to depth 3 (the "
            "agent's max_depth) and layers.0.attention.wq is at depth 4") in gb.boundary
    assert "raise max_depth to 4 (NUMAUDIT_DEPTH=4" in gb.boundary
    assert "capture bwd" not in gb.boundary and "did not hook it" not in gb.boundary
    doc = json.loads(to_json(report))
    assert "NUMAUDIT_DEPTH=4" in json.dumps(doc["graph_breaks"])
    assert "NUMAUDIT_DEPTH=4" in _flat(to_text(report))


@pytest.mark.parametrize("labels", [{}, {CAPTURE_DEPTH_LABEL: "4"}, {CAPTURE_DEPTH_LABEL: "x"}])
def test_a_module_within_max_depth_without_captures_was_not_hooked(db, labels):
    """At or above the agent's depth (or without the label) the module was not hooked: no
    advice to raise max_depth, none to capture bwd (the run did)."""
    [gb] = _deep_break_runs(db, labels).graph_breaks
    assert "neither the forward nor the backward of layers.0.attention.wq" in gb.boundary
    assert "the agent did not hook it" in gb.boundary
    assert "NUMAUDIT_DEPTH" not in gb.boundary and "capture bwd" not in gb.boundary


def test_the_depth_label_is_read_from_the_run_with_the_break(db):
    """ref's max_depth says nothing about what cand hooked."""
    [gb] = _deep_break_runs(db, {CAPTURE_DEPTH_LABEL: "3"}, on="ref").graph_breaks
    assert gb.side == "cand" and "NUMAUDIT_DEPTH" not in gb.boundary


# -- 5. captured but excluded by the policy, not "not captured" (compare/causes.py) -----------

def _ignoring(phases: list[str], name: str = "skip") -> object:
    listed = ", ".join(f'"{p}"' for p in phases)
    return parse_policy(f'preset = "fp32"\n[[rule]]\nname = "{name}"\nphase = [{listed}]\n'
                        'action = "ignore"\n', "p.toml")


def _step_runs(db: Path, *, params: bool = True, bwd: bool = True, grad_factor: float = 1.0,
               fwd_factor: float = 1.0):
    """One step, one microbatch: params, the forward and backward of layers.0 and its gradient;
    cand's forward output or gradient scaled."""
    g = _gen(7)
    w, y, gy, gw = (torch.randn(8, 8, generator=g) for _ in range(4))
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, is_cand in ((ref, False), (cand, True)):
        if params:
            _grad(b, w, "layers.0.weight", phase="param")
        b.add_full(y * (fwd_factor if is_cand else 1.0), step=0, microbatch=0, phase="fwd",
                   site="layers.0", role="output")
        if bwd:
            b.add_full(gy, step=0, microbatch=0, phase="bwd", site="layers.0",
                       role="grad_output")
        _grad(b, gw * (grad_factor if is_cand else 1.0), "layers.0.weight")
    write_runs(db, ref, cand)
    return db


def test_a_block_start_with_excluded_parameters_says_they_were_captured(db):
    _step_runs(db, fwd_factor=1.5)
    f = compare_runs(db, "ref", "cand", _ignoring(["param"], "no-params")).first
    assert (f.key.phase, f.key.site, f.cause.kind) == ("fwd", "layers.0", "unknown")
    assert f.cause.reason == ("first capture of its microbatch; parameter values were captured "
                              "but excluded by the policy (rule 1 (no-params)), so the weights "
                              "cannot be ruled out")
    # not captured at all: said so
    _step_runs(db.with_name("b.db"), params=False, fwd_factor=1.5)
    f = compare_runs(db.with_name("b.db"), "ref", "cand", preset_policy("fp32")).first
    assert "parameter values were not captured" in f.cause.reason


def test_a_gradient_cause_with_excluded_activation_gradients_asks_to_compare_them(db):
    _step_runs(db, grad_factor=2.0)
    report = compare_runs(db, "ref", "cand", _ignoring(["bwd"]))
    f = report.first
    assert f.key.phase == "grad" and f.cause.kind == "unknown"
    assert ("its activation gradients (phase bwd) were captured but excluded by the policy "
            "(rule 1 (skip)): let the policy compare them around layers.0") in f.cause.reason
    assert "capture phase bwd" not in f.cause.reason
    assert "were captured but excluded by the policy" in _flat(to_text(report))
    # the same runs compared in full: backward matched, the gradient alone differs
    full = compare_runs(db, "ref", "cand", preset_policy("fp32")).first
    assert full.cause.reason.startswith("forward and backward activations match")


def test_a_gradient_cause_with_every_activation_excluded_asks_to_compare_them(db):
    _step_runs(db, grad_factor=2.0)
    f = compare_runs(db, "ref", "cand", _ignoring(["fwd", "bwd"])).first
    assert f.key.phase == "grad"
    assert f.cause.reason == ("the step's activations and activation gradients were captured "
                              "but excluded by the policy (rule 1 (skip)): let the policy "
                              "compare phases fwd and bwd to locate it")


def _param_runs(db: Path, *, grad_in: tuple[str, ...] = ("ref", "cand")):
    """Two steps; cand's parameter differs at step 1 while its step-0 value matched; the
    step-0 gradient captured in `grad_in`."""
    g = _gen(8)
    w0, w1, gw = (torch.randn(8, 8, generator=g) for _ in range(3))
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, side in ((ref, "ref"), (cand, "cand")):
        _grad(b, w0, "layers.0.weight", phase="param", step=0)
        if side in grad_in:
            _grad(b, gw, "layers.0.weight", step=0)
        _grad(b, w1 * (1.25 if side == "cand" else 1.0), "layers.0.weight", phase="param",
              step=1)
    write_runs(db, ref, cand)
    return db


@pytest.mark.parametrize("grad_in, where", [(("ref", "cand"), ""), (("ref",), " in ref only")])
def test_a_parameter_whose_excluded_gradient_was_captured_says_so(db, grad_in, where):
    _param_runs(db, grad_in=grad_in)
    f = compare_runs(db, "ref", "cand", _ignoring(["grad"])).first
    assert (f.key.phase, f.key.step) == ("param", 1)
    assert f.cause.reason == (f"its gradient at step 0 was captured{where} but excluded by the "
                              "policy (rule 1 (skip))")


def test_a_parameter_whose_gradient_was_not_captured_says_so(db):
    _param_runs(db, grad_in=())
    f = compare_runs(db, "ref", "cand", preset_policy("fp32")).first
    assert f.cause.reason == "its gradient at step 0 was not captured in either run"


def test_an_update_whose_excluded_optim_grad_was_captured_asks_to_compare_it(db):
    report = _optimizer_runs(db, update=2.0, optim_grad=1.0)
    assert "learning rate" in report.first.cause.reason  # compared: the update rule is blamed
    f = compare_runs(db, "ref", "cand", _ignoring(["optim_grad"])).first
    assert f.key.phase == "update"
    assert f.cause.reason == ("phase optim_grad of this parameter was captured but excluded by "
                              "the policy (rule 1 (skip)): let the policy compare it to tell "
                              "where the difference arises")


def test_a_loss_refused_under_bitwise_shows_no_unmeasured_ratio(db):
    """Under the bitwise preset a loss's verdict can come from fingerprints alone, which
    measure no ratio: the refusal says what no reduction explains without printing 'xnan'."""
    _loss_runs(db, cand_loss=lambda rows, n: rows.sum() / n * 1.3)
    report = compare_runs(db, "ref", "dp", preset_policy("bitwise"))
    loss = _json_finding(report, "loss")
    assert loss["breach"]
    notes = " ".join(loss["notes"])
    assert "no loss reduction explains the difference" in notes and "nan" not in notes, notes


# -- parents a pipeline stage never runs (compare/parents.py) ----------------------------------

def _stage_runs(db: Path, *, cand_stages: bool = True, children: bool = True):
    """A reference that captured the parent `model` and its children; a candidate whose 2
    pipeline stages ran only the children (as a stage cut from a transformers model does)."""
    g = _gen(5)
    acts = {s: torch.randn(4, 8, generator=g) for s in ("model.emb", "model.layers.0",
                                                        "model.layers.1", "model")}
    ref, cand = RunBuilder("ref"), RunBuilder("pp", world_size=2,
                                              stages={0: [0], 1: [1]} if cand_stages else {})
    for site, t in acts.items():
        for phase, role in (("fwd", "output"), ("bwd", "grad_output")):
            key = dict(step=0, microbatch=0, phase=phase, site=site, role=role)
            ref.add_full(t, **key)
            if site == "model" or (not children and site.startswith("model.")):
                continue
            stage = 0 if site in ("model.emb", "model.layers.0") else 1
            cand.add(stage, t, step=0, microbatch=0, phase=phase, site=site, role=role,
                     stage=stage if cand_stages else -1)
    cand.add(1, acts["model"], step=0, microbatch=0, phase="fwd", site="head", role="output",
             stage=1 if cand_stages else -1)
    ref.add_full(acts["model"], step=0, microbatch=0, phase="fwd", site="head", role="output")
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "pp", preset_policy("fp32"))


def test_a_parent_no_pipeline_stage_runs_is_expected_said_once(db):
    report = _stage_runs(db)
    assert report.exit_code == 0, to_text(report)
    missing = [f for f in report.findings() if f.verdict == "missing_in_cand"]
    assert {(f.key.phase, f.key.site) for f in missing} == {("fwd", "model"), ("bwd", "model")}
    assert all(f.expected and not f.breach for f in missing)
    assert missing[0].detail.startswith("not captured in pp: its pipeline stages never ran "
                                        "model's own forward, only its submodules'")
    [said] = [w for w in report.warnings if "never run the parent's forward" in w]
    assert said.startswith("pp: 2 captures of model are missing because pp's pipeline stages "
                           "call the submodules themselves"), said


@pytest.mark.parametrize("stages, children", [(False, True), (True, False)])
def test_a_parent_missing_otherwise_stays_a_breach(db, stages, children):
    """Without pipeline stages, or without its children captured, a missing module is missing."""
    report = _stage_runs(db, cand_stages=stages, children=children)
    assert report.exit_code == 1
    missing = [f for f in report.findings() if f.key.site == "model"]
    assert missing and all(f.verdict == "missing_in_cand" and f.breach for f in missing)
    assert not any("never run the parent's forward" in w for w in report.warnings)


# -- the same values in another dtype (compare/verdicts.py) ------------------------------------

def _dtype_runs(db: Path, *, bf16_side: str = "ref", nudge: bool = False,
                preset: str = "fp32"):
    """`a` holds the same values in bfloat16 in one run and float32 in the other (`nudge`: one
    float32 element off by one ulp); `b`, captured after it, differs in microbatch 1. The
    candidate takes 2 microbatches of 4 where the reference takes 1 of 8, without payloads:
    regrouped pieces keep their fingerprints, not their sketches."""
    g = _gen(6)
    x = torch.randn(8, 16, generator=g).bfloat16()
    y = torch.randn(8, 16, generator=g)
    wide = x.float()
    if nudge:
        wide.view(-1)[3] = torch.nextafter(wide.view(-1)[3], torch.tensor(9.0))
    ref_a, cand_a = (x, wide) if bf16_side == "ref" else (wide, x)
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    key = dict(step=0, role="output")
    ref.add_full(ref_a, microbatch=0, phase="fwd", site="a", **key)
    ref.add_full(y, microbatch=0, phase="fwd", site="b", **key)
    for mb in range(2):
        rows = slice(4 * mb, 4 * mb + 4)
        cand.add_full(cand_a[rows], microbatch=mb, phase="fwd", site="a", **key)
        cand.add_full(y[rows] * (1.01 if mb else 1.0), microbatch=mb, phase="fwd", site="b",
                      **key)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy(preset))


@pytest.mark.parametrize("bf16_side", ["ref", "cand"])
def test_the_same_values_in_another_dtype_pass_and_the_first_divergence_is_the_breach(
        db, bf16_side):
    """Before: `a`, whose only difference is its dtype, was the first divergence ("rel_l2 >= 0
    … a lower bound: nothing measures it") ahead of `b`, the key that breaches."""
    report = _dtype_runs(db, bf16_side=bf16_side)
    a = _finding(report, "fwd", "a")
    assert a.verdict == "close" and not a.breach and a.value == 0.0
    assert any(n.startswith("the same values in another dtype") for n in a.notes), a.notes
    assert set(a.dtype.values()) == {"bfloat16", "float32"}
    assert report.first.key.site == "b" and report.first.cause.kind == "introduced"


def test_values_a_bit_off_in_another_dtype_are_not_taken_as_the_same(db):
    report = _dtype_runs(db, nudge=True)
    a = _finding(report, "fwd", "a")
    assert a.breach and not any("the same values" in n for n in a.notes)


def test_the_same_values_in_another_dtype_are_a_difference_to_the_bitwise_preset(db):
    report = _dtype_runs(db, preset="bitwise")
    a = _finding(report, "fwd", "a")
    assert a.breach and report.first.key.site == "a"
    assert any("a dtype change is a difference under the exact metric" in n for n in a.notes)


@pytest.mark.parametrize("factor, scaled", [(1.013, False), (0.5, True)])
def test_a_scalar_is_said_scaled_only_by_a_count(db, factor, scaled):
    """One element is always its reference times something: "scaled by 1.01" said nothing a
    scalar's value does not, and read as a convention; x0.5 is a count (dp ranks, steps)."""
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    ref.add_full(torch.tensor(0.75), **LOSS)
    cand.add_full(torch.tensor(0.75 * factor), **LOSS)
    write_runs(db, ref, cand)
    f = compare_runs(db, "ref", "cand", preset_policy("fp32")).first
    assert f.headline().split(" — ")[1].startswith("scaled by") == scaled, f.headline()
    assert any("a uniform factor" in n for n in f.notes) == scaled, f.notes
