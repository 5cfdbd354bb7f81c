"""The comparison engine: two stored runs in, a `Report` out (docs/comparison.md).

    report = compare_runs("audit.db", "ref", "pp8", load_policy("policy.toml"))

The pipeline, vectorized over keys (numpy columns, no Python object per record on the hot path),
one subpackage a stage:

1. `read`: each run's records as columns, sites normalized and renamed;
2. `merge`: records re-placed where the runs split their batches otherwise (uneven shares,
   microbatches regrouped, outputs that do not hold the batch), then each key's pieces merged
   into a logical digest: tiling, replica and Partial checks, once per layout signature;
3. `measure`, driven by `auditor.compare.evaluation` under the runs' `conventions`: the two runs
   aligned on the key; the cheap verdicts from the columns (missing, None, incomplete, replica
   divergence, non-finite, and *identical* where the fingerprints agree: most keys of two runs
   that compute the same thing never get further); for the rest, moments and sketches (and
   payloads where both runs sent them) read in chunks and the `policy`'s metric computed against
   its threshold; everything ordered by execution order;
4. `noise`: with reruns of the reference, every key that differs judged per rank piece against
   the reference's own run-to-run noise (docs/noise.md);
5. `explain`: for the breaching keys a report lists, which ranks' pieces differ, while the store
   is still open; causes, graph breaks and groups as `result.Report` is built;
6. `ops`: the operations inside module calls, where the runs captured them (docs/drill-down.md).

`auditor.compare.live.LiveComparison` runs the same pipeline incrementally for `watch`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from numaudit.auditor.compare.evaluation import evaluate_runs
from numaudit.auditor.compare.explain.localize import localize_breaches
from numaudit.auditor.compare.measure.comparison import CompareError
from numaudit.auditor.compare.measure.payloads import measure_exact_breaches
from numaudit.auditor.compare.merge.ranks import mesh_of
from numaudit.auditor.compare.merge.regroup import rescale_declared
from numaudit.auditor.compare.merge.replicas import regroup_with_replicas
from numaudit.auditor.compare.merge.uneven import place_uneven
from numaudit.auditor.compare.noise.judge import NoiseSpec, apply_bands, noise_pieces, resolve_bands
from numaudit.auditor.compare.ops.drill import attach_ops, split_ops
from numaudit.auditor.compare.policy.load import Policy
from numaudit.auditor.compare.read.columns import Catalog
from numaudit.auditor.compare.read.selection import KeySelection
from numaudit.auditor.compare.result import Report
from numaudit.auditor.store import Reader


def _open(reader_or_path: Reader | str | Path) -> tuple[Reader, bool]:
    if isinstance(reader_or_path, Reader):
        return reader_or_path, False
    try:
        return Reader(reader_or_path), True
    except FileNotFoundError as exc:
        raise CompareError(f"db: {exc}") from None


def compare_runs(reader_or_path: Reader | str | Path, ref: str, cand: str,
                 policy: Policy | None = None, *, select: KeySelection | None = None,
                 noise: NoiseSpec | None = None):
    """Compare two stored runs; returns the report model (`auditor.compare.result.Report`).

    `select` keeps only some steps and phases of both runs (a resumed run from its first step
    on; a checkpoint's state); the report says what was left out. `noise` judges the candidate
    against the reference's own run-to-run noise (`auditor.compare.noise.judge`, docs/noise.md)."""

    policy = policy or Policy()
    reader, owned = _open(reader_or_path)
    try:
        t0 = time.perf_counter()
        ref_info, cand_info = _run_info(reader, ref), _run_info(reader, cand)
        catalog = Catalog(reader, policy.renames)
        rc = catalog.load(ref, "ref")
        cc = catalog.load(cand, "cand")
        selected = []
        if select is not None:
            rc, cc = select.apply(rc), select.apply(cc)
            selected = [select.describe()] if select.describe() else []
        ref_info["records"], cand_info["records"] = len(rc), len(cc)
        rc, rc_ops = split_ops(rc, catalog)  # operations compare on their own (drill.py)
        cc, cc_ops = split_ops(cc, catalog)
        t1 = time.perf_counter()
        rc, uneven_ref = place_uneven(rc, catalog, cc)
        cc, uneven_cand = place_uneven(cc, catalog, rc)
        rc, cc, grouping = regroup_with_replicas(rc, cc, catalog)
        grouping += rescale_declared({"ref": ref_info, "cand": cand_info}, catalog)
        # the store is open only until this returns: read what findings name ranks by now;
        # the runs' conventions as declared, or as the evidence shows (`conventions`)
        comp, scale_warnings = evaluate_runs(
            rc, cc, catalog, policy, reader, ref_info, cand_info,
            mesh={"ref": mesh_of(reader, ref), "cand": mesh_of(reader, cand)},
            labels={"ref": ref_info["labels"], "cand": cand_info["labels"]})
        scale_warnings = selected + uneven_ref + uneven_cand + grouping + scale_warnings
        comp.timings["load"] = t1 - t0
        if noise is not None:
            resolve_bands(reader, ref, noise, policy, select)
            comp.noise_summary = apply_bands(comp, noise)
            scale_warnings += comp.noise_summary.pop("warnings")
        t2 = time.perf_counter()
        localize_breaches(comp)
        noise_pieces(comp)
        measure_exact_breaches(comp)  # a bitwise breach: how much and where, from payloads
        comp.timings["localize"] = time.perf_counter() - t2
        report = Report.build(comp, ref_info, cand_info, policy)
        report.warnings.extend(scale_warnings)
        attach_ops(report, rc_ops, cc_ops, catalog, reader)
        comp.timings["total"] = time.perf_counter() - t0
        return report
    finally:
        if owned:
            # Findings read payloads and sites lazily only through the comparison's arrays, so the
            # reader may close; the report keeps no cursor.
            reader.close()


def _run_info(reader: Reader, name: str) -> dict:
    """What the report says about a run (records: filled in from the columns read)."""
    info = reader.run_info(name)
    sessions = reader.conn.execute(
        "SELECT rank, closed IS NOT NULL, stages, records_dropped FROM sessions WHERE run_id = ?",
        (info["run_id"],)).fetchall()
    return {
        "name": name, "world_size": info["world_size"], "dtype": info["dtype"],
        "torch_version": info["torch_version"], "mesh_shape": info["mesh_shape"],
        "mesh_dim_names": info["mesh_dim_names"], "labels": info["labels"],
        "ranks_registered": len({r for r, _, _, _ in sessions}),
        "ranks_closed": len({r for r, closed, _, _ in sessions if closed}),
        "stages": sorted({st for _, _, stages, _ in sessions for st in json.loads(stages)}),
        "records": 0,
        "dropped": sum(d or 0 for _, _, _, d in sessions),
        "conflicts": reader.conflicts(name),
        "grad_scale": info.get("grad_scale", 1.0),
        "grad_scale_sources": info.get("grad_scale_sources", []),
    }
