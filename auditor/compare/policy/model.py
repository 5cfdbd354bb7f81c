"""The policy model: rules, checks, presets and per-dtype tolerances (docs/policy.md).

A `Policy` decides, for every aligned key, whether it is compared at all (``ignore``), whether its
absence from one run is expected (``expect_missing``), and otherwise which metric is checked
against which threshold. Rules are tried in order and the first match wins; a key no rule
matches gets the default check of its dtype. Reading policies from TOML is
`auditor.compare.policy.load`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from numaudit.auditor.compare.read.align import RenameRule

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
    "allclose": ("max over elements of |cand - ref| / (atol + rtol |ref|) (payloads); "
                 "passes at <= 1"),
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

class PolicyError(ValueError):
    """A policy refused; the message names the file, the rule and the field."""


def tolerance(dtype: str, floor: tuple[float, float] | None = None,
              overrides: Mapping[str, tuple[float, float]] | None = None
              ) -> tuple[float, float] | None:
    """(rtol, atol) for a dtype, or None when it compares exactly (integers, bools)."""
    tol = (overrides or {}).get(dtype) or DTYPE_TOLERANCES.get(dtype)
    if tol is None:
        return None
    if floor is not None:
        tol = (max(tol[0], floor[0]), max(tol[1], floor[1]))
    return tol


def looser(a: tuple[float, float] | None,
           b: tuple[float, float] | None) -> tuple[float, float] | None:
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
        return not self.dtypes or any(d in self.dtypes for d in dtypes if d)


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


