"""Exact metrics from payloads: rebuild both runs' logical tensors from the pieces' bytes.

Used by the slow path for keys where both runs sent every piece's bytes; bounded by the policy's
`payload_max_bytes`, and a payload that cannot be used leaves a note instead of a verdict.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.digests.metrics import (
    EPS64,
    FLOAT_DTYPES,
    ITEMSIZE,
    MACHINE_EPS,
    PayloadUnavailable,
    bits_to_values,
    decode_payload,
    payload_metrics,
)
from numaudit.auditor.compare.digests.ulp import ulp_distance
from numaudit.auditor.compare.read.segments import segment_reduce

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison


def payload_keys(comp: Comparison, R: dict, C: dict, n: int) -> np.ndarray:
    rid_r = comp.ref.rid[R["rows"]]
    rid_c = comp.cand.rid[C["rows"]]
    have = comp.catalog.payload_rids(np.concatenate([rid_r, rid_c]))
    if not have:
        return np.zeros(n, bool)
    hr = np.isin(rid_r, list(have))
    hc = np.isin(rid_c, list(have))
    ok_r = segment_reduce(np.logical_and, hr, R["offsets"], len(hr), True)
    ok_c = segment_reduce(np.logical_and, hc, C["offsets"], len(hc), True)
    return ok_r & ok_c


def payload_for(comp: Comparison, i: int, R: dict, C: dict, j: int | np.integer, rtol: float,
                atol: float, ref_scale: float = 1.0) -> None:
    """Exact metrics of key i from both runs' bytes (bounded by policy.payload_max_bytes);
    the reference's values are multiplied by ``ref_scale`` first (activation gradients)."""
    try:
        ref_vals, ref_bits, dt_r = _assemble(comp, "ref", int(comp.ref_index[i]), R, j)
        cand_vals, cand_bits, dt_c = _assemble(comp, "cand", int(comp.cand_index[i]), C, j)
    except PayloadUnavailable as exc:
        comp.notes.setdefault(i, []).append(f"payload not used: {exc}")
        return
    factor_exact = None
    if ref_scale != 1.0:
        ref_vals = ref_vals * ref_scale
        ref_bits = None
        factor_exact = _factor_exact(ref_vals, cand_vals, ref_scale, dt_c)
    pm = payload_metrics(ref_vals, cand_vals, rtol=rtol, atol=atol, ref_bits=ref_bits,
                         cand_bits=cand_bits,
                         ulp_ok=dt_r == dt_c and dt_r in FLOAT_DTYPES and ref_bits is not None
                         and cand_bits is not None)
    if pm.ulp is not None:  # across zero, in ULPs of the larger magnitude (digests/ulp.py)
        pm.ulp = ulp_distance(ref_bits, cand_bits, ref_vals, cand_vals, dt_r)
    d = pm.as_dict()
    rz = np.where(np.isfinite(ref_vals), ref_vals, 0.0).reshape(-1)
    cz = np.where(np.isfinite(cand_vals), cand_vals, 0.0).reshape(-1)
    d["_l2"] = float(np.linalg.norm(cz - rz))
    rn, cn = float(np.linalg.norm(rz)), float(np.linalg.norm(cz))
    d["cosine_distance"] = (1.0 - float(rz @ cz) / (rn * cn)) if rn > 0 and cn > 0 else None
    d["_scaled_resid"] = (float(np.linalg.norm(cz - (cn / rn) * rz)) / cn
                          if rn > 0 and cn > 0 else float("nan"))
    # equal bytes of the same dtype are bitwise-equal tensors, whatever the digests could say
    # (pieces re-placed by auditor.compare.merge.uneven or regroup have no usable fingerprint)
    # A reduction over ranks (a per-rank mean loss) has no bits of its own: its value rebuilt
    # from both runs' bytes is all there is, and equal values are as identical as it can be.
    if ref_bits is not None and cand_bits is not None:
        d["_bitwise"] = bool(dt_r == dt_c and np.array_equal(ref_bits, cand_bits))
    else:
        d["_bitwise"] = bool(dt_r == dt_c and ref_scale == 1.0 and ref_vals.shape ==
                             cand_vals.shape and np.array_equal(ref_vals, cand_vals,
                                                                equal_nan=True))
    if factor_exact is not None:
        d["_factor_exact"] = factor_exact
    comp.payload[i] = d
    comp.payload[i]["rel_l2"] = pm.rel_l2
    comp.payload[i]["allclose"] = pm.allclose
    comp.payload[i]["max_abs"] = pm.max_abs
    comp.payload[i]["max_rel"] = pm.max_rel
    comp.payload[i]["ulp"] = pm.ulp


def _factor_exact(scaled: np.ndarray, cand: np.ndarray, f: float, dtype: str) -> bool:
    """Whether every candidate element is the scaled reference's (`scaled` = reference x f, in
    float64): equal to the last bit for a power of two (the product is exact), else within one
    rounding of the dtype; non-finite elements must match too."""
    if scaled.shape != cand.shape:
        return False
    if math.frexp(f)[0] == 0.5:
        return bool(np.array_equal(scaled, cand, equal_nan=True))
    eps = MACHINE_EPS.get(dtype, EPS64)
    fin = np.isfinite(scaled)
    return bool(np.array_equal(scaled[~fin], cand[~fin], equal_nan=True)
                and np.all(np.abs(cand[fin] - scaled[fin]) <= eps * np.abs(scaled[fin])))


