"""How a run reduced its per-rank losses over its dp ranks, judged on the losses' own evidence.

The agent records each rank's loss as a mean over the rank's share unless the capture says
otherwise (capture's default reduce="mean" for phase loss). Code that normalizes each rank's
loss by the whole batch's count (torchtitan), or sums, makes per-rank losses that add up to the
other run's loss: merged as a mean they read "scaled by 0.50" ahead of any real difference.
`decide` tries the sum where the mean breaches (docs/comparison.md, "Conventions from the
evidence"):

- the sum *explains* the losses when it makes the other run's loss at some loss keys and the
  mean makes it at none the sum does not (a bug that changes the data elsewhere leaves other
  keys differing under both);
- a run that declared a loss normalization of that kind (loss_normalization "global_mean" or
  "sum", in its grad_scale_source) is taken at its word, and no advice is given;
- otherwise the parameter gradients decide: the sum is taken unless they were not captured (or
  are all zero), or they carry the very factor the mean leaves on the loss (the loss's scale
  then reaches training, and the loss is the finding). Gradients that differ otherwise are a
  finding of their own, said as such, and leave the losses to their convention.

A reduction the capture declared (reduce="sum") is never second-guessed: only losses recorded
as means over several dp ranks are tried (a mean is open to the evidence, only ever towards a
sum).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from numaudit.auditor.compare.conventions.grad_evidence import GradEvidence, differ_text, sharing
from numaudit.auditor.compare.explain import factors
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import Comparison
from numaudit.auditor.compare.read.columns import RunColumns
from numaudit.auditor.compare.read.pieces import REDUCE_MEAN
from numaudit.wire.vocabulary import Phase

LOSS = Phase.LOSS
GLOBAL_NORMALIZATIONS = ("global_mean", "sum")
"""Declared loss normalizations (agents/capture/normalization.py) whose per-rank losses add up to
the whole batch's loss: each rank's sum over the global count, or a plain sum."""


@dataclass
class LossDecision:
    """What `decide` concluded about one run's per-rank losses."""

    side: str | None
    """"ref" or "cand": the run whose losses are merged as sums; None: left as means."""
    warning: str = ""
    """The run-level warning when a sum is taken."""
    note: str = ""
    """The note on every loss key when a sum is taken."""
    refusals: dict[int, str] = field(default_factory=dict)
    """Breaching loss key -> why it stays a breach, when no sum is taken."""


def compared(comp: Comparison, phase: int) -> np.ndarray:
    """Keys of a phase both runs hold and the policy compares."""
    return np.flatnonzero((phase == (comp.when & 0xF)) & (comp.verdict != F.IGNORED)
                          & (comp.ref_index >= 0) & (comp.cand_index >= 0))


def declared_normalization(info: dict) -> str:
    """The loss normalization a run declared when it is one whose per-rank losses add up
    (`GLOBAL_NORMALIZATIONS`), read from its ranks' grad_scale sources; "" otherwise."""
    sources = info.get("grad_scale_sources") or []
    found = {s.removeprefix("declared: ").split(" ", 1)[0] for s in sources
             if s.startswith("declared: ")}
    if len(found) == 1 and len(sources) and all(s.startswith("declared: ") for s in sources):
        name = found.pop()
        return name if name in GLOBAL_NORMALIZATIONS else ""
    return ""


def decide(comp: Comparison, rc: RunColumns, cc: RunColumns, run: Callable[..., Comparison],
           ev: GradEvidence, infos: dict[str, dict]) -> LossDecision | None:
    """Whether a run's per-rank losses are sums (module docstring); None when no loss key
    breaches or no run's losses are means over several dp ranks."""
    loss = compared(comp, LOSS)
    if not len(loss) or not comp.breach[loss].any():
        return None
    side = next((s for s in ("cand", "ref") if _mean_side(comp, loss, s)), None)
    if side is None:
        return None
    sub = tuple(c.take(np.flatnonzero((c.when & 0xF) == LOSS)) for c in (rc, cc))
    summed = run(sub, loss_sum=side)
    t = _Trial(comp, summed, side, loss)
    declared = declared_normalization(infos[side])
    if not t.explains:
        return LossDecision(None, refusals={i: t.unexplained() for i in t.breaching()})
    if declared:
        return LossDecision(side, t.warning(declared=declared), t.note(declared=declared))
    if ev.missing:
        return LossDecision(None, refusals={i: t.refused(ev.missing) for i in t.breaching()})
    shared = sharing(comp, ev, t.mean_ratio)
    if len(shared):
        why = (f"the parameter gradients are x{F.format_float(t.mean_ratio)} too "
               f"({differ_text(comp, ev, shared)}): the loss's scale reaches training, so it is "
               "no reporting convention")
        return LossDecision(None, refusals={i: t.refused(why) for i in t.breaching()})
    return LossDecision(side, t.warning(ev=ev), t.note(ev=ev))


def _mean_side(comp: Comparison, keys: np.ndarray, side: str) -> bool:
    """Every one of these keys is, in this run, a mean over several dp ranks' addends."""
    lk = comp.ref_keys if side == "ref" else comp.cand_keys
    g = (comp.ref_index if side == "ref" else comp.cand_index)[keys]
    return bool(len(g)) and bool(((lk.reduced[g] == REDUCE_MEAN) & lk.partial[g]).all())


