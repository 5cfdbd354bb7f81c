"""The store's bulk path (`Store.ingest_columns`): packed and per-record batches store the same
rows, hash alike, and keep idempotence and conflicts when keys are already stored."""

from __future__ import annotations

import sqlite3

import pytest

from numaudit.auditor.store import content_hash
from numaudit.auditor.store.writer import StoreWriter
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches as WB
from numaudit.wire import content_hash as CH
from numaudit.wire import record_form as RF
from tests.auditor.builders import batch, none_record, record, register_request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def writer(tmp_path):
    w = StoreWriter(tmp_path / "audit.db", synchronous="NORMAL")
    w.submit(lambda s: s.register(register_request())).result(10)
    w.submit(lambda s: s.register(register_request(run="cand", session_id="sess-1"))).result(10)
    yield w
    w.close()


def _records() -> list[pb.Record]:
    out = [record(0, j, site=f"layers.{j % 3}", shape=(2 + j % 2, 3)) for j in range(6)]
    red = record(0, 0, site="loss", phase=pb.PHASE_LOSS, shape=(1, 1))
    red.layout.logical_shape[:] = [1, 1]
    red.layout.reduce, red.layout.reduce_weight = pb.REDUCTION_SUM, 1.0
    red.layout.reduce_index, red.layout.reduce_count = 0, 1
    red.digest.nan_count = red.digest.zero_count = 0
    ints = record(0, 0, site="ids", shape=(2, 2))
    ints.layout.dtype, ints.digest.has_moments = "int64", False
    ints.digest.ClearField("sketch")
    flat = record(0, 0, site="fsdp1.weight")
    flat.layout.logical_shape[:], flat.layout.offsets[:], flat.layout.shape[:] = [24], [12], [12]
    flat.layout.flat = True
    return out + [none_record(), red, ints, flat,
                  record(0, 0, site="emb", payload=b"\x07" * 48)]


_COLUMNS = (
    "step", "microbatch", "phase", "role", "idx", "call", "rank", "stage", "is_none", "dtype",
    "logical_shape", "offsets", "shape", "replica", "partial", "complex_as_real", "numel", "nan",
    "posinf", "neginf", "zeros", "has_moments", "sum", "sum_sq", "min", "max", "abs_max",
    "fingerprint", "fingerprint_seed", "sketch", "sketch_seed", "content_hash", "reduce",
    "reduce_weight", "reduce_index", "reduce_count", "ragged_parts", "ragged_first", "ragged_span",
    "flat",
)


def _rows(db, run):
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(
            f"SELECT s.name, {', '.join('r.' + c for c in _COLUMNS)}"
            " FROM records r JOIN sites s USING (site_id) JOIN runs u ON u.run_id = r.run_id"
            " WHERE u.name = ? ORDER BY s.name, r.step, r.microbatch, r.phase", (run,)).fetchall()
    finally:
        conn.close()


def test_packed_and_per_record_store_the_same_rows(writer, tmp_path):
    records = _records()
    per_record = writer.submit(lambda s: s.ingest(batch(1, records))).result(10)
    packed = WB.packed_batch("sess-1", 1, RF.from_records(records))
    assert len(packed.records) == 1 and packed.packed.count == len(records) - 1
    got = writer.submit(lambda s: s.ingest(packed)).result(10)
    assert per_record.stored == got.stored == len(records)
    db = tmp_path / "audit.db"
    assert _rows(db, "ref") == _rows(db, "cand") and len(_rows(db, "ref")) == len(records)
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT COUNT(*) FROM payload_chunks").fetchone()[0] == 2
    conn.close()


def test_a_record_hashes_the_same_packed_or_per_record():
    records = _records()
    cols = WB.batch_columns(WB.packed_batch("s", 1, RF.from_records(records)))
    by_key = {}
    for r, h in zip(RF.to_records(cols), CH.content_hashes(cols)):
        by_key[r.key.SerializeToString()] = h
    for r in records:
        assert by_key[r.key.SerializeToString()] == content_hash(r)
    assert len(set(by_key.values())) == len(records)


