"""Why a key diverged: causes from the captured evidence.

`cause` says whether a diverged key introduced its difference or inherited it (its input, the
previous capture in execution order, the step's parameters, its module's activation gradients),
and where the evidence is missing, whether it was not captured or excluded by the policy. It
reads a filled `Comparison`; where backward graphs break is `auditor.compare.explain.breaks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.explain.evidence_gaps import uncompared as _uncompared
from numaudit.auditor.compare.explain.optimizer_cause import optimizer_cause
from numaudit.auditor.compare.explain.state_cause import state_cause
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.tied import tied_note
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.read.segments import unique
from numaudit.wire.labels import BATCH_STATS_LABEL, DROPOUT_LABEL, UNPASSED_MESH_LABEL
from numaudit.wire.vocabulary import PHASE_IDS, Phase

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison



def cause(comp: Comparison, i: int) -> F.Cause:
    found = _cause(comp, i)
    if found.kind == "introduced" and int(comp.when[i] & 0xF) == Phase.FWD:
        site = comp.key(i).site
        note = _batch_stats_note(comp, site) or _dropout_note(comp, site)
        if note:
            return F.Cause(found.kind, f"{found.reason}; {note}", found.previous)
    note = tied_note(comp, i)
    if note:
        return F.Cause(found.kind, f"{found.reason}; {note}", found.previous)
    return found


def _label_sites(comp: Comparison, side: str, label: str) -> list[str]:
    """The sites a run's label lists (wire/labels.py: joined by ", ")."""
    return comp.labels.get(side, {}).get(label, "").split(", ")


def _batch_stats_note(comp: Comparison, site: str) -> str:
    """Where a run's label lists `site` among its BatchNorms: why that alone differs."""
    for side, name in (("cand", comp.cand.name), ("ref", comp.ref.name)):
        if site in _label_sites(comp, side, BATCH_STATS_LABEL):
            return (f"{site} is a BatchNorm of data-parallel {name}: in training each rank "
                    "normalizes its share of the batch with that share's mean and variance, "
                    "not the whole batch's as one process does (SyncBatchNorm computes those, "
                    "or compare against a reference that splits the batch the same way)")
    return ""


def _dropout_note(comp: Comparison, site: str) -> str:
    """Where a run's label lists `site`, or modules inside it, among its dropouts: why the
    module can differ in a correct run."""
    listed: dict[str, None] = {}
    runs = []
    for side, run in (("ref", comp.ref.name), ("cand", comp.cand.name)):
        mine = [s for s in _label_sites(comp, side, DROPOUT_LABEL)
                if s == site or s.startswith(site + ".")]
        if mine:
            runs.append(run)
            listed.update(dict.fromkeys(mine))
    if not runs:
        return ""
    names = list(listed)
    what = (f"{site} is a dropout" if names == [site] else
            f"{site} holds dropout ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return (f"{what} in {' and '.join(runs)}: in training each run draws its own random masks, "
            "so runs whose random streams differ (one process against data-parallel ranks, "
            "another pipeline schedule, another seed) drop different elements; audit with "
            "dropout off (p=0, or the module in eval mode) or against a reference that draws "
            "the same masks")


def _cause(comp: Comparison, i: int) -> F.Cause:
    step = int(comp.when[i] >> 24)
    phase = int(comp.when[i] & 0xF)
    if int(comp.verdict[i]) == F.REPLICA_DIVERGENCE:
        return _replica_cause(comp, i)
    if phase == Phase.INPUT:
        return _input_cause(comp, i)
    if phase == Phase.PARAM:
        return _param_cause(comp, i, step)
    if phase == Phase.GRAD:
        return _grad_cause(comp, i, step)
    if phase in (Phase.OPTIM_GRAD, Phase.UPDATE):
        return optimizer_cause(comp, i, step, phase)
    if phase == Phase.STATE:
        return state_cause(comp, i)
    key = comp.key(i)
    if key.role == "output":
        site_id = int(comp.where[i] >> 32)
        j = comp.find(step, key.microbatch, phase, site_id, 2, key.index, key.call)
        if j < 0 and key.index:
            j = comp.find(step, key.microbatch, phase, site_id, 2, 0, key.call)
        if j >= 0 and comp.verdict[j] != F.IGNORED:
            return _judged(comp, j, "its input", i)
    p = int(comp.pred[i])
    if phase == Phase.BWD:
        zero = _zero_cut(comp, i, p)
        if zero is not None:
            return zero
        seed = _seed_cause(comp, i, p)
        if seed is not None:
            return seed
    if p >= 0:
        return _judged(comp, p, "the previous capture in execution order", i)
    return _block_start_cause(comp, step)


