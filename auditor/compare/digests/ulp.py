"""ULP distances that read as precision, also across zero.

Between two floats of one sign, the distance in units in the last place is the count of
representable values between them: the difference of their bits taken as sign-magnitude
integers (`auditor.compare.digests.metrics.ordered_bits`). Across zero that count is dominated by
the exponent range: -2e-3 and +2e-3 in float32 are 2 x 0x3B03126F = 1.98e9 values apart, which
says nothing about 4e-3 at that magnitude. So a pair of opposite signs is measured in ULPs of
the larger magnitude instead, |c - r| / ulp(max(|r|, |c|)): about 2^24 for that pair (twice
the value, at float32's 2^-23 per ULP), the same measure a same-sign pair of that size gets.
"""

from __future__ import annotations

import numpy as np

from numaudit.auditor.compare.digests.metrics import MACHINE_EPS, ordered_bits

MIN_NORMAL_EXPONENT = {
    "float64": -1022, "float32": -126, "float16": -14, "bfloat16": -126,
    "float8_e4m3fn": -6, "float8_e4m3fnuz": -7, "float8_e5m2": -14, "float8_e5m2fnuz": -15,
    "float8_e8m0fnu": -127,
}
"""log2 of each float dtype's smallest normal number: below it the spacing stays constant."""


def ulp_of(x: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of `dtype`'s values at |x| (float64 in, float64 out)."""
    emin = MIN_NORMAL_EXPONENT.get(dtype, -1022)
    _, e = np.frexp(np.abs(x))
    exponent = np.where(x != 0, np.maximum(e.astype(np.int64) - 1, emin), emin)
    return np.ldexp(MACHINE_EPS.get(dtype, 2.0 ** -52), exponent)


def ulp_distance(ref_bits: np.ndarray, cand_bits: np.ndarray, ref: np.ndarray,
                 cand: np.ndarray, dtype: str) -> float:
    """The largest ULP distance between the runs' elements (raw bits of one float dtype, and
    their float64 values): same-sign pairs by their bits, opposite-sign pairs in ULPs of the
    larger magnitude; NaN elements count 0 (their disagreement is counted elsewhere)."""
    ob_r = ordered_bits(ref_bits.reshape(-1))
    ob_c = ordered_bits(cand_bits.reshape(-1))
    d = np.abs(ob_c - ob_r).astype(np.float64)
    r, c = ref.reshape(-1), cand.reshape(-1)
    across = (np.sign(ob_r) * np.sign(ob_c) < 0) & np.isfinite(r) & np.isfinite(c)
    if across.any():
        big = np.maximum(np.abs(r[across]), np.abs(c[across]))
        d[across] = np.abs(c[across] - r[across]) / ulp_of(big, dtype)
    d[np.isnan(r) | np.isnan(c)] = 0
    return float(d.max(initial=0))
