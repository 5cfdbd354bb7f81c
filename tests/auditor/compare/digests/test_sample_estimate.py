"""The per-sample estimator (auditor/compare/digests/sample_estimate.py): blocks of samples keyed
within the sample, each with its own label, measure any grouping without bias and within their
stated band; a swap of two samples (whose differences are opposite at every index) is measured where
summing samples keyed alike would read 0; units that do not nest are not measured.

A toy scheme stands in for the agent's hash here (the estimator only needs what the real one
has: bucket = the low bits of a word per within-sample index, a sign per index); the agent's
units are tested against the real scheme in tests/agents/test_sample_digest.py, and the whole
path end to end in tests/e2e/test_regroup.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaudit.agents.digest import hashing
from numaudit.auditor.compare.digests.metrics import sketch_band
from numaudit.auditor.compare.digests.sample_estimate import Units, estimate, fold

M = 96      # elements per sample
BASE_K = 64


def scheme(seed: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.integers(0, 1 << 30, M), g.choice([-1.0, 1.0], M)


def sample_sketch(x: np.ndarray, word: np.ndarray, sign: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros(k)
    np.add.at(out, word % k, sign * x)
    return out


def units_of(samples: np.ndarray, start: int, unit: int, k: int, word, sign, key: int = 0
             ) -> dict:
    """A piece of consecutive samples (rows) at position `start`, as the agent encodes it:
    units of `unit` samples, sample t of a unit with bucket b moved to c = b ^ t, times
    (-1)^popcount(t & c)."""
    n = len(samples)
    out = {n_: [] for n_ in ("key", "pos", "cnt", "size", "k", "moments", "sketch", "fp")}
    for g0 in range(0, n, unit):
        rows = samples[g0:g0 + unit]
        sk = np.zeros(k)
        for t, x in enumerate(rows):
            c = np.arange(k)
            sk += sample_sketch(x, word, sign, k)[c ^ t] * (-1.0) ** np.bitwise_count(c & t)
        out["key"].append(key)
        out["pos"].append(start + g0)
        out["cnt"].append(len(rows))
        out["size"].append(unit)
        out["k"].append(k)
        out["moments"].append([rows.sum(), (rows ** 2).sum(), rows.min(), rows.max(),
                               np.abs(rows).max()])
        out["sketch"].append(sk)
        out["fp"].append(hash(rows.tobytes()) & ((1 << 63) - 1))
    return out


def side(*pieces: dict) -> Units:
    cat = {n: sum((p[n] for p in pieces), []) for n in pieces[0]}
    return Units(key=np.array(cat["key"], np.int64), pos=np.array(cat["pos"], np.int64),
                 cnt=np.array(cat["cnt"], np.int64), size=np.array(cat["size"], np.int64),
                 k=np.array(cat["k"], np.int64), moments=np.array(cat["moments"], np.float64),
                 sketch=np.concatenate(cat["sketch"]), fp=np.array(cat["fp"], np.uint64))


def grouped(x: np.ndarray, groups: list[int], unit_k, word, sign) -> Units:
    """Samples x split into consecutive pieces of the sizes `groups`, each encoded with the
    (unit, k) unit_k(size) gives."""
    pieces, at = [], 0
    for size in groups:
        unit, k = unit_k(size)
        pieces.append(units_of(x[at:at + size], at, unit, k, word, sign))
        at += size
    return side(*pieces)


def per_sample(size: int) -> tuple[int, int]:
    from numaudit.agents.digest.sample_digest import unit_plan
    return unit_plan(size)


def measure(ref: Units, cand: Units, exact: bool = False):
    est = estimate(ref, cand, 1, numel_s=np.array([M]), exact=np.array([exact]))
    d2 = float(est.d2[0])
    sigma = np.sqrt(d2) * float(sketch_band(max(est.k_eff[0], 1.0))) if np.isfinite(
        est.k_eff[0]) else 0.0
    return est, d2, sigma


def test_fold_is_the_sketch_with_fewer_buckets():
    """The agent's scheme: a bucket of k buckets is the bucket of K buckets mod k, signs the
    same, so a folded sketch is the sketch made with fewer buckets (also across 256)."""
    for i in list(range(0, 3000, 7)) + [2 ** 33 + 5]:
        for big, small in ((1024, 256), (1024, 512), (256, 8), (64, 16)):
            b_big, s_big = hashing.bucket_sign(i, big)
            b_small, s_small = hashing.bucket_sign(i, small)
            assert (b_big % small, s_big) == (b_small, s_small)
    x = np.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(fold(x, 2), [[6, 9], [24, 27]])


GROUPINGS = st.sampled_from([[8], [2, 2, 2, 2], [4, 4], [1, 7], [3, 5], [8]])


@settings(max_examples=60, deadline=None)
@given(ref_groups=GROUPINGS, cand_groups=GROUPINGS, seed=st.integers(0, 10_000),
       coarse=st.booleans())
def test_identical_samples_measure_zero_however_they_were_grouped(ref_groups, cand_groups, seed,
                                                                   coarse):
    """The same 8 samples grouped any two ways (per sample, or in units of 4 on one side when
    `coarse`): every block's sketches agree, the distance and its bounds are 0."""
    word, sign = scheme(seed)
    x = np.random.default_rng(seed + 1).standard_normal((8, M))
    unit_k = (lambda n: (4, 8)) if coarse else per_sample
    ref = grouped(x, ref_groups, unit_k, word, sign)
    cand = grouped(x, cand_groups, per_sample, word, sign)
    est, d2, _ = measure(ref, cand)
    assert est.ok[0]
    assert d2 <= 1e-20 * (x ** 2).sum() and est.lower[0] == 0 and est.extremes[0] == 0


