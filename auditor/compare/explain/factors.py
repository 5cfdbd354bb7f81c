"""Exact factors between two runs' tensors, and the counts that name them (docs/comparison.md).

A candidate that equals the reference times 4 is rarely a numerical accident: a count of the
runs' work (dp ranks, microbatches, pipeline microbatches, ranks) went into a division one run
made and the other did not — scale_grads=True, a sum where a mean was meant, a loss divided by
the accumulation steps — or a power of two was hard-coded. `name_factor` says which count a
measured ratio is, `factor_evidence` measures the ratio where the verdict did not (the bitwise
preset decides from fingerprints alone), and `annotate` writes what a breaching key's factor
means at its phase: at `update`, with the optimizer's gradient matching, a learning-rate ratio,
not a loss normalization.

Pure functions but for `annotate` and `factor_evidence`, which read a filled `Comparison`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from numaudit.auditor.compare.digests.integer_ratio import INTEGER_RTOL, MAX_NAMED, snap  # noqa: F401
from numaudit.auditor.compare.digests.metrics import EPS64, MACHINE_EPS
from numaudit.auditor.compare.measure import findings as F
from numaudit.wire.vocabulary import Phase

if TYPE_CHECKING:
    from numaudit.auditor.compare.measure.comparison import Comparison

PIECE_SCAN = 8192
"""Keys whose moments and sketches one `factor_evidence` call reads at most."""
SKETCH_RESID = 1e-6
"""Largest ||cand - a ref|| / ||cand|| of two sketches that `factor_evidence` calls a rescaling
by a (a float64 sketch of a x n copy differs from n x the sketch by rounding only)."""


@dataclass(frozen=True)
class Count:
    """A count of one run's work that a factor between the runs can be."""

    value: int
    name: str
    """What it counts, as the report says it ("dp ranks of ddp", "pp_microbatches of pp")."""
    why: str
    """What a factor of this count usually means (the likely cause)."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def name_factor(f: float, counts: Iterable[Count]) -> str:
    """What a factor f (cand over ref) is in words: "x4 = 4 pp_microbatches of pp: ..." or
    "x1/2 = 1/(2 dp ranks of ddp): ...", a power of two, or "" when f is no such number."""
    got = snap(f)
    if got is None:
        return ""
    n, inverse = got
    shown = f"x1/{n}" if inverse else f"x{n}"
    matches = [c for c in counts if c.value == n]
    if matches:
        names = " = ".join(dict.fromkeys(c.name for c in matches))
        whys = "; ".join(dict.fromkeys(c.why for c in matches))
        return (f"{shown} = 1/({n} {names})" if inverse else f"{shown} = {n} {names}") + \
            f": {whys}"
    if is_power_of_two(n):
        return (f"{shown}, a power of two no count of the runs' work explains (a constant "
                "factor hard-coded in one run: a loss or gradient divided or multiplied by it)")
    return f"{shown}, an integer ratio no count of the runs' work explains"


def run_counts(comp: Comparison, phase: int) -> list[Count]:
    """The counts of both runs' work a factor at `phase` can be: dp ranks (the addends of
    their loss reductions), microbatches a step, pipeline microbatches (the run label
    pp_microbatches, agents/capture/normalization.py note_schedule) and ranks."""
    memo = comp.memo.setdefault("run_counts", {})
    if phase in memo:
        return memo[phase]
    out: list[Count] = []
    is_grad = phase in (Phase.GRAD, Phase.OPTIM_GRAD, Phase.UPDATE)
    for side in ("cand", "ref"):
        cols = comp.cand if side == "cand" else comp.ref
        name = cols.name
        labels = comp.labels.get(side, {})
        dp = dp_size(comp, side)
        if dp > 1:
            out.append(Count(dp, f"dp ranks of {name}", (
                "gradients summed over the dp ranks where they should be averaged, or averaged "
                "where the loss was already normalized globally" if is_grad else
                "a mean over the dp ranks where their sum was meant (or the reverse): the "
                "per-rank loss normalization")))
        pp = labels.get("pp_microbatches", "")
        if pp.isdigit() and int(pp) > 1:
            scaled = labels.get("pp_param_grads", "")
            out.append(Count(int(pp), f"pp_microbatches of {name}", (
                f"{name}'s pipeline schedule {scaled or 'scales parameter gradients'}: "
                "scale_grads=True divides parameter gradients by n_microbatches" if is_grad else
                "the loss divided (or not) by the pipeline's microbatch count")))
        mbs = _microbatches_per_step(comp, side)
        if mbs > 1:
            out.append(Count(mbs, f"microbatches a step of {name}", (
                "gradients accumulated over the microbatches without dividing by their count, "
                "or divided where the reference does not" if is_grad else
                "a loss divided by the accumulation steps in one run only")))
        world = int(comp.memo.get("world_size", {}).get(side, 0) or 0)
        if world > 1 and world != dp:
            out.append(Count(world, f"ranks of {name}",
                             "a division (or sum) over all ranks where the dp ranks were meant"))
    memo[phase] = out
    return out


def dp_size(comp: Comparison, side: str) -> int:
    """The addends of a run's reductions over the batch (its dp size; 1 without any)."""
    lk = comp.cand_keys if side == "cand" else comp.ref_keys
    cols = comp.cand if side == "cand" else comp.ref
    g = np.flatnonzero(lk.reduced > 0)
    if not len(g):
        return 1
    rows = lk.first[g[:64]]
    return max((comp.catalog.pieces[int(c)].reduce_count for c in cols.layout[rows]), default=1)


