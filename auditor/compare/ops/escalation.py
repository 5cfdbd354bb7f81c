"""Escalation of a live comparison (`auditor watch --escalate`, docs/drill-down.md).

When a module introduces a divergence while both runs are still going, the watch asks both
runs' agents to capture that module's operations (and its parent's: the code between its
submodules feeds its input), and the raw bytes of its outputs, at the next step both will run:
a directive the daemon sends on the agents' Ingest streams (auditor/daemon/directives.py). Once
both runs have moved past that step with the operations captured, their op-level comparison
(`auditor.compare.ops.comparison`) is reported: the operation that differs, without a rerun. A run
that moves past the step without them (the directive came too late, the agent took none: a node
sidecar, NUMAUDIT_DIRECTIVES=0, an earlier build) is asked again for a later step, at most
MAX_ATTEMPTS times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.ops.comparison import compare_ops
from numaudit.auditor.compare.read.columns import Catalog, RunColumns
from numaudit.wire.ops import is_op_site, parse_op_site

MAX_MODULES = 3
"""Modules one watch escalates at most (each its own directive)."""
MAX_ATTEMPTS = 3
"""Directives for one module (a later step each time one came too late)."""
STEP_MARGIN = 1
"""Steps between the latest one a run has sent and the one a directive names."""


@dataclass
class Ask:
    site: str
    ops: tuple[str, ...]
    step: int
    attempt: int = 1
    done: bool = False
    reason: str = ""


@dataclass
class LiveDrill:
    """The escalations of one live comparison."""

    names: dict[str, str]
    catalog: Catalog
    ops: dict[str, RunColumns] = field(default_factory=dict)
    asks: dict[str, Ask] = field(default_factory=dict)
    module_breaches: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ops = {side: RunColumns.empty(name, side) for side, name in self.names.items()}

    def add(self, side: str, op_rows: RunColumns) -> None:
        """Operation records that arrived (kept out of the live key comparison)."""
        if len(op_rows):
            self.ops[side] = self.ops[side].concat(op_rows)

    def flagged(self, found: list[F.Finding], latest: int) -> list[dict]:
        """Directives for the modules these findings say introduced a divergence (those not
        asked yet); `latest`: the latest step either run has sent records of."""
        out = []
        for f in found:
            key = f.key
            if not f.breach or key.phase not in ("fwd", "bwd") or is_op_site(key.site):
                continue
            if key.phase == "fwd" and key.role == "output":
                self.module_breaches.add(((key.step << 24) | ((key.microbatch + 1) << 4) | 1,
                                          key.site, key.call))
            if f.cause is None or f.cause.kind != "introduced" or key.site in self.asks:
                continue
            if len(self.asks) >= MAX_MODULES:
                continue
            parent = key.site.rsplit(".", 1)[0] if "." in key.site else ""
            ask = Ask(key.site, (key.site, parent) if parent else (key.site,),
                      max(latest, key.step) + STEP_MARGIN,
                      reason=f"{f.verdict} {key}: {f.cause.kind}: {f.cause.reason}")
            self.asks[key.site] = ask
            out.append(self.directive(ask))
        return out

    def directive(self, ask: Ask) -> dict:
        return {"site": ask.site, "ops": list(ask.ops), "payload": [f"fwd:{ask.site}"],
                "step": ask.step, "attempt": ask.attempt, "reason": ask.reason[:1000]}

    def ready(self, past: float, finished: bool) -> bool:
        """Some ask's step is one both runs are past (or the runs finished)."""
        return any(not a.done and (a.step < past or finished) for a in self.asks.values())

    def progress(self, past: float, finished: bool, latest: int, policy, reader,
                 bwd_factor: float, mesh: dict, labels: dict) -> tuple[list[dict], list[dict]]:
        """(op-level findings reported, directives asked again) for the asks whose step both
        runs are past; a step passed without operation captures in a run is asked again."""
        reports, again = [], []
        for ask in self.asks.values():
            if ask.done or not (ask.step < past or finished):
                continue
            have = {side: self._rows(side, ask) for side in self.names}
            if all(len(rows) for rows in have.values()):
                ask.done = True
                rep = compare_ops(have["ref"], have["cand"], self.catalog, policy, reader,
                                  bwd_factor=bwd_factor, mesh=mesh, labels=labels,
                                  module_breaches=self.module_breaches)
                calls = rep.calls if rep is not None else []
                diff = [c for c in calls if c.kind != "identical"]
                reports.append({"site": ask.site, "step": ask.step, "calls": len(calls),
                                "differ": len(diff),
                                "findings": [c.as_dict() for c in (diff or calls)[:20]],
                                "warnings": rep.warnings if rep is not None else []})
                continue
            lacking = [self.names[s] for s, rows in have.items() if not len(rows)]
            if ask.attempt >= MAX_ATTEMPTS or finished:
                ask.done = True
                reports.append({"site": ask.site, "step": ask.step, "calls": 0, "differ": 0,
                                "findings": [], "warnings": [
                                    f"no operation of {ask.site} was captured at step "
                                    f"{ask.step} in {' and '.join(lacking)}: the directive came "
                                    "after the step started, or the agents take none (a node "
                                    "sidecar, NUMAUDIT_DIRECTIVES=0, an earlier build); drill "
                                    "with a rerun instead (`auditor drill`)"]})
                continue
            ask.attempt += 1
            ask.step = max(latest, ask.step) + STEP_MARGIN
            again.append(self.directive(ask))
        return reports, again

    def _rows(self, side: str, ask: Ask) -> RunColumns:
        cols = self.ops[side]
        if not len(cols):
            return cols
        keep = ask.step == (cols.when >> 24)
        sites = np.unique(cols.where[keep] >> 32).tolist()
        wanted = np.zeros(int(max(sites, default=0)) + 1, bool)
        for sid in sites:
            parsed = parse_op_site(self.catalog.site_names.get(sid, ""))
            wanted[sid] = parsed is not None and parsed[0] in ask.ops
        keep &= wanted[np.minimum(cols.where >> 32, len(wanted) - 1)] & \
            (len(wanted) > (cols.where >> 32))
        return cols.take(keep)


def latest_step(cols: dict[str, RunColumns]) -> int:
    """The latest step either run has sent records of (-1: none)."""
    return max((int((c.when >> 24).max()) for c in cols.values() if len(c)), default=-1)


def directive_status(d: dict, names: dict[str, str]) -> str:
    again = f" (attempt {d['attempt']})" if d["attempt"] > 1 else ""
    return (f"escalating{again}: {d['site']} introduced a divergence; asking the agents of "
            f"{names['ref']} and {names['cand']} to capture the operations of "
            f"{', '.join(d['ops'])} at step {d['step']}")


def drill_status(r: dict) -> str:
    if not r["calls"]:
        return f"drill {r['site']} @ step {r['step']}: " + "; ".join(r["warnings"])
    if not r["differ"]:
        return (f"drill {r['site']} @ step {r['step']}: all {r['calls']} module calls match "
                "operation by operation")
    f = r["findings"][0]
    return (f"drill {r['site']} @ step {r['step']}: {r['differ']} of {r['calls']} module calls "
            f"differ; first: {f['phase']} {f['module']} microbatch {f['microbatch']}: "
            f"{f['kind']} at {f['op']}: {f['reason']}")
