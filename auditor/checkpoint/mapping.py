"""The name map of a converted checkpoint: CAND's names to REF's, and what the conversion did.

A conversion (torchtitan DCP to Hugging Face safetensors and back) renames every tensor and
may store some transposed. The map file says so, so that the audit compares each converted
tensor with the one it came from::

    [[map]]
    cand = "model.layers.*.self_attn.q_proj.weight"   # a glob on CAND's names
    ref = "layers.*.attention.wq.weight"               # the REF name; each * filled in order
    transpose = false                                  # true: CAND holds REF's 2-D tensor
                                                       # transposed

In globs ``*`` matches within one dotted component and ``**`` across components. Entries are
tried in order, the first match decides; a name no entry matches keeps its name. Globs compile
to RE2 (linear time in the name: with Python's backtracking ``re`` a glob of two ``**`` took
time quadratic in the name, minutes on a 480 KB one). ``transpose``
is applied while reading (each box of CAND is transposed into REF's layout), so the
fingerprints compare the tensors exactly.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import re2

from numaudit.auditor.checkpoint.sources import CheckpointError, read_text

MAX_MAP_BYTES = 1 << 20
MAX_MAP_ENTRIES = 4096
_FIELDS = {"cand", "ref", "transpose"}


@dataclass(frozen=True)
class MapRule:
    pattern: Any
    """The compiled RE2 pattern of the glob."""
    ref: str
    transpose: bool
    stars: int


@dataclass
class NameMap:
    """CAND name -> (REF name, transposed) by the first matching rule."""

    rules: list[MapRule]

    def apply(self, name: str) -> tuple[str, bool]:
        for rule in self.rules:
            m = rule.pattern.match(name)
            if m is not None:
                groups = iter(m.groups())
                # mypy cannot infer a lambda with a default (it binds this rule's groups)
                ref = re.sub(r"\*\*|\*", lambda _, g=groups: next(g),  # type: ignore[misc]
                             rule.ref)
                return ref, rule.transpose
        return name, False


def _glob(glob: str) -> tuple[Any, int]:
    out, i, stars = [], 0, 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append("(.*?)")
            i += 2
            stars += 1
        elif glob[i] == "*":
            out.append("([^.]*)")
            i += 1
            stars += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    options = re2.Options()
    options.log_errors = False
    options.max_mem = 64 << 20
    return re2.compile("^" + "".join(out) + "$", options), stars


def load_map(path: Path) -> NameMap:
    """Parse a map file; CheckpointError naming the file, the entry and the field."""
    try:
        doc = tomllib.loads(read_text(path, MAX_MAP_BYTES))
    except tomllib.TOMLDecodeError as exc:
        raise CheckpointError(f"{path}: not TOML ({exc})") from None
    unknown = set(doc) - {"map"}
    if unknown:
        raise CheckpointError(f"{path}: unknown table or field {sorted(unknown)[0]!r} (only "
                              "[[map]] entries)")
    entries = doc.get("map", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CheckpointError(f"{path}: map: must be an array of tables ([[map]])")
    if len(entries) > MAX_MAP_ENTRIES:
        raise CheckpointError(f"{path}: map: {len(entries)} entries exceed {MAX_MAP_ENTRIES}")
    rules = []
    for i, e in enumerate(entries, start=1):
        where = f"{path}: map {i}"
        extra = set(e) - _FIELDS
        if extra:
            raise CheckpointError(f"{where}: unknown field {sorted(extra)[0]!r} (fields: "
                                  f"{', '.join(sorted(_FIELDS))})")
        for field in ("cand", "ref"):
            if not isinstance(e.get(field), str) or not e[field]:
                raise CheckpointError(f"{where}: field {field!r}: a non-empty string is needed")
        transpose = e.get("transpose", False)
        if not isinstance(transpose, bool):
            raise CheckpointError(f"{where}: field 'transpose': true or false")
        try:
            pattern, stars = _glob(e["cand"])
        except re2.error as exc:
            raise CheckpointError(f"{where}: field 'cand': {exc}") from None
        ref_stars = len(re.findall(r"\*\*|\*", e["ref"]))
        if ref_stars != stars:
            raise CheckpointError(f"{where}: field 'ref': {ref_stars} wildcards for the "
                                  f"{stars} of 'cand'")
        rules.append(MapRule(pattern, e["ref"], transpose, stars))
    return NameMap(rules)
