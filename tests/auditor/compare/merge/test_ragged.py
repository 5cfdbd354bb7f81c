"""Ragged pieces (issue 11): rows concatenated from parts of different sizes merge exactly."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from numaudit.agents.digest.digest import digest_piece
from numaudit.agents.layout import PieceLayout, ragged_layout
from numaudit.agents.ragged import rows_from_counts
from numaudit.auditor.compare.digests.algebra import DigestValues
from numaudit.auditor.compare.merge.tiling import INCOMPLETE, OK, merge_pieces, plan_tiling
from numaudit.auditor.compare.read.pieces import Piece

K = 32


def as_piece(lay: PieceLayout) -> Piece:
    return Piece(dtype="float32", logical_shape=lay.logical_shape, offsets=lay.offsets,
                 shape=lay.shape, replica=lay.replica,
                 ragged=tuple(lay.ragged) if lay.ragged else None)


def digest(t: torch.Tensor, lay: PieceLayout) -> DigestValues:
    f64, i64 = digest_piece(t, lay, sketch_k=K)
    return DigestValues.from_rows(f64.tolist(), i64.tolist(), t.dtype.is_floating_point)


def ragged_pieces(counts: list[int], cols: int, seed: int):
    """Each part's rows as a ragged piece, and the concatenated tensor."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, cols, generator=g) for n in counts]
    out = []
    for p, t in enumerate(parts):
        (rows,) = rows_from_counts([[n] for n in counts], p)
        lay = ragged_layout(t.shape, rows.offset, rows.total, part=p, parts=len(counts))
        out.append((lay, t))
    return out, torch.cat(parts)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.integers(1, 5),
       st.integers(0, 2**31))
def test_ragged_pieces_merge_to_the_digest_of_the_concatenation(counts, cols, seed):
    pieces, whole = ragged_pieces(counts, cols, seed)
    merged = merge_pieces([(as_piece(lay), digest(t, lay)) for lay, t in pieces])
    assert merged.status == OK, merged.message
    ref = digest(whole, PieceLayout.full(whole.shape))
    assert merged.digest.fingerprint == ref.fingerprint  # bitwise
    assert merged.digest.numel == ref.numel and merged.digest.zeros == ref.zeros
    assert merged.digest.sum == pytest.approx(ref.sum, rel=1e-12, abs=1e-12)
    assert merged.digest.sum_sq == pytest.approx(ref.sum_sq, rel=1e-12, abs=1e-12)
    assert merged.digest.sketch == pytest.approx(ref.sketch, rel=1e-12, abs=1e-12)
    if whole.numel():
        assert merged.digest.min == ref.min and merged.digest.max == ref.max


def test_expert_parallel_owner_holds_every_source_in_one_piece():
    """An EP owner receives all sources' rows: one piece spanning parts 0-1 equals the whole."""
    t = torch.randn(7, 3)
    lay = ragged_layout(t.shape, 0, 7, part=0, parts=2, span=2)
    merged = merge_pieces([(as_piece(lay), digest(t, lay))])
    assert merged.status == OK
    assert merged.digest.fingerprint == digest(t, PieceLayout.full(t.shape)).fingerprint


def test_zero_rows_everywhere_is_an_empty_tensor_not_a_gap():
    pieces, whole = ragged_pieces([0, 0, 0], 4, 0)
    merged = merge_pieces([(as_piece(lay), digest(t, lay)) for lay, t in pieces])
    assert merged.status == OK and merged.digest.numel == 0
    assert merged.digest.fingerprint == digest(whole, PieceLayout.full(whole.shape)).fingerprint


def test_a_rows_moved_between_ranks_changes_the_fingerprint():
    """12 + 20 rows is not 13 + 19 rows of other values: position matters, not only content."""
    pieces, whole = ragged_pieces([12, 20], 2, 1)
    swapped = torch.cat([whole[12:], whole[:12]])
    a = merge_pieces([(as_piece(lay), digest(t, lay)) for lay, t in pieces]).digest
    b = digest(swapped, PieceLayout.full(swapped.shape))
    assert a.fingerprint != b.fingerprint


def plan(layouts):
    return plan_tiling([as_piece(lay) for lay in layouts])


def lay(rows, offset, total, part, parts, span=1, cols=3):
    return ragged_layout((rows, cols), offset, total, part=part, parts=parts, span=span)


