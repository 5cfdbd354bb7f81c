"""Which keys a comparison looks at: a range of steps, some phases.

A run resumed from a checkpoint at step k has no records before k: compared with the
uninterrupted run as a whole, every earlier key would be missing. `auditor compare --steps k:`
compares both runs from step k on; `auditor checkpoint` compares the ``state`` phase of one
step. What is left out is said in the report's warnings, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.read.columns import RunColumns, unpack_when
from numaudit.wire.vocabulary import PHASE_IDS, PHASE_NAMES


@dataclass(frozen=True)
class KeySelection:
    """Steps ``first <= step < stop`` (None: unbounded) and `phases` (empty: all)."""

    first: int | None = None
    stop: int | None = None
    phases: frozenset[int] = frozenset()
    asked: bool = True
    """The user asked for this selection (`--steps`): the report says what it left out. False
    for a command whose own subject is the selection (`auditor checkpoint`: phase state)."""

    @classmethod
    def parse_steps(cls, text: str, phases: frozenset[int] = frozenset()) -> KeySelection:
        """``K:``, ``K:M``, ``:M`` or ``K`` (one step); ValueError naming what is wrong."""
        lo, sep, hi = text.partition(":")
        if not lo.strip() and not hi.strip():
            raise ValueError(f"steps: {text!r} is not K:, K:M, :M or K (integers)")
        try:
            first = int(lo) if lo.strip() else None
            stop = int(hi) if hi.strip() else None
        except ValueError:
            raise ValueError(f"steps: {text!r} is not K:, K:M, :M or K (integers)") from None
        if not sep:
            stop = None if first is None else first + 1
        if first is not None and stop is not None and stop <= first:
            raise ValueError(f"steps: {text!r} selects no step (M must exceed K)")
        return cls(first, stop, phases)

    @classmethod
    def of_phases(cls, *names: str) -> KeySelection:
        return cls(phases=frozenset(PHASE_IDS[n] for n in names))

    def apply(self, cols: RunColumns) -> RunColumns:
        step, _, phase = unpack_when(cols.when)
        keep = np.ones(len(cols), dtype=bool)
        if self.first is not None:
            keep &= step >= self.first
        if self.stop is not None:
            keep &= step < self.stop
        if self.phases:
            keep &= np.isin(phase, np.fromiter(self.phases, np.int64))
        return cols if keep.all() else cols.take(keep)

    def describe(self) -> str:
        """What the report's warnings say of the selection ("" when not asked for)."""
        if not self.asked:
            return ""
        parts = []
        if self.first is not None or self.stop is not None:
            if self.stop is not None and self.first is not None and self.stop == self.first + 1:
                parts.append(f"step {self.first}")
            else:
                lo = "" if self.first is None else f"from step {self.first}"
                hi = "" if self.stop is None else f"before step {self.stop}"
                parts.append(f"steps {' '.join(p for p in (lo, hi) if p)}")
        if self.phases:
            parts.append("phase " + ", ".join(sorted(PHASE_NAMES[p] for p in self.phases)))
        return (f"only {' and '.join(parts)} compared (as asked); the runs' other keys are "
                "left out of this report")
