"""Whether a measured ratio is a count: n or 1/n for an integer n (`snap`).

Pure and import-free, so that both the slow path (`auditor.compare.measure.slow`, which names a
scalar's difference a rescaling only when it is a count) and the factor names
(`auditor.compare.explain.factors`) use the one definition.
"""

from __future__ import annotations

import math

INTEGER_RTOL = 1e-5
"""How close a ratio must be to an integer n (or 1/n) to be called n: far below any tolerance
that would let a real difference through, far above float32 rounding of a norm ratio."""
MAX_NAMED = 1 << 20
"""Integers beyond this are not named as factors (they are no count of a run's work)."""


def snap(f: float, rtol: float = INTEGER_RTOL) -> tuple[int, bool] | None:
    """(n, inverse) when f is n or 1/n for an integer 2 <= n <= MAX_NAMED within rtol."""
    if not (math.isfinite(f) and f > 0):
        return None
    for value, inverse in ((f, False), (1.0 / f, True)):
        n = round(value)
        if 2 <= n <= MAX_NAMED and abs(value - n) <= rtol * n:
            return n, inverse
    return None
