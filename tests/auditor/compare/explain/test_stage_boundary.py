"""Where backward stopped in a pipeline: the stage boundary a graph break is explained at."""

from __future__ import annotations

from pathlib import Path

import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from tests.auditor.synth import RunBuilder, write_runs

V_PLACEMENT = {0: [0, 3], 1: [1, 2]}
"""DualPipeV's (and ZBV's) placement of 4 stages on 2 ranks: rank 0 holds the first and the last."""


def _v_runs(db: Path, detached: int):
    """ref and cand both 4 stages in a V on 2 ranks, one block each (layers.s in stage s);
    in cand stage `detached` detaches its input, so every stage before it gets all-zero
    activation and parameter gradients while it and the later ones are unchanged."""
    g = torch.Generator().manual_seed(5)
    owner = {s: r for r, stages in V_PLACEMENT.items() for s in stages}
    acts = {s: torch.randn(4, 8, generator=g) for s in range(4)}
    grads = {(s, p): torch.randn(8, 8, generator=g) for s in range(4) for p in ("weight", "bias")}
    ref = RunBuilder("ref", world_size=2, stages=V_PLACEMENT)
    cand = RunBuilder("cand", world_size=2, stages=V_PLACEMENT)
    for b, is_cand in ((ref, False), (cand, True)):
        cut = is_cand and detached
        for s in range(4):
            b.add(owner[s], acts[s], step=0, microbatch=0, phase="fwd", site=f"layers.{s}",
                  role="output", stage=s)
        for s in reversed(range(4)):  # backward runs the last stage first
            gy = torch.zeros(4, 8) if cut and s < detached else acts[s] * 0.5
            b.add(owner[s], gy, step=0, microbatch=0, phase="bwd", site=f"layers.{s}",
                  role="grad_output", stage=s)
        for (s, p), gw in grads.items():
            gw = torch.zeros_like(gw) if cut and s < detached else gw
            b.add(owner[s], gw, step=0, microbatch=-1, phase="grad", site=f"layers.{s}.{p}",
                  role="value", stage=s)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_a_detach_in_a_v_schedule_names_the_boundary_backward_stopped_at(tmp_path):
    """Stage 2 (rank 1's second stage) detaches its input: stages 0 and 1 get no gradient. The
    break is explained at stage 1, the first backward reaches without gradients, and at the
    1 -> 2 boundary, with stage 1's own activation gradients as the evidence; not at stage 0."""
    report = _v_runs(tmp_path / "a.db", detached=2)
    breaks = {b.stage: b for b in report.graph_breaks}
    assert set(breaks) == {0, 1} and {b.scope for b in breaks.values()} == {"stage"}
    assert breaks[0].boundary == ""
    text = breaks[1].boundary
    assert text.startswith("gradients stop at stage 1 (the first without non-zero parameter "
                           "gradients in cand, as backward runs the stages last to first; "
                           "stages 0-1 are all without them), at the stage 1 -> 2 boundary "
                           "(stage 2's parameters received gradients)"), text
    assert "activation gradients arriving at stage 1 are all zero (1 of 1 bwd captures): the " \
           "graph is cut at the boundary (a detach or a no_grad)" in text
    assert "stage 0 ->" not in text and "at stage 0" not in text


def test_a_detach_at_the_last_stage_of_the_v_names_the_2_to_3_boundary(tmp_path):
    """Stage 3, on rank 0 with stage 0, detaches its input: the cut is at 2 -> 3, on rank 1's
    side of the V, though stages 0 and 3 share a rank."""
    report = _v_runs(tmp_path / "a.db", detached=3)
    [text] = [b.boundary for b in report.graph_breaks if b.boundary]
    assert text.startswith("gradients stop at stage 2 (the first without non-zero parameter "
                           "gradients in cand, as backward runs the stages last to first; "
                           "stages 0-2 are all without them), at the stage 2 -> 3 boundary"), text
    assert "activation gradients arriving at stage 2 are all zero" in text


def test_a_detach_at_stage_1_keeps_the_single_stage_text(tmp_path):
    report = _v_runs(tmp_path / "a.db", detached=1)
    [gb] = report.graph_breaks
    assert gb.stage == 0
    assert gb.boundary.startswith("gradients stop at stage 0 (the first without non-zero "
                                  "parameter gradients in cand), at the stage 0 -> 1 boundary "
                                  "(stage 1's parameters received gradients): activation "
                                  "gradients arriving at stage 0 are all zero")
