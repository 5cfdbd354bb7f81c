"""Where a cause lacks evidence: a key that was not captured, or was captured and excluded by
the policy, and what would give it (`auditor.compare.explain.causes`, `optimizer_cause`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from numaudit.auditor.compare.measure import findings as F

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison


def uncompared(comp: Comparison, j: int) -> str:
    """Why key j (-1: no such key in either run) gives no evidence, as a predicate ("was not
    captured in ref"); "" where it was compared. A key the policy excluded was captured: saying
    it was not would send the user to capture what the store already holds."""
    if j < 0:
        return "was not captured in either run"
    v = int(comp.verdict[j])
    if v == F.IGNORED:
        held = [run for run, k in ((comp.ref.name, comp.ref_index[j]),
                                   (comp.cand.name, comp.cand_index[j])) if k >= 0]
        where = "" if len(held) == 2 else f" in {held[0]} only"
        rule = comp.rule_labels[int(comp.rule[j])]
        return f"was captured{where} but excluded by the policy ({rule})"
    if v == F.MISSING_IN_REF:
        return f"was not captured in {comp.ref.name}"
    if v == F.MISSING_IN_CAND:
        return f"was not captured in {comp.cand.name}"
    return ""


def gap_remedy(comp: Comparison, j: int) -> str:
    """What gives the evidence key j lacks (see `uncompared`): compare it, or capture it."""
    if j >= 0 and int(comp.verdict[j]) == F.IGNORED:
        return "let the policy compare it"
    return "capture it in both runs"
