"""Why a key diverged, and where backward graphs break: causes from the captured evidence.

`cause` says whether a diverged key introduced its difference or inherited it (its input, the
previous capture in execution order, the step's parameters, its module's activation gradients);
`graph_breaks` groups gradients that are None or all zero in one run by run, stage and module
and names the stage boundary where they stop. Both read a filled `Comparison`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from auditor.compare import findings as F
from auditor.compare import merge as M
from auditor.compare.align import PHASE_IDS, site_module
from auditor.compare.ranks import key_boxes
from wire.labels import BATCH_STATS_LABEL, DROPOUT_LABEL
from auditor.compare.segments import unique

if TYPE_CHECKING:
    from auditor.compare.comparison import Comparison



def cause(comp: Comparison, i: int) -> F.Cause:
    found = _cause(comp, i)
    if found.kind == "introduced" and int(comp.A[i] & 0xF) == PHASE_IDS["fwd"]:
        site = comp.key(i).site
        note = _batch_stats_note(comp, site) or _dropout_note(comp, site)
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
    step = int(comp.A[i] >> 24)
    phase = int(comp.A[i] & 0xF)
    if int(comp.verdict[i]) == F.REPLICA_DIVERGENCE:
        return _replica_cause(comp, i)
    if phase == PHASE_IDS["input"]:
        return _input_cause(comp, i)
    if phase == PHASE_IDS["param"]:
        return _param_cause(comp, i, step)
    if phase == PHASE_IDS["grad"]:
        return _grad_cause(comp, i, step)
    if phase in (PHASE_IDS["optim_grad"], PHASE_IDS["update"]):
        return _optimizer_cause(comp, i, step, phase)
    key = comp.key(i)
    if key.role == "output":
        site_id = int(comp.B[i] >> 32)
        j = comp.find(step, key.microbatch, phase, site_id, 2, key.index, key.call)
        if j < 0 and key.index:
            j = comp.find(step, key.microbatch, phase, site_id, 2, 0, key.call)
        if j >= 0 and comp.verdict[j] != F.IGNORED:
            return _judged(comp, j, "its input", i)
    p = int(comp.pred[i])
    if phase == PHASE_IDS["bwd"]:
        zero = _zero_cut(comp, i, p)
        if zero is not None:
            return zero
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
    from auditor.compare.ranges import format_ranges
    from auditor.compare.ranks import key_boxes, varying_dims

    key = comp.key(i)
    ri, ci = int(comp.ri[i]), int(comp.ci[i])
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
                 "them is missing or wrong (an all-reduce); the ranks registered no mesh "
                 "coordinates, so the mesh dim cannot be named (pass the device mesh to attach)")
    p = int(comp.pred[i])
    if p >= 0 and int(comp.verdict[p]) == F.REPLICA_DIVERGENCE:
        return F.Cause("inherited", f"{text}; the previous capture in execution order "
                                    f"({comp.key(p)}) already has diverging replicas",
                       comp.key(p))
    return F.Cause("introduced", text, comp.key(p) if p >= 0 else None)


def _zero_cut(comp: Comparison, i: int, p: int) -> F.Cause | None:
    """An activation gradient that is all zero in one run only: backward was cut before it."""
    ri, ci = int(comp.ri[i]), int(comp.ci[i])
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

ROUNDING_AMPLIFICATION = 100.0
"""A module 'amplifies a rounding difference' only while its own difference stays within this
many times its predecessor's; beyond, the evidence says the module itself computes otherwise."""


def _judged(comp: Comparison, j: int, what: str, i: int | None = None) -> F.Cause:
    prev = comp.key(j)
    v = int(comp.verdict[j])
    if v == F.IDENTICAL:
        return F.Cause("introduced", f"{what} ({prev}) is identical", prev)
    if v == F.CLOSE:
        before, after = float(comp.rel_l2[j]), float(comp.rel_l2[i]) if i is not None else np.nan
        if np.isfinite(before) and np.isfinite(after) and \
                after > ROUNDING_AMPLIFICATION * max(before, 1e-12):
            return F.Cause("introduced", f"{what} ({prev}) is within tolerance (rel_l2 "
                                         f"{F.format_float(before)}) and this capture differs by "
                                         f"rel_l2 {F.format_float(after)}: far beyond an amplified "
                                         "rounding difference, the module computes otherwise", prev)
        return F.Cause("introduced", f"{what} ({prev}) is within tolerance but not identical "
                                     f"(rel_l2 {F.format_float(before)}; this capture "
                                     f"{F.format_float(after)}): the module may amplify a "
                                     "rounding difference", prev)
    if v in (F.MISSING_IN_REF, F.MISSING_IN_CAND, F.INCOMPLETE):
        return F.Cause("unknown", f"{what} ({prev}) could not be compared "
                                  f"({F.VERDICT_NAMES[v]})", prev)
    return F.Cause("inherited", f"{what} ({prev}) already differs "
                                f"({F.VERDICT_NAMES[v]})", prev)


