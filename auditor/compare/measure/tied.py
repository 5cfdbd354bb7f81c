"""Tied parameters: one parameter held under two names (an output head tied to the embedding).

The agent captures a tied parameter once, under its first name, and lists the other names in the
run label `wire.labels.TIED_LABEL` ("alias=name"). A key of an alias is then absent from that run
by construction, not because capture failed; and where only one run ties the two names, the
runs train different parameters (one gradient summing both uses against two gradients). These
helpers turn the labels into the texts of such keys; what is compared does not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from numaudit.wire.labels import TIED_LABEL
from numaudit.wire.vocabulary import PHASE_IDS

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison

PARAMETER_PHASES = frozenset(PHASE_IDS[p] for p in ("grad", "param", "optim_grad", "update"))
"""The phases keyed by parameter name: the ones a tie changes."""


def tied_names(comp: Comparison, side: str) -> dict[str, str]:
    """alias -> the name the run captured the parameter under, from its label (memoized)."""
    memo = comp.memo.setdefault("tied_names", {})
    if side not in memo:
        text = comp.labels.get(side, {}).get(TIED_LABEL, "")
        memo[side] = dict(e.split("=", 1) for e in text.split(", ") if "=" in e)
    return memo[side]


def _ties(comp: Comparison, side: str, a: str, b: str) -> bool:
    names = tied_names(comp, side)
    return names.get(a, a) == names.get(b, b)


def missing_detail(comp: Comparison, i: int, side: str) -> str:
    """The detail of key i absent from run `side` because that run ties its parameter to
    another name ("" where no tie explains it)."""
    if int(comp.when[i]) & 0xF not in PARAMETER_PHASES:
        return ""
    site = comp.key(i).site
    name = tied_names(comp, side).get(site)
    if name is None:
        return ""
    run, other_side = (comp.ref.name, "cand") if side == "ref" else (comp.cand.name, "ref")
    other = comp.cand.name if side == "ref" else comp.ref.name
    text = (f"not captured under this name in {run}: {run} ties {site} to {name} (one "
            f"parameter, captured once as {name})")
    if _ties(comp, other_side, site, name):
        return text + (f"; {other} ties them too but captured the parameter as {site} (its "
                       "modules are registered in another order): a policy rename can align them")
    return text + (f"; {other} holds {site} and {name} as separate parameters: one run ties the "
                   "weights and the other does not, so they train different parameters")


def tied_note(comp: Comparison, i: int) -> str:
    """Where key i's parameter is tied to another name in one run only: why its gradient (and
    so its value) can differ between runs that are otherwise the same ("" elsewhere)."""
    if int(comp.when[i]) & 0xF not in PARAMETER_PHASES:
        return ""
    site = comp.key(i).site
    for side, other_side in (("ref", "cand"), ("cand", "ref")):
        aliases = [a for a, n in tied_names(comp, side).items() if n == site]
        alone = [a for a in aliases if not _ties(comp, other_side, a, site)]
        if alone:
            run = comp.ref.name if side == "ref" else comp.cand.name
            other = comp.cand.name if side == "ref" else comp.ref.name
            return (f"{site} is tied to {', '.join(alone)} in {run} and not in {other}: in "
                    f"{run} it is one parameter whose gradient sums the uses under all its "
                    f"names, in {other} separate parameters with a gradient each")
    return ""
