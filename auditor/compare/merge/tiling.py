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
- pieces of one key must agree on logical shape and dtype, and be all flat or all boxes (a flat
  piece, a range of the tensor's flattening, tiles as a 1-D box of it);
- a None piece (a gradient that was None on that rank) next to pieces that are not None is a
  ``replica_divergence`` when the others still tile the tensor (a replica disagrees), else
  ``incomplete``.

A box held by pieces flagged both ``replica`` and ``partial`` (a Partial placement on one mesh dim,
Replicate on another) cannot be told apart from its layouts alone: such copies are deduplicated
by fingerprint, so identical addends count once (docs/comparison.md states the caveat).

Pure functions; the vectorized application over many keys is `auditor.compare.merge.keys`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

import numpy as np

from numaudit.auditor.compare.digests.algebra import DigestValues, merge_disjoint, merge_partial
from numaudit.auditor.compare.merge.ragged_hint import undeclared_ragged
from numaudit.auditor.compare.read.pieces import REDUCE_MEAN, REDUCE_NAMES, REDUCE_NONE, Piece
from numaudit.auditor.compare.read.ranges import format_ranges

MAX_GAP_CELLS = 1 << 20
"""Grid cells examined to locate a coverage gap; beyond this only the count is reported."""



class Status(IntEnum):
    """What merging one key's pieces gave (`TilingPlan.status`, `LogicalKeys.status`)."""

    OK = 0
    """A logical tensor: its pieces tile it, replicas agree."""
    NONE = 1
    """The tensor was None on every rank (a gradient that never came)."""
    INCOMPLETE = 2
    """The pieces do not make the tensor: a gap, an overlap, shapes or dtypes that disagree."""
    REPLICA_DIVERGENCE = 3
    """Pieces that should be copies of one another differ."""


OK, NONE, INCOMPLETE, REPLICA_DIVERGENCE = (Status.OK, Status.NONE, Status.INCOMPLETE,
                                            Status.REPLICA_DIVERGENCE)
"""The statuses by bare name, as the merge's callers spell them (``M.OK``)."""
STATUS_NAMES = {s: s.name.lower() for s in Status}


@dataclass(frozen=True)
class Problem:
    """Why a key's pieces do not make one logical tensor; positions index the key's pieces."""

    kind: str
    """"none_mixed", "disagree", "bounds", "overlap", "mixed_flags", "gap", "ragged", "order",
    "ragged_undeclared"."""
    positions: tuple[int, ...]
    detail: str
    """Text with ``{ranks}`` where the ranks of ``positions`` go."""

    def render(self, ranks: Sequence[int]) -> str:
        names = format_ranges([ranks[p] for p in self.positions]) if self.positions else ""
        return self.detail.replace("{ranks}", names)


@dataclass(frozen=True)
class TilingPlan:
    """How the pieces of every key with one signature merge into a logical digest."""

    status: Status
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
    flat: bool = False
    """The pieces are flat (`Piece.flat`): `logical_shape` is the tensor's flattening, so the
    key's shape agrees with another run's of as many elements."""
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

    flat = [i for i in present if pieces[i].flat]
    if flat and len(flat) < len(present):
        not_flat = [i for i in present if not pieces[i].flat]
        problem = _multi_problem(
            "disagree", [flat, not_flat], "ranks disagree on the layout: ranks {r0} send flat "
            "pieces (ranges of the tensor's flattening), ranks {r1} boxes of its own shape")
        return TilingPlan(status=INCOMPLETE, problems=(problem,))
    for attr, what in (("logical_shape", "logical shape"), ("dtype", "dtype"),
                       ("complex_as_real", "complex flag")):
        values: dict = {}
        for i in present:
            values.setdefault(getattr(pieces[i], attr), []).append(i)
        if len(values) > 1:
            hint = undeclared_ragged(pieces, present) if attr == "logical_shape" else None
            if hint is not None:
                problem = _multi_problem("ragged_undeclared", *hint)
                return TilingPlan(status=INCOMPLETE, problems=(problem,))
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
    problems = _ragged_problems(pieces, present)
    if problems:
        return TilingPlan(status=INCOMPLETE, problems=tuple(problems), dtype=first.dtype,
                          logical_shape=shape)

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
                      logical_shape=shape, complex_as_real=first.complex_as_real,
                      flat=first.flat)
    if nones:
        full_copies = all(pieces[i].replica for i in present)
        kind = REPLICA_DIVERGENCE if full_copies else INCOMPLETE
        what = ("the other replicas hold values" if full_copies
                else "its piece is missing from the logical tensor")
        problem = Problem("none_mixed", nones, f"the tensor is None on ranks {{ranks}} but not on "
                                               f"the others; {what}")
        return TilingPlan(status=kind, take=plan.take, replica_sets=plan.replica_sets,
                          partial=partial, dtype=first.dtype, logical_shape=shape,
                          complex_as_real=first.complex_as_real, flat=first.flat,
                          problems=(problem,))
    return plan


