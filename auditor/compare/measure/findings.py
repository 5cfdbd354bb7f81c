"""Verdicts, findings, first divergence and backward-graph breaks (docs/comparison.md).

A *finding* is the auditor's verdict on one aligned key. Verdicts:

- ``identical``: bitwise equal (fingerprints or payload bytes), or None in both runs; a
  reduction over ranks (a per-rank mean loss) whose values rebuilt from both runs' payloads are
  equal;
- ``close`` / ``diverged``: the policy's metric within / beyond its threshold;
- ``missing_in_ref`` / ``missing_in_cand``: the key exists in one run only;
- ``grad_none``: None in one run, a tensor in the other (a backward-graph break);
- ``nonfinite``: NaN/Inf in one run and not the other, or in both where the policy forbids it;
- ``incomplete``: a run's pieces do not tile the logical tensor;
- ``replica_divergence``: copies that must be identical differ within one run;
- ``conflict``: a rank sent the same key twice with different content (the store kept the first).

A finding *breaches* the policy unless it is identical, close, or an expected absence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from numaudit.auditor.compare.digests.metrics import json_float
from numaudit.auditor.compare.read.align import Key
from numaudit.auditor.compare.read.ranges import format_ranges


class Verdict(IntEnum):
    """What a comparison says of one key (docs/report-schema.md, ``verdict``); the codes of
    `Comparison.verdict`, in this order."""

    IDENTICAL = 0
    CLOSE = 1
    DIVERGED = 2
    MISSING_IN_REF = 3
    MISSING_IN_CAND = 4
    GRAD_NONE = 5
    NONFINITE = 6
    INCOMPLETE = 7
    REPLICA_DIVERGENCE = 8
    CONFLICT = 9
    IGNORED = 10


IDENTICAL, CLOSE, DIVERGED, MISSING_IN_REF, MISSING_IN_CAND, GRAD_NONE, NONFINITE, INCOMPLETE, \
    REPLICA_DIVERGENCE, CONFLICT, IGNORED = tuple(Verdict)
"""The verdicts by bare name, as the comparison's modules spell them (``F.DIVERGED``)."""
VERDICT_NAMES = tuple(v.name.lower() for v in Verdict)
VERDICTS = VERDICT_NAMES[:IGNORED]
"""Verdicts a finding can have (ignored keys produce no finding, only a count)."""
PASSING = frozenset({IDENTICAL, CLOSE, IGNORED})
OTHER_DIGESTS = ("digests were made with other seeds, or for other places (pieces re-placed by "
                 "the auditor: uneven rows per rank, or microbatches regrouped)")
"""Why a key's fingerprint cannot be compared when it is not a Partial one."""


