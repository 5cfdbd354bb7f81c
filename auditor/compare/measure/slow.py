"""The slow path: metrics for keys whose fingerprints could not decide.

Reads the keys' moments and sketches in chunks, merges them per logical key, estimates the
distance between the runs (sketch estimate, with deterministic lower bounds from norms and
extremes), adds exact metrics where both runs sent payloads (`auditor.compare.measure.payloads`),
and judges each key's policy metric against its threshold.
"""

from __future__ import annotations

import math

import numpy as np

from numaudit.auditor.compare.digests.algebra import scaled_fingerprint
from numaudit.auditor.compare.digests.integer_ratio import snap
from numaudit.auditor.compare.digests.metrics import EPS64, MACHINE_EPS, ratio, sketch_metrics
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure import per_sample
from numaudit.auditor.compare.measure.comparison import M_L2, METRIC_CODES, Comparison
from numaudit.auditor.compare.measure.findings import format_float
from numaudit.auditor.compare.measure.payloads import payload_for, payload_keys
from numaudit.auditor.compare.policy.load import METRICS, PAYLOAD_METRICS
from numaudit.auditor.compare.read.columns import Catalog
from numaudit.auditor.compare.read.segments import ranges_index, segment_reduce, unique
from numaudit.auditor.store import Reader
from numaudit.wire.vocabulary import Phase

SLOW_CHUNK = 8192
"""Keys whose moments and sketches are read and compared per round (bounds memory: 2 x 8192 x k
float64 sketches, 32 MiB at k = 256)."""
LOWER_BOUND_SLACK = 16.0
"""Rounding slack of the norm-difference lower bound, in eps64 * sqrt(numel) * norm."""
METRIC_LIST = list(METRICS)
REL_L2, EXACT = METRIC_CODES["rel_l2"], METRIC_CODES["exact"]
PAYLOAD_CODES = tuple(METRIC_CODES[m] for m in PAYLOAD_METRICS)


def store_nonfinite(comp: Comparison, keys: np.ndarray, R: dict, C: dict) -> None:
    if comp.nonfinite_counts is None:
        comp.nonfinite_counts = np.full((len(comp), 6), -1, np.int64)
    comp.nonfinite_counts[keys] = np.stack(
        [R["nan"], R["posinf"], R["neginf"], C["nan"], C["posinf"], C["neginf"]], axis=1)


def record_ids(comp: Comparison, keys: np.ndarray) -> np.ndarray:
    """The record ids `merge_side` reads for these logical keys, both sides."""
    out = []
    for lk, cols, side in ((comp.ref_keys, comp.ref, comp.ref_index), (comp.cand_keys, comp.cand,
                                                                 comp.cand_index)):
        idx = side[keys]
        idx = idx[idx >= 0]
        rows_idx, _ = ranges_index(lk.taken_start[idx], lk.taken_start[idx + 1])
        out.append(cols.rid[lk.taken_row[rows_idx]])
    return np.concatenate(out)


def merge_side(comp: Comparison, keys_idx: np.ndarray, which: str, catalog: Catalog, *,
                sketches: bool = True):
    """Merged moments and sketches of one side for the given logical keys (all with rows)."""
    lk = comp.ref_keys if which == "ref" else comp.cand_keys
    cols = comp.ref if which == "ref" else comp.cand
    rows_idx, offsets = ranges_index(lk.taken_start[keys_idx], lk.taken_start[keys_idx + 1])
    rows = lk.taken_row[rows_idx]
    coef = lk.taken_coef[rows_idx]
    d = catalog.fetch_digests(cols.rid[rows])
    n = len(rows)
    d["sum"] = d["sum"] * coef  # a mean over dp ranks: weighted addends (1 elsewhere)
    out: dict[str, np.ndarray | int] = {}
    for c in ("nan", "posinf", "neginf", "zeros", "sum", "sum_sq"):
        out[c] = segment_reduce(np.add, d[c], offsets, n, 0.0)
    out["min"] = segment_reduce(np.minimum, d["min"], offsets, n, math.inf)
    out["max"] = segment_reduce(np.maximum, d["max"], offsets, n, -math.inf)
    out["abs_max"] = segment_reduce(np.maximum, d["abs_max"], offsets, n, 0.0)
    partial = lk.partial[keys_idx]
    for c in ("sum_sq", "min", "max", "abs_max"):
        out[c] = np.where(partial, np.nan, out[c])
    if not sketches:
        return out
    ks = d["sketch_k"]
    k = int(ks.max(initial=0))
    seg = np.repeat(np.arange(len(keys_idx)), np.diff(np.append(offsets, len(rows))))
    ok = np.ones(len(keys_idx), bool)
    ok[np.diff(np.append(offsets, len(rows))) == 0] = k > 0  # no elements: a zero sketch
    # sketches of another length or seed (another hash scheme) do not add or compare
    # and pieces whose digests describe another place (re-keyed by auditor.compare.merge.regroup)
    placed = np.asarray(catalog.placed, bool)[cols.layout[rows]]
    bad_rows = (ks != k) | (d["sketch_seed"] != catalog.sketch_seed) | ~placed
    if bad_rows.any():
        ok[unique(seg[bad_rows])] = False
    out["sketch"] = segment_reduce(np.add, d["sketch"] * coef[:, None], offsets, n, 0.0) if k \
        else np.zeros((len(keys_idx), 0))
    out["sketch_ok"] = ok & (k > 0)
    out["k"] = k
    out["rows"] = rows
    out["offsets"] = offsets
    return out


