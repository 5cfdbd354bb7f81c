"""Rebuild logical tensors from the pieces ranks sent (docs/comparison.md, "Merge").

The pieces of one key, from all ranks of a run, must tile the key's logical tensor. A *tiling
plan* is worked out once per distinct combination of piece layouts (a "signature": most keys of
a run share a handful) and then applied to the digests of every key that has it:

- pieces that cover the same box are *copies*: replicas (flag ``replica``) must be bitwise
  identical (``replica_divergence`` otherwise), the first one is taken; Partial addends (flag
  ``partial``) are all taken and summed — the sum's fingerprint cannot be rebuilt, so exact
  comparison is unavailable for that key;
- distinct boxes must not overlap, must stay inside the logical shape, and must cover all of it;
  anything else is ``incomplete``, with the ranks and the missing region named;
- pieces of one key must agree on logical shape and dtype;
- a None piece (a gradient that was None on that rank) next to pieces that are not None is a
  ``replica_divergence`` when the others still tile the tensor (a replica disagrees), else
  ``incomplete``.

A box held by pieces flagged both ``replica`` and ``partial`` (a Partial placement on one mesh dim,
Replicate on another) cannot be told apart from its layouts alone: such copies are deduplicated
by fingerprint, so identical addends count once (docs/comparison.md states the caveat).

Pure functions; the vectorized application over many keys is in `auditor.compare.verdicts` and `auditor.compare.slow`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from auditor.compare.digests import DigestValues, merge_disjoint, merge_partial
from auditor.compare.ranges import format_ranges

MAX_GAP_CELLS = 1 << 20
"""Grid cells examined to locate a coverage gap; beyond this only the count is reported."""

OK, NONE, INCOMPLETE, REPLICA_DIVERGENCE = 0, 1, 2, 3
REDUCE_NONE, REDUCE_MEAN, REDUCE_SUM = 0, 1, 2
REDUCE_NAMES = {REDUCE_MEAN: "mean", REDUCE_SUM: "sum"}
STATUS_NAMES = {OK: "ok", NONE: "none", INCOMPLETE: "incomplete",
                REPLICA_DIVERGENCE: "replica_divergence"}


@dataclass(frozen=True)
class Piece:
    """One record's layout as the merge needs it."""

    dtype: str
    logical_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    replica: bool = False
    partial: bool = False
    complex_as_real: bool = False
    is_none: bool = False
    reduce: int = REDUCE_NONE
    """REDUCE_MEAN / REDUCE_SUM: the piece is one addend of a reduction over the batch."""
    reduce_index: int = 0
    """The addend (dp rank) this piece holds."""
    reduce_count: int = 1
    """Addends that make the whole (dp size)."""
    reduce_weight: float = 1.0
    """Weight of the addend in a mean (its batch elements)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_full(self) -> bool:
        return (not self.is_none and self.shape == self.logical_shape
                and not any(self.offsets))

    @property
    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.offsets, self.shape


@dataclass(frozen=True)
class Problem:
    """Why a key's pieces do not make one logical tensor; positions index the key's pieces."""

    kind: str
    """"none_mixed", "disagree", "bounds", "overlap", "mixed_flags", "gap"."""
    positions: tuple[int, ...]
    detail: str
    """Text with ``{ranks}`` where the ranks of ``positions`` go."""

    def render(self, ranks: Sequence[int]) -> str:
        names = format_ranges([ranks[p] for p in self.positions]) if self.positions else ""
        return self.detail.replace("{ranks}", names)


@dataclass(frozen=True)
class TilingPlan:
    """How the pieces of every key with one signature merge into a logical digest."""

    status: int
    """OK, NONE (every piece is None), INCOMPLETE or REPLICA_DIVERGENCE (structural: a None
    piece where replicas hold values); value-level replica checks happen when applied."""
    take: tuple[int, ...] = ()
    """Positions whose digests make up the logical digest (one per box, every addend)."""
    replica_sets: tuple[tuple[int, ...], ...] = ()
    """Groups of positions that must hold bitwise-identical copies."""
    dedupe_sets: tuple[tuple[int, ...], ...] = ()
    """Boxes of replica+partial pieces: taken once per distinct fingerprint."""
    partial: bool = False
    """Some box is a sum of addends: no fingerprint for the logical tensor."""
    dtype: str = ""
    logical_shape: tuple[int, ...] = ()
    complex_as_real: bool = False
    problems: tuple[Problem, ...] = ()
    reduce: int = REDUCE_NONE
    """A reduction over the batch: `take` holds one addend per dp rank."""
    coef: tuple[float, ...] = ()
    """Per position of `take`: the factor its digest's linear parts (sum, sketch, payload
    values) are multiplied by before adding (a mean's normalized weight; 1 otherwise)."""

    @property
    def numel(self) -> int:
        return math.prod(self.logical_shape)

    def describe(self, ranks: Sequence[int]) -> str:
        return "; ".join(p.render(ranks) for p in self.problems)


def plan_tiling(pieces: Sequence[Piece]) -> TilingPlan:
    """Work out how ``pieces`` (one key, one run, any order) make one logical tensor."""
    present = [i for i, p in enumerate(pieces) if not p.is_none]
    nones = tuple(i for i, p in enumerate(pieces) if p.is_none)
    if not present:
        return TilingPlan(status=NONE)
    first = pieces[present[0]]
    problems: list[Problem] = []

    for attr, what in (("logical_shape", "logical shape"), ("dtype", "dtype"),
                       ("complex_as_real", "complex flag")):
        values: dict = {}
        for i in present:
            values.setdefault(getattr(pieces[i], attr), []).append(i)
        if len(values) > 1:
            parts = [f"{_fmt_value(v)} on ranks {{r{k}}}" for k, v in enumerate(values)]
            detail = f"ranks disagree on the {what}: " + ", ".join(parts)
            # each group of positions renders its own rank list
            problem = _multi_problem("disagree", list(values.values()), detail)
            return TilingPlan(status=INCOMPLETE, problems=(problem,))

    shape = first.logical_shape
    for i in present:
        p = pieces[i]
        if len(p.offsets) != len(shape) or len(p.shape) != len(shape) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(p.offsets, p.shape, shape)):
            problems.append(Problem("bounds", (i,), f"the piece of rank {{ranks}} "
                                    f"{_fmt_box(p.offsets, p.shape)} lies outside the logical "
                                    f"shape {list(shape)}"))
    if problems:
        return TilingPlan(status=INCOMPLETE, problems=tuple(problems))
    if any(pieces[i].reduce for i in present):
        return _plan_reduction(pieces, present, nones)

    boxes: dict[tuple, list[int]] = {}
    for i in present:
        if pieces[i].numel == 0:
            continue  # an empty shard (uneven sharding) covers nothing
        boxes.setdefault(pieces[i].box, []).append(i)

    take: list[int] = []
    replica_sets: list[tuple[int, ...]] = []
    dedupe_sets: list[tuple[int, ...]] = []
    partial = False
    for (offsets, bshape), members in boxes.items():
        flags = {(pieces[i].replica, pieces[i].partial) for i in members}
        partials = {pf for _, pf in flags}
        if len(partials) > 1:
            problems.append(Problem("mixed_flags", tuple(members),
                                    f"ranks {{ranks}} hold {_fmt_box(offsets, bshape)} but only "
                                    "some of them as a Partial addend"))
            continue
        if partials == {True}:
            partial = True
            if all(pieces[i].replica for i in members) and len(members) > 1:
                dedupe_sets.append(tuple(members))
            else:
                take.extend(members)
            continue
        if len(members) > 1 and not all(pieces[i].replica for i in members):
            problems.append(Problem("overlap", tuple(members),
                                    f"ranks {{ranks}} all hold {_fmt_box(offsets, bshape)} and "
                                    "are not marked as replicas"))
            continue
        take.append(members[0])
        if len(members) > 1:
            replica_sets.append(tuple(members))
    problems.extend(_overlaps(pieces, list(boxes)))
    if problems:
        return TilingPlan(status=INCOMPLETE, problems=tuple(problems), dtype=first.dtype,
                          logical_shape=shape)

    covered = sum(math.prod(s) for _, s in boxes)
    total = math.prod(shape)
    if covered != total:
        return TilingPlan(status=INCOMPLETE, dtype=first.dtype, logical_shape=shape,
                          problems=(_gap(shape, list(boxes), covered, present),))

    plan = TilingPlan(status=OK, take=tuple(sorted(take)), replica_sets=tuple(replica_sets),
                      dedupe_sets=tuple(dedupe_sets), partial=partial, dtype=first.dtype,
                      logical_shape=shape, complex_as_real=first.complex_as_real)
    if nones:
        full_copies = all(pieces[i].replica for i in present)
        kind = REPLICA_DIVERGENCE if full_copies else INCOMPLETE
        what = ("the other replicas hold values" if full_copies
                else "its piece is missing from the logical tensor")
        problem = Problem("none_mixed", nones, f"the tensor is None on ranks {{ranks}} but not on "
                                               f"the others; {what}")
        return TilingPlan(status=kind, take=plan.take, replica_sets=plan.replica_sets,
                          partial=partial, dtype=first.dtype, logical_shape=shape,
                          complex_as_real=first.complex_as_real, problems=(problem,))
    return plan