def _microbatches_per_step(comp: Comparison, side: str) -> int:
    lk = comp.cand_keys if side == "cand" else comp.ref_keys
    if not len(lk):
        return 0
    mb = ((lk.when >> 4) & 0xFFFFF).astype(np.int64) - 1
    step = lk.when >> 24
    s0 = step.min()
    return len(np.unique(mb[(step == s0) & (mb >= 0)]))


def exact_factor(ref: np.ndarray, cand: np.ndarray, f: float, dtype: str) -> bool:
    """Whether every element of cand is ref x f to within one rounding of the dtype (and at
    least one element is not zero): the bytes prove the factor."""
    r = np.asarray(ref, np.float64).reshape(-1)
    c = np.asarray(cand, np.float64).reshape(-1)
    if r.shape != c.shape or not len(r) or not np.isfinite(r).all() or not np.isfinite(c).all():
        return False
    scaled = r * f
    if not np.any(scaled):
        return False
    eps = MACHINE_EPS.get(dtype, EPS64)
    return bool(np.all(np.abs(c - scaled) <= eps * np.abs(scaled) + 1e-300))


def factor_evidence(comp: Comparison, keys: np.ndarray) -> None:
    """Fill `norm_ratio`, `scaled_resid` and `scaled_by` for breaching keys whose verdict came
    from fingerprints alone (the exact metric of the bitwise preset), from both runs' payloads
    where they are (exactly) or their moments and sketches."""
    from numaudit.auditor.compare.digests.metrics import PayloadUnavailable
    from numaudit.auditor.compare.measure.payloads import logical_values
    from numaudit.auditor.compare.measure.slow import merge_side

    keys = np.asarray(keys, np.int64)[:PIECE_SCAN]
    if not len(keys):
        return
    if comp.scaled_by is None:
        comp.scaled_by = np.full(len(comp), np.nan)
    if comp.scaled_resid is None:
        comp.scaled_resid = np.full(len(comp), np.nan)
    R = merge_side(comp, comp.ref_index[keys], "ref", comp.catalog)
    C = merge_side(comp, comp.cand_index[keys], "cand", comp.catalog)
    ok = R["sketch_ok"] & C["sketch_ok"] & (R["k"] == C["k"])
    for j, i in enumerate(keys.tolist()):
        ri, ci = int(comp.ref_index[i]), int(comp.cand_index[i])
        try:
            rv, _, dt = logical_values(comp, "ref", ri)
            cv, _, _ = logical_values(comp, "cand", ci)
        except (PayloadUnavailable, KeyError, IndexError, ValueError):
            rv = cv = None
        if rv is not None and rv.shape == cv.shape:
            rn, cn = float(np.linalg.norm(rv)), float(np.linalg.norm(cv))
            if rn > 0 and cn > 0:
                comp.norm_ratio[i] = cn / rn
                resid = float(np.linalg.norm(cv.reshape(-1) - (cn / rn) * rv.reshape(-1))) / cn
                comp.scaled_resid[i] = resid
                got = snap(cn / rn)
                if got is not None:
                    n, inv = got
                    f = 1.0 / n if inv else float(n)
                    if exact_factor(rv, cv, f, dt):
                        comp.scaled_by[i] = f
                        comp.memo.setdefault("exact_factor", set()).add(i)
            continue
        if not ok[j]:
            continue
        rs, cs = R["sketch"][j], C["sketch"][j]
        rn = math.sqrt(R["sum_sq"][j]) if np.isfinite(R["sum_sq"][j]) else float(
            np.linalg.norm(rs))
        cn = math.sqrt(C["sum_sq"][j]) if np.isfinite(C["sum_sq"][j]) else float(
            np.linalg.norm(cs))
        if rn > 0 and cn > 0:
            a = cn / rn
            comp.norm_ratio[i] = a
            comp.scaled_resid[i] = float(np.linalg.norm(cs - a * rs)) / cn
            # float64 sketches of x f copies agree to rounding: a larger residual is no rescaling
            if comp.scaled_resid[i] <= SKETCH_RESID and snap(a) is not None:
                comp.scaled_by[i] = a


