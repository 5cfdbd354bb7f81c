"""`PgWriter`'s group commit on a real PostgreSQL server: items queued together commit in one
transaction, each in a savepoint, so one failing item fails alone, a batch whose direct COPY meets
a stored key is run again through the staging table, and every future resolves after the commit
with its own item's result."""

from __future__ import annotations

import threading

import pytest

from numaudit.auditor.store import Reader, UnknownSession
from numaudit.auditor.store.postgres_writer import PgWriter
from tests.auditor.builders import batch, record, register_request

pytestmark = pytest.mark.timeout(60)


def test_queued_items_commit_together_and_fail_alone(pg_url):
    writer = PgWriter(pg_url, synchronous="NORMAL", connections=1)
    try:
        for rank in range(4):
            writer.submit(lambda s, r=rank: s.register_session(
                register_request(session_id=f"sess-{r}", rank=r, world_size=4))).result(20)
        writer.submit(lambda s: s.ingest(batch(1, [record(0, 0)], "sess-0"))).result(20)
        gate = threading.Event()
        blocker = writer.submit(lambda s: gate.wait(10))  # holds the only connection
        work = [
            lambda s: s.ingest(batch(1, [record(1, j) for j in range(3)], "sess-1")),
            lambda s: s.ingest(batch(1, [record(1, 0)], "nobody")),  # fails alone
            # a new seq whose first key is stored: the direct COPY fails, staging takes it
            lambda s: s.ingest(batch(2, [record(0, 0), record(0, 1, fingerprint=5),
                                         record(0, 2)], "sess-0")),
            lambda s: s.ingest(batch(1, [record(1, 0)], "sess-1")),  # resent: a duplicate
            lambda s: s.ingest(batch(1, [record(2, j) for j in range(2)], "sess-2")),
        ]
        futures = [writer.submit(w) for w in work]
        gate.set()
        assert blocker.result(20) is True
        first, unknown, staged, resent, third = futures
        assert (first.result(20).stored, first.result(20).acked_seq) == (3, 1)
        with pytest.raises(UnknownSession):
            unknown.result(20)
        r = staged.result(20)
        assert (r.acked_seq, r.stored, r.duplicates, r.conflicts) == (2, 2, 1, 0)
        r = resent.result(20)
        # queued behind sess-1's fresh batch 1 in the same group (or the next): a resend
        assert r.resent_batch and r.duplicates + r.conflicts == 1
        assert third.result(20).stored == 2
        # a group with no rerun: the failing item's savepoint rolls back, the others commit
        gate2 = threading.Event()
        blocker = writer.submit(lambda s: gate2.wait(10))
        group = [writer.submit(lambda s: s.ingest(batch(2, [record(3, 0)], "sess-2"))),
                 writer.submit(lambda s: s.ingest(batch(1, [record(3, 0)], "nobody"))),
                 writer.submit(lambda s: s.ingest(batch(1, [record(3, 1)], "sess-3")))]
        gate2.set()
        blocker.result(20)
        assert group[0].result(20).stored == 1 and group[2].result(20).stored == 1
        with pytest.raises(UnknownSession):
            group[1].result(20)
    finally:
        writer.close()
    reader = Reader(pg_url)
    try:
        rows = reader.conn.execute(
            "SELECT session_id, COUNT(*) FROM records GROUP BY 1 ORDER BY 1").fetchall()
        acked = dict(reader.conn.execute("SELECT session_id, acked_seq FROM sessions").fetchall())
    finally:
        reader.close()
    assert rows == [("sess-0", 3), ("sess-1", 3), ("sess-2", 3), ("sess-3", 1)]
    assert acked == {"sess-0": 2, "sess-1": 1, "sess-2": 2, "sess-3": 1}


def test_a_batch_copy_is_limited_by_its_size_then_the_session_limit_returns(pg_url):
    """A replica frozen in the middle of a batch's COPY holds its row locks only as long as that
    batch's own limit (1 s + 1 ms per 8 KiB), not the session's 15 s; the limit ends with the
    transaction."""
    from numaudit.auditor.store.postgres import copy_timeout_ms

    SHOW_MS = "SELECT setting FROM pg_settings WHERE name = 'statement_timeout'"

    writer = PgWriter(pg_url, synchronous="NORMAL", connections=1)
    try:
        writer.submit(lambda s: s.register_session(
            register_request(session_id="s", rank=0, world_size=1))).result(20)

        def ingest_then_show(s):
            s.ingest(batch(1, [record(0, j) for j in range(4)], "s"))
            return s.raw.execute(SHOW_MS).fetchone()[0]

        during = writer.submit(ingest_then_show).result(20)
        after = writer.submit(
            lambda s: s.raw.execute(SHOW_MS).fetchone()[0]).result(20)
        assert int(during) == copy_timeout_ms(4, 0) < 1100
        assert int(after) == 15_000
        assert 7000 < copy_timeout_ms(0, 48 << 20) < 7500  # the largest batch: room for a slow link
    finally:
        writer.close()