def _input_cause(comp: Comparison, i: int) -> F.Cause:
    """The batch fed to the model: name the microbatch and, when localized, the ranks."""
    key = comp.key(i)
    where = (f"microbatch {key.microbatch} of step {key.step}" if key.microbatch >= 0
             else f"step {key.step}")
    text = (f"the captured input batch ({key.site}, {where}) differs: data loading, sampler or "
            "microbatch split")
    p = comp.pieces.get(i)
    if p and p.get("differ"):
        text += "; " + F.pieces_text(p)
    elif p and p.get("cannot_localize"):
        text += "; which ranks' rows differ cannot be told (the finding's pieces say why)"
    return F.Cause("introduced", text)


def _replica_cause(comp: Comparison, i: int) -> F.Cause:
    """Copies that must be identical disagree: name the ranks and the mesh dim they span."""
    from numaudit.auditor.compare.merge.ranks import key_boxes, varying_dims
    from numaudit.auditor.compare.read.ranges import format_ranges

    key = comp.key(i)
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    on_cand = ci >= 0 and comp.cand_keys.status[ci] == M.REPLICA_DIVERGENCE
    side, g = ("cand", ci) if on_cand else ("ref", ri)
    lk = comp.cand_keys if on_cand else comp.ref_keys
    cols = comp.cand if on_cand else comp.ref
    bad = [int(r) for r in lk.bad_ranks.get(g, ())]
    holders = next((rows for rows in key_boxes(comp, side, g).values()
                    if len(rows) > 1 and any(int(cols.rank[r]) in bad for r in rows)), None)
    ranks = sorted({int(cols.rank[r]) for r in holders} if holders else set(lk.ranks(cols, g)))
    dims = varying_dims(comp.mesh.get(side), ranks)
    text = f"replicas of {key} disagree across ranks {format_ranges(ranks)} in {cols.name}"
    if dims:
        dim = "/".join(dims)
        text += (f" (mesh {dim}): ranks {format_ranges(bad)} differ from the others, so a "
                 f"collective over {dim} is missing or wrong (an all-reduce left out, or a "
                 "tensor left Partial)")
    else:
        text += (f": ranks {format_ranges(bad)} differ from the others, so a collective among "
                 "them is missing or wrong (an all-reduce)")
        if comp.labels.get(side, {}).get(UNPASSED_MESH_LABEL):
            # the job has a mesh (its model holds DTensors) that attach was not given
            text += ("; the ranks registered no mesh coordinates, so the mesh dim cannot be "
                     "named (pass the device mesh to attach)")
    p = int(comp.pred[i])
    if p >= 0 and _other_parameter(comp, i, p):
        # each parameter's gradient has its own reduction: another one's diverging replicas
        # neither cause nor explain this one's
        p = -1
    if p >= 0 and int(comp.verdict[p]) == F.REPLICA_DIVERGENCE:
        return F.Cause("inherited", f"{text}; the previous capture in execution order "
                                    f"({comp.key(p)}) already has diverging replicas",
                       comp.key(p))
    return F.Cause("introduced", text, comp.key(p) if p >= 0 else None)


PER_PARAMETER = frozenset(PHASE_IDS[p] for p in ("grad", "param", "optim_grad", "update",
                                                 "state"))
"""Phases whose keys are one parameter's (or state entry's) each: the capture before one in
execution order is another parameter's, which it is not computed from."""


def _other_parameter(comp: Comparison, i: int, p: int) -> bool:
    """Key p is another parameter's key of a per-parameter phase than key i's."""
    return int(comp.when[i] & 0xF) in PER_PARAMETER and int(comp.when[p] & 0xF) in PER_PARAMETER \
        and int(comp.where[i] >> 32) != int(comp.where[p] >> 32)


def _zero_cut(comp: Comparison, i: int, p: int) -> F.Cause | None:
    """An activation gradient that is all zero in one run only: backward was cut before it."""
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    if ri < 0 or ci < 0:
        return None
    zr, zc = int(comp.ref_keys.all_zero[ri]), int(comp.cand_keys.all_zero[ci])
    if zr < 0 or zc < 0 or zr == zc:
        return None
    run, other = (comp.cand.name, comp.ref.name) if zc == 1 else (comp.ref.name, comp.cand.name)
    text = (f"this activation gradient is all zero in {run} and not in {other}: backward is cut "
            "before it (a detach or a no_grad")
    if p >= 0 and not comp.breach[p]:
        return F.Cause("introduced", f"{text} between {comp.key(p)}, which matched, and this "
                                     "capture)", comp.key(p))
    return F.Cause("introduced", text + ")", comp.key(p) if p >= 0 else None)

