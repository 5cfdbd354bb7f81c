"""The comparison engine: two stored runs in, a `Report` out (docs/comparison.md).

    report = compare_runs("audit.db", "ref", "pp8", load_policy("policy.toml"))

Pipeline, vectorized over keys (numpy columns, no Python object per record on the hot path):

1. read each run's records as columns (`auditor.columns`), sites normalized and renamed;
2. merge each key's pieces into a logical digest (`auditor.merge.build_keys`): tiling, replica
   and Partial checks, once per distinct layout signature;
3. align the two runs on the key;
4. decide the cheap verdicts from the columns: missing, None, incomplete, replica divergence,
   non-finite, and *identical* where the fingerprints agree — most keys of two runs that compute
   the same thing never get further;
5. for the rest, read moments and sketches (and payloads where both runs sent them) in chunks and
   compute the policy's metric against its threshold (`auditor.metrics`, `findings.judge`);
6. order everything by execution order, find the first divergence, group graph breaks.

`LiveComparison` runs the same pipeline incrementally for `watch`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from auditor import findings as F
from auditor import merge as M
from auditor.align import (PHASE_IDS, PHASE_NAMES, ROLE_NAMES, Key, exec_order, fill_positions,
                           phase_name, role_name)
from auditor.columns import Catalog, RunColumns, unpack_a
from auditor.metrics import (EPS64, FLOAT_DTYPES, MACHINE_EPS, PayloadUnavailable, bits_to_values,
                             decode_payload, payload_metrics, ratio, sketch_metrics)
from auditor.policy import METRICS, PAYLOAD_METRICS, Check, Policy
from auditor.store import Reader

SLOW_CHUNK = 8192
"""Keys whose moments and sketches are read and compared per round (bounds memory: 2 x 8192 x k
float64 sketches, 32 MiB at k = 256)."""
LOWER_BOUND_SLACK = 16.0
"""Rounding slack of the norm-difference lower bound, in eps64 * sqrt(numel) * norm."""

_METRIC_CODES = {m: i for i, m in enumerate(METRICS)}
_METRIC_NAMES = list(METRICS) + ["l2", "shape"]
_M_L2, _M_SHAPE = len(METRICS), len(METRICS) + 1
_ACTIONS = {"compare": 0, "ignore": 1, "expect_missing": 2}
_NONFINITE = {"match": 0, "forbid": 1, "allow": 2}


class CompareError(Exception):
    """A comparison that cannot be made (unknown run, unreadable store): usage/input error."""


# -- the columnar result -----------------------------------------------------------------------------

@dataclass
class Comparison:
    """Every aligned key's verdict and metrics, as arrays (one entry per key, (A, B) order)."""

    ref: RunColumns
    cand: RunColumns
    ref_keys: M.LogicalKeys
    cand_keys: M.LogicalKeys
    catalog: Catalog
    policy: Policy
    A: np.ndarray
    B: np.ndarray
    ri: np.ndarray
    ci: np.ndarray
    verdict: np.ndarray
    breach: np.ndarray
    expected: np.ndarray
    metric: np.ndarray
    value: np.ndarray
    sigma: np.ndarray
    threshold: np.ndarray
    uncertain: np.ndarray
    rule: np.ndarray
    rule_labels: list[str]
    rel_l2: np.ndarray
    rel_sigma: np.ndarray
    cos_dist: np.ndarray
    cos_sigma: np.ndarray
    norm_ratio: np.ndarray
    abs_max_ratio: np.ndarray
    lower_bound: np.ndarray
    order: np.ndarray
    """order[j] = index of the j-th key in execution order."""
    rank_in_order: np.ndarray
    """rank_in_order[i] = position of key i in execution order."""
    pred: np.ndarray
    """Previous compared key in execution order within the same step block (-1: none)."""
    order_stage: np.ndarray
    payload: dict[int, dict] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)
    nonfinite_counts: np.ndarray | None = None
    """[K, 6]: NaN, +Inf, -Inf of ref then cand, where read (-1 elsewhere)."""
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.A)

    # -- keys -----------------------------------------------------------------------------------

    def key(self, i: int) -> Key:
        a, b = int(self.A[i]), int(self.B[i])
        return Key(step=a >> 24, microbatch=((a >> 4) & 0xFFFFF) - 1, phase=phase_name(a & 0xF),
                   site=self.catalog.site_names.get(b >> 32, f"site#{b >> 32}"),
                   role=role_name((b >> 28) & 0xF), index=(b >> 14) & 0x3FFF, call=b & 0x3FFF)

    def find(self, step: int, microbatch: int, phase: int, site_id: int, role: int, index: int = 0,
             call: int = 0) -> int:
        """Index of a key, or -1."""
        a = (step << 24) | ((microbatch + 1) << 4) | phase
        b = (site_id << 32) | (role << 28) | (index << 14) | call
        lo = int(np.searchsorted(self.A, a, "left"))
        hi = int(np.searchsorted(self.A, a, "right"))
        j = lo + int(np.searchsorted(self.B[lo:hi], b))
        return j if j < hi and self.B[j] == b else -1

    def passes(self, i: int) -> bool:
        return not bool(self.breach[i])

    # -- findings -------------------------------------------------------------------------------

    def finding(self, i: int, *, with_cause: bool = True) -> F.Finding:
        i = int(i)
        v = int(self.verdict[i])
        ri, ci = int(self.ri[i]), int(self.ci[i])
        rk, ck = self.ref_keys, self.cand_keys
        cat = self.catalog
        ranks = {"ref": rk.ranks(self.ref, ri) if ri >= 0 else [],
                 "cand": ck.ranks(self.cand, ci) if ci >= 0 else []}
        dt_r = cat.dtypes[rk.dtype[ri]] if ri >= 0 and rk.dtype[ri] >= 0 else None
        dt_c = cat.dtypes[ck.dtype[ci]] if ci >= 0 and ck.dtype[ci] >= 0 else None
        shape_code = ck.shape[ci] if ci >= 0 and ck.shape[ci] >= 0 else (
            rk.shape[ri] if ri >= 0 else -1)
        shape = list(cat.shapes[shape_code][0]) if shape_code >= 0 else None
        numel = int(ck.numel[ci]) if ci >= 0 and ck.status[ci] != M.NONE else (
            int(rk.numel[ri]) if ri >= 0 and rk.status[ri] != M.NONE else None)
        m = int(self.metric[i])
        metric = _METRIC_NAMES[m] if m >= 0 else None
        f = F.Finding(
            key=self.key(i), verdict=F.VERDICT_NAMES[v], breach=bool(self.breach[i]),
            stage=int(ck.stage[ci]) if ci >= 0 else None,
            ref_stage=int(rk.stage[ri]) if ri >= 0 else None,
            ranks=ranks, dtype={"ref": dt_r, "cand": dt_c}, shape=shape, numel=numel,
            metric=metric, value=_f(self.value[i]), sigma=_f(self.sigma[i]),
            threshold=_f(self.threshold[i]), uncertain=bool(self.uncertain[i]),
            metrics=self._metrics(i, ri, ci), rule=self.rule_labels[int(self.rule[i])],
            expected=bool(self.expected[i]), detail=self._detail(i, v, ri, ci),
            notes=list(self.notes.get(i, ())), order=int(self.rank_in_order[i]),
        )
        if with_cause and f.breach and v in (F.DIVERGED, F.NONFINITE):
            f.cause = self.cause(i)
        return f

    def _metrics(self, i: int, ri: int, ci: int) -> dict:
        rk, ck = self.ref_keys, self.cand_keys
        out: dict = {}
        if ri >= 0 and ci >= 0 and rk.status[ri] == M.OK and ck.status[ci] == M.OK:
            if rk.exact[ri] and ck.exact[ci]:
                out["exact"] = bool(rk.fp[ri] == ck.fp[ci])
            else:
                out["exact"] = None
                out["exact_unavailable"] = ("Partial placement: the logical tensor's fingerprint "
                                            "cannot be rebuilt from addends"
                                            if rk.partial[ri] or ck.partial[ci]
                                            else "digests were made with other seeds")
            out["nonfinite_present"] = {"ref": bool(rk.nonfinite[ri]),
                                        "cand": bool(ck.nonfinite[ci])}
        if not math.isnan(self.rel_l2[i]):
            out["rel_l2"] = {"estimate": _jf(self.rel_l2[i]), "sigma": _jf(self.rel_sigma[i]),
                             "lower_bound": _jf(self.lower_bound[i])}
            out["cosine_distance"] = {"estimate": _jf(self.cos_dist[i]),
                                      "sigma": _jf(self.cos_sigma[i])}
            out["norm_ratio"] = _jf(self.norm_ratio[i])
            out["abs_max_ratio"] = _jf(self.abs_max_ratio[i])
        d = self.nonfinite_detail(i)
        if d is not None:
            out["nonfinite"] = d
        if i in self.payload:
            out["payload"] = self.payload[i]
        return out

    def _detail(self, i: int, v: int, ri: int, ci: int) -> str:
        rk, ck = self.ref_keys, self.cand_keys
        if v == F.INCOMPLETE or v == F.REPLICA_DIVERGENCE:
            parts = []
            if ri >= 0 and ri in rk.messages:
                parts.append(f"{self.ref.name}: {rk.messages[ri]}")
            if ci >= 0 and ci in ck.messages:
                parts.append(f"{self.cand.name}: {ck.messages[ci]}")
            return "; ".join(parts)
        if v == F.GRAD_NONE:
            side = self.cand.name if ck.status[ci] == M.NONE else self.ref.name
            return f"None in {side}"
        if v == F.IDENTICAL and ri >= 0 and rk.status[ri] == M.NONE:
            return "None in both runs"
        if v == F.MISSING_IN_REF:
            return f"not captured in {self.ref.name}" + (" (expected by policy)"
                                                        if self.expected[i] else "")
        if v == F.MISSING_IN_CAND:
            return f"not captured in {self.cand.name}" + (" (expected by policy)"
                                                         if self.expected[i] else "")
        if v == F.NONFINITE:
            d = self.nonfinite_detail(i)
            if d is None:
                return "NaN/Inf present in " + " and ".join(
                    n for n, x in ((self.ref.name, rk.nonfinite[ri]), (self.cand.name,
                                                                       ck.nonfinite[ci])) if x)
            parts = []
            for side, name in (("ref", self.ref.name), ("cand", self.cand.name)):
                c = d[side]
                parts.append(f"{name}: {c['nan']} NaN, {c['posinf']} +Inf, {c['neginf']} -Inf")
            return "non-finite elements — " + "; ".join(parts)
        return ""

    def nonfinite_detail(self, i: int) -> dict | None:
        nc = self.nonfinite_counts
        if nc is None or nc[i, 0] < 0:
            return None
        c = nc[i].tolist()
        return {"ref": {"nan": c[0], "posinf": c[1], "neginf": c[2]},
                "cand": {"nan": c[3], "posinf": c[4], "neginf": c[5]}}

    def indices(self, *, breaches_only: bool = False, include_identical: bool = True,
                in_order: bool = True) -> np.ndarray:
        """Keys with a finding (ignored keys have none), optionally only breaches."""
        idx = self.order if in_order else np.arange(len(self))
        keep = self.verdict[idx] != F.IGNORED
        if breaches_only:
            keep &= self.breach[idx]
        if not include_identical:
            keep &= self.verdict[idx] != F.IDENTICAL
        return idx[keep]

    def findings(self, **kw) -> Iterator[F.Finding]:
        for i in self.indices(**kw):
            yield self.finding(i)

    def counts(self) -> dict[str, int]:
        c = np.bincount(self.verdict.astype(np.int64), minlength=len(F.VERDICT_NAMES))
        return {name: int(c[k]) for k, name in enumerate(F.VERDICT_NAMES)}

    def first_divergence(self) -> int:
        """Index of the earliest breaching key in execution order, or -1."""
        br = np.flatnonzero(self.breach[self.order])
        return int(self.order[br[0]]) if len(br) else -1

    # -- introduced or inherited ----------------------------------------------------------------

    def cause(self, i: int) -> F.Cause:
        step = int(self.A[i] >> 24)
        phase = int(self.A[i] & 0xF)
        if phase == PHASE_IDS["input"]:
            return F.Cause("introduced", "the input batch itself differs (data loading, sampler "
                                         "or microbatch split)")
        if phase == PHASE_IDS["param"]:
            return self._param_cause(i, step)
        if phase == PHASE_IDS["grad"]:
            return self._grad_cause(i, step)
        key = self.key(i)
        if key.role == "output":
            site_id = int(self.B[i] >> 32)
            j = self.find(step, key.microbatch, phase, site_id, 2, key.index, key.call)
            if j < 0 and key.index:
                j = self.find(step, key.microbatch, phase, site_id, 2, 0, key.call)
            if j >= 0 and self.verdict[j] != F.IGNORED:
                return self._judged(j, "its input")
        p = int(self.pred[i])
        if p >= 0:
            return self._judged(p, "the previous capture in execution order")
        return self._block_start_cause(step)

    def _judged(self, j: int, what: str) -> F.Cause:
        prev = self.key(j)
        v = int(self.verdict[j])
        if v == F.IDENTICAL:
            return F.Cause("introduced", f"{what} ({prev}) is identical", prev)
        if v == F.CLOSE:
            return F.Cause("introduced", f"{what} ({prev}) is within tolerance but not identical: "
                                         "the module may amplify a rounding difference", prev)
        if v in (F.MISSING_IN_REF, F.MISSING_IN_CAND, F.INCOMPLETE):
            return F.Cause("unknown", f"{what} ({prev}) could not be compared "
                                      f"({F.VERDICT_NAMES[v]})", prev)
        return F.Cause("inherited", f"{what} ({prev}) already differs "
                                    f"({F.VERDICT_NAMES[v]})", prev)

    def _step_keys(self, step: int, phases: tuple[int, ...]) -> np.ndarray:
        lo = int(np.searchsorted(self.A, step << 24, "left"))
        hi = int(np.searchsorted(self.A, (step + 1) << 24, "left"))
        idx = np.arange(lo, hi)
        return idx[np.isin(self.A[lo:hi] & 0xF, phases) & (self.verdict[lo:hi] != F.IGNORED)]

    def _block_start_cause(self, step: int) -> F.Cause:
        params = self._step_keys(step, (PHASE_IDS["param"],))
        if len(params):
            bad = params[self.breach[params]]
            if len(bad):
                j = int(bad[np.argmin(self.rank_in_order[bad])])
                return F.Cause("inherited", f"the step's parameters differ (first: {self.key(j)})",
                               self.key(j))
            return F.Cause("introduced", "first capture of its microbatch, and every parameter "
                                         "value of the step matched")
        return F.Cause("unknown", "first capture of its microbatch; parameter values were not "
                                  "captured, so the weights cannot be ruled out")

    def _grad_cause(self, i: int, step: int) -> F.Cause:
        site = self.catalog.site_names.get(int(self.B[i] >> 32), "")
        module = site.rsplit(".", 1)[0] if "." in site else ""
        bwd = self._step_keys(step, (PHASE_IDS["bwd"],))
        mod_id = self.catalog.site_id(module) if module else None
        mine = bwd[(self.B[bwd] >> 32) == mod_id] if mod_id is not None else bwd[:0]
        if len(mine):
            bad = mine[self.breach[mine]]
            if len(bad):
                j = int(bad[np.argmin(self.rank_in_order[bad])])
                return F.Cause("inherited", f"its module's activation gradient differs "
                                            f"({self.key(j)})", self.key(j))
            return F.Cause("introduced", f"every activation gradient of {module} matched in this "
                                         "step: the difference arises in gradient accumulation, "
                                         "reduction or scaling", self.key(int(mine[0])))
        act = self._step_keys(step, (PHASE_IDS["fwd"], PHASE_IDS["bwd"], PHASE_IDS["loss"],
                                     PHASE_IDS["input"]))
        if len(act):
            bad = act[self.breach[act]]
            if len(bad):
                j = int(bad[np.argmin(self.rank_in_order[bad])])
                return F.Cause("inherited", f"activations of the step already differ (first: "
                                            f"{self.key(j)})", self.key(j))
            return F.Cause("introduced", "every captured activation and activation gradient of "
                                         "the step matched")
        return F.Cause("unknown", "no activation or activation gradient of the step was captured")

    def _param_cause(self, i: int, step: int) -> F.Cause:
        if step == 0:
            return F.Cause("introduced", "the initial weights differ (initialization, seed or "
                                         "checkpoint loading)")
        site_id = int(self.B[i] >> 32)
        role = int((self.B[i] >> 28) & 0xF)
        g = self.find(step - 1, -1, PHASE_IDS["grad"], site_id, role)
        p = self.find(step - 1, -1, PHASE_IDS["param"], site_id, role)
        if g >= 0 and self.breach[g]:
            return F.Cause("inherited", f"its gradient at step {step - 1} differs", self.key(g))
        if p >= 0 and self.breach[p]:
            return F.Cause("inherited", f"its value at step {step - 1} already differs", self.key(p))
        if g >= 0 and p >= 0:
            return F.Cause("introduced", f"its value and gradient matched at step {step - 1}: the "
                                         "optimizer update differs", self.key(g))
        return F.Cause("unknown", f"its gradient or value at step {step - 1} was not captured")


