"""Outputs that do not hold the batch: replicas compared per microbatch, never joined as pieces.

Some module outputs do not depend on the batch and are broadcast over it: transformers'
``model.rotary_emb`` returns cos/sin of shape ``[1, seq, dim]``, whole on every rank and the
same in every microbatch. The agent records them as replicas when the microbatch holds more
than one sample per rank (agents.layout.holds_batch); then every rank's piece is a copy of one
box and the merge checks the copies agree. Two cases remain for the auditor, both handled
before the keys are built (`regroup_with_replicas`, in place of `regroup.regroup`):

- One sample per rank: a tensor of size 1 on the batch dim is as much a one-row batch share as a
  replica, and the agent records a share (``[1, seq, dim]`` of ``[dp, seq, dim]``). Where every
  such piece of a key is bitwise the same (fingerprints moved to one place agree) and the other
  run holds the key with size 1 there, the pieces are copies of that one box (`collapse_copies`).
  Pieces that differ, or another shape in the other run, stay shares: a run whose every rank
  read the same sample is still found where the batch differs.
- Microbatches grouped otherwise (`auditor.compare.merge.regroup`): the batch-holding keys of a step
  are re-keyed into the target grouping along the batch dim; a key that holds no batch (the
  same logical shape in every microbatch of both runs, so regroup leaves it) is compared per
  microbatch: its records go to every target microbatch their source microbatch's samples went
  to, as replicas (`spread_copies`): one microbatch of 8 against 4 of 2 compares its rotary
  cos/sin with each of the four; four against one, the four must agree with each other and with
  the one. Their gradients (phase bwd) are sums over the microbatch's samples and do not spread:
  they are left as they are (docs/comparison.md).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from numaudit.auditor.compare.digests.algebra import shift_fingerprint
from numaudit.auditor.compare.merge.regroup import regroup
from numaudit.auditor.compare.merge.samples import share_dim
from numaudit.auditor.compare.read.columns import Catalog, RunColumns, translation, unpack_when
from numaudit.wire.vocabulary import Phase

SPREAD_PHASES = (Phase.FWD, Phase.INPUT)
"""Per-microbatch phases whose keys that hold no batch are the same in every microbatch."""


def regroup_with_replicas(rc: RunColumns, cc: RunColumns, catalog: Catalog
                          ) -> tuple[RunColumns, RunColumns, list[str]]:
    """`regroup.regroup`, with the keys that do not hold the batch as replicas: copies of one box
    collapsed before (`collapse_copies`), spread over the target microbatches after
    (`spread_copies`). Returns both runs' columns and regroup's lines."""
    rc, cc = collapse_copies(rc, cc, catalog), collapse_copies(cc, rc, catalog)
    gr, gc, lines = regroup(rc, cc, catalog)
    if gr is rc and gc is cc:
        return rc, cc, lines
    return (spread_copies(rc, gr, cc, catalog), spread_copies(cc, gc, rc, catalog), lines)


# -- one sample per rank ---------------------------------------------------------------------------

def _key_starts(cols: RunColumns) -> np.ndarray:
    n = len(cols)
    if not n:
        return np.zeros(0, np.int64)
    new = np.empty(n, bool)
    new[0] = True
    new[1:] = (cols.when[1:] != cols.when[:-1]) | (cols.where[1:] != cols.where[:-1])
    return np.flatnonzero(new)


def collapse_copies(cols: RunColumns, other: RunColumns, catalog: Catalog) -> RunColumns:
    """``cols`` with the keys whose pieces are one-row batch shares that are bitwise copies of
    one another, where ``other`` holds the key with one row, turned into replicas of that row
    (module docstring). Needs movable fingerprints (version 3): without, nothing changes."""
    if not len(cols) or not catalog.fingerprints_v3:
        return cols
    one_row = np.array([_one_row_dim(p) for p in catalog.pieces] or [-1], np.int64)
    d = one_row[cols.layout]
    starts = _key_starts(cols)
    counts = np.diff(np.r_[starts, len(cols)])
    candidates = starts[(np.minimum.reduceat(d, starts) >= 0) & (counts >= 2)
                        & (np.minimum.reduceat(d, starts) == np.maximum.reduceat(d, starts))]
    if not len(candidates):
        return cols
    phases = unpack_when(cols.when[candidates])[2]
    candidates = candidates[np.isin(phases, (Phase.FWD, Phase.INPUT, Phase.BWD))]
    shapes = _step_shapes(other, catalog)
    layout, fp = cols.layout.copy(), cols.fp.copy()
    changed = False
    for s in candidates.tolist():
        rows = np.arange(s, s + int(counts[np.searchsorted(starts, s)]))
        dim = int(d[s])
        pieces = [catalog.pieces[int(c)] for c in cols.layout[rows]]
        one = _as_one_row(pieces[0], dim)
        step, phase = int(cols.when[s]) >> 24, int(cols.when[s]) & 0xF
        if shapes.get((step, phase, int(cols.where[s]))) != {one.logical_shape}:
            continue
        placed = []
        for r, piece in zip(rows.tolist(), pieces):
            code = int(cols.layout[r])
            delta = translation(piece, _as_one_row(piece, dim))
            if delta is None or not catalog.shiftable(code):
                break
            placed.append((r, catalog.derived_piece(_as_one_row(piece, dim), code,
                                                    placed=delta == 0, fingerprint=True),
                           shift_fingerprint(int(cols.fp[r]), delta)))
        if len(placed) != len(rows) or len({f for _, _, f in placed}) != 1:
            continue  # not all movable, or not copies: batch shares
        for r, code, moved in placed:
            layout[r], fp[r] = code, moved
        changed = True
    if not changed:
        return cols
    return _with(cols, layout=layout, fp=fp)


def _one_row_dim(piece) -> int:
    """The dim on which `piece` is a one-row dp share (-1: it is not one)."""
    d = share_dim(piece)
    return -1 if d is None or piece.shape[d] != 1 else d


def _as_one_row(piece, dim: int):
    """`piece` as a replica of the one-row tensor: offset 0, logical size 1 on `dim`."""
    logical, offsets = list(piece.logical_shape), list(piece.offsets)
    logical[dim], offsets[dim] = 1, 0
    return replace(piece, logical_shape=tuple(logical), offsets=tuple(offsets), replica=True)


def _step_shapes(cols: RunColumns, catalog: Catalog) -> dict[tuple[int, int, int], set]:
    """(step, phase, B) -> the logical shapes of the key in any microbatch of the step."""
    out: dict[tuple[int, int, int], set] = {}
    if not len(cols):
        return out
    step, mb, phase = unpack_when(cols.when)
    combo = np.stack([step, phase, cols.where, cols.layout.astype(np.int64)], axis=1)
    for s, p, b, code in np.unique(combo[mb >= 0], axis=0).tolist():
        piece = catalog.pieces[int(code)]
        if not piece.is_none:
            out.setdefault((s, p, b), set()).add(piece.logical_shape)
    return out


# -- microbatches grouped otherwise ----------------------------------------------------------------

def spread_copies(before: RunColumns, after: RunColumns, other: RunColumns,
                  catalog: Catalog) -> RunColumns:
    """``after`` (a run's columns as `regroup` left them; ``before``, as it found them) with
    the records of keys that hold no batch put in every target microbatch their source
    microbatch's re-keyed samples went to, as replicas (module docstring). ``other`` is the
    other run as regroup left it."""
    if not len(after):
        return after
    order = np.argsort(before.rid, kind="stable")
    at = order[np.clip(np.searchsorted(before.rid[order], after.rid), 0, len(order) - 1)]
    if not np.array_equal(before.rid[at], after.rid):
        return after  # rows regroup did not take from `before`: nothing to map
    a_old = before.when[at]
    moved = (a_old != after.when) | (before.layout[at] != after.layout)
    if not moved.any():
        return after
    step, mb_new, phase = unpack_when(after.when)
    mb_old = unpack_when(a_old)[1]
    targets: dict[tuple[int, int], set[int]] = {}
    moved_keys: set[tuple[int, int, int]] = set()
    for r in np.flatnonzero(moved & (mb_new >= 0)).tolist():
        targets.setdefault((int(step[r]), int(mb_old[r])), set()).add(int(mb_new[r]))
        moved_keys.add((int(step[r]), int(phase[r]), int(after.where[r])))
    s_old, m_old, _ = unpack_when(before.when)
    mbs: dict[int, set[int]] = {}
    for s, m in np.unique(np.stack([s_old, m_old], 1)[m_old >= 0], axis=0).tolist():
        mbs.setdefault(s, set()).add(m)
    shapes_here, shapes_there = _step_shapes(after, catalog), _step_shapes(other, catalog)
    by_key: dict[tuple[int, int, int], list[int]] = {}
    for r in np.flatnonzero(~moved & (mb_new >= 0) & np.isin(phase, SPREAD_PHASES)).tolist():
        by_key.setdefault((int(step[r]), int(phase[r]), int(after.where[r])), []).append(r)
    copies: list[tuple[int, int]] = []
    for key, rows in by_key.items():
        s = key[0]
        got = [targets.get((s, int(mb_new[r]))) for r in rows]
        to = [t for t in got if t is not None]
        if key in moved_keys or len(to) < len(got) or all(
                t == {int(mb_new[r])} for t, r in zip(to, rows)):
            continue  # re-keyed, in a microbatch nothing went from, or where it was
        here, there = shapes_here.get(key), shapes_there.get(key)
        if not here or here != there or len(here) != 1:
            continue  # not one shape in both runs: it may hold the batch
        if not {int(mb_new[r]) for r in rows} >= mbs.get(s, set()):
            continue  # not captured in every microbatch of the step: it may hold the batch
        copies.extend((r, t) for r, ts in zip(rows, to) for t in sorted(ts))
    if not copies:
        return after
    keep = np.ones(len(after), bool)
    keep[[r for r, _ in copies]] = False
    rows_ = np.array([r for r, _ in copies], np.int64)
    extra = after.take(rows_)
    copy_mb = np.array([t for _, t in copies], np.int64) + 1
    extra.when = ((extra.when >> 24) << 24) | (copy_mb << 4) | (extra.when & 0xF)
    extra.layout = np.array([_replica_code(catalog, int(c)) for c in extra.layout],
                            after.layout.dtype)
    return after.take(np.flatnonzero(keep)).concat(extra)


def _replica_code(catalog: Catalog, code: int) -> int:
    """Layout `code` flagged as a replica (the same box, so its digests stay valid there)."""
    piece = catalog.pieces[code]
    if piece.replica or piece.is_none:
        return code
    return catalog.derived_piece(replace(piece, replica=True), code, placed=catalog.placed[code],
                                 fingerprint=True)


def _with(cols: RunColumns, **changes) -> RunColumns:
    out = cols.take(np.arange(len(cols)))
    for name, value in changes.items():
        setattr(out, name, value)
    return out
