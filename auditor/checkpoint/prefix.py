"""Names that differ by a prefix: `dcp.save({"model": sd})` against a flat file of `sd`.

DCP names a nested state dict's entries by their path (``model.layers.0.weight``); a
safetensors file or a plain ``torch.save(sd)`` holds ``layers.0.weight``. Compared as they are,
every entry is missing on both sides. `prefix_match` finds the prefix that one side's names
carry over the other's and the two-line `--map` that maps CAND's names onto REF's; it is
*complete* when applying it leaves nothing ambiguous: every CAND name the map renames lands on
a REF name that no CAND name already holds (`auditor checkpoint` then applies it, saying so).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

MIN_MATCHED = 2
"""Names a prefix must explain before it is suggested (one pair is a coincidence)."""


@dataclass(frozen=True)
class PrefixMatch:
    """REF's names are CAND's with `prefix` (``ref_has_prefix``), or the other way round."""

    prefix: str
    ref_has_prefix: bool
    matched: int
    """CAND names the map sends onto a REF name."""
    cand_names: int
    complete: bool

    @property
    def cand_glob(self) -> str:
        return "**" if self.ref_has_prefix else f"{self.prefix}**"

    @property
    def ref_glob(self) -> str:
        return f"{self.prefix}**" if self.ref_has_prefix else "**"

    def toml(self) -> str:
        """The map file's text."""
        return f'[[map]]\ncand = "{self.cand_glob}"\nref = "{self.ref_glob}"\n'

    def describe(self) -> str:
        """The names' relation in words: "every name in ref is 'model.' + a name in cand"."""
        side, other = ("ref", "cand") if self.ref_has_prefix else ("cand", "ref")
        every = "every" if self.complete else f"{self.matched} of the"
        return f"{every} name{'s' if not self.complete else ''} in {side} " \
               f"{'is' if self.complete else 'are'} {self.prefix!r} + a name in {other}"


def prefix_match(ref: Iterable[str], cand: Iterable[str]) -> PrefixMatch | None:
    """The prefix that maps most of CAND's names onto REF's (None when none maps
    MIN_MATCHED or more, or two prefixes tie)."""
    ref_set, cand_set = set(ref), set(cand)
    only_ref, only_cand = ref_set - cand_set, cand_set - ref_set
    counts: Counter = Counter()
    for names, others, ref_side in ((only_ref, only_cand, True), (only_cand, only_ref, False)):
        for name in names:
            for k, ch in enumerate(name):
                if ch == "." and name[k + 1:] in others:
                    counts[(name[:k + 1], ref_side)] += 1
    best = counts.most_common(2)
    if not best or best[0][1] < MIN_MATCHED or (len(best) > 1 and best[1][1] == best[0][1]):
        return None
    (prefix, ref_side), matched = best[0]
    if "*" in prefix:
        return None
    if ref_side:  # every CAND name is renamed to prefix + name
        complete = not (cand_set & ref_set) and matched == len(cand_set)
    else:  # CAND names that start with the prefix lose it; the others keep theirs
        renamed = [c for c in cand_set if c.startswith(prefix)]
        complete = matched == len(renamed) and \
            not any(c[len(prefix):] in cand_set for c in renamed)
    return PrefixMatch(prefix, ref_side, matched, len(cand_set), complete)
