"""The report model: what a comparison of two runs found, for the renderers to read.

`compare_runs` returns a `Report`: the columnar `Comparison`, both runs' descriptions, the policy,
the verdict counts, the first divergence and the graph breaks. `header_dict` is the JSON report's
head (docs/report-schema.md); findings are materialized one at a time while a renderer writes
(`auditor.report`), so a million identical keys cost no million objects.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from numaudit.auditor.compare.explain.breaks import gradients_none_in_both, graph_breaks
from numaudit.auditor.compare.explain.causes import excluded_by_policy
from numaudit.auditor.compare.explain.finding import finding
from numaudit.auditor.compare.explain.groups import Group, group_breaches
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure import parents
from numaudit.auditor.compare.measure.comparison import Comparison
from numaudit.auditor.compare.policy.load import Policy
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.wire.vocabulary import Phase

SCHEMA = "numaudit.report"
SCHEMA_VERSION = 5
"""Bumped on any change that could break a reader of the JSON report (docs/report-schema.md)."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("numaudit")
    except Exception:  # not installed (running from a checkout)
        return "0+unknown"


@dataclass
class Report:
    """The outcome of comparing two runs."""

    comparison: Comparison
    """Every aligned key's verdict and metrics, as columns."""
    ref: dict
    cand: dict
    policy: Policy
    counts: dict[str, int]
    first: F.Finding | None
    graph_breaks: list[F.GraphBreak]
    warnings: list[str] = field(default_factory=list)
    generated_unix: float = field(default_factory=time.time)
    groups: list[Group] = field(default_factory=list)
    """Breaching findings grouped by cause, in execution order
    (`auditor.compare.explain.groups`)."""
    group_of: np.ndarray | None = None
    """Per key: the index of its group, -1 for a key that does not breach."""
    ops: Any = None
    """The op-level comparison (`auditor.compare.ops.comparison.OpReport`) when the runs captured
    operations (docs/drill-down.md); it explains, the module-level keys decide the exit code."""
    drill: dict | None = None
    """The rerun that drills into the first divergence's module (`auditor.compare.ops.drill`)."""

    @property
    def breaches(self) -> int:
        return int(self.comparison.breach.sum())

    @property
    def exit_code(self) -> int:
        """0 = every finding within policy, 1 = some finding breaches it."""
        return 1 if self.breaches else 0

    @property
    def uncertain(self) -> int:
        return int(self.comparison.uncertain.sum())

    @classmethod
    def build(cls, comp: Comparison, ref_info: dict, cand_info: dict, policy: Policy) -> Report:
        counts = comp.counts()
        fd = comp.first_divergence()
        first = finding(comp, fd) if fd >= 0 else None
        warnings = list(comp.catalog.warnings) + _run_warnings(ref_info, cand_info) + \
            parents.warning(comp) + steps_hint(comp) + gradients_none_in_both(comp)
        if first is not None and first.cause and first.key.step > 0 \
                and not comp.step_keys(first.key.step, (Phase.PARAM,)).size:
            params = (Phase.PARAM,)
            what = excluded_by_policy(comp, first.key.step, params) or "were not captured"
            first.notes.append(f"parameter values {what}: a divergence of the weights "
                               "(an optimizer difference) would first show here")
        groups, group_of = group_breaches(comp)
        if first is not None:
            first.group = int(group_of[fd])
        return cls(comparison=comp, ref=ref_info, cand=cand_info, policy=policy, counts=counts,
                   first=first, graph_breaks=graph_breaks(comp), warnings=warnings,
                   groups=groups, group_of=group_of)

    # -- iteration --------------------------------------------------------------------------------

    def findings(self, *, breaches_only: bool = False,
                 include_identical: bool = True) -> Iterator[F.Finding]:
        """Findings in execution order."""
        for i in self.comparison.indices(breaches_only=breaches_only,
                                         include_identical=include_identical):
            yield self.finding(i)

    def finding(self, i: int) -> F.Finding:
        """Key i's finding, with its group."""
        f = finding(self.comparison, i)
        if self.group_of is not None and self.group_of[i] >= 0:
            f.group = int(self.group_of[i])
        return f

    # -- the report's head ------------------------------------------------------------------------

    def header_dict(self) -> dict:
        """The JSON report without its findings (docs/report-schema.md)."""
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "generated_unix": self.generated_unix,
            "numaudit_version": _version(),
            "runs": {"ref": self.ref, "cand": self.cand},
            "policy": self.policy.describe(),
            "summary": {
                "keys": int(len(self.comparison)),
                "verdicts": {v: self.counts.get(v, 0) for v in F.VERDICTS},
                "ignored": self.counts.get("ignored", 0),
                "breaches": self.breaches,
                "uncertain": self.uncertain,
                "exit_code": self.exit_code,
                **({"noise": self.comparison.noise_summary["counts"]}
                   if self.comparison.noise_summary is not None else {}),
            },
            "first_divergence": None if self.first is None else self.first.as_dict(),
            "graph_breaks": [g.as_dict() for g in self.graph_breaks],
            "warnings": self.warnings,
            "groups": [g.as_dict() for g in self.groups],
            **({"noise": self.comparison.noise_summary}
               if self.comparison.noise_summary is not None else {}),
            **({"ops": self.ops.as_dict()} if self.ops is not None else {}),
            **({"drill": self.drill} if self.drill is not None else {}),
        }


