"""Judge a candidate against the reference's own run-to-run noise (docs/noise.md).

With noise bands (`auditor.compare.noise.bands`: distances among reruns of the reference, per key
and per piece), every key of the comparison that is neither identical nor a structural finding
(missing, None, non-finite, incomplete, replicas, conflict, shape) is measured piece by piece on
the reference's boxes (`noise.pieces`) and judged box by box against that box's own band:

- a box whose reruns were bitwise equal allows the rounding floor of its dtype
  (`rounding_floor`) and nothing more, whatever the preset allows;
- a noisy box allows ``slack`` times the largest relative L2 distance among the reruns (and
  ``slack`` times their largest max_abs where payloads measured both), never less than the floor;
- a key is **beyond** when any box is beyond its allowance: it breaches, and its finding says by
  how much ("12x the reference's run-to-run noise") and on which ranks' piece;
- a key the preset alone breaches is **within the reference's own noise** (it passes) only when
  every box is within its noise (bitwise-equal boxes count) — a box merely within the floor
  never excuses the preset;
- a key that cannot be measured piece by piece (pieces in other boxes without payloads, pieces
  re-placed by the auditor) is judged as a whole only where that can breach: a whole-key
  distance beyond ``slack`` times the whole key's band (or beyond the floor where every rerun was
  bitwise equal) breaches; otherwise the preset decides (``not_applied``), since a band pooled
  over pieces could let one rank's noise excuse another rank's mismatch.

Keys without a band keep the preset's verdict (``unbanded``). `apply_bands` changes verdicts,
metrics and notes in place and records each judged key's band in ``comp.noise``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.digests.metrics import ITEMSIZE, MACHINE_EPS, json_float
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import M_SHAPE, METRIC_CODES, METRIC_NAMES
from numaudit.auditor.compare.measure.findings import format_float
from numaudit.auditor.compare.merge.ranks import box_text, fixed_dims
from numaudit.auditor.compare.noise.bands import BITWISE, NOISY, UNUSABLE, Bands
from numaudit.auditor.compare.noise.pieces import PieceDistance, measure_keys

DEFAULT_SLACK = 4.0
"""How many times the largest distance among the reference's runs a candidate may lie from it
and still be within its noise (docs/noise.md, "The statistics")."""
FLOOR_ROUNDINGS = {2: 1.0, 1: 1.0}
"""Roundings of the dtype the floor allows, by item size: a 16- or 8-bit float recomputed in
another order (accumulated in float32, rounded once) lands each element within one ulp."""
WIDE_FLOOR_ROUNDINGS = 16.0
"""Roundings a float32 or float64 tensor's floor allows: its accumulation is in that dtype,
and a reduction in another order (another sharding) leaves a few roundings."""
MAX_ABS_SLACK = 2.0
"""max_abs is allowed this many times ``slack`` times the largest max_abs among the runs."""
KINDS = ("within_band", "excused", "preset_breach", "beyond_noise", "beyond_floor",
         "not_applied", "unbanded")
"""What the bands made of the comparison's keys that are not identical (docs/noise.md):
within their band (``excused``: of those, the ones the preset alone would breach), within it
but breached by the preset (boxes within the rounding floor do not excuse it), beyond the
reference's run-to-run noise, beyond the rounding floor where every run was bitwise equal, with a
band that could not be applied piece by piece, without a band."""
MAX_PIECES_LISTED = 32


@dataclass
class NoiseSpec:
    """What `compare --noise RUN ...` or `--noise-bands FILE` asks for."""

    reruns: tuple[str, ...] = ()
    """Reruns of the reference to measure bands among (with the reference itself)."""
    bands: Bands | None = None
    """Bands measured before (`auditor calibrate`)."""
    slack: float = DEFAULT_SLACK
    abs_slack: float | None = None
    """The same for max_abs (default `MAX_ABS_SLACK` times ``slack``): the largest element's
    difference is an extreme, far more variable from rerun to rerun than the L2 distance."""
    source: str = ""
    """Where the bands came from (a file's path), for the report."""


def rounding_floor(dtype: str | None) -> float:
    """The relative L2 distance a recomputation in another order may leave on a tensor of
    ``dtype``: ``FLOOR_ROUNDINGS`` (or ``WIDE_FLOOR_ROUNDINGS``) times its machine epsilon."""
    if not dtype or dtype not in MACHINE_EPS:
        return 0.0
    return MACHINE_EPS[dtype] * FLOOR_ROUNDINGS.get(ITEMSIZE[dtype], WIDE_FLOOR_ROUNDINGS)


def apply_bands(comp, spec: NoiseSpec) -> dict:
    """Judge every key of ``comp`` that has a band (module docstring); returns the summary the
    report carries (counts per kind)."""
    bands = spec.bands
    assert bands is not None  # callers run resolve_bands first
    g_all = bands.locate(comp.when, comp.where, comp.catalog.site_names)
    v = comp.verdict
    counts = dict.fromkeys(KINDS, 0)
    differing = (v != F.IDENTICAL) & (v != F.IGNORED)
    counts["unbanded"] = int((differing & (g_all < 0)).sum())
    judged = np.flatnonzero(((v == F.CLOSE) | (v == F.DIVERGED)) & (comp.metric != M_SHAPE)
                            & (comp.ref_index >= 0) & (comp.cand_index >= 0) & (g_all >= 0))
    unusable = judged[bands.state[g_all[judged]] == UNUSABLE]
    for i in unusable.tolist():
        counts["not_applied"] += 1
        _record(comp, i, {"kind": "not_applied", "band": "none",
                          "reason": bands.reasons.get(int(g_all[i]), "")})
    judged = judged[bands.state[g_all[judged]] != UNUSABLE]
    numel = comp.ref_keys.numel[comp.ref_index[judged]]
    other = judged[(bands.numel[g_all[judged]] >= 0) & (bands.numel[g_all[judged]] != numel)]
    for i in other.tolist():
        counts["not_applied"] += 1
        _record(comp, i, {"kind": "not_applied", "band": "none",
                          "reason": "the bands were measured on another tensor at this key "
                                    f"({int(bands.numel[g_all[i]])} elements, here "
                                    f"{int(comp.ref_keys.numel[comp.ref_index[i]])}: microbatches "
                                    "grouped otherwise?)"})
    judged = np.setdiff1d(judged, other)
    measured = measure_keys(comp, judged)
    for i in judged.tolist():
        kind = _judge(comp, i, int(g_all[i]), measured[i], spec)
        counts[kind] += 1
        if kind == "excused":
            counts["within_band"] += 1
    noisy = bands.state == NOISY
    warnings = []
    if comp.cand.name in bands.runs:
        warnings.append(f"{comp.cand.name} is one of the runs the noise bands were measured "
                        "among: it lies within them by construction")
    keys = {"noisy": int(noisy.sum()), "bitwise": int((bands.state == BITWISE).sum()),
            "unusable": int((bands.state == UNUSABLE).sum())}
    return {"warnings": warnings, "runs": list(bands.runs), "pairs": bands.pairs,
            "slack": spec.slack, "source": spec.source or "runs", "keys": keys,
            "counts": counts, "nondeterminism": bands.meta.get("nondeterminism")}


def _record(comp, i: int, info: dict) -> None:
    comp.noise[i] = info


def _band_of(bands: Bands, g: int, box, same_policy: bool) -> tuple | None:
    """(bitwise, rel, sigma, max_abs, max_abs's bound from the extremes, allclose) of a box's
    band; None when the bands have no such box. Their elementwise ratio counts only under the
    policy they were measured with (NaN otherwise)."""
    if bands.state[g] == BITWISE:
        return True, 0.0, 0.0, 0.0, 0.0, 0.0
    j = bands.pieces(g).get(box)
    if j is None:
        return None
    return (bool(bands.p_bitwise[j]), float(bands.p_rel[j]), float(bands.p_sigma[j]),
            float(bands.p_max_abs[j]), float(bands.p_bound[j]),
            float(bands.p_allclose[j]) if same_policy else math.nan)


def _dtype_floor(comp, i: int) -> tuple[float, str]:
    dts = comp.catalog.dtypes
    names = [dts[lk.dtype[g]] for lk, g in ((comp.ref_keys, int(comp.ref_index[i])),
                                            (comp.cand_keys, int(comp.cand_index[i])))
             if g >= 0 and lk.dtype[g] >= 0]
    floors = [(rounding_floor(d), d) for d in names]
    return max(floors) if floors else (0.0, "")


def _judge(comp, i: int, g: int, measured, spec: NoiseSpec) -> str:
    bands, slack = spec.bands, spec.slack
    assert bands is not None  # set by resolve_bands before apply_bands
    floor, dtype = _dtype_floor(comp, i)
    bitwise_key = bands.state[g] == BITWISE
    base = {"band": "bitwise" if bitwise_key else "noisy", "runs": len(bands.runs),
            "slack": slack, "abs_slack": abs_slack(spec), "floor": floor,
            "preset_breach": bool(comp.breach[i])}
    if isinstance(measured, str):
        return _whole(comp, i, g, measured, spec, floor, dtype, base)
    rows = []
    logical = tuple(comp.catalog.shapes[comp.ref_keys.shape[int(comp.ref_index[i])]][0])
    for p in measured:
        band = _band_of(bands, g, p.box, spec_policy_same(bands, comp))
        if band is None:  # another sharding of the reference: no band is this box's
            why = "the reference's pieces are not those the bands were measured on"
            _record(comp, i, dict(base, kind="not_applied", reason=why))
            comp.notes.setdefault(i, []).append(f"not judged against the reference's noise "
                                                f"({why}): the preset decides")
            return "not_applied"
        if math.isnan(band[1]) or math.isnan(p.rel):
            return _whole(comp, i, g, "a distance could not be measured", spec, floor, dtype,
                          base)
        rows.append(_piece_verdict(comp, p, band, slack, floor, abs_slack(spec)))
        rows[-1]["whole"] = p.box is not None and tuple(p.box[1]) == logical
    beyond = [r for r in rows if r["beyond"]]
    worst = max(rows, key=lambda r: r["ratio_to_limit"]) if rows else None
    info = dict(base, pieces=[_piece_dict(comp, r) for r in
                              sorted(rows, key=lambda r: -r["ratio_to_limit"])][:MAX_PIECES_LISTED],
                pieces_total=len(rows), beyond_pieces=sum(r["beyond"] for r in rows))
    noisy_rows = [r for r in rows if not r["band_bitwise"] and r["band_rel"] > 0]
    if noisy_rows:
        info["times"] = max(r["times"] for r in noisy_rows)
    uncertain = any(r["uncertain"] for r in rows)
    if beyond:
        comp.uncertain[i] = uncertain
        noisy_beyond = [r for r in beyond if not r["band_bitwise"]]
        kind = "beyond_noise" if noisy_beyond else "beyond_floor"
        top = max(noisy_beyond or beyond, key=lambda r: r["ratio_to_limit"])
        if noisy_beyond:
            info["times"] = max(r["times"] for r in noisy_beyond)
        also = [r for r in beyond if r["band_bitwise"]] if noisy_beyond else []
        _breach(comp, i, top, kind, info, dtype, also)
        return kind
    excusable = all(r["piece"].bitwise or r["within_noise"] for r in rows)
    if comp.breach[i] and excusable and rows and worst is not None:
        _excuse(comp, i, worst, info)
        return "excused"
    if not comp.breach[i]:
        comp.uncertain[i] = uncertain
    kind = "preset_breach" if comp.breach[i] else "within_band"
    _record(comp, i, dict(info, kind=kind))
    return kind


def abs_slack(spec: NoiseSpec) -> float:
    return spec.abs_slack if spec.abs_slack is not None else MAX_ABS_SLACK * spec.slack


def _piece_verdict(comp, p: PieceDistance, band, slack: float, floor: float,
                   a_slack: float) -> dict:
    band_bitwise, b_rel, b_sigma, b_abs, b_bound, b_close = band
    noise_limit = 0.0 if band_bitwise else slack * b_rel
    limit = max(noise_limit, floor)
    abs_limit = math.nan
    if not band_bitwise and not math.isnan(b_abs):
        abs_limit = max(a_slack * b_abs, floor * (p.ref_abs_max if not math.isnan(p.ref_abs_max)
                                                  else 0.0))
    # without payloads the extremes bound the candidate's max_abs from below: enough to breach,
    # never to excuse
    cand_abs = p.max_abs if not math.isnan(p.max_abs) else p.max_abs_bound
    pol = comp.policy
    breach, unc = F.judge(np.array([p.rel]), np.array([p.sigma]), np.array([limit]),
                          pol.sigmas, pol.on_uncertain)
    over_abs = not math.isnan(abs_limit) and cand_abs > abs_limit
    beyond = bool(breach[0]) or over_abs
    within_noise = (not beyond and not band_bitwise and b_rel > 0 and p.rel <= noise_limit
                    and _abs_within(p, b_abs, b_bound, a_slack, floor))
    times = p.rel / b_rel if b_rel > 0 else (math.inf if p.rel > 0 else 0.0)
    ratio = max(p.rel / limit if limit > 0 else (math.inf if p.rel > 0 else 0.0),
                cand_abs / abs_limit if over_abs else 0.0)
    return {"piece": p, "band_bitwise": band_bitwise, "band_rel": b_rel, "band_max_abs": b_abs,
            "band_allclose": b_close,
            "limit": limit, "abs_limit": abs_limit, "beyond": beyond, "over_abs": over_abs,
            "within_noise": within_noise, "times": times, "ratio_to_limit": ratio,
            "uncertain": bool(unc[0])}


def spec_policy_same(bands: Bands, comp) -> bool:
    """Whether the bands were measured under the comparison's policy (their elementwise ratios
    are then the candidate's kind)."""
    return (bands.meta.get("policy") or {}).get("sha256") == comp.policy.sha256


def _abs_within(p: PieceDistance, b_abs: float, b_bound: float, a_slack: float,
                floor: float) -> bool:
    """Whether the candidate's largest element difference is within the noise's, as far as it
    can be shown: against the reruns' max_abs, a known max_abs of the candidate; without one
    (no payloads) its lower bound from the extremes against theirs. Only what is shown
    excuses a preset's breach."""
    if not math.isnan(b_abs):
        return not math.isnan(p.max_abs) and p.max_abs <= a_slack * b_abs
    if not math.isnan(b_bound):
        ref = p.ref_abs_max if not math.isnan(p.ref_abs_max) else 0.0
        return p.max_abs_bound <= max(a_slack * b_bound, floor * ref)
    return True


def _piece_dict(comp, r: dict) -> dict:
    p: PieceDistance = r["piece"]
    side = "cand" if p.cand_ranks else "ref"
    ranks = p.cand_ranks or p.ranks
    return {"box": None if p.box is None else box_text(*p.box), "ranks": ranks, "side": side,
            "mesh": fixed_dims(comp.mesh.get(side) if comp.mesh else None, ranks),
            "rel_l2": _jf(p.rel), "sigma": _jf(p.sigma), "max_abs": _jf(p.max_abs),
            "band": "bitwise" if r["band_bitwise"] else "noisy",
            "band_rel_l2": _jf(r["band_rel"]), "band_max_abs": _jf(r["band_max_abs"]),
            "limit": _jf(r["limit"]), "beyond": r["beyond"], "method": p.method,
            "allclose": _jf(p.allclose), "band_allclose": _jf(r["band_allclose"])}


def _jf(v: float) -> float | str | None:
    """A distance for the report: NaN (not measured) as null."""
    return json_float(v, nan=None)


def _where(r: dict) -> str:
    p: PieceDistance = r["piece"]
    ranks = p.cand_ranks or p.ranks
    if p.box is None or (not any(p.box[0]) and r.get("whole")):
        return "the whole tensor" + (f" (ranks {', '.join(map(str, ranks))})"
                                     if len(ranks) > 1 else "")
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}'s piece "
            f"{box_text(*p.box)}")