def _f(v: float) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def _jf(v: float):
    v = float(v)
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


# -- evaluation --------------------------------------------------------------------------------------

def align_keys(r: M.LogicalKeys, c: M.LogicalKeys):
    """(A, B, ref index, cand index) of the union of both runs' keys, in key order."""
    if len(r) == len(c) and np.array_equal(r.A, c.A) and np.array_equal(r.B, c.B):
        idx = np.arange(len(r))
        return r.A, r.B, idx, idx.copy()
    A = np.concatenate([r.A, c.A])
    B = np.concatenate([r.B, c.B])
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
             reader: Reader) -> Comparison:
    """Verdicts and metrics for every key of two runs' columns."""
    t0 = time.perf_counter()
    rk = M.build_keys(ref, catalog)
    ck = M.build_keys(cand, catalog)
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
    metric = np.array([_METRIC_CODES[ch.metric] for ch in checks], np.int16)[inv]
    explicit = np.array([np.nan if ch.threshold is None else ch.threshold for ch in checks])[inv]
    rtol = np.array([ch.rtol for ch in checks])[inv]
    atol = np.array([ch.atol for ch in checks])[inv]
    nfmode = np.array([_NONFINITE[ch.nonfinite] for ch in checks], np.int8)[inv]
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
    assign((st_r == M.INCOMPLETE) | (st_c == M.INCOMPLETE), F.INCOMPLETE)
    assign((st_r == M.REPLICA_DIVERGENCE) | (st_c == M.REPLICA_DIVERGENCE), F.REPLICA_DIVERGENCE)
    expected |= assign(~hr, F.MISSING_IN_REF) & (action == 2)
    expected |= assign(~hc, F.MISSING_IN_CAND) & (action == 2)
    none_r, none_c = st_r == M.NONE, st_c == M.NONE
    assign(none_r & none_c, F.IDENTICAL)
    assign(none_r ^ none_c, F.GRAD_NONE)
    # from here on both sides hold an OK logical digest
    sh_r, sh_c = side(rk.shape, ck.shape, -1)
    m = assign(sh_r != sh_c, F.DIVERGED)
    out_metric[m] = _M_SHAPE
    for i in np.flatnonzero(m):
        a, b = catalog.shapes[sh_r[i]][0], catalog.shapes[sh_c[i]][0]
        notes.setdefault(int(i), []).append(f"logical shape {list(a)} in {ref.name}, {list(b)} "
                                            f"in {cand.name}")
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
    out_metric[assign(same, F.IDENTICAL)] = _METRIC_CODES["exact"]
    hm_r, hm_c = side(rk.has_moments, ck.has_moments, False)
    exact_metric = metric == _METRIC_CODES["exact"]
    m = assign((exact_metric | ~hm_r | ~hm_c) & ex_r & ex_c, F.DIVERGED)
    out_metric[m] = _METRIC_CODES["exact"]
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
        ref=ref, cand=cand, ref_keys=rk, cand_keys=ck, catalog=catalog, policy=policy, A=A, B=B,
        ri=ri, ci=ci, verdict=verdict, breach=np.zeros(K, bool), expected=expected,
        metric=out_metric, value=value, sigma=sigma, threshold=threshold, uncertain=uncertain,
        rule=rule, rule_labels=list(labels), rel_l2=nan.copy(), rel_sigma=nan.copy(),
        cos_dist=nan.copy(), cos_sigma=nan.copy(), norm_ratio=nan.copy(),
        abs_max_ratio=nan.copy(), lower_bound=nan.copy(), order=np.arange(K),
        rank_in_order=np.arange(K), pred=np.full(K, -1, np.int64),
        order_stage=np.zeros(K, np.int64), notes=notes,
    )
    nf_keys = np.flatnonzero(verdict == F.NONFINITE)
    for s0 in range(0, len(nf_keys), SLOW_CHUNK):
        chunk = nf_keys[s0:s0 + SLOW_CHUNK]
        R = _merge_side(comp, comp.ri[chunk], "ref", catalog, sketches=False)
        C = _merge_side(comp, comp.ci[chunk], "cand", catalog, sketches=False)
        _store_nonfinite(comp, chunk, R, C)
    slow = np.flatnonzero(verdict < 0)
    for s in range(0, len(slow), SLOW_CHUNK):
        _slow_chunk(comp, slow[s:s + SLOW_CHUNK], metric, explicit, rtol, atol, reader)
    t3 = time.perf_counter()
    comp.breach = ~np.isin(comp.verdict, (F.IDENTICAL, F.CLOSE, F.IGNORED)) & ~expected
    _order(comp)
    t4 = time.perf_counter()
    comp.timings.update(merge=t1 - t0, verdicts=t2 - t1, metrics=t3 - t2, order=t4 - t3)
    return comp


