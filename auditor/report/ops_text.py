"""The text report's drill-down lines: the rerun that drills into the first divergence's module,
and the op-level findings (docs/drill-down.md), from the JSON report's ``drill`` and ``ops``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable


def op_groups(calls: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """Calls that say the same thing (phase, module, step, kind, operation), in order."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for f in calls:
        groups[(f["phase"], f["module"], f["step"], f["kind"], f["op"])].append(f)
    return list(groups.items())


def print_drill(con, para: Callable[[str, int, str], None], doc: dict) -> None:
    """Under the first divergence: the rerun to drill into it; then the Operations section."""
    from rich.text import Text

    drill = doc.get("drill")
    if drill:
        para(f"drill: {drill['text']}", 2, "")
    ops = doc.get("ops")
    if not ops:
        return
    con.print()
    n, diff = ops["calls"], ops["findings"]
    con.print(Text(f"Operations (drill-down): {n} module call{'s' if n != 1 else ''} compared"
                   f" operation by operation, {len(diff) + ops.get('findings_omitted', 0)} "
                   "differ", style="bold"))
    if not diff:
        para("every operation of every compared call matches", 2, "")
    for (phase, module, step, kind, op), calls in op_groups(diff):
        first = calls[0]
        total = sum(1 for f in diff if (f["phase"], f["module"], f["step"]) ==
                    (phase, module, step))
        mbs = sorted({f["microbatch"] for f in calls})
        where = (f"microbatch {mbs[0]}" if len(mbs) == 1 else
                 f"{len(calls)} of {total} differing calls (microbatches {mbs[0]}-{mbs[-1]})")
        head = f"{phase} {module} @ step {step}, {where}: "
        head += f"{kind} at {op}" if op else kind
        para(head, 2, "red" if first["breach"] else "yellow")
        if first.get("reason"):
            para(first["reason"], 4, "")
        for line in first.get("structure", [])[:3]:
            para(f"structure: {line}", 4, "")
    for w in ops.get("warnings", []):
        para(f"- {w}", 2, "")
