"""Regrouped microbatches: compare runs whose steps split their samples into other microbatches.

One run accumulates 4 microbatches of 4 samples, the other runs one of 16; a data-parallel run
with 2 local microbatches a rank against one process with one. Such runs share no per-microbatch
key, yet they compute the same step. Before the keys are built, this stage re-keys the records
of the per-microbatch phases (input, fwd, bwd and the loss) of one run, or of both, into one
grouping, along the batch dim, so that the engine rebuilds and compares them as pieces of the
same logical tensors (docs/comparison.md, "Regrouped microbatches").

- The grouping of a step is read from the runs' own layouts: a key captured in every microbatch
  of both runs whose logical shapes agree but in one dim, whose sizes add up to the same total,
  holds the batch on that dim; the sizes are the microbatches' sample counts.
- Samples are placed in each run's order (microbatch 0's samples first; within a microbatch the
  dp ranks' shares in rank order, as the layouts say) and then aligned by content where both
  runs sent the bytes of a batch-holding key: the input (phase ``input``) or, else, the earliest
  activation, matched row by row (bitwise, or nearest row with a clear margin). So a
  data-parallel run whose ranks took contiguous shares of the step and split them into local
  microbatches aligns with one process that ran the step whole.
- The target grouping is the other run's when every re-keyed piece lands inside one of its
  microbatches, else the step as one microbatch (microbatch 0 then stands for the whole step).
- A re-keyed piece sits at another place of another logical tensor than the one its digest was
  made for. Its version-3 fingerprint follows it (`Catalog.moved`: a translation of its global
  indices by d multiplies it by ``h**d``), so equal bits still make a key *identical*; its
  sketch does not (docs/digests.md "Placing pieces after the fact"), and neither does a
  fingerprint when the runs' samples were dealt in another order or the store predates
  version 3. Keys whose pieces all carry payloads are compared exactly from the bytes; the
  others, when their bits differ, from the per-sample digests both runs' agents sent
  (`auditor.compare.measure.per_sample`: keyed within the sample, they follow any re-keying), and
  without them breach as uncertain, saying so, unless the policy lets uncertain findings pass.
- A declared activation-gradient scale is relative to the run's own microbatches: re-keyed
  into microbatches of another size it is rescaled by the ratio (`rescale_declared`).
- Per-rank losses (mean or sum addends) are renumbered as addends of the target microbatch,
  weighted by their samples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import overload

import numpy as np

from numaudit.auditor.compare.merge.samples import (
    align_samples,
    round_robin,
    sample_starts,
    share_dim,
)
from numaudit.auditor.compare.read.columns import Catalog, RunColumns, unpack_when
from numaudit.auditor.compare.read.pieces import REDUCE_NONE
from numaudit.wire.vocabulary import Phase

BATCH_PHASES = (Phase.INPUT, Phase.FWD, Phase.BWD)
"""Per-microbatch phases whose tensors hold the microbatch's samples along a batch dim."""


@dataclass
class StepPlan:
    """How one step's samples are regrouped."""

    step: int
    dim_of: dict[tuple[int, int], int]
    """(phase, B) of each batch-holding key → its batch dim."""
    rows_ref: dict[int, int]
    """Microbatch → samples, in ref."""
    rows_cand: dict[int, int]
    perm: np.ndarray
    """perm[g] = ref's sample position of cand's sample g (both in their runs' order)."""
    aligned_by: str
    """How perm was found, for the report."""
    dealt: tuple[str, int] | None = None
    """(run, dp size) when that run's dp ranks were dealt the samples in turn (a
    DistributedSampler): its pieces hold no consecutive samples in the other run's order, so
    both runs are re-keyed in their own orders and compared row by sample
    (`Catalog.sample_orders`)."""