def test_resend_of_a_packed_batch_is_a_duplicate_and_changed_content_a_conflict(writer):
    records = _records()
    ingest = lambda b: writer.submit(lambda s: s.ingest(b)).result(10)  # noqa: E731
    first = ingest(WB.packed_batch("sess-0", 1, RF.from_records(records)))
    assert first.stored == len(records)
    # the same records per record, at a resent seq: all duplicates
    again = ingest(batch(1, records))
    assert again.resent_batch and again.duplicates == len(records) and not again.conflicts
    # a new seq holding one stored record, one changed one and a new one: the bulk insert falls
    # back to rows, stores the new one, counts the duplicate, flags the conflict
    changed = record(0, 1, site="layers.1", shape=(3, 3), fingerprint=12345)
    new = record(5, 0, site="layers.9")
    mixed = ingest(WB.packed_batch("sess-0", 2, RF.from_records([records[0], changed, new])))
    assert (mixed.stored, mixed.duplicates, mixed.conflicts) == (1, 1, 1)
    # a key twice inside one new batch: stored once, the second is a duplicate
    twice = ingest(WB.packed_batch("sess-0", 3, RF.from_records([record(7, 0), record(7, 0)])))
    assert (twice.stored, twice.duplicates) == (1, 1)


def test_failed_bulk_insert_leaves_nothing_and_the_session_unacked(writer, tmp_path):
    """A batch whose writes fail is rolled back whole (its savepoint): no rows, acked_seq kept."""
    cols = RF.from_records(_records())
    cols.cols["site"] = cols.cols["site"].copy()
    cols.sites = []  # no site table: building the rows fails inside the writer's item
    with pytest.raises(IndexError):  # the batch's site index into an empty site table
        writer.submit(lambda s: s.ingest_columns("sess-0", 1, cols)).result(10)
    conn = sqlite3.connect(tmp_path / "audit.db")
    assert conn.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 0
    acked = conn.execute("SELECT acked_seq FROM sessions WHERE session_id='sess-0'").fetchone()
    assert acked == (0,)
    conn.close()



def test_page_size_applies_to_new_store_files_only(tmp_path, monkeypatch):
    from numaudit.auditor.store import connect
    from numaudit.auditor.store import sqlite as store_sqlite

    monkeypatch.setattr(store_sqlite, "PAGE_SIZE", 16384)
    conn = connect(tmp_path / "a.db")
    assert conn.execute("PRAGMA page_size").fetchone()[0] == 16384
    conn.close()
    monkeypatch.setattr(store_sqlite, "PAGE_SIZE", 4096)
    conn = connect(tmp_path / "a.db")  # reopened by a build with another page size: kept
    assert conn.execute("PRAGMA page_size").fetchone()[0] == 16384
    conn.close()


def test_content_hash_tells_apart_what_a_linear_hash_would_not():
    """Changes that cancel out in a sum or a linear form (two sign flips, two buckets swapped,
    a value moved between fields or records) still change the hash."""
    base = record(0, 0, shape=(4, 3))
    base.digest.sketch[:] = [0.5 * i for i in range(16)]
    variants = [base]
    flipped = pb.Record()
    flipped.CopyFrom(base)
    flipped.digest.sum, flipped.digest.min = -base.digest.sum, -base.digest.min
    swapped = pb.Record()
    swapped.CopyFrom(base)
    sketch = swapped.digest.sketch
    sketch[1], sketch[2] = base.digest.sketch[2], base.digest.sketch[1]
    moved = pb.Record()
    moved.CopyFrom(base)
    moved.digest.nan_count, moved.digest.zero_count = base.digest.zero_count, base.digest.nan_count
    shorter = pb.Record()
    shorter.CopyFrom(base)
    del shorter.digest.sketch[-1]
    variants += [flipped, swapped, moved, shorter]
    hashes = [content_hash(r) for r in variants]
    assert len(set(hashes)) == len(variants)
    many = RF.from_records([record(s, m, site=f"l{i}") for s in range(4) for m in range(8)
                           for i in range(32)])
    assert len(set(CH.content_hashes(many))) == many.n == 1024
