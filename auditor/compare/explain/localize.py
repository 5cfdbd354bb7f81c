"""Which ranks' pieces of a diverged key differ (docs/comparison.md, "Localize to ranks").

Run once per comparison while the store is open (`localize_breaches`), for the breaching
`diverged`/`nonfinite` findings a report lists (the first divergence and at most
`LOCALIZE_PER_GROUP` per phase and stage): never for the keys that agree. Piece by piece, in this
order of cost:

- equal boxes in both runs: a box whose fingerprints agree (both exact, no loss-normalization
  factor between the runs) agrees; the others are measured from both pieces' payloads where both
  runs sent them, else from the pieces' moments and sketches (a piece's sketch is that of its
  elements at their global positions, so two runs' sketches of one box compare), against the
  key's policy tolerance, so a box off by a rounding error is not named; a box that cannot be
  measured differs by its fingerprint. The method says what decided: ``payload`` (bytes of the
  differing boxes), ``fingerprint`` (fingerprints, confirmed by the sketches), ``moments``
  (no comparable fingerprints: the sketches alone) or ``samples`` (pieces placed by the
  auditor, whose sketches describe other places: both runs' per-sample digests,
  `auditor.compare.measure.per_sample`);
- one run's boxes inside the other's (a single-process reference against DDP pieces): a sub-box
  has no digest of its own, so both logical tensors are rebuilt from payloads and compared box by
  box of the finer run; without payloads, boxes of whole samples are told apart by both runs'
  per-sample digests (method ``samples``); without either it says what would be needed;
- boxes that cross, Partial addends, reductions over the batch: cannot be localized, and says so.

Flat pieces (ranges of a tensor's flattening, as FSDP1 holds a parameter) against boxes of the
tensor's own shape: the boxes are taken as the ranges of the flattening they span, and the pieces
are told apart as above, named by those ranges; boxes that are no such range cannot be localized.

The result is the finding's ``pieces`` field (docs/report-schema.md).
"""

from __future__ import annotations

import math

import numpy as np

from numaudit.auditor.compare.digests.metrics import (
    PayloadUnavailable,
    bits_to_values,
    decode_payload,
    sketch_metrics,
)
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure import per_sample
from numaudit.auditor.compare.measure.payloads import logical_values
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.ranks import box_text, fixed_dims, key_boxes
from numaudit.auditor.compare.read.align import phase_name, role_name
from numaudit.wire.vocabulary import Phase

LOCALIZE_PER_GROUP = 50
"""Breaching findings localized per (phase, stage) group, in execution order (the text report
lists 50 per group by default); the first divergence always is."""
MAX_DIFFER_LISTED = 32
"""Differing pieces listed per finding; `differ_count` says how many there were."""


def localize_breaches(comp) -> None:
    """Fill ``comp.pieces`` for the listed breaching findings (store still open)."""
    idx = comp.indices(breaches_only=True)
    if not len(idx):
        return
    v = comp.verdict[idx]
    both = (comp.ref_index[idx] >= 0) & (comp.cand_index[idx] >= 0)
    idx = idx[((v == F.DIVERGED) | (v == F.NONFINITE)) & both]
    taken: dict[tuple[int, int], int] = {}
    stage = comp.cand_keys.stage
    for i in idx.tolist():
        group = (int(comp.when[i] & 0xF), int(stage[int(comp.cand_index[i])]))
        n = taken.get(group, 0)
        if n >= LOCALIZE_PER_GROUP:
            continue
        taken[group] = n + 1
        try:
            got = localize(comp, i)
        except PayloadUnavailable as exc:
            got = _cannot(f"payloads could not be read ({exc})")
        if got is not None:
            comp.pieces[i] = got


def _cannot(why: str) -> dict:
    return {"method": None, "side": None, "differ": [], "differ_count": 0, "agree": 0,
            "cannot_localize": why}


