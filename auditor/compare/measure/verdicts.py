"""Verdicts from the columns: align two runs' logical keys and decide what the digests can.

`evaluate` merges each run's pieces into logical keys (`auditor.compare.merge.tiling`), aligns them,
and decides the cheap verdicts vectorized over keys: ignored by policy, missing, None, incomplete,
replica divergence, shape, non-finite, and *identical* where fingerprints agree. What is left goes
to the slow path (`auditor.compare.measure.slow`), then everything is put in execution order.
"""

from __future__ import annotations

import time

import numpy as np

from numaudit.auditor.compare.digests.metrics import FLOAT_DTYPES
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import M_SHAPE, METRIC_CODES, Comparison
from numaudit.auditor.compare.measure.order import order_keys
from numaudit.auditor.compare.measure.parents import MEMO as PARENTS_MEMO
from numaudit.auditor.compare.measure.parents import unrun_parents
from numaudit.auditor.compare.measure.slow import (
    SLOW_CHUNK,
    merge_side,
    record_ids,
    slow_chunk,
    store_nonfinite,
)
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.keys import LogicalKeys, build_keys, merged_as_sum
from numaudit.auditor.compare.policy.load import Check, Policy
from numaudit.auditor.compare.read.columns import Catalog, RunColumns, shape_flags
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.auditor.store import Reader
from numaudit.wire.vocabulary import PHASE_NAMES, ROLE_NAMES, Phase

_ACTIONS = {"compare": 0, "ignore": 1, "expect_missing": 2}
_NONFINITE = {"match": 0, "forbid": 1, "allow": 2}


def align_keys(r: LogicalKeys, c: LogicalKeys):
    """(A, B, ref index, cand index) of the union of both runs' keys, in key order."""
    if len(r) == len(c) and np.array_equal(r.when, c.when) and np.array_equal(r.where, c.where):
        idx = np.arange(len(r))
        return r.when, r.where, idx, idx.copy()
    A = np.concatenate([r.when, c.when])
    B = np.concatenate([r.where, c.where])
    side = np.concatenate([np.zeros(len(r), np.int8), np.ones(len(c), np.int8)])
    src = np.concatenate([np.arange(len(r)), np.arange(len(c))])
    order = np.lexsort((side, B, A))
    A, B, side, src = A[order], B[order], side[order], src[order]
    new = np.ones(len(A), bool)
    if len(A):
        new[1:] = (A[1:] != A[:-1]) | (B[1:] != B[:-1])
    kid = np.cumsum(new) - 1
    K = int(kid[-1]) + 1 if len(A) else 0
    ri = np.full(K, -1, np.int64)
    ci = np.full(K, -1, np.int64)
    ri[kid[side == 0]] = src[side == 0]
    ci[kid[side == 1]] = src[side == 1]
    return A[new], B[new], ri, ci


