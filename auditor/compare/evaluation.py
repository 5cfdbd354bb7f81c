"""The comparison evaluated under the runs' conventions: as declared, or as the evidence shows.

    comp, warnings = evaluate_runs(rc, cc, catalog, policy, reader, ref_info, cand_info, ...)

The agent cannot see how the user's code normalizes its loss, so the verdicts of a first
evaluation under the declared (or assumed) conventions may carry a factor that is a convention,
not a bug (`auditor.compare.conventions`). This driver evaluates the runs
(`auditor.compare.measure.verdicts.evaluate`) at most three times:

1. under the declared conventions;
2. again with one run's per-rank losses merged as sums, when the losses' own evidence says so
   (`conventions.loss_reduction.decide`);
3. again with the activation gradients scaled by the one factor the evidence shows
   (`conventions.activation_grads.bwd_trial`), kept only if every activation gradient of the
   microbatches whose forward matched then passes.

Each convention taken from the evidence is said in the run-level warnings and on every key it
touched; then every breaching factor is named (`auditor.compare.explain.factors`).
"""

from __future__ import annotations

from numaudit.auditor.compare.conventions.activation_grads import (
    bwd_breaches,
    bwd_factor,
    bwd_trial,
    bwd_warning,
    exact_after_factor,
)
from numaudit.auditor.compare.conventions.grad_evidence import grad_evidence
from numaudit.auditor.compare.conventions.loss_reduction import compared, decide
from numaudit.auditor.compare.explain import factors
from numaudit.auditor.compare.measure.comparison import Comparison
from numaudit.auditor.compare.measure.verdicts import evaluate
from numaudit.auditor.compare.policy.load import Policy
from numaudit.auditor.compare.read.columns import Catalog, RunColumns
from numaudit.auditor.store import Reader
from numaudit.wire.vocabulary import Phase


def evaluate_runs(rc: RunColumns, cc: RunColumns, catalog: Catalog, policy: Policy,
                  reader: Reader, ref_info: dict, cand_info: dict, *, mesh: dict,
                  labels: dict) -> tuple[Comparison, list[str]]:
    """The comparison of two runs' columns under their declared conventions, or under the
    conventions the evidence shows (module docstring), with every breaching factor named;
    returns it and the run-level warnings to report."""
    declared, warnings = bwd_factor(ref_info, cand_info)

    def run(cols=(rc, cc), *, factor=declared, loss_sum=None, why="") -> Comparison:
        comp = evaluate(cols[0], cols[1], catalog, policy, reader, bwd_factor=factor,
                        loss_sum=loss_sum, bwd_inferred=why)
        comp.mesh, comp.labels = mesh, labels
        comp.memo["world_size"] = {"ref": ref_info.get("world_size"),
                                   "cand": cand_info.get("world_size")}
        return comp

    comp = run()
    ev = grad_evidence(comp)
    # 2. the loss: one run's per-rank losses summed, not averaged, over its dp ranks
    loss_side, loss_notes = None, {}  # noted once comp is final (the bwd trial may redo it)
    loss = decide(comp, rc, cc, run, ev, {"ref": ref_info, "cand": cand_info})
    if loss is not None and loss.side is not None:
        loss_side = loss.side
        comp = run(loss_sum=loss.side)
        warnings.append(loss.warning)
        loss_notes = {i: loss.note for i in compared(comp, Phase.LOSS).tolist()}
    elif loss is not None:
        loss_notes = loss.refusals
    # 3. the activation gradients: one factor beyond the scales the agents inferred
    inferred = bwd_trial(comp, ref_info, cand_info, ev)
    if inferred is not None:
        g, total, why = inferred
        again = run(factor=declared * g, loss_sum=loss_side, why=why)
        if not bwd_breaches(again):
            comp = again
            warnings.append(bwd_warning(comp, ev, g, total, why))
    for i, note in loss_notes.items():
        comp.notes.setdefault(i, []).append(note)
    factors.annotate(comp)
    warnings.extend(exact_after_factor(comp, ref_info, cand_info))
    return comp, warnings
