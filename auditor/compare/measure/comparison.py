"""The comparison's result as columns: one entry per aligned key, in key order.

`Comparison` holds every key's verdict, metric, threshold and the estimates behind them as numpy
arrays (a million keys cost no million objects); `Comparison.finding(i)` materializes one key as a
`Finding` (docs/report-schema.md) when a report asks for it. The stages that fill it live beside
it: `verdicts` (cheap verdicts from the columns), `slow` (metrics from moments and sketches),
`payloads` (exact metrics from bytes), `order` (execution order), `causes` (why a key diverged).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from numaudit.auditor.compare.explain import causes
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure import parents, tied
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.keys import LogicalKeys
from numaudit.auditor.compare.policy.load import METRICS, Policy
from numaudit.auditor.compare.read.align import PHASE_IDS, Key, phase_name, role_name
from numaudit.auditor.compare.read.columns import Catalog, RunColumns

METRIC_CODES = {m: i for i, m in enumerate(METRICS)}
"""Code of each policy metric in `Comparison.metric`."""
METRIC_NAMES = list(METRICS) + ["l2", "shape"]
"""Name of each code in `Comparison.metric` (two more than the policy's: absolute l2, shape)."""
M_L2, M_SHAPE = len(METRICS), len(METRICS) + 1


class CompareError(Exception):
    """A comparison that cannot be made (unknown run, unreadable store): usage/input error."""


@dataclass
class Comparison:
    """Every aligned key's verdict and metrics, as arrays (one entry per key, (A, B) order)."""

    ref: RunColumns
    cand: RunColumns
    ref_keys: LogicalKeys
    cand_keys: LogicalKeys
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
    bwd_factor: float = 1.0
    """The reference's activation gradients (phase bwd) are compared scaled by this: the
    candidate's grad_scale over the reference's (their loss normalizations)."""
    bwd_inferred: str = ""
    """Why `bwd_factor` is what it is when the evidence gave it, not the runs' declared scales
    (`auditor.compare.conventions.activation_grads`); "" when declared."""
    scaled_by: np.ndarray | None = None
    """Norm ratio of keys that breach as a pure rescaling of the reference (NaN elsewhere)."""
    pieces: dict[int, dict] = field(default_factory=dict)
    """Which ranks' pieces differ, for the localized breaching keys (`localize`)."""
    mesh: dict[str, dict] = field(default_factory=dict)
    """Per side ("ref", "cand"): the run's mesh dim names and each rank's coordinate
    (`ranks.mesh_of`), read while the store was open."""
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per side ("ref", "cand"): the run's labels, as registered."""
    scaled_resid: np.ndarray | None = None
    """||cand - a*ref|| / ||cand|| with a = ||cand||/||ref||, where measured: how far the
    candidate is from a pure rescaling of the reference."""
    memo: dict = field(default_factory=dict)
    """Evidence derived once per comparison and reused by every finding's cause (`causes`)."""
    noise: dict[int, dict] = field(default_factory=dict)
    """Keys judged against the reference's noise bands: their band and verdict
    (`auditor.compare.noise.judge`; the finding's ``metrics.noise``)."""
    noise_summary: dict | None = None
    """With noise bands: the counts per kind and the reference's nondeterminism (the report's
    ``noise``)."""

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
        if shape_code >= 0 and cat.shapes[shape_code][2] and ri >= 0 and rk.shape[ri] >= 0:
            shape_code = int(rk.shape[ri])  # a flat side's shape is its count: the other's
                                            # says more
        shape = list(cat.shapes[shape_code][0]) if shape_code >= 0 else None
        numel = int(ck.numel[ci]) if ci >= 0 and ck.status[ci] != M.NONE else (
            int(rk.numel[ri]) if ri >= 0 and rk.status[ri] != M.NONE else None)
        m = int(self.metric[i])
        metric = METRIC_NAMES[m] if m >= 0 else None
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
            pieces=self.pieces.get(i),
        )
        if with_cause and f.breach and v in (F.DIVERGED, F.NONFINITE, F.REPLICA_DIVERGENCE):
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
                                            else F.OTHER_DIGESTS)
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
            # JSON has no inf/NaN: rel_l2 against an all-zero reference is inf, as elsewhere
            out["payload"] = {k: _json_floats(v) for k, v in self.payload[i].items()
                              if not k.startswith("_")}
        if self.scaled_by is not None and not math.isnan(self.scaled_by[i]):
            out["scaled_by"] = _jf(self.scaled_by[i])
        if i in self.noise:
            out["noise"] = self.noise[i]
        if self.bwd_factor != 1.0 and (int(self.A[i]) & 0xF) == PHASE_IDS["bwd"] \
                and not math.isnan(self.rel_l2[i]):
            out["ref_scaled_by"] = self.bwd_factor
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
        if v in (F.MISSING_IN_REF, F.MISSING_IN_CAND):
            side, run = ("ref", self.ref.name) if v == F.MISSING_IN_REF else ("cand",
                                                                             self.cand.name)
            unrun = parents.missing_detail(self, i, side)
            if unrun:
                return unrun
            text = tied.missing_detail(self, i, side) or (
                f"not in {run}'s state (not saved, or left out when it was saved or loaded)"
                if int(self.A[i] & 0xF) == PHASE_IDS["state"] else f"not captured in {run}")
            return text + (" (expected by policy)" if self.expected[i] else "")
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
        """Whether key i introduced its divergence or inherited it
        (`auditor.compare.explain.causes`)."""
        return causes.cause(self, i)

    def step_keys(self, step: int, phases: tuple[int, ...]) -> np.ndarray:
        """Compared (not ignored) keys of one step in the given phases."""
        lo = int(np.searchsorted(self.A, step << 24, "left"))
        hi = int(np.searchsorted(self.A, (step + 1) << 24, "left"))
        idx = np.arange(lo, hi)
        return idx[np.isin(self.A[lo:hi] & 0xF, phases) & (self.verdict[lo:hi] != F.IGNORED)]


def _f(v: float) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def _json_floats(v):
    """`v` with every float (in dicts and lists too) as `_jf` writes it."""
    if isinstance(v, float):
        return _jf(v)
    if isinstance(v, dict):
        return {k: _json_floats(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_floats(x) for x in v]
    return v


def _jf(v: float):
    v = float(v)
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v
