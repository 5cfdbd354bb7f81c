"""Where each key of a run was captured: its position in execution order within the run.

The agent numbers every capture in the order its hooks fired (`Record.capture_order`, one
clock per rank's process), so within one rank the numbers order keys as they ran, whatever
order the records were stored in. A key is captured by several ranks (the dp ranks' batch
shares, tp replicas), each by its own clock: the ranks of one pipeline stage run the same
modules in the same order, but not the same captures (a rank that captures a tensor the
others do not, experts held by one expert-parallel rank), so their numbers drift apart.

So a key's position is read in one rank's frame per group of keys that execution order
compares (step, microbatch, phase, stage): the rank that holds the most of the group's keys
(the lowest such rank on a tie). A key that rank lacks is placed, by its own ranks' numbers,
just after the nearest key before it that the frame rank holds (`align.fill_positions`, as keys
only the candidate has are placed in the reference's frame). A key with several pieces on one
rank (records of several microbatches re-keyed into one by `auditor.compare.merge.regroup`) takes
the earliest.

Records of an agent before capture numbers (0) leave only the store's order, record ids:
`key_positions` says so, and the comparison warns that execution order is approximated.
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.read.align import fill_positions
from numaudit.auditor.compare.read.segments import unique


def key_positions(cols, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, bool]:
    """(position per key, numbered) for a run's columns (`columns.RunColumns`, sorted by key
    and rank) whose keys' rows start at ``starts`` and number ``counts``.

    Numbered: every record carries its capture order, and positions are capture numbers in
    each group's frame (module docstring). Else positions are the record ids of each key's
    first piece (storage order, as before records were numbered), and numbered is False.
    Positions are comparable only between keys of one (step, microbatch, phase, stage) group.
    """
    G = len(starts)
    if G == 0:
        return np.zeros(0), True
    if not cols.numbered:
        return cols.rid[starts].astype(np.float64), False
    order = cols.order
    rank = cols.rank.astype(np.int64)
    if (rank == rank[0]).all():  # one rank holds every key: its numbers are the positions
        return np.minimum.reduceat(order, starts).astype(np.float64), True
    ranks = unique(rank)
    if (counts == len(ranks)).all() and np.array_equal(rank, np.tile(ranks, G)):
        # every rank holds every key once (data parallel, tensor parallel): every group's frame
        # is the lowest rank, whose row comes first in each key's
        return order[starts].astype(np.float64), True
    key = np.repeat(np.arange(G), counts)
    group = _ids(cols.when, cols.stage[starts][key].astype(np.int64))
    pair = _ids(group, rank)  # (group, rank) of each row
    n_pairs = int(pair.max()) + 1
    pair_group = np.zeros(n_pairs, np.int64)
    pair_rank = np.zeros(n_pairs, np.int64)
    pair_group[pair], pair_rank[pair] = group, rank
    pair_key = _ids(pair, key)  # keys, not rows: a key may have several pieces on a rank
    some_row = np.zeros(int(pair_key.max()) + 1, np.int64)
    some_row[pair_key] = np.arange(len(rank))
    held = np.bincount(pair[some_row], minlength=n_pairs)
    best = np.lexsort((pair_rank, -held, pair_group))
    first = np.ones(n_pairs, bool)
    first[1:] = pair_group[best][1:] != pair_group[best][:-1]
    frame = np.zeros(int(group.max()) + 1, np.int64)
    frame[pair_group[best][first]] = pair_rank[best][first]
    in_frame = rank == frame[group]
    frame_pos = np.full(G, np.inf)
    np.minimum.at(frame_pos, key[in_frame], order[in_frame].astype(np.float64))
    frame_pos[np.isinf(frame_pos)] = np.nan
    if not np.isnan(frame_pos).any():
        return frame_pos, True
    # every row's position in its group's frame (known for keys the frame rank holds)
    filled = fill_positions(pair, order.astype(np.float64), frame_pos[key])
    return np.minimum.reduceat(filled, starts), True


def _ids(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A dense id per distinct (a, b) pair of each row."""
    o = np.lexsort((b, a))
    new = np.ones(len(a), bool)
    new[1:] = (a[o][1:] != a[o][:-1]) | (b[o][1:] != b[o][:-1])
    out = np.empty(len(a), np.int64)
    out[o] = np.cumsum(new) - 1
    return out