def evaluate(ref: RunColumns, cand: RunColumns, catalog: Catalog, policy: Policy,
             reader: Reader, bwd_factor: float = 1.0, *, loss_sum: str | None = None,
             bwd_inferred: str = "") -> Comparison:
    """Verdicts and metrics for every key of two runs' columns.

    ``bwd_factor`` (cand grad_scale / ref grad_scale) is what the runs' loss normalizations make
    the candidate's activation gradients (phase bwd) relative to the reference's: those keys are
    compared against the reference scaled by it (``bwd_inferred``: why, when the evidence gave
    it rather than the runs' declarations). ``loss_sum`` ("ref" or "cand") merges that run's
    per-rank losses as sums over its dp ranks instead of means
    (`auditor.compare.conventions.activation_grads` decides when the evidence says so).
    """
    t0 = time.perf_counter()
    rk = build_keys(ref, catalog)
    ck = build_keys(cand, catalog)
    if loss_sum == "ref":
        rk = merged_as_sum(rk, Phase.LOSS)
    elif loss_sum == "cand":
        ck = merged_as_sum(ck, Phase.LOSS)
    t1 = time.perf_counter()
    A, B, ri, ci = align_keys(rk, ck)
    K = len(A)
    hr, hc = ri >= 0, ci >= 0
    rsafe, csafe = np.maximum(ri, 0), np.maximum(ci, 0)

    def side(arr_r, arr_c, fill):
        return (np.where(hr, arr_r[rsafe] if len(arr_r) else fill, fill),
                np.where(hc, arr_c[csafe] if len(arr_c) else fill, fill))

    st_r, st_c = side(rk.status, ck.status, -1)
    dt_r, dt_c = side(rk.dtype, ck.dtype, -1)

    # the policy, once per distinct (site, phase, role, dtype pair); without rules it depends
    # on the dtype pair alone
    combo = ((dt_r.astype(np.int64) + 1) << 8) | (dt_c.astype(np.int64) + 1)
    if policy.rules:
        combo |= ((B >> 32) << 24) | ((A & 0xF) << 20) | (((B >> 28) & 0xF) << 16)
    uniq, inv = np.unique(combo, return_inverse=True)
    checks = [_check_for(int(u), catalog, policy) for u in uniq]
    labels: dict[str, int] = {}
    rule_u = np.array([labels.setdefault(ch.rule, len(labels)) for ch in checks], np.int16)
    action = np.array([_ACTIONS[ch.action] for ch in checks], np.int8)[inv]
    metric = np.array([METRIC_CODES[ch.metric] for ch in checks], np.int16)[inv]
    explicit = np.array([np.nan if ch.threshold is None else ch.threshold for ch in checks])[inv]
    rtol = np.array([ch.rtol for ch in checks])[inv]
    atol = np.array([ch.atol for ch in checks])[inv]
    nfmode = np.array([_NONFINITE[ch.nonfinite] for ch in checks], np.int8)[inv]
    elementwise = np.array([ch.elementwise for ch in checks], bool)[inv]
    rule = rule_u[inv] if len(uniq) else np.zeros(0, np.int16)

    verdict = np.full(K, -1, np.int8)
    expected = np.zeros(K, bool)
    out_metric = np.full(K, -1, np.int16)
    nan = np.full(K, np.nan)
    value, sigma, threshold = nan.copy(), nan.copy(), nan.copy()
    uncertain = np.zeros(K, bool)
    notes: dict[int, list[str]] = {}

    def assign(mask, v):
        m = mask & (verdict < 0)
        verdict[m] = v
        return m

    assign(action == 1, F.IGNORED)
    cf_r, cf_c = side(rk.conflict, ck.conflict, 0)
    m = assign((cf_r > 0) | (cf_c > 0), F.CONFLICT)
    for i in np.flatnonzero(m):
        parts = []
        for name, cols, keys, idx, n in ((ref.name, ref, rk, ri[i], cf_r[i]),
                                         (cand.name, cand, ck, ci[i], cf_c[i])):
            if n > 0:
                s0, cnt = int(keys.first[idx]), int(keys.count[idx])
                bad = [int(r) for r, f in zip(cols.rank[s0:s0 + cnt], cols.flags[s0:s0 + cnt])
                       if f & 4]
                parts.append(f"{name}: rank{'s' if len(bad) > 1 else ''} {format_ranges(bad)} "
                             "sent this key again with other content (the first stored is kept; "
                             "two jobs under one run name, or a rank that reran a step)")
        notes.setdefault(int(i), []).append("; ".join(parts))
    assign((st_r == M.INCOMPLETE) | (st_c == M.INCOMPLETE), F.INCOMPLETE)
    assign((st_r == M.REPLICA_DIVERGENCE) | (st_c == M.REPLICA_DIVERGENCE), F.REPLICA_DIVERGENCE)
    expected |= assign(~hr, F.MISSING_IN_REF) & (action == 2)
    expected |= assign(~hc, F.MISSING_IN_CAND) & (action == 2)
    # a parent module a pipeline stage never runs, while its children run (`parents`)
    unrun = unrun_parents(A, B, ri, ci, rk, ck, catalog) if not (hr.all() and hc.all()) else {}
    unrun = {i: s for i, s in unrun.items() if verdict[i] in (F.MISSING_IN_REF, F.MISSING_IN_CAND)}
    if unrun:
        expected[list(unrun)] = True
    none_r, none_c = st_r == M.NONE, st_c == M.NONE
    assign(none_r & none_c, F.IDENTICAL)
    assign(none_r ^ none_c, F.GRAD_NONE)
    # from here on both sides hold an OK logical digest
    sh_r, sh_c = side(rk.shape, ck.shape, -1)
    n_r, n_c = side(rk.numel, ck.numel, -1)
    same_shape = same_shapes(catalog, sh_r, sh_c, n_r, n_c)
    # tensors without elements: equal when their logical shapes are (nothing else to compare)
    out_metric[assign((n_r == 0) & (n_c == 0) & same_shape, F.IDENTICAL)] = \
        METRIC_CODES["exact"]
    m = assign(~same_shape, F.DIVERGED)
    out_metric[m] = M_SHAPE
    for i in np.flatnonzero(m):
        a, b = _shape_text(catalog.shapes[sh_r[i]]), _shape_text(catalog.shapes[sh_c[i]])
        hint = _batch_dim_hint(catalog.shapes[sh_r[i]], catalog.shapes[sh_c[i]], ref.name,
                               cand.name)
        notes.setdefault(int(i), []).append(f"logical shape {a} in {ref.name}, {b} "
                                            f"in {cand.name}{hint}")
    nf_r, nf_c = side(rk.nonfinite, ck.nonfinite, 0)
    assign((nfmode == 1) & ((nf_r > 0) | (nf_c > 0)), F.NONFINITE)
    assign((nfmode == 0) & ((nf_r > 0) != (nf_c > 0)), F.NONFINITE)
    ex_r, ex_c = side(rk.exact, ck.exact, False)
    fp_r, fp_c = side(rk.fp, ck.fp, np.uint64(0))
    # equal fingerprints mean equal bits; equal bits mean equal values only within one float
    # dtype (fp16 and bf16 share bit patterns) — integers enter the fingerprint by value
    classes: dict[str, int] = {}
    klass = np.array([classes.setdefault(d if d in FLOAT_DTYPES else "integer", len(classes))
                      for d in catalog.dtypes] + [-1], np.int64)
    same = ex_r & ex_c & (fp_r == fp_c) & (klass[dt_r] == klass[dt_c])
    if bwd_factor != 1.0:
        # activation gradients must equal the reference's times the factor: equal bits are a
        # difference (unless both are all zero)
        z_r, z_c = side(rk.all_zero, ck.all_zero, 0)
        same &= (Phase.BWD != (A & 0xF)) | ((z_r == 1) & (z_c == 1))
    out_metric[assign(same, F.IDENTICAL)] = METRIC_CODES["exact"]
    hm_r, hm_c = side(rk.has_moments, ck.has_moments, False)
    exact_metric = metric == METRIC_CODES["exact"]
    # the same values in bfloat16 and float32: within any tolerance, a difference to bitwise
    upcast = ex_r & ex_c & (verdict < 0) & (
        upcast_equal(fp_r, fp_c, dt_r, dt_c, catalog.dtypes) if catalog.fingerprints_v3
        else False)
    if bwd_factor != 1.0:
        upcast &= Phase.BWD != (A & 0xF)
    same_values = assign(upcast & ~exact_metric, F.CLOSE)
    out_metric[same_values], value[same_values] = metric[same_values], 0.0
    for i in np.flatnonzero(upcast):
        notes.setdefault(int(i), []).append(
            f"the same values in another dtype ({catalog.dtypes[dt_r[i]]} in {ref.name}, "
            f"{catalog.dtypes[dt_c[i]]} in {cand.name}): the float32 fingerprint is the bfloat16 "
            "one's, each element's bits widened exactly" + (
                "; a dtype change is a difference under the exact metric" if exact_metric[i]
                else ""))
    if bwd_factor != 1.0:
        # activation gradients must be the reference's times the factor: unequal fingerprints
        # say nothing, the slow path judges them against the scaled reference
        exact_metric &= Phase.BWD != (A & 0xF)
    m = assign((exact_metric | ~hm_r | ~hm_c) & ex_r & ex_c, F.DIVERGED)
    out_metric[m] = METRIC_CODES["exact"]
    for i in np.flatnonzero(m & ~exact_metric):
        notes.setdefault(int(i), []).append("integer/bool tensor: compared exactly")
    # no fingerprint to compare and no sketch to estimate from: say so, never pass silently
    part_r, part_c = side(rk.partial, ck.partial, False)
    m = (verdict < 0) & (~hm_r | ~hm_c)
    for i in np.flatnonzero(m):
        why = ("an integer Partial sum has neither fingerprint nor sketch"
               if part_r[i] or part_c[i] else
               "the runs' fingerprints were made with different seeds and integer tensors "
               "have no sketch")
        notes.setdefault(int(i), []).append(f"not comparable: {why}")
    unverifiable = assign(m & (part_r | part_c),
                          F.DIVERGED if policy.on_uncertain == "breach" else F.CLOSE)
    uncertain[unverifiable] = True
    assign(m, F.DIVERGED)
    t2 = time.perf_counter()

    comp = Comparison(
        ref=ref, cand=cand, ref_keys=rk, cand_keys=ck, catalog=catalog, policy=policy,
        when=A, where=B,
        ref_index=ri, cand_index=ci, verdict=verdict, breach=np.zeros(K, bool), expected=expected,
        metric=out_metric, value=value, sigma=sigma, threshold=threshold, uncertain=uncertain,
        rule=rule, rule_labels=list(labels), rel_l2=nan.copy(), rel_sigma=nan.copy(),
        cos_dist=nan.copy(), cos_sigma=nan.copy(), norm_ratio=nan.copy(),
        abs_max_ratio=nan.copy(), lower_bound=nan.copy(), order=np.arange(K),
        rank_in_order=np.arange(K), pred=np.full(K, -1, np.int64),
        order_stage=np.zeros(K, np.int64), notes=notes, bwd_factor=bwd_factor,
        bwd_inferred=bwd_inferred,
    )
    if unrun:
        comp.memo[PARENTS_MEMO] = unrun
    comp.rel_l2[same_values] = comp.lower_bound[same_values] = 0.0
    nf_keys = np.flatnonzero(verdict == F.NONFINITE)
    slow = np.flatnonzero(verdict < 0)
    catalog.prefetch_digests(record_ids(comp, np.concatenate([nf_keys, slow])))
    for s0 in range(0, len(nf_keys), SLOW_CHUNK):
        chunk = nf_keys[s0:s0 + SLOW_CHUNK]
        R = merge_side(comp, comp.ref_index[chunk], "ref", catalog, sketches=False)
        C = merge_side(comp, comp.cand_index[chunk], "cand", catalog, sketches=False)
        store_nonfinite(comp, chunk, R, C)
    for s in range(0, len(slow), SLOW_CHUNK):
        slow_chunk(comp, slow[s:s + SLOW_CHUNK], metric, explicit, rtol, atol, reader,
                   elementwise)
    catalog.drop_prefetched()
    t3 = time.perf_counter()
    comp.breach = ~np.isin(comp.verdict, (F.IDENTICAL, F.CLOSE, F.IGNORED)) & ~expected
    order_keys(comp)
    t4 = time.perf_counter()
    comp.timings.update(merge=t1 - t0, verdicts=t2 - t1, metrics=t3 - t2, order=t4 - t3)
    return comp


