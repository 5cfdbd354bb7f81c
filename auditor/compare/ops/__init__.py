"""Drill-down: from the module that introduced a divergence to the operation inside it.

Owns aligning two runs' operations inside a module call (`align`), the op-level comparison that
finds the first operation whose output differs while its inputs match (`comparison`), why it
differs (`causes`), the plans for a rerun with operations captured (`drill`) and the escalation of
a live comparison (`escalation`; docs/drill-down.md). Hand-off: an Operations section for the
report, read after the module-level comparison is final.
"""
