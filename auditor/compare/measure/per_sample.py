"""Keys measured from per-sample digests, where pieces placed after the fact left no sketch.

Regrouped microbatches (`auditor.compare.merge.regroup`) and uneven dp shares
(`auditor.compare.merge.uneven`) move records to places their sketches were not made for, so the
slow path has no sketch to measure such a key by (docs/digests.md "Placing pieces after the fact").
Agents that sent per-sample digests (agents/digest/sample_digest.py) make up for it: each unit of
samples is keyed within the sample, so it means the same at any place, and the key's distance
is the sum of its blocks' (`auditor.compare.digests.sample_estimate`). Here the slow path's keys are
turned into units: each taken piece's units at the positions its (moved) layout gives along the
batch dim, the reference's in the candidate's sample order where the samples were dealt to dp
ranks in turn (`Catalog.sample_orders`). Keys whose pieces are not all so described (an agent
of an earlier build, a piece without samples, units that do not nest) are left as they were.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.digests.algebra import FINGERPRINT_SEED, fingerprint_to_int64
from numaudit.auditor.compare.digests.metrics import EPS64, ROUNDING_FLOOR, sketch_band
from numaudit.auditor.compare.digests.sample_estimate import N_MOMENTS, Units, estimate
from numaudit.auditor.compare.read.sample_digests import SampleRows, fetch
from numaudit.auditor.compare.read.segments import ranges_index


@dataclass
class Measured:
    """Per slow-path key (NaN / False where not measured)."""

    ok: np.ndarray
    dist: np.ndarray
    dist_sigma: np.ndarray
    lower: np.ndarray
    """Deterministic lower bound on ||cand - ref|| (norms and extremes of the blocks)."""
    cos_dist: np.ndarray
    cos_sigma: np.ndarray
    scaled_resid: np.ndarray
    notes: dict[int, str]


def _sides(comp, g_ref: np.ndarray, g_cand: np.ndarray):
    """Both runs' units of the logical keys ``g_ref`` / ``g_cand`` (one key per position), and
    per key whether it can be measured, its sample's elements and whether its unit
    fingerprints may decide; None when no record of either run has sample digests."""
    cat = comp.catalog
    sides = []
    for which, g in (("ref", g_ref), ("cand", g_cand)):
        lk = comp.ref_keys if which == "ref" else comp.cand_keys
        cols = comp.ref if which == "ref" else comp.cand
        rows_idx, offsets = ranges_index(lk.taken_start[g], lk.taken_start[g + 1])
        rows = lk.taken_row[rows_idx]
        coef = lk.taken_coef[rows_idx]
        fetched = fetch(cat, cols.rid[rows])
        if not fetched:
            return None
        seg = np.repeat(np.arange(len(g)), np.diff(np.append(offsets, len(rows))))
        orders = [cat.sample_orders.get((int(lk.when[x]), int(lk.where[x]))) if which == "ref"
                  else None for x in g]
        keyed = [(int(lk.when[x]), int(lk.where[x])) for x in g]
        sides.append(_units(cat, cols, rows, coef, seg, len(g), fetched, orders, keyed))
    (ref, ref_bad, ref_numel, ref_exact), (cand, cand_bad, cand_numel, cand_exact) = sides
    bad = ref_bad | cand_bad | (ref_numel != cand_numel)
    return (_drop(ref, bad), _drop(cand, bad), ~bad, np.maximum(ref_numel, 1),
            ref_exact & cand_exact & cat.fingerprints_v3)


def measure(comp, keys: np.ndarray, want: np.ndarray, rn: np.ndarray, cn: np.ndarray,
            numel: np.ndarray, ref_scale: np.ndarray) -> Measured | None:
    """Distances of the slow path's keys ``keys`` (positions ``want`` of them) from per-sample
    digests; None when none of them can be (no such digests in both runs)."""
    at = np.flatnonzero(want)
    if not len(at):
        return None
    got = _sides(comp, comp.ref_index[keys[at]], comp.cand_index[keys[at]])
    if got is None:
        return None
    ref, cand, _, numel_s, exact = got
    n = len(at)
    est = estimate(ref, cand, n, numel_s=numel_s, scale=ref_scale[at],
                   alpha=np.where(rn[at] > 0, cn[at] / np.where(rn[at] > 0, rn[at], 1), 1.0),
                   exact=exact)
    if not est.ok.any():
        return None
    K = len(keys)
    out = Measured(ok=np.zeros(K, bool), dist=np.full(K, np.nan), dist_sigma=np.full(K, np.nan),
                   lower=np.full(K, np.nan), cos_dist=np.full(K, np.nan),
                   cos_sigma=np.full(K, np.nan), scaled_resid=np.full(K, np.nan), notes={})
    ok = est.ok
    j = at[ok]
    r, c = rn[j], cn[j]
    dist = np.sqrt(np.maximum(est.d2[ok], 0.0))
    floor = ROUNDING_FLOOR * EPS64 * np.sqrt(numel[j] / est.k[ok] + 1.0) * np.maximum(r, c)
    sigma = dist * np.where(np.isfinite(est.k_eff[ok]), sketch_band(
        np.where(np.isfinite(est.k_eff[ok]), np.maximum(est.k_eff[ok], 1.0), 1.0)), 0.0) + floor
    out.ok[j] = True
    out.lower[j] = np.maximum(est.lower[ok], est.extremes[ok])
    out.dist[j] = np.maximum(dist, out.lower[j])
    out.dist_sigma[j] = sigma
    with np.errstate(divide="ignore", invalid="ignore"):
        denom = 2.0 * r * c
        out.cos_dist[j] = np.clip(np.where(denom > 0, (est.d2[ok] - (r - c) ** 2) / denom,
                                           np.where((r == 0) & (c == 0), 0.0, 1.0)), 0.0, 2.0)
        out.cos_sigma[j] = np.where(denom > 0, 2.0 * dist * sigma / denom, 0.0)
        out.scaled_resid[j] = np.where(c > 0, np.sqrt(np.maximum(est.resid2[ok], 0)) / c, np.nan)
    for x, blocks, same, k in zip(j.tolist(), est.blocks[ok].tolist(),
                                  est.identical[ok].tolist(), est.k[ok].tolist()):
        out.notes[x] = (f"measured from per-sample digests ({blocks} block"
                        f"{'s' if blocks != 1 else ''} of samples, {k} buckets each"
                        + (f"; {same} bitwise equal" if same else "")
                        + "): its pieces were placed by the auditor, where their sketches do "
                          "not describe them")
    return out


def _units(cat, cols, rows: np.ndarray, coef: np.ndarray, seg: np.ndarray, n: int,
           fetched: dict[int, SampleRows], orders: list, keyed: list[tuple[int, int]]
           ) -> tuple[Units, np.ndarray, np.ndarray, np.ndarray]:
    """One side's units of the keys (segments ``seg`` of its taken rows), and per key whether
    some piece cannot be described so, its sample's element count, and whether every unit's
    fingerprint was made with the comparison's seeds. ``keyed``: each key's (when, where), under
    which the stages that move pieces record the dim they moved them along (``sample_dims``)."""
    bad = np.zeros(n, bool)
    numel_s = np.full(n, -1, np.int64)
    exact = np.ones(n, bool)
    # version 3's seeds: unit fingerprints decide a block only with them (`fingerprints_v3`)
    fs, ss = fingerprint_to_int64(FINGERPRINT_SEED), cat.sketch_seed
    moved_along = cat.__dict__.get("sample_dims", {})
    key, pos, cnt, size, ks, mom, sk, fp = [], [], [], [], [], [], [], []
    for row, c, s in zip(rows.tolist(), coef.tolist(), seg.tolist()):
        if bad[s]:
            continue
        sd = fetched.get(int(cols.rid[row]))
        piece = cat.pieces[int(cols.layout[row])]
        if sd is None or c != 1.0 or piece.is_none or sd.seeds[1] != ss or \
                not 0 <= sd.dim < len(piece.shape) or piece.shape[sd.dim] != sd.count or \
                piece.partial or piece.flat or piece.reduce or sd.unit < 1:
            bad[s] = True
            continue
        d = sd.dim
        if moved_along.get(keyed[s], d) != d:  # moved along another dim: its samples' keys
            bad[s] = True                       # describe their old places
            continue
        ns = math.prod(piece.logical_shape[:d] + piece.logical_shape[d + 1:])
        if numel_s[s] not in (-1, ns):
            bad[s] = True
            continue
        numel_s[s] = ns
        exact[s] &= sd.seeds[0] == fs
        g = sd.f64.shape[0]
        starts = piece.offsets[d] + sd.unit * np.arange(g)
        counts = np.minimum(sd.unit, sd.count - sd.unit * np.arange(g))
        order = orders[s]
        if order is not None:  # the reference's samples in the candidate's order
            perm, od = order
            if od != d or sd.unit != 1:
                bad[s] = True
                continue
            inverse = np.empty_like(perm)
            inverse[perm] = np.arange(len(perm))
            starts = inverse[starts]
        key.append(np.full(g, s))
        pos.append(starts)
        cnt.append(counts)
        size.append(np.full(g, sd.unit))
        ks.append(np.full(g, sd.k))
        mom.append(sd.f64[:, :N_MOMENTS])
        sk.append(sd.f64[:, N_MOMENTS:].reshape(-1))
        fp.append(sd.fp)

    def cat_(parts, dt):
        return np.concatenate(parts).astype(dt) if parts else np.zeros(0, dt)

    units = Units(key=cat_(key, np.int64), pos=cat_(pos, np.int64), cnt=cat_(cnt, np.int64),
                  size=cat_(size, np.int64), k=cat_(ks, np.int64),
                  moments=np.concatenate(mom) if mom else np.zeros((0, N_MOMENTS)),
                  sketch=cat_(sk, np.float64), fp=cat_(fp, np.uint64))
    return units, bad, numel_s, exact


def _drop(units: Units, bad: np.ndarray) -> Units:
    keep = ~bad[units.key]
    if keep.all():
        return units
    starts = units.starts()
    idx = np.concatenate([np.arange(s, s + k) for s, k in zip(starts[keep], units.k[keep])]) \
        if keep.any() else np.zeros(0, np.int64)
    return Units(key=units.key[keep], pos=units.pos[keep], cnt=units.cnt[keep],
                 size=units.size[keep], k=units.k[keep], moments=units.moments[keep],
                 sketch=units.sketch[idx], fp=units.fp[keep])


def localize_boxes(comp, i: int, boxes: dict, scale: float, beyond) -> list | None:
    """Per box of key ``i`` (``{(offsets, shape): rows}``, boxes of whole samples: every dim
    but the batch dim whole), ``(box, rows, differs, rel_l2)`` from both runs' per-sample
    digests restricted to the box's samples; None when the key has none in both runs or a box
    is not such a box. ``beyond(rel, dist, ref_norm, numel)`` is the policy's test. A box whose
    samples cannot be measured apart (coarse units across its edge) differs, with no
    rel_l2."""
    got = _sides(comp, comp.ref_index[[i]], comp.cand_index[[i]])
    if got is None or not got[2][0]:
        return None
    ref, cand, _, numel_s, exact = got
    shape = comp.catalog.shapes[int(comp.cand_keys.shape[comp.cand_index[i]])][0]
    dims = {int(d) for d in _unit_dims(comp, i)}
    if len(dims) != 1:
        return None
    (d,) = dims
    spans = []
    for offsets, size in boxes:
        if any(o != 0 or s != n for e, (o, s, n) in enumerate(zip(offsets, size, shape))
               if e != d):
            return None
        spans.append((offsets[d], offsets[d] + size[d]))

    def select(units: Units) -> Units:
        key, keep = [], []
        for j, (lo, hi) in enumerate(spans):
            inside = np.flatnonzero((units.pos >= lo) & (units.pos < hi))
            keep.append(inside)
            key.append(np.full(len(inside), j))
        keep_all, key_all = np.concatenate(keep), np.concatenate(key)
        starts = units.starts()
        idx = (np.concatenate([np.arange(s, s + k) for s, k in
                               zip(starts[keep_all], units.k[keep_all])])
               if len(keep_all) else np.zeros(0, np.int64))
        return Units(key=key_all.astype(np.int64), pos=units.pos[keep_all],
                     cnt=units.cnt[keep_all], size=units.size[keep_all], k=units.k[keep_all],
                     moments=units.moments[keep_all], sketch=units.sketch[idx],
                     fp=units.fp[keep_all])

    n = len(spans)
    est = estimate(select(ref), select(cand), n, numel_s=np.full(n, int(numel_s[0])),
                   scale=np.full(n, scale), exact=np.full(n, bool(exact[0])))
    out = []
    for j, ((box, rows), (lo, hi)) in enumerate(zip(boxes.items(), spans)):
        if not est.ok[j]:
            out.append((box, rows, True, math.nan))
            continue
        rn = math.sqrt(max(float(est.ref_sq[j]), 0.0))
        dist = max(math.sqrt(max(float(est.d2[j]), 0.0)), float(est.lower[j]),
                   float(est.extremes[j]))
        rel = dist / rn if rn > 0 else (math.inf if dist > 0 else 0.0)
        out.append((box, rows, beyond(rel, dist, rn, (hi - lo) * int(numel_s[0])), rel))
    return out


def _unit_dims(comp, i: int) -> set[int]:
    """The batch dims the sample digests of key ``i``'s pieces were made along."""
    out = set()
    for which, g in (("ref", int(comp.ref_index[i])), ("cand", int(comp.cand_index[i]))):
        lk = comp.ref_keys if which == "ref" else comp.cand_keys
        cols = comp.ref if which == "ref" else comp.cand
        rows = lk.taken_row[lk.taken_start[g]:lk.taken_start[g + 1]]
        out |= {s.dim for s in fetch(comp.catalog, cols.rid[rows]).values()}
    return out
