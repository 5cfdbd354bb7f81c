"""Where backward graphs break: gradients that are None or all zero in one run, from the evidence.

`graph_breaks` groups parameter gradients (phase grad) that are None, or all zero in one run
only, by run, stage and module (`auditor.compare.measure.findings.group_graph_breaks`), and names
for each group where the gradients stop: the stage boundary backward reaches without gradients, or
what a module's activation gradients show (a cut before it, frozen parameters, a module deeper
than the agent's max_depth or not hooked). It reads a filled `Comparison`.
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.read.align import site_module
from numaudit.auditor.compare.read.ranges import format_ranges
from numaudit.wire.labels import BLOCK_DEPTH_LABEL, BLOCK_LISTS_LABEL, CAPTURE_DEPTH_LABEL
from numaudit.wire.vocabulary import Phase


def graph_breaks(comp) -> list[F.GraphBreak]:
    """Group grad_none and all-zero parameter gradients (GRAD phase) by run, stage and module."""
    grad = Phase.GRAD
    is_grad = grad == (comp.when & 0xF)
    if not is_grad.any():
        return []
    rk, ck = comp.ref_keys, comp.cand_keys
    names = {"ref": comp.ref.name, "cand": comp.cand.name}
    site_names = comp.catalog.site_names
    idx = np.flatnonzero(is_grad & (comp.verdict != F.IGNORED))
    ri, ci = comp.ref_index[idx], comp.cand_index[idx]
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
        site = site_names.get(int(comp.where[i] >> 32), "")
        stage = int(comp.order_stage[i])
        for side, present in (("ref", r >= 0), ("cand", c >= 0)):
            if present:
                totals_run[side].add(site)
                totals_stage.setdefault((side, stage), set()).add(site)
                totals_module.setdefault((side, site_module(site)), set()).add(site)
        step = int(comp.when[i] >> 24)
        if is_none:
            side = "cand" if ck.status[c] == M.NONE else "ref"
            entries.append((side, "none", stage, site, step))
        elif zd:
            entries.append(("ref" if z_ref == 1 else "cand", "zero", stage, site, step))
    breaks = F.group_graph_breaks(entries, totals_stage, totals_run, names, totals_module)
    _add_boundary(comp, breaks)
    return breaks


def gradients_none_in_both(comp) -> list[str]:
    """A warning for the steps whose compared parameter gradients are all None in both runs:
    they compare as identical, which says nothing of what backward computed. Gradients cleared
    (a `zero_grad()`) before they were captured look so, alike in both runs whatever differs."""
    idx = np.flatnonzero(((comp.when & 0xF) == Phase.GRAD) & (comp.verdict != F.IGNORED)
                         & (comp.ref_index >= 0) & (comp.cand_index >= 0))
    if not idx.size:
        return []
    none = comp.none_in_both(idx)
    steps = comp.when[idx] >> 24
    empty = [int(s) for s in np.unique(steps) if none[steps == s].all()]
    if not empty:
        return []
    n = int(np.isin(steps, empty).sum())
    return [f"every parameter gradient of step{'s' if len(empty) > 1 else ''} "
            f"{format_ranges(empty)} is None in both runs ({n} gradients): they compare as "
            "identical but show nothing of backward. If backward ran, the "
            "gradients were cleared (zero_grad) before they were captured: the agent captures "
            "them when the step block exits, or just before a torch.optim optimizer steps "
            "inside it; step any other optimizer after the block"]


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
    bwd = sites_mask & ((keys.when & 0xF) == Phase.BWD) & (keys.status == M.OK)
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
    in_module = np.isin(keys.where >> 32, site_ids)
    n, zero = _bwd_of(comp, keys, in_module)
    if n == 0:
        return _no_bwd_at(comp, keys, run, b.module, in_module)
    if zero == n:
        return (f"activation gradients arriving at {module} are all zero ({zero} of {n} bwd "
                f"captures in {run}): the graph is cut before it (a detach or a no_grad)")
    return (f"activation gradients reached {module} ({n - zero} of {n} bwd captures in {run} "
            "are not all zero): its parameters are frozen (requires_grad=False) or unused")


def _no_bwd_at(comp, keys, run: str, module: str, in_module: np.ndarray) -> str:
    """Why `run` holds no activation gradient of `module` (and its submodules): phase bwd was
    not captured at all, the module lies deeper than the agent's max_depth (the run label
    CAPTURE_DEPTH_LABEL), or the agent did not hook it. Only the first asks to capture bwd."""
    what = "to tell frozen parameters from a graph cut before the module"
    name = module or "(root)"
    if not ((keys.when & 0xF) == Phase.BWD).any():
        return (f"{run} captured no activation gradient (phase bwd) of {name}: capture bwd "
                f"{what}")
    labels = comp.labels.get("cand" if keys is comp.cand_keys else "ref", {})
    limit = labels.get(CAPTURE_DEPTH_LABEL, "")
    level = module.count(".") + 1 if module else 0
    fwd = int((in_module & ((keys.when & 0xF) == Phase.FWD)).sum())
    if limit.isdigit() and level > int(limit) and not fwd:  # (hooked inside a block: has fwd)
        deeper = (f"{run} captured activation gradients (phase bwd) of modules down to depth "
                  f"{limit} (the agent's max_depth) and {name} is at depth {level}")
        raise_depth = (f"max_depth to {level} (NUMAUDIT_DEPTH={level}; modules= can then narrow "
                       "the hooks to it)")
        block, inside = _enclosing_block(module, labels.get(BLOCK_LISTS_LABEL, ""))
        reach = labels.get(BLOCK_DEPTH_LABEL, "")
        if not (block and reach.isdigit()):
            return f"{deeper}, so it has none: raise {raise_depth} {what}"
        if inside > int(reach):
            return (f"{deeper}, {inside} levels inside the repeated block {block}, and the "
                    f"agent hooks {reach} inside each block (block_depth), so it has none: raise "
                    f"block_depth to {inside} (NUMAUDIT_BLOCK_DEPTH={inside}, that level in "
                    f"every block) or {raise_depth} {what}")
        # within block_depth of its block: it was in reach, so it was not hooked (below)
    if not module:
        return (f"{run} captured activation gradients (phase bwd) of submodules, but the root "
                "module is never hooked: nothing tells frozen parameters of its own from a "
                "graph cut before them")
    if fwd:
        return (f"{run} captured activation gradients (phase bwd) of other modules and the "
                f"forward of {name} ({fwd} fwd captures), but no gradient reached its output: "
                "it and everything before it take no gradient (frozen), or the graph is cut "
                "after it")
    return (f"{run} captured activation gradients (phase bwd) of other modules but neither the "
            f"forward nor the backward of {name}: the agent did not hook it (modules= or "
            f"exclude=) or it did not run, so hook it {what}")


def _enclosing_block(module: str, lists: str) -> tuple[str, int]:
    """(the outermost repeated block holding `module`, the levels `module` lies inside it), as
    the agent's block_depth counts them (agents/capture/sites.py); ("", 0) when no container
    in `lists` (BLOCK_LISTS_LABEL) holds it."""
    containers = set(lists.split(", ")) - {"", "..."}
    parts = module.split(".")
    for n in range(1, len(parts)):
        if ".".join(parts[:n]) in containers:
            return ".".join(parts[:n + 1]), len(parts) - n - 1
    return "", 0


def _stage_boundary(comp, cut: list[F.GraphBreak], keys, run: str, kind: str) -> str:
    what = "parameter gradients" if kind == "none" else "non-zero parameter gradients"
    stages = sorted({b.stage for b in cut if b.stage is not None and b.stage >= 0})
    stop = stages[-1] if stages else None  # the first stage backward reaches without them
    in_stage = keys.stage == stop if stages else np.ones(len(keys), bool)
    where = f"stage {stop}" if stages else "the model"
    phase = keys.when & 0xF
    bwd = in_stage & (phase == Phase.BWD) & (keys.status == M.OK)
    fwd = np.flatnonzero(in_stage & (phase == Phase.FWD))
    before = (f", as backward runs the stages last to first; stages {stages[0]}-{stop} are all "
              "without them" if len(stages) > 1 else "")
    text = f"gradients stop at {where} (the first without {what} in {run}{before})"
    later = stages[-1] + 1 if stages else None
    if later is not None and later not in stages and (keys.stage == later).any():
        text += (f", at the stage {stop} -> {later} boundary (stage {later}'s parameters "
                 "received gradients)")
    n_bwd, n_zero = _bwd_of(comp, keys, in_stage)
    if not ((keys.when & 0xF) == Phase.BWD).any():
        return text + (f"; {run} captured no activation gradients (phase bwd), so whether "
                       "backward reached the stage cannot be told: capture bwd to locate the cut")
    if n_bwd and n_zero == n_bwd:
        return text + (f": activation gradients arriving at {where} are all zero ({n_zero} of "
                       f"{n_bwd} bwd captures): the graph is cut at the boundary (a detach or a "
                       "no_grad)")
    if len(fwd):
        # the stage's input activation: its earliest forward capture
        first = fwd[np.argmin(keys.pos[fwd])]
        site_id = int(keys.where[first] >> 32)
        site = comp.catalog.site_names.get(site_id, "?")
        back = bwd & (site_id == (keys.where >> 32))
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
