"""Conventions inferred from the evidence: how each run reduced its loss over its dp ranks, and
what that makes its activation gradients (docs/comparison.md, "Conventions from the evidence").

The agent cannot see how the user's code normalizes its loss. It records each rank's loss as a
mean over the rank's share (capture's default reduce="mean" for phase loss) and its activation
gradients as dp_size x those of one process (the per-rank mean loss of ordinary DDP/FSDP code,
agents/capture/normalization.py). Code that normalizes by the global token count and sums gradients
over ranks (torchtitan), or plain sums, break both guesses, and every data-parallel pair would
read "scaled by 0.50" ahead of the real bug. So after a first evaluation under the declared
conventions, `evaluate_runs` tries the other one on the evidence, each convention judged on its
own evidence:

- loss: a run whose per-rank losses merge into the other run's loss as a sum, and not as a
  mean, is taken as summing (`auditor.compare.loss_reduction`) unless the parameter gradients
  carry the very factor the mean leaves on the loss (or cannot vouch for the step: not
  captured, all zero). A declared normalization that sums (loss_normalization "global_mean")
  is taken at its word; a reduction the capture declared (reduce="sum") is not second-guessed.
- activation gradients: when every breaching activation gradient is the reference times one
  factor g = n or 1/n beyond the scales the runs' agents inferred (not declared), under the
  corrected scale every activation gradient passes, and the parameter gradients can vouch for
  the step and do not carry g themselves, the scale is taken from the evidence.

Parameter gradients that differ otherwise (a bucket left unreduced, a frozen parameter, one
microbatch trained) are the finding, not evidence against a convention
(`auditor.compare.grad_evidence`). Each inference is one convention for the whole run, is said
in the report's warnings and on every key it touched; a factor no convention explains is a
finding said with its name (`auditor.compare.factors`). Under the exact metric (the bitwise
preset), activation gradients that are exactly the reference times the factor a convention
implies pass, and the warnings say how many.
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare import factors
from numaudit.auditor.compare import findings as F
from numaudit.auditor.compare.align import PHASE_IDS
from numaudit.auditor.compare.columns import Catalog, RunColumns
from numaudit.auditor.compare.comparison import Comparison
from numaudit.auditor.compare.grad_evidence import GradEvidence, differ_text, grad_evidence, sharing
from numaudit.auditor.compare.loss_reduction import compared as _compared
from numaudit.auditor.compare.loss_reduction import decide
from numaudit.auditor.compare.policy import Policy
from numaudit.auditor.compare.verdicts import evaluate
from numaudit.auditor.store import Reader

LOSS, BWD = PHASE_IDS["loss"], PHASE_IDS["bwd"]


def evaluate_runs(rc: RunColumns, cc: RunColumns, catalog: Catalog, policy: Policy,
                  reader: Reader, ref_info: dict, cand_info: dict, *, mesh: dict,
                  labels: dict) -> tuple[Comparison, list[str]]:
    """The comparison of two runs' columns under their declared conventions, or under the
    conventions the evidence shows (module docstring), with every breaching factor named;
    returns it and the run-level warnings to report."""
    declared, warnings = bwd_factor(ref_info, cand_info)
    names = {"ref": rc.name, "cand": cc.name}

    def run(cols=(rc, cc), *, factor=declared, loss_sum=None, why="") -> Comparison:
        comp = evaluate(cols[0], cols[1], catalog, policy, reader, bwd_factor=factor,
                        loss_sum=loss_sum, bwd_inferred=why)
        comp.mesh, comp.labels = mesh, labels
        comp.memo["world_size"] = {"ref": ref_info.get("world_size"),
                                   "cand": cand_info.get("world_size")}
        return comp

    comp = run()
    ev = grad_evidence(comp)
    loss_side, loss_notes = None, {}  # noted once comp is final (the bwd trial may redo it)
    loss = decide(comp, rc, cc, run, ev, {"ref": ref_info, "cand": cand_info})
    if loss is not None and loss.side is not None:
        loss_side = loss.side
        comp = run(loss_sum=loss.side)
        warnings.append(loss.warning)
        loss_notes = {i: loss.note for i in _compared(comp, LOSS).tolist()}
    elif loss is not None:
        loss_notes = loss.refusals
    inferred = _bwd_trial(comp, ref_info, cand_info, ev)
    if inferred is not None:
        g, total, why = inferred
        again = run(factor=declared * g, loss_sum=loss_side, why=why)
        if not (again.breach & _phase(again, BWD) & _forward_matched(again)).any():
            comp = again
            if comp.bwd_factor == 1.0:  # no rescaling, so scale_bwd said nothing
                for i in _compared(comp, BWD).tolist():
                    comp.notes.setdefault(i, []).append(f"compared as they are, inferred from "
                                                        f"the evidence ({why})")
            grads = ("while the parameter gradients agree" if not len(ev.bad) else
                     f"while the parameter gradients differ ({differ_text(comp, ev)}) but none "
                     f"by that x{F.format_float(g)}")
            bwd = _compared(comp, BWD)
            seen = int(_forward_matched(comp)[bwd].sum())
            where = "" if seen == len(bwd) else (f" in the microbatches whose forward matched "
                                                 f"({seen} of {len(bwd)})")
            warnings.append(f"activation gradients (phase bwd): every one of {names['cand']}'s"
                            f"{where} is x{F.format_float(g)} of what the runs' agents "
                            f"inferred from their data-parallel sizes, {grads}: compared after the "
                            f"x{F.format_float(total)} inferred from the evidence ({why})")
    for i, note in loss_notes.items():
        comp.notes.setdefault(i, []).append(note)
    factors.annotate(comp)
    warnings.extend(_exact_after_factor(comp, ref_info, cand_info))
    return comp, warnings


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


def _phase(comp: Comparison, phase: int) -> np.ndarray:
    phases = comp.A & 0xF
    return phases == phase


def _forward_matched(comp: Comparison) -> np.ndarray:
    """Per key, whether every input, activation and loss of its microbatch passes: only there
    do activation gradients show the scale backward starts from (where the forward already
    differs, a later step after a gradient bug, they differ for that reason)."""
    block = comp.A >> 4  # step and microbatch
    forward = np.isin(comp.A & 0xF, (PHASE_IDS["input"], PHASE_IDS["fwd"], LOSS))
    return ~np.isin(block, block[forward & comp.breach])


def _bwd_trial(comp: Comparison, ref_info: dict, cand_info: dict, ev: GradEvidence):
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
    bad = bwd[comp.breach[bwd] & _forward_matched(comp)[bwd]]
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


def _exact_after_factor(comp: Comparison, ref_info: dict, cand_info: dict) -> list[str]:
    """The warning naming the activation gradients that the exact metric (the bitwise preset)
    passed as the reference times the factor the runs' conventions imply
    (`auditor.compare.slow`): they differ bitwise by design."""
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