def upcast_equal(fp_r: np.ndarray, fp_c: np.ndarray, dt_r: np.ndarray, dt_c: np.ndarray,
                 dtypes: list[str]) -> np.ndarray:
    """Per key, whether one run holds bfloat16 values and the other exactly those values in
    float32: a float32 element's bits are its bfloat16 bits shifted left by 16, and the
    fingerprint (version 3: the sum of index keys times each element's raw bits, mod 2**64)
    shifts with them, so the float32 fingerprint is the bfloat16 one times 2**16."""
    names = np.array(list(dtypes) + [""])
    bf_r = (names[dt_r] == "bfloat16") & (names[dt_c] == "float32")
    bf_c = (names[dt_c] == "bfloat16") & (names[dt_r] == "float32")
    if not (bf_r.any() or bf_c.any()):
        return np.zeros(len(fp_r), bool)
    w = np.uint64(16)
    with np.errstate(over="ignore"):
        return (bf_r & (fp_c == (fp_r << w))) | (bf_c & (fp_r == (fp_c << w)))


def same_shapes(catalog: Catalog, sh_r: np.ndarray, sh_c: np.ndarray, n_r: np.ndarray,
                n_c: np.ndarray) -> np.ndarray:
    """Per key, whether the runs' logical shapes (codes into `Catalog.shapes`, -1: none) agree:
    equal, or, where either run's pieces are flat (ranges of the tensor's flattening, as FSDP1
    holds a parameter), as many elements (`n_r`, `n_c`) and the same complex flag. Flat pieces'
    digests index elements by flat index as boxes' do, so such keys compare as they are."""
    same = sh_r == sh_c
    flat, car = shape_flags(catalog.shapes)
    if flat.any():
        same |= ((sh_r >= 0) & (sh_c >= 0) & (flat[sh_r] | flat[sh_c]) & (n_r == n_c)
                 & (car[sh_r] == car[sh_c]))
    return same