def regroup(rc: RunColumns, cc: RunColumns, catalog: Catalog
            ) -> tuple[RunColumns, RunColumns, list[str]]:
    """The two runs' columns with differently grouped steps re-keyed into one grouping, and one
    line per kind of regrouping for the report's warnings (empty when the runs group alike)."""
    notes: dict[str, list[int]] = {}
    s_r, mb_r, ph_r = unpack_when(rc.when)
    s_c, mb_c, ph_c = unpack_when(cc.when)
    new_r = {"when": rc.when.copy(), "layout": rc.layout.copy(), "fp": rc.fp.copy()}
    new_c = {"when": cc.when.copy(), "layout": cc.layout.copy(), "fp": cc.fp.copy()}
    changed = False
    probed = False
    """Whether a step grouped alike was aligned already: reading a step's rows costs payload
    reads, and the first such step tells the order of the data pipeline, unless its samples
    were dealt to dp ranks in turn (then every step is re-keyed, and so aligned)."""
    codes = _code_arrays(catalog)
    for step in np.intersect1d(np.unique(s_r), np.unique(s_c)):
        at_r, at_c = _step_rows_of(rc, mb_r, int(step)), _step_rows_of(cc, mb_c, int(step))
        probe_plan = None
        if _alike(rc, cc, at_r, at_c, ph_r, ph_c, codes):
            # the same microbatches, every key of the same logical shape in both runs: only
            # the keys alignment reads are planned, to see whether the samples are in order
            if probed:
                continue
            probe_r, probe_c = _probe(rc, cc, at_r, at_c, ph_r, ph_c)
            probe_plan, why = _plan(int(step), rc, cc, probe_r, probe_c, mb_r, mb_c, ph_r,
                                    ph_c, catalog, probe=True)
            if probe_plan is None:
                probed = True
                if why:
                    notes.setdefault(why, []).append(int(step))
                continue
        plan, why = _plan(int(step), rc, cc, at_r, at_c, mb_r, mb_c, ph_r, ph_c, catalog,
                          known=probe_plan)
        if plan is None:
            if why:
                notes.setdefault(why, []).append(int(step))
            continue
        text = _apply(plan, rc, cc, at_r, at_c, mb_r, mb_c, ph_r, ph_c, catalog, new_r, new_c)
        notes.setdefault(text, []).append(int(step))
        changed = True
    if not changed:
        return rc, cc, _lines(notes)
    return _rebuilt(rc, new_r), _rebuilt(cc, new_c), _lines(notes)


def _step_rows_of(cols: RunColumns, mb: np.ndarray, step: int) -> np.ndarray:
    """Rows of ``step``'s per-microbatch records (columns are sorted by A, step first)."""
    lo, hi = np.searchsorted(cols.when, [step << 24, (step + 1) << 24])
    return lo + np.flatnonzero(mb[lo:hi] >= 0)


def _code_arrays(catalog: Catalog) -> tuple[np.ndarray, np.ndarray]:
    """Per layout code: an id equal for equal logical shapes (-1 for None, flat or ragged
    pieces), and the dim on which the piece is a dp batch share (-1: none)."""
    ids: dict[tuple[int, ...], int] = {}
    shape_id = np.array([-1 if p.is_none or p.flat or p.ragged is not None else
                         ids.setdefault(p.logical_shape, len(ids)) for p in catalog.pieces]
                        or [-1], np.int64)
    shares = np.array([-1 if (d := share_dim(p)) is None else d for p in catalog.pieces]
                      or [-1], np.int64)
    return shape_id, shares


def _alike(rc, cc, at_r, at_c, ph_r, ph_c, codes) -> bool:
    """Both runs hold the step's batch-phase keys in the same microbatches with the same
    logical shapes (vectorized: most steps of most comparisons are so)."""
    def signature(cols, at, ph):
        # rows are sorted by key: one row per run of equal (key, logical shape) is the set of
        # them when a key's pieces agree on the shape (else a longer list: "not alike", which
        # costs the full plan, never a wrong answer)
        at = at[np.isin(ph[at], BATCH_PHASES)]
        sid = codes[0][cols.layout[at]]
        keep = sid >= 0
        A, B, sid = cols.when[at][keep], cols.where[at][keep], sid[keep]
        new = np.ones(len(A), bool)
        new[1:] = (A[1:] != A[:-1]) | (B[1:] != B[:-1]) | (sid[1:] != sid[:-1])
        return A[new], B[new], sid[new]

    a, b = signature(rc, at_r, ph_r), signature(cc, at_c, ph_c)
    return all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, b))