def _seed_cause(comp: Comparison, i: int, p: int) -> F.Cause | None:
    """The first activation gradient of its microbatch's backward, after a loss (or forward)
    that matched: it is computed from where backward starts, the seed (the scale the loss's
    backward starts from) and the loss function's own gradient, not by its module."""
    if p < 0 or int(comp.when[p] & 0xF) == Phase.BWD or comp.breach[p]:
        return None
    prev, key = comp.key(p), comp.key(i)
    matched = f"{prev} {F.VERDICT_NAMES[int(comp.verdict[p])]}"
    f = float(comp.scaled_by[i]) if comp.scaled_by is not None else np.nan
    if not np.isfinite(f):
        return F.Cause("introduced", f"the first activation gradient of backward differs while "
                                     f"the capture before it matched ({matched}): what differs "
                                     "is where backward starts, the seed (the scale the loss's "
                                     "backward starts from) or the loss function's gradient, "
                                     f"rather than what {key.site} computes", prev)
    beyond = (" beyond the factor the runs' loss normalizations imply" if comp.bwd_factor != 1.0
              else "")
    return F.Cause("introduced", f"the first activation gradient of backward is "
                                 f"{comp.cand.name}'s = {comp.ref.name}'s x{F.format_float(f)}"
                                 f"{beyond} while the capture before it matched ({matched}): "
                                 "what differs is the backward seed, the scale the loss's "
                                 "backward starts from (the loss multiplied or divided between "
                                 "its capture and backward(): by a count of ranks or "
                                 "microbatches, or a loss scaler), not what "
                                 f"{key.site} computes (the finding's note names the "
                                 "factor)", prev)


ROUNDING_AMPLIFICATION = 100.0
"""A module 'amplifies a rounding difference' only while its own difference stays within this
many times its predecessor's; beyond, the evidence says the module itself computes otherwise."""


def _bound_only(comp: Comparison, i: int) -> bool:
    """Key i's rel_l2 is only the moments' lower bound (no sketch estimate, no payload)."""
    sigma, lb = float(comp.rel_sigma[i]), float(comp.lower_bound[i])
    return np.isnan(sigma) and i not in comp.payload and lb == float(comp.rel_l2[i])


def _judged(comp: Comparison, j: int, what: str, i: int | None = None) -> F.Cause:
    prev = comp.key(j)
    v = int(comp.verdict[j])
    if v == F.IDENTICAL:
        return F.Cause("introduced", f"{what} ({prev}) is identical", prev)
    if v == F.CLOSE:
        before, after = float(comp.rel_l2[j]), float(comp.rel_l2[i]) if i is not None else np.nan
        at_least = ">= " if i is not None and _bound_only(comp, i) else ""
        if np.isfinite(before) and np.isfinite(after) and \
                after > ROUNDING_AMPLIFICATION * max(before, 1e-12):
            return F.Cause("introduced", f"{what} ({prev}) is within tolerance (rel_l2 "
                                         f"{F.format_float(before)}) and this capture differs by "
                                         f"rel_l2 {at_least}{F.format_float(after)}: far beyond an "
                                         "amplified rounding difference, the module computes "
                                         "otherwise", prev)
        start = _first_not_identical(comp, j)
        begins = "" if start == j else (
            f"; the runs first differ at {comp.key(start)} (within tolerance, rel_l2 "
            f"{F.format_float(float(comp.rel_l2[start]))}; the capture before it is identical)")
        return F.Cause("introduced", f"{what} ({prev}) is within tolerance but not identical "
                                     f"(rel_l2 {F.format_float(before)}; this capture "
                                     f"{at_least}{F.format_float(after)}): the module may amplify "
                                     f"a rounding difference{begins}", prev)
    if v in (F.MISSING_IN_REF, F.MISSING_IN_CAND, F.INCOMPLETE):
        return F.Cause("unknown", f"{what} ({prev}) could not be compared "
                                  f"({F.VERDICT_NAMES[v]})", prev)
    if i is not None and _unmeasured_below(comp, j, i):
        # the previous capture's bits differ by an amount nothing measures (its lower bound is
        # within tolerance): no evidence that it carries the difference this capture shows
        return F.Cause("introduced", f"{what} ({prev}) differs in its bits by an unmeasured "
                                     f"amount (rel_l2 >= {F.format_float(float(comp.rel_l2[j]))}, "
                                     "within tolerance as far as it is known) and this capture "
                                     f"differs by rel_l2 {F.format_float(float(comp.rel_l2[i]))}"
                                     ": the difference most likely arises here", prev)
    return F.Cause("inherited", f"{what} ({prev}) already differs "
                                f"({F.VERDICT_NAMES[v]})", prev)


