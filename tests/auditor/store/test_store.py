"""The store and its single writer, without the network: idempotence, conflicts, failure paths."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from numaudit.auditor.store import RECORD_COLUMNS, Reader, StoreError, UnknownSession, content_hash
from numaudit.auditor.store.writer import StoreWriter, WriterClosed
from tests.auditor.builders import batch, record, register_request

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def writer(tmp_path):
    w = StoreWriter(tmp_path / "audit.db", synchronous="NORMAL")
    w.submit(lambda s: s.register(register_request())).result(10)
    yield w
    w.close()


def columns(row: tuple, *names: str) -> tuple:
    """The named values of a `Reader.records` row."""
    return tuple(row[RECORD_COLUMNS.index(n)] for n in names)


def sites_of(db, run="ref"):
    reader = Reader(db)
    try:
        return [(r[0], r[3]) for r in reader.records(run)]
    finally:
        reader.close()


def test_ingest_is_idempotent_and_flags_conflicts(writer, tmp_path):
    ingest = lambda b: writer.submit(lambda s: s.ingest(b)).result(10)  # noqa: E731
    first = ingest(batch(1, [record(0, j) for j in range(3)]))
    assert (first.acked_seq, first.stored) == (1, 3)
    again = ingest(batch(1, [record(0, j) for j in range(3)]))
    assert again.resent_batch and again.duplicates == 3 and again.acked_seq == 1
    moved = ingest(batch(2, [record(0, 0), record(0, 1, fingerprint=99)]))
    assert (moved.stored, moved.duplicates, moved.conflicts) == (0, 1, 1)
    reader = Reader(tmp_path / "audit.db")
    try:
        assert reader.conflicts("ref") == 1
        assert [r[28] for r in reader.records("ref")] == [0xDEADBEEF] * 3
    finally:
        reader.close()


def test_content_hash_ignores_chunking_but_not_content():
    a, b = record(payload=b"\0" * 48), record(payload=b"\0" * 48)
    b.payload.chunk_index, b.payload.data = 1, b"other bytes"
    assert content_hash(a) == content_hash(b)
    assert content_hash(a) != content_hash(record(fingerprint=1))
    flat = record(payload=b"\0" * 48)
    flat.layout.flat = True  # the layout says another thing: a range of the flattening
    assert content_hash(flat) != content_hash(a)


def test_store_errors(writer):
    with pytest.raises(UnknownSession):
        writer.submit(lambda s: s.ingest(batch(1, [record()], session_id="nobody"))).result(10)
    with pytest.raises(StoreError, match="world_size"):
        writer.submit(lambda s: s.register(
            register_request(session_id="x", world_size=4, mesh_shape=[4]))).result(10)


def test_cancelled_work_is_skipped_and_the_writer_keeps_going(writer):
    """A future cancelled while queued (an ingest stream that went away) must not kill the
    writer."""
    entered, release, ran = threading.Event(), threading.Event(), []
    blocker = writer.submit(lambda s: (entered.set(), release.wait(10)))
    assert entered.wait(10)
    queued = writer.submit(lambda s: ran.append("queued"))
    assert queued.cancel()
    release.set()
    blocker.result(10)
    assert writer.submit(lambda s: "alive").result(10) == "alive"
    assert ran == []


def test_failed_transaction_does_not_leave_stale_site_ids(writer, tmp_path):
    """A site inserted in a transaction that rolled back must not keep its cached id."""
    def sabotage(store):  # makes the group's COMMIT fail, as a disk error would
        store.conn.execute("ROLLBACK")

    entered, release = threading.Event(), threading.Event()
    blocker = writer.submit(lambda s: (entered.set(), release.wait(10)))
    assert entered.wait(10)
    doomed = writer.submit(lambda s: s.ingest(batch(1, [record(0, 0, "site.a")])))
    failing = writer.submit(sabotage)
    release.set()
    blocker.result(10)  # committed alone; the next group holds doomed + failing
    for fut in (doomed, failing):
        with pytest.raises(sqlite3.OperationalError):  # the group's transaction is gone
            fut.result(10)
    writer.submit(lambda s: s.ingest(batch(1, [record(0, 0, "site.b")]))).result(10)
    writer.submit(lambda s: s.ingest(batch(2, [record(0, 1, "site.a")]))).result(10)
    assert sites_of(tmp_path / "audit.db") == [(0, "site.b"), (0, "site.a")]


def test_submit_after_close_raises(tmp_path):
    w = StoreWriter(tmp_path / "audit.db")
    w.close()
    with pytest.raises(WriterClosed):
        w.submit(lambda s: None)


def test_close_commits_what_is_queued(tmp_path):
    w = StoreWriter(tmp_path / "audit.db")
    w.submit(lambda s: s.register(register_request()))
    futures = [w.submit(lambda s, i=i: s.ingest(batch(i, [record(i)]))) for i in range(1, 20)]
    w.close()
    assert all(f.result(0).stored == 1 for f in futures)
    assert len(sites_of(tmp_path / "audit.db")) == 19


def test_reduction_fields_and_grad_scale_are_stored(writer, tmp_path):
    writer.submit(lambda s: s.register(register_request(
        session_id="s2", rank=1, grad_scale=2.0, grad_scale_source="declared"))).result(10)
    r = record(0, 0)
    r.layout.reduce, r.layout.reduce_weight = 1, 6.0
    r.layout.reduce_index, r.layout.reduce_count = 1, 2
    writer.submit(lambda s: s.ingest(batch(1, [r, record(0, 1)]))).result(10)
    reader = Reader(tmp_path / "audit.db")
    try:
        rows = [columns(row, "reduce", "reduce_weight", "reduce_index", "reduce_count")
                for row in reader.records("ref")]
        assert rows == [(1, 6.0, 1, 2), (0, 1.0, 0, 1)]
        info = reader.run_info("ref")
        # one session declared 2, the other nothing: the run's scale is ambiguous
        assert info["grad_scale"] is None and info["grad_scale_sources"] == ["declared"]
    finally:
        reader.close()


def test_ragged_parts_are_stored(writer, tmp_path):
    r = record(0, 0)
    r.layout.ragged_first, r.layout.ragged_span, r.layout.ragged_parts = 1, 1, 2
    writer.submit(lambda s: s.ingest(batch(1, [r]))).result(10)
    reader = Reader(tmp_path / "audit.db")
    try:
        assert [columns(row, "ragged_parts", "ragged_first", "ragged_span")
                for row in reader.records("ref")] == [(2, 1, 1)]
    finally:
        reader.close()


def test_a_version_1_store_is_upgraded_in_place(tmp_path):
    import sqlite3

    from numaudit.auditor.store import sqlite as store_sqlite

    old = store_sqlite._SCHEMA
    for _table, column, decl in store_sqlite._ADDED_COLUMNS:
        old = old.replace(f",\n    {column} {decl}", "").replace(f", {column} {decl}", "")
    assert "reduce_weight" not in old and "grad_scale" not in old
    db = tmp_path / "v1.db"
    conn = sqlite3.connect(db)
    conn.executescript(old)
    conn.close()
    w = StoreWriter(db, synchronous="NORMAL")
    try:
        w.submit(lambda s: s.register(register_request(grad_scale=4.0))).result(10)
        numbered = record(0, 0)
        numbered.capture_order = 7
        w.submit(lambda s: s.ingest(batch(1, [numbered]))).result(10)
    finally:
        w.close()
    reader = Reader(db)
    try:
        assert reader.run_info("ref")["grad_scale"] == 4.0
        assert [columns(row, *RECORD_COLUMNS[-9:]) for row in reader.records("ref")] == [
            (0, 1.0, 0, 1, 0, 0, 0, 0, 7)]
    finally:
        reader.close()
