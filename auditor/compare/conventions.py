"""Conventions inferred from the evidence: how each run reduced its loss over its dp ranks, and
what that makes its activation gradients (docs/comparison.md, "Conventions from the evidence").

The agent cannot see how the user's code normalizes its loss. It records each rank's loss as a
mean over the rank's share (capture's default reduce="mean" for phase loss) and its activation
gradients as dp_size x those of one process (the per-rank mean loss of ordinary DDP/FSDP code,
agents/normalization.py). Code that normalizes by the global token count and sums gradients
over ranks (torchtitan), or plain sums, break both guesses, and every data-parallel pair would
read "scaled by 0.50" ahead of the real bug. So after a first evaluation under the declared
conventions, `evaluate_runs` tries the other one on the evidence:

- loss: a run whose per-rank losses do not merge as a mean into the other run's loss but do as a
  sum is taken as summing, when every loss key of the run agrees under it and the parameter
  gradients (phase grad) agree: the training step is the same, the loss's reduction is a
  reporting convention. A reduction the user declared (capture(..., reduce="sum")) is not
  second-guessed; the wire cannot tell a declared "mean" from the default, so a mean is always
  open to the evidence (only ever towards a sum, and only with the gradients agreeing).
- activation gradients: when every breaching activation gradient is the reference times one
  factor n or 1/n beyond the scales the runs' agents inferred (not declared), the parameter
  gradients agree, and under the corrected scale every activation gradient passes, the scale
  is taken from the evidence.

Each inference is one convention for the whole run, is said in the report's warnings and on
every key it touched, and never applies where the parameter gradients differ or were not
captured: then the factor is a finding, said with its name (`auditor.compare.factors`).
"""

from __future__ import annotations

import numpy as np

from auditor.compare import factors
from auditor.compare import findings as F
from auditor.compare import merge as M
from auditor.compare.align import PHASE_IDS
from auditor.compare.columns import Catalog, RunColumns
from auditor.compare.comparison import Comparison
from auditor.compare.policy import Policy
from auditor.compare.verdicts import evaluate
from auditor.store import Reader

LOSS, BWD, GRAD = PHASE_IDS["loss"], PHASE_IDS["bwd"], PHASE_IDS["grad"]


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
    loss_side, loss_notes = None, {}  # noted once comp is final (the bwd trial may redo it)
    grads_ok, grads_why = grads_agree(comp)
    trial = _loss_trial(comp, rc, cc, run)
    if trial is not None:
        side, ratios, sum_comp = trial
        if grads_ok and not sum_comp.breach.any():
            loss_side = side
            comp = run(loss_sum=side)
            warnings.append(_loss_warning(comp, side, ratios))
            for i in _compared(comp, LOSS).tolist():
                loss_notes[i] = _loss_note(comp, side, ratios)
        else:
            for i in np.flatnonzero(comp.breach & _phase(comp, LOSS)).tolist():
                loss_notes[i] = _loss_refusal(comp, side, ratios, sum_comp, grads_why)
    inferred = _bwd_trial(comp, ref_info, cand_info, grads_ok)
    if inferred is not None:
        g, total, why = inferred
        again = run(factor=declared * g, loss_sum=loss_side, why=why)
        if not (again.breach & _phase(again, BWD)).any():
            comp = again
            if comp.bwd_factor == 1.0:  # no rescaling, so scale_bwd said nothing
                for i in _compared(comp, BWD).tolist():
                    comp.notes.setdefault(i, []).append(f"compared as they are, inferred from "
                                                        f"the evidence ({why})")
            warnings.append(f"activation gradients (phase bwd): every one of {names['cand']}'s "
                            f"is x{F.format_float(g)} of what the runs' agents inferred from "
                            f"their data-parallel sizes, while the parameter gradients agree: "
                            f"compared after the x{F.format_float(total)} inferred from the "
                            f"evidence ({why})")
    for i, note in loss_notes.items():
        comp.notes.setdefault(i, []).append(note)
    factors.annotate(comp)
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
    return (comp.A & 0xF) == phase