def _probe(rc, cc, at_r, at_c, ph_r, ph_c) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the keys `align_samples` reads (the input, the first activations) in both
    runs: enough to tell whether samples were dealt, without looking at every key."""
    fwd = at_r[ph_r[at_r] == Phase.FWD]
    first = fwd[np.argsort(rc.rid[fwd], kind="stable")]
    _, at = np.unique(rc.where[first], return_index=True)
    keys = set(rc.where[first[np.sort(at)[:4]]].tolist())

    def rows(cols, at, ph):
        return at[(ph[at] == Phase.INPUT) | ((ph[at] == Phase.FWD)
                                                & np.isin(cols.where[at], list(keys)))]
    return rows(rc, at_r, ph_r), rows(cc, at_c, ph_c)


def _lines(notes: dict[str, list[int]]) -> list[str]:
    from numaudit.auditor.compare.read.ranges import format_ranges
    return [f"step {format_ranges(steps)}: {text}" if len(steps) == 1 else
            f"steps {format_ranges(steps)}: {text}" for text, steps in notes.items()]


def _rebuilt(cols: RunColumns, new: dict) -> RunColumns:
    assert cols.order is not None  # RunColumns.__post_init__ sets it
    out = RunColumns(cols.name, cols.side, new["when"], cols.where.copy(), cols.rank.copy(),
                     cols.stage.copy(), cols.flags.copy(), new["layout"], new["fp"],
                     cols.rid.copy(), max_rid=cols.max_rid, order=cols.order.copy())
    out.sort()
    return out


# -- the plan of a step ----------------------------------------------------------------------------

def _shapes(cols: RunColumns, at: np.ndarray, mb: np.ndarray, ph: np.ndarray, catalog: Catalog
            ) -> tuple[dict[tuple[int, int], dict[int, tuple[int, ...]]],
                       dict[tuple[int, int], int]]:
    """(phase, B) → microbatch → logical shape, for the batch phases' records at ``at``
    (None pieces and flat or ragged pieces left out), and (phase, B) → the dim its pieces are
    dp batch shares on (`samples.share_dim`), where they are; one look per distinct layout."""
    at = at[np.isin(ph[at], BATCH_PHASES)]
    out: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}
    shares: dict[tuple[int, int], int] = {}
    if not len(at):
        return out, shares
    combo = np.stack([cols.when[at], cols.where[at], cols.layout[at].astype(np.int64)], axis=1)
    _, first = np.unique(combo, axis=0, return_index=True)
    for r in at[np.sort(first)]:
        piece = catalog.pieces[cols.layout[r]]
        if piece.is_none or piece.flat or piece.ragged is not None:
            continue
        k = (int(ph[r]), int(cols.where[r]))
        out.setdefault(k, {})[int(mb[r])] = piece.logical_shape
        d = share_dim(piece)
        if d is not None:
            shares.setdefault(k, d)
    return out, shares


def _batch_dim(ref: dict[int, tuple], cand: dict[int, tuple]) -> int | None:
    """The dim on which a key's logical shapes differ between microbatches and runs while the
    totals agree: the batch dim; None when the key holds no batch that way."""
    shapes = list(ref.values()) + list(cand.values())
    ndim = len(shapes[0])
    if ndim == 0 or any(len(s) != ndim for s in shapes):
        return None
    varying = [d for d in range(ndim) if len({s[d] for s in shapes}) > 1]
    if len(varying) != 1:
        return None
    d = varying[0]
    if sum(s[d] for s in ref.values()) != sum(s[d] for s in cand.values()):
        return None
    return d


def _plan(step, rc, cc, at_r, at_c, mb_r, mb_c, ph_r, ph_c, catalog, probe: bool = False,
          known: StepPlan | None = None) -> tuple[StepPlan | None, str]:
    """How step ``step`` is regrouped (None: it is not, and why, "" for nothing to say).
    ``probe``: a step grouped alike, whose keys' batch dim no shape shows: the dp ranks'
    split says it, else the batch is taken on dim 0 (only to tell whether the samples are in
    order: no dp shares, nothing to re-key). ``known``: the probe's plan of this step, whose
    alignment is kept (the payloads are not read twice); only the keys are planned again."""
    sh_r, shares_r = _shapes(rc, at_r, mb_r, ph_r, catalog)
    sh_c, shares_c = _shapes(cc, at_c, mb_c, ph_c, catalog)
    mbs_r = sorted({int(m) for m in mb_r[at_r]})
    mbs_c = sorted({int(m) for m in mb_c[at_c]})
    dim_of: dict[tuple[int, int], int] = {}
    rows_r: dict[int, int] | None = None
    rows_c: dict[int, int] | None = None
    # keys in ref's capture order: the earliest batch-holding key sets the grouping
    first_rid: dict[tuple[int, int], int] = {}  # every key of sh_r is some row's of at_r
    for r in at_r:
        k = (int(ph_r[r]), int(rc.where[r]))
        if k in sh_r and k not in first_rid:
            first_rid[k] = int(rc.rid[r])
    for k in sorted((k for k in sh_r if k in sh_c), key=lambda k: first_rid[k]):
        ref, cand = sh_r[k], sh_c[k]
        if sorted(ref) != mbs_r or sorted(cand) != mbs_c:
            continue  # not captured in every microbatch of the step
        d = _batch_dim(ref, cand)
        if d is None and len(set(ref.values()) | set(cand.values())) == 1:
            # one shape everywhere: the dim a run's dp ranks split, if either run has them
            d = shares_c.get(k, shares_r.get(k, 0 if probe else None))
        if d is None:
            continue
        kr = {m: s[d] for m, s in ref.items()}
        kc = {m: s[d] for m, s in cand.items()}
        if rows_r is None:
            rows_r, rows_c = kr, kc
        if kr == rows_r and kc == rows_c:
            dim_of[k] = d
    if rows_r is None:
        return None, ""
    assert rows_c is not None  # set together with rows_r
    if known is not None:
        return replace(known, dim_of={**dim_of, **known.dim_of}), ""
    alike = [rows_r[m] for m in mbs_r] == [rows_c[m] for m in mbs_c]
    shared = [k for k in dim_of if k in shares_c or k in shares_r]
    perm, aligned_by = align_samples(rc, cc, at_r, at_c, mb_r, mb_c, ph_r, ph_c, catalog, dim_of,
                                     rows_r, rows_c)
    if perm is None:
        return None, "" if alike else aligned_by
    dealt = None
    if shared:
        k = shared[0]
        inverse = np.empty_like(perm)
        inverse[perm] = np.arange(len(perm))
        if (n := round_robin(cc, at_c, mb_c, ph_c, catalog, k, dim_of[k], rows_c, perm)):
            dealt = (cc.name, n)
        elif (n := round_robin(rc, at_r, mb_r, ph_r, catalog, k, dim_of[k], rows_r, inverse)):
            dealt = (rc.name, n)
    if alike and dealt is None:
        # the same grouping, and the same order (or one no sampler deals: compared as it is)
        if np.array_equal(perm, np.arange(len(perm))) or not aligned_by.startswith(
                "samples aligned"):
            return None, ""
        moved = int(np.count_nonzero(perm != np.arange(len(perm))))
        return None, (f"{cc.name} holds {rc.name}'s samples in another order ({moved} of "
                      f"{len(perm)} moved; {aligned_by}), one that no sampler's dealing to dp "
                      "ranks explains (shuffled, or microbatches fed in another order): the "
                      "per-microbatch keys are compared as they are and differ where the order "
                      "does")
    return StepPlan(step, dim_of, rows_r, rows_c, perm, aligned_by, dealt), ""


# -- re-keying -------------------------------------------------------------------------------------

@overload
def _placements(cols, at, mb, ph, catalog, plan: StepPlan, rows: dict[int, int],
                to_target: None) -> dict[int, tuple[int, int]]: ...
@overload
def _placements(cols, at, mb, ph, catalog, plan: StepPlan, rows: dict[int, int],
                to_target: np.ndarray) -> dict[int, tuple[int, int]] | None: ...
def _placements(cols, at, mb, ph, catalog, plan: StepPlan, rows: dict[int, int],
                to_target: np.ndarray | None) -> dict[int, tuple[int, int]] | None:
    """Record → (target sample position of its first row, rows) for the batch-holding records
    at ``at``, in the target's sample order (``to_target`` maps the run's positions; None:
    identity); None when a piece's samples are not consecutive there."""
    starts = sample_starts(rows)
    out = {}
    for r in at[np.isin(ph[at], BATCH_PHASES)]:
        d = plan.dim_of.get((int(ph[r]), int(cols.where[r])))
        if d is None:
            continue
        piece = catalog.pieces[cols.layout[r]]
        if piece.is_none:
            continue
        g0 = starts[int(mb[r])] + piece.offsets[d]
        n = piece.shape[d]
        if to_target is not None and n:
            pos = to_target[g0:g0 + n]
            if not np.array_equal(pos, np.arange(pos[0], pos[0] + n)):
                return None
            g0 = int(pos[0])
        out[int(r)] = (g0, n)
    return out


