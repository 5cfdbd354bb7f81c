"""The comparison's result as columns: one entry per aligned key, in key order.

`Comparison` holds every key's verdict, metric, threshold and the estimates behind them as numpy
arrays (a million keys cost no million objects); `auditor.compare.explain.finding` materializes
one key as a `Finding` (docs/report-schema.md) when a report asks for it. The stages that fill
it live beside it: `verdicts` (cheap verdicts from the columns), `slow` (metrics from moments and
sketches), `payloads` (exact metrics from bytes), `order` (execution order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.merge import tiling as M
from numaudit.auditor.compare.merge.keys import LogicalKeys
from numaudit.auditor.compare.policy.load import METRICS, Policy
from numaudit.auditor.compare.read.align import Key, phase_name, role_name
from numaudit.auditor.compare.read.columns import Catalog, RunColumns

METRIC_CODES = {m: i for i, m in enumerate(METRICS)}
"""Code of each policy metric in `Comparison.metric`."""
METRIC_NAMES = list(METRICS) + ["l2", "shape"]
"""Name of each code in `Comparison.metric` (two more than the policy's: absolute l2, shape)."""
M_L2, M_SHAPE = len(METRICS), len(METRICS) + 1


class CompareError(Exception):
    """A comparison that cannot be made (unknown run, unreadable store): usage/input error."""


@dataclass
class Comparison:
    """Every aligned key's verdict and metrics, as arrays: one entry per key, in (when, where)
    order."""

    ref: RunColumns
    cand: RunColumns
    ref_keys: LogicalKeys
    cand_keys: LogicalKeys
    catalog: Catalog
    policy: Policy
    when: np.ndarray
    """Per key, when in training it was captured: step << 24 | (microbatch + 1) << 4 | phase
    (`auditor.compare.read.columns`); keys are sorted by (when, where)."""
    where: np.ndarray
    """Per key, where in the model: site << 32 | role << 28 | index << 14 | call."""
    ref_index: np.ndarray
    """Per key, its index in `ref_keys` (-1: the reference has no such key)."""
    cand_index: np.ndarray
    """Per key, its index in `cand_keys` (-1: the candidate has no such key)."""
    verdict: np.ndarray
    breach: np.ndarray
    expected: np.ndarray
    metric: np.ndarray
    value: np.ndarray
    sigma: np.ndarray
    threshold: np.ndarray
    uncertain: np.ndarray
    rule: np.ndarray
    rule_labels: list[str]
    rel_l2: np.ndarray
    rel_sigma: np.ndarray
    cos_dist: np.ndarray
    cos_sigma: np.ndarray
    norm_ratio: np.ndarray
    abs_max_ratio: np.ndarray
    lower_bound: np.ndarray
    order: np.ndarray
    """order[j] = index of the j-th key in execution order."""
    rank_in_order: np.ndarray
    """rank_in_order[i] = position of key i in execution order."""
    pred: np.ndarray
    """Previous compared key in execution order within the same step block (-1: none)."""
    order_stage: np.ndarray
    payload: dict[int, dict] = field(default_factory=dict)
    notes: dict[int, list[str]] = field(default_factory=dict)
    nonfinite_counts: np.ndarray | None = None
    """[K, 6]: NaN, +Inf, -Inf of ref then cand, where read (-1 elsewhere)."""
    timings: dict[str, float] = field(default_factory=dict)
    bwd_factor: float = 1.0
    """The reference's activation gradients (phase bwd) are compared scaled by this: the
    candidate's grad_scale over the reference's (their loss normalizations)."""
    bwd_inferred: str = ""
    """Why `bwd_factor` is what it is when the evidence gave it, not the runs' declared scales
    (`auditor.compare.conventions.activation_grads`); "" when declared."""
    scaled_by: np.ndarray | None = None
    """Norm ratio of keys that breach as a pure rescaling of the reference (NaN elsewhere)."""
    pieces: dict[int, dict] = field(default_factory=dict)
    """Which ranks' pieces differ, for the localized breaching keys (`localize`)."""
    mesh: dict[str, dict] = field(default_factory=dict)
    """Per side ("ref", "cand"): the run's mesh dim names and each rank's coordinate
    (`ranks.mesh_of`), read while the store was open."""
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per side ("ref", "cand"): the run's labels, as registered."""
    scaled_resid: np.ndarray | None = None
    """||cand - a*ref|| / ||cand|| with a = ||cand||/||ref||, where measured: how far the
    candidate is from a pure rescaling of the reference."""
    memo: dict = field(default_factory=dict)
    """Evidence derived once per comparison and reused by every finding's cause (`causes`)."""
    noise: dict[int, dict] = field(default_factory=dict)
    """Keys judged against the reference's noise bands: their band and verdict
    (`auditor.compare.noise.judge`; the finding's ``metrics.noise``)."""
    noise_summary: dict | None = None
    """With noise bands: the counts per kind and the reference's nondeterminism (the report's
    ``noise``)."""

    def __len__(self) -> int:
        return len(self.when)

    # -- keys -----------------------------------------------------------------------------------

    def key(self, i: int) -> Key:
        a, b = int(self.when[i]), int(self.where[i])
        return Key(step=a >> 24, microbatch=((a >> 4) & 0xFFFFF) - 1, phase=phase_name(a & 0xF),
                   site=self.catalog.site_names.get(b >> 32, f"site#{b >> 32}"),
                   role=role_name((b >> 28) & 0xF), index=(b >> 14) & 0x3FFF, call=b & 0x3FFF)

    def find(self, step: int, microbatch: int, phase: int, site_id: int, role: int, index: int = 0,
             call: int = 0) -> int:
        """Index of a key, or -1."""
        a = (step << 24) | ((microbatch + 1) << 4) | phase
        b = (site_id << 32) | (role << 28) | (index << 14) | call
        lo = int(np.searchsorted(self.when, a, "left"))
        hi = int(np.searchsorted(self.when, a, "right"))
        j = lo + int(np.searchsorted(self.where[lo:hi], b))
        return j if j < hi and self.where[j] == b else -1

    def passes(self, i: int) -> bool:
        return not bool(self.breach[i])

    def nonfinite_detail(self, i: int) -> dict | None:
        nc = self.nonfinite_counts
        if nc is None or nc[i, 0] < 0:
            return None
        c = nc[i].tolist()
        return {"ref": {"nan": c[0], "posinf": c[1], "neginf": c[2]},
                "cand": {"nan": c[3], "posinf": c[4], "neginf": c[5]}}

    def indices(self, *, breaches_only: bool = False, include_identical: bool = True,
                in_order: bool = True) -> np.ndarray:
        """Keys with a finding (ignored keys have none), optionally only breaches."""
        idx = self.order if in_order else np.arange(len(self))
        keep = self.verdict[idx] != F.IGNORED
        if breaches_only:
            keep &= self.breach[idx]
        if not include_identical:
            keep &= self.verdict[idx] != F.IDENTICAL
        return idx[keep]

    def none_in_both(self, idx: np.ndarray) -> np.ndarray:
        """Per key of `idx`: held by both runs and None in both (a gradient neither run got)."""
        held = (self.ref_index[idx] >= 0) & (self.cand_index[idx] >= 0)
        return held & (self.ref_keys.status[np.maximum(self.ref_index[idx], 0)] == M.NONE) \
            & (self.cand_keys.status[np.maximum(self.cand_index[idx], 0)] == M.NONE)

    def counts(self) -> dict[str, int]:
        c = np.bincount(self.verdict.astype(np.int64), minlength=len(F.VERDICT_NAMES))
        return {name: int(c[k]) for k, name in enumerate(F.VERDICT_NAMES)}

    def first_divergence(self) -> int:
        """Index of the earliest breaching key in execution order, or -1."""
        br = np.flatnonzero(self.breach[self.order])
        return int(self.order[br[0]]) if len(br) else -1

    def step_keys(self, step: int, phases: tuple[int, ...]) -> np.ndarray:
        """Compared (not ignored) keys of one step in the given phases."""
        lo = int(np.searchsorted(self.when, step << 24, "left"))
        hi = int(np.searchsorted(self.when, (step + 1) << 24, "left"))
        idx = np.arange(lo, hi)
        return idx[np.isin(self.when[lo:hi] & 0xF, phases) & (self.verdict[lo:hi] != F.IGNORED)]