def scale_bwd(comp: Comparison, keys: np.ndarray, R: dict) -> np.ndarray:
    """Scale the reference's merged activation gradients (phase bwd) by the factor the runs' loss
    normalizations imply (`Comparison.bwd_factor`); returns each key's factor (1 elsewhere)."""
    f = comp.bwd_factor
    fs = np.ones(len(keys))
    if f == 1.0:
        return fs
    bwd = (comp.when[keys] & 0xF) == Phase.BWD
    if not bwd.any():
        return fs
    fs[bwd] = f
    R["sum"] = R["sum"] * fs
    R["sum_sq"] = R["sum_sq"] * fs * fs
    lo, hi = R["min"] * fs, R["max"] * fs
    R["min"], R["max"] = np.minimum(lo, hi), np.maximum(lo, hi)
    R["abs_max"] = R["abs_max"] * np.abs(fs)
    if "sketch" in R and R["sketch"].size:
        R["sketch"] = R["sketch"] * fs[:, None]
    text = (f"compared after the x{format_float(f)} inferred from the evidence "
            f"({comp.bwd_inferred})" if comp.bwd_inferred else
            f"compared after the x{format_float(f)} the runs' loss normalizations imply "
            f"(gradient scale of {comp.cand.name} over {comp.ref.name})")
    for j in np.flatnonzero(bwd):
        comp.notes.setdefault(int(keys[j]), []).append(text)
    return fs


def _scaled_exactly(comp: Comparison, keys: np.ndarray, ri: np.ndarray, ci: np.ndarray, R: dict,
                    ref_scale: np.ndarray) -> np.ndarray:
    """Keys whose candidate is bit for bit the reference times its factor when that factor is
    an exact power of two (a dp size's activation-gradient scale): float32/bfloat16/float16,
    both fingerprints exact (version 3), no zero or non-finite reference element, and the
    candidate's fingerprint the one the scaled reference has (`digests.scaled_fingerprint`).
    What a sketch or payload would have measured (0) is then known without either."""
    out = np.zeros(len(keys), bool)
    if not comp.catalog.fingerprints_v3:
        return out
    for j in np.flatnonzero(ref_scale != 1.0):
        mant, exp = math.frexp(float(ref_scale[j]))
        r, c = int(ri[j]), int(ci[j])
        rk, ck = comp.ref_keys, comp.cand_keys
        if mant != 0.5 or not (rk.exact[r] and ck.exact[c]) or rk.dtype[r] != ck.dtype[c] \
                or ck.dtype[c] < 0 \
                or R["zeros"][j] or R["nan"][j] or R["posinf"][j] or R["neginf"][j]:
            continue
        want = scaled_fingerprint(int(rk.fp[r]), int(ck.numel[c]),
                                  comp.catalog.dtypes[int(ck.dtype[c])], exp - 1)
        out[j] = want is not None and want == int(ck.fp[c])
    return out


def _digests_scaled(R: dict, C: dict, j: int | np.integer) -> bool:
    """Whether key j's candidate digests are exactly the reference's as scaled (`scale_bwd`):
    sketch and moments equal to the last bit, as a power-of-two factor makes them."""
    return all(np.array_equal(np.asarray(C[k][j]), np.asarray(R[k][j]), equal_nan=True)
               for k in ("sketch", "sum", "sum_sq", "min", "max", "abs_max"))


