"""A module below the agent's max_depth that was hooked anyway, inside a repeated block
(agents/capture/sites.py, block_depth: transformers' model.layers.N.input_layernorm at depth 4 under
the default max_depth of 3): a graph break there is not explained as "deeper than max_depth"."""

from __future__ import annotations

from pathlib import Path

import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.wire.labels import CAPTURE_DEPTH_LABEL
from tests.auditor.synth import RunBuilder, write_runs


def test_a_break_at_a_module_hooked_inside_a_block_is_not_blamed_on_depth(tmp_path: Path):
    g = torch.Generator().manual_seed(0)
    acts = {m: torch.randn(4, 8, generator=g)
            for m in ("model.layers.0.input_layernorm", "model.layers.0", "lm_head")}
    grads = {s: torch.randn(8, 8, generator=g)
             for s in ("model.layers.0.input_layernorm.weight", "lm_head.weight")}
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    cand.register = {"labels": {CAPTURE_DEPTH_LABEL: "3"}}
    for b, is_cand in ((ref, False), (cand, True)):
        for m, a in acts.items():
            b.add_full(a, step=0, microbatch=0, phase="fwd", site=m, role="output")
        for m, a in reversed(acts.items()):
            if not (is_cand and m == "model.layers.0.input_layernorm"):
                b.add_full(a * 0.5, step=0, microbatch=0, phase="bwd", site=m,
                           role="grad_output")
        for site, gw in grads.items():
            if is_cand and site.startswith("model.layers.0.input_layernorm"):
                b.add_none(0, step=0, site=site)
            else:
                b.add_full(gw, step=0, microbatch=-1, phase="grad", site=site, role="value")
    report = compare_runs(write_runs(tmp_path / "a.db", ref, cand), "ref", "cand",
                          preset_policy("fp32"))
    [gb] = report.graph_breaks
    assert gb.module == "model.layers.0.input_layernorm"
    assert "NUMAUDIT_DEPTH" not in gb.boundary and "max_depth" not in gb.boundary, gb.boundary
    assert "the forward of model.layers.0.input_layernorm" in gb.boundary, gb.boundary