def _plan_reduction(pieces: Sequence[Piece], present: list[int],
                    nones: tuple[int, ...]) -> TilingPlan:
    """Pieces that are addends of a reduction over the batch (a per-rank loss or mean).

    Each covers the whole logical tensor; pieces with the same reduce_index are replicas of one
    addend (the same dp rank seen from several tp/pp ranks) and must agree; every addend index
    0..reduce_count-1 must be present. A mean weights its addends by reduce_weight.
    """
    first = pieces[present[0]]
    shape = first.logical_shape
    base = dict(dtype=first.dtype, logical_shape=shape, complex_as_real=first.complex_as_real)
    kinds = {(pieces[i].reduce, pieces[i].reduce_count) for i in present}
    if len(kinds) > 1:
        groups: dict = {}
        for i in present:
            groups.setdefault((pieces[i].reduce, pieces[i].reduce_count), []).append(i)
        parts = [f"{_reduce_text(*k)} on ranks {{r{n}}}" for n, k in enumerate(groups)]
        return TilingPlan(status=INCOMPLETE, **base, problems=(_multi_problem(
            "disagree", list(groups.values()),
            "ranks disagree on the reduction over the batch: " + ", ".join(parts)),))
    kind, count = next(iter(kinds))
    if kind not in REDUCE_NAMES:
        return TilingPlan(status=INCOMPLETE, **base, problems=(Problem(
            "disagree", tuple(present), f"unknown reduction {kind} on ranks {{ranks}}"),))
    not_whole = tuple(i for i in present if pieces[i].offsets != (0,) * len(shape)
                      or pieces[i].shape != shape)
    if not_whole:
        return TilingPlan(status=INCOMPLETE, **base, problems=(Problem(
            "bounds", not_whole, "ranks {ranks} hold only part of a reduced value (an addend of "
                                 "a reduction over the batch must cover the whole tensor)"),))
    by_index: dict[int, list[int]] = {}
    for i in present:
        by_index.setdefault(pieces[i].reduce_index, []).append(i)
    missing = sorted(set(range(count)) - set(by_index))
    outside = tuple(i for idx, m in by_index.items() if not 0 <= idx < count for i in m)
    if missing or outside:
        what = []
        if missing:
            what.append(f"the addends of dp ranks {format_ranges(missing)} (of {count}) are "
                        "missing")
        if outside:
            what.append("some addend indices lie outside the dp size")
        return TilingPlan(status=INCOMPLETE, **base, problems=(Problem(
            "gap", tuple(present), f"{_reduce_text(kind, count)} from ranks {{ranks}}: "
                                   + "; ".join(what)),))
    take = sorted(m[0] for m in by_index.values())
    replica_sets = tuple(tuple(m) for m in by_index.values() if len(m) > 1)
    if kind == REDUCE_MEAN:
        total = math.fsum(pieces[i].reduce_weight for i in take)
        coef = tuple(pieces[i].reduce_weight / total if total > 0 else 1.0 / len(take)
                     for i in take)
    else:
        coef = (1.0,) * len(take)
    if nones:  # a None addend next to values: that dp rank's piece is missing
        return TilingPlan(status=INCOMPLETE, **base, problems=(Problem(
            "none_mixed", nones, "the reduced value is None on ranks {ranks} but not on the "
                                 "others"),))
    return TilingPlan(status=OK, take=tuple(take), replica_sets=replica_sets,
                      partial=count > 1, reduce=kind, coef=coef, **base)


