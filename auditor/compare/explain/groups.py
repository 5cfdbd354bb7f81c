"""Breaching findings grouped by cause: what a report says once for many keys.

A loss not divided by the accumulation count makes every parameter gradient of the step the
reference times the same factor, each with the same cause: said once per key, that is 29 copies
of one paragraph. `group_breaches` puts breaching findings into one group when they share their
phase, pipeline stage, verdict, cause and factor:

- the cause is its kind (introduced, inherited, unknown) and its reason with what names the key
  taken out (parenthesized evidence, key texts, the site, numbers), so "the previous capture in
  execution order (fwd tok output @ step 1 mb 1) already differs" and the same words about
  another key are one cause; a finding without a cause (missing, grad_none) groups by its
  detail the same way;
- the factor is `scaled_by` to three significant digits (a group is "all scaled by 2.00").

Groups are in execution order of their first member, so the first divergence's group comes
first. A group keeps what its members share (notes whose wording differs only in numbers and
key names are shared; the first member's words are shown) and what distinguishes them compactly
(steps, microbatches and sites as ranges: `auditor.compare.explain.site_sets`). Causes are worked
out for the first `GROUP_CAUSES` breaches in execution order; later breaches are grouped without
theirs (a group whose `cause` is null and `causes_examined` false), so a million breaches cost no
million causes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.explain.finding import finding
from numaudit.auditor.compare.explain.site_sets import compact_sites
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.read.align import phase_name, role_name
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.wire.vocabulary import PHASE_IDS

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison

GROUP_CAUSES = 5000
"""Breaching findings (the earliest in execution order) whose causes are worked out to group
them; the rest are grouped by phase, stage, verdict and factor alone."""

GROUP_SITES_LISTED = 1000
"""Sites a group's JSON lists (`sites`); `site_count` counts them all and `sites_text` says
them all compactly."""

NOUNS = {"input": ("input", "inputs"), "fwd": ("activation", "activations"),
         "bwd": ("activation gradient", "activation gradients"), "loss": ("loss", "losses"),
         "grad": ("parameter gradient", "parameter gradients"),
         "param": ("parameter value", "parameter values"),
         "optim_grad": ("gradient the optimizer consumed", "gradients the optimizer consumed"),
         "update": ("update", "updates"), "state": ("state entry", "state entries")}
"""What a key of each phase is, singular and plural ("29 parameter gradients of step 0")."""

_PHASES = "|".join(sorted(PHASE_IDS, key=len, reverse=True))
_KEY_TEXT = re.compile(rf"\b(?:{_PHASES}) \S+ \S+(?: call \d+)? @ step \d+(?: mb \d+)?")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")
_PAREN = re.compile(r"\([^()]*\)")


def template(text: str, site: str = "") -> str:
    """`text` with what names one key taken out (parenthesized evidence, key texts, the site,
    numbers): two findings' reasons with the same template give the same cause."""
    t = text
    if site:
        t = t.replace(site, "<site>")
    while True:
        shorter = _PAREN.sub("", t)
        if shorter == t:
            break
        t = shorter
    t = _KEY_TEXT.sub("<key>", t)
    t = _NUMBER.sub("#", t)
    return " ".join(t.split())


def _factor(v: float) -> float | None:
    if not math.isfinite(v):
        return None
    return float(f"{v:.3g}")