def _compared(comp: Comparison, phase: int) -> np.ndarray:
    """Keys of a phase both runs hold and the policy compares."""
    return np.flatnonzero(_phase(comp, phase) & (comp.verdict != F.IGNORED) & (comp.ri >= 0)
                          & (comp.ci >= 0))


def grads_agree(comp: Comparison) -> tuple[bool, str]:
    """Whether the parameter gradients (phase grad) vouch for the training step: captured in
    both runs, none breaching, some not zero; else why not."""
    grad = np.flatnonzero(_phase(comp, GRAD) & (comp.verdict != F.IGNORED))
    if not len(grad):
        return False, "no parameter gradient (phase grad) was captured to show the training " \
                      "step matches"
    bad = grad[comp.breach[grad]]
    if len(bad):
        j = int(bad[np.argmin(comp.rank_in_order[bad])])
        return False, (f"the parameter gradients differ too ({len(bad)} of {len(grad)}, first "
                       f"{comp.key(j)}), so the factor reaches training")
    both = grad[(comp.ri[grad] >= 0) & (comp.ci[grad] >= 0)]
    rk = comp.ref_keys
    r = comp.ri[both]
    live = (rk.status[r] == M.OK) & (rk.all_zero[r] != 1) if len(r) else np.zeros(0, bool)
    if not live.any():
        return False, "no parameter gradient that is not zero or None was compared"
    return True, ""


def _mean_side(comp: Comparison, keys: np.ndarray, side: str) -> bool:
    """Every one of these keys is, in this run, a mean over several dp ranks' addends."""
    lk = comp.ref_keys if side == "ref" else comp.cand_keys
    g = (comp.ri if side == "ref" else comp.ci)[keys]
    return bool(len(g)) and bool(((lk.reduced[g] == M.REDUCE_MEAN) & lk.partial[g]).all())


def _loss_trial(comp: Comparison, rc: RunColumns, cc: RunColumns, run):
    """(side, {"mean": ratio, "sum": ratio}, comparison of the loss keys with that side merged
    as sums) for the first run (cand, then ref) whose per-rank losses are means over dp ranks,
    when some loss key breaches; None when there is nothing to try."""
    loss = _compared(comp, LOSS)
    if not len(loss) or not comp.breach[loss].any():
        return None
    for side in ("cand", "ref"):
        if not _mean_side(comp, loss, side):
            continue
        sub = tuple(c.take(np.flatnonzero((c.A & 0xF) == LOSS)) for c in (rc, cc))
        summed = run(sub, loss_sum=side)
        ratios = {"mean": _median_ratio(comp, loss), "sum": _median_ratio(
            summed, _compared(summed, LOSS))}
        return side, ratios, summed
    return None


def _median_ratio(comp: Comparison, keys: np.ndarray) -> float:
    """The loss keys' median norm ratio (cand over ref): 1 for identical keys."""
    r = np.where(comp.verdict[keys] == F.IDENTICAL, 1.0, comp.norm_ratio[keys])
    r = r[np.isfinite(r)]
    return float(np.median(r)) if len(r) else float("nan")


def _loss_warning(comp: Comparison, side: str, ratios: dict) -> str:
    name = comp.cand.name if side == "cand" else comp.ref.name
    other = comp.ref.name if side == "cand" else comp.cand.name
    n = factors.dp_size(comp, side)
    return (f"{name}'s per-rank losses are sums over its {n} dp ranks, not means: merged as a "
            f"sum they equal {other}'s loss (as a mean, the default for phase loss"
            f"{_times(ratios['mean'], ', x')}), and the parameter gradients agree; its losses "
            f"are compared as sums (capture(loss, reduce=\"sum\") declares it)")