def _block_start_cause(comp: Comparison, step: int) -> F.Cause:
    params = comp.step_keys(step, (PHASE_IDS["param"],))
    if len(params):
        bad = params[comp.breach[params]]
        if len(bad):
            j = int(bad[np.argmin(comp.rank_in_order[bad])])
            return F.Cause("inherited", f"the step's parameters differ (first: {comp.key(j)})",
                           comp.key(j))
        return F.Cause("introduced", "first capture of its microbatch, and every parameter "
                                     "value of the step matched")
    return F.Cause("unknown", "first capture of its microbatch; parameter values were not "
                              "captured, so the weights cannot be ruled out")

def _grad_cause(comp: Comparison, i: int, step: int) -> F.Cause:
    site = comp.catalog.site_names.get(int(comp.B[i] >> 32), "")
    module = site.rsplit(".", 1)[0] if "." in site else ""
    bwd = comp.step_keys(step, (PHASE_IDS["bwd"],))
    mod_id = comp.catalog.site_id(module) if module else None
    mine = bwd[(comp.B[bwd] >> 32) == mod_id] if mod_id is not None else bwd[:0]
    if len(mine):
        bad = mine[comp.breach[mine]]
        if len(bad):
            j = int(bad[np.argmin(comp.rank_in_order[bad])])
            return F.Cause("inherited", f"its module's activation gradient differs "
                                        f"({comp.key(j)})", comp.key(j))
    act = comp.step_keys(step, (PHASE_IDS["fwd"], PHASE_IDS["bwd"], PHASE_IDS["loss"],
                                 PHASE_IDS["input"]))
    if not len(act):
        return F.Cause("unknown", "no activation or activation gradient of the step was "
                                  "captured: capture phases fwd and bwd to locate it")
    bad = act[comp.breach[act]]
    if len(bad):
        j = int(bad[np.argmin(comp.rank_in_order[bad])])
        return F.Cause("inherited", f"activations of the step already differ (first: "
                                    f"{comp.key(j)})", comp.key(j))
    is_bwd = (comp.A[act] & 0xF) == PHASE_IDS["bwd"]
    bwd_n = int(np.count_nonzero(is_bwd))
    fwd_n = len(act) - bwd_n
    close_fwd = int(np.count_nonzero(comp.verdict[act[~is_bwd]] == F.CLOSE))
    close_bwd = int(np.count_nonzero(comp.verdict[act[is_bwd]] == F.CLOSE))
    if bwd_n == 0:
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
    site_id = int(comp.B[i] >> 32)
    role = int((comp.B[i] >> 28) & 0xF)
    g = comp.find(step - 1, -1, PHASE_IDS["grad"], site_id, role)
    p = comp.find(step - 1, -1, PHASE_IDS["param"], site_id, role)
    for phase, what in (("update", "the update applied to it"),
                        ("optim_grad", "the gradient the optimizer consumed")):
        j = comp.find(step - 1, -1, PHASE_IDS[phase], site_id, role)
        if j >= 0 and comp.breach[j]:
            return F.Cause("inherited", f"{what} at step {step - 1} differs ({phase})",
                           comp.key(j))
    if g >= 0 and comp.breach[g]:
        return F.Cause("inherited", f"its gradient at step {step - 1} differs", comp.key(g))
    if p >= 0 and comp.breach[p]:
        return F.Cause("inherited", f"its value at step {step - 1} already differs", comp.key(p))
    if g >= 0 and p >= 0:
        return F.Cause("introduced", f"its value and gradient matched at step {step - 1}: the "
                                     "optimizer update differs", comp.key(g))
    return F.Cause("unknown", f"its gradient or value at step {step - 1} was not captured")


def _optimizer_cause(comp: Comparison, i: int, step: int, phase: int) -> F.Cause:
    """optim_grad against the gradient after backward; update against what the optimizer got."""
    site_id = int(comp.B[i] >> 32)
    role = int((comp.B[i] >> 28) & 0xF)
    if phase == PHASE_IDS["optim_grad"]:
        before, name = PHASE_IDS["grad"], "grad"
    else:
        before, name = PHASE_IDS["optim_grad"], "optim_grad"
    j = comp.find(step, -1, before, site_id, role)
    if j < 0 or comp.verdict[j] == F.IGNORED:
        return F.Cause("unknown", f"phase {name} of this parameter was not captured in both "
                                  f"runs: capture it to tell where the difference arises")
    v = int(comp.verdict[j])
    if comp.breach[j]:
        return F.Cause("inherited", f"its {name} already differs ({F.VERDICT_NAMES[v]})",
                       comp.key(j))
    if phase == PHASE_IDS["update"]:
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
    keys = comp.step_keys(step, (PHASE_IDS["optim_grad"],))
    # None or all-zero gradients are identical under any factor: they say nothing about it
    ri = comp.ri[keys]
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
    for g, f in zip(comp.ci[keys].tolist(), factor.tolist()):
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


