"""Why a saved state entry (phase ``state``) differs.

Entries of a checkpoint do not feed one another: "the previous capture is identical" says
nothing about them. What does say something is how the two tensors differ. A conversion that
stores a tensor transposed, or reorders a dimension (attention heads permuted for rotary
embeddings), keeps every value and moves it: the moments (sum, sum of squares, extremes,
counts) agree within float64 rounding while the fingerprint, a function of each element's
position, does not, and the sketch puts the two far apart. A value changed in place (one
ulp, a perturbed element) moves the moments or leaves the sketch near.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.payloads import logical_values

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison

SUM_RTOL = 1e-9
"""Sums of the same values summed in another order agree to about n * 2**-53 relative."""
FAR = 1e-3
"""Relative L2 distance (from the sketches) beyond which values moved rather than changed."""


def state_cause(comp: Comparison, i: int) -> F.Cause:
    key = comp.key(i)
    base = (f"{key.site} as saved differs (a checkpoint entry: nothing upstream to inherit "
            "from)")
    moved = _hint(_permuted, comp, i)
    values = _hint(_single_values, comp, i)
    if values is not None:
        base = (f"{key.site} is {values[0]} in {comp.ref.name}, {values[1]} in "
                f"{comp.cand.name} (a checkpoint entry: nothing upstream to inherit from)")
    if moved:
        code = int(comp.ref_keys.shape[int(comp.ref_index[i])])
        shape: tuple[int, ...] = comp.catalog.shapes[code][0] if code >= 0 else ()
        square = len(shape) == 2 and shape[0] == shape[1]
        return F.Cause("introduced", (
            f"{key.site} holds the same values in other positions: equal counts, sums and "
            f"extremes, another fingerprint, relative L2 distance {moved:.2g} — a permutation "
            + ("(a square matrix stored transposed?) " if square else "")
            + "by a conversion or a resharding that moved elements: a transpose or a "
            "reordered dimension the map does not declare"))
    return F.Cause("introduced", base)


def _permuted(comp: Comparison, i: int) -> float | None:
    """The sketch's relative L2 distance when the moments say the same multiset of values
    and the sketch says far apart; None otherwise."""
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    if ri < 0 or ci < 0 or not comp.ref_keys.has_moments[ri] or not comp.cand_keys.has_moments[ci]:
        return None
    if comp.ref_keys.partial[ri] or comp.cand_keys.partial[ci]:
        return None
    R, C = _merged(comp, "ref", ri), _merged(comp, "cand", ci)
    if R is None or C is None:
        return None
    for c in ("nan", "posinf", "neginf", "min", "max", "abs_max"):
        if float(R[c][0]) != float(C[c][0]):
            return None
    for c in ("sum", "sum_sq"):
        r, s = float(R[c][0]), float(C[c][0])
        scale = max(abs(r), abs(s), float(R["sum_sq"][0]) ** 0.5, 1e-300)
        if abs(r - s) > SUM_RTOL * scale:
            return None
    norm = float(np.linalg.norm(R["sketch"]))
    if norm == 0 or not math.isfinite(norm) or len(R["sketch"]) != len(C["sketch"]):
        return None
    dist = float(np.linalg.norm(R["sketch"] - C["sketch"])) / norm
    return dist if dist > FAR else None


def _hint(fn, comp: Comparison, i: int):
    """`fn(comp, i)`, or None where it cannot read what it needs (a closed store, a payload not
    kept): a hint left unsaid, never a failed comparison, and one hint's failure never another's."""
    try:
        return fn(comp, i)
    except Exception:
        return None


def _single_values(comp: Comparison, i: int) -> tuple[str, str] | None:
    """Both sides' value of a one-element entry (a step count, a learning rate, a dataloader's
    position), from the payloads; None when either is not one element."""
    ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
    if ri < 0 or ci < 0:
        return None
    for keys, g in ((comp.ref_keys, ri), (comp.cand_keys, ci)):
        code = int(keys.shape[g])
        if code < 0 or math.prod(comp.catalog.shapes[code][0]) != 1:
            return None  # only one element is worth printing: no payload read for the rest
    out = []
    for side, g in (("ref", ri), ("cand", ci)):
        values, _, dtype = logical_values(comp, side, g)
        if values.size != 1:
            return None
        x = float(values.reshape(-1)[0])
        out.append(_number(x, str(dtype)))
    return out[0], out[1]


def _number(x: float, dtype: str) -> str:
    """`x` as its dtype prints it: shortest round-trip digits (an integer dtype's as one)."""
    if not dtype.startswith(("float", "bfloat", "complex")) and math.isfinite(x) \
            and x == int(x) and abs(x) < 2 ** 53:
        return str(int(x))
    if dtype == "float32":
        return str(np.float32(x))
    if dtype == "float64" or not math.isfinite(x):
        return repr(x)
    return f"{x:.4g}"  # 16-bit floats: 3-4 significant digits are all they hold


def _merged(comp: Comparison, side: str, g: int) -> dict | None:
    """One key's moments and sketch summed over its pieces (placed pieces of one sketch
    scheme only; None otherwise)."""
    lk = comp.ref_keys if side == "ref" else comp.cand_keys
    cols = comp.ref if side == "ref" else comp.cand
    rows = lk.taken_row[lk.taken_start[g]:lk.taken_start[g + 1]]
    if not len(rows) or not all(comp.catalog.placed[int(x)] for x in cols.layout[rows]):
        return None
    d = comp.catalog.fetch_digests(cols.rid[rows])
    if len(set(d["sketch_k"].tolist())) != 1 or int(d["sketch_k"][0]) == 0 \
            or (d["sketch_seed"] != comp.catalog.sketch_seed).any():
        return None
    out = {c: [float(np.sum(d[c]))] for c in ("nan", "posinf", "neginf", "sum", "sum_sq")}
    out["min"], out["max"] = [float(np.min(d["min"]))], [float(np.max(d["max"]))]
    out["abs_max"] = [float(np.max(d["abs_max"]))]
    out["sketch"] = np.sum(d["sketch"], axis=0)
    return out
