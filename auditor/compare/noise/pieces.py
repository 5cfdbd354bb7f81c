"""Distances between a comparison's two runs on each piece of the reference (docs/noise.md).

A noise band is kept per key and per rank piece, never pooled: a band pooled over a key's pieces
lets one rank's noise excuse another rank's mismatch. This module measures, for chosen keys of
a `Comparison`, the distance between the runs on every box the reference's pieces occupy (the
box a rank, with its replicas, holds), in this order of cost:

- equal boxes in both runs: equal fingerprints are bitwise-equal pieces (distance 0); the others
  are measured from both pieces' payloads (exact: relative L2, max_abs, ULP, the share of
  elements failing the preset's elementwise test), else from their sketches and moments (relative
  L2 with its sigma; max_abs only bounded below by the extremes);
- other boxes in the candidate (another sharding): both logical tensors rebuilt from payloads
  and cut at the reference's boxes; without payloads a key cannot be measured per piece;
- Partial addends and reductions over the batch have no piece of their own: the key is one
  "piece" (box None), measured as the comparison measured the whole key.

- the candidate's pieces re-placed by the auditor (its microbatches regrouped into the
  reference's, uneven rows), whose digests describe other places: as other boxes, from payloads,
  else from both runs' per-sample digests restricted to each box's samples
  (`per_sample.localize_boxes`).

The reference's own pieces re-placed are not measured: they are not the pieces its bands were
measured on. A key that cannot be measured gets the reason instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.digests.metrics import (
    FLOAT_DTYPES,
    PayloadUnavailable,
    bits_to_values,
    decode_payload,
    payload_metrics,
    sketch_metrics,
)
from numaudit.auditor.compare.digests.ulp import ulp_distance
from numaudit.auditor.compare.measure import per_sample
from numaudit.auditor.compare.measure.payloads import logical_values
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.ranks import key_boxes
from numaudit.auditor.compare.read.align import phase_name, role_name
from numaudit.wire.vocabulary import Phase

NAN = math.nan


@dataclass
class PieceDistance:
    """The distance between the runs on one box of the reference's pieces."""

    box: tuple | None
    """(offsets, shape) of the reference's piece; None: the whole key (no piece of its own)."""
    ranks: list[int]
    """The reference's ranks holding the box (replicas included)."""
    bitwise: bool
    rel: float
    """||cand - ref|| / ||ref|| on the box (inf when ||ref|| = 0 and they differ; NaN unknown)."""
    sigma: float = 0.0
    """1-sigma of `rel` (0 when exact)."""
    max_abs: float = NAN
    """max |cand - ref| (NaN unknown: no payloads)."""
    max_abs_bound: float = 0.0
    """A lower bound of max_abs from the extremes (known without payloads)."""
    ulp: float = NAN
    share: float = NAN
    """Share of the box's elements failing the preset's elementwise test (NaN unknown)."""
    ref_abs_max: float = NAN
    """max |ref| on the box (the reference times the comparison's factor, for activation
    gradients)."""
    method: str = "fingerprint"
    """"fingerprint", "payload", "sketch" or "key" (the comparison's whole-key metrics)."""
    cand_ranks: list[int] | None = None
    """The candidate's ranks holding the same box (None: it holds other boxes)."""
    allclose: float = NAN
    """The preset's elementwise test at its worst element, max |c - r| / (atol + rtol |r|)
    (assert_close passes at <= 1; NaN unknown): element by element, relative to each element,
    where max_abs is dominated by the largest ones."""

    @classmethod
    def equal(cls, box, ranks, cand_ranks=None) -> PieceDistance:
        return cls(box, ranks, True, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, NAN,
                   cand_ranks=cand_ranks)