def _first_not_identical(comp: Comparison, j: int) -> int:
    """The earliest of the unbroken run of captures within tolerance but not identical that
    ends at key j, walking back in execution order: where a small difference first shows (a
    module that computes almost the same, found by the capture after it breaching). Key j itself
    unless that run starts at an identical capture; no claim where it starts otherwise."""
    start, k = j, int(comp.pred[j])
    while k >= 0 and comp.verdict[k] == F.CLOSE:
        start, k = k, int(comp.pred[k])
    return start if k >= 0 and comp.verdict[k] == F.IDENTICAL else j


def _unmeasured_below(comp: Comparison, j: int, i: int) -> bool:
    """Key j breaches only as uncertain, on a lower bound within its threshold, while key i is
    a certain breach far beyond any amplified rounding of that bound."""
    if not (comp.uncertain[j] and not comp.uncertain[i] and _bound_only(comp, j)):
        return False
    before, after = float(comp.rel_l2[j]), float(comp.rel_l2[i])
    return (np.isfinite(before) and np.isfinite(after) and before <= float(comp.threshold[j])
            and after > ROUNDING_AMPLIFICATION * max(before, 1e-12))


def _block_start_cause(comp: Comparison, step: int) -> F.Cause:
    params = comp.step_keys(step, (Phase.PARAM,))
    if len(params):
        bad = params[comp.breach[params]]
        if len(bad):
            j = int(bad[np.argmin(comp.rank_in_order[bad])])
            return F.Cause("inherited", f"the step's parameters differ (first: {comp.key(j)})",
                           comp.key(j))
        return F.Cause("introduced", "first capture of its microbatch, and every parameter "
                                     "value of the step matched")
    excluded = excluded_by_policy(comp, step, (Phase.PARAM,))
    if excluded:
        return F.Cause("unknown", f"first capture of its microbatch; parameter values {excluded}"
                                  ", so the weights cannot be ruled out")
    return F.Cause("unknown", "first capture of its microbatch; parameter values were not "
                              "captured, so the weights cannot be ruled out")


def excluded_by_policy(comp: Comparison, step: int, phases: tuple[int, ...]) -> str:
    """"were captured but excluded by the policy (rule ...)" where every key of `step` in
    `phases` was excluded by the policy (there is at least one), else "": what tells "not
    captured" apart from "not compared" when a step has no compared key of those phases."""
    lo = int(np.searchsorted(comp.when, step << 24, "left"))
    hi = int(np.searchsorted(comp.when, (step + 1) << 24, "left"))
    mine = np.isin(comp.when[lo:hi] & 0xF, phases)
    ignored = mine & (comp.verdict[lo:hi] == F.IGNORED)
    if not ignored.any() or (mine & ~ignored).any():
        return ""
    rules = ", ".join(comp.rule_labels[int(r)] for r in unique(comp.rule[lo:hi][ignored]))
    return f"were captured but excluded by the policy ({rules})"

