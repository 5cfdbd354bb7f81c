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
from auditor.compare.align import PHASE_IDS

if TYPE_CHECKING:
    from auditor.compare.comparison import Comparison



def cause(comp: Comparison, i: int) -> F.Cause:
    step = int(comp.A[i] >> 24)
    phase = int(comp.A[i] & 0xF)
    if phase == PHASE_IDS["input"]:
        return F.Cause("introduced", "the input batch itself differs (data loading, sampler "
                                     "or microbatch split)")
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
    if p >= 0:
        return _judged(comp, p, "the previous capture in execution order", i)
    return _block_start_cause(comp, step)

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
        return F.Cause("introduced", f"every activation gradient of {module} matched in this "
                                     "step: the difference arises in gradient accumulation, "
                                     "reduction or scaling", comp.key(int(mine[0])))
    act = comp.step_keys(step, (PHASE_IDS["fwd"], PHASE_IDS["bwd"], PHASE_IDS["loss"],
                                 PHASE_IDS["input"]))
    if len(act):
        bad = act[comp.breach[act]]
        if len(bad):
            j = int(bad[np.argmin(comp.rank_in_order[bad])])
            return F.Cause("inherited", f"activations of the step already differ (first: "
                                        f"{comp.key(j)})", comp.key(j))
        bwd_n = int(np.count_nonzero((comp.A[act] & 0xF) == PHASE_IDS["bwd"]))
        fwd_n = len(act) - bwd_n
        close_n = int(np.count_nonzero(comp.verdict[act] == F.CLOSE))
        if bwd_n == 0:
            return F.Cause("unknown", f"the {fwd_n} captured activations of the step match but "
                                      "no activation gradient was captured: capture phase bwd "
                                      f"around {module or 'the model'} to tell a backward "
                                      "difference from one in reduction, accumulation or "
                                      "scaling")
        if close_n:
            return F.Cause("introduced", f"{fwd_n} activations and {bwd_n} activation gradients "
                                         f"of the step are within tolerance ({close_n} only "
                                         "close, not identical), parameter gradients are not: "
                                         "reduction, accumulation or scaling, or a small "
                                         "difference the gradient sums up")
        return F.Cause("introduced", f"forward and backward activations match, gradients do "
                                     f"not: all {fwd_n} activations and {bwd_n} activation "
                                     "gradients of the step are identical, so the difference "
                                     "arises in gradient reduction, accumulation or scaling")
    return F.Cause("unknown", "no activation or activation gradient of the step was captured: "
                              "capture phases fwd and bwd to locate it")

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
        differs = ("and differs as the optimizer consumed it: gradient clipping, unscaling or a "
                   "gradient transformation treated the runs differently")
    else:
        before, name = PHASE_IDS["optim_grad"], "optim_grad"
        differs = ("but the update applied differs: learning rate, optimizer state or the "
                   "update rule")
    j = comp.find(step, -1, before, site_id, role)
    if j < 0 or comp.verdict[j] == F.IGNORED:
        return F.Cause("unknown", f"phase {name} of this parameter was not captured in both "
                                  f"runs: capture it to tell where the difference arises")
    v = int(comp.verdict[j])
    if comp.breach[j]:
        return F.Cause("inherited", f"its {name} already differs ({F.VERDICT_NAMES[v]})",
                       comp.key(j))
    return F.Cause("introduced", f"its {name} matched ({F.VERDICT_NAMES[v]}) {differs}",
                   comp.key(j))


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
    for i, r, c, is_none, zd, z_ref in zip(idx.tolist(), ri.tolist(), ci.tolist(),
                                            none.tolist(), zero_diff.tolist(), zr.tolist()):
        site = site_names.get(int(comp.B[i] >> 32), "")
        stage = int(comp.order_stage[i])
        for side, present in (("ref", r >= 0), ("cand", c >= 0)):
            if present:
                totals_run[side].add(site)
                totals_stage.setdefault((side, stage), set()).add(site)
        step = int(comp.A[i] >> 24)
        if is_none:
            side = "cand" if ck.status[c] == M.NONE else "ref"
            entries.append((side, "none", stage, site, step))
        elif zd:
            entries.append(("ref" if z_ref == 1 else "cand", "zero", stage, site, step))
    breaks = F.group_graph_breaks(entries, totals_stage, totals_run, names)
    _add_boundary(comp, breaks)
    return breaks


def _add_boundary(comp, breaks: list[F.GraphBreak]) -> None:
    """Name where gradients stop: the first stage (in pipeline order) without parameter
    gradients, and whether its input activation's backward was captured."""
    for side, kind in (("cand", "none"), ("cand", "zero"), ("ref", "none"), ("ref", "zero")):
        mine = [b for b in breaks if b.side == side and b.kind == kind]
        if not mine:
            continue
        what = "parameter gradients" if kind == "none" else "non-zero parameter gradients"
        keys = comp.cand_keys if side == "cand" else comp.ref_keys
        run = (comp.cand if side == "cand" else comp.ref).name
        stages = sorted({b.stage for b in mine if b.stage is not None and b.stage >= 0})
        in_stage = keys.stage == stages[0] if stages else np.ones(len(keys), bool)
        where = f"stage {stages[0]}" if stages else "the model"
        phase = keys.A & 0xF
        bwd = in_stage & (phase == PHASE_IDS["bwd"]) & (keys.status == M.OK)
        fwd = np.flatnonzero(in_stage & (phase == PHASE_IDS["fwd"]))
        text = f"gradients stop at {where} (the first without {what} in {run})"
        later = stages[0] + 1 if stages else None
        if later is not None and later not in stages and (keys.stage == later).any():
            text += (f", at the stage {stages[0]} -> {later} boundary (stage {later}'s parameters "
                     "received gradients)")
        any_bwd = ((keys.A & 0xF) == PHASE_IDS["bwd"]).any()
        if not any_bwd:
            text += (f"; {run} captured no activation gradients (phase bwd), so whether backward "
                     "reached the stage cannot be told: capture bwd to locate the cut")
        elif len(fwd):
            # the stage's input activation: its earliest forward capture
            first = fwd[np.argmin(keys.pos[fwd])]
            site_id = int(keys.B[first] >> 32)
            site = comp.catalog.site_names.get(site_id, "?")
            back = bwd & ((keys.B >> 32) == site_id)
            if back.any():
                text += (f": the backward of its input activation ({site}) was captured, so "
                         "gradients reached the stage but its parameters received none (a skipped "
                         "weight-gradient step, or gradients dropped or freed before capture)")
            elif bwd.any():
                text += (f": {int(bwd.sum())} activation gradients were captured in it but not the "
                         f"backward of its input activation ({site})")
            else:
                text += (f": no activation gradient was captured in it, not even for its input "
                         f"activation ({site}): backward never reached it")
        elif bwd.any():
            text += f": {int(bwd.sum())} activation gradients were captured in it"
        else:
            text += ": no activation gradient was captured in it either"
        target = next((b for b in mine if b.scope in ("run", "stage")), mine[0])
        target.boundary = text