def measure_keys(comp, keys, policy=None) -> dict[int, list[PieceDistance] | str]:
    """Per key of ``keys`` (both runs hold it): its pieces' distances, or why they cannot be
    measured one by one. ``policy`` gives the elementwise test of the share of failing elements
    (default: the comparison's)."""
    policy = policy or comp.policy
    out: dict[int, list[PieceDistance] | str] = {}
    todo: list[tuple] = []
    for i in (int(k) for k in keys):
        got = _plan(comp, i, todo, policy)
        if got is not None:
            out[i] = got
    _measure_pairs(comp, todo, policy, out)
    return out


def _scale(comp, i: int) -> float:
    return comp.bwd_factor if (int(comp.when[i]) & 0xF) == Phase.BWD else 1.0


def _plan(comp, i: int, todo: list, policy):
    """Pieces of key i decided without reading digests (bitwise boxes, whole keys), or the
    reason it cannot be measured; pairs of rows left to measure are appended to ``todo``."""
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    rk, ck = comp.ref_keys, comp.cand_keys
    if ri < 0 or ci < 0 or rk.status[ri] != M.OK or ck.status[ci] != M.OK:
        return "a run's pieces do not make one logical tensor"
    if rk.partial[ri] or ck.partial[ci] or rk.reduced[ri] or ck.reduced[ci]:
        return [_whole(comp, i)]
    if (int(comp.when[i]), int(comp.where[i])) in comp.catalog.sample_orders:
        return "the samples lie in other orders in the two runs (regrouped by the auditor)"
    placed = comp.catalog.placed
    rb, cb = key_boxes(comp, "ref", ri), key_boxes(comp, "cand", ci)
    rows = [r for rs in rb.values() for r in rs]
    if not all(placed[int(comp.ref.layout[r])] for r in rows):
        return "the reference's pieces were re-placed by the auditor (regrouped or uneven " \
               "rows): they are not the pieces its bands were measured on"
    shapes = comp.catalog.shapes
    if shapes[rk.shape[ri]][2] != shapes[ck.shape[ci]][2]:
        return "flat pieces in one run, boxes of the tensor's shape in the other"
    ranks = {box: [int(comp.ref.rank[r]) for r in rs] for box, rs in rb.items()}
    if set(rb) != set(cb) or \
            not all(placed[int(comp.cand.layout[r])] for rs in cb.values() for r in rs):
        # other boxes, or the candidate's pieces moved (microbatches regrouped): its digests
        # describe no box of the reference; both runs' bytes, else their per-sample digests
        return _sliced(comp, i, rb, ranks, policy)
    scale = _scale(comp, i)
    exact = bool(rk.exact[ri] and ck.exact[ci]) and scale == 1.0
    pieces: list[PieceDistance] = []
    for box, rrows in rb.items():
        crow = cb[box][0]
        cranks = [int(comp.cand.rank[r]) for r in cb[box]]
        if exact and comp.ref.fp[rrows[0]] == comp.cand.fp[crow]:
            pieces.append(PieceDistance.equal(box, ranks[box], cranks))
        else:
            todo.append((i, box, ranks[box], rrows[0], crow, scale, cranks))
    return pieces


def _whole(comp, i: int) -> PieceDistance:
    """The whole key as one piece, from the comparison's own metrics."""
    pm = comp.payload.get(i)
    if pm is not None:
        numel = max(int(comp.cand_keys.numel[int(comp.cand_index[i])]), 1)
        return PieceDistance(None, [], bool(pm.get("_bitwise")), _num(pm["rel_l2"]), 0.0,
                             _num(pm["max_abs"]), _num(pm["max_abs"]), _num(pm.get("ulp")),
                             (pm.get("mismatched") or 0) / numel, NAN, "key",
                             allclose=_num(pm.get("allclose")))
    rel = float(comp.rel_l2[i])
    sigma = float(comp.rel_sigma[i])
    return PieceDistance(None, [], False, rel, 0.0 if math.isnan(sigma) else sigma,
                         max_abs_bound=NAN, method="key")


