"""Execution order of aligned keys, and each key's predecessor within its step block.

The first divergence is the earliest breaching key in this order; a key's predecessor is what
`causes` compares it against. Stage and position come from the candidate where it has the key.
"""

from __future__ import annotations

import numpy as np

from auditor.compare import findings as F
from auditor.compare.align import AFTER_BACKWARD_PHASES, PHASE_IDS, exec_order, fill_positions
from auditor.compare.columns import unpack_a
from auditor.compare.comparison import Comparison


def order_keys(comp: Comparison) -> None:
    """Execution order, predecessors (see auditor.compare.align)."""
    K = len(comp)
    if K == 0:
        return
    rk, ck = comp.ref_keys, comp.cand_keys
    hr, hc = comp.ri >= 0, comp.ci >= 0
    step, mb, phase = unpack_a(comp.A)
    site = comp.B >> 32
    # stage the key ran in: the candidate's; for keys it lacks, the candidate's stage of the site
    cand_stage = np.where(hc, ck.stage[np.maximum(comp.ci, 0)] if len(ck) else -1, -1)
    site_stage = np.full(int(site.max()) + 1, -1, np.int64)
    if hc.any():
        site_stage[site[hc]] = cand_stage[hc]
    ref_stage = np.where(hr, rk.stage[np.maximum(comp.ri, 0)] if len(rk) else -1, -1)
    stage = np.where(hc, cand_stage, np.where(site_stage[site] >= 0, site_stage[site], ref_stage))
    ref_pos = np.where(hr, rk.pos[np.maximum(comp.ri, 0)] if len(rk) else 0, 0).astype(np.float64)
    ref_pos[~hr] = np.nan
    cand_pos = np.where(hc, ck.pos[np.maximum(comp.ci, 0)] if len(ck) else 0, 0).astype(np.float64)
    cand_pos[~hc] = np.nan
    if hr.all():
        pos = ref_pos
    else:  # place candidate-only keys within their (step, microbatch, phase, stage) group
        g_order = np.lexsort((stage, comp.A))
        ga, gs = comp.A[g_order], stage[g_order]
        gnew = np.ones(K, bool)
        gnew[1:] = (ga[1:] != ga[:-1]) | (gs[1:] != gs[:-1])
        group = np.empty(K, np.int64)
        group[g_order] = np.cumsum(gnew) - 1
        pos = fill_positions(group, cand_pos, ref_pos)
    order = exec_order(step, mb, phase, stage, pos)
    comp.order = order
    comp.rank_in_order = np.empty(K, np.int64)
    comp.rank_in_order[order] = np.arange(K)
    comp.order_stage = stage
    # predecessor: previous non-ignored key in order within the same step block
    seq = order[comp.verdict[order] != F.IGNORED]
    blk_mb = mb[seq].copy()
    blk_mb[phase[seq] == PHASE_IDS["param"]] = -(1 << 40)
    blk_mb[np.isin(phase[seq], AFTER_BACKWARD_PHASES)] = 1 << 40
    same = np.zeros(len(seq), bool)
    if len(seq) > 1:
        same[1:] = (step[seq][1:] == step[seq][:-1]) & (blk_mb[1:] == blk_mb[:-1])
    pred = np.full(K, -1, np.int64)
    pred[seq[1:][same[1:]]] = seq[:-1][same[1:]]
    comp.pred = pred
