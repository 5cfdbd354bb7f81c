"""Key alignment: site normalization, rename rules, execution order."""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.read.align import (
    RenameRule,
    canonical_sites,
    exec_order,
    fill_positions,
    glob_to_regex,
    normalize_site,
)
from numaudit.wire.vocabulary import PHASE_IDS


def test_normalize_site_strips_wrappers_like_the_agent():
    from numaudit.agents.capture.sites import normalize_site as agent_normalize

    for name in ("_orig_mod.module.layers.0._checkpoint_wrapped_module.moe",
                 "module.layers.1._fsdp_wrapped_module.attention.wq",
                 "layers.2.module.x", "module", "output.weight"):
        assert normalize_site(name) == agent_normalize(name)
    assert normalize_site("_orig_mod.layers.0._checkpoint_wrapped_module.moe") == "layers.0.moe"
    assert normalize_site("layers.2.module.x") == "layers.2.module.x"  # only a leading `module`


def test_glob_rename_numbers_its_wildcards():
    rule = RenameRule(glob_to_regex("stages.*.layers.*"), r"layers.\2")
    assert rule.apply("stages.1.layers.7.moe") == "layers.7.moe"
    assert rule.apply("embed") == "embed"


def test_canonical_sites_per_side_and_collisions():
    names = {1: "stages.0.layers.0", 2: "layers.0", 3: "_orig_mod.head"}
    rules = [RenameRule(r"^stages\.\d+\.", "", side="cand")]
    ref, w_ref = canonical_sites(names, rules, "ref")
    cand, w_cand = canonical_sites(names, rules, "cand")
    assert ref == {1: "stages.0.layers.0", 2: "layers.0", 3: "head"}
    assert cand == {1: "layers.0", 2: "layers.0", 3: "head"}
    assert not w_ref and w_cand and "both align as 'layers.0'" in w_cand[0]


def test_exec_order_steps_params_microbatches_phases_stages():
    P = PHASE_IDS
    keys = [  # (step, mb, phase, stage, position)
        (0, -1, P["grad"], 0, 1.0),
        (0, 1, P["fwd"], 0, 5.0),
        (0, 0, P["bwd"], 0, 9.0),
        (0, 0, P["bwd"], 1, 8.0),
        (0, 0, P["loss"], 1, 7.0),
        (0, 0, P["fwd"], 1, 3.0),
        (0, 0, P["fwd"], 0, 4.0),
        (0, 0, P["input"], 0, 2.0),
        (0, -1, P["param"], 0, 99.0),
        (1, -1, P["param"], 0, 0.0),
    ]
    a = np.array(keys, dtype=np.float64)
    order = exec_order(a[:, 0].astype(np.int64), a[:, 1].astype(np.int64),
                       a[:, 2].astype(np.int64), a[:, 3].astype(np.int64), a[:, 4])
    got = [keys[i] for i in order]
    assert got == [
        (0, -1, P["param"], 0, 99.0),   # the step's weights first
        (0, 0, P["input"], 0, 2.0),
        (0, 0, P["fwd"], 0, 4.0),       # stage 0 before stage 1 in forward
        (0, 0, P["fwd"], 1, 3.0),
        (0, 0, P["loss"], 1, 7.0),
        (0, 0, P["bwd"], 1, 8.0),       # stage 1 before stage 0 in backward
        (0, 0, P["bwd"], 0, 9.0),
        (0, 1, P["fwd"], 0, 5.0),
        (0, -1, P["grad"], 0, 1.0),     # gradients after every microbatch
        (1, -1, P["param"], 0, 0.0),
    ]


def test_fill_positions_places_candidate_only_keys_after_their_predecessor():
    group = np.array([0, 0, 0, 0, 1, 1])
    own = np.array([10.0, 11.0, 12.0, 13.0, 20.0, 21.0])
    ref = np.array([100.0, np.nan, 101.0, np.nan, np.nan, 300.0])
    pos = fill_positions(group, own, ref)
    assert pos[0] == 100 and pos[2] == 101 and pos[5] == 300
    assert 100 < pos[1] < 101 < pos[3] < 102
    assert pos[4] < 300  # first of its group with no known predecessor: before the known ones
