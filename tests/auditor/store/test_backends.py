"""The store's guarantees on both backends: a SQLite file and a real PostgreSQL server
(`store_location` runs each test on both; `pg_url` tests are PostgreSQL only).

Ingest, resends, duplicates and conflicts, run names and renames, close, payloads and the read
side must say the same thing whichever backend holds the store; on PostgreSQL, several writers
(one per replica) on one database must keep those guarantees."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from numaudit.auditor.store import (
    RECORD_COLUMNS,
    Reader,
    RunNameTaken,
    StoreError,
    UnknownSession,
    summary,
)
from numaudit.auditor.store.backend import open_writer
from numaudit.protos import numaudit_pb2 as pb
from tests.auditor.builders import batch, float32_bytes, record, register_request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def writer(store_location):
    w = open_writer(store_location, synchronous="NORMAL")
    yield w
    w.close()


def call(writer, work):
    return writer.submit(work).result(20)


def register(writer, **kw):
    return call(writer, lambda s: s.register_session(register_request(**kw)))


def ingest(writer, b):
    return call(writer, lambda s: s.ingest(b))


def read(location, fn):
    reader = Reader(location)
    try:
        return fn(reader)
    finally:
        reader.close()


def test_ingest_resend_duplicates_and_conflicts(writer, store_location):
    register(writer)
    first = ingest(writer, batch(1, [record(0, j) for j in range(3)]))
    assert (first.acked_seq, first.stored, first.duplicates, first.conflicts) == (1, 3, 0, 0)
    again = ingest(writer, batch(1, [record(0, j) for j in range(3)]))
    assert again.resent_batch and (again.acked_seq, again.duplicates, again.conflicts) == (1, 3, 0)
    moved = ingest(writer, batch(2, [record(0, 0), record(0, 1, fingerprint=99), record(0, 5)]))
    assert (moved.acked_seq, moved.stored, moved.duplicates, moved.conflicts) == (2, 1, 1, 1)
    reused = ingest(writer, batch(2, [record(0, 0), record(0, 2, fingerprint=7), record(0, 9)]))
    assert reused.resent_batch and (reused.duplicates, reused.conflicts) == (1, 2)
    rows = read(store_location, lambda r: list(r.records("ref")))
    assert [(row[1], row[28]) for row in rows] == [(j, 0xDEADBEEF) for j in (0, 1, 2, 5)]
    assert read(store_location, lambda r: r.conflicts("ref")) == 2
    sessions = read(store_location, lambda r: r.sessions("ref"))
    assert [(s["acked_seq"], s["records_stored"]) for s in sessions] == [(2, 4)]


def test_unknown_session_and_world_size_are_refused(writer):
    register(writer)
    with pytest.raises(UnknownSession, match="session_id"):
        ingest(writer, batch(1, [record()], session_id="nobody"))
    with pytest.raises(StoreError, match="world_size"):
        call(writer, lambda s: s.register(
            register_request(session_id="x", world_size=4, mesh_shape=[4])))
    with pytest.raises(StoreError, match="session_id: already registered"):
        register(writer, session_id="sess-0", rank=1)


def test_run_names_renames_and_resumes(writer):
    assert register(writer, session_id="a0", job_id="A") == (0, "ref")
    with pytest.raises(RunNameTaken, match="belongs to another job"):
        register(writer, session_id="b0", job_id="B")
    got = [register(writer, session_id=f"b{r}", rank=r, job_id="B", rename_if_taken=True)[1]
           for r in (1, 0)]
    assert got == ["ref.2", "ref.2"]
    ingest(writer, batch(1, [record(0, 0)], session_id="a0"))
    assert register(writer, session_id="a0", job_id="A") == (1, "ref")  # resume: acked seq


def test_close_session_payloads_and_reads(writer, store_location):
    register(writer)
    register(writer, session_id="sess-1", rank=1)
    data = float32_bytes(12)
    with_payload = record(0, 0, payload=data)
    ingest(writer, batch(1, [with_payload, record(0, 1, "layers.1")]))
    ingest(writer, batch(1, [record(0, 0)], session_id="sess-1"))
    stored = call(writer, lambda s: s.close_session(pb.CloseSessionRequest(
        session_id="sess-0", records_sent=2, records_dropped=1,
        dropped_by_reason={"queue_full": 1})))
    assert stored == 2

    def check(r):
        rows = list(r.records("ref"))
        assert [(row[3], row[7]) for row in rows] == [("layers.0", 0), ("layers.0", 1),
                                                      ("layers.1", 0)]
        rid = rows[0][30]
        assert bool(rows[0][31]) and not rows[1][31]
        header, blob = r.payload(rid)
        assert header["raw_nbytes"] == with_payload.payload.raw_nbytes
        assert blob == with_payload.payload.data
        assert r.payload(rows[1][30]) is None
        assert r.run_names() == ["ref"] and r.steps("ref") == [0]
        assert r.phase_counts("ref") == [(1, 2, 3, 0)]
        desc = summary.describe_run(r, "ref")
        assert desc.summary.records == 3 and desc.summary.ranks_closed == 1
        assert [(k.rank, k.records_stored, k.closed) for k in desc.ranks] == [
            (0, 2, True), (1, 1, False)]
        assert desc.ranks[0].dropped_by_reason == {"queue_full": 1}
        assert summary.list_runs(r).runs[0].records == 3
    read(store_location, check)


def test_a_chunked_payload_is_complete_only_with_every_chunk(writer, store_location):
    register(writer)
    data = float32_bytes(64)
    a, b = record(0, 0, payload=data), record(0, 0, payload=data)
    a.payload.chunk_count = b.payload.chunk_count = 2
    half = len(a.payload.data) // 2
    whole = a.payload.data
    a.payload.data, b.payload.chunk_index, b.payload.data = whole[:half], 1, whole[half:]
    ingest(writer, batch(1, [a]))
    rid = read(store_location, lambda r: next(iter(r.records("ref")))[30])
    assert read(store_location, lambda r: r.payload(rid)) is None
    second = ingest(writer, batch(2, [b]))
    assert (second.stored, second.duplicates) == (0, 1)  # the record, with its second chunk
    assert read(store_location, lambda r: r.payload(rid))[1] == whole


def test_packed_payload_batches_store_their_chunks(writer, store_location):
    """A fresh packed batch whose records carry payloads (PostgreSQL: COPY straight into
    `records` and `payload_chunks` under ids drawn beforehand), one whose 2-chunk payload
    repeats a key (PostgreSQL: the staging path), and resends of both: every record readable
    with its own payload, nothing stored twice."""
    from numaudit.wire.batches import split_batch
    from numaudit.wire.record_form import from_records

    register(writer)
    payloads = {j: float32_bytes(12 + j) for j in (0, 3, 4)}
    records = [record(0, j, shape=(1, 12 + j), payload=payloads.get(j)) for j in range(6)]
    fresh = split_batch("sess-0", 1, from_records(records), None)
    assert len(fresh.packed.payloads) == 3 and not len(fresh.records)
    assert ingest(writer, fresh).stored == 6
    data = float32_bytes(64)
    a, b = record(1, 0, payload=data), record(1, 0, payload=data)
    whole, half = a.payload.data, len(a.payload.data) // 2
    a.payload.chunk_count = b.payload.chunk_count = 2
    a.payload.data, b.payload.chunk_index, b.payload.data = whole[:half], 1, whole[half:]
    chunked = split_batch("sess-0", 2, from_records([a, b, record(1, 1)]), None)
    assert (ingest(writer, chunked).stored, ) == (2, )
    again = ingest(writer, split_batch("sess-0", 3, from_records(records), None))
    assert (again.stored, again.duplicates, again.conflicts) == (0, 6, 0)

    def check(r):
        rows = {(row[0], row[1]): row for row in r.records("ref")}
        assert len(rows) == 8
        for j in range(6):
            got = r.payload(rows[(0, j)][30])
            if j in payloads:
                assert got[1] == records[j].payload.data and bool(rows[(0, j)][31])
            else:
                assert got is None and not rows[(0, j)][31]
        assert r.payload(rows[(1, 0)][30])[1] == whole
        assert r.payload(rows[(1, 1)][30]) is None
    read(store_location, check)


def test_a_payload_in_chunks_is_counted_and_flagged_as_one_record(writer, store_location):
    """Each later chunk travels as a row repeating its record's key and content: stored,
    duplicates and conflicts count the record once, and a conflicting record is flagged once,
    on a fresh batch and on a resend alike (the agent and `auditor ingest` count the same)."""
    from numaudit.wire.batches import split_batch
    from numaudit.wire.record_form import from_records

    data = float32_bytes(64)

    def chunked(seq, fingerprint=0xDEADBEEF):
        rows = [record(1, 1)]
        for i in range(3):
            r = record(1, 0, payload=data, fingerprint=fingerprint)
            whole = r.payload.data
            cut = -(-len(whole) // 3)
            r.payload.chunk_index, r.payload.chunk_count = i, 3
            r.payload.data = whole[i * cut:(i + 1) * cut]
            rows.append(r)
        return split_batch("sess-0", seq, from_records(rows), None)

    register(writer)
    counts = [(r.stored, r.duplicates, r.conflicts) for r in (
        ingest(writer, chunked(1)),                   # fresh
        ingest(writer, chunked(1)),                   # a resend
        ingest(writer, chunked(1, fingerprint=5)),    # a resend with other content
        ingest(writer, chunked(2, fingerprint=6)),    # a fresh batch with other content
    )]
    assert counts == [(2, 0, 0), (0, 2, 0), (0, 1, 1), (0, 1, 1)]
    assert read(store_location, lambda r: r.conflicts("ref")) == 2


def flat_record(step: int = 0, microbatch: int = 0, *, flat: bool = True, **kw) -> pb.Record:
    """`record`'s 12 elements as elements 0 .. 12 of a flattened (8, 3): a flat piece, or
    (`flat` False) a box of a 1-D tensor of the same numbers."""
    r = record(step, microbatch, **kw)
    r.layout.logical_shape[:], r.layout.offsets[:], r.layout.shape[:] = [24], [0], [12]
    r.layout.flat = flat
    return r


def flat_column(reader, run: str = "ref") -> dict[tuple[int, int], int]:
    at = RECORD_COLUMNS.index("flat")
    return {(row[0], row[1]): row[at] for row in reader.records(run)}


def test_a_flat_piece_comes_back_flat(writer, store_location):
    """Per record and packed, on a fresh batch and through a resend: the flag is stored, read
    back, and part of what a record says (sent again with only the flag changed, a conflict)."""
    from numaudit.wire.batches import split_batch
    from numaudit.wire.record_form import from_records

    register(writer)
    first = [flat_record(0, 0), flat_record(0, 1, flat=False), record(0, 2)]
    assert ingest(writer, batch(1, first)).stored == 3
    packed = split_batch("sess-0", 2, from_records([flat_record(1, 0), record(1, 1)]), None)
    assert not len(packed.records) and ingest(writer, packed).stored == 2
    stored = {(0, 0): 1, (0, 1): 0, (0, 2): 0, (1, 0): 1, (1, 1): 0}
    assert read(store_location, flat_column) == stored
    again = ingest(writer, batch(3, first))
    assert (again.stored, again.duplicates, again.conflicts) == (0, 3, 0)
    flipped = ingest(writer, batch(4, [flat_record(0, 0, flat=False), flat_record(0, 1)]))
    assert (flipped.stored, flipped.duplicates, flipped.conflicts) == (0, 0, 2)
    assert read(store_location, lambda r: r.conflicts("ref")) == 2
    assert read(store_location, flat_column) == stored  # the first stored is kept


def _drop_flat_column(location) -> None:
    """Make the store one written before flat pieces: no `flat` column in `records`."""
    if str(location).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(location), autocommit=True) as conn:
            conn.execute("ALTER TABLE records DROP COLUMN flat")
        return
    import sqlite3

    conn = sqlite3.connect(location)
    try:
        conn.execute("ALTER TABLE records DROP COLUMN flat")
    finally:
        conn.close()


def _store_from_before_flat_pieces(location) -> None:
    """A store with two records, as written before the `flat` column existed."""
    w = open_writer(location, synchronous="NORMAL")
    try:
        register(w)
        ingest(w, batch(1, [record(0, 0), record(0, 1)]))
    finally:
        w.close()
    _drop_flat_column(location)


def test_a_store_made_before_flat_pieces_gets_the_column(store_location):
    """Its records read as not flat once a writer opened it (which adds the column), and flat
    records stored after that read as flat."""
    _store_from_before_flat_pieces(store_location)
    w = open_writer(store_location, synchronous="NORMAL")
    try:
        ingest(w, batch(2, [flat_record(1, 0)]))
    finally:
        w.close()
    assert read(store_location, flat_column) == {(0, 0): 0, (0, 1): 0, (1, 0): 1}


def test_a_store_made_before_flat_pieces_reads_without_a_writer(store_location):
    """A store from before flat pieces, read (and compared) before any writer opened it again:
    a reader does not change the schema, so its records read as not flat, and the store is
    left as it was."""
    _store_from_before_flat_pieces(store_location)
    assert read(store_location, flat_column) == {(0, 0): 0, (0, 1): 0}
    if str(store_location).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(store_location)) as conn:
            columns = {r[0] for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'records'")}
    else:
        import sqlite3

        with sqlite3.connect(store_location) as conn:
            columns = {r[1] for r in conn.execute("PRAGMA table_info(records)")}
    assert "flat" not in columns


# -- PostgreSQL: several writers (replicas) on one database -----------------------------------

def test_replicas_serialize_a_sessions_batches(pg_url):
    """One session's stream sent in order to two replicas at once (an agent that reconnected to
    another replica while the first still committed): every record stored once, the acked seq
    the last, no conflicts."""
    writers = [open_writer(pg_url, synchronous="NORMAL") for _ in range(2)]
    try:
        register(writers[0])
        batches = [batch(seq, [record(seq, j) for j in range(50)]) for seq in range(1, 21)]
        results = []
        for b in batches:  # both streams in step, so that each batch's two copies race
            futures = [w.submit(lambda s, b=b: s.ingest(b)) for w in writers]
            results += [f.result(20) for f in futures]
        assert sum(r.stored for r in results) == 20 * 50
        # the session row lock: of the two copies of a batch, the second to commit sees the
        # first's acked seq and is a resend (without it both would pass as new batches)
        assert sum(not r.resent_batch for r in results) == 20
        assert sum(r.conflicts for r in results) == 0
        rows = read(pg_url, lambda r: list(r.records("ref")))
        assert len(rows) == 1000 and len({row[:8] for row in rows}) == 1000
        assert read(pg_url, lambda r: r.sessions("ref"))[0]["acked_seq"] == 20
    finally:
        for w in writers:
            w.close()


def test_replicas_agree_on_new_runs_renames_and_sites(pg_url):
    """Ranks of two jobs registering at once through two replicas: one run per job, every rank
    of a job on the same name, one id per site name."""
    writers = [open_writer(pg_url, synchronous="NORMAL") for _ in range(2)]
    barrier = threading.Barrier(8)

    def join(i):
        job = "AB"[i % 2]
        w = writers[(i // 2) % 2]
        barrier.wait(10)
        acked, name = register(w, session_id=f"{job}{i}", rank=i // 2, world_size=4,
                               mesh_shape=[4], job_id=job, rename_if_taken=True)
        ingest(w, batch(1, [record(0, 0, f"site.{j}") for j in range(i, i + 4)],
                        session_id=f"{job}{i}"))
        return job, name

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(join, range(8)))
        names = {job: {n for j, n in got if j == job} for job in "AB"}
        assert all(len(v) == 1 for v in names.values()), names
        assert {*names["A"], *names["B"]} == {"ref", "ref.2"}
        sites = read(pg_url, lambda r: r.conn.execute("SELECT name FROM sites").fetchall())
        assert sorted(n for (n,) in sites) == sorted(f"site.{j}" for j in range(11))
    finally:
        for w in writers:
            w.close()


def test_a_restarted_database_server_is_reconnected(pg_server, pg_url):
    w = open_writer(pg_url, synchronous="FULL")
    try:
        register(w)
        assert ingest(w, batch(1, [record(0, 0)])).stored == 1
        pg_server.restart()
        assert ingest(w, batch(2, [record(0, 1)])).stored == 1
        assert ingest(w, batch(2, [record(0, 1)])).resent_batch
    finally:
        w.close()
    assert len(read(pg_url, lambda r: list(r.records("ref")))) == 2


def test_a_database_that_is_not_a_store_is_refused(pg_server, pg_url):
    import psycopg

    from numaudit.auditor.store import NotAStore

    with pytest.raises(NotAStore, match="holds no numaudit store"):
        Reader(pg_url)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    with pytest.raises(NotAStore, match="another application"):
        open_writer(pg_url)
    with pytest.raises(NotAStore, match="cannot connect"):
        Reader(pg_server.url("no_such_database"))