def _fits(place: dict[int, tuple[int, int]], rows: dict[int, int]) -> bool:
    starts = sample_starts(rows)
    bounds = [(starts[m], starts[m] + rows[m]) for m in sorted(rows)]
    for g0, n in place.values():
        if n and not any(lo <= g0 and g0 + n <= hi for lo, hi in bounds):
            return False
    return True


def _apply(plan: StepPlan, rc, cc, at_r, at_c, mb_r, mb_c, ph_r, ph_c, catalog,
           new_r: dict, new_c: dict) -> str:
    inverse = np.empty_like(plan.perm)
    inverse[plan.perm] = np.arange(len(plan.perm))
    grouping = _grouping(plan, rc.name, cc.name)
    place_c = _placements(cc, at_c, mb_c, ph_c, catalog, plan, plan.rows_cand, plan.perm)
    place_r = None
    moves: list[tuple[str, dict[int, tuple[int, int]], np.ndarray | None]]
    # (side, its placements in the target's order, the map of its positions to it)
    if place_c is not None and _fits(place_c, plan.rows_ref):
        target, what = plan.rows_ref, f"{cc.name}'s re-keyed into {rc.name}'s"
        moves = [("cand", place_c, plan.perm)]
    elif (place_r := _placements(rc, at_r, mb_r, ph_r, catalog, plan, plan.rows_ref, inverse)
          ) is not None and _fits(place_r, plan.rows_cand):
        target, what = plan.rows_cand, f"{rc.name}'s re-keyed into {cc.name}'s"
        moves = [("ref", place_r, inverse)]
    elif place_c is not None:
        target, what = {0: len(plan.perm)}, ("both re-keyed into one of the whole step "
                                             "(microbatch 0)")
        moves = [("ref", _placements(rc, at_r, mb_r, ph_r, catalog, plan, plan.rows_ref, None),
                  None), ("cand", place_c, plan.perm)]
    elif plan.dealt is not None:
        run, n = plan.dealt
        target, what = {0: len(plan.perm)}, (
            f"{run}'s {n} dp ranks were dealt the samples in turn (a DistributedSampler's "
            "order): both runs re-keyed into one microbatch of the whole step, each in its own "
            f"order, and {cc.name}'s rows compared with {rc.name}'s rows of the same samples "
            f"(boxes and element indices in {cc.name}'s order)")
        moves = [("ref", _placements(rc, at_r, mb_r, ph_r, catalog, plan, plan.rows_ref, None),
                  None),
                 ("cand", _placements(cc, at_c, mb_c, ph_c, catalog, plan, plan.rows_cand, None),
                  None)]
        for (phase, b), d in plan.dim_of.items():
            catalog.sample_orders[((plan.step << 24) | (1 << 4) | phase, b)] = (plan.perm, d)
    else:
        return (f"{grouping}, and {cc.name}'s pieces do not hold consecutive samples in "
                f"{rc.name}'s order (samples dealt round-robin to ranks?): not regrouped; "
                "compare runs whose ranks take consecutive shares of the batch")
    starts = sample_starts(target)
    sample_dims = catalog.__dict__.setdefault("sample_dims", {})
    """(when, where) of a re-keyed key -> the dim its pieces moved along (`per_sample`: a piece's
    sample digests follow it only along its samples' dim)."""
    sizes = catalog.__dict__.setdefault("regrouped_sizes", {"ref": set(), "cand": set()})
    """Per side: (its microbatch's samples, the target microbatch's) of every re-keyed piece
    (`rescale_declared`)."""
    for side, place, to_target in moves:
        cols, new, mb, ph, at, rows = (
            (rc, new_r, mb_r, ph_r, at_r, plan.rows_ref) if side == "ref" else
            (cc, new_c, mb_c, ph_c, at_c, plan.rows_cand))
        for r, (g0, n) in place.items():
            t = _target_mb(g0, n, starts, target)
            d = plan.dim_of[(int(ph[r]), int(cols.where[r]))]
            piece = catalog.pieces[cols.layout[r]]
            logical, offsets = list(piece.logical_shape), list(piece.offsets)
            logical[d], offsets[d] = target[t], g0 - starts[t]
            new["layout"][r], new["fp"][r] = catalog.moved(
                replace(piece, logical_shape=tuple(logical), offsets=tuple(offsets)),
                int(cols.layout[r]), int(cols.fp[r]), exact=plan.dealt is None)
            new["when"][r] = (plan.step << 24) | ((t + 1) << 4) | int(ph[r])
            sample_dims[(int(new["when"][r]), int(cols.where[r]))] = d
            sizes[side].add((rows[int(mb[r])], target[t]))
        _regroup_losses(cols, at, mb, ph, catalog, plan.step, rows, target, starts, to_target,
                        new)
    how = what if plan.dealt else f"{what} microbatches along the batch dim"
    moved = [int(side_cols.layout[r]) for side, place, _ in moves
             for side_cols in [rc if side == "ref" else cc] for r in place]
    if plan.dealt is None and moved and all(catalog.shiftable(c) for c in moved):
        return (f"{grouping}: {how}; {plan.aligned_by}; re-keyed pieces took their "
                "fingerprints along (bitwise equality stays exact) but not their sketches: a key "
                "whose bits differ is measured from payloads, else from the per-sample digests "
                "of both runs' agents, and without either it breaches as uncertain under a "
                "tolerance (payloads: NUMAUDIT_PAYLOAD_MAX_BYTES, NUMAUDIT_PAYLOAD; per-sample "
                "digests: agents of this build, docs/digests.md)")
    return (f"{grouping}: {how}; {plan.aligned_by}; "
            "re-keyed pieces are compared by their payloads, else by the per-sample digests of "
            "both runs' agents (their fingerprints and sketches describe their old places): a "
            "key with neither breaches as uncertain (payloads: NUMAUDIT_PAYLOAD_MAX_BYTES, "
            "NUMAUDIT_PAYLOAD)")


