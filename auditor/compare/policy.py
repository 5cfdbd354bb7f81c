"""Tolerance policies: ordered TOML rules, presets and per-dtype defaults (docs/policy.md).

A policy decides, for every aligned key, whether it is compared at all (``ignore``), whether its
absence from one run is expected (``expect_missing``), and otherwise which metric is checked
against which threshold. Rules are tried in file order and the first match wins; a key no rule
matches gets the default check: ``rel_l2`` for floating dtypes (``exact`` for integers and
bools) with the tolerances of its dtype — torch.testing.assert_close's, floored by the preset.

Every malformed policy is refused with a `PolicyError` naming the file, the rule and the field.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from auditor.compare.align import PHASE_IDS, ROLE_IDS, RenameRule, glob_to_regex

# torch.testing.assert_close defaults; float8 types have none there: their machine epsilon.
DTYPE_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-7, 1e-7),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "complex128": (1e-7, 1e-7),
    "complex64": (1.3e-6, 1e-5),
    "complex32": (1e-3, 1e-5),
    "float8_e4m3fn": (0.125, 1e-3),
    "float8_e4m3fnuz": (0.125, 1e-3),
    "float8_e5m2": (0.25, 1e-3),
    "float8_e5m2fnuz": (0.25, 1e-3),
    "float8_e8m0fnu": (1.0, 0.0),
}
"""(rtol, atol) per floating dtype. Other dtypes (integers, bool, packed fp4) compare exactly."""

PRESETS: dict[str, str] = {
    "bitwise": "every tensor must be bitwise identical (fingerprint equality)",
    "fp32": "rel_l2 within each dtype's assert_close tolerance, at least fp32's",
    "bf16": "rel_l2 within each dtype's assert_close tolerance, at least bf16's",
    "loose": "rel_l2 within 5% (rtol 5e-2, atol 1e-3): same computation, any precision",
}
PRESET_FLOORS: dict[str, tuple[float, float]] = {
    "fp32": DTYPE_TOLERANCES["float32"],
    "bf16": DTYPE_TOLERANCES["bfloat16"],
    "loose": (5e-2, 1e-3),
}

METRICS: dict[str, str] = {
    "exact": "fingerprints equal (bitwise); no threshold",
    "rel_l2": "||cand - ref|| / ||ref|| (payloads if both runs sent them, else sketches)",
    "cosine": "1 - cosine similarity",
    "norm_ratio": "| ||cand|| / ||ref|| - 1 |",
    "abs_max_ratio": "| max|cand| / max|ref| - 1 |",
    "allclose": "max over elements of |cand - ref| / (atol + rtol |ref|) (payloads); passes at <= 1",
    "max_abs": "max over elements of |cand - ref| (payloads)",
    "max_rel": "max over elements of |cand - ref| / |ref| (payloads)",
    "ulp": "max distance in units in the last place (payloads, same dtype)",
}
PAYLOAD_METRICS = frozenset({"allclose", "max_abs", "max_rel", "ulp"})
ACTIONS = ("compare", "ignore", "expect_missing")
NONFINITE = ("match", "forbid", "allow")
ON_UNCERTAIN = ("estimate", "breach", "pass")

DEFAULT_SIGMAS = 3.0
DEFAULT_PAYLOAD_MAX_BYTES = 64 << 20
"""Raw bytes of one logical tensor, per run, that exact payload metrics decompress (memory is
about 8/itemsize + 1 times that)."""

_TOP_FIELDS = {"version", "name", "preset", "sigmas", "on_uncertain", "nonfinite",
               "payload_max_bytes", "tolerances", "rename", "rule"}
_RULE_FIELDS = {"name", "match", "phase", "site", "role", "dtype", "action", "metric",
                "threshold", "rtol", "atol", "nonfinite"}
_RENAME_FIELDS = {"side", "regex", "glob", "replace"}
_TOL_FIELDS = {"rtol", "atol"}


class PolicyError(ValueError):
    """A policy refused; the message names the file, the rule and the field."""


def tolerance(dtype: str, floor: tuple[float, float] | None = None,
              overrides: Mapping[str, tuple[float, float]] | None = None) -> tuple[float, float] | None:
    """(rtol, atol) for a dtype, or None when it compares exactly (integers, bools)."""
    tol = (overrides or {}).get(dtype) or DTYPE_TOLERANCES.get(dtype)
    if tol is None:
        return None
    if floor is not None:
        tol = (max(tol[0], floor[0]), max(tol[1], floor[1]))
    return tol


def looser(a: tuple[float, float] | None, b: tuple[float, float] | None) -> tuple[float, float] | None:
    """The looser of two tolerances (larger rtol, then larger atol); exact only if both are."""
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclass(frozen=True)
class Rule:
    """One ``[[rule]]`` of a policy file."""

    index: int
    """1-based position in the file."""
    name: str = ""
    phases: tuple[str, ...] = ()
    """Empty = any phase."""
    sites: tuple[str, ...] = ()
    """Globs on the aligned site name; empty = any site."""
    match: tuple[str, ...] = ()
    """Globs on "phase:site" (a glob without a colon is a site glob)."""
    roles: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    """Matches when either run's dtype is listed."""
    action: str = "compare"
    metric: str | None = None
    threshold: float | None = None
    rtol: float | None = None
    atol: float | None = None
    nonfinite: str | None = None

    @property
    def label(self) -> str:
        return f"rule {self.index}" + (f" ({self.name})" if self.name else "")

    def matches(self, phase: str, site: str, role: str, dtypes: Iterable[str]) -> bool:
        if self.phases and phase not in self.phases:
            return False
        if self.roles and role not in self.roles:
            return False
        if self.sites and not any(fnmatch.fnmatchcase(site, g) for g in self.sites):
            return False
        if self.match:
            ps = f"{phase}:{site}"
            if not any(fnmatch.fnmatchcase(ps if ":" in g else site, g) for g in self.match):
                return False
        if self.dtypes and not any(d in self.dtypes for d in dtypes if d):
            return False
        return True