def localize(comp, i: int) -> dict | None:
    """The ``pieces`` field of finding ``i`` (both runs hold the key); None when each run holds
    the tensor as one piece (the finding's ranks already say all there is)."""
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    rk, ck = comp.ref_keys, comp.cand_keys
    if rk.status[ri] != M.OK or ck.status[ci] != M.OK:
        return _cannot("a run's pieces do not make one logical tensor")
    if rk.reduced[ri] or ck.reduced[ci]:
        return _cannot("a reduction over the batch: each rank holds an addend of the whole "
                       "value, not a piece of it")
    if rk.partial[ri] or ck.partial[ci]:
        return _cannot("Partial addends: no rank holds a piece of the logical tensor by itself")
    rb, cb = key_boxes(comp, "ref", ri), key_boxes(comp, "cand", ci)
    if len(rb) <= 1 and len(cb) <= 1:
        return None  # one piece (or its replicas) in each run: nothing to tell apart
    shapes = comp.catalog.shapes
    mixed = shapes[rk.shape[ri]][2] != shapes[ck.shape[ci]][2]
    if mixed:  # flat pieces in one run, boxes of the tensor's shape in the other
        r_ranges, c_ranges = _as_ranges(comp, rk, ri, rb), _as_ranges(comp, ck, ci, cb)
        if r_ranges is None or c_ranges is None:
            return _cannot("one run holds flat pieces (ranges of the tensor's flattening), the "
                           "other boxes of its shape that are not such ranges")
        rb, cb = r_ranges, c_ranges
    scale = comp.bwd_factor if (int(comp.when[i]) & 0xF) == Phase.BWD else 1.0
    check = _check(comp, i)
    # samples in other orders (auditor.compare.merge.regroup): only the logical values, the
    # reference's in the candidate's order, compare box by box
    permuted = (int(comp.when[i]), int(comp.where[i])) in comp.catalog.sample_orders
    if set(rb) == set(cb) and not permuted:
        return _equal_boxes(comp, i, rb, cb, scale, check)
    if permuted or _inside(cb, rb):
        fine = "cand"
    elif _inside(rb, cb):
        fine = "ref"
    else:
        return _cannot("the runs' pieces cross (neither run's boxes lie inside the other's)")
    coarse = "ref" if fine == "cand" else "cand"
    run = {"ref": comp.ref.name, "cand": comp.cand.name}
    boxes = cb if fine == "cand" else rb
    big = rb if fine == "cand" else cb
    rows = [r for rs in big.values() for r in rs]
    cols = comp.ref if coarse == "ref" else comp.cand
    whole = ", ".join(box_text(*b) for b in list(big)[:3])
    need = (f"{run[coarse]} holds {whole} as one piece (rank{'s' if len(rows) > 1 else ''} "
            f"{', '.join(str(int(cols.rank[r])) for r in rows[:8])}) and a sub-box has no digest "
            f"of its own: comparing the {run[fine]} pieces one by one needs payloads from both "
            "runs (capture this site's payload, e.g. NUMAUDIT_PAYLOAD or the automatic payload of "
            "small tensors, within the policy's payload_max_bytes); the pieces of one run against "
            "each other are no evidence")
    rids = np.concatenate([comp.ref.rid[[r for rs in rb.values() for r in rs]],
                           comp.cand.rid[[r for rs in cb.values() for r in rs]]])
    if not len(rids) or len(comp.catalog.payload_rids(rids)) < len(set(rids.tolist())):
        got = per_sample.localize_boxes(comp, i, boxes, scale, _policy_test(check))
        return _cannot(need) if got is None else _result(comp, fine, "samples", got)
    try:
        ref_vals, _, _ = logical_values(comp, "ref", ri)
        cand_vals, _, _ = logical_values(comp, "cand", ci)
    except PayloadUnavailable as exc:
        return _cannot(f"{need} ({exc})")
    if mixed:
        ref_vals, cand_vals = ref_vals.reshape(-1), cand_vals.reshape(-1)
    ref_vals = ref_vals * scale
    results = []
    for box, brow in boxes.items():
        sl = tuple(slice(o, o + s) for o, s in zip(*box))
        results.append((box, brow, *_measure(ref_vals[sl], cand_vals[sl], check)))
    return _result(comp, fine, "payload", results)