def _grad_cause(comp: Comparison, i: int, step: int) -> F.Cause:
    site = comp.catalog.site_names.get(int(comp.where[i] >> 32), "")
    module = site.rsplit(".", 1)[0] if "." in site else ""
    bwd = comp.step_keys(step, (Phase.BWD,))
    mod_id = comp.catalog.site_id(module) if module else None
    mine = bwd[(comp.where[bwd] >> 32) == mod_id] if mod_id is not None else bwd[:0]
    if len(mine):
        bad = mine[comp.breach[mine]]
        if len(bad):
            j = int(bad[np.argmin(comp.rank_in_order[bad])])
            return F.Cause("inherited", f"its module's activation gradient differs "
                                        f"({comp.key(j)})", comp.key(j))
    act_phases = (Phase.FWD, Phase.BWD, Phase.LOSS, Phase.INPUT)
    act = comp.step_keys(step, act_phases)
    if not len(act):
        excluded = excluded_by_policy(comp, step, act_phases)
        if excluded:
            return F.Cause("unknown", f"the step's activations and activation gradients "
                                      f"{excluded}: let the policy compare phases fwd and bwd "
                                      "to locate it")
        return F.Cause("unknown", "no activation or activation gradient of the step was "
                                  "captured: capture phases fwd and bwd to locate it")
    bad = act[comp.breach[act]]
    if len(bad):
        j = int(bad[np.argmin(comp.rank_in_order[bad])])
        return F.Cause("inherited", f"activations of the step already differ (first: "
                                    f"{comp.key(j)})", comp.key(j))
    is_bwd = (comp.when[act] & 0xF) == Phase.BWD
    bwd_n = int(np.count_nonzero(is_bwd))
    fwd_n = len(act) - bwd_n
    close_fwd = int(np.count_nonzero(comp.verdict[act[~is_bwd]] == F.CLOSE))
    close_bwd = int(np.count_nonzero(comp.verdict[act[is_bwd]] == F.CLOSE))
    if bwd_n == 0:
        excluded = excluded_by_policy(comp, step, (Phase.BWD,))
        if excluded:
            return F.Cause("unknown", f"the {fwd_n} compared activations of the step match; "
                                      f"its activation gradients (phase bwd) {excluded}: let "
                                      f"the policy compare them around {module or 'the model'} "
                                      "to tell a backward difference from one in reduction, "
                                      "accumulation or scaling")
        return F.Cause("unknown", f"the {fwd_n} captured activations of the step match but "
                                  "no activation gradient was captured: capture phase bwd "
                                  f"around {module or 'the model'} to tell a backward "
                                  "difference from one in reduction, accumulation or "
                                  "scaling")
    prev = comp.key(int(mine[0])) if len(mine) else None
    own = (f" ({len(mine)} of them at {module} itself)" if len(mine) else
           f" (none at {module or 'its module'} itself)")
    if close_fwd or close_bwd:
        scaled = (f" (activation gradients compared after the x{F.format_float(comp.bwd_factor)}"
                  " the loss normalizations imply: equal only within tolerance)"
                  if comp.bwd_factor != 1.0 else "")
        return F.Cause("introduced", f"forward and backward activations match within "
                                     f"tolerance, gradients do not: {fwd_n} activations "
                                     f"({close_fwd} close, the rest identical) and {bwd_n} "
                                     f"activation gradients ({close_bwd} close) of the "
                                     f"step{own}{scaled}: reduction, accumulation or scaling, or a "
                                     "small difference the gradient sums up", prev)
    return F.Cause("introduced", f"forward and backward activations match, gradients do "
                                 f"not: all {fwd_n} activations and {bwd_n} activation "
                                 f"gradients of the step{own} are identical, so the "
                                 "difference arises in gradient reduction, accumulation or "
                                 "scaling", prev)


def _param_cause(comp: Comparison, i: int, step: int) -> F.Cause:
    if step == 0:
        return F.Cause("introduced", "the initial weights differ (initialization, seed or "
                                     "checkpoint loading)")
    site_id = int(comp.where[i] >> 32)
    role = int((comp.where[i] >> 28) & 0xF)
    g = comp.find(step - 1, -1, Phase.GRAD, site_id, role)
    p = comp.find(step - 1, -1, Phase.PARAM, site_id, role)
    for phase, what in (("update", "the update applied to it"),
                        ("optim_grad", "the gradient the optimizer consumed")):
        j = comp.find(step - 1, -1, PHASE_IDS[phase], site_id, role)
        if j >= 0 and comp.breach[j] and not _uncompared(comp, j):
            return F.Cause("inherited", f"{what} at step {step - 1} differs ({phase})",
                           comp.key(j))
    g_gap, p_gap = _uncompared(comp, g), _uncompared(comp, p)
    if not g_gap and comp.breach[g]:
        return F.Cause("inherited", f"its gradient at step {step - 1} differs", comp.key(g))
    if not p_gap and comp.breach[p]:
        return F.Cause("inherited", f"its value at step {step - 1} already differs", comp.key(p))
    if not g_gap and not p_gap:
        return F.Cause("introduced", f"its value and gradient matched at step {step - 1}: the "
                                     "optimizer update differs", comp.key(g))
    gaps = [f"its {what} at step {step - 1} {gap}" for what, gap in (("gradient", g_gap),
                                                                     ("value", p_gap)) if gap]
    if g_gap == p_gap:
        gaps = [f"its gradient and value at step {step - 1} {_plural(g_gap)}"]
    return F.Cause("unknown", " and ".join(gaps))


def _plural(predicate: str) -> str:
    return predicate.replace("was ", "were ", 1)
