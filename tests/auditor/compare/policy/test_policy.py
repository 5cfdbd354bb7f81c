"""Tolerance policies: defaults, presets, ordered rules, validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from numaudit.auditor.compare.policy.load import (
    DTYPE_TOLERANCES,
    PolicyError,
    load_policy,
    parse_policy,
    preset_policy,
    resolve_policy,
)

ROOT = Path(__file__).resolve().parents[4]


def test_defaults_follow_assert_close_and_the_looser_dtype_wins():
    p = preset_policy(None)
    c = p.check("fwd", "layers.0", "output", "float32", "float32")
    assert (c.metric, c.rtol, c.atol, c.rule) == ("rel_l2", 1.3e-6, 1e-5, "default")
    c = p.check("fwd", "layers.0", "output", "float32", "bfloat16")
    assert (c.rtol, c.atol) == DTYPE_TOLERANCES["bfloat16"]
    assert p.check("input", "tokens", "value", "int64", "int64").metric == "exact"
    assert p.check("fwd", "x", "output", "float64", "float64").rtol == 1e-7


def test_presets():
    assert preset_policy("bitwise").check("fwd", "a", "output", "float32", "float32").metric \
        == "exact"
    bf16 = preset_policy("bf16").check("fwd", "a", "output", "float32", "float32")
    assert (bf16.rtol, bf16.atol) == DTYPE_TOLERANCES["bfloat16"]
    fp32 = preset_policy("fp32").check("fwd", "a", "output", "float64", "float64")
    assert fp32.rtol == DTYPE_TOLERANCES["float32"][0]  # the floor lifts float64
    assert preset_policy("loose").check("grad", "w", "value", "bfloat16", "bfloat16").rtol == 5e-2
    with pytest.raises(PolicyError, match="preset"):
        preset_policy("exactish")


def test_rules_first_match_wins_and_match_on_phase_site_role_dtype():
    p = parse_policy("""
        name = "t"
        [[rule]]
        name = "router"
        match = "fwd:layers.*.moe.gate"
        metric = "cosine"
        threshold = 1e-4
        [[rule]]
        match = "layers.*"
        role = ["grad_output", "grad_input"]
        rtol = 1e-3
        [[rule]]
        dtype = "bfloat16"
        metric = "max_abs"
        threshold = 0.5
        [[rule]]
        phase = ["param", "grad"]
        action = "ignore"
    """, "t.toml")
    c = p.check("fwd", "layers.3.moe.gate", "output", "float32", "float32")
    assert (c.rule, c.metric, c.threshold) == ("rule 1 (router)", "cosine", 1e-4)
    assert p.check("bwd", "layers.3.moe.gate", "output", "float32", "float32").rule == "default"
    c = p.check("bwd", "layers.3.moe", "grad_output", "float32", "float32")
    assert (c.rule, c.rtol, c.atol) == ("rule 2", 1e-3, 1e-5)
    assert p.check("fwd", "head", "output", "float32", "bfloat16").metric == "max_abs"
    assert p.check("grad", "head.weight", "value", "float32", "float32").action == "ignore"


def test_hash_is_stable_and_tracks_content():
    a = parse_policy("[[rule]]\nsite = 'x'\naction = 'ignore'\n", "a.toml")
    b = parse_policy("# comment\n[[rule]]\nsite = 'x'\naction = 'ignore'\n", "a.toml")
    c = parse_policy("[[rule]]\nsite = 'y'\naction = 'ignore'\n", "a.toml")
    assert a.sha256 == b.sha256 != c.sha256
    assert len(a.sha256) == 64
    assert a.describe()["rules"] == [{"index": 1, "sites": ["x"], "action": "ignore"}]


@pytest.mark.parametrize("text, where", [
    ("sigmas = -1", "field 'sigmas'"),
    ("treshold = 1", "field 'treshold': unknown field"),
    ("version = 2", "field 'version'"),
    ("preset = 'fp31'", "field 'preset': 'fp31' is not one of"),
    ("nonfinite = 'sometimes'", "field 'nonfinite'"),
    ("[tolerances.float31]\nrtol = 1", "tolerances.float31: field 'dtype'"),
    ("[tolerances.float32]\nrtol = 'a'", "tolerances.float32: field 'rtol'"),
    ("[[rule]]\nname = 'r'\nmetric = 'cosin'", "rule 1 (r): field 'metric': 'cosin' is not one of"),
    ("[[rule]]\nphase = 'forward'", "rule 1: field 'phase'"),
    ("[[rule]]\nrole = 'out'", "rule 1: field 'role'"),
    ("[[rule]]\nthreshold = 1e-3", "rule 1: field 'metric': a threshold needs"),
    ("[[rule]]\nmetric = 'exact'\nthreshold = 1", "rule 1: field 'threshold'"),
    ("[[rule]]\nmetric = 'rel_l2'\nthreshold = 1\nrtol = 1", "rule 1: field 'threshold'"),
    ("[[rule]]\naction = 'ignore'\nmetric = 'rel_l2'", "rule 1: field 'metric': has no effect"),
    ("[[rule]]\nmatch = 'fdw:x'", "rule 1: field 'match'"),
    ("[[rule]]\nsite = 'a'\n[[rule]]\nsite = 3", "rule 2: field 'site'"),
    ("rule = 3", "field 'rule': must be an array of tables"),
    ("[[rename]]\nregex = '('\nreplace = ''", "rename 1: field 'regex'"),
    ("[[rename]]\nglob = 'a.*'\nreplace = '\\\\3'", "rename 1: field 'replace'"),
    ("[[rename]]\nglob = 'a'", "rename 1: field 'replace': missing"),
    ("[[rename]]\nregex = 'a'\nglob = 'b'\nreplace = ''", "rename 1: field 'regex'"),
    ("[[rename]]\nside = 'left'\nregex = 'a'\nreplace = ''", "rename 1: field 'side'"),
])
def test_malformed_policies_name_file_rule_and_field(text, where):
    with pytest.raises(PolicyError) as err:
        parse_policy(text, "my.toml")
    assert str(err.value).startswith("my.toml: ")
    assert where in str(err.value)


def test_toml_syntax_error_and_unreadable_file(tmp_path):
    with pytest.raises(PolicyError, match=r"^bad.toml: not valid TOML"):
        parse_policy("[[rule]\n", "bad.toml")
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.toml")


def test_shipped_policies_parse_and_preset_overrides():
    for path in sorted((ROOT / "examples" / "policies").glob("*.toml")):
        p = load_policy(path)
        assert p.source == str(path)
    p = load_policy(ROOT / "examples" / "policies" / "default.toml", preset="bf16")
    assert p.preset == "bf16"
    assert resolve_policy("", "loose").preset == "loose"
    assert resolve_policy("", "").source == "defaults"
