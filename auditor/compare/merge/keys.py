"""Every key of one run merged at once: the vectorized application of
`auditor.compare.merge.tiling`.

`build_keys` groups a run's columns by key, works out one tiling plan per distinct signature of
piece layouts (`merge.plan_tiling`), and applies it to every key that has it: which rows make up
each key's logical digest (with their coefficients, for reductions over the batch), and each
key's status (ok, None, incomplete, replica divergence) with the message explaining it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from numaudit.auditor.compare.merge.tiling import (
    INCOMPLETE,
    NONE,
    REPLICA_DIVERGENCE,
    TilingPlan,
    plan_tiling,
)
from numaudit.auditor.compare.read.pieces import REDUCE_MEAN, REDUCE_SUM
from numaudit.auditor.compare.read.positions import key_positions
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.auditor.compare.read.segments import ranges_index, unique


@dataclass
class LogicalKeys:
    """Every key of one run, merged: one entry per key, in (when, where) order
    (`RunColumns.when`, `RunColumns.where`).

    ``taken_row[taken_start[g]:taken_start[g + 1]]`` are the rows (of the run's columns) whose
    digests make up key g's logical digest.
    """

    when: np.ndarray
    where: np.ndarray
    first: np.ndarray
    """Row of the key's first piece (lowest rank)."""
    count: np.ndarray
    status: np.ndarray
    dtype: np.ndarray
    """Code into Catalog.dtypes (-1 when unknown)."""
    shape: np.ndarray
    """Code into Catalog.shapes (-1 when unknown)."""
    numel: np.ndarray
    nonfinite: np.ndarray
    """Pieces that hold NaN or Inf (0: the logical tensor is finite)."""
    all_zero: np.ndarray
    """1 when every element is zero, 0 when not, -1 when unknown (Partial keys)."""
    fp: np.ndarray
    exact: np.ndarray
    """The fingerprint describes the logical tensor (no Partial box, known seeds)."""
    partial: np.ndarray
    has_moments: np.ndarray
    stage: np.ndarray
    pos: np.ndarray
    """Capture position (float64) in execution order within the run, comparable between keys
    of one (step, microbatch, phase, stage) group (`positions.key_positions`)."""
    taken_start: np.ndarray
    taken_row: np.ndarray
    taken_coef: np.ndarray
    """Per taken row: the factor of its linear digest parts (a mean's weight; 1 otherwise)."""
    reduced: np.ndarray
    """The key is a reduction over dp ranks (REDUCE_MEAN / REDUCE_SUM; 0 when not)."""
    conflict: np.ndarray
    """Ranks whose stored record of this key was contradicted by a resend (0: none)."""
    messages: dict[int, str]
    """Why a key is incomplete or its replicas diverge."""
    bad_ranks: dict[int, tuple[int, ...]]
    numbered: bool = True
    """Positions come from the agents' capture numbers; False: from record ids (a run stored
    by agents before capture numbers), which approximate execution order by storage order."""

    def __len__(self) -> int:
        return len(self.when)

    def ranks(self, cols, g: int) -> list[int]:
        s = int(self.first[g])
        return [int(r) for r in cols.rank[s:s + int(self.count[g])]]


def build_keys(cols, catalog) -> LogicalKeys:
    """Merge every key of a run's columns (`auditor.compare.read.columns.RunColumns`) using tiling
    plans."""
    n = len(cols)
    if n:
        new = np.empty(n, dtype=bool)
        new[0] = True
        np.not_equal(cols.when[1:], cols.when[:-1], out=new[1:])
        new[1:] |= cols.where[1:] != cols.where[:-1]
        starts = np.flatnonzero(new)
    else:
        starts = np.zeros(0, np.int64)
    G = len(starts)
    counts = np.diff(np.append(starts, n)).astype(np.int64)
    status = np.zeros(G, np.int8)
    dtype = np.full(G, -1, np.int32)
    shape = np.full(G, -1, np.int32)
    numel = np.zeros(G, np.int64)
    nonfinite = np.zeros(G, np.int64)
    zeros = np.zeros(G, np.int8)
    fp = np.zeros(G, np.uint64)
    exact = np.zeros(G, bool)
    partial = np.zeros(G, bool)
    has_moments = np.zeros(G, bool)
    messages: dict[int, str] = {}
    bad_ranks: dict[int, tuple[int, ...]] = {}
    taken_keys: list[np.ndarray] = []
    taken_rows: list[np.ndarray] = []
    taken_coefs: list[np.ndarray] = []
    reduced = np.zeros(G, np.int8)
    plans: dict[tuple, TilingPlan] = catalog.__dict__.setdefault("_plans", {})

    for size in unique(counts):
        gsel = np.flatnonzero(counts == size)
        idx = starts[gsel][:, None] + np.arange(size)
        codes = cols.layout[idx]
        if size == 1:
            uniq, inv = np.unique(codes[:, 0], return_inverse=True)
            uniq = uniq[:, None]
        else:
            uniq, inv = np.unique(codes, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        order = np.argsort(inv, kind="stable")
        bounds = np.searchsorted(inv[order], np.arange(len(uniq) + 1))
        for u in range(len(uniq)):
            pick = order[bounds[u]:bounds[u + 1]]
            sig = tuple(int(c) for c in uniq[u])
            plan = plans.get(sig)
            if plan is None:
                plan = plans[sig] = plan_tiling([catalog.pieces[c] for c in sig])
            _apply(plan, sig, gsel[pick], idx[pick], cols, catalog, status, dtype, shape, numel,
                   nonfinite, zeros, fp, exact, partial, has_moments, messages, bad_ranks,
                   taken_keys, taken_rows, taken_coefs)
            reduced[gsel[pick]] = plan.reduce

    if taken_keys:
        tk = np.concatenate(taken_keys)
        tr = np.concatenate(taken_rows)
        tc = np.concatenate(taken_coefs)
        order = np.argsort(tk, kind="stable")
        tk, tr, tc = tk[order], tr[order], tc[order]
    else:
        tk = tr = np.zeros(0, np.int64)
        tc = np.zeros(0)
    taken_start = np.searchsorted(tk, np.arange(G + 1))
    conflict = (np.add.reduceat(((cols.flags & 4) != 0).astype(np.int64), starts)
                if G else np.zeros(0, np.int64))
    pos, numbered = key_positions(cols, starts, counts)
    return LogicalKeys(
        when=cols.when[starts], where=cols.where[starts], first=starts, count=counts, status=status,
        dtype=dtype, shape=shape, numel=numel, nonfinite=nonfinite, all_zero=zeros, fp=fp,
        exact=exact, partial=partial, has_moments=has_moments, stage=cols.stage[starts],
        pos=pos, taken_start=taken_start, taken_row=tr, taken_coef=tc,
        reduced=reduced, conflict=conflict, messages=messages, bad_ranks=bad_ranks,
        numbered=numbered,
    )


def merged_as_sum(lk: LogicalKeys, phase: int) -> LogicalKeys:
    """``lk`` with its means over several addends at ``phase`` merged as sums instead: what the
    addends make when each rank's value was a sum (or normalized by the whole batch), not a
    mean over its share (`auditor.compare.conventions`). Their addend-tuple fingerprints no longer
    describe the merged value, so such keys are compared by their metrics."""
    sel = (phase == (lk.when & 0xF)) & (lk.reduced == REDUCE_MEAN) & lk.partial
    if not sel.any():
        return lk
    g = np.flatnonzero(sel)
    rows_idx, _ = ranges_index(lk.taken_start[g], lk.taken_start[g + 1])
    coef = lk.taken_coef.copy()
    coef[rows_idx] = 1.0
    exact, reduced = lk.exact.copy(), lk.reduced.copy()
    exact[g] = False
    reduced[g] = REDUCE_SUM
    return replace(lk, taken_coef=coef, exact=exact, reduced=reduced)


def _apply(plan: TilingPlan, sig: tuple[int, ...], groups: np.ndarray, rows: np.ndarray, cols,
           catalog, status, dtype, shape, numel, nonfinite, zeros, fp, exact, partial,
           has_moments, messages, bad_ranks, taken_keys, taken_rows, taken_coefs) -> None:
    """Apply one plan to every key (``groups``) sharing its signature; ``rows`` is [g, n]."""
    if plan.status == NONE:
        status[groups] = NONE
        return
    if plan.dtype:
        dtype[groups] = catalog.dtype_code(plan.dtype)
        shape[groups] = catalog.shape_code(plan.logical_shape, plan.complex_as_real, plan.flat)
    if plan.status == INCOMPLETE:
        status[groups] = INCOMPLETE
        _describe(plan, groups, rows, cols, messages)
        return
    take = rows[:, list(plan.take)] if plan.take else np.zeros((len(groups), 0), np.int64)
    if plan.dedupe_sets:
        extra = []
        for r in rows:
            chosen: list[int] = []
            for ds in plan.dedupe_sets:
                seen: set[int] = set()
                for pos in ds:
                    f = int(cols.fp[r[pos]])
                    if f not in seen:
                        seen.add(f)
                        chosen.append(int(r[pos]))
            extra.append(chosen)
        for g, r_take, more in zip(groups, take, extra):
            taken_keys.append(np.full(len(r_take) + len(more), g, np.int64))
            taken_rows.append(np.concatenate([r_take, np.array(more, np.int64)]))
            taken_coefs.append(np.ones(len(r_take) + len(more)))
        flat = [np.concatenate([t, np.array(m, np.int64)]) for t, m in zip(take, extra)]
        fp[groups] = [int(cols.fp[f].sum(dtype=np.uint64)) for f in flat]
        nonfinite[groups] = [int((cols.flags[f] & 2).astype(bool).sum()) for f in flat]
    else:
        taken_keys.append(np.repeat(groups, take.shape[1]))
        taken_rows.append(take.reshape(-1))
        coef = np.array(plan.coef if plan.coef else (1.0,) * take.shape[1], np.float64)
        taken_coefs.append(np.tile(coef, len(groups)))
        fp[groups] = cols.fp[take].sum(axis=1, dtype=np.uint64)
        nonfinite[groups] = ((cols.flags[take] & 2) != 0).sum(axis=1)
    numel[groups] = plan.numel
    if plan.partial or take.shape[1] == 0:
        zeros[groups] = -1
    else:
        zeros[groups] = ((cols.flags[take] & 1) != 0).all(axis=1)
    partial[groups] = plan.partial
    seeds_ok = all(catalog.seeds_ok[c] for c in sig if not catalog.pieces[c].is_none)
    exact[groups] = (not plan.partial) and seeds_ok
    if plan.reduce and plan.partial and seeds_ok and not plan.dedupe_sets:
        # Addends of a reduction over the batch: their sum's fingerprint cannot be rebuilt, but
        # the tuple (addend index, weight, addend fingerprint) can be: two runs whose addends are
        # pairwise bitwise equal, with equal weights, combine to bitwise-equal values.
        fp[groups] = _addends_fingerprint(plan, sig, catalog, cols.fp[take])
        exact[groups] = True
    has_moments[groups] = any(catalog.has_moments[c] for c in sig if not catalog.pieces[c].is_none)
    if plan.status == REPLICA_DIVERGENCE:
        status[groups] = REPLICA_DIVERGENCE
        _describe(plan, groups, rows, cols, messages)
        for g, r in zip(groups, rows):
            bad_ranks[int(g)] = tuple(int(cols.rank[r[p]]) for p in plan.problems[0].positions)
        return
    for rs in plan.replica_sets:
        f = cols.fp[rows[:, list(rs)]]
        bad = np.flatnonzero((f != f[:, :1]).any(axis=1))
        for b in bad:
            g = int(groups[b])
            r = rows[b]
            ranks = [int(cols.rank[r[p]]) for p in rs]
            odd = [rk for rk, fv in zip(ranks, f[b]) if fv != f[b, 0]]
            status[g] = REPLICA_DIVERGENCE
            bad_ranks[g] = tuple(odd)
            messages[g] = (f"replicas differ: ranks {format_ranges(odd)} disagree with rank "
                           f"{ranks[0]} (replicas on ranks {format_ranges(ranks)})")


def _describe(plan: TilingPlan, groups: np.ndarray, rows: np.ndarray, cols,
              messages: dict[int, str]) -> None:
    cache: dict[bytes, str] = {}
    for g, r in zip(groups, rows):
        ranks = cols.rank[r]
        k = ranks.tobytes()
        text = cache.get(k)
        if text is None:
            text = cache[k] = plan.describe([int(x) for x in ranks])
        messages[int(g)] = text


_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_ADDENDS_DOMAIN = np.uint64(0x6E756D6164646E64)
"""Keeps an addend-tuple fingerprint apart from any plain tensor fingerprint."""


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def _addends_fingerprint(plan: TilingPlan, sig: tuple[int, ...], catalog,
                         addend_fps: np.ndarray) -> np.ndarray:
    """[g] fingerprints of each key's reduction as a tuple of addends (``addend_fps`` is [g, n])."""
    pieces = [catalog.pieces[sig[pos]] for pos in plan.take]
    tags = np.array([(p.reduce << 56) ^ (p.reduce_count << 32) ^ p.reduce_index for p in pieces],
                    np.uint64)
    weights = np.array([p.reduce_weight for p in pieces], np.float64).view(np.uint64)
    with np.errstate(over="ignore"):
        mixed = _splitmix(_splitmix(addend_fps.astype(np.uint64) ^ _ADDENDS_DOMAIN)
                          ^ _splitmix(tags ^ _splitmix(weights)))
        return mixed.sum(axis=1, dtype=np.uint64)
