"""The comparison's fast reads load a run exactly as its row read does: key segments on SQLite
(`auditor.store.key_segments`, with a fall back to rows whenever they do not account for every
record) and the packed one-row read on PostgreSQL (`auditor.compare.read.reads.pg_arrays`)."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.read import reads
from numaudit.auditor.compare.read.columns import Catalog
from numaudit.auditor.store import Reader, connect, key_segments
from numaudit.auditor.store.backend import open_writer
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches as WB
from numaudit.wire import record_form as RF
from tests.auditor.builders import batch, none_record, record, register_request
from tests.auditor.synth import mlp_run, write_runs

pytestmark = pytest.mark.timeout(120)


def _odd_records() -> list[pb.Record]:
    """Records that exercise every part of a layout text and every flag bit."""
    out = []
    for j, weight in enumerate((1 / 3, 0.1, 1e-5, 2.0, 12345.678)):
        r = record(0, j, site="loss", phase=pb.PHASE_LOSS, shape=(1, 1))
        r.layout.logical_shape[:] = [1, 1]
        r.layout.reduce, r.layout.reduce_weight = pb.REDUCTION_MEAN, weight
        r.layout.reduce_index, r.layout.reduce_count = j % 2, 2
        out.append(r)
    rag = record(1, 0, site="moe.experts", shape=(3, 3))
    rag.layout.ragged_parts, rag.layout.ragged_first, rag.layout.ragged_span = 4, 1, 2
    out.append(rag)
    for flag in ("replica", "partial", "complex_as_real"):
        r = record(1, 1, site=f"flags.{flag}")
        setattr(r.layout, flag, True)
        out.append(r)
    zeros = record(1, 2, site="zeros")
    zeros.digest.nan_count, zeros.digest.zero_count = 0, zeros.digest.numel
    inf = record(1, 3, site="inf")
    inf.digest.nan_count, inf.digest.neginf_count = 0, 2
    ints = record(1, 4, site="ids")
    ints.layout.dtype, ints.digest.has_moments = "int64", False
    ints.digest.ClearField("sketch")
    seeds = record(1, 5, site="other.seeds")
    seeds.digest.fingerprint_seed, seeds.digest.sketch_seed = 99, 98
    far = record(7_000_000, 3, site="late", fingerprint=(1 << 64) - 5)
    far.key.index, far.key.call, far.stage = 9000, 16000, 3
    # a flat piece, and a 1-D box of the same dims: one layout table entry, told apart by the
    # flag bit alone
    flat, box = record(1, 6, site="fsdp1.weight"), record(1, 7, site="fsdp1.weight")
    for r in (flat, box):
        r.layout.logical_shape[:], r.layout.offsets[:], r.layout.shape[:] = [24], [12], [12]
    flat.layout.flat = True
    return out + [zeros, inf, ints, seeds, far, flat, box, none_record(step=2)]


def _load(db, run: str, *, rows: bool, monkeypatch) -> tuple:
    reader = Reader(db)
    try:
        cat = Catalog(reader)
        with monkeypatch.context() as m:
            if rows:
                m.setattr(key_segments, "covered", lambda conn, run_id: 0)
                m.setattr(reads, "pg_arrays", lambda reader, params: None)
            cols = cat.load(run, "ref")
        pieces = [cat.pieces[i] for i in cols.layout.tolist()]
        bits = [(cat.seeds_ok[i], cat.has_moments[i]) for i in cols.layout.tolist()]
        return cols, pieces, bits, list(cat.warnings)
    finally:
        reader.close()


def _assert_same_load(db, run: str, monkeypatch) -> int:
    seg, seg_pieces, seg_bits, seg_warn = _load(db, run, rows=False, monkeypatch=monkeypatch)
    row, row_pieces, row_bits, _ = _load(db, run, rows=True, monkeypatch=monkeypatch)
    for f in ("when", "where", "rank", "stage", "flags", "fp", "rid"):
        assert np.array_equal(getattr(seg, f), getattr(row, f)), f
    assert seg.max_rid == row.max_rid
    assert seg_pieces == row_pieces and seg_bits == row_bits
    assert not seg_warn
    return len(seg)


def _segment_count(db) -> tuple[int, int]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT COUNT(*), COALESCE(SUM(n), 0) FROM segments").fetchone()
    finally:
        conn.close()


def _write_odd_runs(db):
    """Runs "ref" and "cand" of the odd records; cand also resends some keys (one changed):
    the row-by-row path stores only the new ones."""
    w = open_writer(db, synchronous="NORMAL")
    try:
        w.submit(lambda s: s.register(register_request())).result(10)
        w.submit(lambda s: s.register(register_request(run="cand", session_id="c0"))).result(10)
        recs = _odd_records()
        w.submit(lambda s: s.ingest(batch(1, recs))).result(10)
        w.submit(lambda s: s.ingest(WB.packed_batch("c0", 1, RF.from_records(recs[:8])))).result(10)
        again = [pb.Record() for _ in range(3)]
        for a, r in zip(again, recs[6:9]):
            a.CopyFrom(r)
        again[1].digest.fingerprint ^= 1  # a conflict; again[2] repeats a key of this batch
        fresh = recs[8:] + again
        got = w.submit(lambda s: s.ingest(batch(2, fresh, session_id="c0"))).result(10)
        assert (got.stored, got.duplicates, got.conflicts) == (len(recs) - 8, 2, 1)
    finally:
        w.close()
    return db


@pytest.fixture
def odd_store(tmp_path):
    return _write_odd_runs(tmp_path / "audit.db")


def test_segments_load_exactly_what_rows_load(odd_store, monkeypatch):
    n = len(_odd_records())
    assert _assert_same_load(odd_store, "ref", monkeypatch) == n
    assert _assert_same_load(odd_store, "cand", monkeypatch) == n
    # three segments: ref's batch, cand's two (the second holding only its new records)
    assert _segment_count(odd_store) == (3, 2 * n)


def test_segments_of_a_sharded_training_run_load_like_rows(tmp_path, monkeypatch):
    def drop_grad(kind, step, mb, site, t):
        return None if (kind, site) == ("grad", "layers.1.weight") else t

    db = write_runs(tmp_path / "a.db", mlp_run("ref", world=1, steps=2, payload=True),
                    mlp_run("cand", world=4, steps=2, perturb=drop_grad))
    assert _assert_same_load(db, "ref", monkeypatch) > 0
    assert _assert_same_load(db, "cand", monkeypatch) > 0
    conn = connect(db)
    run_ids = conn.execute("SELECT run_id FROM runs")
    assert all(key_segments.complete(conn, rid) for (rid,) in run_ids)
    conn.close()


def test_incomplete_or_missing_segments_fall_back_to_rows(odd_store, monkeypatch):
    before = compare_runs(odd_store, "ref", "cand")
    conn = sqlite3.connect(odd_store)
    conn.execute("DELETE FROM segments WHERE segment_id = (SELECT MAX(segment_id) FROM segments)")
    conn.commit()
    conn.close()
    conn = connect(odd_store)
    assert not key_segments.complete(conn, 2) and key_segments.complete(conn, 1)
    conn.close()
    assert _assert_same_load(odd_store, "cand", monkeypatch) == len(_odd_records())
    # a store from before segments (no table at all) reads as it always did
    conn = sqlite3.connect(odd_store)
    conn.execute("DROP TABLE segments")
    conn.commit()
    conn.close()
    reader = Reader(odd_store)
    try:
        assert len(Catalog(reader).load("cand", "cand")) == len(_odd_records())
    finally:
        reader.close()
    after = compare_runs(odd_store, "ref", "cand")
    assert after.counts == before.counts


def test_a_damaged_segment_is_reported_and_rows_are_read(odd_store, monkeypatch):
    conn = sqlite3.connect(odd_store)
    conn.execute("UPDATE segments SET data = substr(data, 1, 40) WHERE segment_id = 1")
    conn.commit()
    conn.close()
    cols, _, _, warnings = _load(odd_store, "ref", rows=False, monkeypatch=monkeypatch)
    assert len(cols) == len(_odd_records())
    assert len(warnings) == 1 and "segment" in warnings[0] and "row by row" in warnings[0]


def test_backfill_rebuilds_the_segments_of_a_run(odd_store, monkeypatch):
    conn = sqlite3.connect(odd_store)
    conn.execute("DELETE FROM segments")
    conn.commit()
    conn.close()
    conn = connect(odd_store)
    assert key_segments.backfill(conn, 1, per_segment=4) == len(_odd_records())
    assert key_segments.backfill(conn, 2) == len(_odd_records())
    assert key_segments.complete(conn, 1) and key_segments.complete(conn, 2)
    conn.close()
    assert _assert_same_load(odd_store, "ref", monkeypatch) == len(_odd_records())
    assert _assert_same_load(odd_store, "cand", monkeypatch) == len(_odd_records())


def test_decode_refuses_what_it_cannot_vouch_for():
    blob = key_segments.encode({c: [0] for c in key_segments.SOURCE_COLUMNS}
                           | {"dtype": [""], "logical_shape": ["[]"], "offsets": ["[]"],
                              "shape": ["[]"], "reduce_weight": [1.0]}, [5])
    cols, table = key_segments.decode(blob)
    assert cols["record_id"].tolist() == [5] and len(table) == 1
    for bad, why in ((blob[:-1], "do not hold"), (b"XXXX" + blob[4:], "magic"),
                     (blob[:8], "header")):
        with pytest.raises(key_segments.SegmentError, match=why):
            key_segments.decode(bad)
    head = key_segments._HEAD
    _, n, tlen = head.unpack_from(blob)
    for table in (b"{}", b"[[1,2]]", b'[["", "[]", "[]", 7, 0, 0, 0, 0, 0, 1, 1.0, 0, 0]]',
                  b'[["", "[]", "[]", "[]", 0, 0, 0, 0, 0, 1, "1", 0, 0]]', b"[[", b"[3]"):
        body = blob[head.size + tlen + (-(head.size + tlen) % 8):]
        forged = head.pack(key_segments.MAGIC, n, len(table)) + table + \
            b"\0" * (-(head.size + len(table)) % 8) + body
        with pytest.raises(key_segments.SegmentError, match="layout (table|code)"):
            key_segments.decode(forged)


def test_segments_that_disagree_with_their_count_are_not_used(odd_store, monkeypatch):
    """A segment row whose count says n but whose blob holds other records is not trusted."""
    conn = sqlite3.connect(odd_store)
    data, n = conn.execute("SELECT data, n FROM segments WHERE segment_id = 1").fetchone()
    cols, _ = key_segments.decode(data)
    half = {c: [0] * 2 for c in key_segments.SOURCE_COLUMNS} | {
        "dtype": ["float32"] * 2, "logical_shape": ["[1]"] * 2, "offsets": ["[0]"] * 2,
        "shape": ["[1]"] * 2, "reduce_weight": [1.0] * 2}
    conn.execute("UPDATE segments SET data = ? WHERE segment_id = 1",
                 (key_segments.encode(half, [1, 2]),))
    conn.commit()
    conn.close()
    seg, _, _, warnings = _load(odd_store, "ref", rows=False, monkeypatch=monkeypatch)
    row, _, _, _ = _load(odd_store, "ref", rows=True, monkeypatch=monkeypatch)
    assert len(seg) == len(row) == n and np.array_equal(seg.fp, row.fp)
    assert len(warnings) == 1 and "decode to 2 records" in warnings[0]


def test_a_key_beyond_the_comparable_range_is_refused_from_segments_too(tmp_path, monkeypatch):
    from numaudit.auditor.compare.read.columns import KeyRangeError

    db = tmp_path / "audit.db"
    w = open_writer(db, synchronous="NORMAL")
    try:
        w.submit(lambda s: s.register(register_request())).result(10)
        w.submit(lambda s: s.ingest(batch(1, [record(1 << 40, 0)]))).result(10)
    finally:
        w.close()
    assert _segment_count(db) == (1, 1)
    for rows in (False, True):
        with pytest.raises(KeyRangeError, match="beyond the comparable range"):
            _load(db, "ref", rows=rows, monkeypatch=monkeypatch)


def test_the_packed_postgresql_read_loads_exactly_what_rows_load(pg_url, monkeypatch):
    _write_odd_runs(pg_url)
    assert _assert_same_load(pg_url, "ref", monkeypatch) == len(_odd_records())
    assert _assert_same_load(pg_url, "cand", monkeypatch) == len(_odd_records())


def test_a_run_too_large_for_one_postgresql_value_is_read_in_blocks(pg_url, monkeypatch):
    """PostgreSQL caps a value at 1 GB; past it the packed read goes by blocks of record ids
    (here blocks of 3; the first, whole-run read is made to raise what PostgreSQL 15 raises for
    a string_agg past the cap: ProgramLimitExceeded, "Cannot enlarge string buffer", as checked
    by hand on text and bytea aggregates over 1 GB)."""
    import psycopg

    _write_odd_runs(pg_url)
    first = reads.pg_packed
    calls = []

    def too_large_once(reader, params, where):
        calls.append(where)
        if not where:
            raise psycopg.errors.ProgramLimitExceeded("out of memory")
        return first(reader, params, where)

    monkeypatch.setattr(reads, "PG_BLOCK", 3)
    with monkeypatch.context() as m:
        m.setattr(reads, "pg_packed", too_large_once)
        blocks, _, _, _ = _load(pg_url, "cand", rows=False, monkeypatch=monkeypatch)
    rows, _, _, _ = _load(pg_url, "cand", rows=True, monkeypatch=monkeypatch)
    assert len(calls) > 4 and calls[0] == ""
    for f in ("when", "where", "rank", "stage", "flags", "fp", "rid"):
        assert np.array_equal(getattr(blocks, f), getattr(rows, f)), f


def test_digests_prefetched_from_segments_equal_the_rows(odd_store, monkeypatch):
    """A comparison whose keys mostly differ reads counts and moments from the segments and
    only sketches from rows (`Catalog.prefetch_digests`): the same values as reading rows."""
    monkeypatch.setattr(reads, "PREFETCH_MIN", 1)
    reader = Reader(odd_store)
    try:
        cat = Catalog(reader)
        rids = np.concatenate([cat.load("ref", "ref").rid, cat.load("cand", "cand").rid])
        rids = np.concatenate([rids[::-1], rids[:3]])  # any order, repeats
        from_rows = cat.fetch_digests(rids)
        cat.prefetch_digests(rids)
        prefetched_rids = cat._digests._prefetched[0]
        assert len(prefetched_rids) == len(np.unique(rids))
        prefetched = cat.fetch_digests(rids)
        cat.drop_prefetched()
    finally:
        reader.close()
    assert from_rows.keys() == prefetched.keys()
    for c, v in from_rows.items():
        assert v.dtype == prefetched[c].dtype and np.array_equal(v, prefetched[c]), c
    assert np.isinf(from_rows["min"]).any()  # records without moments hold the identities


def test_engine_verdicts_are_the_same_with_prefetched_digests(tmp_path, monkeypatch):
    from tests.auditor.synth import one_ulp

    def drift(kind, step, mb, site, t):
        return one_ulp(t, 1) if kind in ("fwd", "grad") else t

    db = write_runs(tmp_path / "a.db", mlp_run("ref", world=2, steps=2),
                    mlp_run("cand", world=2, steps=2, perturb=drift))
    monkeypatch.setattr(reads, "PREFETCH_MIN", 10 ** 9)
    from_rows = compare_runs(db, "ref", "cand")
    monkeypatch.setattr(reads, "PREFETCH_MIN", 1)
    prefetched = compare_runs(db, "ref", "cand")
    assert from_rows.counts == prefetched.counts and from_rows.counts.get("close", 0) > 10
    a, b = from_rows.comparison, prefetched.comparison
    for f in ("verdict", "value", "sigma", "rel_l2", "cos_dist"):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f


def test_rows_are_read_by_ranges_and_lists_alike(tmp_path, monkeypatch):
    """`reads.rows_of` reads close record ids by ranges (dropping the rows in between) and
    scattered ones by lists: the same rows, in record id order, as one list would give."""
    db = write_runs(tmp_path / "a.db", mlp_run("ref", world=2, steps=3))
    monkeypatch.setattr(reads, "RANGE_GAP", 4)
    reader = Reader(db)
    try:
        every = np.array([r for (r,) in reader.conn.execute(
            "SELECT record_id FROM records ORDER BY record_id")], np.int64)
        assert len(every) > 100
        wanted = np.concatenate([every[:40][every[:40] % 3 != 0],  # dense, some rows dropped
                                 every[60:100:10],                 # scattered
                                 every[-5:]])                      # dense, all kept
        got = reads.rows_of(reader, wanted, "record_id, fingerprint")
        want = reader.conn.execute(
            "SELECT record_id, fingerprint FROM records WHERE record_id IN (SELECT value FROM"
            " json_each(?)) ORDER BY record_id", (json.dumps(wanted.tolist()),)).fetchall()
    finally:
        reader.close()
    assert got == want and len(got) == len(wanted)