def _loss_note(comp: Comparison, side: str, ratios: dict) -> str:
    name = comp.cand.name if side == "cand" else comp.ref.name
    other = comp.ref.name if side == "cand" else comp.cand.name
    return (f"{name}'s per-rank losses are sums (each rank's loss normalized by the whole "
            f"batch's count, or a plain sum): merged as a sum they equal {other}'s loss, merged "
            f"as a mean{_times(ratios['mean'], ' x', ' not')}; inferred from the evidence, with "
            "the parameter gradients agreeing")


def _loss_refusal(comp: Comparison, side: str, ratios: dict, summed: Comparison,
                  grads_why: str) -> str:
    """Why a breaching loss stays a breach: the sum does not explain it either, or it does but
    the gradients cannot vouch for the step."""
    name = comp.cand.name if side == "cand" else comp.ref.name
    other = comp.ref.name if side == "cand" else comp.cand.name
    n = factors.dp_size(comp, side)
    loss = _compared(summed, LOSS)
    held = int(np.count_nonzero(~summed.breach[loss]))
    if summed.breach.any() and held and grads_why:
        # the sum explains the first losses, and training parted afterwards: the gradients
        # are what differs, not the reduction
        return (f"merged as a sum over its {n} dp ranks, {name}'s per-rank losses equal "
                f"{other}'s loss at {held} of {len(loss)} loss keys and not at the others, and "
                f"{grads_why}: not taken as a convention")
    if summed.breach.any():
        return (f"neither as a mean nor as a sum over its {n} dp ranks do {name}'s per-rank "
                f"losses make {other}'s loss{_ratios_text(ratios)}: no loss reduction explains "
                "the difference")
    return (f"merged as a sum over its {n} dp ranks, {name}'s per-rank losses equal {other}'s "
            f"loss, but {grads_why}: not taken as a convention")


def _bwd_trial(comp: Comparison, ref_info: dict, cand_info: dict, grads_ok: bool):
    """(g, total factor, why) when every breaching activation gradient is the reference times
    one factor g = n or 1/n beyond the runs' inferred scales and the gradients agree."""
    if not grads_ok:
        return None
    sources = [s for info in (ref_info, cand_info) for s in info.get("grad_scale_sources") or []]
    inferred_only = all(info.get("grad_scale_sources") for info in (ref_info, cand_info)) and \
        not any(s.startswith("declared") for s in sources)
    if not inferred_only:
        return None
    bwd = _compared(comp, BWD)
    bad = bwd[comp.breach[bwd]]
    if not len(bad) or comp.scaled_by is None:
        return None
    if (comp.verdict[bad] != F.DIVERGED).any():
        return None
    sb = comp.scaled_by[bad]
    if not np.isfinite(sb).all():
        return None
    snapped = {factors.snap(float(x)) for x in sb}
    if len(snapped) != 1 or None in snapped:
        return None
    n, inverse = snapped.pop()
    g = 1.0 / n if inverse else float(n)
    total = comp.bwd_factor * g
    if abs(total - 1.0) < 1e-9:
        why = ("each rank's loss normalized by the whole batch, gradients summed over ranks: "
               f"{comp.cand.name}'s activation gradients equal {comp.ref.name}'s")
    else:
        named = factors.name_factor(total, factors.run_counts(comp, BWD))
        why = (f"{comp.cand.name}'s activation gradients are x{F.format_float(total)} "
               f"{comp.ref.name}'s" + (f" ({named})" if named else ""))
    return g, total, why


def _ratios_text(ratios: dict) -> str:
    """" (mean x0.5, sum x1.3)" with the ratios that were measured (a verdict from fingerprints
    alone measures none)."""
    shown = [f"{k}{_times(v, ' x')}" for k, v in ratios.items() if np.isfinite(v)]
    return f" ({', '.join(shown)})" if shown else ""


def _times(ratio: float, before: str, unmeasured: str = "") -> str:
    """``before`` + the ratio where it was measured, else ``unmeasured``."""
    return f"{before}{F.format_float(ratio)}" if np.isfinite(ratio) else unmeasured
