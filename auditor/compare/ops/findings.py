"""What the op-level comparison reports: one `OpFinding` per compared module call, gathered in
an `OpReport` (docs/drill-down.md; the report's ``operations``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LISTED = 1000
"""Calls whose op-level findings the JSON report lists (the text report summarizes them all)."""



@dataclass
class OpFinding:
    """What the op-level comparison says of one module call."""

    step: int
    microbatch: int
    phase: str
    module: str
    call: int
    kind: str
    """"introduced", "inherited", "absent" (an operation the candidate lacks), "added" (one it
    runs and the reference does not), "unknown", or "identical" (every operation matches)."""
    op: str = ""
    """The operation named, as ``aten.mm (op 3)`` (the reference's numbering)."""
    reason: str = ""
    breach: bool = False
    finding: dict | None = None
    """The first differing output's finding (as the report's findings), when one differs."""
    structure: list[str] = field(default_factory=list)
    """How the runs' operation sequences differ (`auditor.compare.ops.align.describe`)."""
    compared: int = 0
    """Operations both runs ran, compared."""

    def as_dict(self) -> dict:
        return {"step": self.step, "microbatch": self.microbatch, "phase": self.phase,
                "module": self.module, "call": self.call, "kind": self.kind, "op": self.op,
                "reason": self.reason, "breach": self.breach, "finding": self.finding,
                "structure": self.structure, "compared": self.compared}

    def where(self) -> str:
        mb = f", microbatch {self.microbatch}" if self.microbatch >= 0 else ""
        call = f", call {self.call}" if self.call else ""
        return f"{self.phase} {self.module} @ step {self.step}{mb}{call}"


@dataclass
class OpReport:
    """The op-level comparison of two runs."""

    calls: list[OpFinding]
    """Every compared module call, in execution order."""
    warnings: list[str] = field(default_factory=list)

    @property
    def breaches(self) -> int:
        return sum(f.breach for f in self.calls)

    def differing(self) -> list[OpFinding]:
        return [f for f in self.calls if f.kind != "identical"]

    def as_dict(self) -> dict:
        diff = self.differing()
        return {"calls": len(self.calls), "breaches": self.breaches,
                "modules": sorted({f.module for f in self.calls}),
                "findings": [f.as_dict() for f in diff[:MAX_LISTED]],
                "findings_omitted": max(0, len(diff) - MAX_LISTED),
                "warnings": self.warnings}
