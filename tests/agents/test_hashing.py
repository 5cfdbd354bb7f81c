"""The hash scheme's properties that the digest's guarantees rest on (agents/hashing.py)."""

from __future__ import annotations

import numpy as np
import torch

from agents import hashing as H


def test_every_fingerprint_key_is_odd():
    """An odd key makes key * bits a bijection mod 2**64: one changed element always shows."""
    assert all(H.lane_key(j) & 1 for j in range(H.LANES))
    assert all(H.key(i) & 1 for i in [0, 1, 255, 256, 2**32 + 7, 2**62 + 3])
    assert all(H.block_key(b) & 1 == 0 for b in range(1000))


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
