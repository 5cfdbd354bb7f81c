"""The activation gradients' scale (phase bwd): the factor the runs' loss normalizations imply
(`bwd_factor`), the one factor the evidence shows beyond it (`bwd_trial`), and what a report says
when the evidence set it (`bwd_warning`, `exact_after_factor`). The package docstring says when
the evidence is taken over the declaration (`auditor.compare.conventions`).
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.conventions.grad_evidence import (
    GradEvidence,
    differ_text,
    sharing,
)
from numaudit.auditor.compare.conventions.loss_reduction import compared as _compared
from numaudit.auditor.compare.explain import factors
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import Comparison
from numaudit.wire.vocabulary import Phase

BWD = Phase.BWD


def bwd_warning(comp: Comparison, ev: GradEvidence, g: float, total: float, why: str) -> str:
    """The run-level warning for activation gradients compared after the factor the evidence
    showed (`bwd_trial`), with a note on each of them when no rescaling was needed."""
    bwd = _compared(comp, BWD)
    if comp.bwd_factor == 1.0:  # no rescaling, so scale_bwd said nothing
        for i in bwd.tolist():
            comp.notes.setdefault(i, []).append(f"compared as they are, inferred from "
                                                f"the evidence ({why})")
    grads = ("while the parameter gradients agree" if not len(ev.bad) else
             f"while the parameter gradients differ ({differ_text(comp, ev)}) but none "
             f"by that x{F.format_float(g)}")
    seen = int(forward_matched(comp)[bwd].sum())
    where = "" if seen == len(bwd) else (f" in the microbatches whose forward matched "
                                         f"({seen} of {len(bwd)})")
    return (f"activation gradients (phase bwd): every one of {comp.cand.name}'s"
            f"{where} is x{F.format_float(g)} of what the runs' agents "
            f"inferred from their data-parallel sizes, {grads}: compared after the "
            f"x{F.format_float(total)} inferred from the evidence ({why})")


def bwd_breaches(comp: Comparison) -> bool:
    """Whether an activation gradient of a microbatch whose forward matched still breaches."""
    return bool((comp.breach & ((comp.when & 0xF) == BWD) & forward_matched(comp)).any())


def bwd_factor(ref_info: dict, cand_info: dict) -> tuple[float, list[str]]:
    """What the runs' loss normalizations make cand's activation gradients relative to ref's
    (cand grad_scale / ref grad_scale), and warnings when a run's scale is unknown."""
    warnings = []
    for info in (ref_info, cand_info):
        if info.get("grad_scale", 1.0) is None:
            warnings.append(f"{info['name']}: its ranks declared different gradient scales "
                            f"({', '.join(info.get('grad_scale_sources') or []) or 'no source'}):"
                            " activation gradients (phase bwd) are compared unscaled")
    r, c = ref_info.get("grad_scale", 1.0), cand_info.get("grad_scale", 1.0)
    if r is None or c is None or not r or not c:
        return 1.0, warnings
    return float(c) / float(r), warnings


def forward_matched(comp: Comparison) -> np.ndarray:
    """Per key, whether every input, activation and loss of its microbatch passes: only there
    do activation gradients show the scale backward starts from (where the forward already
    differs, a later step after a gradient bug, they differ for that reason)."""
    block = comp.when >> 4  # step and microbatch
    forward = np.isin(comp.when & 0xF, (Phase.INPUT, Phase.FWD, Phase.LOSS))
    return ~np.isin(block, block[forward & comp.breach])


def bwd_trial(comp: Comparison, ref_info: dict, cand_info: dict, ev: GradEvidence):
    """(g, total factor, why) when every breaching activation gradient of the microbatches whose
    forward matched is the reference times one factor g = n or 1/n beyond the runs' inferred
    scales, and the parameter gradients can vouch for the step and do not carry g themselves."""
    if ev.missing:
        return None
    sources = [s for info in (ref_info, cand_info) for s in info.get("grad_scale_sources") or []]
    inferred_only = all(info.get("grad_scale_sources") for info in (ref_info, cand_info)) and \
        not any(s.startswith("declared") for s in sources)
    if not inferred_only:
        return None
    bwd = _compared(comp, BWD)
    bad = bwd[comp.breach[bwd] & forward_matched(comp)[bwd]]
    if not len(bad) or (comp.verdict[bad] != F.DIVERGED).any():
        return None
    blind = bad[np.isnan(comp.norm_ratio[bad])]
    if len(blind):  # decided by fingerprints alone (the exact metric): measure the factor
        factors.factor_evidence(comp, blind)
    if comp.scaled_by is None:
        return None
    sb = comp.scaled_by[bad]
    if not np.isfinite(sb).all():
        return None
    snapped = {factors.snap(float(x)) for x in sb}
    if len(snapped) != 1 or None in snapped:
        return None
    snap = snapped.pop()
    assert snap is not None  # ruled out just above
    n, inverse = snap
    g = 1.0 / n if inverse else float(n)
    if len(sharing(comp, ev, g)):
        return None  # the factor reaches training: it is the finding, not a convention
    total = comp.bwd_factor * g
    if abs(total - 1.0) < 1e-9:
        why = ("each rank's loss normalized by the whole batch, gradients summed over ranks: "
               f"{comp.cand.name}'s activation gradients equal {comp.ref.name}'s")
    else:
        named = factors.name_factor(total, factors.run_counts(comp, BWD))
        why = (f"{comp.cand.name}'s activation gradients are x{F.format_float(total)} "
               f"{comp.ref.name}'s" + (f" ({named})" if named else ""))
    return g, total, why


def exact_after_factor(comp: Comparison, ref_info: dict, cand_info: dict) -> list[str]:
    """The warning naming the activation gradients that the exact metric (the bitwise preset)
    passed as the reference times the factor the runs' conventions imply
    (`auditor.compare.measure.slow`): they differ bitwise by design."""
    proofs = comp.memo.get("exact_after_factor", {})
    keys = [i for i in proofs if not comp.breach[i]]
    if not keys:
        return []
    count = {p: sum(1 for i in keys if proofs[i] == p) for p in ("bits", "bytes", "digests")}
    how = "; ".join(f"{n} {what}" for n, what in (
        (count["bits"], "bit for bit (the fingerprint moved with the factor)"),
        (count["bytes"], "from both runs' bytes"),
        (count["digests"], "from sketches and moments equal to the last bit (uncertain: no "
                           "fingerprint or bytes prove every element)")) if n)
    source = (f"inferred from the evidence ({comp.bwd_inferred})" if comp.bwd_inferred else
              "of the runs' declared or inferred loss normalizations (grad_scale "
              f"{_scale(cand_info)} of {comp.cand.name} over {_scale(ref_info)} of "
              f"{comp.ref.name})")
    named = factors.name_factor(comp.bwd_factor, factors.run_counts(comp, BWD))
    return [f"activation gradients (phase bwd): {len(keys)} compared by the exact metric are "
            f"exactly {comp.ref.name}'s x{F.format_float(comp.bwd_factor)} in "
            f"{comp.cand.name} ({how}): the factor {source}"
            f"{f' ({named})' if named else ''}, so they pass"]


def _scale(info: dict) -> str:
    s = info.get("grad_scale", 1.0)
    return F.format_float(float(s)) if s else "-"