def phase_meaning(comp: Comparison, i: int) -> str:
    """What a uniform factor between the runs means at key i's phase."""
    phase = int(comp.when[i] & 0xF)
    if phase == Phase.UPDATE:
        site_id = int(comp.where[i] >> 32)
        role = int((comp.where[i] >> 28) & 0xF)
        step = int(comp.when[i] >> 24)
        j = comp.find(step, -1, Phase.OPTIM_GRAD, site_id, role)
        if j >= 0 and comp.verdict[j] != F.IGNORED and not comp.breach[j]:
            return (f"its optim_grad matched ({F.VERDICT_NAMES[int(comp.verdict[j])]}), so the "
                    "optimizer applied the same gradient with another step size: a learning "
                    "rate (or another optimizer hyper-parameter scaling the update) that "
                    "differs by this factor")
        if j >= 0 and comp.breach[j]:
            return "the gradient the optimizer consumed (optim_grad) already differs"
        return ("a learning rate or optimizer hyper-parameter ratio, or a gradient scaled "
                "before the optimizer (optim_grad not captured to tell)")
    if phase in (Phase.GRAD, Phase.OPTIM_GRAD):
        return ("a uniform factor on the gradients: their reduction over ranks (a sum for a "
                "mean), accumulation, a pipeline's scale_grads, gradient clipping or loss "
                "scaling")
    if phase in (Phase.LOSS, Phase.BWD):
        return "a uniform factor no declared loss normalization explains"
    return "a uniform factor"


def annotate(comp: Comparison) -> None:
    """Say, on every breaching key that is the reference times one factor, what the factor is
    and what it means at the key's phase; keys decided by fingerprints alone get the factor
    measured first (`factor_evidence`). Memoized in `comp.notes`."""
    if comp.scaled_by is None:
        comp.scaled_by = np.full(len(comp), np.nan)
    diverged = comp.breach & (comp.verdict == F.DIVERGED)
    blind = diverged & np.isnan(comp.norm_ratio) & (comp.ref_index >= 0) & (comp.cand_index >= 0)
    if blind.any():
        factor_evidence(comp, np.flatnonzero(blind))
    exact = comp.memo.get("exact_factor", set())
    for i in np.flatnonzero(diverged & np.isfinite(comp.scaled_by)).tolist():
        f = float(comp.scaled_by[i])
        phase = int(comp.when[i] & 0xF)
        named = name_factor(f, run_counts(comp, phase))
        if phase == Phase.UPDATE and "no count of the runs' work" in named:
            named = ""  # an update's factor no count explains is said by its phase's meaning
        resid = comp.scaled_resid[i] if comp.scaled_resid is not None else np.nan
        scaled_ref = comp.bwd_factor != 1.0 and phase == Phase.BWD
        beyond = " beyond the factor the runs' loss normalizations imply" if scaled_ref else ""
        if i in exact:
            how = "exactly (every element, from both runs' bytes)"
        else:
            how = f"(what remains after that factor: {F.format_float(resid)} relative)"
        head = f"{comp.cand.name} is {comp.ref.name} scaled by {f:.3g}{beyond} {how}"
        if named:  # what the count is, for a report that says the factor once for many keys
            comp.memo.setdefault("factor_names", {})[i] = named
        comp.notes.setdefault(i, []).append(
            f"{head}: {named + '; ' if named else ''}{phase_meaning(comp, i)}")