def _as_ranges(comp, keys, g: int, boxes: dict) -> dict | None:
    """A key's boxes (`key_boxes`) as ranges of its tensor's flattening, 1-D boxes as a flat
    piece's: those of a flat key as they are, a box as the row-major range it spans when it is
    one (rows of a dim-0 shard are; a column shard is not), else None."""
    shape, _, flat = comp.catalog.shapes[keys.shape[g]]
    if flat:
        return boxes
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out: dict[tuple, list[int]] = {}
    for (offsets, size), rows in boxes.items():
        start = sum(o * s for o, s in zip(offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, size, strides))
        numel = math.prod(size)
        if last - start + 1 != numel:
            return None
        out[((start,), (numel,))] = rows
    return out


def _inside(small: dict, big: dict) -> bool:
    """Every box of ``small`` lies inside one box of ``big``."""
    def within(a, b):
        return all(bo <= ao and ao + asz <= bo + bsz
                   for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1]))
    return bool(small) and all(any(within(a, b) for b in big) for a in small)


def _check(comp, i: int):
    rk, ck = comp.ref_keys, comp.cand_keys
    dts = comp.catalog.dtypes
    site = comp.catalog.site_names.get(int(comp.where[i] >> 32), "")
    return comp.policy.check(phase_name(int(comp.when[i]) & 0xF), site,
                             role_name((int(comp.where[i]) >> 28) & 0xF),
                             dts[rk.dtype[comp.ref_index[i]]], dts[ck.dtype[comp.cand_index[i]]])


def _measure(r: np.ndarray, c: np.ndarray, check) -> tuple[bool, float]:
    """(differs, rel_l2) of one box from exact values, against the key's tolerance."""
    r = np.where(np.isfinite(r), r, 0.0).reshape(-1)
    c_f = np.isfinite(c).reshape(-1)
    c = np.where(np.isfinite(c), c, 0.0).reshape(-1)
    d = float(np.linalg.norm(c - r))
    rn = float(np.linalg.norm(r))
    rel = d / rn if rn > 0 else (math.inf if d > 0 else 0.0)
    differs = _beyond(rel, d, rn, r.size, check) or not c_f.all()
    if check.elementwise and r.size:
        differs |= bool(np.any(np.abs(c - r) > check.atol + check.rtol * np.abs(r)))
    return differs, rel


def _beyond(rel: float, dist: float, rn: float, n: int, check) -> bool:
    explicit = check.threshold if check.metric == "rel_l2" and check.threshold is not None \
        else None
    # written as "not within" so that NaN (a non-finite piece) differs
    if rn > 0:
        thr = explicit if explicit is not None else check.rtol + check.atol * math.sqrt(n) / rn
        return not rel <= thr
    return not dist <= (explicit if explicit is not None else check.atol * math.sqrt(n))


def _policy_test(check):
    """`_beyond` with the key's policy check bound: (rel, dist, ref norm, numel) -> differs."""
    return lambda rel, dist, rn, n: _beyond(rel, dist, rn, n, check)