def _breach(comp, i: int, top: dict, kind: str, info: dict, dtype: str,
            also: list | None = None) -> None:
    p: PieceDistance = top["piece"]
    runs = info["runs"]
    if kind == "beyond_noise":
        what = (f"beyond the reference's own noise: rel_l2 {format_float(p.rel)} on {_where(top)} "
                f"is {_times(top['times'])} the largest distance among its {runs} runs "
                f"({format_float(top['band_rel'])}; within noise: up to {info['slack']:g}x)")
        if top["over_abs"]:
            bound = "" if not math.isnan(p.max_abs) else " at least"
            what += (f"; max_abs{bound} "
                     f"{format_float(p.max_abs if not bound else p.max_abs_bound)} against "
                     f"{format_float(top['abs_limit'])}"
                     f" ({info['abs_slack']:g}x theirs, {format_float(top['band_max_abs'])})")
        if also:
            what += ("; and beyond the rounding floor where the runs are bitwise equal: "
                     + ", ".join(f"rel_l2 {format_float(r['piece'].rel)} on {_where(r)}"
                                 for r in also[:4]))
    else:
        what = (f"the reference's {runs} runs are bitwise equal here, so any difference beyond "
                f"the rounding floor of {dtype} (rel_l2 {format_float(info['floor'])}) is a "
                f"finding: rel_l2 {format_float(p.rel)} on {_where(top)}")
    if top["over_abs"] and not p.rel > top["limit"]:
        cand_abs = p.max_abs if not math.isnan(p.max_abs) else p.max_abs_bound
        comp.metric[i], comp.value[i], comp.threshold[i] = (METRIC_CODES["max_abs"], cand_abs,
                                                            top["abs_limit"])
        comp.sigma[i] = math.nan
    else:
        comp.metric[i], comp.value[i], comp.threshold[i] = (METRIC_CODES["rel_l2"], p.rel,
                                                            top["limit"])
        comp.sigma[i] = p.sigma if p.sigma > 0 else math.nan
    comp.verdict[i], comp.breach[i] = F.DIVERGED, True
    _rescaling(comp, i, top["limit"])
    comp.notes.setdefault(i, []).append(what)
    _record(comp, i, dict(info, kind=kind))