def _target_mb(g0: int, n: int, starts: dict[int, int], target: dict[int, int]) -> int:
    """The target microbatch holding positions g0 .. g0 + n - 1 (-1: none holds them all)."""
    for m in sorted(target):
        if starts[m] <= g0 and g0 + n <= starts[m] + target[m]:
            return m
    return -1


def _regroup_losses(cols, at, mb, ph, catalog, step: int, rows: dict[int, int],
                    target: dict[int, int], starts: dict[int, int], to_target, new) -> None:
    """Per-rank loss addends of the step as addends of the target microbatches, weighted by
    their samples (each addend holds an equal share of its microbatch, in dp-rank order); the
    step's losses are left as they are when an addend's samples are not one run of a target
    microbatch."""
    src_starts = sample_starts(rows)
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r in at[ph[at] == Phase.LOSS]:
        piece = catalog.pieces[cols.layout[r]]
        m = int(mb[r])
        if piece.reduce == REDUCE_NONE or piece.is_none or m not in rows:
            return
        share, rest = divmod(rows[m], max(piece.reduce_count, 1))
        if rest or not share:
            return
        g0 = src_starts[m] + piece.reduce_index * share
        if to_target is not None:
            pos = to_target[g0:g0 + share]
            if len(pos) != share or not np.array_equal(pos, np.arange(pos[0], pos[0] + share)):
                return
            g0 = int(pos[0])
        t = _target_mb(g0, share, starts, target)
        if t < 0:
            return
        groups.setdefault((int(cols.where[r]), t), []).append((g0, int(r), share))
    for (_, t), addends in groups.items():
        addends.sort()
        for i, (_, r, share) in enumerate(addends):
            code = cols.layout[r]
            new["layout"][r] = catalog.derived_piece(
                replace(catalog.pieces[code], reduce_index=i, reduce_count=len(addends),
                        reduce_weight=float(share)), int(code), placed=True)
            new["when"][r] = (step << 24) | ((t + 1) << 4) | Phase.LOSS