def steps_hint(comp: Comparison) -> list[str]:
    """Where one run has steps the other lacks before or after all of the other's (a longer
    run, a run resumed later): their keys all read missing, and `--steps` compares the steps
    both have."""
    steps = {side: np.unique(lk.when >> 24) for side, lk in (("ref", comp.ref_keys),
                                                          ("cand", comp.cand_keys))}
    r, c = steps["ref"], steps["cand"]
    if not len(r) or not len(c):
        return []
    lo, hi = max(int(r[0]), int(c[0])), min(int(r[-1]), int(c[-1]))
    if lo > hi:
        return []
    out = []
    for mine, other, name, other_name, verdict in (
            (c, r, comp.cand.name, comp.ref.name, "missing_in_ref"),
            (r, c, comp.ref.name, comp.cand.name, "missing_in_cand")):
        extra = np.setdiff1d(mine, other)
        if not len(extra) or not ((extra > other[-1]) | (extra < other[0])).all():
            continue
        out.append(f"{name} has steps {format_ranges(extra.tolist())} that {other_name} has "
                   f"not ({other_name}: steps {format_ranges(other.tolist())}), so their keys "
                   f"read {verdict}: `--steps {lo if lo else ''}:{hi + 1}` compares only the "
                   "steps both runs have")
    return out


def _run_warnings(ref: dict, cand: dict) -> list[str]:
    out = []
    for info in (ref, cand):
        n = info["name"]
        if info["ranks_registered"] < info["world_size"]:
            out.append(f"{n}: only {info['ranks_registered']} of {info['world_size']} ranks "
                       "registered: keys of the others are missing")
        if info["ranks_closed"] < info["ranks_registered"]:
            out.append(f"{n}: {info['ranks_registered'] - info['ranks_closed']} ranks have not "
                       "closed their session: the run may still be sending")
        if info["dropped"]:
            out.append(f"{n}: agents dropped {info['dropped']} records (see `auditor show {n}`)")
        if info["conflicts"]:
            out.append(f"{n}: {info['conflicts']} records were resent with other content "
                       "(first stored kept)")
    if ref.get("dtype") and cand.get("dtype") and ref["dtype"] != cand["dtype"]:
        out.append(f"training dtypes differ ({ref['dtype']} vs {cand['dtype']}): each key gets "
                   "the looser of its two dtypes' tolerances")
    return out