@dataclass(frozen=True)
class Check:
    """What the policy says about one aligned key."""

    rule: str
    """Label of the deciding rule ("rule 2 (router)") or "default"."""
    action: str
    metric: str
    threshold: float | None
    """Explicit threshold in the metric's unit; None = derived from rtol/atol."""
    rtol: float
    atol: float
    nonfinite: str
    elementwise: bool = False
    """The preset's default test (fp32, bf16): assert_close's elementwise test where both runs
    sent payloads, and a bound on the extremes where they did not, besides rel_l2."""


ELEMENTWISE_PRESETS = frozenset({"fp32", "bf16"})
"""Presets whose default test is elementwise (docs/policy.md, "Presets")."""


@dataclass
class Policy:
    """A parsed, validated policy."""

    name: str = "default"
    source: str = "defaults"
    """Path of the file, "preset:NAME" or "defaults"."""
    preset: str | None = None
    sigmas: float = DEFAULT_SIGMAS
    """Half-width of the sketch-uncertainty band, in standard deviations."""
    on_uncertain: str = "estimate"
    nonfinite: str = "match"
    payload_max_bytes: int = DEFAULT_PAYLOAD_MAX_BYTES
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    renames: list[RenameRule] = field(default_factory=list)
    rules: list[Rule] = field(default_factory=list)

    @property
    def floor(self) -> tuple[float, float] | None:
        return PRESET_FLOORS.get(self.preset or "")

    def canonical(self) -> dict:
        """The resolved policy as plain data (what the hash covers)."""
        return {
            "name": self.name, "preset": self.preset, "sigmas": self.sigmas,
            "on_uncertain": self.on_uncertain, "nonfinite": self.nonfinite,
            "payload_max_bytes": self.payload_max_bytes,
            "tolerances": {k: list(v) for k, v in sorted(self.tolerances.items())},
            "renames": [dict(pattern=r.pattern, replace=r.replace, side=r.side)
                        for r in self.renames],
            "rules": [{k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in asdict(r).items() if v not in ((), None, "")}
                      for r in self.rules],
        }

    @property
    def sha256(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def describe(self) -> dict:
        """The policy as the JSON report shows it."""
        return {"name": self.name, "source": self.source, "sha256": self.sha256,
                **{k: v for k, v in self.canonical().items() if k != "name"}}

    def check(self, phase: str, site: str, role: str, dtype_ref: str | None,
              dtype_cand: str | None) -> Check:
        """The check for one key (first matching rule, else the default)."""
        if not self.rules:  # the common case: one answer per dtype pair
            cache = self.__dict__.setdefault("_default_checks", {})
            got = cache.get((dtype_ref, dtype_cand))
            if got is None:
                got = cache[(dtype_ref, dtype_cand)] = self._check(phase, site, role, dtype_ref,
                                                                   dtype_cand)
            return got
        return self._check(phase, site, role, dtype_ref, dtype_cand)

    def _check(self, phase: str, site: str, role: str, dtype_ref: str | None,
               dtype_cand: str | None) -> Check:
        tol = self.key_tolerance(dtype_ref, dtype_cand)
        for rule in self.rules:
            if not rule.matches(phase, site, role, (dtype_ref or "", dtype_cand or "")):
                continue
            metric = rule.metric or self._default_metric(tol)
            rtol = rule.rtol if rule.rtol is not None else (tol[0] if tol else 0.0)
            atol = rule.atol if rule.atol is not None else (tol[1] if tol else 0.0)
            return Check(rule.label, rule.action, metric, rule.threshold, rtol, atol,
                         rule.nonfinite or self.nonfinite,
                         elementwise=self._elementwise(rule.metric or metric, rule.metric is None
                                                       and rule.threshold is None))
        rtol, atol = tol if tol else (0.0, 0.0)
        metric = self._default_metric(tol)
        return Check("default", "compare", metric, None, rtol, atol, self.nonfinite,
                     elementwise=self._elementwise(metric, True))

    def _elementwise(self, metric: str, defaulted: bool) -> bool:
        return defaulted and metric == "rel_l2" and self.preset in ELEMENTWISE_PRESETS

    def key_tolerance(self, dtype_ref: str | None, dtype_cand: str | None):
        """Tolerance of a key: the looser of the two runs' dtypes (None: compare exactly)."""
        tols = [tolerance(d, self.floor, self.tolerances) for d in (dtype_ref, dtype_cand) if d]
        out = None
        for t in tols:
            out = looser(out, t)
        return out

    def _default_metric(self, tol) -> str:
        if self.preset == "bitwise" or tol is None:
            return "exact"
        return "rel_l2"


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
    """Parse a policy file's text; errors name ``source``, the rule and the field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from None
    return _build(doc, source, preset)


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
    for i, table in enumerate(_array_of_tables(ctx, doc, "rename"), start=1):
        pol.renames.append(_rename(ctx, i, table))
    for i, table in enumerate(_array_of_tables(ctx, doc, "rule"), start=1):
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
    if "regex" in t:
        pattern = _string(ctx, where, t, "regex")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ctx.err(where, "regex", f"{pattern!r} is not a regular expression ({exc})") from None
    else:
        pattern = glob_to_regex(_string(ctx, where, t, "glob"))
        compiled = re.compile(pattern)
    try:
        compiled.sub(replace, "")  # a bad group reference fails on the first match only...
        for probe in ("x", "a.b"):
            compiled.sub(replace, probe)
        _check_group_refs(compiled, replace)
    except (re.error, IndexError) as exc:
        raise ctx.err(where, "replace", f"{replace!r} does not fit the pattern ({exc})") from None
    return RenameRule(pattern=pattern, replace=replace, side=side, source=f"{ctx.source} {where}")


def _check_group_refs(compiled: re.Pattern, replace: str) -> None:
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


def _number(ctx: _Ctx, where: str, t: Mapping[str, Any], f: str, *, positive: bool = False) -> float:
    v = t.get(f)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
            or (positive and v == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise ctx.err(where, f, f"{v!r} is not {want}")
    return float(v)


def _choice(ctx: _Ctx, where: str, t: Mapping[str, Any], f: str, options: Iterable[str]) -> str | None:
    if f not in t:
        return None
    v = t[f]
    options = tuple(options)
    if v not in options:
        raise ctx.err(where, f, f"{v!r} is not one of {', '.join(options)}")
    return v
