"""Host-side digest algebra: storage round trips, merging, and the sketch's documented bands."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from numaudit.auditor.compare.digests import algebra as A
from numaudit.auditor.compare.digests.algebra import (
    DigestValues,
    fingerprint_from_int64,
    fingerprint_to_int64,
    merge_disjoint,
    merge_partial,
    sketch_cosine,
    sketch_l2_estimate,
    sketch_rel_error,
)
from numaudit.auditor.compare.digests.metrics import sketch_band
from numaudit.protos import numaudit_pb2 as pb


def test_auditor_digests_imports_no_torch():
    """The daemon imports this module at start-up; torch would cost seconds."""
    code = "import sys, numaudit.auditor.compare.digests.algebra; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_seeds_and_row_layout_match_the_agent():
    from numaudit.agents.digest import digest as agent
    from numaudit.agents.digest import hashing

    assert (A.FINGERPRINT_SEED, A.SKETCH_SEED, A.N_MOMENTS) == (
        agent.FINGERPRINT_SEED, agent.SKETCH_SEED, agent.N_MOMENTS)
    assert A.FINGERPRINT_H == hashing.H_BASE


def test_a_shifted_piece_fingerprint_is_the_one_digested_at_its_new_place():
    """shift_fingerprint moves a digested piece by any number of indices, either way."""
    import torch

    from numaudit.agents.digest.digest import digest_piece
    from numaudit.agents.layout import PieceLayout

    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    for before, after in [(0, 4), (4, 0), (2, 9)]:
        got = fingerprint_from_int64(int(digest_piece(t, PieceLayout((12, 5), (before, 0),
                                                                      (3, 5)))[1][5]))
        want = fingerprint_from_int64(int(digest_piece(t, PieceLayout((12, 5), (after, 0),
                                                                       (3, 5)))[1][5]))
        assert A.shift_fingerprint(got, (after - before) * 5) == want


@pytest.mark.parametrize("u", [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0xDEADBEEFCAFEF00D])
def test_fingerprint_int64_round_trip(u):
    i = fingerprint_to_int64(u)
    assert -(2**63) <= i < 2**63
    assert fingerprint_from_int64(i) == u


def test_fingerprint_int64_rejects_out_of_range():
    with pytest.raises(ValueError, match="fingerprint"):
        fingerprint_to_int64(2**64)
    with pytest.raises(ValueError, match="fingerprint"):
        fingerprint_from_int64(2**63)


def _values(seed: int, n: int = 10, k: int = 8) -> DigestValues:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    return DigestValues(
        numel=n, nan=1, posinf=0, neginf=2, zeros=3, has_moments=True, sum=float(x.sum()),
        sum_sq=float((x * x).sum()), min=float(x.min()), max=float(x.max()),
        abs_max=float(abs(x).max()), fingerprint=int(rng.integers(0, 2**63)) * 2 + 1,
        sketch=rng.normal(size=k),
    )


def test_proto_round_trip():
    d = _values(1)
    msg = d.to_proto(pb.Digest())
    back = DigestValues.from_proto(pb.Digest.FromString(msg.SerializeToString()))
    assert back.fingerprint == d.fingerprint and back.numel == d.numel
    assert (back.sum, back.min, back.max, back.abs_max) == (d.sum, d.min, d.max, d.abs_max)
    np.testing.assert_array_equal(back.sketch, d.sketch)
    assert (msg.fingerprint_seed, msg.sketch_seed) == (A.FINGERPRINT_SEED, A.SKETCH_SEED)


def test_integer_digest_leaves_float_fields_unset():
    d = DigestValues.from_rows([0, 0, math.inf, -math.inf, 0, 0, 0], [4, 0, 0, 0, 1, -5], False)
    assert d.fingerprint == 2**64 - 5 and d.sketch.size == 0
    msg = d.to_proto(pb.Digest())
    assert (msg.sum, msg.min, msg.max) == (0.0, 0.0, 0.0)  # proto3 defaults: unset
    assert len(msg.sketch) == 0 and not msg.has_moments
    back = DigestValues.from_proto(msg)
    assert (back.min, back.max) == (math.inf, -math.inf) and back.fingerprint == d.fingerprint


def test_from_rows_validates_lengths():
    with pytest.raises(ValueError, match="i64_row"):
        DigestValues.from_rows([0.0] * 6, [1, 2, 3], True)
    with pytest.raises(ValueError, match="f64_row"):
        DigestValues.from_rows([0.0] * 3, [0] * 6, True)


def test_merge_disjoint_algebra():
    a, b = _values(1), _values(2)
    m = merge_disjoint([a, b])
    assert m.numel == 20 and m.nan == 2 and m.zeros == 6
    assert m.fingerprint == (a.fingerprint + b.fingerprint) % 2**64
    assert m.min == min(a.min, b.min) and m.abs_max == max(a.abs_max, b.abs_max)
    np.testing.assert_array_equal(m.sketch, a.sketch + b.sketch)
    ident = merge_disjoint([a, DigestValues.empty(True, 8)])
    assert ident.fingerprint == a.fingerprint and ident.min == a.min and ident.sum == a.sum
    assert merge_disjoint([a]).fingerprint == a.fingerprint


def test_merge_refuses_incompatible_pieces():
    a, b = _values(1, k=8), _values(2, k=16)
    with pytest.raises(ValueError, match="sketch"):
        merge_disjoint([a, b])
    c = _values(3)
    c.sketch_seed = 1
    with pytest.raises(ValueError, match="seed"):
        merge_disjoint([a, c])
    with pytest.raises(ValueError, match="no pieces"):
        merge_disjoint([])
    with pytest.raises(ValueError, match="numel"):
        merge_partial([_values(1, n=10), _values(2, n=11)])


def test_merge_partial_marks_what_is_unknown():
    a, b = _values(1), _values(2)
    m = merge_partial([a, b])
    assert not m.exact and m.numel == 10
    assert m.sum == pytest.approx(a.sum + b.sum)
    assert math.isnan(m.sum_sq) and math.isnan(m.min) and m.zeros == -1 and m.fingerprint == 0
    assert m.nonfinite == a.nonfinite + b.nonfinite
    assert merge_disjoint([m, merge_partial([a, b])]).exact is False


# ----------------------------------------------------------------- sketch bands

torch = pytest.importorskip("torch")


def _digest(x, k: int = 256):
    from numaudit.agents.digest.digest import digest_piece
    from numaudit.agents.layout import PieceLayout

    f, i = digest_piece(x, PieceLayout.full(tuple(x.shape)), sketch_k=k)
    return DigestValues.from_rows(f.tolist(), i.tolist(), True)


def _pairs(count: int, seed: int):
    """Reference/candidate pairs: sizes 1k..20k, noise 1e-7..1, several shapes of difference."""
    g = torch.Generator().manual_seed(seed)
    for j in range(count):
        n = int(torch.randint(1_000, 20_000, (1,), generator=g))
        scale = 10.0 ** int(torch.randint(-3, 4, (1,), generator=g))
        a = torch.randn(n, generator=g, dtype=torch.float64) * scale
        level = 10 ** float(torch.empty(1).uniform_(-7, 0, generator=g))
        kind = j % 6
        noise = torch.randn(n, generator=g, dtype=torch.float64)
        if kind == 1:  # heavy-tailed noise
            noise = noise ** 3
        elif kind == 2:  # differences confined to 5% of the elements
            noise = noise * (torch.rand(n, generator=g) < 0.05)
        elif kind == 3:  # one diverged column of a [rows, 64] matrix
            column_7 = torch.arange(64) == 7
            noise = (noise.view(-1)[: n - n % 64].view(-1, 64) * column_7).reshape(-1)
            a = a[: noise.numel()]
        elif kind == 4:  # a contiguous block differs
            mask = torch.zeros(n, dtype=torch.bool)
            s = int(torch.randint(0, n // 2, (1,), generator=g))
            mask[s: s + n // 4] = True
            noise = noise * mask
        elif kind == 5:  # every element off by the same amount (a bias): the most regular
            noise = torch.ones(n, dtype=torch.float64)  # pattern lanes sharing a bucket can see
        b = a + level * a.abs().mean() * noise
        yield a, b


@pytest.mark.parametrize("k", [64, 256])
def test_rel_error_within_documented_band(one_thread, k):
    """|estimate / true - 1| <= 4 nominal sigmas (1/sqrt(2k)) on >= 99% of 300 pairs; the band
    reported is wider (`sketch_band`: read off the estimate, it allows for a low one). At k = 64
    lanes of one block share buckets: their signs must still be uncorrelated (no bias)."""
    sigma_rel = 1 / math.sqrt(2 * k)
    ratios, inside = [], 0
    pairs = list(_pairs(300, seed=7))
    for a, b in pairs:
        true = float((b - a).norm() / a.norm())
        est, sigma = sketch_rel_error(_digest(a, k), _digest(b, k))
        assert sigma == pytest.approx(est * sketch_band(k))
        ratio = est / true
        ratios.append(ratio)
        inside += abs(ratio - 1) <= 4 * sigma_rel
    assert inside >= 0.99 * len(pairs)
    r2 = np.array(ratios) ** 2
    assert abs(r2.mean() - 1) < 4 * math.sqrt(2 / k) / math.sqrt(len(pairs))  # unbiased
    assert np.std(ratios) < 1.25 * sigma_rel


def test_cosine_within_documented_band(one_thread):
    g = torch.Generator().manual_seed(11)
    inside, total = 0, 0
    for j in range(200):
        n = int(torch.randint(1_000, 20_000, (1,), generator=g))
        a = torch.randn(n, generator=g, dtype=torch.float64)
        perp = torch.randn(n, generator=g, dtype=torch.float64)
        perp -= (perp @ a) / (a @ a) * a
        angle = float(torch.empty(1).uniform_(0, math.pi, generator=g)) * (0.001 if j % 2 else 1)
        b = (math.cos(angle) * a / a.norm() + math.sin(angle) * perp / perp.norm()) * 3.0
        true = float(a @ b / (a.norm() * b.norm()))
        est, sigma = sketch_cosine(_digest(a), _digest(b))
        total += 1
        inside += abs(est - true) <= 4 * sigma + 1e-12
    assert inside >= 0.99 * total


def test_identical_and_single_element_differences_are_exact():
    a = torch.randn(5000, dtype=torch.float64)
    da = _digest(a)
    assert sketch_l2_estimate(da, _digest(a.clone())) == (0.0, 0.0)
    assert sketch_cosine(da, da)[0] == 1.0
    b = a.clone()
    b[1234] += 0.5
    est, _ = sketch_l2_estimate(da, _digest(b))
    assert est == pytest.approx(0.5, rel=1e-9)


def test_zero_reference():
    z = _digest(torch.zeros(100, dtype=torch.float64))
    one = _digest(torch.ones(100, dtype=torch.float64))
    assert sketch_rel_error(z, z) == (0.0, 0.0)
    assert sketch_rel_error(z, one) == (math.inf, math.inf)
    with pytest.raises(ValueError, match="sketch"):
        ints = DigestValues.from_rows([0.0] * 5, [1, 0, 0, 0, 0, 0], False)
        sketch_l2_estimate(ints, ints)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_power_of_two_rescaling_is_predicted_from_the_fingerprint_alone(dtype):
    """x * 2**e moves every normal element's exponent by e: its fingerprint follows from x's
    (key_sum over the whole tensor). A zero element breaks the prediction (a false difference,
    never a false equality), and float64 (mixed terms) has no prediction."""
    import torch

    from numaudit.agents.digest.digest import digest_piece
    from numaudit.agents.layout import PieceLayout

    t = torch.randn(37, 5, generator=torch.Generator().manual_seed(4)).to(getattr(torch, dtype))
    layout = PieceLayout.full((37, 5))

    def fp(x):
        return fingerprint_from_int64(int(digest_piece(x, layout)[1][5]))

    for e in (1, 2, -1):
        assert A.scaled_fingerprint(fp(t), 185, dtype, e) == fp(t * 2.0 ** e)
    assert A.scaled_fingerprint(fp(t), 185, dtype, 1) != fp(t * 3.0)
    z = t.clone()
    z[3, 1] = 0
    assert A.scaled_fingerprint(fp(z), 185, dtype, 1) != fp(z * 2.0)
    assert A.scaled_fingerprint(fp(t), 185, "float64", 1) is None
