"""Rebuilding logical tensors from pieces: tiling plans and merged digests."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from numaudit.agents.digest.digest import digest_piece
from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.digests.algebra import DigestValues
from numaudit.auditor.compare.merge.tiling import (
    INCOMPLETE,
    NONE,
    OK,
    REPLICA_DIVERGENCE,
    merge_pieces,
    plan_tiling,
)
from numaudit.auditor.compare.read.pieces import Piece


def piece(logical, offsets, shape, **kw) -> Piece:
    return Piece(dtype=kw.pop("dtype", "float32"), logical_shape=tuple(logical),
                 offsets=tuple(offsets), shape=tuple(shape), **kw)


def digest(t: torch.Tensor, lay: PieceLayout) -> DigestValues:
    f64, i64 = digest_piece(t, lay, sketch_k=32)
    return DigestValues.from_rows(f64.tolist(), i64.tolist(), t.dtype.is_floating_point)


def as_piece(lay: PieceLayout, dtype: str = "float32") -> Piece:
    return piece(lay.logical_shape, lay.offsets, lay.shape, replica=lay.replica,
                 partial=lay.partial, dtype=dtype)


def test_full_piece_and_even_shards_tile():
    assert plan_tiling([piece((4, 3), (0, 0), (4, 3))]).status == OK
    plan = plan_tiling([piece((4, 3), (2 * r, 0), (2, 3)) for r in range(2)])
    assert plan.status == OK and plan.take == (0, 1) and not plan.partial
    assert plan_tiling([piece((), (), ())]).numel == 1  # a scalar


def test_uneven_and_empty_shards_tile():
    pieces = [piece((5, 2), (0, 0), (3, 2)), piece((5, 2), (3, 0), (2, 2)),
              piece((5, 2), (5, 0), (0, 2))]  # torch reports an empty shard at the end
    plan = plan_tiling(pieces)
    assert plan.status == OK and plan.take == (0, 1)


def test_gap_names_ranks_and_region():
    pieces = [piece((8, 4), (0, 0), (2, 4)), piece((8, 4), (2, 0), (2, 4)),
              piece((8, 4), (6, 0), (2, 4))]
    plan = plan_tiling(pieces)
    assert plan.status == INCOMPLETE
    text = plan.describe([0, 1, 3])
    assert "ranks 0-1, 3 cover 24 of 32 elements" in text and "within [4:6, 0:4]" in text


def test_two_dim_gap_is_located():
    pieces = [piece((4, 4), (0, 0), (2, 2)), piece((4, 4), (0, 2), (2, 2)),
              piece((4, 4), (2, 0), (2, 2))]
    assert "within [2:4, 2:4]" in plan_tiling(pieces).describe([0, 1, 2])


def test_overlap_and_bounds_and_disagreement_are_incomplete():
    overlap = plan_tiling([piece((4,), (0,), (3,)), piece((4,), (2,), (2,))])
    assert overlap.status == INCOMPLETE and "overlap" in overlap.describe([5, 6])
    assert "ranks 5" in overlap.describe([5, 6]) and "ranks 6" in overlap.describe([5, 6])
    same_box = plan_tiling([piece((4,), (0,), (4,)), piece((4,), (0,), (4,))])
    assert same_box.status == INCOMPLETE and "not marked as replicas" in same_box.describe([0, 1])
    outside = plan_tiling([piece((4,), (2,), (4,))])
    assert outside.status == INCOMPLETE and "outside the logical shape" in outside.describe([3])
    disagree = plan_tiling([piece((4,), (0,), (2,)), piece((5,), (2,), (2,))])
    text = disagree.describe([0, 1])
    assert disagree.status == INCOMPLETE and "disagree on the logical shape" in text
    assert "[4] on ranks 0" in text and "[5] on ranks 1" in text
    dtypes = plan_tiling([piece((4,), (0,), (2,)), piece((4,), (2,), (2,), dtype="bfloat16")])
    assert "disagree on the dtype" in dtypes.describe([0, 1])


def test_replicas_and_partials():
    rep = plan_tiling([piece((4,), (0,), (4,), replica=True) for _ in range(3)])
    assert rep.status == OK and rep.take == (0,) and rep.replica_sets == ((0, 1, 2),)
    part = plan_tiling([piece((4,), (0,), (4,), partial=True) for _ in range(2)])
    assert part.status == OK and part.take == (0, 1) and part.partial
    mixed = plan_tiling([piece((4,), (0,), (4,), partial=True), piece((4,), (0,), (4,))])
    assert mixed.status == INCOMPLETE and "Partial" in mixed.describe([0, 1])


def test_none_pieces():
    none = Piece(dtype="", logical_shape=(), offsets=(), shape=(), is_none=True)
    assert plan_tiling([none, none]).status == NONE
    rep = plan_tiling([piece((4,), (0,), (4,), replica=True), none])
    assert rep.status == REPLICA_DIVERGENCE and "None on ranks 7" in rep.describe([0, 7])
    shard = plan_tiling([piece((4,), (0,), (2,)), none])
    assert shard.status == INCOMPLETE


def test_merge_pieces_matches_the_whole_tensor():
    t = torch.randn(6, 5)
    whole = digest(t, PieceLayout.full((6, 5)))
    lays = [PieceLayout((6, 5), (0, 0), (4, 5)), PieceLayout((6, 5), (4, 0), (2, 5))]
    pieces = [(as_piece(lay), digest(t[lay.offsets[0]:lay.offsets[0] + lay.shape[0]], lay))
              for lay in lays]
    merged = merge_pieces(pieces)
    assert merged.status == OK and merged.exact
    assert merged.digest.fingerprint == whole.fingerprint
    assert merged.digest.sketch == pytest.approx(whole.sketch)


def test_merge_pieces_replica_divergence_names_ranks():
    t = torch.randn(3, 3)
    lay = PieceLayout((3, 3), (0, 0), (3, 3), replica=True)
    other = t.clone()
    other[1, 1] += 1
    out = merge_pieces([(as_piece(lay), digest(t, lay)), (as_piece(lay), digest(other, lay)),
                        (as_piece(lay), digest(t, lay))], ranks=[4, 5, 6])
    assert out.status == REPLICA_DIVERGENCE and out.divergent_ranks == (5,)
    assert "ranks 5 disagree with rank 4" in out.message


def test_merge_partial_adds_sums_and_sketches_but_not_fingerprints():
    t = torch.randn(4, 4, dtype=torch.float64)
    a = torch.randn(4, 4, dtype=torch.float64)
    lay = PieceLayout((4, 4), (0, 0), (4, 4), partial=True)
    out = merge_pieces([(as_piece(lay, "float64"), digest(a, lay)),
                        (as_piece(lay, "float64"), digest(t - a, lay))])
    whole = digest(t, PieceLayout.full((4, 4)))
    assert out.status == OK and not out.exact and not out.digest.exact
    assert out.digest.sum == pytest.approx(whole.sum)
    assert max(abs(out.digest.sketch - whole.sketch)) < 1e-12
    assert math.isnan(out.digest.sum_sq)


@st.composite
def tilings(draw):
    """A 2-D shape and a random grid tiling of it (cuts per dim), sometimes with a missing cell."""
    rows = draw(st.integers(1, 7))
    cols = draw(st.integers(1, 5))
    rcuts = sorted(set(draw(st.lists(st.integers(0, rows), max_size=3))) | {0, rows})
    ccuts = sorted(set(draw(st.lists(st.integers(0, cols), max_size=2))) | {0, cols})
    boxes = [((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in zip(rcuts, rcuts[1:])
             for c0, c1 in zip(ccuts, ccuts[1:])]
    drop = draw(st.booleans()) and len(boxes) > 1
    if drop:
        boxes.pop(draw(st.integers(0, len(boxes) - 1)))
    return (rows, cols), boxes, drop


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tilings(), st.integers(0, 2 ** 31))
def test_any_tiling_merges_to_the_whole_tensor(tiling, seed):
    (rows, cols), boxes, dropped = tiling
    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    pieces = []
    for (r0, c0), (h, w) in boxes:
        lay = PieceLayout((rows, cols), (r0, c0), (h, w))
        pieces.append((as_piece(lay), digest(t[r0:r0 + h, c0:c0 + w], lay)))
    out = merge_pieces(pieces)
    if dropped:
        assert out.status == INCOMPLETE and "missing" in out.message
        return
    whole = digest(t, PieceLayout.full((rows, cols)))
    assert out.status == OK
    assert out.digest.fingerprint == whole.fingerprint
    assert out.digest.numel == rows * cols
    assert max(abs(out.digest.sketch - whole.sketch), default=0) < 1e-9