def _batch_dim_hint(ref_entry: tuple, cand_entry: tuple, ref: str, cand: str) -> str:
    """Where one run's shape is the other's with dim 0 k times larger and another dim d k times
    smaller, that run joined its data-parallel ranks' pieces on dim 0 while the tensor holds the
    batch on dim d (sequence-first code): say so, and what to declare."""
    (a, _, flat_a), (b, _, flat_b) = ref_entry, cand_entry
    if flat_a or flat_b or len(a) != len(b) or len(a) < 2 or a == b:
        return ""
    for joined, other, name in ((b, a, cand), (a, b, ref)):
        if other[0] == 0 or joined[0] % other[0]:
            continue
        k = joined[0] // other[0]
        dims = [d for d in range(1, len(a)) if joined[d] != other[d]]
        if k > 1 and len(dims) == 1 and joined[dims[0]] * k == other[dims[0]]:
            d = dims[0]
            return (f"; {name} joined its data-parallel ranks' pieces on dim 0, and the tensor "
                    f"looks to hold the batch on dim {d}: for sequence-first code, attach "
                    f"{name}'s agent with batch_dim={d} (NUMAUDIT_BATCH_DIM={d})")
    return ""


def _shape_text(entry: tuple) -> str:
    shape, _, flat = entry
    return f"{list(shape)} (flat pieces)" if flat else str(list(shape))


def _check_for(combo: int, catalog: Catalog, policy: Policy) -> Check:
    site = catalog.site_names.get(combo >> 24, "")
    phase = PHASE_NAMES.get((combo >> 20) & 0xF, "")
    role = ROLE_NAMES.get((combo >> 16) & 0xF, "")
    dr, dc = ((combo >> 8) & 0xFF) - 1, (combo & 0xFF) - 1
    return policy.check(phase, site, role, catalog.dtypes[dr] if dr >= 0 else None,
                        catalog.dtypes[dc] if dc >= 0 else None)