def _exact_after_factor(comp: Comparison, i: int, f: float, dt: str, bits: bool,
                        payload: dict | None, digests: bool) -> tuple[bool, bool]:
    """(breach, uncertain) of activation gradient i under the exact metric, against the
    reference times the factor f the runs' conventions imply, with a note saying how, and
    remembered for the run-level warning (`auditor.compare.conventions.activation_grads`).

    Bit for bit where the candidate's fingerprint is the scaled reference's (a power of two
    over elements that are all normal); else from both runs' bytes (every element the scaled
    reference's exactly, or within one rounding of the dtype for a factor that is no power of
    two); else, for a power of two, from digests that are exactly the scaled reference's
    (sketch and moments to the last bit): passing, but uncertain, since no bytes prove every
    element; anything else breaches."""
    power = math.frexp(f)[0] == 0.5
    if bits:
        ok, unc, how, proof = True, False, "", "bits"  # said with the fingerprint check
    elif payload is not None:
        ok, unc, proof = bool(payload.get("_factor_exact")), False, "bytes"
        how = ("every element from both runs' bytes" if power else
               f"every element within one rounding in {dt}, from both runs' bytes")
    else:
        ok, unc, proof = power and digests, power and digests, "digests"
        how = ("from sketch and moments equal to the last bit (no fingerprint or bytes prove "
               "every element: a fingerprint moves with a power of two over elements that are "
               "all normal, no zero)" if ok else
               "no fingerprint or bytes to prove it" + ("" if power else
                                                        f" (x{format_float(f)} is no power of "
                                                        "two: only bytes can)"))
    if how:
        verdict = "exactly" if ok else "not shown to be exactly"
        comp.notes.setdefault(i, []).append(
            f"the exact metric, after the x{format_float(f)}: {verdict} the scaled reference, "
            f"{how}")
    if ok:
        comp.memo.setdefault("exact_after_factor", {})[i] = proof
    return not ok, unc