def _equal_boxes(comp, i, rb: dict, cb: dict, scale: float, check) -> dict:
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    exact = bool(comp.ref_keys.exact[ri] and comp.cand_keys.exact[ci]) and scale == 1.0
    results, todo = [], []
    for box, crows in cb.items():
        rrow = rb[box][0]
        if exact and comp.ref.fp[rrow] == comp.cand.fp[crows[0]]:
            results.append((box, crows, False, 0.0))
        else:
            todo.append((box, crows, rrow))
    if not todo:
        return _result(comp, "cand", "fingerprint", results)
    method = "fingerprint"
    rids = np.concatenate([comp.ref.rid[[t[2] for t in todo]],
                           comp.cand.rid[[t[1][0] for t in todo]]])
    have = comp.catalog.payload_rids(rids)
    measured = []
    for box, crows, rrow in todo:
        rrid, crid = int(comp.ref.rid[rrow]), int(comp.cand.rid[crows[0]])
        if rrid in have and crid in have:
            try:
                rv = _piece_values(comp, comp.ref, rrow) * scale
                cv = _piece_values(comp, comp.cand, crows[0])
            except PayloadUnavailable:
                measured.append((box, crows, rrow))
                continue
            results.append((box, crows, *_measure(rv, cv, check)))
            method = "payload"
        else:
            measured.append((box, crows, rrow))
    if measured:
        got = _sketched(comp, measured, scale, check)
        if got is not None:
            results.extend(got)
            # without comparable fingerprints the sketches alone decided
            method = "moments" if method == "fingerprint" and not exact else method
        elif (got := per_sample.localize_boxes(comp, i, {box: crows for box, crows, _ in
                                                         measured}, scale,
                                               _policy_test(check))) is not None:
            results.extend(got)  # pieces placed by the auditor: their samples' digests
            method = "samples" if method == "fingerprint" else method
        else:
            results.extend((box, crows, True, math.nan) for box, crows, _ in measured)
    return _result(comp, "cand", method, results)


def _piece_values(comp, cols, row: int) -> np.ndarray:
    piece = comp.catalog.pieces[int(cols.layout[row])]
    got = comp.catalog.reader.payload(int(cols.rid[row]))
    if got is None:
        raise PayloadUnavailable("incomplete payload")
    header, data = got
    budget = comp.policy.payload_max_bytes
    bits = decode_payload(header, data, piece.dtype, piece.shape, max_bytes=budget)
    return bits_to_values(bits, piece.dtype).reshape(piece.shape)


def _sketched(comp, todo: list, scale: float, check) -> list | None:
    """Per-box differences from the pieces' moments and sketches (None: no usable sketch, as
    for pieces whose digests were made at another place: regrouped)."""
    placed = comp.catalog.placed
    if not all(placed[int(comp.ref.layout[t[2]])] and placed[int(comp.cand.layout[t[1][0]])]
               for t in todo):
        return None
    R = comp.catalog.fetch_digests(comp.ref.rid[[t[2] for t in todo]])
    C = comp.catalog.fetch_digests(comp.cand.rid[[t[1][0] for t in todo]])
    k = R["sketch"].shape[1]
    if k == 0 or C["sketch"].shape[1] != k or (R["sketch_k"] != k).any() \
            or (C["sketch_k"] != k).any():
        return None
    numel = np.array([math.prod(t[0][1]) for t in todo], np.float64)
    sm = sketch_metrics(R["sketch"] * scale, C["sketch"], R["sum_sq"] * scale * scale,
                        C["sum_sq"], numel)
    out = []
    for j, (box, crows, _) in enumerate(todo):
        rn = math.sqrt(max(float(R["sum_sq"][j]) * scale * scale, 0.0))
        ext = max(abs(float(C["max"][j] - R["max"][j] * scale)) if scale > 0 else 0.0,
                  abs(float(C["abs_max"][j] - R["abs_max"][j] * abs(scale))))
        dist = max(float(sm.dist[j]), ext if math.isfinite(ext) else 0.0)
        rel = dist / rn if rn > 0 else (math.inf if dist > 0 else 0.0)
        out.append((box, crows, _beyond(rel, dist, rn, int(numel[j]), check), rel))
    return out


def _result(comp, side: str, method: str, results: list) -> dict:
    cols = comp.cand if side == "cand" else comp.ref
    mesh = comp.mesh.get(side) if comp.mesh else None
    results.sort(key=lambda t: t[0])
    differ = []
    for box, rows, differs, rel in results:
        if not differs:
            continue
        ranks = [int(cols.rank[r]) for r in rows]
        differ.append({"ranks": ranks, "mesh": fixed_dims(mesh, ranks), "box": box_text(*box),
                       "rel_l2": None if rel is None or math.isnan(rel) else
                       (rel if math.isfinite(rel) else "inf")})
    return {"method": method, "side": side, "differ": differ[:MAX_DIFFER_LISTED],
            "differ_count": len(differ), "agree": len(results) - len(differ),
            "cannot_localize": None}
