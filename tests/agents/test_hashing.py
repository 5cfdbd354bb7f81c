"""The hash scheme's properties that the digest's guarantees rest on (agents/digest/hashing.py)."""

from __future__ import annotations

import numpy as np
import torch

from numaudit.agents.digest import hashing as H


def test_every_fingerprint_key_is_odd():
    """An odd key makes key * V a bijection mod 2**64: one changed element always shows."""
    assert all(H.lane_key(j) & 1 for j in range(H.LANES))
    assert all(H.key(i) & 1 for i in [0, 1, 255, 256, 2**32 + 7, 2**62 + 3])
    assert all(H.block_power(b) & 1 for b in [0, 1, 999, 2**40 + 1])


def test_keys_are_lane_times_block_power():
    """K(i) = T[i mod 256] * P(i div 256), the split every kernel computes, with P(b) from the
    byte table up to blocks of 2**56."""
    table = H.power_table()
    for i in [0, 7, 256 * 3 + 9, 2**32 + 5, 2**63 + 2**40 + 17]:
        b = i >> H.LANE_BITS
        p = 1
        for t in range(H.POW_BYTES):
            p = p * table[t][(b >> (8 * t)) & 255] & H.M64
        assert p == H.block_power(b)
        assert H.key(i) == H.lane_key(i & 255) * p & H.M64


def test_h_has_the_largest_order_mod_2_64():
    """h = 5 mod 8 generates a cyclic group of order 2**62: keys repeat only 2**62 apart."""
    assert H.H_BASE % 8 == 5
    assert pow(H.H_BASE, 1 << 61, 1 << 64) != 1 and pow(H.H_BASE, 1 << 62, 1 << 64) == 1


def test_a_fingerprint_shifts_by_one_multiplication():
    """The fingerprint of a run of values at offset g, times h**d, is that of the same values
    at g + d (d of either sign): what lets the auditor place a piece after the fact."""
    import random
    rng = random.Random(3)
    vals = [rng.getrandbits(64) for _ in range(300)]

    def fp(g):
        return sum(H.key(g + t) * v for t, v in enumerate(vals)) & H.M64

    for g, d in [(0, 1), (5, 300), (1000, -999), (2**40, 2**33 + 3)]:
        assert H.shift(fp(g), d) == fp(g + d)


def test_torch_block_powers_match_the_definition():
    b = torch.tensor([0, 1, 255, 256, 65537, 2**40 + 3, 2**55 + 2**48 + 9])
    got = [int(x) & H.M64 for x in H.block_powers(b, int(b.max()))]
    assert got == [H.block_power(int(x)) for x in b]


def test_bent_signs_have_zero_autocorrelation():
    """For every lane shift d != 0, sum over s of (-1)^(bent(u^s) ^ bent(u^d^s)) is 0: two lanes
    of a block sharing a bucket get uncorrelated signs over the blocks' random shifts."""
    f = np.array([H.bent(u) for u in range(H.LANES)])
    sign = 1 - 2 * f
    for d in range(1, H.LANES):
        assert int((sign * sign[np.arange(H.LANES) ^ d]).sum()) == 0, d


def test_placement_rows_are_permutations_of_the_groups():
    place = H.place_table()
    assert place.shape == (H.PLACE_ROWS, H.GROUPS)
    groups = np.sort(place & 31, axis=1)
    assert (groups == np.arange(H.GROUPS)).all()
    lane_xor = place >> 5
    assert set(np.unique(lane_xor)) == set(range(8))
    assert len({row.tobytes() for row in place}) == H.PLACE_ROWS  # rows differ


def test_a_lane_group_lands_in_one_bucket_group():
    """8 consecutive lanes go to 8 consecutive buckets (the kernels add them as one vector)."""
    for k in (8, 64, 256, 4096):
        for i0 in (0, 8 * 37, 2**40 + 8 * 5):
            buckets = [H.bucket_sign(i0 + r, k)[0] for r in range(8)]
            assert sorted(buckets) == list(range(min(buckets), min(buckets) + 8))
            assert min(buckets) % 8 == 0


def test_torch_tables_match_the_definition():
    table, bent, lane, shifted, place_g, place_x = H.tables(torch.device("cpu"))
    assert [int(v) & H.M64 for v in table[:4]] == [H.lane_key(j) for j in range(4)]
    assert bent.tolist() == [H.bent(u) for u in range(H.LANES)]
    assert int(shifted[5, 9]) == H.bent(9 ^ 5)
    place = H.place_table()
    assert (place_g.numpy() == (place & 31)).all() and (place_x.numpy() == (place >> 5)).all()