def _ragged_problems(pieces: Sequence[Piece], present: list[int]) -> list[Problem]:
    """Ragged pieces: their parts cover 0 .. parts - 1 exactly once, rows in part order.

    Pieces declaring the same parts are copies (replicas, addends) and must hold the same rows.
    Runs after the bounds check, before the box tiling (which would report the same faults less
    precisely: a missing part as a gap, parts out of order not at all).
    """
    parts_of = {i: r for i in present if (r := pieces[i].ragged) is not None}
    ragged = list(parts_of)
    if not ragged:
        return []
    plain = [i for i in present if pieces[i].ragged is None]
    if plain:
        return [_multi_problem("ragged", [ragged, plain], "ranks {r0} send ragged parts of the "
                               "tensor and ranks {r1} plain pieces of it")]
    counts: dict[int, list[int]] = {}
    for i in ragged:
        counts.setdefault(parts_of[i][2], []).append(i)
    if len(counts) > 1:
        detail = "ranks disagree on the number of ragged parts: " + ", ".join(
            f"{n} on ranks {{r{k}}}" for k, n in enumerate(counts))
        return [_multi_problem("disagree", list(counts.values()), detail)]
    n_parts = parts_of[ragged[0]][2]
    groups: dict[tuple[int, int], list[int]] = {}
    for i in ragged:
        first, span, _ = parts_of[i]
        groups.setdefault((first, span), []).append(i)
    problems: list[Problem] = []
    for (first, span), members in groups.items():
        if len({pieces[i].box for i in members}) > 1:
            problems.append(Problem("overlap", tuple(members), f"ranks {{ranks}} all hold "
                                    f"{_fmt_parts(first, span, n_parts)} but different rows"))
    holders: list[list[tuple[int, int]]] = [[] for _ in range(n_parts)]
    for first, span in groups:
        for p in range(first, first + span):
            holders[p].append((first, span))
    missing = [p for p in range(n_parts) if not holders[p]]
    if missing:
        problems.append(Problem("gap", (), f"no rank sent ragged part {format_ranges(missing)} of "
                                           f"{n_parts} (parts are concatenated in order)"))
    clashes = sorted({tuple(sorted(h)) for h in holders if len(h) > 1})
    for clash in clashes[:3]:
        both = [groups[g] for g in clash]
        shared = [p for p in range(n_parts) if all(g[0] <= p < g[0] + g[1] for g in clash)]
        problems.append(_multi_problem(
            "overlap", both, " and ".join(f"ranks {{r{k}}} ({_fmt_parts(*g, n_parts)})"
                                          for k, g in enumerate(clash))
            + f" both hold part {format_ranges(shared)}"))
    if problems:
        return problems
    row = 0
    for first, span in sorted(groups):
        lead = groups[(first, span)]
        offset, rows = pieces[lead[0]].offsets[0], pieces[lead[0]].shape[0]
        if offset != row:
            problems.append(Problem("order", tuple(lead), f"ranks {{ranks}} hold "
                                    f"{_fmt_parts(first, span, n_parts)} at rows "
                                    f"{offset}:{offset + rows}, but the parts before it end at "
                                    f"row {row}"))
            break
        row = offset + rows
    else:
        total = pieces[ragged[0]].logical_shape[0]
        if row != total:
            problems.append(Problem("gap", tuple(ragged), f"the ragged parts of ranks {{ranks}} "
                                    f"end at row {row} of {total}"))
    return problems


def _fmt_parts(first: int, span: int, parts: int) -> str:
    which = f"part {first}" if span == 1 else f"parts {first}-{first + span - 1}"
    return f"{which} of {parts}"


def _plan_reduction(pieces: Sequence[Piece], present: list[int],
                    nones: tuple[int, ...]) -> TilingPlan:
    """Pieces that are addends of a reduction over the batch (a per-rank loss or mean).

    Each covers the whole logical tensor; pieces with the same reduce_index are replicas of one
    addend (the same dp rank seen from several tp/pp ranks) and must agree; every addend index
    0..reduce_count-1 must be present. A mean weights its addends by reduce_weight.
    """
    first = pieces[present[0]]
    shape = first.logical_shape
    base = TilingPlan(status=INCOMPLETE, dtype=first.dtype, logical_shape=shape,
                      complex_as_real=first.complex_as_real, flat=first.flat)
    kinds = {(pieces[i].reduce, pieces[i].reduce_count) for i in present}
    if len(kinds) > 1:
        groups: dict = {}
        for i in present:
            groups.setdefault((pieces[i].reduce, pieces[i].reduce_count), []).append(i)
        parts = [f"{_reduce_text(*k)} on ranks {{r{n}}}" for n, k in enumerate(groups)]
        return replace(base, problems=(_multi_problem(
            "disagree", list(groups.values()),
            "ranks disagree on the reduction over the batch: " + ", ".join(parts)),))
    kind, count = next(iter(kinds))
    if kind not in REDUCE_NAMES:
        return replace(base, problems=(Problem(
            "disagree", tuple(present), f"unknown reduction {kind} on ranks {{ranks}}"),))
    not_whole = tuple(i for i in present if pieces[i].offsets != (0,) * len(shape)
                      or pieces[i].shape != shape)
    if not_whole:
        return replace(base, problems=(Problem(
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
        return replace(base, problems=(Problem(
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
        return replace(base, problems=(Problem(
            "none_mixed", nones, "the reduced value is None on ranks {ranks} but not on the "
                                 "others"),))
    return replace(base, status=OK, take=tuple(take), replica_sets=replica_sets,
                   partial=count > 1, reduce=kind, coef=coef)


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




# -- one key at a time (tests, tools) --------------------------------------------------------------

@dataclass
class LogicalDigest:
    """A key's logical digest in one run, with how it was rebuilt."""

    status: Status
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
    # only None pieces lack a digest, and plans never take or compare those positions
    digests = {i: d for i, (_, d) in enumerate(pieces) if d is not None}
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
        d0 = next(iter(digests.values()))
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