def _grouping(plan: StepPlan, ref: str, cand: str) -> str:
    return (f"{ref} groups the step's {len(plan.perm)} samples as {_sizes(plan.rows_ref)}, "
            f"{cand} as {_sizes(plan.rows_cand)}")


def _sizes(rows: dict[int, int]) -> str:
    sizes = [rows[m] for m in sorted(rows)]
    if len(set(sizes)) == 1:
        return f"{len(sizes)} microbatch{'es' if len(sizes) > 1 else ''} of {sizes[0]}"
    return "microbatches of " + ", ".join(map(str, sizes))


def rescale_declared(infos: dict[str, dict], catalog: Catalog) -> list[str]:
    """Declared activation-gradient scales (``grad_scale``) of runs whose microbatches were
    re-keyed, made relative to the microbatches they were re-keyed into; one line each for the
    report's warnings.

    A declared scale is relative to one process whose loss is the mean over the run's *own*
    microbatch (docs/parallelisms.md "What you declare": ``grad_scale=1/4`` for a loss divided
    by 4 accumulation steps). Re-keyed into microbatches of ``t`` samples from its own of ``m``,
    the reference is the mean over ``t``, whose gradients are ``m / t`` of those: the scale
    becomes ``grad_scale x t / m``. Scales the agent inferred are left as they are: inferred as
    if the loss were not divided by the accumulation, they already equal the re-keyed ones for
    the common loop that divides it (a loss that is not divided is then found as a factor)."""
    sizes = catalog.__dict__.get("regrouped_sizes", {})
    lines = []
    for side, info in infos.items():
        pairs = sizes.get(side)
        sources = info.get("grad_scale_sources") or []
        scale = info.get("grad_scale")
        if not pairs or scale is None or not sources or \
                not all(s.startswith("declared") for s in sources):
            continue
        ratios = {t / m for m, t in pairs if m}
        if ratios == {1.0}:
            continue
        name = info.get("name", side)
        if len(ratios) != 1:
            lines.append(f"{name}: its declared gradient scale x{scale:g} is relative to its own "
                         "microbatches, which were re-keyed into microbatches of other sizes "
                         f"({', '.join(f'{m} into {t}' for m, t in sorted(pairs))}): activation "
                         "gradients are compared under its declared scale as it is")
            continue
        (ratio,) = ratios
        info["grad_scale"] = scale * ratio
        own = sorted({m for m, _ in pairs})
        target = sorted({t for _, t in pairs})
        lines.append(f"{name}: its declared gradient scale x{scale:g} ({', '.join(sources)}) is "
                     f"relative to its own microbatches of {', '.join(map(str, own))} samples; "
                     f"re-keyed into microbatches of {', '.join(map(str, target))} it is "
                     f"x{scale * ratio:g}, and activation gradients are compared under that")
    return lines