def _rescaling(comp, i: int, tol: float) -> None:
    """A breach that is a pure rescaling of the reference reads "scaled by" (as slow.py says)."""
    if comp.scaled_by is None or comp.scaled_resid is None:
        return
    nr, resid = float(comp.norm_ratio[i]), float(comp.scaled_resid[i])
    if math.isfinite(nr) and nr > 0 and resid <= tol and abs(nr - 1.0) > tol:
        comp.scaled_by[i] = nr


def _excuse(comp, i: int, worst: dict, info: dict) -> None:
    p: PieceDistance = worst["piece"]
    metric = comp.metric[i]
    preset = (f"{METRIC_NAMES[metric]} {format_float(float(comp.value[i]))} vs "
              f"{format_float(float(comp.threshold[i]))}" if metric >= 0 else "its metric")
    times = info.get("times", 0.0)
    comp.notes.setdefault(i, []).append(
        f"within the reference's own noise: every piece lies within {info['slack']:g}x the "
        f"largest distance among its {info['runs']} runs (at most {_times(times)}: rel_l2 "
        f"{format_float(p.rel)} on {_where(worst)}), though the preset alone would breach "
        f"({preset})")
    comp.metric[i], comp.value[i] = METRIC_CODES["rel_l2"], p.rel
    comp.threshold[i] = worst["limit"]
    comp.sigma[i] = p.sigma if p.sigma > 0 else math.nan
    comp.verdict[i], comp.breach[i], comp.uncertain[i] = F.CLOSE, False, False
    if comp.scaled_by is not None:
        comp.scaled_by[i] = math.nan
    _record(comp, i, dict(info, kind="excused"))


