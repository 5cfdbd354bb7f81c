"""Parent modules whose forward never ran in a pipeline stage while their children's did.

A pipeline stage built from a model calls the kept submodules itself: a stage cut from
transformers' `LlamaForCausalLM` runs `model.embed_tokens` and `model.layers.N` but never the
parent `model`'s forward, so the parent's own captures (`fwd model`, `bwd model`) are absent
from the pipelined run while every child it holds was captured. Nothing was lost: what the
parent computes is what its children output, and they are compared. Such a key is an expected
absence, not a breach (`unrun_parents`), its finding says why (`missing_detail`), and the
report says it once (`warning`). A parent missing while none of its children ran, or in a run
without pipeline stages, stays missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.wire.vocabulary import Phase

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison
    from numaudit.auditor.compare.merge.keys import LogicalKeys
    from numaudit.auditor.compare.read.columns import Catalog

ACTIVATION_PHASES = (Phase.FWD, Phase.BWD)
MEMO = "unrun_parents"
"""`Comparison.memo` entry: {key index: the side whose stages never ran the module}."""


def unrun_parents(A: np.ndarray, B: np.ndarray, ri: np.ndarray, ci: np.ndarray,
                  rk: LogicalKeys, ck: LogicalKeys, catalog: Catalog) -> dict[int, str]:
    """{key index: "ref" or "cand"} of the activation keys (fwd, bwd) absent from that run
    whose module has submodules that run captured in a pipeline stage (stage >= 0) at the same
    step, microbatch and phase."""
    out: dict[int, str] = {}
    acts = np.isin(A & 0xF, ACTIVATION_PHASES)
    for side, idx, lk in (("ref", ri, rk), ("cand", ci, ck)):
        miss = np.flatnonzero((idx < 0) & acts)
        if not len(miss) or not len(lk):
            continue
        held = np.flatnonzero(np.isin(lk.when, np.unique(A[miss])) & (lk.stage >= 0))
        if not len(held):
            continue
        inside: set[tuple[int, str]] = set()
        for a, site in set(zip(lk.when[held].tolist(), (lk.where[held] >> 32).tolist())):
            parts = catalog.site_names.get(site, "").split(".")
            inside.update((a, ".".join(parts[:n])) for n in range(1, len(parts)))
        for i in miss.tolist():
            name = catalog.site_names.get(int(B[i] >> 32), "")
            if name and (int(A[i]), name) in inside:
                out[i] = side
    return out


def missing_detail(comp: Comparison, i: int, side: str) -> str:
    """The detail of key i when it is such an absence ("" otherwise)."""
    if comp.memo.get(MEMO, {}).get(i) != side:
        return ""
    run = comp.ref.name if side == "ref" else comp.cand.name
    return (f"not captured in {run}: its pipeline stages never ran {comp.key(i).site}'s own "
            "forward, only its submodules' (compared on their own); expected, not a breach")


def warning(comp: Comparison) -> list[str]:
    """One warning per run naming the modules whose captures are absent for that reason."""
    out = []
    marked = comp.memo.get(MEMO, {})
    for side in ("ref", "cand"):
        keys = [i for i, s in marked.items() if s == side and comp.verdict[i] in (
            F.MISSING_IN_REF, F.MISSING_IN_CAND)]
        if not keys:
            continue
        run = comp.ref.name if side == "ref" else comp.cand.name
        sites = list(dict.fromkeys(comp.key(i).site for i in keys))
        shown = ", ".join(sites[:4]) + (f" and {len(sites) - 4} more" if len(sites) > 4 else "")
        out.append(f"{run}: {len(keys)} captures of {shown} are missing because {run}'s "
                   "pipeline stages call the submodules themselves and never run the parent's "
                   "forward (as a stage cut from a transformers model does); every submodule "
                   "of it that ran is compared, so these absences are expected, not breaches")
    return out
