"""Record.capture_order on both backends: stored as sent by every write path, not part of what
a record says (a resend with another number is a duplicate), and 0 for records of a store made
before the column existed, read with or without a writer having opened it since."""

from __future__ import annotations

import numpy as np
import pytest

from numaudit.auditor.store import RECORD_COLUMNS, key_segments
from numaudit.auditor.store.backend import open_writer
from numaudit.wire.batches import split_batch
from numaudit.wire.record_form import from_records
from tests.auditor.builders import batch, float32_bytes, payload_for, record
from tests.auditor.store.test_backends import call, ingest, read, register

pytestmark = pytest.mark.timeout(60)


def numbered(step: int, microbatch: int, order: int, **kw):
    r = record(step, microbatch, **kw)
    r.capture_order = order
    return r


def orders(reader, run: str = "ref") -> dict[tuple[int, int], int]:
    at = RECORD_COLUMNS.index("capture_order")
    return {(row[0], row[1]): row[at] for row in reader.records(run)}


@pytest.fixture
def writer(store_location):
    w = open_writer(store_location, synchronous="NORMAL")
    register(w)
    yield w
    w.close()


def test_every_write_path_stores_the_number_as_sent(writer, store_location):
    """Per record, packed (the direct COPY on PostgreSQL), packed with a payload (record ids
    drawn first), and a batch one of whose keys is stored already (the staging table)."""
    assert ingest(writer, batch(1, [numbered(0, 0, 5), numbered(0, 1, 0)])).stored == 2
    packed = split_batch("sess-0", 2, from_records([numbered(1, 0, 9), numbered(1, 1, 7)]), None)
    assert not len(packed.records) and ingest(writer, packed).stored == 2
    with_payload = numbered(2, 0, 11)
    with_payload.payload.CopyFrom(payload_for(float32_bytes(12), raw_nbytes=48, codec="raw"))
    assert ingest(writer, split_batch("sess-0", 3, from_records([with_payload]), None)).stored == 1
    staged = ingest(writer, batch(4, [numbered(0, 0, 5), numbered(3, 0, 3)]))
    assert (staged.stored, staged.duplicates) == (1, 1)
    assert read(store_location, orders) == {(0, 0): 5, (0, 1): 0, (1, 0): 9, (1, 1): 7,
                                            (2, 0): 11, (3, 0): 3}


def test_a_resend_with_another_number_is_a_duplicate(writer, store_location):
    """When a capture was made is not what it says: the record stored first keeps its
    number, and the resend is no conflict (an earlier build's resend without one neither)."""
    ingest(writer, batch(1, [numbered(0, 0, 4), numbered(0, 1, 6)]))
    again = ingest(writer, batch(2, [numbered(0, 0, 40), numbered(0, 1, 0)]))
    assert (again.stored, again.duplicates, again.conflicts) == (0, 2, 0)
    assert read(store_location, orders) == {(0, 0): 4, (0, 1): 6}


def test_segments_carry_the_number_and_older_ones_read_as_unnumbered(writer, store_location):
    if str(store_location).startswith("postgresql://"):
        pytest.skip("key segments are SQLite's")
    ingest(writer, batch(1, [numbered(0, 0, 12), numbered(0, 1, 13)]))
    import sqlite3

    with sqlite3.connect(store_location) as conn:
        (blob,) = conn.execute("SELECT data FROM segments").fetchone()
    cols, table = key_segments.decode(blob)
    assert cols["capture_order"].tolist() == [12, 13]
    # the same segment as written before records carried a number (format NAS2)
    n = 2
    head = key_segments._HEAD
    tlen = head.unpack_from(blob)[2]
    at = head.size + tlen + (-(head.size + tlen) % 8)
    ints = len(key_segments.INTS)
    order_at = at + 8 * n * (ints - 1)
    old = (head.pack(b"NAS2", n, tlen) + blob[head.size:order_at] + blob[order_at + 8 * n:])
    got, old_table = key_segments.decode(old)
    assert old_table == table and got["capture_order"].tolist() == [0, 0]
    assert np.array_equal(got["record_id"], cols["record_id"])
    assert np.array_equal(got["numel"], cols["numel"])


def _drop_column(location) -> None:
    """Make the store one written before records carried their capture order."""
    if str(location).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(location), autocommit=True) as conn:
            conn.execute("ALTER TABLE records DROP COLUMN capture_order")
        return
    import sqlite3

    conn = sqlite3.connect(location)
    try:
        conn.execute("ALTER TABLE records DROP COLUMN capture_order")
    finally:
        conn.close()


def _older_store(location) -> None:
    w = open_writer(location, synchronous="NORMAL")
    try:
        register(w)
        ingest(w, batch(1, [record(0, 0), record(0, 1)]))
    finally:
        w.close()
    _drop_column(location)


def test_a_store_made_before_the_column_reads_unnumbered(store_location):
    """Read before any writer opened it again (a reader does not change the schema): its
    records read as not numbered."""
    _older_store(store_location)
    assert read(store_location, orders) == {(0, 0): 0, (0, 1): 0}


def test_a_store_made_before_the_column_gets_it(store_location):
    """A writer adds the column: old records read 0, new ones their number."""
    _older_store(store_location)
    w = open_writer(store_location, synchronous="NORMAL")
    try:
        assert call(w, lambda s: s.ingest(batch(2, [numbered(1, 0, 8)]))).stored == 1
    finally:
        w.close()
    assert read(store_location, orders) == {(0, 0): 0, (0, 1): 0, (1, 0): 8}