def slow_chunk(comp: Comparison, keys: np.ndarray, metric_all, explicit_all, rtol_all, atol_all,
               reader: Reader, elementwise_all: np.ndarray | None = None) -> None:
    """Metrics and verdicts for keys whose fingerprints could not decide."""
    cat, pol = comp.catalog, comp.policy
    ri, ci = comp.ref_index[keys], comp.cand_index[keys]
    R = merge_side(comp, ri, "ref", cat)
    C = merge_side(comp, ci, "cand", cat)
    numel = comp.cand_keys.numel[ci].astype(np.float64)
    n = len(keys)
    store_nonfinite(comp, keys, R, C)
    ref_scale = scale_bwd(comp, keys, R)
    scaled_exact = _scaled_exactly(comp, keys, ri, ci, R, ref_scale)
    sketch_ok = R["sketch_ok"] & C["sketch_ok"] & (R["k"] == C["k"])
    if R["k"] == C["k"] and R["k"] > 0:
        sm = sketch_metrics(R["sketch"], C["sketch"], R["sum_sq"], C["sum_sq"], numel)
    else:
        sm = None
    rn = np.sqrt(np.maximum(R["sum_sq"], 0))
    cn = np.sqrt(np.maximum(C["sum_sq"], 0))
    if sm is not None:
        rn = np.where(np.isnan(rn), sm.ref_norm, rn)
        cn = np.where(np.isnan(cn), sm.cand_norm, cn)
    # deterministic lower bounds on ||cand - ref||: norms, extremes (Cauchy-Schwarz / max-norm)
    slack = LOWER_BOUND_SLACK * EPS64 * np.sqrt(numel + 1) * np.maximum(rn, cn)
    with np.errstate(invalid="ignore"):
        lb = np.nanmax(np.stack([
            np.where(np.isnan(R["sum_sq"]) | np.isnan(C["sum_sq"]), 0.0,
                     np.maximum(np.abs(cn - rn) - slack, 0.0)),
            np.nan_to_num(np.abs(C["max"] - R["max"]), nan=0.0, posinf=0.0),
            np.nan_to_num(np.abs(C["min"] - R["min"]), nan=0.0, posinf=0.0),
            np.nan_to_num(np.abs(C["abs_max"] - R["abs_max"]), nan=0.0, posinf=0.0),
        ]), axis=0)
    if sm is not None:
        dist = np.where(sketch_ok, np.maximum(sm.dist, lb), lb)
        dist_sigma = np.where(sketch_ok, sm.dist_sigma, np.nan)
        cos_d = np.where(sketch_ok, sm.cos_dist, np.nan)
        cos_s = np.where(sketch_ok, sm.cos_sigma, np.nan)
    else:
        dist, dist_sigma = lb, np.full(n, np.nan)
        cos_d, cos_s = np.full(n, np.nan), np.full(n, np.nan)
    # pieces the auditor placed (regrouped, uneven rows) left no sketch: per-sample digests
    sampled = per_sample.measure(comp, keys, ~sketch_ok & ~scaled_exact, rn, cn, numel,
                                 ref_scale)
    if sampled is not None:
        got = sampled.ok
        lb = np.where(got, np.maximum(lb, sampled.lower), lb)
        dist = np.where(got, np.maximum(sampled.dist, lb), dist)
        dist_sigma = np.where(got, sampled.dist_sigma, dist_sigma)
        cos_d = np.where(got, sampled.cos_dist, cos_d)
        cos_s = np.where(got, sampled.cos_sigma, cos_s)
        sketch_ok = sketch_ok | got
        for pos, note in sampled.notes.items():
            comp.notes.setdefault(int(keys[pos]), []).append(note)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(rn > 0, dist / rn, np.where(dist > 0, np.inf, 0.0))
        rel_sigma = np.where(rn > 0, dist_sigma / rn, np.nan)
        rel_lb = np.where(rn > 0, lb / rn, np.where(lb > 0, np.inf, 0.0))
    if sm is not None:
        rel_sigma = np.where(sm.norm_from_sketch, sm.rel_sigma, rel_sigma)
    comp.rel_l2[keys] = rel
    comp.rel_sigma[keys] = rel_sigma
    comp.cos_dist[keys] = cos_d
    comp.cos_sigma[keys] = cos_s
    comp.norm_ratio[keys] = ratio(cn, rn)
    comp.abs_max_ratio[keys] = ratio(C["abs_max"], R["abs_max"])
    comp.lower_bound[keys] = rel_lb
    # distance from a pure rescaling: ||cand - a ref|| / ||cand||, a = ||cand|| / ||ref||
    if comp.scaled_resid is None:
        comp.scaled_resid = np.full(len(comp), np.nan)
    if sm is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            alpha = np.where(rn > 0, cn / rn, np.nan)
            resid = C["sketch"] - alpha[:, None] * R["sketch"]
            comp.scaled_resid[keys] = np.where(
                sketch_ok & (cn > 0), np.sqrt(np.einsum("ij,ij->i", resid, resid)) / cn, np.nan)
    if sampled is not None:
        comp.scaled_resid[keys[sampled.ok]] = sampled.scaled_resid[sampled.ok]
    for j in np.flatnonzero(~sketch_ok & ~scaled_exact):
        comp.notes.setdefault(int(keys[j]), []).append(
            "sketches not comparable (different bucket counts or seeds, or pieces re-placed by the "
            "auditor): rel_l2 is only a lower bound from the moments")
    for j in np.flatnonzero(scaled_exact):
        comp.notes.setdefault(int(keys[j]), []).append(
            f"bit for bit the reference x{format_float(ref_scale[j])}: the candidate's "
            "fingerprint is the one the reference's scaled values have (every element normal, "
            "its exponent moved)")
        dist[j], lb[j], rel[j], rel_lb[j] = 0.0, 0.0, 0.0, 0.0
        comp.rel_l2[int(keys[j])], comp.rel_sigma[int(keys[j])] = 0.0, 0.0
        comp.lower_bound[int(keys[j])] = 0.0

    # payload metrics where both runs sent every piece's bytes
    rtol, atol = rtol_all[keys], atol_all[keys]
    has_payload = payload_keys(comp, R, C, n)
    for j in np.flatnonzero(has_payload):
        payload_for(comp, int(keys[j]), R, C, j, float(rtol[j]), float(atol[j]),
                    ref_scale=float(ref_scale[j]))
    pm_ok = np.array([int(i) in comp.payload for i in keys], bool) if comp.payload else \
        np.zeros(n, bool)
    for j in np.flatnonzero(pm_ok):
        comp.scaled_resid[int(keys[j])] = comp.payload[int(keys[j])].get("_scaled_resid", np.nan)

    requested = metric_all[keys]
    eff = requested.copy()
    explicit = explicit_all[keys].copy()
    elementwise = (elementwise_all[keys] if elementwise_all is not None
                   else np.zeros(n, bool)) & (requested == REL_L2)
    # the preset's elementwise test: assert_close's own where both runs' bytes are here
    eff[elementwise & pm_ok] = METRIC_CODES["allclose"]
    for code in PAYLOAD_CODES:
        fall = (eff == code) & ~pm_ok
        for j in np.flatnonzero(fall):
            comp.notes.setdefault(int(keys[j]), []).append(
                f"{METRIC_LIST[code]} needs payloads from both runs: compared by rel_l2 instead")
        eff[fall] = REL_L2
        explicit[fall] = np.nan
    exact_fallback = eff == EXACT
    for j in np.flatnonzero(exact_fallback):
        dt = cat.dtypes[comp.cand_keys.dtype[ci[j]]]
        eps = MACHINE_EPS.get(dt, EPS64)
        explicit[j] = eps
        if ref_scale[j] != 1.0:  # equal bits would be a difference: the factor is the test
            continue
        comp.notes.setdefault(int(keys[j]), []).append(
            "exact comparison unavailable (Partial placement or other seeds): compared by rel_l2 "
            f"against one rounding in {dt} ({eps:.3g})")
    eff[exact_fallback] = REL_L2

    value = np.full(n, np.nan)
    sig = np.zeros(n)
    thr = np.full(n, np.nan)
    certain = np.zeros(n, bool)
    code_out = eff.copy()
    sqrt_n = np.sqrt(numel)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_thr = np.where(rn > 0, rtol + atol * sqrt_n / rn, np.inf)
    has_explicit = ~np.isnan(explicit)

    # rel_l2, the common case, vectorized
    sel = eff == REL_L2
    if sel.any():
        abs_mode = sel & (rn == 0)
        rel_mode = sel & ~abs_mode
        thr[rel_mode] = np.where(has_explicit, explicit, rel_thr)[rel_mode]
        value[rel_mode] = rel[rel_mode]
        sig[rel_mode] = np.nan_to_num(rel_sigma[rel_mode], nan=0.0)
        certain[rel_mode] = rel_lb[rel_mode] > thr[rel_mode]
        thr[abs_mode] = np.where(has_explicit, explicit, atol * sqrt_n)[abs_mode]
        value[abs_mode] = dist[abs_mode]
        sig[abs_mode] = np.nan_to_num(dist_sigma[abs_mode], nan=0.0)
        certain[abs_mode] = lb[abs_mode] > thr[abs_mode]
        code_out[abs_mode] = M_L2
        for j in np.flatnonzero(sel & pm_ok):
            exact = comp.payload[int(keys[j])]
            value[j] = exact["_l2"] if abs_mode[j] else exact["rel_l2"]
            sig[j], certain[j] = 0.0, False
        value[sel & scaled_exact], sig[sel & scaled_exact] = 0.0, 0.0
        certain[sel & scaled_exact] = False
    for j in np.flatnonzero(~sel):
        i = int(keys[j])
        m = METRIC_LIST[eff[j]]
        e = explicit[j]
        pm = comp.payload.get(i)
        if m == "cosine":
            value[j], sig[j] = cos_d[j], np.nan_to_num(cos_s[j], nan=0.0)
            thr[j] = e if has_explicit[j] else 0.5 * rel_thr[j] ** 2
        elif m == "norm_ratio":
            value[j] = abs(comp.norm_ratio[i] - 1.0)
            thr[j] = e if has_explicit[j] else rel_thr[j]
        elif m == "abs_max_ratio":
            value[j] = abs(comp.abs_max_ratio[i] - 1.0)
            amax = R["abs_max"][j]
            thr[j] = e if has_explicit[j] else (rtol[j] + atol[j] / amax if amax > 0 else math.inf)
        elif m == "allclose":
            assert pm is not None  # a payload metric only where pm_ok (PAYLOAD_CODES above)
            value[j], thr[j] = pm["allclose"], 1.0
        elif m == "max_abs":
            assert pm is not None  # a payload metric only where pm_ok (PAYLOAD_CODES above)
            value[j] = pm["max_abs"]
            thr[j] = e if has_explicit[j] else atol[j] + rtol[j] * R["abs_max"][j]
        elif m == "max_rel":
            assert pm is not None  # a payload metric only where pm_ok (PAYLOAD_CODES above)
            value[j] = pm["max_rel"]
            thr[j] = e if has_explicit[j] else rtol[j]
        elif m == "ulp":
            assert pm is not None  # a payload metric only where pm_ok (PAYLOAD_CODES above)
            if pm.get("ulp") is None:
                comp.notes.setdefault(i, []).append("ulp needs the same float dtype in both runs: "
                                                    "compared by max_rel instead")
                value[j], thr[j] = pm["max_rel"], rtol[j]
                code_out[j] = METRIC_CODES["max_rel"]
            else:
                value[j] = pm["ulp"]
                thr[j] = e if has_explicit[j] else 0.0
    # without bytes, the extremes bound what assert_close allows any element:
    # |max|c| - max|r||, |max c - max r|, |min c - min r| <= max|c - r| <= atol + rtol max|r|
    ext_keys = elementwise & ~pm_ok & (eff == REL_L2)
    if ext_keys.any():
        with np.errstate(invalid="ignore"):
            ext = np.nanmax(np.stack([
                np.nan_to_num(np.abs(C["abs_max"] - R["abs_max"]), nan=0.0, posinf=0.0),
                np.nan_to_num(np.abs(C["max"] - R["max"]), nan=0.0, posinf=0.0),
                np.nan_to_num(np.abs(C["min"] - R["min"]), nan=0.0, posinf=0.0)]), axis=0)
            ext_thr = atol + rtol * R["abs_max"]
        over = ext_keys & (ext > ext_thr) & ~(value > thr) & np.isfinite(ext_thr)
        for j in np.flatnonzero(over):
            comp.notes.setdefault(int(keys[j]), []).append(
                f"rel_l2 {format_float(value[j])} is within {format_float(thr[j])}, but the "
                f"extremes differ by {format_float(ext[j])}, more than assert_close allows any "
                f"element (atol + rtol·max|ref| = {format_float(ext_thr[j])}): max_abs is at "
                "least that (no payloads to measure it)")
            value[j], thr[j], sig[j], certain[j] = ext[j], ext_thr[j], 0.0, True
            code_out[j] = METRIC_CODES["max_abs"]
    comp.metric[keys] = code_out
    breach, unc = F.judge(value, sig, thr, pol.sigmas, pol.on_uncertain, certain)
    for j in np.flatnonzero(exact_fallback & (ref_scale != 1.0)):
        dt = cat.dtypes[comp.cand_keys.dtype[ci[j]]]
        breach[j], unc[j] = _exact_after_factor(
            comp, int(keys[j]), float(ref_scale[j]), dt, bool(scaled_exact[j]),
            comp.payload.get(int(keys[j])) if pm_ok[j] else None,
            _digests_scaled(R, C, j) if sketch_ok[j] else False)
        breach[j] |= unc[j] and pol.on_uncertain == "breach"
    # Without comparable sketches or payloads, a sketch metric is only its lower bound: a value
    # under the threshold proves nothing, so it is uncertain and breaches unless the policy
    # says uncertain findings pass.
    blind = np.isin(code_out, (REL_L2, M_L2, METRIC_CODES["cosine"])) & ~sketch_ok & ~pm_ok \
        & ~breach & ~(scaled_exact & (code_out != METRIC_CODES["cosine"]))
    for j in np.flatnonzero(blind):
        comp.notes.setdefault(int(keys[j]), []).append(
            "no comparable sketch or payload: the distance cannot be shown within policy")
    unc |= blind
    breach |= blind & (pol.on_uncertain != "pass")
    # a pure rescaling (cosine ~ 1, norm ratio != 1) is said as such: "scaled by 4.00"; what
    # the factor is and means at the key's phase is said once every verdict is in
    # (`auditor.compare.explain.factors.annotate`)
    if comp.scaled_by is None:
        comp.scaled_by = np.full(len(comp), np.nan)
    tol = np.where(has_explicit & (eff == REL_L2), explicit, rel_thr)
    resid = comp.scaled_resid[keys]
    nr = comp.norm_ratio[keys]
    with np.errstate(invalid="ignore"):
        pure = breach & (resid <= tol) & (np.abs(nr - 1.0) > tol) & np.isfinite(nr) & (nr > 0)
    # one element is always "a rescaling": only a count (n or 1/n) says more than its value
    for j in np.flatnonzero(pure & (numel == 1)):
        pure[j] = snap(float(nr[j])) is not None
    comp.scaled_by[keys[pure]] = nr[pure]
    comp.value[keys] = value
    comp.sigma[keys] = np.where(sig > 0, sig, np.nan)
    comp.threshold[keys] = thr
    comp.uncertain[keys] = unc
    bitwise = np.array([comp.payload[int(i)].get("_bitwise", False) if ok else False
                        for i, ok in zip(keys, pm_ok)], bool)
    comp.verdict[keys] = np.where(breach, F.DIVERGED, np.where(bitwise, F.IDENTICAL, F.CLOSE))