def _reduce_text(kind: int, count: int) -> str:
    return f"a {REDUCE_NAMES.get(kind, str(kind))} over {count} dp rank" + \
        ("s" if count != 1 else "")


def _multi_problem(kind: str, groups: list[list[int]], detail: str) -> Problem:
    """A problem whose text names several rank groups ({r0}, {r1}, ...)."""
    return _MultiProblem(kind, tuple(i for g in groups for i in g), detail,
                         tuple(tuple(g) for g in groups))


@dataclass(frozen=True)
class _MultiProblem(Problem):
    groups: tuple[tuple[int, ...], ...] = field(default=())

    def render(self, ranks: Sequence[int]) -> str:
        text = self.detail
        for k, g in enumerate(self.groups):
            text = text.replace(f"{{r{k}}}", format_ranges([ranks[p] for p in g]))
        return text


def _overlaps(pieces: Sequence[Piece], boxes: list[tuple]) -> list[Problem]:
    """Distinct boxes that intersect (vectorized pairwise test)."""
    if len(boxes) < 2 or not boxes[0][0]:
        return []
    lo = np.array([o for o, _ in boxes], dtype=np.int64)
    hi = lo + np.array([s for _, s in boxes], dtype=np.int64)
    inter = np.all(np.maximum(lo[:, None, :], lo[None, :, :])
                   < np.minimum(hi[:, None, :], hi[None, :, :]), axis=2)
    np.fill_diagonal(inter, False)
    out = []
    for a, b in zip(*np.nonzero(np.triu(inter))):
        oa, sa = boxes[a]
        ob, sb = boxes[b]
        out.append(_multi_problem(
            "overlap", [_holders(pieces, boxes[a]), _holders(pieces, boxes[b])],
            f"the pieces of ranks {{r0}} {_fmt_box(oa, sa)} and of ranks {{r1}} "
            f"{_fmt_box(ob, sb)} overlap and are not replicas"))
        if len(out) >= 3:
            break
    return out


