"""Exact factors between two runs' tensors and the counts that name them
(auditor.compare.explain.factors): the pure functions, without processes or stores."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numaudit.auditor.compare.explain.factors import (
    MAX_NAMED,
    Count,
    exact_factor,
    name_factor,
    snap,
)

PP = Count(4, "pp_microbatches of pp", "pp's schedule divides by n_microbatches")
DP = Count(2, "dp ranks of ddp", "a sum over the dp ranks where a mean was meant")


@pytest.mark.parametrize("f, want", [
    (4.0, (4, False)),
    (0.25, (4, True)),
    (4.0 * (1 + 5e-6), (4, False)),   # within INTEGER_RTOL of 4
    (1 / (3.0 * (1 - 5e-6)), (3, True)),
    (2.0, (2, False)),
    (float(MAX_NAMED), (MAX_NAMED, False)),
])
def test_snap_finds_an_integer_or_its_inverse(f, want):
    assert snap(f) == want


@pytest.mark.parametrize("f", [1.0, 1.5, 2.5, 4.001, 0.3, 0.0, -4.0, math.nan, math.inf,
                               float(MAX_NAMED + 1), 1 / (MAX_NAMED + 1)])
def test_snap_refuses_what_no_count_can_be(f):
    """1 (no factor), non-integers, a ratio off by more than the rounding of a norm ratio,
    signs, non-finite values and integers beyond any count of a run's work."""
    assert snap(f) is None


def test_name_factor_names_the_count_it_matches():
    assert name_factor(4.0, [DP, PP]) == \
        "x4 = 4 pp_microbatches of pp: pp's schedule divides by n_microbatches"


def test_name_factor_writes_an_inverse_as_one_over_the_count():
    assert name_factor(0.5, [DP, PP]) == \
        "x1/2 = 1/(2 dp ranks of ddp): a sum over the dp ranks where a mean was meant"


def test_name_factor_joins_every_count_of_that_value():
    mbs = Count(4, "microbatches a step of ref", "accumulation without dividing")
    text = name_factor(4.0, [PP, mbs, Count(4, "pp_microbatches of pp", "again")])
    assert text.startswith("x4 = 4 pp_microbatches of pp = microbatches a step of ref: ")
    assert text.count("pp_microbatches of pp") == 1  # the same name once
    assert "n_microbatches; accumulation without dividing; again" in text


def test_name_factor_without_a_count_says_power_of_two_or_plain_integer():
    eight = name_factor(8.0, [DP, PP])
    assert eight.startswith("x8, a power of two no count of the runs' work explains")
    assert name_factor(1 / 16, []).startswith("x1/16, a power of two")
    three = name_factor(3.0, [DP, PP])
    assert three == "x3, an integer ratio no count of the runs' work explains"
    assert "power of two" not in three


@pytest.mark.parametrize("f", [2.5, 1.0, 1.1, math.nan, 0.0])
def test_name_factor_of_a_non_integer_is_empty(f):
    assert name_factor(f, [DP, PP]) == ""


def test_exact_factor_holds_for_every_element_scaled_within_one_rounding():
    rng = np.random.default_rng(0)
    r = rng.standard_normal(1000).astype(np.float32)
    assert exact_factor(r, r * np.float32(4), 4.0, "float32")
    assert exact_factor(r, r * np.float32(0.25), 0.25, "float32")
    # x3 rounds in float32: one rounding of float32 is allowed, not of float64
    c3 = (r * np.float32(3)).astype(np.float32)
    assert exact_factor(r, c3, 3.0, "float32")
    assert not exact_factor(r, c3, 3.0, "float64")


def test_exact_factor_fails_on_one_element_off_or_another_factor():
    rng = np.random.default_rng(1)
    r = rng.standard_normal(256).astype(np.float32)
    c = r * np.float32(4)
    c[17] = np.nextafter(np.nextafter(c[17], np.float32(np.inf)), np.float32(np.inf))
    c[17] *= np.float32(1.001)
    assert not exact_factor(r, c, 4.0, "float32")
    assert not exact_factor(r, r * np.float32(4), 2.0, "float32")


@pytest.mark.parametrize("ref, cand", [
    (np.zeros(8, np.float32), np.zeros(8, np.float32)),          # nothing proves the factor
    (np.ones(8, np.float32), np.full(4, 4, np.float32)),          # shapes differ
    (np.array([1, np.nan], np.float32), np.array([4, np.nan], np.float32)),
    (np.array([1, np.inf], np.float32), np.array([4, np.inf], np.float32)),
    (np.zeros(0, np.float32), np.zeros(0, np.float32)),
])
def test_exact_factor_refuses_what_the_bytes_cannot_prove(ref, cand):
    assert not exact_factor(ref, cand, 4.0, "float32")