def judge(value: np.ndarray, sigma: np.ndarray, threshold: np.ndarray, sigmas: float,
          on_uncertain: str, certain_breach: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """(breach, uncertain) for estimates ``value +- sigma`` against ``threshold``.

    The point estimate decides; a finding is *uncertain* when the threshold lies within
    ``sigmas`` standard deviations of the estimate, i.e. when noise could have decided it. Since
    the sketch's sigma is proportional to the difference itself, a difference far below the
    threshold is never uncertain (it is ``close``) and one far above never is either
    (``diverged``). ``on_uncertain`` then says what an uncertain finding is: ``estimate`` (the
    point estimate), ``breach`` (conservative) or ``pass``. ``certain_breach`` marks keys whose
    deterministic lower bound already exceeds the threshold.
    """
    value = np.asarray(value, np.float64)
    sigma = np.nan_to_num(np.asarray(sigma, np.float64), nan=0.0)
    threshold = np.asarray(threshold, np.float64)
    with np.errstate(invalid="ignore"):
        over = value > threshold
        uncertain = (sigma > 0) & (np.abs(value - threshold) <= sigmas * sigma)
    uncertain &= np.isfinite(value)
    if certain_breach is not None:
        over |= certain_breach
        uncertain &= ~certain_breach
    if on_uncertain == "breach":
        breach = over | uncertain
    elif on_uncertain == "pass":
        breach = over & ~uncertain
    else:
        breach = over
    # NaN values (not computable) never pass silently
    breach |= np.isnan(value)
    return breach, uncertain


@dataclass
class Cause:
    """Whether a diverged key introduced the divergence or inherited it."""

    kind: str
    """"introduced", "inherited" or "unknown"."""
    reason: str
    previous: Key | None = None
    """The capture the judgement rests on (its input, or the previous site in order)."""

    def as_dict(self) -> dict:
        return {"kind": self.kind, "reason": self.reason,
                "previous": None if self.previous is None else self.previous.as_dict()}


@dataclass
class Finding:
    """The verdict on one aligned key, with everything needed to act on it."""

    key: Key
    verdict: str
    breach: bool
    stage: int | None
    """The candidate's pipeline stage (-1 when not pipelined, None when the key is missing)."""
    ref_stage: int | None
    ranks: dict[str, list[int]]
    """Ranks that sent pieces, per side ("ref", "cand")."""
    dtype: dict[str, str | None]
    shape: list[int] | None
    numel: int | None
    metric: str | None = None
    value: float | None = None
    sigma: float | None = None
    threshold: float | None = None
    uncertain: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    rule: str = "default"
    expected: bool = False
    """An absence the policy expects (expect_missing): not a breach."""
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    cause: Cause | None = None
    pieces: dict | None = None
    """Which ranks' pieces differ (`auditor.compare.explain.localize`); None when not localized."""
    order: int = 0
    """Position in execution order (0 = earliest)."""
    group: int | None = None
    """Index of the breaching finding's group in the report (`auditor.compare.explain.groups`)."""

    def as_dict(self) -> dict:
        return {
            "key": self.key.as_dict(),
            "verdict": self.verdict,
            "breach": self.breach,
            "stage": self.stage,
            "ref_stage": self.ref_stage,
            "ranks": self.ranks,
            "dtype": self.dtype,
            "shape": self.shape,
            "numel": self.numel,
            "metric": self.metric,
            "value": json_float(self.value),
            "sigma": json_float(self.sigma),
            "threshold": json_float(self.threshold),
            "uncertain": self.uncertain,
            "metrics": self.metrics,
            "rule": self.rule,
            "expected": self.expected,
            "detail": self.detail,
            "notes": self.notes,
            "cause": None if self.cause is None else self.cause.as_dict(),
            "pieces": self.pieces,
            "order": self.order,
            "group": self.group,
        }

    def headline(self) -> str:
        """One line: verdict, key, metric against threshold."""
        return headline(self.as_dict())


def key_text(k: dict) -> str:
    """A key dict (JSON form) as `Key.__str__` writes it."""
    return str(Key(**k))


def headline(f: dict) -> str:
    """One line for a finding in its JSON form: verdict, key, stage, metric vs threshold."""
    text = f"{f['verdict']}: {key_text(f['key'])}"
    if f.get("stage") is not None and f["stage"] >= 0:
        text += f" (stage {f['stage']})"
    measure = measure_text(f)
    if measure:
        text += f" — {measure}"
    if f.get("detail"):
        text += f" — {f['detail']}"
    return text


def _lower_bound_only(f: dict, metrics: dict) -> bool:
    """The rel_l2 shown is only the moments' lower bound: no sketch estimate (no sigma), no
    payload, and the value is that bound (a key whose pieces were placed after the fact)."""
    rel = metrics.get("rel_l2")
    if f.get("metric") != "rel_l2" or not isinstance(rel, dict) or metrics.get("payload"):
        return False
    sigma = rel.get("sigma")
    no_sigma = sigma is None or sigma == "nan" or (isinstance(sigma, float) and math.isnan(sigma))
    value = f.get("value")
    return bool(no_sigma and isinstance(value, (int, float)) and rel.get("lower_bound") == value)


def measure_text(f: dict, *, compact: bool = False) -> str:
    """The metric that explains the finding, then the deciding metric against its threshold.

    A pure rescaling (cosine ~ 1) reads "scaled by 4.00 (rel_l2 3 vs 1.3e-06)"; a diverged
    direction adds the cosine ("rel_l2 0.69 vs 1.3e-06; cosine 0.72"); exact data adds max-abs,
    ULP and the elements failing assert_close. `compact` is the text report's column form;
    "" when the finding has no measured value.
    """
    value = f.get("value")
    metrics = f.get("metrics") or {}
    if f.get("metric") == "exact" and value is None and metrics.get("payload"):
        return _exact_text(f, metrics["payload"])  # a bitwise breach: how much, from bytes
    if not f.get("metric") or value is None:
        return ""
    bound = _lower_bound_only(f, metrics)
    text = f"{f['metric']} {'>= ' if bound else ''}{format_float(value)}"
    if f.get("sigma"):
        text += (" ±" if compact else " ± ") + format_float(f["sigma"])
    if f.get("threshold") is not None:
        text += f" vs {format_float(f['threshold'])}"
    if f.get("uncertain"):
        text += (" (a lower bound: nothing measures it)" if bound else
                 " (within noise)" if compact else " (within noise of the threshold)")
    noise = noise_text(metrics.get("noise"))
    scaled = metrics.get("scaled_by")
    if scaled is not None:
        return f"scaled by {_fixed(scaled)} ({text}{'; ' + noise if noise else ''})"
    extra = [noise] if noise else []
    payload = metrics.get("payload")
    if f.get("verdict") in ("diverged", "close") and payload:
        if f["metric"] != "max_abs" and payload.get("max_abs") is not None:
            extra.append(f"max_abs {format_float(payload['max_abs'])}")
        if payload.get("ulp") not in (None, 0, 0.0) and f["metric"] != "ulp":
            extra.append(f"{format_float(payload['ulp'])} ulp")
        if payload.get("mismatched") and f.get("numel"):
            extra.append(f"{payload['mismatched']} of {f['numel']} elements fail assert_close")
    cos = (payload or {}).get("cosine_distance")
    if cos is None:
        cos = (metrics.get("cosine_distance") or {}).get("estimate")
    if f.get("verdict") == "diverged" and f["metric"] in ("rel_l2", "allclose", "max_abs") \
            and isinstance(cos, (int, float)) and cos > 1e-3:
        extra.append(f"cosine {format_float(1.0 - cos)}")
    return text + ("; " + ", ".join(extra) if extra else "")


def _exact_text(f: dict, payload: dict) -> str:
    """A fingerprint breach measured from both runs' values: "fingerprints differ; max_abs
    1.19e-07, 1 ulp, 1 of 4096 elements differ"."""
    extra = []
    if payload.get("max_abs") is not None:
        extra.append(f"max_abs {format_float(payload['max_abs'])}")
    if payload.get("ulp") not in (None, 0, 0.0):
        extra.append(f"{format_float(payload['ulp'])} ulp")
    if payload.get("mismatched") and f.get("numel"):
        extra.append(f"{payload['mismatched']} of {f['numel']} elements differ")
    return "fingerprints differ" + ("; " + ", ".join(extra) if extra else "")


def noise_text(noise: dict | None) -> str:
    """A finding's verdict against the reference's noise bands (``metrics.noise``) in words:
    "317x the reference's run-to-run noise"; "" when the bands did not decide it."""
    kind = (noise or {}).get("kind")
    times = (noise or {}).get("times")
    if kind == "beyond_noise" and isinstance(times, (int, float)):
        return (f"{times:.2g}x" if times < 10 else f"{times:,.0f}x") + \
            " the reference's run-to-run noise"
    if kind == "beyond_floor":
        return "the reference's reruns are bitwise equal here"
    if kind == "excused":
        return "within the reference's run-to-run noise"
    return ""


def pieces_text(p: dict | None, *, short: bool = False) -> str:
    """A finding's ``pieces`` in words: "ranks differ: dp=1 (rank 1 [4:8, 0:16]); 1 of 2 agree
    (payload)"; `short` keeps the first part ("ranks differ: dp=1"). "" when not localized."""
    if not p:
        return ""
    if p.get("cannot_localize"):
        return "ranks: cannot localize" + ("" if short else f": {p['cannot_localize']}")
    differ = p.get("differ") or []
    total = p.get("differ_count", len(differ)) + p.get("agree", 0)
    if not differ:
        return "" if short else (f"ranks: no single piece differs beyond tolerance ({total} "
                                 f"pieces, {p.get('method')})")
    side = "" if p.get("side") in (None, "cand") else f" (in {p['side']})"
    where = []
    for d in differ[:8]:
        mesh = ", ".join(f"{k}={v}" for k, v in (d.get("mesh") or {}).items())
        where.append(mesh or f"rank {format_ranges(d['ranks'])}")
    more = p.get("differ_count", len(differ)) - len(where)
    head = "ranks differ: " + "; ".join(where) + (f"; +{more} more" if more > 0 else "") + side
    if short:
        return head
    boxes = "; ".join(f"rank {format_ranges(d['ranks'])} {d['box']}" for d in differ[:8])
    return (f"{head} ({boxes}); {p.get('agree', 0)} of {total} pieces agree "
            f"(by {p.get('method')})")


def _fixed(v) -> str:
    if isinstance(v, str):
        return v
    return f"{v:.2f}" if 0.01 <= abs(v) < 1000 else f"{v:.3g}"


def format_float(v: float | str | None) -> str:
    """3 significant digits; "0", "inf", "nan" as such; "-" for None; strings unchanged."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v == 0:
        return "0"
    if math.isinf(v) or math.isnan(v):
        return str(v)
    return f"{v:.3g}"


# -- backward-graph breaks -------------------------------------------------------------------------

@dataclass
class GraphBreak:
    """Parameters without gradient in one run, grouped (stage, module, or the whole run)."""

    side: str
    """The run where gradients are None (or all zero): "ref" or "cand"."""
    kind: str
    """"none" (gradient is None) or "zero" (gradient is all zeros)."""
    scope: str
    """"run", "stage" or "module"."""
    stage: int | None
    module: str
    params: int
    """Distinct parameters concerned."""
    total_params: int
    """Parameters of that scope compared."""
    steps: list[int]
    sites: list[str]
    message: str
    boundary: str = ""

    def as_dict(self) -> dict:
        return {"side": self.side, "kind": self.kind, "scope": self.scope, "stage": self.stage,
                "module": self.module, "params": self.params, "total_params": self.total_params,
                "steps": self.steps, "sites": self.sites, "message": self.message,
                "boundary": self.boundary}


def group_graph_breaks(entries: Sequence[tuple[str, str, int | None, str, int]],
                       totals_by_stage: dict[tuple[str, int | None], set[str]],
                       totals_run: dict[str, set[str]],
                       run_names: dict[str, str],
                       totals_module: dict[tuple[str, str], set[str]] | None = None
                       ) -> list[GraphBreak]:
    """Group per-key breaks into one line per run, stage or module.

    ``entries``: (side, kind, stage, site, step) of every gradient that is None (kind "none")
    or all zeros (kind "zero") in one run only; ``totals_*``: every parameter site compared,
    per (side, stage) and per side, so "all parameters of stage 1" can be recognised;
    ``totals_module`` per (side, module), so a module where only some parameters lack a
    gradient reads "K of N parameters of M received no gradient (frozen or unused)".
    """
    from numaudit.auditor.compare.read.align import common_prefix, site_module

    out: list[GraphBreak] = []
    by_side_kind: dict[tuple[str, str], list] = {}
    for side, kind, stage, site, step in entries:
        by_side_kind.setdefault((side, kind), []).append((stage, site, step))
    plural = {"none": "gradients are None", "zero": "gradients are all zero"}
    single = {"none": "gradient is None", "zero": "gradient is all zero"}

    def what_n(kind: str, n: int) -> str:
        return f"{n} parameter {(single if n == 1 else plural)[kind]}"

    for (side, kind), items in sorted(by_side_kind.items()):
        run = run_names.get(side, side)
        other = run_names.get("ref" if side == "cand" else "cand", "")
        sites_all = {s for _, s, _ in items}
        steps_all = sorted({st for _, _, st in items})
        tail = f" in {run} (present in {other})" if kind == "none" else \
            f" in {run} but not in {other}"
        if sites_all and sites_all >= totals_run.get(side, set()):
            out.append(GraphBreak(side, kind, "run", None, "", len(sites_all), len(sites_all),
                                  steps_all, sorted(sites_all)[:20],
                                  f"all {what_n(kind, len(sites_all))}{tail}, "
                                  f"steps {format_ranges(steps_all)}"))
            continue
        by_stage: dict[int | None, list] = {}
        for stage, site, step in items:
            by_stage.setdefault(stage, []).append((site, step))
        for stage in sorted(by_stage, key=lambda s: (s is None, s)):
            rows = by_stage[stage]
            sites = {s for s, _ in rows}
            steps = sorted({st for _, st in rows})
            total = totals_by_stage.get((side, stage), set())
            label = f"stage {stage}" if stage is not None and stage >= 0 else "the model"
            if total and sites >= total and stage is not None and stage >= 0:
                out.append(GraphBreak(side, kind, "stage", stage, "", len(sites), len(total),
                                      steps, sorted(sites)[:20],
                                      f"{label}: all {what_n(kind, len(sites))}{tail}, "
                                      f"steps {format_ranges(steps)}"))
                continue
            by_module: dict[str, set[str]] = {}
            for s in sites:
                by_module.setdefault(site_module(s), set()).add(s)
            # collapse modules under their common prefix when there are many
            if len(by_module) > 8:
                prefix = common_prefix(by_module) or "(several modules)"
                out.append(GraphBreak(side, kind, "module", stage, prefix, len(sites),
                                      len(total) or len(sites), steps, sorted(sites)[:20],
                                      f"{label}: {len(sites)} of {len(total) or len(sites)} "
                                      f"parameter {plural[kind]}{tail} in {len(by_module)} modules "
                                      f"under {prefix}, steps {format_ranges(steps)}"))
                continue
            for module, msites in sorted(by_module.items()):
                mtotal = len((totals_module or {}).get((side, module), msites) | msites)
                names = ", ".join(sorted(s.rsplit(".", 1)[-1] for s in msites))
                if mtotal > len(msites):
                    did = ("received no gradient (frozen or unused)" if kind == "none" else
                           "have all-zero gradients while the others do not (unused)")
                    text = (f"{label}: {len(msites)} of {mtotal} parameters of "
                            f"{module or '(root)'} {did}: {names}{tail}, "
                            f"steps {format_ranges(steps)}")
                else:
                    text = (f"{label}: {module or '(root)'}: {what_n(kind, len(msites))}"
                            f"{tail} ({names}), steps {format_ranges(steps)}")
                out.append(GraphBreak(side, kind, "module", stage, module, len(msites),
                                      mtotal, steps, sorted(msites), text))
    return out