def _num(v) -> float:
    if v is None:
        return NAN
    if isinstance(v, str):
        return {"inf": math.inf, "-inf": -math.inf}.get(v, NAN)
    return float(v)


def _check(comp, i: int, policy):
    rk, ck = comp.ref_keys, comp.cand_keys
    dts = comp.catalog.dtypes
    site = comp.catalog.site_names.get(int(comp.where[i] >> 32), "")
    return policy.check(phase_name(int(comp.when[i]) & 0xF), site,
                        role_name((int(comp.where[i]) >> 28) & 0xF),
                        dts[rk.dtype[comp.ref_index[i]]], dts[ck.dtype[comp.cand_index[i]]])


def _sliced(comp, i: int, rb: dict, ranks: dict, policy):
    """Both logical tensors from payloads, cut at the reference's boxes."""
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    rids = np.concatenate([
        comp.ref.rid[comp.ref_keys.taken_row[comp.ref_keys.taken_start[ri]:
                                             comp.ref_keys.taken_start[ri + 1]]],
        comp.cand.rid[comp.cand_keys.taken_row[comp.cand_keys.taken_start[ci]:
                                               comp.cand_keys.taken_start[ci + 1]]]])
    if not len(rids) or len(comp.catalog.payload_rids(rids)) < len(set(rids.tolist())):
        return _sampled(comp, i, rb, ranks)
    try:
        r_vals, r_bits, dt_r = logical_values(comp, "ref", ri)
        c_vals, c_bits, dt_c = logical_values(comp, "cand", ci)
    except PayloadUnavailable as exc:
        return f"payloads could not be read ({exc})"
    scale = _scale(comp, i)
    check = _check(comp, i, policy)
    out = []
    for box, _ in rb.items():
        sl = tuple(slice(o, o + s) for o, s in zip(*box))
        bits = (r_bits[sl], c_bits[sl]) if r_bits is not None and c_bits is not None \
            and scale == 1.0 and dt_r == dt_c else None
        out.append(_exact(box, ranks[box], r_vals[sl] * scale, c_vals[sl], bits, dt_r, check))
    return out


def _sampled(comp, i: int, rb: dict, ranks: dict):
    """The reference's boxes (of whole samples) measured from both runs' per-sample digests
    restricted to each box's samples (`per_sample.localize_boxes`), or why not."""
    got = per_sample.localize_boxes(comp, i, rb, _scale(comp, i), lambda *_: False)
    if got is None or any(math.isnan(rel) for _, _, _, rel in got):
        return ("the runs' pieces occupy other boxes (or were re-placed by the auditor) and "
                "neither payloads nor per-sample digests measure each box of the reference")
    return [PieceDistance(box, ranks[box], False, float(rel), method="samples")
            for box, _, _, rel in got]


def _exact(box, ranks, r: np.ndarray, c: np.ndarray, bits, dtype: str, check) -> PieceDistance:
    """A box's distance from both runs' values (``bits``: both runs' raw bits, same dtype)."""
    ulp_ok = bits is not None and dtype in FLOAT_DTYPES
    pm = payload_metrics(r, c, rtol=check.rtol, atol=check.atol,
                         ref_bits=bits[0] if bits else None, cand_bits=bits[1] if bits else None,
                         ulp_ok=ulp_ok)
    ulp = NAN
    if ulp_ok and pm.ulp is not None:
        ulp = ulp_distance(bits[0], bits[1], r, c, dtype)
    bitwise = bool(bits is not None and np.array_equal(bits[0], bits[1]))
    rz = np.where(np.isfinite(r), r, 0.0)
    return PieceDistance(box, ranks, bitwise, float(pm.rel_l2), 0.0, float(pm.max_abs),
                         float(pm.max_abs), ulp, pm.mismatched / max(r.size, 1),
                         float(np.abs(rz).max(initial=0.0)), "payload",
                         allclose=float(pm.allclose))