@dataclass
class Group:
    """Breaching findings that share phase, stage, verdict, cause and factor."""

    index: int
    phase: str
    stage: int | None
    verdict: str
    count: int = 0
    first_order: int = 0
    """Execution order of the group's first member (`Finding.order`)."""
    steps: set[int] = field(default_factory=set)
    microbatches: set[int] = field(default_factory=set)
    roles: dict[str, None] = field(default_factory=dict)
    sites: dict[str, None] = field(default_factory=dict)
    cause: dict | None = None
    """The first member's cause (`Cause.as_dict`), null without one."""
    causes_examined: bool = True
    scaled_by: float | None = None
    metric: str | None = None
    values: list[float] = field(default_factory=list)
    thresholds: set[float] = field(default_factory=set)
    detail: str = ""
    factor_name: str = ""
    """What the shared factor is as a count of the runs' work ("x4 = 4 microbatches a step of
    cand: ..."; `auditor.compare.explain.factors.name_factor`), "" when none names it."""
    notes: list[str] | None = None
    """Notes every member has (by template; the first member's wording)."""
    _note_templates: list[str] = field(default_factory=list)
    _metrics: set = field(default_factory=set)

    def add(self, f: F.Finding, factor_head: str = "", factor_name: str = "") -> None:
        """Count finding `f` in; `factor_head` starts its factor note (said by `factor_name`
        for the group, not among its notes)."""
        k = f.key
        notes = [n for n in f.notes if not (factor_head and n.startswith(factor_head))]
        if not self.count:
            self.first_order = f.order
            self.cause = None if f.cause is None else f.cause.as_dict()
            self.detail = f.detail
            self.factor_name = factor_name
            self.notes = notes
            self._note_templates = [template(n, k.site) for n in notes]
        elif self.notes:
            mine = {template(n, k.site) for n in notes}
            keep = [t in mine for t in self._note_templates]
            self.notes = [n for n, ok in zip(self.notes, keep) if ok]
            self._note_templates = [t for t, ok in zip(self._note_templates, keep) if ok]
        if self.detail and f.detail != self.detail and \
                template(f.detail, k.site) != template(self.detail, k.site):
            self.detail = ""
        self.count += 1
        self.steps.add(k.step)
        if k.microbatch >= 0:
            self.microbatches.add(k.microbatch)
        self.roles[k.role + (f"[{k.index}]" if k.index else "")] = None
        self.sites[k.site] = None
        self._metrics.add(f.metric)
        if isinstance(f.value, (int, float)) and math.isfinite(f.value):
            self.values.append(float(f.value))
        if isinstance(f.threshold, (int, float)):
            self.thresholds.add(float(f.threshold))

    def headline(self) -> str:
        """"29 parameter gradients of step 0: all scaled by 2.00" ("of steps 1-2 mb 0-3")."""
        one, many = NOUNS.get(self.phase, ("key", "keys"))
        steps = sorted(self.steps)
        text = (f"{self.count} {one if self.count == 1 else many} of "
                f"step{'s' if len(steps) > 1 else ''} {format_ranges(steps)}")
        if self.microbatches:
            text += f" mb {format_ranges(sorted(self.microbatches))}"
        if self.stage is not None and self.stage >= 0:
            text += f", stage {self.stage}"
        return f"{text}: {self.what()}"

    def what(self) -> str:
        """The verdict the members share, with its measure: "all scaled by 2.00", "diverged
        (rel_l2 0.012-0.95 vs 1.3e-06)", "missing_in_cand (not captured in pp)"."""
        if self.scaled_by is not None:
            return ("all " if self.count > 1 else "") + f"scaled by {F._fixed(self.scaled_by)}"
        text = self.verdict
        metric = next(iter(self._metrics)) if len(self._metrics) == 1 else None
        if metric and self.values and self.verdict in ("diverged", "nonfinite"):
            lo, hi = min(self.values), max(self.values)
            span = F.format_float(lo) if F.format_float(lo) == F.format_float(hi) else \
                f"{F.format_float(lo)} to {F.format_float(hi)}"
            thr = (f" vs {F.format_float(next(iter(self.thresholds)))}"
                   if len(self.thresholds) == 1 else "")
            text += f" ({metric} {span}{thr})"
        elif self.detail:
            text += f" ({self.detail})"
        return text

    def sites_text(self) -> str:
        return compact_sites(self.sites)

    def as_dict(self) -> dict:
        metric = next(iter(self._metrics)) if len(self._metrics) == 1 else None
        return {
            "index": self.index, "headline": self.headline(), "phase": self.phase,
            "stage": self.stage, "verdict": self.verdict, "count": self.count,
            "first_order": self.first_order, "steps": sorted(self.steps),
            "microbatches": sorted(self.microbatches), "roles": list(self.roles),
            "sites": list(self.sites)[:GROUP_SITES_LISTED], "site_count": len(self.sites),
            "sites_text": self.sites_text(),
            "scaled_by": self.scaled_by, "metric": metric,
            "value_range": [min(self.values), max(self.values)] if self.values else None,
            "cause": self.cause, "causes_examined": self.causes_examined,
            "detail": self.detail, "factor_name": self.factor_name, "notes": self.notes or [],
        }


