"""Per-sample digests as stored: the units of samples an agent digested on their own
(agents/digest/sample_digest.py; numaudit.v1 SampleDigests), read by record id.

Read by the sample alignment (`auditor.compare.merge.samples`) and the measurement of keys whose
pieces were placed after the fact (`auditor.compare.measure.per_sample`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numaudit.auditor.compare.digests.sample_estimate import N_MOMENTS
from numaudit.auditor.compare.read.reads import ID_CHUNK, ids_in
from numaudit.auditor.compare.read.segments import unique


@dataclass
class SampleRows:
    """One record's sample digests, as stored (numaudit.v1 SampleDigests)."""

    dim: int
    unit: int
    count: int
    k: int
    f64: np.ndarray
    """[units, 5 + k]."""
    fp: np.ndarray
    """uint64 [units]."""
    seeds: tuple[int, int]
    """The record's (fingerprint, sketch) seeds as stored (int64): the scheme they were made
    with."""


def fetch(catalog, rids: np.ndarray) -> dict[int, SampleRows]:
    """The sample digests of these records that have some (a store of an earlier build has no
    table for them: none)."""
    reader = catalog.reader
    out: dict[int, SampleRows] = {}
    uniq = unique(np.asarray(rids, np.int64))
    try:
        for start in range(0, len(uniq), ID_CHUNK):
            where, param = ids_in(reader, uniq[start:start + ID_CHUNK].tolist())
            where = where.replace("record_id", "s.record_id")
            rows = reader.conn.execute(
                "SELECT s.record_id, s.dim, s.unit, s.count, s.sketch_k, s.rows, s.fingerprints,"
                " r.fingerprint_seed, r.sketch_seed FROM sample_digests s JOIN records r"
                f" ON r.record_id = s.record_id WHERE {where}", param).fetchall()
            for rid, dim, unit, count, k, vals, fps, fs, ss in rows:
                f64 = np.frombuffer(bytes(vals), "<f8")
                fp = np.frombuffer(bytes(fps), "<u8")
                if k < 1 or len(f64) != len(fp) * (N_MOMENTS + k):
                    continue
                out[int(rid)] = SampleRows(int(dim), int(unit), int(count), int(k),
                                           f64.reshape(len(fp), N_MOMENTS + k), fp,
                                           (int(fs), int(ss)))
    except Exception as exc:  # no such table: a store of an earlier build
        if "sample_digests" not in str(exc):
            raise
    return out