def _piece(comp, cols, row: int):
    """(raw bits, float64 values, dtype) of one record's payload."""
    piece = comp.catalog.pieces[int(cols.layout[row])]
    got = comp.catalog.reader.payload(int(cols.rid[row]))
    if got is None:
        raise PayloadUnavailable("incomplete payload")
    header, data = got
    bits = decode_payload(header, data, piece.dtype, piece.shape,
                          max_bytes=comp.policy.payload_max_bytes)
    return bits, bits_to_values(bits, piece.dtype).reshape(piece.shape), piece.dtype


def _measure_pairs(comp, todo: list, policy, out: dict) -> None:
    """Boxes whose fingerprints could not decide: from payloads where both runs sent them, else
    from sketches and moments (in one read); a box neither measures makes its key unmeasured."""
    if not todo:
        return
    rids = np.array([int(comp.ref.rid[t[3]]) for t in todo] +
                    [int(comp.cand.rid[t[4]]) for t in todo], np.int64)
    have = comp.catalog.payload_rids(rids)
    sketched = []
    for t in todo:
        i, box, ranks, rrow, crow, scale, cranks = t
        if isinstance(out.get(i), str):
            continue
        if int(comp.ref.rid[rrow]) in have and int(comp.cand.rid[crow]) in have:
            try:
                rb, rv, dt_r = _piece(comp, comp.ref, rrow)
                cb, cv, dt_c = _piece(comp, comp.cand, crow)
            except PayloadUnavailable:
                sketched.append(t)
                continue
            bits = (rb, cb) if scale == 1.0 and dt_r == dt_c else None
            got = _exact(box, ranks, rv * scale, cv, bits, dt_r, _check(comp, i, policy))
            got.cand_ranks = cranks
            out[i].append(got)
        else:
            sketched.append(t)
    if sketched:
        _sketched(comp, sketched, out)


def _sketched(comp, todo: list, out: dict) -> None:
    R = comp.catalog.fetch_digests(comp.ref.rid[[t[3] for t in todo]])
    C = comp.catalog.fetch_digests(comp.cand.rid[[t[4] for t in todo]])
    k = R["sketch"].shape[1]
    usable = k > 0 and C["sketch"].shape[1] == k
    ok = (R["sketch_k"] == k) & (C["sketch_k"] == k) if usable else np.zeros(len(todo), bool)
    ok &= (R["sketch_seed"] == comp.catalog.sketch_seed) & \
        (C["sketch_seed"] == comp.catalog.sketch_seed)
    scale = np.array([t[5] for t in todo])
    numel = np.array([math.prod(t[1][1]) for t in todo], np.float64)
    if usable:
        sm = sketch_metrics(R["sketch"] * scale[:, None], C["sketch"],
                            R["sum_sq"] * scale * scale, C["sum_sq"], numel)
    for j, (i, box, ranks, _, _, s, cranks) in enumerate(todo):
        if isinstance(out.get(i), str):
            continue
        if not ok[j]:
            out[i] = ("a piece has no comparable sketch and no payload in both runs "
                      f"(ranks {', '.join(map(str, ranks))})")
            continue
        rn = math.sqrt(max(float(R["sum_sq"][j]) * s * s, 0.0))
        ext = max(abs(float(C["max"][j] - R["max"][j] * s)) if s > 0 else 0.0,
                  abs(float(C["min"][j] - R["min"][j] * s)) if s > 0 else 0.0,
                  abs(float(C["abs_max"][j] - R["abs_max"][j] * abs(s))))
        ext = ext if math.isfinite(ext) else 0.0
        dist = max(float(sm.dist[j]), ext)
        rel = dist / rn if rn > 0 else (math.inf if dist > 0 else 0.0)
        sigma = float(sm.dist_sigma[j]) / rn if rn > 0 else 0.0
        out[i].append(PieceDistance(box, ranks, False, rel, sigma, NAN, ext, NAN, NAN,
                                    float(R["abs_max"][j]) * abs(s), "sketch", cranks))
