"""Tolerance policies from TOML files, presets and Compare requests (docs/policy.md).

The model (rules, checks, presets, per-dtype tolerances: `auditor.compare.policy.model`) is
re-exported here, so `auditor.compare.policy.load` is the one place callers import policies from.
Rules are tried in file order and the first match wins; a key no rule matches gets the default
check: ``rel_l2`` for floating dtypes (``exact`` for integers and bools) with the tolerances of its
dtype — torch.testing.assert_close's, floored by the preset. Every malformed policy is refused with
a `PolicyError` naming the file, the rule and the field; rename patterns run on RE2 (linear time)
and policy text is bounded in size and nesting before it is parsed.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import re2

from numaudit.auditor.compare.policy.model import (  # noqa: F401  (the policy API, re-exported)
    ACTIONS,
    DEFAULT_PAYLOAD_MAX_BYTES,
    DEFAULT_SIGMAS,
    DTYPE_TOLERANCES,
    ELEMENTWISE_PRESETS,
    METRICS,
    NONFINITE,
    ON_UNCERTAIN,
    PAYLOAD_METRICS,
    PRESET_FLOORS,
    PRESETS,
    Check,
    Policy,
    PolicyError,
    Rule,
    looser,
    tolerance,
)
from numaudit.auditor.compare.read.align import RenameRule, glob_to_regex
from numaudit.wire.vocabulary import PHASE_IDS, ROLE_IDS

MAX_POLICY_CHARS = 256 << 10
"""Policy text longer than this is refused before it is parsed (a Compare request carries it)."""
MAX_POLICY_DEPTH = 8
"""Deepest nesting of tables and arrays a policy may use (real policies use 3); deeper text,
including text deep enough to exhaust the TOML parser's recursion, is refused."""
MAX_POLICY_RULES = 4096
MAX_POLICY_RENAMES = 256
MAX_PATTERN_CHARS = 1024
"""Longest rename regex or glob."""
RE2_MAX_MEM = 8 << 20
"""Memory RE2 may use for one compiled rename pattern."""

_TOP_FIELDS = {"version", "name", "preset", "sigmas", "on_uncertain", "nonfinite",
               "payload_max_bytes", "tolerances", "rename", "rule"}
_RULE_FIELDS = {"name", "match", "phase", "site", "role", "dtype", "action", "metric",
                "threshold", "rtol", "atol", "nonfinite"}
_RENAME_FIELDS = {"side", "regex", "glob", "replace"}
_TOL_FIELDS = {"rtol", "atol"}


# -- construction ---------------------------------------------------------------------------------

def preset_policy(name: str | None) -> Policy:
    """A preset by name; None or "" gives the per-dtype defaults."""
    if not name:
        return Policy()
    if name not in PRESETS:
        raise PolicyError(f"preset: {name!r} is not one of {', '.join(PRESETS)}")
    return Policy(name=name, source=f"preset:{name}", preset=name)


def load_policy(path: str | Path, preset: str | None = None) -> Policy:
    """Read and validate a policy file; ``preset`` (the CLI's --preset) overrides the file's."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the policy ({exc.strerror or exc})") from None
    return parse_policy(text, str(path), preset=preset)


def resolve_policy(text: str = "", preset: str = "", source: str = "policy") -> Policy:
    """Policy from file contents and/or a preset name, as the Compare RPC receives them."""
    if text.strip():
        return parse_policy(text, source, preset=preset or None)
    return preset_policy(preset or None)


def parse_policy(text: str, source: str = "policy", *, preset: str | None = None) -> Policy:
    """Parse a policy file's text; errors name ``source``, the rule and the field.

    Size and nesting are bounded (`MAX_POLICY_CHARS`, `MAX_POLICY_DEPTH`), so text from a
    request cannot exhaust memory or the parser's recursion."""
    if len(text) > MAX_POLICY_CHARS:
        raise PolicyError(f"{source}: {len(text)} characters exceed the limit of "
                          f"{MAX_POLICY_CHARS}")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise PolicyError(f"{source}: nested deeper than {MAX_POLICY_DEPTH} levels") from None
    if _depth(doc) > MAX_POLICY_DEPTH:
        raise PolicyError(f"{source}: nested deeper than {MAX_POLICY_DEPTH} levels")
    return _build(doc, source, preset)


