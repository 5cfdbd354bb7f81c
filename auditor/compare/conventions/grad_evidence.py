"""What the parameter gradients (phase grad) say about a factor seen elsewhere.

A convention between two runs (a loss merged as a sum over dp ranks, activation gradients at
another scale) is a reporting matter only when it does not reach training: the parameter
gradients, what the optimizer consumes, must not carry the same factor. `GradEvidence` holds
which parameter gradients were compared and which breach; `sharing` says which of the breaching
ones are the reference times a given factor. A gradient that differs otherwise (a bucket left
unreduced, a frozen parameter, one microbatch trained) is a finding of its own and no evidence
against the convention (docs/comparison.md, "Conventions from the evidence").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.explain import factors
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.merge import tiling as M
from numaudit.wire.vocabulary import Phase

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison

GRAD = Phase.GRAD
SAME_FACTOR_RTOL = 1e-4
"""How close two factors (norm ratios) must be to be one factor: far below any difference of
counts, far above the rounding of a norm ratio measured from float64 moments or bytes."""


@dataclass(frozen=True)
class GradEvidence:
    """The compared parameter gradients of a comparison and the breaching ones."""

    keys: np.ndarray
    """Parameter-gradient keys the policy compares."""
    bad: np.ndarray
    """The breaching ones, in execution order."""
    missing: str
    """Why the gradients cannot vouch for the training step ("" when they can: captured in both
    runs, some of them neither zero nor None)."""

    @property
    def agree(self) -> bool:
        return not self.missing and not len(self.bad)


def grad_evidence(comp: Comparison) -> GradEvidence:
    """The parameter gradients of `comp` as evidence (see `GradEvidence`)."""
    grad = np.flatnonzero(((comp.when & 0xF) == GRAD) & (comp.verdict != F.IGNORED))
    bad = grad[comp.breach[grad]]
    bad = bad[np.argsort(comp.rank_in_order[bad], kind="stable")]
    if not len(grad):
        return GradEvidence(grad, bad, "no parameter gradient (phase grad) was captured to show "
                                       "the training step matches")
    both = grad[(comp.ref_index[grad] >= 0) & (comp.cand_index[grad] >= 0)]
    rk = comp.ref_keys
    r = comp.ref_index[both]
    live = (rk.status[r] == M.OK) & (rk.all_zero[r] != 1) if len(r) else np.zeros(0, bool)
    if not live.any():
        return GradEvidence(grad, bad, "no parameter gradient that is not zero or None was "
                                       "compared")
    return GradEvidence(grad, bad, "")


def same_factor(a: float, b: float) -> bool:
    """Two measured factors are one (both finite and positive, within SAME_FACTOR_RTOL)."""
    return bool(np.isfinite(a) and np.isfinite(b) and a > 0 and b > 0
                and abs(a / b - 1.0) <= SAME_FACTOR_RTOL)


def sharing(comp: Comparison, ev: GradEvidence, factor: float) -> np.ndarray:
    """The breaching parameter gradients that are the reference times `factor` (a pure
    rescaling, measured from payloads or moments and sketches first where their verdict came
    from fingerprints alone), in execution order."""
    bad = ev.bad[comp.verdict[ev.bad] == F.DIVERGED]
    if not len(bad) or not np.isfinite(factor):
        return bad[:0]
    both = (comp.ref_index[bad] >= 0) & (comp.cand_index[bad] >= 0)
    blind = bad[np.isnan(comp.norm_ratio[bad]) & both]
    if len(blind):
        factors.factor_evidence(comp, blind)
    if comp.scaled_by is None:
        return bad[:0]
    sb = comp.scaled_by[bad]
    return bad[np.array([same_factor(float(s), factor) for s in sb], bool)]


def differ_text(comp: Comparison, ev: GradEvidence, keys: np.ndarray | None = None) -> str:
    """"3 of 30, first grad w value @ step 0" for the given breaching keys (default: all)."""
    keys = ev.bad if keys is None else keys
    return f"{len(keys)} of {len(ev.keys)}, first {comp.key(int(keys[0]))}"
