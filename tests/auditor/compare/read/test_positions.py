"""positions.key_positions as a pure function: capture numbers in one rank's frame per group of
keys, keys the frame rank lacks placed by their own rank's numbers, record ids without numbers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from numaudit.auditor.compare.read.positions import key_positions


def _cols(rows: list[tuple[int, int, int, int]], *, numbered: bool = True):
    """Columns of ``(key, rank, capture order, record id)`` rows (one group: same A and stage),
    sorted by key and rank as a run's columns are; and each key's first row and row count."""
    rows = sorted(rows)
    key, rank, order, rid = (np.array(c, np.int64) for c in zip(*rows))
    if not numbered:
        order = np.zeros_like(order)
    cols = SimpleNamespace(when=np.full(len(rows), 5 << 24), rank=rank,
                           stage=np.full(len(rows), -1), order=order, rid=rid,
                           numbered=bool((order > 0).all()))
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    counts = np.diff(np.r_[starts, len(rows)])
    return cols, starts, counts


def _sequence(positions: np.ndarray, names: list[str]) -> list[str]:
    return [names[i] for i in np.argsort(positions, kind="stable")]


def test_one_rank_is_ordered_by_its_numbers_not_its_storage():
    # keys 0..3 stored in record-id order 0, 1, 2, 3 but captured as 3, 1, 4, 2
    cols, starts, counts = _cols([(0, 0, 3, 10), (1, 0, 1, 11), (2, 0, 4, 12), (3, 0, 2, 13)])
    pos, numbered = key_positions(cols, starts, counts)
    assert numbered and _sequence(pos, ["a", "b", "c", "d"]) == ["b", "d", "a", "c"]


def test_ranks_whose_clocks_drift_are_read_in_one_frame():
    """Rank 0 captures an extra tensor (so its numbers run ahead of rank 1's) and expert e0;
    rank 1 holds expert e1 only. The frame is rank 0 (it holds the most keys); e1 is placed
    after router, its predecessor on rank 1, and before what follows router on rank 0."""
    names = ["emb", "extra", "router", "e0", "e1", "out"]
    cols, starts, counts = _cols([
        (0, 0, 1, 1), (1, 0, 2, 2), (2, 0, 3, 3), (3, 0, 4, 4), (5, 0, 5, 5),   # rank 0
        (0, 1, 1, 6), (2, 1, 2, 7), (4, 1, 3, 8), (5, 1, 4, 9),                 # rank 1
    ])
    pos, numbered = key_positions(cols, starts, counts)
    assert numbered
    seq = _sequence(pos, names)
    assert seq[:3] == ["emb", "extra", "router"] and seq[-1] == "out"
    assert set(seq[3:5]) == {"e0", "e1"}


def test_a_key_before_any_the_frame_holds_comes_first():
    """Rank 1 captured a key before anything the frame (rank 0) holds: it leads the group."""
    cols, starts, counts = _cols([(1, 0, 7, 1), (2, 0, 8, 2), (3, 0, 9, 3),
                                  (0, 1, 1, 4), (1, 1, 2, 5)])
    pos, _ = key_positions(cols, starts, counts)
    assert _sequence(pos, ["only_on_1", "x", "y", "z"]) == ["only_on_1", "x", "y", "z"]


def test_records_without_numbers_are_ordered_by_record_id():
    cols, starts, counts = _cols([(0, 0, 3, 12), (1, 0, 1, 10), (2, 0, 2, 11)], numbered=False)
    pos, numbered = key_positions(cols, starts, counts)
    assert not numbered and pos.tolist() == [12.0, 10.0, 11.0]


def test_a_key_of_several_pieces_on_one_rank_takes_the_earliest():
    """Records of several microbatches re-keyed into one (regrouping): the key ran when its
    first piece was captured."""
    cols, starts, counts = _cols([(0, 0, 9, 1), (0, 0, 2, 2), (1, 0, 5, 3), (1, 0, 12, 4)])
    pos, _ = key_positions(cols, starts, counts)
    assert pos.tolist() == [2.0, 5.0]
    # the frame is the rank holding the most keys (rank 1: three), not the most pieces
    cols, starts, counts = _cols([(0, 0, 9, 1), (0, 0, 2, 2), (1, 0, 5, 3), (1, 0, 12, 4),
                                  (0, 1, 4, 5), (1, 1, 1, 6), (2, 1, 3, 7)])
    pos, _ = key_positions(cols, starts, counts)
    assert _sequence(pos, ["a", "b", "c"]) == ["b", "c", "a"]
