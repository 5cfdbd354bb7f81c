"""Graph breaks at modules inside a repeated block (agents/capture/sites.py, block_depth:
transformers' model.layers.N.input_layernorm at depth 4 is hooked under the default max_depth of 3).

- hooked anyway (it has fwd captures): not explained as "deeper than max_depth";
- deeper in its block than block_depth reaches: raise block_depth (or max_depth);
- within block_depth's reach yet without captures: the agent did not hook it, no depth advice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.wire.labels import BLOCK_DEPTH_LABEL, BLOCK_LISTS_LABEL, CAPTURE_DEPTH_LABEL
from tests.auditor.synth import RunBuilder, write_runs


def _break_at(tmp_path: Path, module: str, labels: dict, *, hooked: bool = False) -> str:
    """cand's gradient of `module`'s weight is None, and cand holds no activation gradient of
    `module`; both runs capture the block and the head, and (`hooked`) the forward of `module`
    itself. The graph break's boundary text."""
    g = torch.Generator().manual_seed(1)
    sites = ("model.layers.0", "lm_head") + ((module,) if hooked else ())
    acts = {m: torch.randn(4, 8, generator=g) for m in sites}
    grads = {s: torch.randn(8, 8, generator=g) for s in (f"{module}.weight", "lm_head.weight")}
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    cand.register = {"labels": labels}
    for b, is_cand in ((ref, False), (cand, True)):
        for m, a in acts.items():
            b.add_full(a, step=0, microbatch=0, phase="fwd", site=m, role="output")
            if not (is_cand and m == module):
                b.add_full(a * 0.5, step=0, microbatch=0, phase="bwd", site=m,
                           role="grad_output")
        for site, gw in grads.items():
            if is_cand and site.startswith(module):
                b.add_none(0, step=0, site=site)
            else:
                b.add_full(gw, step=0, microbatch=-1, phase="grad", site=site, role="value")
    report = compare_runs(write_runs(tmp_path / "b.db", ref, cand), "ref", "cand",
                          preset_policy("fp32"))
    [gb] = report.graph_breaks
    assert gb.module == module
    return gb.boundary


def test_a_break_at_a_module_hooked_inside_a_block_is_not_blamed_on_depth(tmp_path: Path):
    boundary = _break_at(tmp_path, "model.layers.0.input_layernorm",
                         {CAPTURE_DEPTH_LABEL: "3"}, hooked=True)
    assert "NUMAUDIT_DEPTH" not in boundary and "max_depth" not in boundary, boundary
    assert "the forward of model.layers.0.input_layernorm" in boundary, boundary


BLOCKS = {CAPTURE_DEPTH_LABEL: "3", BLOCK_DEPTH_LABEL: "1",
          BLOCK_LISTS_LABEL: "model.layers"}


def test_a_break_deeper_in_its_block_than_block_depth_says_to_raise_block_depth(tmp_path):
    boundary = _break_at(tmp_path, "model.layers.0.mlp.up_proj", BLOCKS)
    assert "2 levels inside the repeated block model.layers.0" in boundary, boundary
    assert "raise block_depth to 2 (NUMAUDIT_BLOCK_DEPTH=2" in boundary, boundary
    assert "or max_depth to 5 (NUMAUDIT_DEPTH=5" in boundary, boundary


def test_a_break_within_block_depth_was_not_hooked_not_too_deep(tmp_path):
    boundary = _break_at(tmp_path, "model.layers.0.mlp", BLOCKS)
    assert "the agent did not hook it" in boundary, boundary
    assert "NUMAUDIT_DEPTH" not in boundary and "block_depth" not in boundary, boundary


@pytest.mark.parametrize("labels", [
    {CAPTURE_DEPTH_LABEL: "3"},  # an agent from before the block labels
    {**BLOCKS, BLOCK_LISTS_LABEL: "model.norms"},  # its block is no ModuleList's child
])
def test_without_a_known_block_a_deep_break_says_to_raise_max_depth(tmp_path, labels):
    boundary = _break_at(tmp_path, "model.layers.0.mlp.up_proj", labels)
    assert "raise max_depth to 5 (NUMAUDIT_DEPTH=5" in boundary, boundary
    assert "NUMAUDIT_BLOCK_DEPTH" not in boundary, boundary
