"""Drill-down: from the module that introduced a divergence to the operation inside it
(docs/drill-down.md).

`attach_ops` gives a report its op-level comparison (`auditor.compare.ops.comparison`) when the runs
captured operations, and, when the first divergence is a module's own (introduced at a module's
forward output or activation gradient) and its operations were not captured, the rerun that
captures them (`drill_plan`): the same settings for both runs,
``NUMAUDIT_OPS=<site> NUMAUDIT_STEPS=<step>``, or the plan file `auditor drill` writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.merge.uneven import place_uneven
from numaudit.auditor.compare.ops.comparison import compare_ops, split_ops
from numaudit.auditor.compare.ops.findings import OpReport
from numaudit.auditor.compare.read.columns import Catalog, RunColumns
from numaudit.wire.ops import is_op_site
from numaudit.wire.plan import Plan
from numaudit.wire.vocabulary import Phase, Role

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison
    from numaudit.auditor.compare.result import Report

__all__ = ["split_ops", "attach_ops", "drill_plan", "module_breaches"]

DRILL_PHASES = ("fwd", "bwd")
NOT_THE_MODULE = ("the first activation gradient of backward",)
"""How `auditor.compare.explain.causes` starts an introduced cause that is not the module's own
computation (the backward seed: where backward starts, the loss's gradient)."""


def module_breaches(comp: Comparison) -> set[tuple[int, str, int]]:
    """(A, module site, call) of every module forward output that breaches."""
    out = set()
    out_role = Role.OUTPUT
    fwd = Phase.FWD
    idx = np.flatnonzero(comp.breach & (fwd == (comp.when & 0xF))
                         & (out_role == ((comp.where >> 28) & 0xF)))
    for i in idx.tolist():
        b = int(comp.where[i])
        out.add((int(comp.when[i]), comp.catalog.site_names.get(b >> 32, ""), b & 0x3FFF))
    return out


def attach_ops(report: Report, rc_ops: RunColumns, cc_ops: RunColumns, catalog: Catalog,
               reader) -> None:
    """Compare the runs' operation records (if any) into ``report.ops``, and say the rerun
    that drills into the first divergence's module (``report.drill``)."""
    comp = report.comparison
    ops: OpReport | None = None
    if len(rc_ops) or len(cc_ops):
        rc_ops = place_uneven(rc_ops, catalog, cc_ops)[0]
        cc_ops = place_uneven(cc_ops, catalog, rc_ops)[0]
        ops = compare_ops(rc_ops, cc_ops, catalog, report.policy, reader,
                          bwd_factor=comp.bwd_factor, mesh=comp.mesh, labels=comp.labels,
                          module_breaches=module_breaches(comp))
    report.ops = ops
    plan = drill_plan(report)
    if plan is not None:
        report.drill = drill_dict(plan, report.ref["name"], report.cand["name"])


def drill_plan(report: Report) -> Plan | None:
    """The rerun that captures the operations of the module that introduced the first
    divergence, at its step; None when there is none to drill into (no divergence, one not
    introduced by a module, or its operations are already compared in this report)."""
    first = report.first
    if first is None or first.cause is None or first.cause.kind != "introduced":
        return None
    key = first.key
    if key.phase not in DRILL_PHASES or not key.site or is_op_site(key.site):
        return None
    if first.cause.reason.startswith(NOT_THE_MODULE):
        return None  # the causes say what differs is not what the module computes
    # the module, and its parent: the parent's own code between its submodules (a scale, a
    # residual add) feeds the module's input, which module-level captures do not hold
    parent = key.site.rsplit(".", 1)[0] if "." in key.site else ""
    sites = (key.site, parent) if parent else (key.site,)
    ops = report.ops
    if ops is not None and any(f.module in sites for f in ops.calls):
        return None  # its operations were captured (at that step, or a later one live)
    payload = [f"fwd:{key.site}"]
    reason = (f"first divergence of {report.ref['name']} vs {report.cand['name']}: "
              f"{first.verdict} {key}; {first.cause.kind}: {first.cause.reason}")
    return Plan(ops=sites, steps=(key.step,), payload=tuple(payload),
                reason=reason[:1000], runs={"ref": report.ref["name"],
                                            "cand": report.cand["name"]})


def drill_dict(plan: Plan, ref: str, cand: str) -> dict:
    """The report's ``drill`` (docs/report-schema.md): what to rerun, as variables and as a
    plan file."""
    site, step = plan.ops[0], plan.steps[0]
    globs = ",".join(plan.ops)
    return {"site": site, "ops": list(plan.ops), "step": step, "payload": list(plan.payload),
            "env": f"NUMAUDIT_OPS={globs} NUMAUDIT_STEPS={step}",
            "command": f"auditor drill {ref} {cand} -o plan.toml",
            "text": (f"rerun both runs with NUMAUDIT_OPS={globs} NUMAUDIT_STEPS={step} (or "
                     f"NUMAUDIT_PLAN from `auditor drill {ref} {cand} -o plan.toml`): the report "
                     f"then names the operation inside {site}")}


def first_op_finding(ops: OpReport | None, finding: F.Finding | None):
    """The op-level finding of the first divergence's module call, if its operations were
    compared (the call whose step, microbatch and call match)."""
    if ops is None or finding is None:
        return None
    k = finding.key
    for f in ops.calls:
        if (f.module, f.step, f.microbatch, f.call, f.phase) == (k.site, k.step, k.microbatch,
                                                                 k.call, k.phase):
            return f
    return None
