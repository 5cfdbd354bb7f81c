"""Causes say what the captured evidence shows, and what to capture when it is missing."""

from __future__ import annotations

from pathlib import Path

import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from tests.auditor.synth import RunBuilder, one_ulp, write_runs


def _runs(db: Path, *, bwd: bool, fwd_delta: float = 0.0, out_delta: float = 0.0):
    g = torch.Generator().manual_seed(0)
    x, y, gy, gw = (torch.randn(8, 16, generator=g) for _ in range(4))
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, is_cand in ((ref, False), (cand, True)):
        b.add_full(x * (1 + (fwd_delta if is_cand else 0)), step=0, microbatch=0, phase="fwd",
                   site="embed", role="output")
        b.add_full(y + (out_delta if is_cand else 0), step=0, microbatch=0, phase="fwd",
                   site="head", role="output")
        if bwd:
            b.add_full(gy, step=0, microbatch=0, phase="bwd", site="embed", role="grad_output")
        b.add_full(gw * (2 if is_cand else 1), step=0, microbatch=-1, phase="grad",
                   site="head.weight", role="value")
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_gradients_differ_after_identical_activations_and_activation_gradients(tmp_path):
    f = _runs(tmp_path / "a.db", bwd=True).first
    assert f.key.phase == "grad"
    assert f.cause.reason.startswith("forward and backward activations match, gradients do not")


def test_without_activation_gradients_the_cause_says_what_to_capture(tmp_path):
    f = _runs(tmp_path / "a.db", bwd=False).first
    assert f.cause.kind == "unknown" and "capture phase bwd" in f.cause.reason
    assert "activation gradient of the step matched" not in f.cause.reason


def test_a_close_predecessor_does_not_excuse_a_large_divergence(tmp_path):
    f = _runs(tmp_path / "a.db", bwd=True, fwd_delta=1e-7, out_delta=0.5).first
    assert f.key.site == "head"
    assert "may amplify a rounding difference" not in f.cause.reason
    assert "the module computes otherwise" in f.cause.reason


def test_gradients_differ_while_the_modules_own_activation_gradients_match(tmp_path):
    """The module's own bwd capture is identical: the cause says which facts match."""
    g = torch.Generator().manual_seed(1)
    x, gy, gw = (torch.randn(8, 16, generator=g) for _ in range(3))
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, k in ((ref, 1), (cand, 3)):
        b.add_full(x, step=0, microbatch=0, phase="fwd", site="head", role="output")
        b.add_full(gy, step=0, microbatch=0, phase="bwd", site="head", role="grad_output")
        b.add_full(gw * k, step=0, microbatch=-1, phase="grad", site="head.weight", role="value")
    write_runs(tmp_path / "a.db", ref, cand)
    f = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32")).first
    assert f.cause.reason.startswith("forward and backward activations match, gradients do not")
    assert "1 of them at head itself" in f.cause.reason


def test_activation_gradients_only_close_are_said_to_be_close(tmp_path):
    g = torch.Generator().manual_seed(2)
    x, gy, gw = (torch.randn(8, 16, generator=g) for _ in range(3))
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, is_cand in ((ref, False), (cand, True)):
        b.add_full(x, step=0, microbatch=0, phase="fwd", site="head", role="output")
        b.add_full(one_ulp(gy, 3) if is_cand else gy, step=0, microbatch=0, phase="bwd",
                   site="head", role="grad_output")
        b.add_full(gw * (2 if is_cand else 1), step=0, microbatch=-1, phase="grad",
                   site="head.weight", role="value")
    write_runs(tmp_path / "a.db", ref, cand)
    f = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32")).first
    assert f.key.phase == "grad"
    assert f.cause.reason.startswith("forward and backward activations match within tolerance")
    assert "1 activation gradients (1 close)" in f.cause.reason