def _depth(value: Any) -> int:
    """Nesting depth of parsed TOML (iterative: the value may be deep)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            if d > MAX_POLICY_DEPTH:
                return d
            todo.extend((x, d + 1) for x in v)
    return deepest


@functools.lru_cache(maxsize=1024)
def compile_linear(pattern: str) -> Any:
    """A rename pattern compiled by RE2: matching takes time linear in the site name, whatever
    the pattern (Python's `re` backtracks: ``^(.|.)*!$`` froze a daemon for 36 s). RE2 has no
    backreferences or lookaround; `re2.error` says so."""
    options = re2.Options()
    options.log_errors = False
    options.max_mem = RE2_MAX_MEM
    return re2.compile(pattern, options)


@dataclass(frozen=True)
class LinearRenameRule(RenameRule):
    """A `RenameRule` applied with RE2 (same ``\\1`` / ``\\g<name>`` replacement syntax)."""

    def apply(self, site: str) -> str:
        return compile_linear(self.pattern).sub(self.replace, site)


class _Ctx:
    def __init__(self, source: str) -> None:
        self.source = source

    def err(self, where: str, fld: str, why: str) -> PolicyError:
        place = f"{self.source}: {where}: " if where else f"{self.source}: "
        return PolicyError(f"{place}field {fld!r}: {why}")


def _unknown(ctx: _Ctx, where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    for k in table:
        if k not in allowed:
            raise ctx.err(where, k, f"unknown field (expected one of {', '.join(sorted(allowed))})")


def _build(doc: Mapping[str, Any], source: str, preset_override: str | None) -> Policy:
    ctx = _Ctx(source)
    _unknown(ctx, "", doc, _TOP_FIELDS)
    version = doc.get("version", 1)
    if version != 1 or isinstance(version, bool):
        raise ctx.err("", "version", f"{version!r} is not supported (this build reads version 1)")
    pol = Policy(source=source)
    pol.name = _string(ctx, "", doc, "name") or Path(source).stem or "policy"
    preset = preset_override or _string(ctx, "", doc, "preset")
    if preset:
        if preset not in PRESETS:
            raise ctx.err("", "preset", f"{preset!r} is not one of {', '.join(PRESETS)}")
        pol.preset = preset
    if "sigmas" in doc:
        pol.sigmas = _number(ctx, "", doc, "sigmas", positive=True)
    pol.on_uncertain = _choice(ctx, "", doc, "on_uncertain", ON_UNCERTAIN) or pol.on_uncertain
    pol.nonfinite = _choice(ctx, "", doc, "nonfinite", NONFINITE) or pol.nonfinite
    if "payload_max_bytes" in doc:
        v = doc["payload_max_bytes"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ctx.err("", "payload_max_bytes", f"{v!r} is not an integer >= 0")
        pol.payload_max_bytes = v
    tols = doc.get("tolerances", {})
    if not isinstance(tols, dict):
        raise ctx.err("", "tolerances", "must be a table of [tolerances.DTYPE] tables")
    for dtype, table in tols.items():
        where = f"tolerances.{dtype}"
        if dtype not in DTYPE_TOLERANCES:
            raise ctx.err(where, "dtype", f"{dtype!r} is not a floating dtype "
                                          f"({', '.join(DTYPE_TOLERANCES)})")
        if not isinstance(table, dict):
            raise ctx.err(where, "rtol", "must be a table with rtol and atol")
        _unknown(ctx, where, table, _TOL_FIELDS)
        base = DTYPE_TOLERANCES[dtype]
        rtol = _number(ctx, where, table, "rtol") if "rtol" in table else base[0]
        atol = _number(ctx, where, table, "atol") if "atol" in table else base[1]
        pol.tolerances[dtype] = (rtol, atol)
    renames, rules = _array_of_tables(ctx, doc, "rename"), _array_of_tables(ctx, doc, "rule")
    if len(renames) > MAX_POLICY_RENAMES:
        raise ctx.err("", "rename", f"{len(renames)} entries exceed the limit of "
                                    f"{MAX_POLICY_RENAMES}")
    if len(rules) > MAX_POLICY_RULES:
        raise ctx.err("", "rule", f"{len(rules)} entries exceed the limit of {MAX_POLICY_RULES}")
    for i, table in enumerate(renames, start=1):
        pol.renames.append(_rename(ctx, i, table))
    for i, table in enumerate(rules, start=1):
        pol.rules.append(_rule(ctx, i, table))
    return pol


def _array_of_tables(ctx: _Ctx, doc: Mapping[str, Any], name: str) -> list[dict]:
    value = doc.get(name, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ctx.err("", name, f"must be an array of tables ([[{name}]])")
    return value


def _rename(ctx: _Ctx, i: int, t: dict) -> RenameRule:
    where = f"rename {i}"
    _unknown(ctx, where, t, _RENAME_FIELDS)
    side = _choice(ctx, where, t, "side", ("ref", "cand", "both")) or "cand"
    if ("regex" in t) == ("glob" in t):
        raise ctx.err(where, "regex", "give exactly one of 'regex' or 'glob'")
    if "replace" not in t:
        raise ctx.err(where, "replace", "missing")
    replace = _string(ctx, where, t, "replace")
    kind = "regex" if "regex" in t else "glob"
    text = _string(ctx, where, t, kind)
    if len(text) > MAX_PATTERN_CHARS:
        raise ctx.err(where, kind, f"{len(text)} characters exceed the limit of "
                                   f"{MAX_PATTERN_CHARS}")
    pattern = text if kind == "regex" else glob_to_regex(text)
    try:
        compiled = compile_linear(pattern)
    except re2.error as exc:
        raise ctx.err(where, kind, f"{text!r} is not a regular expression RE2 accepts "
                                   f"({_re2_reason(exc)})") from None
    try:
        compiled.sub(replace, "")  # a bad group reference fails on the first match only...
        for probe in ("x", "a.b"):
            compiled.sub(replace, probe)
        _check_group_refs(compiled, replace)
    except (re.error, re2.error, IndexError) as exc:
        raise ctx.err(where, "replace", f"{replace!r} does not fit the pattern ({exc})") from None
    return LinearRenameRule(pattern=pattern, replace=replace, side=side,
                            source=f"{ctx.source} {where}")


def _re2_reason(exc: Exception) -> str:
    reason = exc.args[0] if exc.args else exc
    return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)


def _check_group_refs(compiled: Any, replace: str) -> None:
    for m in re.finditer(r"\\(\d+)|\\g<(\w+)>", replace):
        ref = m.group(1) or m.group(2)
        if ref.isdigit() and int(ref) > compiled.groups:
            raise re.error(f"invalid group reference {ref}")
        if not ref.isdigit() and ref not in compiled.groupindex:
            raise re.error(f"unknown group name {ref}")


def _rule(ctx: _Ctx, i: int, t: dict) -> Rule:
    name = t.get("name") if isinstance(t.get("name"), str) else ""
    where = f"rule {i}" + (f" ({name})" if name else "")
    _unknown(ctx, where, t, _RULE_FIELDS)
    name = _string(ctx, where, t, "name")
    phases = _strings(ctx, where, t, "phase")
    for p in phases:
        if p not in PHASE_IDS:
            raise ctx.err(where, "phase", f"{p!r} is not one of {', '.join(PHASE_IDS)}")
    roles = _strings(ctx, where, t, "role")
    for r in roles:
        if r not in ROLE_IDS:
            raise ctx.err(where, "role", f"{r!r} is not one of {', '.join(ROLE_IDS)}")
    match = _strings(ctx, where, t, "match")
    for g in match:
        if ":" in g:
            ph = g.split(":", 1)[0]
            if not any(fnmatch.fnmatchcase(p, ph) for p in PHASE_IDS):
                raise ctx.err(where, "match", f"{g!r}: {ph!r} matches no phase "
                                              f"({', '.join(PHASE_IDS)})")
    dtypes = _strings(ctx, where, t, "dtype")
    action = _choice(ctx, where, t, "action", ACTIONS) or "compare"
    metric = _choice(ctx, where, t, "metric", tuple(METRICS))
    if action != "compare":
        for f in ("metric", "threshold", "rtol", "atol"):
            if f in t:
                raise ctx.err(where, f, f"has no effect with action {action!r}")
    threshold = _number(ctx, where, t, "threshold") if "threshold" in t else None
    rtol = _number(ctx, where, t, "rtol") if "rtol" in t else None
    atol = _number(ctx, where, t, "atol") if "atol" in t else None
    if metric == "exact" and (threshold is not None or rtol is not None or atol is not None):
        raise ctx.err(where, "threshold", "metric 'exact' takes no threshold, rtol or atol")
    if threshold is not None and (rtol is not None or atol is not None):
        raise ctx.err(where, "threshold", "give either threshold or rtol/atol, not both")
    if threshold is not None and metric is None:
        raise ctx.err(where, "metric", "a threshold needs the metric it is measured in")
    if metric == "allclose" and threshold is not None:
        raise ctx.err(where, "threshold", "metric 'allclose' uses rtol/atol (it passes at <= 1)")
    nonfinite = _choice(ctx, where, t, "nonfinite", NONFINITE)
    if not any((phases, match, t.get("site"), roles, dtypes)):
        pass  # a catch-all rule is legitimate (e.g. the last rule of a policy)
    return Rule(index=i, name=name, phases=phases, sites=_strings(ctx, where, t, "site"),
                match=match, roles=roles, dtypes=dtypes, action=action, metric=metric,
                threshold=threshold, rtol=rtol, atol=atol, nonfinite=nonfinite)


def _string(ctx: _Ctx, where: str, t: Mapping[str, Any], f: str) -> str:
    v = t.get(f, "")
    if not isinstance(v, str):
        raise ctx.err(where, f, f"{v!r} is not a string")
    return v


def _strings(ctx: _Ctx, where: str, t: Mapping[str, Any], f: str) -> tuple[str, ...]:
    v = t.get(f)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or not v:
        raise ctx.err(where, f, f"{v!r} is not a non-empty string or list of strings")
    return tuple(v)


def _number(ctx: _Ctx, where: str, t: Mapping[str, Any], f: str, *,
            positive: bool = False) -> float:
    v = t.get(f)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
            or (positive and v == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise ctx.err(where, f, f"{v!r} is not {want}")
    return float(v)


def _choice(ctx: _Ctx, where: str, t: Mapping[str, Any], f: str,
            options: Iterable[str]) -> str | None:
    if f not in t:
        return None
    v = t[f]
    options = tuple(options)
    if v not in options:
        raise ctx.err(where, f, f"{v!r} is not one of {', '.join(options)}")
    return v