def _check_for(combo: int, catalog: Catalog, policy: Policy) -> Check:
    site = catalog.site_names.get(combo >> 24, "")
    phase = PHASE_NAMES.get((combo >> 20) & 0xF, "")
    role = ROLE_NAMES.get((combo >> 16) & 0xF, "")
    dr, dc = ((combo >> 8) & 0xFF) - 1, (combo & 0xFF) - 1
    return policy.check(phase, site, role, catalog.dtypes[dr] if dr >= 0 else None,
                        catalog.dtypes[dc] if dc >= 0 else None)


def _ranges_index(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated aranges [starts[i], ends[i]) and the segment offsets."""
    lengths = ends - starts
    total = int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    idx = np.repeat(starts - offsets, lengths) + np.arange(total)
    return idx, offsets


def _store_nonfinite(comp: Comparison, keys: np.ndarray, R: dict, C: dict) -> None:
    if comp.nonfinite_counts is None:
        comp.nonfinite_counts = np.full((len(comp), 6), -1, np.int64)
    comp.nonfinite_counts[keys] = np.stack(
        [R["nan"], R["posinf"], R["neginf"], C["nan"], C["posinf"], C["neginf"]], axis=1)


def _merge_side(comp: Comparison, keys_idx: np.ndarray, which: str, catalog: Catalog, *,
                sketches: bool = True):
    """Merged moments and sketches of one side for the given logical keys (all with rows)."""
    lk = comp.ref_keys if which == "ref" else comp.cand_keys
    cols = comp.ref if which == "ref" else comp.cand
    rows_idx, offsets = _ranges_index(lk.taken_start[keys_idx], lk.taken_start[keys_idx + 1])
    rows = lk.taken_row[rows_idx]
    d = catalog.fetch_digests(cols.rid[rows])
    out = {}
    for c in ("nan", "posinf", "neginf", "sum", "sum_sq"):
        out[c] = np.add.reduceat(d[c], offsets)
    out["min"] = np.minimum.reduceat(d["min"], offsets)
    out["max"] = np.maximum.reduceat(d["max"], offsets)
    out["abs_max"] = np.maximum.reduceat(d["abs_max"], offsets)
    partial = lk.partial[keys_idx]
    for c in ("sum_sq", "min", "max", "abs_max"):
        out[c] = np.where(partial, np.nan, out[c])
    if not sketches:
        return out
    ks = d["sketch_k"]
    k = int(ks.max(initial=0))
    seg = np.repeat(np.arange(len(keys_idx)), np.diff(np.append(offsets, len(rows))))
    ok = np.ones(len(keys_idx), bool)
    bad_rows = ks != k
    if bad_rows.any():
        ok[np.unique(seg[bad_rows])] = False
    out["sketch"] = np.add.reduceat(d["sketch"], offsets, axis=0) if k else \
        np.zeros((len(keys_idx), 0))
    out["sketch_ok"] = ok & (k > 0)
    out["k"] = k
    out["rows"] = rows
    out["offsets"] = offsets
    return out


def _slow_chunk(comp: Comparison, keys: np.ndarray, metric_all, explicit_all, rtol_all, atol_all,
                reader: Reader) -> None:
    """Metrics and verdicts for keys whose fingerprints could not decide."""
    cat, pol = comp.catalog, comp.policy
    ri, ci = comp.ri[keys], comp.ci[keys]
    R = _merge_side(comp, ri, "ref", cat)
    C = _merge_side(comp, ci, "cand", cat)
    numel = comp.cand_keys.numel[ci].astype(np.float64)
    n = len(keys)
    _store_nonfinite(comp, keys, R, C)
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
        cos_d = cos_s = np.full(n, np.nan)
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
    for j in np.flatnonzero(~sketch_ok):
        comp.notes.setdefault(int(keys[j]), []).append(
            "sketches not comparable (different bucket counts or seeds): rel_l2 is only a lower "
            "bound from the moments")

    # payload metrics where both runs sent every piece's bytes
    rtol, atol = rtol_all[keys], atol_all[keys]
    has_payload = _payload_keys(comp, R, C, n)
    for j in np.flatnonzero(has_payload):
        _payload_for(comp, int(keys[j]), R, C, j, float(rtol[j]), float(atol[j]))
    pm_ok = np.array([int(i) in comp.payload for i in keys], bool) if comp.payload else \
        np.zeros(n, bool)

    requested = metric_all[keys]
    eff = requested.copy()
    explicit = explicit_all[keys].copy()
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
        comp.notes.setdefault(int(keys[j]), []).append(
            "exact comparison unavailable (Partial placement or other seeds): compared by rel_l2 "
            f"against one rounding in {dt} ({eps:.3g})")
        explicit[j] = eps
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
        code_out[abs_mode] = _M_L2
        for j in np.flatnonzero(sel & pm_ok):
            pm = comp.payload[int(keys[j])]
            value[j] = pm["_l2"] if abs_mode[j] else pm["rel_l2"]
            sig[j], certain[j] = 0.0, False
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
            value[j], thr[j] = pm["allclose"], 1.0
        elif m == "max_abs":
            value[j] = pm["max_abs"]
            thr[j] = e if has_explicit[j] else atol[j] + rtol[j] * R["abs_max"][j]
        elif m == "max_rel":
            value[j] = pm["max_rel"]
            thr[j] = e if has_explicit[j] else rtol[j]
        elif m == "ulp":
            if pm.get("ulp") is None:
                comp.notes.setdefault(i, []).append("ulp needs the same float dtype in both runs: "
                                                    "compared by max_rel instead")
                value[j], thr[j] = pm["max_rel"], rtol[j]
                code_out[j] = _METRIC_CODES["max_rel"]
            else:
                value[j] = pm["ulp"]
                thr[j] = e if has_explicit[j] else 0.0
    comp.metric[keys] = code_out
    breach, unc = F.judge(value, sig, thr, pol.sigmas, pol.on_uncertain, certain)
    comp.value[keys] = value
    comp.sigma[keys] = np.where(sig > 0, sig, np.nan)
    comp.threshold[keys] = thr
    comp.uncertain[keys] = unc
    comp.verdict[keys] = np.where(breach, F.DIVERGED, F.CLOSE)


METRIC_LIST = list(METRICS)
REL_L2, EXACT = _METRIC_CODES["rel_l2"], _METRIC_CODES["exact"]
PAYLOAD_CODES = tuple(_METRIC_CODES[m] for m in PAYLOAD_METRICS)


def _payload_keys(comp: Comparison, R: dict, C: dict, n: int) -> np.ndarray:
    rid_r = comp.ref.rid[R["rows"]]
    rid_c = comp.cand.rid[C["rows"]]
    have = comp.catalog.payload_rids(np.concatenate([rid_r, rid_c]))
    if not have:
        return np.zeros(n, bool)
    hr = np.isin(rid_r, list(have))
    hc = np.isin(rid_c, list(have))
    ok_r = np.logical_and.reduceat(hr, R["offsets"]) if len(hr) else np.zeros(n, bool)
    ok_c = np.logical_and.reduceat(hc, C["offsets"]) if len(hc) else np.zeros(n, bool)
    return ok_r & ok_c


def _payload_for(comp: Comparison, i: int, R: dict, C: dict, j: int, rtol: float,
                 atol: float) -> None:
    """Exact metrics of key i from both runs' bytes (bounded by policy.payload_max_bytes)."""
    try:
        ref_vals, ref_bits, dt_r = _assemble(comp, "ref", int(comp.ri[i]), R, j)
        cand_vals, cand_bits, dt_c = _assemble(comp, "cand", int(comp.ci[i]), C, j)
    except PayloadUnavailable as exc:
        comp.notes.setdefault(i, []).append(f"payload not used: {exc}")
        return
    pm = payload_metrics(ref_vals, cand_vals, rtol=rtol, atol=atol, ref_bits=ref_bits,
                         cand_bits=cand_bits,
                         ulp_ok=dt_r == dt_c and dt_r in FLOAT_DTYPES and ref_bits is not None
                         and cand_bits is not None)
    d = pm.as_dict()
    rz = np.where(np.isfinite(ref_vals), ref_vals, 0.0).reshape(-1)
    cz = np.where(np.isfinite(cand_vals), cand_vals, 0.0).reshape(-1)
    d["_l2"] = float(np.linalg.norm(cz - rz))
    comp.payload[i] = d
    comp.payload[i]["rel_l2"] = pm.rel_l2
    comp.payload[i]["allclose"] = pm.allclose
    comp.payload[i]["max_abs"] = pm.max_abs
    comp.payload[i]["max_rel"] = pm.max_rel
    comp.payload[i]["ulp"] = pm.ulp


def _assemble(comp: Comparison, which: str, g: int, S: dict, j: int):
    """(float64 values, raw bits or None, dtype) of one side's logical tensor from payloads."""
    lk = comp.ref_keys if which == "ref" else comp.cand_keys
    cols = comp.ref if which == "ref" else comp.cand
    cat = comp.catalog
    budget = comp.policy.payload_max_bytes
    start, end = int(lk.taken_start[g]), int(lk.taken_start[g + 1])
    rows = lk.taken_row[start:end]
    dtype = cat.dtypes[lk.dtype[g]]
    shape = cat.shapes[lk.shape[g]][0]
    if math.prod(shape) * _itemsize(dtype) > budget:
        raise PayloadUnavailable(f"logical tensor of {math.prod(shape)} elements exceeds "
                                 f"payload_max_bytes {budget}")
    partial = bool(lk.partial[g])
    values = np.zeros(shape, np.float64)
    bits = None if partial else np.zeros(shape, np.uint64)
    used = 0
    for r in rows:
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
            values[box] += v
        else:
            values[box] = v
            bits[box] = b
    if bits is not None:
        bits = bits.astype({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[
            _itemsize(dtype)])
    return values, bits, dtype


def _itemsize(dtype: str) -> int:
    from auditor.metrics import ITEMSIZE
    return ITEMSIZE[dtype]


def _order(comp: Comparison) -> None:
    """Execution order, predecessors (see auditor.align)."""
    K = len(comp)
    if K == 0:
        return
    rk, ck = comp.ref_keys, comp.cand_keys
    hr, hc = comp.ri >= 0, comp.ci >= 0
    step, mb, phase = unpack_a(comp.A)
    site = comp.B >> 32
    # stage the key ran in: the candidate's; for keys it lacks, the candidate's stage of the site
    cand_stage = np.where(hc, ck.stage[np.maximum(comp.ci, 0)] if len(ck) else -1, -1)
    site_stage = np.full(int(site.max()) + 1, -1, np.int64)
    if hc.any():
        site_stage[site[hc]] = cand_stage[hc]
    ref_stage = np.where(hr, rk.stage[np.maximum(comp.ri, 0)] if len(rk) else -1, -1)
    stage = np.where(hc, cand_stage, np.where(site_stage[site] >= 0, site_stage[site], ref_stage))
    ref_pos = np.where(hr, rk.pos[np.maximum(comp.ri, 0)] if len(rk) else 0, 0).astype(np.float64)
    ref_pos[~hr] = np.nan
    cand_pos = np.where(hc, ck.pos[np.maximum(comp.ci, 0)] if len(ck) else 0, 0).astype(np.float64)
    cand_pos[~hc] = np.nan
    if hr.all():
        pos = ref_pos
    else:  # place candidate-only keys within their (step, microbatch, phase, stage) group
        g_order = np.lexsort((stage, comp.A))
        ga, gs = comp.A[g_order], stage[g_order]
        gnew = np.ones(K, bool)
        gnew[1:] = (ga[1:] != ga[:-1]) | (gs[1:] != gs[:-1])
        group = np.empty(K, np.int64)
        group[g_order] = np.cumsum(gnew) - 1
        pos = fill_positions(group, cand_pos, ref_pos)
    order = exec_order(step, mb, phase, stage, pos)
    comp.order = order
    comp.rank_in_order = np.empty(K, np.int64)
    comp.rank_in_order[order] = np.arange(K)
    comp.order_stage = stage
    # predecessor: previous non-ignored key in order within the same step block
    seq = order[comp.verdict[order] != F.IGNORED]
    blk_mb = mb[seq].copy()
    blk_mb[phase[seq] == PHASE_IDS["param"]] = -(1 << 40)
    blk_mb[phase[seq] == PHASE_IDS["grad"]] = 1 << 40
    same = np.zeros(len(seq), bool)
    if len(seq) > 1:
        same[1:] = (step[seq][1:] == step[seq][:-1]) & (blk_mb[1:] == blk_mb[:-1])
    pred = np.full(K, -1, np.int64)
    pred[seq[1:][same[1:]]] = seq[:-1][same[1:]]
    comp.pred = pred


# -- entry points ------------------------------------------------------------------------------------

def _open(reader_or_path: Reader | str | Path) -> tuple[Reader, bool]:
    if isinstance(reader_or_path, Reader):
        return reader_or_path, False
    try:
        return Reader(reader_or_path), True
    except FileNotFoundError as exc:
        raise CompareError(f"db: {exc}") from None


def compare_runs(reader_or_path: Reader | str | Path, ref: str, cand: str,
                 policy: Policy | None = None):
    """Compare two stored runs; returns an `auditor.report.Report`."""
    from auditor.report import Report

    policy = policy or Policy()
    reader, owned = _open(reader_or_path)
    try:
        t0 = time.perf_counter()
        ref_info, cand_info = _run_info(reader, ref), _run_info(reader, cand)
        catalog = Catalog(reader, policy.renames)
        rc = catalog.load(ref, "ref")
        cc = catalog.load(cand, "cand")
        ref_info["records"], cand_info["records"] = len(rc), len(cc)
        t1 = time.perf_counter()
        comp = evaluate(rc, cc, catalog, policy, reader)
        comp.timings["load"] = t1 - t0
        report = Report.build(comp, ref_info, cand_info, policy)
        comp.timings["total"] = time.perf_counter() - t0
        return report
    finally:
        if owned:
            # Findings read payloads and sites lazily only through the comparison's arrays, so the
            # reader may close; the report keeps no cursor.
            reader.close()


def _run_info(reader: Reader, name: str) -> dict:
    """What the report says about a run (records: filled in from the columns read)."""
    info = reader.run_info(name)
    sessions = reader.conn.execute(
        "SELECT rank, closed IS NOT NULL, stages, records_dropped FROM sessions WHERE run_id = ?",
        (info["run_id"],)).fetchall()
    return {
        "name": name, "world_size": info["world_size"], "dtype": info["dtype"],
        "torch_version": info["torch_version"], "mesh_shape": info["mesh_shape"],
        "mesh_dim_names": info["mesh_dim_names"], "labels": info["labels"],
        "ranks_registered": len({r for r, _, _, _ in sessions}),
        "ranks_closed": len({r for r, closed, _, _ in sessions if closed}),
        "stages": sorted({st for _, _, stages, _ in sessions for st in json.loads(stages)}),
        "records": 0,
        "dropped": sum(d or 0 for _, _, _, d in sessions),
        "conflicts": reader.conflicts(name),
    }


# -- live comparison (watch) ------------------------------------------------------------------------

@dataclass
class LiveEvent:
    """What `LiveComparison.poll` reports: a finding (maybe the first divergence) or a status."""

    finding: F.Finding | None = None
    first_divergence: bool = False
    status: str = ""


class LiveComparison:
    """Compare two runs while they are still being written (``auditor watch``).

    Each `poll` reads the records stored since the last one and reports every key that became
    *final*: its pieces tile the logical tensor in both runs and no further piece can change
    it. A key whose pieces are all disjoint shards is final as soon as they tile it; a key with
    replicas or Partial addends (more copies may still arrive) once every rank of both runs has
    moved past its step (sent a record of a later step, or closed its session). When both runs
    have finished (every rank registered and closed) everything left is reported, missing keys
    included. The first divergence is announced once: when every key up to its step has been
    reported in both runs, so that no earlier divergence can still appear.
    """

    def __init__(self, reader: Reader, ref: str, cand: str, policy: Policy | None = None) -> None:
        self.reader = reader
        self.names = {"ref": ref, "cand": cand}
        self.policy = policy or Policy()
        reader.run_id(ref)
        reader.run_id(cand)
        self.catalog = Catalog(reader, self.policy.renames)
        self.cols = {side: RunColumns.empty(name, side) for side, name in self.names.items()}
        self.done = {side: np.zeros(0, bool) for side in self.names}
        self.reported: set[tuple[int, int]] = set()
        self.breach_steps: set[int] = set()
        self.announced = False
        self.finished = False
        self.emitted = 0
        self._late_warned = False
        self._last_past = -math.inf

    def _progress(self, side: str) -> tuple[float, bool]:
        """(the step every rank of the run is past, whether the run is finished)."""
        run_id = self.reader.run_id(self.names[side])
        world = self.reader.conn.execute("SELECT world_size FROM runs WHERE run_id = ?",
                                         (run_id,)).fetchone()[0]
        sessions = self.reader.conn.execute(
            "SELECT rank, closed IS NOT NULL FROM sessions WHERE run_id = ?", (run_id,)).fetchall()
        closed = {r for r, c in sessions if c}
        ranks = {r for r, _ in sessions}
        finished = len(ranks) >= world and closed >= ranks
        if len(ranks) < world:
            return -1.0, False
        cols = self.cols[side]
        latest = np.full(max(ranks, default=0) + 1, -1, np.int64)
        if len(cols):
            np.maximum.at(latest, cols.rank, cols.A >> 24)
        past = min((float(latest[r]) for r in ranks - closed), default=math.inf)
        return past, finished

    def poll(self) -> list[LiveEvent]:
        """Read what arrived and report the keys that became final."""
        events: list[LiveEvent] = []
        new_rows = 0
        for side in ("ref", "cand"):
            old = self.cols[side]
            fresh = self.catalog.load(self.names[side], side, after_rid=old.max_rid)
            if not len(fresh):
                continue
            new_rows += len(fresh)
            late = np.array([(int(a), int(b)) in self.reported for a, b in zip(fresh.A, fresh.B)],
                            bool) if self.reported else np.zeros(len(fresh), bool)
            if late.any() and not self._late_warned:
                self._late_warned = True
                events.append(LiveEvent(status=f"{self.names[side]}: {int(late.sum())} pieces "
                                               "arrived for keys already reported; ignored"))
            fresh.max_rid = max(fresh.max_rid, old.max_rid)
            merged = old.concat(fresh)
            done = np.concatenate([self.done[side], late])
            # keep `done` aligned with the re-sorted rows
            order = np.lexsort((np.concatenate([old.rank, fresh.rank]),
                                np.concatenate([old.B, fresh.B]),
                                np.concatenate([old.A, fresh.A])))
            self.done[side] = done[order]
            self.cols[side] = merged
        (past_r, fin_r), (past_c, fin_c) = self._progress("ref"), self._progress("cand")
        self.finished = fin_r and fin_c
        past = min(past_r if not fin_r else math.inf, past_c if not fin_c else math.inf)
        if new_rows or self.finished or past != self._last_past:
            events.extend(self._emit(past, everything=self.finished))
        self._last_past = past
        if not self.announced and self.breach_steps:
            s = min(self.breach_steps)
            if s < past or self.finished:
                events.extend(self._announce(s))
        return events

    def flush(self) -> list[LiveEvent]:
        """Report everything left (the runs ended or the watch timed out)."""
        events = self._emit(math.inf, everything=True)
        if not self.announced and self.breach_steps:
            events.extend(self._announce(min(self.breach_steps)))
        return events

    def _pending(self, side: str) -> tuple[RunColumns, np.ndarray]:
        idx = np.flatnonzero(~self.done[side])
        return self.cols[side].take(idx), idx

    def _emit(self, past: float, *, everything: bool) -> list[LiveEvent]:
        rc, ridx = self._pending("ref")
        cc, cidx = self._pending("cand")
        if not len(rc) and not len(cc):
            return []
        comp = evaluate(rc, cc, self.catalog, self.policy, self.reader)
        rk, ck = comp.ref_keys, comp.cand_keys
        step = comp.A >> 24
        if everything:
            final = np.ones(len(comp), bool)
        else:
            hr, hc = comp.ri >= 0, comp.ci >= 0
            st_r = np.where(hr, rk.status[np.maximum(comp.ri, 0)] if len(rk) else -1, -1)
            st_c = np.where(hc, ck.status[np.maximum(comp.ci, 0)] if len(ck) else -1, -1)
            copies_r = _has_copies(rk, self.catalog, rc)
            copies_c = _has_copies(ck, self.catalog, cc)
            cp_r = np.where(hr, copies_r[np.maximum(comp.ri, 0)] if len(rk) else False, False)
            cp_c = np.where(hc, copies_c[np.maximum(comp.ci, 0)] if len(ck) else False, False)
            tiled = hr & hc & np.isin(st_r, (M.OK, M.NONE)) & np.isin(st_c, (M.OK, M.NONE)) \
                & ~cp_r & ~cp_c
            final = tiled | (step < past)
        events = []
        for i in comp.order[final[comp.order]]:
            i = int(i)
            if comp.verdict[i] == F.IGNORED:
                continue
            f = comp.finding(i)
            events.append(LiveEvent(finding=f))
            if f.breach:
                self.breach_steps.add(f.key.step)
        self.emitted += len(events)
        # mark the rows of reported keys
        for which, lk, cols_idx, keys in (("ref", rk, ridx, comp.ri), ("cand", ck, cidx, comp.ci)):
            g = keys[final & (keys >= 0)]
            if not len(g):
                continue
            rows, _ = _ranges_index(lk.first[g], lk.first[g] + lk.count[g])
            self.done[which][cols_idx[rows]] = True
        for a, b in zip(comp.A[final].tolist(), comp.B[final].tolist()):
            self.reported.add((a, b))
        return events

    def _announce(self, step: int) -> list[LiveEvent]:
        """Evaluate every key up to ``step`` in both runs and announce the earliest breach."""
        parts = {}
        for side in ("ref", "cand"):
            c = self.cols[side]
            parts[side] = c.take(np.flatnonzero((c.A >> 24) <= step))
        comp = evaluate(parts["ref"], parts["cand"], self.catalog, self.policy, self.reader)
        fd = comp.first_divergence()
        if fd < 0:
            return []
        self.announced = True
        return [LiveEvent(finding=comp.finding(fd), first_divergence=True)]


def _has_copies(lk: M.LogicalKeys, catalog: Catalog, cols: RunColumns) -> np.ndarray:
    """Keys whose pieces include replicas or Partial addends (more copies may still arrive)."""
    if not len(lk):
        return np.zeros(0, bool)
    flagged = np.array([p.replica or p.partial for p in catalog.pieces], bool)
    per_row = flagged[cols.layout] if len(cols) else np.zeros(0, bool)
    return np.logical_or.reduceat(per_row, lk.first) if len(per_row) else np.zeros(len(lk), bool)
