"""Align two runs: key names, site normalization and renames, execution order.

Two runs are aligned on the key ``(step, microbatch, phase, site, role, index, call)``. Sites are
normalized the same way the agent does (wrapper components stripped), then the policy's rename
rules apply, so a candidate whose stages were rebuilt under other module names still aligns.

Execution order (what "first" means in "first divergence") is documented in
docs/comparison.md; the pieces of it that are pure functions live here:

- steps ascending; within a step the parameter values come first (the agent captures them at the
  end of the step but before ``optimizer.step()``, so they are the weights the step's forward
  used), then microbatches ascending, then the parameter gradients (accumulated over the step);
- within a microbatch: input < fwd < loss < bwd;
- within a phase: pipeline stage order (reversed for bwd, which runs the last stage first), then
  capture order: the order the agent's hooks fired, numbered by the agent on the training thread
  (`Record.capture_order`; `auditor.compare.read.positions` reads a key's number across ranks,
  `auditor.compare.measure.order` across the two runs). Records of an agent before those numbers are
  ordered by record id, the order they were stored in, which only approximates it (records
  carrying a payload are stored after the others of their batch).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from numaudit.wire.vocabulary import PHASE_NAMES, ROLE_NAMES, Phase

# Rank of each phase inside a microbatch (per-microbatch phases) or a step (per-step phases).
PHASE_RANK: dict[int, int] = {
    Phase.PARAM: 0, Phase.INPUT: 1, Phase.FWD: 2, Phase.LOSS: 3, Phase.BWD: 4,
    Phase.GRAD: 5, Phase.OPTIM_GRAD: 6, Phase.UPDATE: 7, Phase.STATE: 8,
}
PER_STEP_PHASES = frozenset({Phase.PARAM, Phase.GRAD, Phase.OPTIM_GRAD, Phase.UPDATE,
                             Phase.STATE})
AFTER_BACKWARD_PHASES = (Phase.GRAD, Phase.OPTIM_GRAD, Phase.UPDATE, Phase.STATE)
"""Per-step phases that come after every microbatch of the step, in this order."""

# Wrapper components dropped wherever they appear (agents/capture/sites.py does the same on
# capture).
_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_LEADING_WRAPPERS = frozenset({"module"})


def phase_name(phase: int) -> str:
    return PHASE_NAMES.get(phase, f"phase{phase}")


def role_name(role: int) -> str:
    return ROLE_NAMES.get(role, f"role{role}")


class Key(NamedTuple):
    """A key as users read it; phase and role by name."""

    step: int
    microbatch: int
    phase: str
    site: str
    role: str
    index: int = 0  # type: ignore[assignment]  # a field may shadow tuple.index; mypy objects
    call: int = 0

    def __str__(self) -> str:
        where = f"step {self.step}" + (f" mb {self.microbatch}" if self.microbatch >= 0 else "")
        extra = ((f"[{self.index}]" if self.index else "")
                 + (f" call {self.call}" if self.call else ""))
        return f"{self.phase} {self.site} {self.role}{extra} @ {where}"

    def as_dict(self) -> dict:
        return self._asdict()


def normalize_site(name: str) -> str:
    """``_orig_mod.module.layers.0._checkpoint_wrapped_module.moe`` → ``layers.0.moe``."""
    if "_mod" not in name and not name.startswith("module") and ".." not in name \
            and not name.startswith(".") and not name.endswith("."):
        return name  # nothing to strip (the agent normalizes already): the common case
    parts = [p for p in name.split(".") if p and p not in _WRAPPERS]
    while parts and parts[0] in _LEADING_WRAPPERS:
        parts.pop(0)
    return ".".join(parts)


@dataclass(frozen=True)
class RenameRule:
    """Rewrite site names of one side (or both) before aligning.

    ``pattern`` is a regular expression (``re.sub`` semantics, so ``\\1`` works in
    ``replace``); a glob from the policy file is translated to an anchored regex whose ``*``
    become groups ``\\1``, ``\\2``...
    """

    pattern: str
    replace: str
    side: str = "cand"
    """"ref", "cand" or "both"."""
    source: str = ""
    """Where the rule came from, for messages ("policy.toml rename 2")."""

    def applies_to(self, side: str) -> bool:
        return self.side == "both" or self.side == side

    def apply(self, site: str) -> str:
        return re.sub(self.pattern, self.replace, site)


def glob_to_regex(glob: str) -> str:
    """An anchored regex for a site glob in which each ``*``/``?`` is a numbered group."""
    out = []
    for ch in glob:
        if ch == "*":
            out.append("(.*)")
        elif ch == "?":
            out.append("(.)")
        else:
            out.append(re.escape(ch))
    return "^" + "".join(out) + "$"


def canonical_sites(names: Mapping[int, str], renames: Sequence[RenameRule],
                    side: str) -> tuple[dict[int, str], list[str]]:
    """Site id → aligned name for one side, and warnings about names that collide.

    Collisions (two stored sites renamed to one name) are reported, not refused: the pieces of
    both would be merged as one tensor and flagged `incomplete` by the tiling check.
    """
    out: dict[int, str] = {}
    origin: dict[str, str] = {}
    warnings: list[str] = []
    rules = [r for r in renames if r.applies_to(side)]
    for sid, name in names.items():
        new = normalize_site(name)
        for rule in rules:
            new = rule.apply(new)
        out[sid] = new
        prev = origin.setdefault(new, name)
        if (prev != name and (prev != new or name != new)
                and normalize_site(prev) != normalize_site(name)):
            warnings.append(f"{side}: sites {prev!r} and {name!r} both align as {new!r}")
    return out, warnings


def glob_match(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


# -- execution order ------------------------------------------------------------------------------

MB_PARAM = -(1 << 40)   # per-step parameter values: before every microbatch of the step
MB_GRAD = 1 << 40       # per-step gradients: after every microbatch of the step


if TYPE_CHECKING:  # numpy loads with the engine, not with the CLI's policy parsing
    import numpy as np


def exec_order(step: np.ndarray, microbatch: np.ndarray, phase: np.ndarray, stage: np.ndarray,
               position: np.ndarray, substage: np.ndarray | None = None) -> np.ndarray:
    """Indices that sort keys into execution order (see the module docstring).

    ``position`` is a float capture position (in the reference's frame; keys it lacks get a
    position interpolated from the candidate's order, see `fill_positions`); ``stage`` is the
    pipeline stage the key ran in (-1 when not pipelined); ``substage``, when given, the stage
    the run whose positions these are ran it in, which orders keys of one ``stage`` that ran in
    several of that run's stages (reversed for bwd too).
    """
    import numpy as np

    phase_rank = _lookup(phase, PHASE_RANK, 9)
    mb = microbatch.astype(np.int64).copy()
    mb[phase == Phase.PARAM] = MB_PARAM
    mb[np.isin(phase, AFTER_BACKWARD_PHASES)] = MB_GRAD
    bwd = phase == Phase.BWD
    stage_rank = stage.astype(np.int64).copy()
    stage_rank[bwd] = -stage_rank[bwd]
    if substage is None:
        return np.lexsort((position, stage_rank, phase_rank, mb, step))
    sub_rank = substage.astype(np.int64).copy()
    sub_rank[bwd] = -sub_rank[bwd]
    return np.lexsort((position, sub_rank, stage_rank, phase_rank, mb, step))


def _lookup(values: np.ndarray, table: Mapping[int, int], default: int) -> np.ndarray:
    import numpy as np

    lut = np.full(max(max(table), int(values.max(initial=0))) + 1, default, dtype=np.int64)
    for k, v in table.items():
        lut[k] = v
    return lut[np.clip(values, 0, len(lut) - 1)]


def fill_positions(group: np.ndarray, own_position: np.ndarray,
                   ref_position: np.ndarray) -> np.ndarray:
    """Capture positions in the reference's frame for keys of one run.

    ``group`` identifies the (step, microbatch, phase) a key belongs to; ``own_position`` is its
    capture position in its own run; ``ref_position`` the reference's, NaN where the reference
    lacks the key. A key the reference lacks is placed just after the nearest preceding key (in
    its own run's capture order, same group) that the reference has; at the start of its group
    when there is none.
    """
    import numpy as np

    n = len(group)
    out = ref_position.astype(np.float64).copy()
    if n == 0 or not np.isnan(out).any():
        return out
    order = np.lexsort((own_position, group))
    g, r = group[order], out[order]
    idx = np.arange(n)
    starts = np.r_[True, g[1:] != g[:-1]]
    seg_start = np.flatnonzero(starts)[np.cumsum(starts) - 1]
    known = ~np.isnan(r)
    last = np.maximum.accumulate(np.where(known, idx, -1))
    has_prev = last >= seg_start
    filled = np.where(
        known, r,
        np.where(has_prev, r[np.maximum(last, 0)] + (idx - last) / (n + 1.0),
                 -(n + 1.0) + (idx - seg_start)),
    )
    out[order] = filled
    return out


def site_module(site: str) -> str:
    """The module a parameter belongs to: ``layers.0.attn.wq.weight`` → ``layers.0.attn.wq``."""
    return site.rsplit(".", 1)[0] if "." in site else ""


def common_prefix(sites: Iterable[str]) -> str:
    """Longest common dotted prefix of module names ("" when none)."""
    parts_list = [s.split(".") for s in sites]
    if not parts_list:
        return ""
    prefix = parts_list[0]
    for parts in parts_list[1:]:
        n = 0
        while n < min(len(prefix), len(parts)) and prefix[n] == parts[n]:
            n += 1
        prefix = prefix[:n]
    return ".".join(prefix)
