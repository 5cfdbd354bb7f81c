"""Aligning two runs' operations inside one module call (docs/drill-down.md).

Operations are aligned by their order and their names, as a diff aligns lines: an operation
one run has and the other lacks is said as such (a collective a parallelism adds or leaves
out, a cast to another dtype, an operation split or fused) instead of shifting every
operation after it onto the wrong partner. Pure functions over (ordinal, name) lists.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from numaudit.wire.ops import is_cast, is_collective


@dataclass
class Alignment:
    """Which operations of one module call pair up, and where the others sit."""

    pairs: list[tuple[int, int]] = field(default_factory=list)
    """(ref ordinal, cand ordinal), in order."""
    only_ref: list[int] = field(default_factory=list)
    only_cand: list[int] = field(default_factory=list)
    place: dict[tuple[str, int], float] = field(default_factory=dict)
    """("ref" | "cand", ordinal) of an unpaired operation -> its place in the reference's order
    (a cand-only operation sits half a step after the pair before it)."""
    names: dict[tuple[str, int], str] = field(default_factory=dict)

    def cand_of(self) -> dict[int, int]:
        return {c: r for r, c in self.pairs}

    def unpaired(self) -> list[tuple[float, str, int]]:
        """(place, side, ordinal) of every unpaired operation, in the reference's order."""
        return sorted((self.place[(s, o)], s, o) for s, ops in (("ref", self.only_ref),
                                                                 ("cand", self.only_cand))
                      for o in ops)


def align_ops(ref: list[tuple[int, str]], cand: list[tuple[int, str]]) -> Alignment:
    """Align two runs' (ordinal, name) operation lists of one module call."""
    out = Alignment()
    for side, ops in (("ref", ref), ("cand", cand)):
        for o, name in ops:
            out.names[(side, o)] = name
    if [n for _, n in ref] == [n for _, n in cand]:
        out.pairs = [(r, c) for (r, _), (c, _) in zip(ref, cand)]
        return out
    sm = difflib.SequenceMatcher(None, [n for _, n in ref], [n for _, n in cand],
                                 autojunk=False)
    last_ref = -1.0
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                out.pairs.append((ref[i][0], cand[j][0]))
                last_ref = ref[i][0]
            continue
        for i in range(i1, i2):
            out.only_ref.append(ref[i][0])
            out.place[("ref", ref[i][0])] = ref[i][0]
        base = ref[i2 - 1][0] if i2 > i1 else last_ref
        for k, j in enumerate(range(j1, j2)):
            out.only_cand.append(cand[j][0])
            out.place[("cand", cand[j][0])] = base + (k + 1) / (j2 - j1 + 1)
        if i2 > i1:
            last_ref = ref[i2 - 1][0]
    return out


def describe(al: Alignment, ref: str, cand: str) -> list[str]:
    """What the unpaired operations say: collectives one run adds or lacks, casts, operations
    the runs decompose otherwise; one line per run of consecutive unpaired operations."""
    lines = []
    groups: list[list[tuple[float, str, int]]] = []
    for item in al.unpaired():
        if groups and item[0] - groups[-1][-1][0] <= 1.0:
            groups[-1].append(item)
        else:
            groups.append([item])
    for g in groups:
        lines.append(_describe_group(al, g, ref, cand))
    return lines


def unpaired_kind(name: str) -> str:
    """"collective", "cast" or "operation"."""
    if is_collective(name):
        return "collective"
    if is_cast(name):
        return "cast"
    return "operation"


def op_text(al: Alignment, side: str, o: int) -> str:
    return f"{al.names[(side, o)]} (op {o})"


def _describe_group(al: Alignment, g: list, ref: str, cand: str) -> str:
    sides = {s for _, s, _ in g}
    names = {s: [op_text(al, s, o) for _, s2, o in g if s2 == s] for s in sides}
    if sides == {"ref", "cand"}:
        return (f"{', '.join(names['ref'])} in {ref} are {', '.join(names['cand'])} in {cand}: "
                "the runs decompose this computation otherwise (a parallelism may split or "
                "fuse an operation); compared again from the next operation both run")
    side = sides.pop()
    kinds = {unpaired_kind(al.names[(side, o)]) for _, _, o in g}
    who, other = (cand, ref) if side == "cand" else (ref, cand)
    what = {"collective": "the collective", "cast": "the cast"}.get(kinds.pop(), "the operation") \
        if len(kinds) == 1 else "the operations"
    return f"{who} runs {what} {', '.join(names[side])}, which {other} does not"
