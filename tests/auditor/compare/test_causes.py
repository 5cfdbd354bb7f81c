"""Causes say what the captured evidence shows, and what to capture when it is missing."""

from __future__ import annotations

from pathlib import Path

import torch

from auditor.compare.engine import compare_runs
from auditor.compare.policy import preset_policy
from tests.auditor.synth import RunBuilder, write_runs


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
