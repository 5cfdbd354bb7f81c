"""Measure noise bands among a reference's runs (`auditor calibrate`, `compare --noise`).

Every pair of the given runs (the reference and its reruns, one configuration) is compared as
`compare_runs` compares two runs (pieces re-placed where the ranks' rows are uneven, microbatches
regrouped), under a measuring policy (relative L2 for every floating key, the user's renames and
payload budget), so that every key that is not bitwise equal gets its distances whatever the
user's preset; the keys' pieces are then measured one by one (`noise.pieces`) and the pairs
combined into `Bands` (docs/noise.md). n runs make n (n - 1) / 2 pairs: 3 for a reference and 2
reruns.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import numpy as np

from numaudit.auditor.compare.conventions.activation_grads import bwd_factor
from numaudit.auditor.compare.measure import findings as F
from numaudit.auditor.compare.measure.comparison import M_SHAPE, CompareError
from numaudit.auditor.compare.measure.verdicts import evaluate
from numaudit.auditor.compare.merge.replicas import regroup_with_replicas
from numaudit.auditor.compare.merge.uneven import place_uneven
from numaudit.auditor.compare.noise.bands import BandBuilder, Bands
from numaudit.auditor.compare.noise.nondeterminism import describe_noise
from numaudit.auditor.compare.noise.pieces import measure_keys
from numaudit.auditor.compare.policy.load import Policy
from numaudit.auditor.compare.read.columns import Catalog
from numaudit.auditor.compare.read.selection import KeySelection
from numaudit.auditor.store import Reader

log = logging.getLogger(__name__)


def measuring_policy(policy: Policy) -> Policy:
    """The policy pairs of reruns are compared under: relative L2 for every floating key (so
    every key that differs is measured), with the user's renames, payload budget and
    non-finite handling."""
    return Policy(name="noise-measure", source="noise", nonfinite=policy.nonfinite,
                  payload_max_bytes=policy.payload_max_bytes, renames=list(policy.renames))


def pair_comparison(reader: Reader, a: str, b: str, policy: Policy,
                    select: KeySelection | None = None):
    """The comparison of runs ``a`` and ``b`` under the measuring policy."""
    catalog = Catalog(reader, policy.renames)
    ac, bc = catalog.load(a, "ref"), catalog.load(b, "cand")
    if select is not None:
        ac, bc = select.apply(ac), select.apply(bc)
    ac, _ = place_uneven(ac, catalog, bc)
    bc, _ = place_uneven(bc, catalog, ac)
    ac, bc, _ = regroup_with_replicas(ac, bc, catalog)
    factor, _ = bwd_factor(reader.run_info(a), reader.run_info(b))
    return evaluate(ac, bc, catalog, measuring_policy(policy), reader, bwd_factor=factor)


def measure_bands(reader: Reader, runs: list[str], policy: Policy, *,
                  select: KeySelection | None = None,
                  progress: Callable[[str], None] | None = None) -> Bands:
    """The bands among ``runs`` (at least two: the reference and a rerun), every pair measured;
    ``policy`` gives the elementwise test of the share of failing elements."""
    runs = list(dict.fromkeys(runs))
    if len(runs) < 2:
        raise CompareError("noise: bands need at least two runs of the reference (it and a "
                           "rerun)")
    for name in runs:
        reader.run_id(name)  # UnknownRun names the run
    builder = BandBuilder(runs)
    first = None
    for a, b in itertools.combinations(runs, 2):
        comp = pair_comparison(reader, a, b, policy, select)
        v = comp.verdict
        keys = np.flatnonzero(((v == F.CLOSE) | (v == F.DIVERGED)) & (comp.metric != M_SHAPE)
                              & (comp.ref_index >= 0) & (comp.cand_index >= 0))
        measured = measure_keys(comp, keys, policy)
        builder.add(comp, measured)
        first = first or comp
        if progress is not None:
            progress(f"{a} vs {b}: {int((v == F.IDENTICAL).sum())} of {len(comp)} keys bitwise "
                     f"equal")
    bands = builder.build({"policy": {"name": policy.name, "sha256": policy.sha256},
                           "selection": select.describe() if select is not None else ""})
    bands.meta["nondeterminism"] = describe_noise(bands, first)
    return bands