def _kinds(g: np.random.Generator, x: np.ndarray) -> dict[str, np.ndarray]:
    """Candidates of the kinds a comparison meets, for reference samples x [16, M]."""
    bias = g.standard_normal(M) * 1e-3
    swapped = x.copy()
    swapped[[3, 11]] = x[[11, 3]]
    flipped = x.copy()
    d = g.standard_normal(M) * 1e-3
    flipped[4] += d
    flipped[5] -= d  # opposite differences at every index of two samples
    one = x.copy()
    one[7] += g.standard_normal(M) * 1e-2
    return {"spread": x + g.standard_normal(x.shape) * 1e-4 * np.abs(x).mean(),
            "same bias in every sample": x + bias, "two samples swapped": swapped,
            "opposite differences": flipped, "one sample": one}


@pytest.mark.parametrize("ref_groups, cand_groups, unit_k", [
    ([16], [4, 4, 4, 4], per_sample),         # accumulation 4x4 against one batch of 16
    ([8, 8], [2] * 8, per_sample),            # dp ranks' local microbatches
    ([16], [16], lambda n: (2, 8)),           # coarse units of 2 on both sides
    ([32 // 2] * 2, [4] * 8, lambda n: (4, 8) if n > 4 else per_sample(n)),
])
def test_estimates_are_unbiased_and_within_their_band(ref_groups, cand_groups, unit_k):
    """Over 200 draws of the scheme per kind of difference: E[d2] is ||d||^2 (within 3 standard
    errors), and the truth lies within 4 of the stated sigmas for at least 99% of draws, for
    differences spread over every sample, the same in every sample (a bias: the blocks share
    the within-sample scheme, so their errors add coherently and the band is one block's),
    confined to one sample, and opposite in two samples (which a sum of samples keyed alike
    would cancel)."""
    n = sum(ref_groups)
    g = np.random.default_rng(7)
    x = g.standard_normal((n, M))
    for kind, cand_x in _kinds(g, x).items():
        truth = float(((cand_x - x) ** 2).sum())
        ratios, inside = [], 0
        for seed in range(200):
            word, sign = scheme(1000 + seed)
            ref = grouped(x, ref_groups, unit_k, word, sign)
            cand = grouped(cand_x, cand_groups, per_sample, word, sign)
            est, d2, sigma = measure(ref, cand)
            assert est.ok[0], kind
            ratios.append(d2 / truth)
            inside += abs(np.sqrt(d2) - np.sqrt(truth)) <= 4 * sigma
        ratios = np.array(ratios)
        assert abs(ratios.mean() - 1) <= 3 * ratios.std() / np.sqrt(len(ratios)) + 1e-9, kind
        assert inside >= 198, (kind, inside)
        if kind in ("two samples swapped", "opposite differences"):
            assert ratios.min() > 1e-3, kind  # never 0: no sample cancels another


def test_samples_summed_keyed_alike_would_cancel_a_swap():
    """Why each sample of a block has its own label: summing within-sample sketches without
    them reads a swap of two samples as nothing, at every draw of the scheme."""
    g = np.random.default_rng(3)
    x = g.standard_normal((4, M))
    swapped = x[[1, 0, 2, 3]]
    word, sign = scheme(5)

    def unlabeled(rows):
        return sum(sample_sketch(r, word, sign, 8) for r in rows)

    assert np.abs(unlabeled(swapped) - unlabeled(x)).max() < 1e-12
    est, d2, _ = measure(side(units_of(x, 0, 4, 8, word, sign)),
                         side(units_of(swapped, 0, 4, 8, word, sign)))
    assert d2 > 0.2 * ((swapped - x) ** 2).sum()


def test_units_that_do_not_nest_or_outgrow_their_labels_are_not_measured():
    word, sign = scheme(1)
    x = np.random.default_rng(2).standard_normal((12, M))
    # units of 2 at positions 0, 2, ... against units of 2 at 1, 3, ...: no block aligns them
    ref = side(units_of(x[:12], 0, 2, 8, word, sign))
    cand = side(units_of(x[:1], 0, 1, 8, word, sign), units_of(x[1:11], 1, 2, 8, word, sign),
                units_of(x[11:], 11, 1, 8, word, sign))
    assert not measure(ref, cand)[0].ok[0]
    # a block of 12 samples needs 12 labels: past 8 buckets
    ref = side(units_of(x[:8], 0, 8, 8, word, sign), units_of(x[8:], 8, 4, 8, word, sign))
    cand = side(units_of(x[:4], 0, 4, 8, word, sign), units_of(x[4:], 4, 8, 8, word, sign))
    assert not measure(ref, cand)[0].ok[0]
    # a side that misses a sample of the block
    ref = side(units_of(x[:4], 0, 1, 8, word, sign))
    cand = side(units_of(x[:3], 0, 1, 8, word, sign))
    assert not measure(ref, cand)[0].ok[0]


def test_exact_blocks_scales_and_bounds():
    """Blocks whose fingerprints agree count an exact 0 (the band narrows to the blocks that
    differ); a reference scaled by the runs' factor compares as scaled; the norm and extreme
    bounds of the blocks bound the distance from below."""
    word, sign = scheme(4)
    x = np.random.default_rng(5).standard_normal((8, M))
    y = x.copy()
    y[2] += 1.0
    ref = side(units_of(x, 0, 1, 16, word, sign))
    cand = side(units_of(y, 0, 1, 16, word, sign))
    est, d2, _ = measure(ref, cand, exact=True)
    assert (est.blocks[0], est.identical[0]) == (8, 7)
    assert est.k_eff[0] == pytest.approx(16 / (1 if d2 else 1), rel=0.5)
    truth = np.sqrt(((y - x) ** 2).sum())
    assert est.lower[0] <= truth and est.extremes[0] <= np.abs(y - x).max() + 1e-12
    assert est.lower[0] > 0.5 * abs(np.linalg.norm(y[2]) - np.linalg.norm(x[2]))
    scaled = side(units_of(2 * x, 0, 1, 16, word, sign))
    est = estimate(ref, scaled, 1, numel_s=np.array([M]), scale=np.array([2.0]))
    assert est.d2[0] <= 1e-24 * (x ** 2).sum()