def test_missing_part_is_named():
    p = plan([lay(12, 0, 40, 0, 3), lay(8, 32, 40, 2, 3)])
    assert p.status == INCOMPLETE
    assert p.describe([0, 2]) == "no rank sent ragged part 1 of 3 (parts are concatenated in order)"


def test_missing_empty_part_is_named_too():
    """An expert with no tokens on rank 1 must still get rank 1's zero-row piece."""
    p = plan([lay(12, 0, 12, 0, 2)])
    assert p.status == INCOMPLETE and "part 1 of 2" in p.describe([0])
    assert plan([lay(12, 0, 12, 0, 2), lay(0, 12, 12, 1, 2)]).status == OK


def test_overlapping_parts_name_both_ranks():
    p = plan([lay(12, 0, 32, 0, 2), lay(20, 12, 32, 1, 2), lay(32, 0, 32, 0, 2, span=2)])
    assert p.status == INCOMPLETE
    text = p.describe([0, 1, 5])
    assert "ranks 5 (parts 0-1 of 2)" in text and "both hold part" in text


def test_parts_out_of_order_are_incomplete_even_when_the_rows_tile():
    """Rank 1 declares its rows first: the boxes tile, but not in the declared order."""
    p = plan([lay(12, 20, 32, 0, 2), lay(20, 0, 32, 1, 2)])
    assert p.status == INCOMPLETE
    assert p.describe([0, 1]) == ("ranks 0 hold part 0 of 2 at rows 20:32, but the parts before "
                                  "it end at row 0")


def test_disagreeing_totals_and_part_counts():
    assert "logical shape" in plan([lay(12, 0, 32, 0, 2), lay(20, 12, 33, 1, 2)]).describe([0, 1])
    text = plan([lay(12, 0, 32, 0, 2), lay(20, 12, 32, 1, 3)]).describe([0, 1])
    assert text.startswith("ranks disagree on the number of ragged parts")


def test_plain_and_ragged_pieces_do_not_mix():
    plain = PieceLayout(logical_shape=(32, 3), offsets=(12, 0), shape=(20, 3))
    text = plan([lay(12, 0, 32, 0, 2), plain]).describe([0, 1])
    assert text == "ranks 0 send ragged parts of the tensor and ranks 1 plain pieces of it"


def test_replicas_of_a_part_are_copies():
    a = lay(12, 0, 32, 0, 2)
    b = lay(20, 12, 32, 1, 2)
    rep = [ragged_layout((n, 3), o, 32, part=p, parts=2, replica=True)
           for n, o, p in ((12, 0, 0), (12, 0, 0), (20, 12, 1), (20, 12, 1))]
    assert plan(rep).status == OK and len(plan(rep).replica_sets) == 2
    assert plan([a, b]).status == OK


def _batch_pieces(rows_per_rank: list[int], cols: int = 4) -> list[Piece]:
    from numaudit.agents.layout import batch_layout

    n = len(rows_per_rank)
    return [as_piece(batch_layout((r, cols), k, n)) for k, r in enumerate(rows_per_rank)]


@pytest.mark.parametrize("rows", [[12, 20], [0, 7], [3, 3, 5, 0]])
def test_an_undeclared_ragged_output_is_named_as_such(rows):
    """Per-rank row counts captured as a batch split: incomplete, and the text says why and
    how to declare it, naming each row count's ranks."""
    plan = plan_tiling(_batch_pieces(rows))
    assert plan.status == INCOMPLETE
    (problem,) = plan.problems
    assert problem.kind == "ragged_undeclared"
    text = plan.describe(list(range(len(rows))))
    assert "row counts differ" in text and "ragged_rows(counts, dp_group)" in text
    for r in rows:
        assert f"{r} on ranks" in text
    assert f"{rows[0]} on ranks 0" in text


def test_other_shape_disagreements_keep_their_own_text():
    from numaudit.agents.layout import batch_layout

    # trailing dims differ: not the ragged signature
    pieces = [as_piece(batch_layout((4, 3), 0, 2)), as_piece(batch_layout((6, 5), 1, 2))]
    plan = plan_tiling(pieces)
    assert plan.status == INCOMPLETE and plan.problems[0].kind == "disagree"
    # one full tensor against a batch share: not either
    full = as_piece(PieceLayout.full((8, 4)))
    plan = plan_tiling([full, as_piece(batch_layout((6, 4), 1, 2))])
    assert plan.problems[0].kind == "disagree"
    # equal row counts tile as usual
    assert plan_tiling(_batch_pieces([5, 5])).status == OK
