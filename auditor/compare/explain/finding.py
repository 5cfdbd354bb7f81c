"""One key of a comparison as a `Finding` (docs/report-schema.md): what a report lists.

`Comparison` keeps every key's verdict and metrics as columns; `finding(comp, i)` materializes
one key when a report, a group or the live comparison asks for it: its ranks, dtypes, shape,
metrics as JSON values, the detail a verdict carries, and for a divergence its cause.
"""

from __future__ import annotations

import math

from numaudit.auditor.compare.digests.metrics import json_float
from numaudit.auditor.compare.explain import causes
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure import parents, tied
from numaudit.auditor.compare.measure.comparison import METRIC_NAMES, Comparison
from numaudit.auditor.compare.merge import tiling as M
from numaudit.wire.vocabulary import Phase


def finding(comp: Comparison, i: int, *, with_cause: bool = True) -> F.Finding:
    """Key ``i`` of the comparison as a `Finding`, with its cause when it breaches as a
    divergence (`auditor.compare.explain.causes`)."""
    i = int(i)
    v = int(comp.verdict[i])
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    rk, ck = comp.ref_keys, comp.cand_keys
    cat = comp.catalog
    ranks = {"ref": rk.ranks(comp.ref, ri) if ri >= 0 else [],
             "cand": ck.ranks(comp.cand, ci) if ci >= 0 else []}
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
    m = int(comp.metric[i])
    metric = METRIC_NAMES[m] if m >= 0 else None
    f = F.Finding(
        key=comp.key(i), verdict=F.VERDICT_NAMES[v], breach=bool(comp.breach[i]),
        stage=int(ck.stage[ci]) if ci >= 0 else None,
        ref_stage=int(rk.stage[ri]) if ri >= 0 else None,
        ranks=ranks, dtype={"ref": dt_r, "cand": dt_c}, shape=shape, numel=numel,
        metric=metric, value=_f(comp.value[i]), sigma=_f(comp.sigma[i]),
        threshold=_f(comp.threshold[i]), uncertain=bool(comp.uncertain[i]),
        metrics=_metrics(comp, i, ri, ci), rule=comp.rule_labels[int(comp.rule[i])],
        expected=bool(comp.expected[i]), detail=_detail(comp, i, v, ri, ci),
        notes=list(comp.notes.get(i, ())), order=int(comp.rank_in_order[i]),
        pieces=comp.pieces.get(i),
    )
    if with_cause and f.breach and v in (F.DIVERGED, F.NONFINITE, F.REPLICA_DIVERGENCE):
        f.cause = causes.cause(comp, i)
    return f


def _metrics(comp: Comparison, i: int, ri: int, ci: int) -> dict:
    rk, ck = comp.ref_keys, comp.cand_keys
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
    if not math.isnan(comp.rel_l2[i]):
        out["rel_l2"] = {"estimate": _jf(comp.rel_l2[i]), "sigma": _jf(comp.rel_sigma[i]),
                         "lower_bound": _jf(comp.lower_bound[i])}
        out["cosine_distance"] = {"estimate": _jf(comp.cos_dist[i]),
                                  "sigma": _jf(comp.cos_sigma[i])}
        out["norm_ratio"] = _jf(comp.norm_ratio[i])
        out["abs_max_ratio"] = _jf(comp.abs_max_ratio[i])
    d = comp.nonfinite_detail(i)
    if d is not None:
        out["nonfinite"] = d
    if i in comp.payload:
        # JSON has no inf/NaN: rel_l2 against an all-zero reference is inf, as elsewhere
        out["payload"] = {k: _json_floats(v) for k, v in comp.payload[i].items()
                          if not k.startswith("_")}
    if comp.scaled_by is not None and not math.isnan(comp.scaled_by[i]):
        out["scaled_by"] = _jf(comp.scaled_by[i])
    if i in comp.noise:
        out["noise"] = comp.noise[i]
    if comp.bwd_factor != 1.0 and (int(comp.when[i]) & 0xF) == Phase.BWD \
            and not math.isnan(comp.rel_l2[i]):
        out["ref_scaled_by"] = comp.bwd_factor
    return out


def _detail(comp: Comparison, i: int, v: int, ri: int, ci: int) -> str:
    rk, ck = comp.ref_keys, comp.cand_keys
    if v == F.INCOMPLETE or v == F.REPLICA_DIVERGENCE:
        parts = []
        if ri >= 0 and ri in rk.messages:
            parts.append(f"{comp.ref.name}: {rk.messages[ri]}")
        if ci >= 0 and ci in ck.messages:
            parts.append(f"{comp.cand.name}: {ck.messages[ci]}")
        return "; ".join(parts)
    if v == F.GRAD_NONE:
        side = comp.cand.name if ck.status[ci] == M.NONE else comp.ref.name
        return f"None in {side}"
    if v == F.IDENTICAL and ri >= 0 and rk.status[ri] == M.NONE:
        return "None in both runs"
    if v in (F.MISSING_IN_REF, F.MISSING_IN_CAND):
        side, run = ("ref", comp.ref.name) if v == F.MISSING_IN_REF else ("cand",
                                                                         comp.cand.name)
        unrun = parents.missing_detail(comp, i, side)
        if unrun:
            return unrun
        text = tied.missing_detail(comp, i, side) or (
            f"not in {run}'s state (not saved, or left out when it was saved or loaded)"
            if int(comp.when[i] & 0xF) == Phase.STATE else f"not captured in {run}")
        return text + (" (expected by policy)" if comp.expected[i] else "")
    if v == F.NONFINITE:
        d = comp.nonfinite_detail(i)
        if d is None:
            return "NaN/Inf present in " + " and ".join(
                n for n, x in ((comp.ref.name, rk.nonfinite[ri]), (comp.cand.name,
                                                                   ck.nonfinite[ci])) if x)
        parts = []
        for side, name in (("ref", comp.ref.name), ("cand", comp.cand.name)):
            c = d[side]
            parts.append(f"{name}: {c['nan']} NaN, {c['posinf']} +Inf, {c['neginf']} -Inf")
        return "non-finite elements — " + "; ".join(parts)
    return ""

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


def _jf(v: float) -> float | str | None:
    """A metric for the report: NaN (not measured) as null."""
    return json_float(v, nan=None)