# -- graph breaks ------------------------------------------------------------------------------------

def graph_breaks(comp) -> list[F.GraphBreak]:
    """Group grad_none and all-zero parameter gradients (GRAD phase) by run, stage and module."""
    grad = PHASE_IDS["grad"]
    is_grad = (comp.A & 0xF) == grad
    if not is_grad.any():
        return []
    rk, ck = comp.ref_keys, comp.cand_keys
    names = {"ref": comp.ref.name, "cand": comp.cand.name}
    site_names = comp.catalog.site_names
    idx = np.flatnonzero(is_grad & (comp.verdict != F.IGNORED))
    ri, ci = comp.ri[idx], comp.ci[idx]
    both_ok = (ri >= 0) & (ci >= 0)
    zr = np.where(both_ok, rk.all_zero[np.maximum(ri, 0)] if len(rk) else -1, -1)
    zc = np.where(both_ok, ck.all_zero[np.maximum(ci, 0)] if len(ck) else -1, -1)
    zero_diff = both_ok & (zr >= 0) & (zc >= 0) & (zr != zc) & (comp.verdict[idx] != F.GRAD_NONE)
    none = comp.verdict[idx] == F.GRAD_NONE
    if not (none.any() or zero_diff.any()):  # the common case: nothing to group
        return []
    entries: list[tuple] = []
    totals_stage: dict[tuple, set[str]] = {}
    totals_run: dict[str, set[str]] = {"ref": set(), "cand": set()}
    totals_module: dict[tuple[str, str], set[str]] = {}
    for i, r, c, is_none, zd, z_ref in zip(idx.tolist(), ri.tolist(), ci.tolist(),
                                            none.tolist(), zero_diff.tolist(), zr.tolist()):
        site = site_names.get(int(comp.B[i] >> 32), "")
        stage = int(comp.order_stage[i])
        for side, present in (("ref", r >= 0), ("cand", c >= 0)):
            if present:
                totals_run[side].add(site)
                totals_stage.setdefault((side, stage), set()).add(site)
                totals_module.setdefault((side, site_module(site)), set()).add(site)
        step = int(comp.A[i] >> 24)
        if is_none:
            side = "cand" if ck.status[c] == M.NONE else "ref"
            entries.append((side, "none", stage, site, step))
        elif zd:
            entries.append(("ref" if z_ref == 1 else "cand", "zero", stage, site, step))
    breaks = F.group_graph_breaks(entries, totals_stage, totals_run, names, totals_module)
    _add_boundary(comp, breaks)
    return breaks


def _add_boundary(comp, breaks: list[F.GraphBreak]) -> None:
    """Name where gradients stop, from the captured evidence.

    A break of a whole run or stage: for each run of consecutive stages without parameter
    gradients, its last stage in pipeline order, the first one backward reaches (it runs the
    stages last to first, whatever ranks hold them: a V schedule puts stages 0 and 3 of four on
    one rank), and what that stage's activation gradients show (all zero: a cut at its boundary
    with the next stage; its input activation's backward captured: backward reached it; none
    captured). The stages before it lack gradients because nothing flows back past it. A break
    of some modules only, while other parameters got gradients: those modules' own evidence
    (frozen or unused, or a cut before them when their activation gradients are all zero)."""
    for side, kind in (("cand", "none"), ("cand", "zero"), ("ref", "none"), ("ref", "zero")):
        mine = [b for b in breaks if b.side == side and b.kind == kind]
        if not mine:
            continue
        keys = comp.cand_keys if side == "cand" else comp.ref_keys
        run = (comp.cand if side == "cand" else comp.ref).name
        for b in mine:
            if b.scope == "module":
                b.boundary = _module_boundary(comp, b, keys, run)
        for group in _consecutive_stages([b for b in mine if b.scope in ("run", "stage")]):
            group[-1].boundary = _stage_boundary(comp, group, keys, run, kind)