def _holders(pieces: Sequence[Piece], box: tuple) -> list[int]:
    return [i for i, p in enumerate(pieces) if not p.is_none and p.box == box]


def _gap(shape: tuple[int, ...], boxes: list[tuple], covered: int, present: list[int]) -> Problem:
    """Describe what the boxes leave uncovered: element count and bounding box of the gap."""
    total = math.prod(shape)
    missing = total - covered
    head = f"pieces from ranks {{ranks}} cover {covered} of {total} elements"
    if not shape:
        return Problem("gap", tuple(present), head + "; the scalar is missing")
    cuts = [sorted({0, g, *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
            for d, g in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_GAP_CELLS or cells == 0:
        return Problem("gap", tuple(present), head + f"; {missing} elements are missing")
    grid = np.zeros([len(c) - 1 for c in cuts], dtype=bool)
    for o, s in boxes:
        idx = tuple(slice(c.index(o[d]), c.index(o[d] + s[d])) for d, c in enumerate(cuts))
        grid[idx] = True
    holes = np.argwhere(~grid)
    lo = holes.min(axis=0)
    hi = holes.max(axis=0)
    region = [f"{cuts[d][lo[d]]}:{cuts[d][hi[d] + 1]}" for d in range(len(shape))]
    return Problem("gap", tuple(present),
                   head + f"; {missing} elements are missing, within [{', '.join(region)}]")


def _fmt_box(offsets: Sequence[int], shape: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, shape)) + "]"


def _fmt_value(v: object) -> str:
    return str(list(v)) if isinstance(v, tuple) else str(v)




# -- one key at a time (tests, tools) ----------------------------------------------------------------

@dataclass
class LogicalDigest:
    """A key's logical digest in one run, with how it was rebuilt."""

    status: int
    digest: DigestValues | None
    plan: TilingPlan
    message: str = ""
    divergent_ranks: tuple[int, ...] = ()

    @property
    def exact(self) -> bool:
        """The fingerprint describes the logical tensor (no Partial box)."""
        return self.digest is not None and not self.plan.partial


def merge_pieces(pieces: Sequence[tuple[Piece, DigestValues | None]],
                 ranks: Sequence[int] | None = None) -> LogicalDigest:
    """Rebuild one key's logical digest from its pieces (layout, digest; digest None if is_none).

    The scalar reference implementation of what the engine does in bulk; `ranks` (default
    0..n-1) name the pieces in messages.
    """
    ranks = list(range(len(pieces))) if ranks is None else list(ranks)
    plan = plan_tiling([p for p, _ in pieces])
    if plan.status == NONE:
        return LogicalDigest(NONE, None, plan)
    if plan.status == INCOMPLETE:
        return LogicalDigest(INCOMPLETE, None, plan, plan.describe(ranks))
    digests = [d for _, d in pieces]
    for rs in plan.replica_sets:
        fps = {digests[i].fingerprint for i in rs}
        if len(fps) > 1:
            first = digests[rs[0]].fingerprint
            bad = [ranks[i] for i in rs if digests[i].fingerprint != first]
            msg = (f"replicas differ: ranks {format_ranges(bad)} disagree with rank {ranks[rs[0]]}")
            return LogicalDigest(REPLICA_DIVERGENCE, None, plan, msg, tuple(bad))
    if plan.status == REPLICA_DIVERGENCE:
        return LogicalDigest(REPLICA_DIVERGENCE, None, plan, plan.describe(ranks),
                             tuple(ranks[i] for i in plan.problems[0].positions))
    if plan.reduce:
        return LogicalDigest(OK, _merge_reduction([digests[i] for i in plan.take], plan.coef),
                             plan)
    boxes: dict[tuple, list[DigestValues]] = {}
    taken = list(plan.take)
    for ds in plan.dedupe_sets:
        seen: set[int] = set()
        for i in ds:
            if digests[i].fingerprint not in seen:
                seen.add(digests[i].fingerprint)
                taken.append(i)
    for i in taken:
        boxes.setdefault(pieces[i][0].box, []).append(digests[i])
    parts = [merge_partial(v) if _is_partial(pieces, k) else v[0] for k, v in boxes.items()]
    if not parts:  # every piece empty: a tensor with no elements
        d0 = next(d for d in digests if d is not None)
        merged = DigestValues.empty(d0.has_moments, d0.sketch_k)
    else:
        merged = merge_disjoint(parts)
    return LogicalDigest(OK, merged, plan)


def _merge_reduction(addends: Sequence[DigestValues], coef: Sequence[float]) -> DigestValues:
    """The digest of sum(coef_i * addend_i): exact for one addend, else like a Partial sum."""
    if len(addends) == 1 and coef[0] == 1.0:
        return addends[0]
    scaled = [replace(a, sum=a.sum * c, sketch=a.sketch * c) for a, c in zip(addends, coef)]
    return merge_partial(scaled)


def _is_partial(pieces: Sequence[tuple[Piece, DigestValues | None]], box: tuple) -> bool:
    return any(p.partial for p, _ in pieces if not p.is_none and p.box == box)


# -- many keys at once -------------------------------------------------------------------------------

@dataclass
class LogicalKeys:
    """Every key of one run, merged: one entry per key, in (A, B) order.

    ``taken_row[taken_start[g]:taken_start[g + 1]]`` are the rows (of the run's columns) whose
    digests make up key g's logical digest.
    """

    A: np.ndarray
    B: np.ndarray
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
    """Capture position: record id of the first piece."""
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

    def __len__(self) -> int:
        return len(self.A)

    def ranks(self, cols, g: int) -> list[int]:
        s = int(self.first[g])
        return [int(r) for r in cols.rank[s:s + int(self.count[g])]]


def build_keys(cols, catalog) -> LogicalKeys:
    """Merge every key of a run's columns (`auditor.compare.columns.RunColumns`) using tiling plans."""
    n = len(cols)
    if n:
        new = np.empty(n, dtype=bool)
        new[0] = True
        np.not_equal(cols.A[1:], cols.A[:-1], out=new[1:])
        new[1:] |= cols.B[1:] != cols.B[:-1]
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

    for size in np.unique(counts):
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
    return LogicalKeys(
        A=cols.A[starts], B=cols.B[starts], first=starts, count=counts, status=status,
        dtype=dtype, shape=shape, numel=numel, nonfinite=nonfinite, all_zero=zeros, fp=fp,
        exact=exact, partial=partial, has_moments=has_moments, stage=cols.stage[starts],
        pos=cols.rid[starts], taken_start=taken_start, taken_row=tr, taken_coef=tc,
        reduced=reduced, conflict=conflict, messages=messages, bad_ranks=bad_ranks,
    )


def _apply(plan: TilingPlan, sig: tuple[int, ...], groups: np.ndarray, rows: np.ndarray, cols,
           catalog, status, dtype, shape, numel, nonfinite, zeros, fp, exact, partial,
           has_moments, messages, bad_ranks, taken_keys, taken_rows, taken_coefs) -> None:
    """Apply one plan to every key (``groups``) sharing its signature; ``rows`` is [g, n]."""
    if plan.status == NONE:
        status[groups] = NONE
        return
    if plan.dtype:
        dtype[groups] = catalog.dtype_code(plan.dtype)
        shape[groups] = catalog.shape_code(plan.logical_shape, plan.complex_as_real)
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
    exact[groups] = (not plan.partial) and all(catalog.seeds_ok[c] for c in sig
                                               if not catalog.pieces[c].is_none)
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