def logical_values(comp: Comparison, which: str, g: int):
    """(float64 values, raw bits or None, dtype) of logical key ``g`` of one side, rebuilt
    from its pieces' payloads (raises PayloadUnavailable)."""
    return _assemble(comp, which, g, {}, 0)


def _assemble(comp: Comparison, which: str, g: int, S: dict, j: int | np.integer):
    """(float64 values, raw bits or None, dtype) of one side's logical tensor from payloads."""
    lk = comp.ref_keys if which == "ref" else comp.cand_keys
    cols = comp.ref if which == "ref" else comp.cand
    cat = comp.catalog
    budget = comp.policy.payload_max_bytes
    start, end = int(lk.taken_start[g]), int(lk.taken_start[g + 1])
    rows = lk.taken_row[start:end]
    coefs = lk.taken_coef[start:end]
    dtype = cat.dtypes[lk.dtype[g]]
    shape = cat.shapes[lk.shape[g]][0]
    if math.prod(shape) * ITEMSIZE[dtype] > budget:
        raise PayloadUnavailable(f"logical tensor of {math.prod(shape)} elements exceeds "
                                 f"payload_max_bytes {budget}")
    partial = bool(lk.partial[g]) or bool(lk.reduced[g])
    values = np.zeros(shape, np.float64)
    bits = None if partial else np.zeros(shape, np.uint64)
    used = 0
    for r, coef in zip(rows, coefs):
        piece = cat.pieces[cols.layout[r]]
        got = cat.reader.payload(int(cols.rid[r]))
        if got is None:
            raise PayloadUnavailable(f"rank {int(cols.rank[r])}'s payload is incomplete")
        header, data = got
        used += int(header.get("raw_nbytes", 0))
        if used > budget:
            raise PayloadUnavailable(f"payloads exceed payload_max_bytes {budget}")
        b = decode_payload(header, data, dtype, piece.shape, max_bytes=budget)
        box = tuple(slice(o, o + s) for o, s in zip(piece.offsets, piece.shape))
        v = bits_to_values(b, dtype).reshape(piece.shape)
        if partial:
            values[box] += v * coef if coef != 1.0 else v
        else:
            values[box] = v
            assert bits is not None  # None only for a partial sum
            bits[box] = b
    if bits is not None:
        bits = bits.astype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[
            ITEMSIZE[dtype]])
    order = cat.sample_orders.get((int(lk.when[g]), int(lk.where[g]))) if which == "ref" else None
    if order is not None:  # the reference's rows in the candidate's sample order
        perm, d = order
        values = np.take(values, perm, axis=d)
        bits = None if bits is None else np.take(bits, perm, axis=d)
    return values, bits, dtype



MEASURED_EXACT = 50
"""Fingerprint breaches (the earliest) that `measure_exact_breaches` measures from payloads."""


def measure_exact_breaches(comp: Comparison, limit: int = MEASURED_EXACT) -> None:
    """A key decided by fingerprints alone (the bitwise preset) says only that they differ:
    where both runs sent its payloads, measure how much and where (max_abs, ulp, the largest
    difference's index) for the earliest `limit` such breaches. The verdict stands."""
    from numaudit.auditor.compare.measure import findings as F
    from numaudit.auditor.compare.policy.load import METRICS

    exact = list(METRICS).index("exact")  # its code in comp.metric (comparison.METRIC_CODES)
    todo = [int(i) for i in comp.indices(breaches_only=True)
            if int(comp.verdict[i]) == F.DIVERGED and int(comp.metric[i]) == exact
            and int(i) not in comp.payload and comp.ref_index[i] >= 0 and comp.cand_index[i] >= 0]
    for i in todo[:limit]:
        try:
            ref_vals, ref_bits, dt_r = logical_values(comp, "ref", int(comp.ref_index[i]))
            cand_vals, cand_bits, dt_c = logical_values(comp, "cand", int(comp.cand_index[i]))
        except PayloadUnavailable:
            continue
        if ref_vals.shape != cand_vals.shape:
            continue
        same = dt_r == dt_c and dt_r in FLOAT_DTYPES and ref_bits is not None and \
            cand_bits is not None
        pm = payload_metrics(ref_vals, cand_vals, rtol=0.0, atol=0.0, ref_bits=ref_bits,
                             cand_bits=cand_bits, ulp_ok=same)
        if same:
            pm.ulp = ulp_distance(ref_bits, cand_bits, ref_vals, cand_vals, dt_r)
            pm.mismatched = int(np.count_nonzero(ref_bits != cand_bits))
        d = pm.as_dict()
        d["allclose"] = None  # judged bit for bit: no tolerance to measure against
        comp.payload[i] = d