def _two_stage_runs(db: Path, *, detach: bool = False, frozen: str | None = None):
    """Two pipeline stages (ranks 0, 1); the candidate cut at the 0 -> 1 boundary (stage 0's
    activation and parameter gradients all zero) or with one parameter frozen."""
    g = torch.Generator().manual_seed(3)
    ref = RunBuilder("ref", world_size=2, stages={0: [0], 1: [1]})
    cand = RunBuilder("cand", world_size=2, stages={0: [0], 1: [1]})
    mods = {0: ["layers.0", "layers.1"], 1: ["layers.2", "layers.3"]}
    acts = {m: torch.randn(4, 8, generator=g) for st in mods.values() for m in st}
    grads = {f"{m}.{p}": torch.randn(8, 8, generator=g) for st in mods.values() for m in st
             for p in ("weight", "bias")}
    for b, is_cand in ((ref, False), (cand, True)):
        for st, ms in mods.items():
            for m in ms:
                b.add(st, acts[m], step=0, microbatch=0, phase="fwd", site=m, role="output",
                      stage=st)
            for m in reversed(ms):
                gy = acts[m] * 0.5
                if is_cand and detach and st == 0:
                    gy = torch.zeros_like(gy)
                b.add(st, gy, step=0, microbatch=0, phase="bwd", site=m, role="grad_output",
                      stage=st)
            for m in ms:
                for p in ("weight", "bias"):
                    site = f"{m}.{p}"
                    if is_cand and site == frozen:
                        b.add_none(st, step=0, site=site, stage=st)
                        continue
                    gw = grads[site]
                    if is_cand and detach and st == 0:
                        gw = torch.zeros_like(gw)
                    b.add(st, gw, step=0, microbatch=-1, phase="grad", site=site, role="value",
                          stage=st)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_all_zero_activation_gradients_at_a_stage_boundary_are_a_detach(tmp_path):
    report = _two_stage_runs(tmp_path / "a.db", detach=True)
    [gb] = report.graph_breaks
    assert (gb.kind, gb.scope, gb.stage) == ("zero", "stage", 0)
    assert "activation gradients arriving at stage 0 are all zero (2 of 2 bwd captures): the " \
           "graph is cut at the boundary (a detach or a no_grad)" in gb.boundary
    assert "skipped weight-gradient" not in gb.boundary
    # the first divergence is the first all-zero activation gradient, and it says so
    f = report.first
    assert f.key.phase == "bwd" and f.key.site == "layers.1"
    assert "all zero in cand and not in ref" in f.cause.reason


def test_one_frozen_parameter_is_not_a_graph_cut(tmp_path):
    report = _two_stage_runs(tmp_path / "a.db", frozen="layers.1.bias")
    [gb] = report.graph_breaks
    assert gb.scope == "module" and (gb.params, gb.total_params) == (1, 2)
    assert "1 of 2 parameters of layers.1 received no gradient (frozen or unused): bias" \
        in gb.message
    assert "gradients stop" not in gb.boundary
    assert "frozen (requires_grad=False) or unused" in gb.boundary


