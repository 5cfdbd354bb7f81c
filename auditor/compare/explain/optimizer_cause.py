"""Why an optimizer-phase key diverged (`optim_grad`, `update`): the gradient the optimizer
consumed, and the scaling between what backward produced and what the step used (clipping,
unscaling, a gradient transformation). Called by `auditor.compare.explain.causes`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.explain.evidence_gaps import gap_remedy, uncompared
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.ranks import key_boxes
from numaudit.auditor.compare.read.segments import unique
from numaudit.wire.vocabulary import Phase

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison


def optimizer_cause(comp: Comparison, i: int, step: int, phase: int) -> F.Cause:
    """optim_grad against the gradient after backward; update against what the optimizer got."""
    site_id = int(comp.where[i] >> 32)
    role = int((comp.where[i] >> 28) & 0xF)
    if phase == Phase.OPTIM_GRAD:
        before, name = Phase.GRAD, "grad"
    else:
        before, name = Phase.OPTIM_GRAD, "optim_grad"
    j = comp.find(step, -1, before, site_id, role)
    gap = uncompared(comp, j)
    if gap:
        return F.Cause("unknown", f"phase {name} of this parameter {gap}: "
                                  f"{gap_remedy(comp, j)} to tell where the difference arises")
    v = int(comp.verdict[j])
    if comp.breach[j]:
        return F.Cause("inherited", f"its {name} already differs ({F.VERDICT_NAMES[v]})",
                       comp.key(j))
    if phase == Phase.OPTIM_GRAD and comp.none_in_both(np.array([j]))[0]:
        return F.Cause("unknown", "its grad is None in both runs while the optimizer consumed a "
                                  "gradient: the gradients were cleared (zero_grad) before they "
                                  "were captured, so where the difference arises cannot be told "
                                  "from them; step the optimizer after the step block (a "
                                  "torch.optim one inside it is seen before it steps)",
                       comp.key(j))
    if phase == Phase.UPDATE:
        return F.Cause("introduced", f"its optim_grad matched ({F.VERDICT_NAMES[v]}) but the "
                                     "update applied differs: learning rate, optimizer state or "
                                     "the update rule", comp.key(j))
    grads = comp.step_keys(step, (before,))
    n_bad = int(np.count_nonzero(comp.breach[grads]))
    every = (f", as did all {len(grads)} parameter gradients of step {step}" if n_bad == 0
             else "")
    text = (f"the gradients matched before the optimizer (its grad: {F.VERDICT_NAMES[v]}"
            f"{every}) and differ as it consumed them")
    return F.Cause("introduced", f"{text}: {_consumed_scaling(comp, step)}", comp.key(j))


SCALE_AGREEMENT = 1e-4
"""Relative spread within which the optim_grad keys of one stage (or rank) share one scaling
factor."""


def _consumed_scaling(comp: Comparison, step: int) -> str:
    """What the optimizer-side gradients of a step say about how they were transformed: one
    factor per pipeline stage (clipping by a stage-local norm), one factor for all (a different
    clipping coefficient or gradient scale), or no pure rescaling. Memoized per step."""
    memo = comp.memo.setdefault("consumed_scaling", {})
    if step in memo:
        return memo[step]
    keys = comp.step_keys(step, (Phase.OPTIM_GRAD,))
    # None or all-zero gradients are identical under any factor: they say nothing about it
    ri = comp.ref_index[keys]
    rk = comp.ref_keys
    blank = (ri >= 0) & (comp.verdict[keys] == F.IDENTICAL)
    if len(rk):
        r = np.maximum(ri, 0)
        blank &= (rk.status[r] == M.NONE) | (rk.all_zero[r] == 1)
    keys = keys[~blank]
    scaled = comp.scaled_by[keys] if comp.scaled_by is not None else np.full(len(keys), np.nan)
    factor = np.where(comp.verdict[keys] == F.IDENTICAL, 1.0, scaled)
    stage = comp.order_stage[keys]
    per_stage: dict[int, float] = {}
    for s in unique(stage).tolist():
        f = factor[stage == s]
        if not np.isfinite(f).all() or not len(f):
            per_stage = {}
            break
        mid = float(np.median(f))
        if np.abs(f - mid).max() > SCALE_AGREEMENT * mid:
            per_stage = {}
            break
        per_stage[int(s)] = mid
    generic = ("gradient clipping, unscaling or a gradient transformation treated the runs "
               "differently")
    distinct = len({round(f, 6) for f in per_stage.values()})
    if len(per_stage) > 1 and distinct > 1:
        each = ", ".join(f"stage {s} x{F.format_float(f)}" for s, f in sorted(per_stage.items()))
        text = (f"each pipeline stage's gradients are scaled by a factor of its own relative to "
                f"{comp.ref.name} ({each}), so the coefficient was computed per stage: gradients "
                "clipped by each stage's local norm instead of the global norm over all stages "
                "(or a per-stage gradient scale)")
    elif per_stage and distinct == 1 and next(iter(per_stage.values())) != 1.0:
        f = F.format_float(next(iter(per_stage.values())))
        text = (f"every gradient the optimizer consumed is scaled by x{f} relative to "
                f"{comp.ref.name}: a different clipping coefficient (max_norm, or a norm over a "
                "different set of gradients) or gradient scale")
    else:
        per_rank = _per_rank_factors(comp, keys, factor)
        if len(per_rank) > 1 and len({round(f, 6) for f in per_rank.values()}) > 1:
            each = ", ".join(f"rank {r} x{F.format_float(f)}" for r, f in sorted(per_rank.items()))
            text = (f"the gradients each rank of {comp.cand.name} holds are scaled by a factor of "
                    f"its own relative to {comp.ref.name} ({each}), so the coefficient was "
                    "computed per rank: gradients sharded over ranks (FSDP) clipped by the norm "
                    "of each rank's shard instead of the global norm (torch.nn.utils."
                    "clip_grad_norm_ on FSDP1's flat parameters, where the FSDP module's own "
                    "clip_grad_norm_ takes the norm over every shard)")
        else:
            text = generic
    memo[step] = text
    return text


def _per_rank_factors(comp: Comparison, keys: np.ndarray, factor: np.ndarray) -> dict[int, float]:
    """The factor shared by the candidate's gradients that one rank holds alone, per rank
    (parameters sharded whole to ranks, or a rank's only range of them); {} where a rank's
    gradients do not share one, or no rank holds any alone."""
    per: dict[int, list[float]] = {}
    for g, f in zip(comp.cand_index[keys].tolist(), factor.tolist()):
        if g < 0:
            continue
        rows = [r for held in key_boxes(comp, "cand", g).values() for r in held]
        ranks = {int(comp.cand.rank[r]) for r in rows}
        if len(ranks) == 1:
            per.setdefault(ranks.pop(), []).append(f)
    out: dict[int, float] = {}
    for rank, fs in per.items():
        f = np.array(fs)
        mid = float(np.median(f))
        if not np.isfinite(f).all() or np.abs(f - mid).max() > SCALE_AGREEMENT * mid:
            return {}
        out[rank] = mid
    return out
