"""The drill-down plan file: the one format `auditor drill` writes and agents read."""

from __future__ import annotations

import pytest

from numaudit.wire.plan import Plan, format_plan, parse_plan, read_plan


def test_a_plan_round_trips():
    plan = Plan(ops=("layers.1.attention", "layers.1"), steps=(0, 7),
                payload=("fwd:layers.1.attention",), reason='introduced: "x"\nnext',
                runs={"ref": "ref", "cand": "pp8"})
    assert parse_plan(format_plan(plan)) == plan


@pytest.mark.parametrize("text,field", [
    ("ops = ['a']\n", "version"),
    ("version = 1\n", "ops"),
    ("version = 1\nops = ['a']\nsteps = [-1]\n", "steps"),
    ("version = 1\nops = ['a']\nsteps = ['0']\n", "steps"),
    ("version = 1\nops = [1]\n", "ops"),
    ("version = 1\nops = ['a']\npayload = 'fwd:a'\n", "payload"),
    ("version = 1\nops = ['a']\nbogus = 1\n", "unknown key"),
    ("version = 1\nops = ['a'", "not valid TOML"),
])
def test_bad_plans_are_refused_naming_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        parse_plan(text)


def test_a_file_too_large_or_missing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        read_plan(tmp_path / "absent.toml")
    big = tmp_path / "big.toml"
    big.write_text("version = 1\nops = ['a']\n" + "#" * (70 << 10))
    with pytest.raises(ValueError, match="not a drill-down plan"):
        read_plan(big)