def test_replicas_that_disagree_name_the_mesh_dim_of_the_missing_collective(tmp_path):
    """dp=2 x tp=2: the output of a Rowwise layer left unreduced differs across tp ranks."""
    from numaudit.agents.layout import PieceLayout
    from tests.auditor.synth import shards

    g = torch.Generator().manual_seed(4)
    h = torch.randn(8, 16, generator=g)
    mesh = dict(world_size=4, mesh={r: [r // 2, r % 2] for r in range(4)},
                register={"mesh_shape": [2, 2], "mesh_dim_names": ["dp", "tp"]})
    ref, cand = RunBuilder("ref"), RunBuilder("cand", **mesh)
    key = dict(step=0, microbatch=0, phase="fwd", site="layers.0.ffn", role="output")
    ref.add_full(h, **key)
    for half, (piece, lay) in enumerate(shards(h, 2)):
        for r in (2 * half, 2 * half + 1):
            t = piece * 0.5 if r == 3 else piece
            cand.add(r, t, PieceLayout(lay.logical_shape, lay.offsets, lay.shape, replica=True),
                     **key)
    write_runs(tmp_path / "a.db", ref, cand)
    f = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32")).first
    assert f.verdict == "replica_divergence"
    assert f.cause is not None
    assert "disagree across ranks 2-3 in cand (mesh tp)" in f.cause.reason
    assert "collective over tp is missing or wrong" in f.cause.reason


def test_one_parameter_without_gradient_in_an_unpipelined_model_is_not_a_cut(tmp_path):
    """The issue's case: one frozen parameter of many, no pipeline: never 'gradients stop at the
    model'; its module's activation gradients were captured, so it is frozen or unused."""
    from tests.auditor.synth import mlp_run

    def freeze(kind, step, mb, site, t):
        return None if kind == "grad" and site == "layers.1.weight" else t

    ref = mlp_run("ref", layers=4)
    cand = mlp_run("cand", layers=4, perturb=freeze)
    write_runs(tmp_path / "a.db", ref, cand)
    report = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32"))
    [gb] = report.graph_breaks
    assert gb.scope == "module" and gb.module == "layers.1"
    assert "gradients stop" not in gb.boundary
    assert "activation gradients reached layers.1" in gb.boundary
    assert "frozen (requires_grad=False) or unused" in gb.boundary


def test_a_batchnorm_of_a_data_parallel_run_is_named_where_it_introduces_a_difference(tmp_path):
    """A data-parallel agent lists its BatchNorm sites in a run label: where one of them
    introduces the first divergence, the cause says why (each rank's statistics); a module the
    label does not list gets no such text."""
    from tests.auditor.synth import mlp_run

    def per_rank_stats(kind, step, mb, site, t):
        if kind == "fwd" and site == "layers.1":  # each half normalized by its own mean
            return torch.cat([h - h.mean() for h in t.chunk(2)])
        return t

    for label, named in (("layers.1, head.bn", True), ("layers.10, layers.0", False)):
        db = tmp_path / f"{named}.db"
        cand = mlp_run("cand", world=2, perturb=per_rank_stats)
        cand.register = {"labels": {"local_batch_stats": label}}
        write_runs(db, mlp_run("ref"), cand)
        f = compare_runs(db, "ref", "cand", preset_policy("fp32")).first
        assert (f.key.phase, f.key.site, f.cause.kind) == ("fwd", "layers.1", "introduced")
        said = "layers.1 is a BatchNorm of data-parallel cand" in f.cause.reason
        assert said == named, f.cause.reason
        if named:  # `auditor watch` says it too
            assert "layers.1 is a BatchNorm of data-parallel cand" in \
                _watched_first(db).cause.reason


def test_a_module_holding_dropout_is_named_where_it_introduces_a_difference(tmp_path):
    """An agent lists its dropout sites in a run label: where the module that introduces the
    first divergence is one of them, or holds one, the cause says that runs drawing other random
    masks differ there by design; a module the label does not cover gets no such text."""
    from tests.auditor.synth import mlp_run

    def other_masks(kind, step, mb, site, t):
        if kind == "fwd" and site == "layers.1":
            return t * (torch.arange(t.numel()).reshape(t.shape) % 5 != 0)
        return t

    cases = (("layers.1.drop", "layers.1 holds dropout (layers.1.drop) in cand"),
             ("layers.1", "layers.1 is a dropout in cand"),
             ("layers.10.drop, layers.0.drop", None))
    for i, (label, said) in enumerate(cases):
        db = tmp_path / f"{i}.db"
        cand = mlp_run("cand", perturb=other_masks)
        cand.register = {"labels": {"dropout_sites": label}}
        write_runs(db, mlp_run("ref"), cand)
        f = compare_runs(db, "ref", "cand", preset_policy("fp32")).first
        assert (f.key.phase, f.key.site, f.cause.kind) == ("fwd", "layers.1", "introduced")
        if said is None:
            assert "dropout" not in f.cause.reason, f.cause.reason
        else:
            assert said in f.cause.reason and "draws its own random masks" in f.cause.reason
    assert "layers.1 is a dropout in cand" in _watched_first(tmp_path / "1.db").cause.reason


def _watched_first(db: Path):
    """The first divergence `auditor watch` announces for ref and cand, both runs stored."""
    from numaudit.auditor.compare.live import LiveComparison
    from numaudit.auditor.store import Reader

    reader = Reader(db)
    try:
        live = LiveComparison(reader, "ref", "cand", preset_policy("fp32"))
        events = live.poll() + live.flush()
    finally:
        reader.close()
    (first,) = [e.finding for e in events if e.first_divergence]
    return first


def test_watch_announces_the_first_divergence_with_the_runs_gradient_scale(tmp_path):
    """`auditor watch` re-evaluates the steps up to the first breach to announce it: with the
    activation-gradient scale the runs' loss normalizations imply, as `compare` does, so the
    x2 activation gradients of a per-rank mean loss over 2 dp ranks are not announced as the
    first divergence ahead of the real one (a parameter gradient here)."""
    from tests.auditor.synth import mlp_run

    def dp2(kind, step, mb, site, t):
        if kind == "bwd":
            return t * 2  # each rank's loss a mean over its half: activation gradients x2
        if kind == "grad" and site == "layers.0.weight":
            return t * 1.5  # the real divergence
        return t

    db = tmp_path / "a.db"
    ref = mlp_run("ref")
    ref.register = {"grad_scale": 1.0}
    cand = mlp_run("cand", world=2, perturb=dp2)
    cand.register = {"grad_scale": 2.0}
    write_runs(db, ref, cand)
    want = compare_runs(db, "ref", "cand", preset_policy("fp32")).first
    assert (want.key.phase, want.key.site) == ("grad", "layers.0.weight")
    assert _watched_first(db).key == want.key


def _seed_runs(db: Path, factor: float, *, head_delta: float = 0.0, loss: bool = True):
    """A head whose activation gradient, the first of backward, is the reference's x `factor`
    (and + `head_delta` on one element) after a loss that matches; the gradients that follow
    carry the same factor."""
    g = torch.Generator().manual_seed(4)
    x, y, gy, gx = (torch.randn(8, 16, generator=g) for _ in range(4))
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, k in ((ref, 1.0), (cand, factor)):
        b.add_full(x, step=0, microbatch=0, phase="fwd", site="body", role="output")
        b.add_full(y, step=0, microbatch=0, phase="fwd", site="head", role="output")
        if loss:
            b.add_full(y.square().mean(), step=0, microbatch=0, phase="loss", site="loss",
                       role="value")
        head = gy * k
        if k != 1.0 and head_delta:
            head[0, 0] += head_delta
        b.add_full(head, step=0, microbatch=0, phase="bwd", site="head", role="grad_output")
        b.add_full(gx * k, step=0, microbatch=0, phase="bwd", site="body", role="grad_output")
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32")).first


def test_an_exact_factor_at_the_first_activation_gradient_is_the_backward_seed(tmp_path):
    """Before: "introduced … the module computes otherwise" at head; what differs is the scale
    backward starts from."""
    f = _seed_runs(tmp_path / "a.db", 2.0)
    assert (f.key.phase, f.key.site) == ("bwd", "head")
    assert f.cause.kind == "introduced"
    assert f.cause.reason.startswith("the first activation gradient of backward is cand's = "
                                     "ref's x2 while the capture before it matched (loss loss "
                                     "value @ step 0 mb 0 identical): what differs is the "
                                     "backward seed, the scale the loss's backward starts from")
    assert "not what head computes" in f.cause.reason
    assert "computes otherwise" not in f.cause.reason


def test_any_difference_at_the_first_activation_gradient_points_at_where_backward_starts(
        tmp_path):
    f = _seed_runs(tmp_path / "a.db", 2.0, head_delta=3.0, loss=False)
    assert (f.key.phase, f.key.site) == ("bwd", "head")
    assert f.cause.reason.startswith("the first activation gradient of backward differs while "
                                     "the capture before it matched (fwd head output @ step 0 "
                                     "mb 0 identical): what differs is where backward starts")


def test_a_breach_amplifying_a_small_difference_names_where_the_runs_first_differ(tmp_path):
    """A module computing almost the same (an exact GELU for a tanh one) stays within tolerance,
    and so does the block around it; the LayerNorm after them breaches by amplifying the small
    difference. The cause names the capture where the runs first differ (the first close after
    an identical one), not only the capture right before the breach."""
    g = torch.Generator().manual_seed(3)
    chain = [("embed", 0.0), ("h.0.mlp", 3e-7), ("h.0", 3e-7), ("h.1.ln", 2e-5)]
    acts = {site: torch.randn(8, 64, generator=g) for site, _ in chain}
    noise = {site: torch.randn(8, 64, generator=g) for site, _ in chain}
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    for b, is_cand in ((ref, False), (cand, True)):
        for site, rel in chain:
            a = acts[site]
            b.add_full(a + rel * noise[site] * a.abs() if is_cand else a, step=0, microbatch=0,
                       phase="fwd", site=site, role="output")
    write_runs(tmp_path / "a.db", ref, cand)
    report = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32"))
    verdicts = {f.key.site: f.verdict for f in report.findings()}
    assert verdicts == {"embed": "identical", "h.0.mlp": "close", "h.0": "close",
                        "h.1.ln": "diverged"}, verdicts
    f = report.first
    assert f.key.site == "h.1.ln" and "may amplify a rounding difference" in f.cause.reason
    assert "the runs first differ at fwd h.0.mlp output @ step 0 mb 0" in f.cause.reason, \
        f.cause.reason