class _Trial:
    """The loss keys under both reductions, and the texts that say what they show."""

    def __init__(self, comp: Comparison, summed: Comparison, side: str, loss: np.ndarray):
        self.comp, self.side, self.loss = comp, side, loss
        self.name = comp.cand.name if side == "cand" else comp.ref.name
        self.other = comp.ref.name if side == "cand" else comp.cand.name
        self.n = factors.dp_size(comp, side)
        keys = compared(summed, LOSS)
        sum_ok = {(int(summed.when[i]), int(summed.where[i])) for i in keys[~summed.breach[keys]]}
        mean_ok = {(int(comp.when[i]), int(comp.where[i])) for i in loss[~comp.breach[loss]]}
        self.held = np.array([(int(comp.when[i]), int(comp.where[i])) in sum_ok for i in loss],
                             bool)
        self.explains = bool(self.held.any()) and mean_ok <= sum_ok
        self.mean_only = len(mean_ok - sum_ok)
        self.mean_ratio = _median_ratio(comp, loss[self.held]) if self.held.any() else \
            _median_ratio(comp, loss)
        self.sum_ratio = _median_ratio(summed, keys)

    def breaching(self) -> list[int]:
        return np.flatnonzero(self.comp.breach & ((self.comp.when & 0xF) == LOSS)).tolist()

    def _where(self) -> str:
        held = int(self.held.sum())
        return "" if held == len(self.loss) else f" at {held} of {len(self.loss)} loss keys"

    def warning(self, *, declared: str = "", ev: GradEvidence | None = None) -> str:
        mean = f"as a mean, the default for phase loss{_times(self.mean_ratio, ', x')}"
        if declared:
            return (f"{self.name}'s per-rank losses are sums over its {self.n} dp ranks, as its "
                    f"declared loss_normalization={declared!r} says: merged as a sum they equal "
                    f"{self.other}'s loss{self._where()} ({mean}); its losses are compared as "
                    "sums")
        head = (f"{self.name}'s per-rank losses are sums over its {self.n} dp ranks, not means: "
                f"merged as a sum they equal {self.other}'s loss{self._where()} ({mean})")
        if ev is not None and len(ev.bad):
            grads = (f"; the parameter gradients differ ({differ_text(self.comp, ev)}), but none "
                     f"by that x{F.format_float(self.mean_ratio)}: what differs is in them, not "
                     "in the loss's reduction")
        else:
            grads = ", and the parameter gradients agree"
        return (f"{head}{grads}; its losses are compared as sums (capture(loss, reduce=\"sum\") "
                "declares it)")

    def note(self, *, declared: str = "", ev: GradEvidence | None = None) -> str:
        mean = f"merged as a mean{_times(self.mean_ratio, ' x', ' not')}"
        if declared:
            return (f"{self.name}'s per-rank losses are sums, as its declared "
                    f"loss_normalization={declared!r} says: merged as a sum they equal "
                    f"{self.other}'s loss, {mean}")
        gradients = ("the parameter gradients agreeing" if ev is None or not len(ev.bad) else
                     "the parameter gradients differing, but not by that factor")
        return (f"{self.name}'s per-rank losses are sums (each rank's loss normalized by the "
                f"whole batch's count, or a plain sum): merged as a sum they equal "
                f"{self.other}'s loss, {mean}; inferred from the evidence, with {gradients}")

    def refused(self, why: str) -> str:
        """A sum that explains the losses, refused for `why` (about the gradients)."""
        return (f"merged as a sum over its {self.n} dp ranks, {self.name}'s per-rank losses "
                f"equal {self.other}'s loss{self._where()}, but {why}: not taken as a convention")

    def unexplained(self) -> str:
        """Neither reduction explains the losses (or each explains some)."""
        held = int(self.held.sum())
        if held and self.mean_only:
            return (f"{self.name}'s per-rank losses equal {self.other}'s loss merged as a sum "
                    f"over its {self.n} dp ranks at {held} of {len(self.loss)} loss keys and as "
                    f"a mean at {self.mean_only}: no one loss reduction explains them")
        ratios = {"mean": self.mean_ratio, "sum": self.sum_ratio}
        return (f"neither as a mean nor as a sum over its {self.n} dp ranks do {self.name}'s "
                f"per-rank losses make {self.other}'s loss{_ratios_text(ratios)}: no loss "
                "reduction explains the difference")


def _median_ratio(comp: Comparison, keys: np.ndarray) -> float:
    """The keys' median norm ratio (cand over ref): 1 for identical keys."""
    r = np.where(comp.verdict[keys] == F.IDENTICAL, 1.0, comp.norm_ratio[keys])
    r = r[np.isfinite(r)]
    return float(np.median(r)) if len(r) else float("nan")


def _ratios_text(ratios: dict) -> str:
    """" (mean x0.5, sum x1.3)" with the ratios that were measured (a verdict from fingerprints
    alone measures none)."""
    shown = [f"{k}{_times(v, ' x')}" for k, v in ratios.items() if np.isfinite(v)]
    return f" ({', '.join(shown)})" if shown else ""


def _times(ratio: float, before: str, unmeasured: str = "") -> str:
    """``before`` + the ratio where it was measured, else ``unmeasured``."""
    return f"{before}{F.format_float(ratio)}" if np.isfinite(ratio) else unmeasured
