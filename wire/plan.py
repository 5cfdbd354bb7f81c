"""Drill-down plans: the file `auditor drill REF CAND -o plan.toml` writes and agents read
(``NUMAUDIT_PLAN=plan.toml``, or ``attach(..., plan=...)``; docs/drill-down.md).

    # numaudit drill-down plan: rerun both runs with NUMAUDIT_PLAN=<this file>
    version = 1
    ops = ["layers.1.attention"]          # module sites whose operations are captured
    steps = [0]                           # the steps captured (all others are left out)
    payload = ["fwd:layers.1.attention"]  # phase:site globs whose raw bytes travel
    reason = "introduced: ..."            # what the report said (for the reader)
    ref = "ref"
    cand = "pp8"

Both sides import this module: one format, one reader, one writer.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

PLAN_VERSION = 1
MAX_PLAN_BYTES = 64 << 10
"""A plan is a few lines; a larger file is not one."""
MAX_GLOBS = 64
MAX_GLOB_CHARS = 512
MAX_STEPS = 4096
_KEYS = {"version", "ops", "steps", "payload", "reason", "ref", "cand"}


@dataclass(frozen=True)
class Plan:
    """What a drill-down rerun captures."""

    ops: tuple[str, ...]
    """Module-site globs whose every operation is captured (agents/capture/ops.py)."""
    steps: tuple[int, ...]
    """The steps captured; empty = every step."""
    payload: tuple[str, ...] = ()
    """"phase:site" globs whose raw bytes travel (the drilled module's outputs)."""
    reason: str = ""
    runs: dict[str, str] = field(default_factory=dict)
    """The runs the plan was made from ("ref", "cand"), for the reader."""


def _strings(value, name: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_GLOBS or not all(
            isinstance(v, str) and v and len(v) <= MAX_GLOB_CHARS and v.isprintable()
            for v in value):
        raise ValueError(f"{where}: {name}: must be a list of at most {MAX_GLOBS} non-empty "
                         f"printable strings of at most {MAX_GLOB_CHARS} characters")
    return tuple(value)


def parse_plan(text: str, where: str = "plan") -> Plan:
    """A plan from its TOML text; ValueError naming the file and the field otherwise."""
    if len(text.encode()) > MAX_PLAN_BYTES:
        raise ValueError(f"{where}: over {MAX_PLAN_BYTES} bytes: not a drill-down plan")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    unknown = set(data) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: "
                         f"{', '.join(sorted(_KEYS))}")
    if data.get("version") != PLAN_VERSION:
        raise ValueError(f"{where}: version: {data.get('version')!r}; this build reads "
                         f"version {PLAN_VERSION}")
    ops = _strings(data.get("ops", []), "ops", where)
    if not ops:
        raise ValueError(f"{where}: ops: no module to drill into")
    steps = data.get("steps", [])
    if not isinstance(steps, list) or len(steps) > MAX_STEPS or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 40 for s in steps):
        raise ValueError(f"{where}: steps: must be a list of step numbers (integers >= 0)")
    reason = data.get("reason", "")
    if not isinstance(reason, str):
        raise ValueError(f"{where}: reason: must be a string")
    runs = {k: data[k] for k in ("ref", "cand") if isinstance(data.get(k), str)}
    return Plan(ops, tuple(steps), _strings(data.get("payload", []), "payload", where),
                reason, runs)


def read_plan(path: str | Path) -> Plan:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"plan: cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"plan: {path}: not UTF-8 text") from None
    return parse_plan(text, f"plan: {path}")


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=True)  # a JSON string with ASCII escapes is TOML's too


def format_plan(plan: Plan) -> str:
    """The plan as the TOML file agents read (`parse_plan` gives it back)."""
    lines = ["# numaudit drill-down plan (docs/drill-down.md): rerun both runs with",
             "#   NUMAUDIT_PLAN=<this file>",
             f"version = {PLAN_VERSION}",
             "ops = [" + ", ".join(_toml_string(g) for g in plan.ops) + "]",
             "steps = [" + ", ".join(str(int(s)) for s in plan.steps) + "]",
             "payload = [" + ", ".join(_toml_string(g) for g in plan.payload) + "]"]
    if plan.reason:
        lines.append(f"reason = {_toml_string(plan.reason)}")
    for side in ("ref", "cand"):
        if side in plan.runs:
            lines.append(f"{side} = {_toml_string(plan.runs[side])}")
    return "\n".join(lines) + "\n"