def _consecutive_stages(cut: list[F.GraphBreak]) -> list[list[F.GraphBreak]]:
    """Whole-stage breaks in runs of consecutive stages, each in stage order (a whole-run
    break, without a stage, alone)."""
    groups: list[list[F.GraphBreak]] = []
    for b in sorted(cut, key=lambda b: (b.stage is None, b.stage if b.stage is not None else 0)):
        last = groups[-1][-1] if groups else None
        if (last is not None and b.stage is not None and last.stage is not None
                and b.stage >= 0 and b.stage == last.stage + 1):
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def _bwd_of(comp, keys, sites_mask: np.ndarray) -> tuple[int, int]:
    """(captured, all zero) activation gradients (phase bwd, merged) among the masked keys."""
    bwd = sites_mask & ((keys.A & 0xF) == PHASE_IDS["bwd"]) & (keys.status == M.OK)
    return int(bwd.sum()), int((bwd & (keys.all_zero == 1)).sum())


def _module_boundary(comp, b: F.GraphBreak, keys, run: str) -> str:
    module = b.module or "(root)"
    if b.total_params > b.params:
        return (f"the other {b.total_params - b.params} parameters of {module} received "
                f"gradients in {run}, so backward reached the module and the graph is not cut "
                f"there: the {b.params} without were frozen (requires_grad=False) or unused in "
                f"{run}'s forward, or their weight gradients were never computed or were "
                "dropped (a split backward's weight step); the captures cannot tell which")
    site_ids = np.array([sid for sid, name in comp.catalog.site_names.items()
                         if name == b.module or name.startswith(b.module + ".")], np.int64)
    n, zero = _bwd_of(comp, keys, np.isin(keys.B >> 32, site_ids))
    if n == 0:
        return (f"{run} captured no activation gradient (phase bwd) of {module}: capture bwd to "
                "tell frozen parameters from a graph cut before the module")
    if zero == n:
        return (f"activation gradients arriving at {module} are all zero ({zero} of {n} bwd "
                f"captures in {run}): the graph is cut before it (a detach or a no_grad)")
    return (f"activation gradients reached {module} ({n - zero} of {n} bwd captures in {run} "
            "are not all zero): its parameters are frozen (requires_grad=False) or unused")


def _stage_boundary(comp, cut: list[F.GraphBreak], keys, run: str, kind: str) -> str:
    what = "parameter gradients" if kind == "none" else "non-zero parameter gradients"
    stages = sorted({b.stage for b in cut if b.stage is not None and b.stage >= 0})
    stop = stages[-1] if stages else None  # the first stage backward reaches without them
    in_stage = keys.stage == stop if stages else np.ones(len(keys), bool)
    where = f"stage {stop}" if stages else "the model"
    phase = keys.A & 0xF
    bwd = in_stage & (phase == PHASE_IDS["bwd"]) & (keys.status == M.OK)
    fwd = np.flatnonzero(in_stage & (phase == PHASE_IDS["fwd"]))
    before = (f", as backward runs the stages last to first; stages {stages[0]}-{stop} are all "
              "without them" if len(stages) > 1 else "")
    text = f"gradients stop at {where} (the first without {what} in {run}{before})"
    later = stop + 1 if stages else None
    if later is not None and later not in stages and (keys.stage == later).any():
        text += (f", at the stage {stop} -> {later} boundary (stage {later}'s parameters "
                 "received gradients)")
    n_bwd, n_zero = _bwd_of(comp, keys, in_stage)
    if not ((keys.A & 0xF) == PHASE_IDS["bwd"]).any():
        return text + (f"; {run} captured no activation gradients (phase bwd), so whether "
                       "backward reached the stage cannot be told: capture bwd to locate the cut")
    if n_bwd and n_zero == n_bwd:
        return text + (f": activation gradients arriving at {where} are all zero ({n_zero} of "
                       f"{n_bwd} bwd captures): the graph is cut at the boundary (a detach or a "
                       "no_grad)")
    if len(fwd):
        # the stage's input activation: its earliest forward capture
        first = fwd[np.argmin(keys.pos[fwd])]
        site_id = int(keys.B[first] >> 32)
        site = comp.catalog.site_names.get(site_id, "?")
        back = bwd & ((keys.B >> 32) == site_id)
        if back.any():
            zeros = f"; {n_zero} of them all zero" if n_zero else ", none all zero"
            return text + (f": the backward of its input activation ({site}) was captured "
                           f"({n_bwd} activation gradients in the stage{zeros}), so gradients "
                           "reached the stage but its parameters received none (a skipped "
                           "weight-gradient step, or gradients dropped or freed before capture)")
        if bwd.any():
            return text + (f": {n_bwd} activation gradients were captured in it but not the "
                           f"backward of its input activation ({site})")
        return text + (f": no activation gradient was captured in it, not even for its input "
                       f"activation ({site}): backward never reached it")
    if bwd.any():
        return text + f": {n_bwd} activation gradients were captured in it"
    return text + ": no activation gradient was captured in it either"