def group_breaches(comp: Comparison) -> tuple[list[Group], np.ndarray]:
    """The breaching findings' groups in execution order, and each key's group index (-1 for
    a key that does not breach)."""
    of = np.full(len(comp), -1, np.int32)
    groups: list[Group] = []
    by_key: dict[tuple, int] = {}
    ck, rk = comp.cand_keys, comp.ref_keys
    breaches = comp.indices(breaches_only=True)
    names = comp.memo.get("factor_names", {})
    head = f"{comp.cand.name} is {comp.ref.name} scaled by "
    for i in breaches[:GROUP_CAUSES].tolist():
        f = finding(comp, i)
        ci, ri = int(comp.cand_index[i]), int(comp.ref_index[i])
        stage = int(ck.stage[ci]) if ci >= 0 else (int(rk.stage[ri]) if ri >= 0 else None)
        factor = None if comp.scaled_by is None else _factor(float(comp.scaled_by[i]))
        if f.cause is not None:
            why = (f.cause.kind, template(f.cause.reason, f.key.site))
        else:
            why = ("", template(f.detail, f.key.site))
        key = (f.key.phase, stage, f.verdict, factor) + why
        g = by_key.get(key)
        if g is None:
            g = by_key[key] = len(groups)
            groups.append(Group(g, f.key.phase, stage, f.verdict, scaled_by=factor))
        groups[g].add(f, head, names.get(i, ""))
        of[i] = g
    rest = breaches[GROUP_CAUSES:]
    if len(rest):
        _group_unexamined(comp, rest, groups, of)
    return groups, of


def _group_unexamined(comp: Comparison, idx: np.ndarray, groups: list[Group],
                      of: np.ndarray) -> None:
    """Breaches past GROUP_CAUSES, grouped from the columns by phase, stage, verdict and
    factor (their causes are not worked out)."""
    ck, rk = comp.cand_keys, comp.ref_keys
    ci, ri = comp.cand_index[idx], comp.ref_index[idx]
    stage = np.where(ci >= 0, ck.stage[np.maximum(ci, 0)],
                     np.where(ri >= 0, rk.stage[np.maximum(ri, 0)], -2)).astype(np.int64)
    factor = (np.full(len(idx), np.nan) if comp.scaled_by is None else
              np.array([_factor(float(v)) or np.nan for v in comp.scaled_by[idx]]))
    cols = np.stack([comp.when[idx] & 0xF, stage, comp.verdict[idx].astype(np.int64),
                     np.nan_to_num(factor, nan=-1.0).view(np.int64)], axis=1)
    _, first, inverse = np.unique(cols, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    for u in np.argsort(first, kind="stable").tolist():
        members = idx[inverse == u]
        j = int(members[0])
        st = int(stage[first[u]])
        fac = factor[first[u]]
        g = Group(len(groups), phase_name(int(comp.when[j]) & 0xF), None if st == -2 else st,
                  F.VERDICT_NAMES[int(comp.verdict[j])], causes_examined=False,
                  scaled_by=None if math.isnan(fac) else float(fac))
        g.first_order = int(comp.rank_in_order[j])
        g.count = len(members)
        A, B = comp.when[members], comp.where[members]
        g.steps = set((A >> 24).tolist())
        g.microbatches = {m for m in (((A >> 4) & 0xFFFFF) - 1).tolist() if m >= 0}
        names = comp.catalog.site_names
        g.sites = dict.fromkeys(names.get(s, f"site#{s}") for s in (B >> 32).tolist())
        g.roles = dict.fromkeys(role_name(r) for r in ((B >> 28) & 0xF).tolist())
        g.notes = []
        groups.append(g)
        of[members] = g.index
