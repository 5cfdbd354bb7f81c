"""Findings grouped by cause (auditor.compare.explain.groups): the compact key lists, the templates
that decide which causes are one, and what a group shares."""

from __future__ import annotations

import itertools
import re

from hypothesis import given
from hypothesis import strategies as st

from numaudit.auditor.compare.explain.groups import template
from numaudit.auditor.compare.explain.site_sets import compact_sites, shorten


def _expand(text: str) -> set[str]:
    """The names a compact text stands for (braces and numeric ranges expanded)."""
    out: set[str] = set()
    for item in text.split(", "):
        parts = []
        for part in re.split(r"\.(?![^{]*})", item):
            choices = part[1:-1].split(",") if part.startswith("{") else [part]
            names = []
            for c in choices:
                m = re.fullmatch(r"(\d+)-(\d+)", c)
                names += [str(i) for i in range(int(m[1]), int(m[2]) + 1)] if m else [c]
            parts.append(names)
        out |= {".".join(p) for p in itertools.product(*parts)}
    return out


def test_a_transformers_parameters_read_compactly():
    names = ["tok.weight"] + [f"layers.{i}.{m}.{p}" for i in range(4)
                              for m in ("norm", "w1", "w2") for p in ("weight", "bias")]
    names += ["norm.weight", "norm.bias", "out.weight", "out.bias"]
    text = compact_sites(names)
    assert text == "tok.weight, layers.0-3.{norm,w1,w2}.{weight,bias}, {norm,out}.{weight,bias}"
    assert _expand(text) == set(names)


def test_a_module_and_its_submodules():
    names = ["layers.0", "layers.0.w1", "layers.1", "layers.1.w1", "layers.3.w1"]
    text = compact_sites(names)
    assert text == "layers.0-1, layers.0-1.w1, layers.3.w1"
    assert _expand(text) == set(names)


_part = st.sampled_from(["layers", "0", "1", "2", "10", "w1", "attn", "weight", "bias"])


@given(st.lists(st.lists(_part, min_size=1, max_size=4).map(".".join), min_size=1,
                max_size=30))
def test_the_compact_text_stands_for_exactly_the_names(names):
    assert _expand(compact_sites(names)) == set(names)


def test_shorten_says_how_many_it_left_out():
    text = ", ".join(f"site{i}" for i in range(40))
    short = shorten(text, 50)
    assert len(short) <= 50 and short.endswith("more")
    kept = short.split(", +")[0].split(", ")
    assert int(short.rsplit("+", 1)[1].split()[0]) == 40 - len(kept)
    assert shorten("a, b", 50) == "a, b"


def test_templates_take_out_what_names_one_key():
    a = ("the previous capture in execution order (fwd tok output @ step 1 mb 1) already "
         "differs (diverged)")
    b = ("the previous capture in execution order (bwd layers.3.w2 grad_output @ step 0 mb 3) "
         "already differs (diverged)")
    assert template(a) == template(b) == "the previous capture in execution order already differs"
    c = ("forward and backward activations match, gradients do not: all 1424 activations and "
         "1072 activation gradients of the step (16 of them at layers.1.norm itself) are "
         "identical")
    d = c.replace("16 of them at layers.1.norm", "2 of them at out")
    assert template(c) == template(d)
    assert template("replicas of grad a.weight value @ step 0 disagree", "a.weight") == \
        template("replicas of grad b.weight value @ step 0 disagree", "b.weight")
    assert template("its input (x) is identical") != template("its input (x) already differs")