def _times(t: float) -> str:
    if math.isinf(t):
        return "infinitely many times"
    return f"{t:.2g}x" if t < 10 else f"{t:,.0f}x"


def _whole(comp, i: int, g: int, why: str, spec: NoiseSpec, floor: float, dtype: str,
           base: dict) -> str:
    """A key not measurable piece by piece: judged as a whole only where that breaches."""
    bands = spec.bands
    assert bands is not None  # set by resolve_bands before apply_bands
    pm = comp.payload.get(i)
    rel = float(pm["rel_l2"]) if pm is not None and isinstance(pm.get("rel_l2"), float) \
        else float(comp.rel_l2[i])
    info = dict(base, reason=why)
    if math.isnan(rel):
        _record(comp, i, dict(info, kind="not_applied"))
        comp.notes.setdefault(i, []).append(f"not judged against the reference's noise ({why}): "
                                            "the preset decides")
        return "not_applied"
    bitwise = bands.state[g] == BITWISE
    band_rel = 0.0 if bitwise else float(bands.rel[g])
    limit = max(spec.slack * band_rel, floor) if not math.isnan(band_rel) else math.nan
    if not math.isnan(limit) and rel > limit:
        r = {"piece": PieceDistance(None, [], False, rel), "band_bitwise": bitwise,
             "band_rel": band_rel, "band_max_abs": math.nan, "limit": limit,
             "abs_limit": math.nan, "beyond": True, "over_abs": False, "within_noise": False,
             "times": rel / band_rel if band_rel > 0 else math.inf, "ratio_to_limit": 0.0,
             "uncertain": False}
        kind = "beyond_floor" if bitwise else "beyond_noise"
        if not bitwise:
            info["times"] = r["times"]
        _breach(comp, i, r, kind, info, dtype)
        return kind
    _record(comp, i, dict(info, kind="not_applied"))
    comp.notes.setdefault(i, []).append(
        f"not judged against the reference's noise piece by piece ({why}): the whole tensor is "
        "within its band, but a band is per piece (one rank's noise must not excuse another "
        "rank's difference), so the preset decides")
    return "not_applied"



def resolve_bands(reader, ref: str, spec: NoiseSpec, policy, select=None) -> Bands:
    """The spec's bands: those given, else measured among the reference and its reruns."""
    if spec.bands is None:
        from numaudit.auditor.compare.noise.calibrate import measure_bands

        spec.bands = measure_bands(reader, [ref, *spec.reruns], policy, select=select)
    return spec.bands


def noise_pieces(comp) -> None:
    """The ``pieces`` of keys the bands found beyond (after `localize.localize_breaches`, whose
    test is the preset's): the boxes beyond their own band, by the candidate's ranks."""
    for i, info in comp.noise.items():
        rows = info.get("pieces") or []
        if not info.get("kind", "").startswith("beyond") or len(rows) < 2:
            continue
        differ = [{"ranks": r["ranks"], "mesh": r["mesh"], "box": r["box"],
                   "rel_l2": r["rel_l2"]} for r in rows if r["beyond"]]
        total = info.get("pieces_total", len(rows))
        comp.pieces[i] = {"method": "band", "side": rows[0]["side"], "differ": differ,
                          "differ_count": info.get("beyond_pieces", len(differ)),
                          "agree": total - info.get("beyond_pieces", len(differ)),
                          "cannot_localize": None}
