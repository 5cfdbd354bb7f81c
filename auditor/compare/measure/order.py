"""Execution order of aligned keys, and each key's predecessor within its step block.

The first divergence is the earliest breaching key in this order; a key's predecessor is what
`causes` compares it against. Stage comes from the candidate where it has the key. Positions
within a (step, microbatch, phase, stage) group are the agents' capture numbers
(`positions.key_positions`), read in the reference's frame, keys only the candidate has placed
after their predecessor in the candidate's own order (`align.fill_positions`); the candidate's
frame is taken when only its records are numbered. A run whose records carry no capture numbers
(stored by an agent before them) is ordered by record ids, storage order, and the report says
so once (`APPROXIMATED`).
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import Comparison
from numaudit.auditor.compare.read.align import (
    AFTER_BACKWARD_PHASES,
    exec_order,
    fill_positions,
)
from numaudit.auditor.compare.read.columns import unpack_when
from numaudit.wire.vocabulary import Phase

APPROXIMATED = "execution order is approximated by storage order"
"""How the warning about runs without capture numbers starts (`auditor watch` shows it too)."""


def order_keys(comp: Comparison) -> None:
    """Execution order, predecessors (see auditor.compare.read.align)."""
    K = len(comp)
    if K == 0:
        return
    rk, ck = comp.ref_keys, comp.cand_keys
    hr, hc = comp.ref_index >= 0, comp.cand_index >= 0
    step, mb, phase = unpack_when(comp.when)
    site = comp.where >> 32
    # stage the key ran in: the candidate's; for keys it lacks, the candidate's stage of the site
    cand_stage = _stage_of(ck, comp.cand_index, hc, site)
    ref_stage = _stage_of(rk, comp.ref_index, hr, site)
    stage = np.where(hc | (cand_stage >= 0), cand_stage, ref_stage)
    ref_pos = np.where(hr, rk.pos[np.maximum(comp.ref_index, 0)] if len(rk) else 0, np.nan)
    cand_pos = np.where(hc, ck.pos[np.maximum(comp.cand_index, 0)] if len(ck) else 0, np.nan)
    # the frame: the reference's positions, unless only the candidate's are capture numbers
    if rk.numbered or not ck.numbered:
        frame, own, frame_stage, has = ref_pos, cand_pos, ref_stage, hr
    else:
        frame, own, frame_stage, has = cand_pos, ref_pos, cand_stage, hc
    _warn_unnumbered(comp, has)
    if has.all():
        pos = frame
    else:  # place the other run's keys within their (step, microbatch, phase, stage) group
        g_order = np.lexsort((stage, comp.when))
        ga, gs = comp.when[g_order], stage[g_order]
        gnew = np.ones(K, bool)
        gnew[1:] = (ga[1:] != ga[:-1]) | (gs[1:] != gs[:-1])
        group = np.empty(K, np.int64)
        group[g_order] = np.cumsum(gnew) - 1
        pos = fill_positions(group, own, frame)
        frame_stage = _carried(group, own, has, frame_stage)
    # the frame run's own stage orders keys of one stage of the candidate that ran in several
    # of its stages (positions of different stages come from different ranks' clocks)
    order = exec_order(step, mb, phase, stage, pos, frame_stage)
    comp.order = order
    comp.rank_in_order = np.empty(K, np.int64)
    comp.rank_in_order[order] = np.arange(K)
    comp.order_stage = stage
    # predecessor: previous non-ignored key in order within the same step block
    seq = order[comp.verdict[order] != F.IGNORED]
    blk_mb = mb[seq].copy()
    blk_mb[phase[seq] == Phase.PARAM] = -(1 << 40)
    blk_mb[np.isin(phase[seq], AFTER_BACKWARD_PHASES)] = 1 << 40
    same = np.zeros(len(seq), bool)
    if len(seq) > 1:
        same[1:] = (step[seq][1:] == step[seq][:-1]) & (blk_mb[1:] == blk_mb[:-1])
    pred = np.full(K, -1, np.int64)
    pred[seq[1:][same[1:]]] = seq[:-1][same[1:]]
    comp.pred = pred


def _stage_of(keys, idx: np.ndarray, has: np.ndarray, site: np.ndarray) -> np.ndarray:
    """Per aligned key: the stage one run captured it in; for keys it lacks, its stage of the
    same site (-1: none)."""
    stage = np.where(has, keys.stage[np.maximum(idx, 0)] if len(keys) else -1, -1).astype(np.int64)
    site_stage = np.full(int(site.max()) + 1, -1, np.int64)
    if has.any():
        site_stage[site[has]] = stage[has]
    return np.where(has, stage, site_stage[site])


def _carried(group: np.ndarray, own: np.ndarray, has: np.ndarray,
             values: np.ndarray) -> np.ndarray:
    """``values`` of the keys the frame run has; for the others, the value of the key they are
    placed after (`align.fill_positions`: the nearest one before it in its own run's order, in
    its group, that the frame run has), or of the group's first such key when none is before."""
    out = values.copy()
    if has.all():
        return out
    n = len(group)
    order = np.lexsort((own, group))
    g, known = group[order], has[order]
    idx = np.arange(n)
    starts = np.r_[True, g[1:] != g[:-1]]
    seg_start = np.flatnonzero(starts)[np.cumsum(starts) - 1]
    ends = np.r_[g[1:] != g[:-1], True]
    seg_end = np.flatnonzero(ends)[np.cumsum(starts) - 1]
    last = np.maximum.accumulate(np.where(known, idx, -1))
    nxt = np.minimum.accumulate(np.where(known, idx, n)[::-1])[::-1]
    src = np.where(last >= seg_start, last, np.where(nxt <= seg_end, nxt, -1))
    v = values[order]
    carried = np.where(src >= 0, v[np.maximum(src, 0)], -1)
    out[order] = np.where(known, v, carried)
    return out


def _warn_unnumbered(comp: Comparison, frame_has: np.ndarray) -> None:
    """One warning when execution order rests on record ids: the frame run's records carry no
    capture numbers, or keys only the other run has are placed by its storage order."""
    rk, ck = comp.ref_keys, comp.cand_keys
    names = {"ref": comp.ref.name, "cand": comp.cand.name}
    frame_side = "ref" if rk.numbered or not ck.numbered else "cand"
    other = "cand" if frame_side == "ref" else "ref"
    keys = {"ref": rk, "cand": ck}
    runs = []
    if not keys[frame_side].numbered and frame_has.any():
        runs.append(names[frame_side])
    if not keys[other].numbered and not frame_has.all():
        runs.append(names[other])
    if not runs:
        return
    which = (f"run {runs[0]!r}" if len(runs) == 1 else
             f"runs {runs[0]!r} and {runs[1]!r}")
    comp.catalog.warn(
        f"{APPROXIMATED} (record ids) for {which}: {'its' if len(runs) == 1 else 'their'} "
        "records carry no capture order (stored by an agent of an earlier build), so the first "
        "divergence, causes and heatmap rows may not follow the order the hooks fired; re-run "
        "with a current agent")
