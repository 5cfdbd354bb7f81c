"""The store on a PostgreSQL server: the same tables and guarantees as `auditor.store.sqlite`,
safe for several daemons (stateless replicas) writing one database at once.

What the SQLite store gets from its single writer thread comes here from the database:
- a session's acked seq: every batch locks its session row (a fresh batch by the conditional
  ``UPDATE`` that advances it, a resend by ``SELECT ... FOR UPDATE``), so two replicas given
  the same session's batches store one and see the other as a resend;
- run names and renames, session ids, site ids: unique constraints; a transaction that loses a
  race (unique violation, serialization failure, deadlock) is rolled back and run again
  (`auditor.store.postgres_writer.PgWriter`), and then sees the winner's row;
- records unique on (run, key, rank): a fresh batch is COPYed straight into `records` (binary COPY
  built with numpy, `auditor.store.pg_copy`); when a key of it is stored already, the COPY fails,
  the batch is run again and goes through a per-connection staging table, inserted with ``ON
  CONFLICT DO NOTHING``; keys already stored are compared by content hash in SQL, and differing ones
  flagged in `conflicts`;
- the order in which records commit: each carries its transaction id (`xid`), which
  `auditor.compare.read.columns.ReadMark` reads new records by (record ids do not commit in order).
A batch is acked only after its transaction committed. FULL is ``synchronous_commit = on`` (the
commit's WAL is on disk before the ack). NORMAL turns it off, which is weaker than SQLite's NORMAL:
the WAL is written and flushed by the server's WAL writer within about 3 x ``wal_writer_delay`` (0.6
s by default), so a crash of the database server (not only of its machine) can lose batches acked in
that window; the database stays consistent.

`QmarkConnection` lets the read side (`auditor.store.reader`, `auditor.compare.read.columns`) run
the same SQL on both backends: it rewrites SQLite's ``?`` and ``:name`` placeholders.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from numaudit.auditor.store.files import NotAStore

try:
    import psycopg
    from psycopg import errors as pg_errors
except ModuleNotFoundError as exc:  # a plain install: SQLite only
    if exc.name != "psycopg":  # psycopg itself is there: a real error
        raise
    raise NotAStore("db: a postgresql:// store needs psycopg, which a plain install does not "
                    "bring: pip install 'numaudit[postgres]'") from None

from numaudit.auditor.store.dbapi import one
from numaudit.auditor.store.errors import StoreError, UnknownSession
from numaudit.auditor.store.jobs import run_for_job
from numaudit.auditor.store.location import redact
from numaudit.auditor.store.pg_copy import COLUMNS as COPY_COLUMNS
from numaudit.auditor.store.pg_copy import ID_COLUMNS, SQL_TYPES, STAGE_COLUMNS, copy_buffer
from numaudit.auditor.store.rows import sample_rows
from numaudit.auditor.store.sqlite import SCHEMA_VERSION, IngestResult
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches, content_hash
from numaudit.wire.packed import PayloadChunk, RecordColumns

log = logging.getLogger(__name__)

_SCHEMA_LOCK = 0x6E756D61  # advisory lock id while creating the schema ("numa")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id BIGSERIAL PRIMARY KEY, name TEXT UNIQUE NOT NULL, created DOUBLE PRECISION NOT NULL,
    world_size BIGINT NOT NULL, mesh_shape TEXT NOT NULL, mesh_dim_names TEXT NOT NULL,
    torch_version TEXT NOT NULL, dtype TEXT NOT NULL, seed BIGINT NOT NULL, labels TEXT NOT NULL,
    job_id TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, run_id BIGINT NOT NULL REFERENCES runs(run_id),
    rank BIGINT NOT NULL, local_rank BIGINT NOT NULL, host TEXT NOT NULL,
    mesh_coordinate TEXT NOT NULL, stages TEXT NOT NULL, registered DOUBLE PRECISION NOT NULL,
    acked_seq BIGINT NOT NULL DEFAULT 0, closed DOUBLE PRECISION, records_sent BIGINT,
    records_dropped BIGINT, capture_errors BIGINT, dropped_by_reason TEXT,
    job_id TEXT NOT NULL DEFAULT '', grad_scale DOUBLE PRECISION NOT NULL DEFAULT 0,
    grad_scale_source TEXT NOT NULL DEFAULT '', agent_version TEXT NOT NULL DEFAULT '');
-- a database made before sessions carried the agent's version gets the column ('' = unknown)
ALTER TABLE sessions ADD COLUMN IF NOT EXISTS agent_version TEXT NOT NULL DEFAULT '';
CREATE TABLE IF NOT EXISTS sites (site_id BIGSERIAL PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    record_id BIGSERIAL PRIMARY KEY, run_id BIGINT NOT NULL,
    step BIGINT NOT NULL, microbatch BIGINT NOT NULL, phase BIGINT NOT NULL,
    site_id BIGINT NOT NULL, role BIGINT NOT NULL, idx BIGINT NOT NULL, call BIGINT NOT NULL,
    rank BIGINT NOT NULL, stage BIGINT NOT NULL, is_none BIGINT NOT NULL, dtype TEXT NOT NULL,
    logical_shape TEXT NOT NULL, offsets TEXT NOT NULL, shape TEXT NOT NULL,
    replica BIGINT NOT NULL, partial BIGINT NOT NULL, complex_as_real BIGINT NOT NULL,
    numel BIGINT NOT NULL, nan BIGINT NOT NULL, posinf BIGINT NOT NULL, neginf BIGINT NOT NULL,
    zeros BIGINT NOT NULL, has_moments BIGINT NOT NULL,
    sum DOUBLE PRECISION, sum_sq DOUBLE PRECISION, min DOUBLE PRECISION, max DOUBLE PRECISION,
    abs_max DOUBLE PRECISION,
    fingerprint BIGINT NOT NULL, fingerprint_seed BIGINT NOT NULL,
    sketch BYTEA NOT NULL, sketch_seed BIGINT NOT NULL, content_hash BYTEA NOT NULL,
    session_id TEXT NOT NULL, seq BIGINT NOT NULL, received DOUBLE PRECISION NOT NULL,
    reduce BIGINT NOT NULL DEFAULT 0, reduce_weight DOUBLE PRECISION NOT NULL DEFAULT 1,
    reduce_index BIGINT NOT NULL DEFAULT 0, reduce_count BIGINT NOT NULL DEFAULT 1,
    ragged_parts BIGINT NOT NULL DEFAULT 0, ragged_first BIGINT NOT NULL DEFAULT 0,
    ragged_span BIGINT NOT NULL DEFAULT 0, flat BIGINT NOT NULL DEFAULT 0,
    capture_order BIGINT NOT NULL DEFAULT 0);
-- a database made before flat pieces (Layout.flat) gets the column; its records are not flat
ALTER TABLE records ADD COLUMN IF NOT EXISTS flat BIGINT NOT NULL DEFAULT 0;
-- one made before records carried their capture order: its records are not numbered (0)
ALTER TABLE records ADD COLUMN IF NOT EXISTS capture_order BIGINT NOT NULL DEFAULT 0;
-- the transaction that stored the record: `auditor watch` reads new records by it, since with
-- concurrent writers record ids do not commit in order (auditor.compare.read.columns.ReadMark); a
-- btree (appended at its right edge) so a poll reads only the newest rows (a BRIN index leaves
-- the newest ranges unsummarized until autovacuum gets to them: a scan of the table's tail)
ALTER TABLE records ADD COLUMN IF NOT EXISTS xid BIGINT NOT NULL DEFAULT txid_current();
CREATE INDEX IF NOT EXISTS records_by_xact ON records (xid);
CREATE UNIQUE INDEX IF NOT EXISTS records_by_key
    ON records (run_id, step, microbatch, phase, site_id, role, idx, call, rank);
CREATE INDEX IF NOT EXISTS records_by_session ON records (session_id);
CREATE TABLE IF NOT EXISTS payload_chunks (
    record_id BIGINT NOT NULL REFERENCES records(record_id), chunk_index BIGINT NOT NULL,
    chunk_count BIGINT NOT NULL, codec TEXT NOT NULL, raw_nbytes BIGINT NOT NULL,
    compressed_nbytes BIGINT NOT NULL, crc32 BIGINT NOT NULL, data BYTEA NOT NULL,
    PRIMARY KEY (record_id, chunk_index));
CREATE TABLE IF NOT EXISTS sample_digests (
    record_id BIGINT PRIMARY KEY REFERENCES records(record_id), dim BIGINT NOT NULL,
    unit BIGINT NOT NULL, count BIGINT NOT NULL, sketch_k BIGINT NOT NULL, rows BYTEA NOT NULL,
    fingerprints BYTEA NOT NULL);
CREATE TABLE IF NOT EXISTS conflicts (
    conflict_id BIGSERIAL PRIMARY KEY, record_id BIGINT NOT NULL REFERENCES records(record_id),
    session_id TEXT NOT NULL, seq BIGINT NOT NULL, content_hash BYTEA NOT NULL,
    received DOUBLE PRECISION NOT NULL);
CREATE INDEX IF NOT EXISTS conflicts_by_record ON conflicts (record_id);
"""

# The staging tables one connection COPYs a batch into (emptied at each commit): the rows of
# `pg_copy.copy_buffer` with their position in the batch, and the batch's payload chunks.
_STAGE_COLUMNS = [(c, SQL_TYPES[c]) for c in STAGE_COLUMNS]
_CHUNK_COLUMNS = [("pos", "int8"), ("chunk_index", "int8"), ("chunk_count", "int8"),
                  ("codec", "text"), ("raw_nbytes", "int8"), ("compressed_nbytes", "int8"),
                  ("crc32", "int8"), ("data", "bytea")]
_SAMPLE_COLUMNS = [("pos", "int8"), ("dim", "int8"), ("unit", "int8"), ("count", "int8"),
                   ("sketch_k", "int8"), ("rows", "bytea"), ("fingerprints", "bytea")]
_STAGE, _CHUNKS = "numaudit_stage", "numaudit_stage_chunks"
_SAMPLES = "numaudit_stage_samples"
_STAGE_DDL = [f"CREATE TEMP TABLE IF NOT EXISTS {name} ("
              + ", ".join(f"{n} {t}" for n, t in columns) + ") ON COMMIT DELETE ROWS"
              for name, columns in ((_STAGE, _STAGE_COLUMNS), (_CHUNKS, _CHUNK_COLUMNS),
                                    (_SAMPLES, _SAMPLE_COLUMNS))]
_IDS = "records with ids"
_COPY = {name: f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
         for name, table, columns in (
             (_STAGE, _STAGE, STAGE_COLUMNS), (_CHUNKS, _CHUNKS, [n for n, _ in _CHUNK_COLUMNS]),
             ("records", "records", COPY_COLUMNS), (_IDS, "records", ID_COLUMNS),
             ("payload_chunks", "payload_chunks",
              ["record_id"] + [n for n, _ in _CHUNK_COLUMNS[1:]]),
             (_SAMPLES, _SAMPLES, [n for n, _ in _SAMPLE_COLUMNS]),
             ("sample_digests", "sample_digests",
              ["record_id"] + [n for n, _ in _SAMPLE_COLUMNS[1:]]))}
_NEXT_IDS = ("SELECT nextval(pg_get_serial_sequence('records', 'record_id'))"
             " FROM generate_series(1, %s)")
_INSERT_RECORDS = (f"INSERT INTO records ({', '.join(COPY_COLUMNS)}) SELECT "
                   f"{', '.join(COPY_COLUMNS)} FROM {_STAGE} ORDER BY pos ON CONFLICT DO NOTHING")
_KEY_JOIN = (f"{_STAGE} s JOIN records r ON r.run_id = s.run_id AND r.rank = s.rank"
             " AND r.step = s.step AND r.microbatch = s.microbatch AND r.phase = s.phase"
             " AND r.site_id = s.site_id AND r.role = s.role AND r.idx = s.idx"
             " AND r.call = s.call")
_FLAG_CONFLICTS = (
    "INSERT INTO conflicts (record_id, session_id, seq, content_hash, received)"
    f" SELECT r.record_id, s.session_id, s.seq, s.content_hash, s.received FROM {_KEY_JOIN}"
    " WHERE r.content_hash <> s.content_hash AND NOT s.pos = ANY(%s)")
_COUNT_SAME = (f"SELECT COUNT(*) FROM {_KEY_JOIN} WHERE r.content_hash = s.content_hash"
               " AND NOT s.pos = ANY(%s)")
"""Both leave out the rows `RecordColumns.repeated_rows` names (their positions the parameter):
later chunks of a payload whose first chunk is in the batch, counted and flagged with it."""
_INSERT_CHUNKS = (
    "INSERT INTO payload_chunks SELECT r.record_id, c.chunk_index, c.chunk_count, c.codec,"
    f" c.raw_nbytes, c.compressed_nbytes, c.crc32, c.data FROM {_CHUNKS} c JOIN {_KEY_JOIN}"
    " ON s.pos = c.pos WHERE r.content_hash = s.content_hash ON CONFLICT DO NOTHING")
_INSERT_SAMPLES = (
    "INSERT INTO sample_digests SELECT r.record_id, c.dim, c.unit, c.count, c.sketch_k, c.rows,"
    f" c.fingerprints FROM {_SAMPLES} c JOIN {_KEY_JOIN} ON s.pos = c.pos"
    " WHERE r.content_hash = s.content_hash ON CONFLICT DO NOTHING")


# -- SQL written for SQLite, run on PostgreSQL ------------------------------------------------

@functools.lru_cache(maxsize=512)
def qmark_to_pyformat(sql: str) -> str:
    """``?`` → ``%s``, ``:name`` → ``%(name)s``, literal ``%`` → ``%%`` (outside quotes)."""
    out, i, n = [], 0, len(sql)
    while i < n:
        c = sql[i]
        if c == "'":
            j = sql.index("'", i + 1) + 1
            out.append(sql[i:j].replace("%", "%%"))
            i = j
            continue
        if c == "?":
            out.append("%s")
        elif c == "%":
            out.append("%%")
        elif c == ":" and i + 1 < n and (sql[i + 1].isalpha() or sql[i + 1] == "_") \
                and (i == 0 or sql[i - 1] != ":"):
            m = re.match(r"[A-Za-z_]\w*", sql[i + 1:])
            assert m is not None  # sql[i + 1] starts a name (the SQL is the store's own, ASCII)
            out.append(f"%({m.group(0)})s")
            i += 1 + len(m.group(0))
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


class QmarkConnection:
    """A psycopg connection that takes SQLite-style SQL (`execute` returns the cursor)."""

    dialect = "postgres"

    def __init__(self, raw: psycopg.Connection) -> None:
        self.raw = raw

    def execute(self, sql: str, params: Any = ()) -> psycopg.Cursor:
        return self.raw.execute(qmark_to_pyformat(sql), params if params else None)

    def close(self) -> None:
        self.raw.close()


# -- Connecting -------------------------------------------------------------------------------

WRITER_TIMEOUTS = {"idle_in_transaction_session_timeout": "1s", "lock_timeout": "1s",
                   "statement_timeout": "15s"}
"""A writer's session settings, so that a replica that hangs (SIGSTOP, a stalled host) in the
middle of a transaction releases its row locks within seconds: the server ends a session idle
in a transaction for 2 s (a writer never is: it runs its statements back to back), and a
statement still running after 15 s; a writer waiting 1 s for a lock gives up and runs again
(`postgres_writer`) instead of holding its own group of acks behind another replica's
transaction. A batch's COPY gets a tighter limit of its own (`copy_timeout_ms`): a replica
frozen in the middle of one holds its locks only that long. Before, a replica frozen while idle
in a transaction stalled the other's sessions for as long as it stayed frozen (issue 40)."""

COPY_BASE_MS = 1000
COPY_BYTES_PER_MS = 8 << 10
"""A batch's COPY statements may take 1 s plus 1 ms per 8 KiB they carry (about 8 MB/s; a
48 MiB batch: 7.1 s), room for a slow link to the database; no longer, so that a replica frozen
while streaming a COPY releases its row locks soon (the server cancels the statement, then ends
the session idle in the aborted transaction 1 s later), not after the session-wide
`statement_timeout`."""


def copy_timeout_ms(records: int, payload_bytes: int) -> int:
    """`statement_timeout` for the COPY statements of a batch of `records` rows that carry
    `payload_bytes` of payload (a row's fixed columns count as 512 bytes)."""
    return COPY_BASE_MS + (payload_bytes + 512 * records) // COPY_BYTES_PER_MS


def pg_connect(url: str, *, readonly: bool = False, synchronous: str = "FULL",
               connect_timeout: float = 10) -> psycopg.Connection:
    """A connection to the store at `url`; for writing, the schema is created if missing."""
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=int(connect_timeout))
    except psycopg.OperationalError as exc:
        why = str(exc).strip().splitlines()[-1] if str(exc).strip() else exc
        raise NotAStore(f"db: cannot connect to {redact(url)}: {why}") from None
    try:
        if readonly:
            if one(conn.execute("SELECT to_regclass('meta')"))[0] is None:
                raise NotAStore(f"db: {redact(url)} holds no numaudit store (no meta table)")
            app = conn.execute("SELECT value FROM meta WHERE key = 'application'").fetchone()
            if app is None or app[0] != "numaudit":
                raise NotAStore(f"db: {redact(url)} has a meta table but is not a numaudit store")
            _shadow_missing_columns(conn)
        else:
            conn.execute("SET synchronous_commit = "
                         + ("off" if synchronous.upper() == "NORMAL" else "on"))
            _create_schema(conn, url)
            for name, value in WRITER_TIMEOUTS.items():  # after the schema's advisory lock
                conn.execute(f"SET {name} = '{value}'")
    except BaseException:
        conn.close()
        raise
    return conn


_ADDED_COLUMNS = (("records", "flat", "0::bigint"), ("sessions", "agent_version", "''::text"),
                  ("records", "capture_order", "0::bigint"))
"""Columns added to the schema after stores were made: (table, column, default)."""


def _shadow_missing_columns(conn: psycopg.Connection) -> None:
    """A store made before some of `_ADDED_COLUMNS`, read before any writer added them (a
    reader does not change the schema): a temporary view named like each such table, which
    unqualified names find first (pg_temp leads the search path), adds them with their
    defaults for this session."""
    for table in {t for t, _, _ in _ADDED_COLUMNS}:
        have = {r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = %s"
            " AND table_schema = current_schema()", (table,))}
        missing = [f"{default} AS {column}" for t, column, default in _ADDED_COLUMNS
                   if t == table and column not in have]
        if have and missing:
            conn.execute(f"CREATE TEMP VIEW {table} AS SELECT *, {', '.join(missing)} "
                         f"FROM {table}")


def _create_schema(conn: psycopg.Connection, url: str) -> None:
    with conn.transaction():
        # Replicas starting together must not race on CREATE TABLE IF NOT EXISTS.
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        if one(conn.execute("SELECT to_regclass('meta')"))[0] is not None:
            app = conn.execute("SELECT value FROM meta WHERE key = 'application'").fetchone()
            if app is None or app[0] != "numaudit":
                raise NotAStore(f"db: {redact(url)} has a meta table of another application; "
                                "refusing to touch it")
        conn.execute(_SCHEMA)
        conn.execute("INSERT INTO meta VALUES ('application', 'numaudit'),"
                     " ('schema_version', %s) ON CONFLICT (key) DO UPDATE SET value ="
                     " EXCLUDED.value", (str(SCHEMA_VERSION),))


# -- The write side ---------------------------------------------------------------------------

class PgStore:
    """Write side over one connection; every call runs inside `PgWriter`'s transaction."""

    def __init__(self, url: str, *, synchronous: str = "FULL") -> None:
        self.url = url
        self.raw = pg_connect(url, synchronous=synchronous)
        self.conn = QmarkConnection(self.raw)  # for run_for_job, shared with the SQLite store
        for ddl in _STAGE_DDL:
            self.raw.execute(ddl)
        self._site_ids: dict[str, int] = {}
        """Sites known committed (a site inserted by a transaction that rolls back is not)."""
        self._new_sites: dict[str, int] = {}
        self._staged: set[tuple[str, int]] = set()
        """(session, seq) of batches whose direct COPY met a stored key: the staging path next."""

    def close(self) -> None:
        self.raw.close()

    # -- transactions: one per work item (`PgWriter`); savepoints as in the SQLite Store

    def begin(self) -> None:
        self.raw.execute("BEGIN")

    def commit(self) -> None:
        self.raw.execute("COMMIT")
        self._site_ids.update(self._new_sites)
        self._new_sites.clear()

    def rollback(self) -> None:
        self._new_sites.clear()
        if self.raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            self.raw.execute("ROLLBACK")

    def savepoint(self, name: str) -> None:
        self.raw.execute(f"SAVEPOINT {name}")

    def release(self, name: str) -> None:
        self.raw.execute(f"RELEASE SAVEPOINT {name}")

    def rollback_to(self, name: str) -> None:
        self.raw.execute(f"ROLLBACK TO SAVEPOINT {name}")
        self.raw.execute(f"RELEASE SAVEPOINT {name}")
        self._new_sites.clear()

    # -- writes -------------------------------------------------------------------------------

    def register(self, req: pb.RegisterRequest) -> int:
        return self.register_session(req)[0]

    def register_session(self, req: pb.RegisterRequest) -> tuple[int, str]:
        """Create the run on its first rank, add or resume the session; (acked seq, run name).
        Two replicas creating the same run or session: the loser's unique violation makes
        `PgWriter` run this again, and then it finds the winner's row."""
        name, row = run_for_job(self.conn, req)
        if row is None:
            run_id = one(self.raw.execute(
                "INSERT INTO runs (name, created, world_size, mesh_shape, mesh_dim_names,"
                " torch_version, dtype, seed, labels, job_id) VALUES"
                " (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s) RETURNING run_id",
                (name, time.time(), req.world_size, json.dumps(list(req.mesh_shape)),
                 json.dumps(list(req.mesh_dim_names)), req.torch_version, req.dtype, req.seed,
                 json.dumps(dict(req.labels), sort_keys=True), req.job_id)))[0]
        else:
            run_id, world_size, _ = row
            if world_size != req.world_size:
                raise StoreError(
                    f"world_size: {req.world_size} differs from run {name!r}'s {world_size}")
        existing = self.raw.execute(
            "SELECT run_id, rank, acked_seq FROM sessions WHERE session_id = %s FOR UPDATE",
            (req.session_id,)).fetchone()
        if existing is not None:
            if (existing[0], existing[1]) != (run_id, req.rank):
                raise StoreError("session_id: already registered for another run or rank")
            return existing[2], name
        self.raw.execute(
            "INSERT INTO sessions (session_id, run_id, rank, local_rank, host, mesh_coordinate,"
            " stages, registered, job_id, grad_scale, grad_scale_source, agent_version)"
            " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
            (req.session_id, run_id, req.rank, req.local_rank, req.host,
             json.dumps(list(req.mesh_coordinate)), json.dumps(list(req.stages)), time.time(),
             req.job_id, req.grad_scale, req.grad_scale_source, req.agent_version))
        return 0, name

    def session(self, session_id: str, *, lock: bool = False) -> tuple[int, int, int]:
        """(run_id, rank, acked_seq); with `lock`, the row stays locked until commit, so no
        other replica stores a batch of this session meanwhile."""
        row = self.raw.execute(
            "SELECT run_id, rank, acked_seq FROM sessions WHERE session_id = %s"
            + (" FOR UPDATE" if lock else ""), (session_id,)).fetchone()
        if row is None:
            raise UnknownSession(f"session_id: {session_id!r} is not registered")
        return row

    def site_ids(self, names: Sequence[str], *, create: bool) -> dict[str, int]:
        """Ids of these site names; with `create`, missing names are added (never burning ids
        on names that exist: the comparison sizes tables by the largest site id)."""
        want = set(names)
        ids = {n: self._site_ids[n] for n in want if n in self._site_ids}
        missing = sorted(want - ids.keys())
        if missing:
            found: dict[str, int] = dict(self.raw.execute(
                "SELECT name, site_id FROM sites WHERE name = ANY(%s)", (missing,)).fetchall())
            self._site_ids.update(found)  # committed by someone: safe to cache
            ids.update(found)
            missing = [n for n in missing if n not in found]
        if missing and create:
            # sorted, so two replicas adding overlapping names cannot deadlock
            self.raw.execute("INSERT INTO sites (name) SELECT unnest(%s::text[]) ORDER BY 1"
                             " ON CONFLICT DO NOTHING", (missing,))
            added: dict[str, int] = dict(self.raw.execute(
                "SELECT name, site_id FROM sites WHERE name = ANY(%s)", (missing,)).fetchall())
            self._new_sites.update(added)
            ids.update(added)
        return ids

    def ingest(self, batch: pb.RecordBatch, hashes: Sequence[bytes] | None = None) -> IngestResult:
        """Store one validated batch (packed, per record, or both). See `ingest_columns`."""
        cols = batches.batch_columns(batch)
        return self.ingest_columns(batch.session_id, batch.seq, cols, hashes)

    def ingest_columns(self, session_id: str, seq: int, cols: RecordColumns,
                       hashes: Sequence[bytes] | None = None) -> IngestResult:
        """Store one validated batch of records given as columns. A fresh batch (seq > acked)
        advances its session's acked seq and is COPYed straight into `records` (two statements);
        if some key of it is stored already, that COPY fails, the transaction is run again and
        the batch goes through the staging table: one INSERT ... SELECT ... ON CONFLICT DO
        NOTHING, then keys already stored are compared by content hash in SQL (equal: a
        duplicate; different: flagged in `conflicts`). A resent batch (seq <= acked) stores
        nothing and is checked the same way."""
        n = cols.n
        if hashes is None:
            hashes = content_hash.content_hashes(cols)
        direct = (session_id, seq) not in self._staged
        self._staged.discard((session_id, seq))
        row = self.raw.execute(  # a fresh batch: advance its session (row locked till commit)
            "UPDATE sessions SET acked_seq = %s WHERE session_id = %s AND acked_seq < %s"
            " RETURNING run_id, rank", (seq, session_id, seq)).fetchone()
        if row is not None:
            (run_id, rank), acked, fresh = row, seq - 1, True
        else:  # a resend (or an unknown session)
            run_id, rank, acked = self.session(session_id, lock=True)
            fresh = False
        ids = self.site_ids(cols.sites, create=fresh)
        site_ids = [ids.get(name, -1) for name in cols.sites]
        payload_bytes = sum(len(p.data) for p in cols.payloads.values())
        self.raw.execute("SELECT set_config('statement_timeout', %s, true)",
                         (f"{copy_timeout_ms(n, payload_bytes)}ms",))
        args = (cols, site_ids, run_id, rank, hashes, session_id, seq, time.time())
        cur = self.raw.cursor()
        if fresh and n and direct:
            # The common case, no key of the batch stored yet: COPY straight into `records`. When
            # some key is, the COPY fails and `PgWriter` runs the batch again, then through the
            # staging table. A batch with payloads draws its record ids first, so that its chunks go
            # straight into `payload_chunks` too: through the staging tables they needed a join on
            # the key, which the planner ran as a scan of `records` while its statistics were those
            # of a small table (ingest with one payload record in six went 4x slower).
            rids = None
            if cols.payloads or cols.cols["sample_k"].any():
                rids = np.sort(np.fromiter((r for (r,) in cur.execute(_NEXT_IDS, (n,))),
                                           np.int64, n))
            try:
                self._write(cur, "records" if rids is None else _IDS,
                            copy_buffer(*args, record_ids=rids))
            except pg_errors.UniqueViolation:
                if len(self._staged) > 1000:
                    self._staged.clear()
                self._staged.add((session_id, seq))
                raise
            if rids is not None:
                self._write_chunks(cur, "payload_chunks", rids, cols.payloads)
                self._write_samples(cur, "sample_digests", rids, cols)
            return IngestResult(acked_seq=seq, stored=n)
        self._write(cur, _STAGE, copy_buffer(*args, pos=True))
        repeated = sorted(cols.repeated_rows())
        records = n - len(repeated)
        if not fresh:
            same = one(cur.execute(_COUNT_SAME, (repeated,)))[0]
            cur.execute(_FLAG_CONFLICTS, (repeated,))
            return IngestResult(acked_seq=acked, duplicates=same, conflicts=records - same,
                                resent_batch=True)
        stored = cur.execute(_INSERT_RECORDS).rowcount
        conflicts = cur.execute(_FLAG_CONFLICTS, (repeated,)).rowcount if stored < n else 0
        if cols.payloads:
            self._write_chunks(cur, _CHUNKS, np.arange(n), cols.payloads)
            cur.execute(_INSERT_CHUNKS)
        if self._write_samples(cur, _SAMPLES, np.arange(n), cols):
            cur.execute(_INSERT_SAMPLES)
        return IngestResult(acked_seq=seq, stored=stored,
                            duplicates=records - stored - conflicts, conflicts=conflicts)

    @staticmethod
    def _write_chunks(cur: psycopg.Cursor, table: str, ids: np.ndarray,
                      payloads: dict[int, pb.Payload | PayloadChunk]) -> None:
        """The payload chunks as rows of `table`, each under `ids[row]` of its record (its
        record id, or its position in the batch for the staging table)."""
        with cur.copy(_COPY[table]) as copy:
            copy.set_types([t for _, t in _CHUNK_COLUMNS])
            for row, p in sorted(payloads.items()):
                copy.write_row((int(ids[row]), p.chunk_index, p.chunk_count, p.codec,
                                p.raw_nbytes, p.compressed_nbytes, p.crc32, p.data))

    @staticmethod
    def _write_samples(cur: psycopg.Cursor, table: str, ids: np.ndarray,
                       cols: RecordColumns) -> int:
        """The records' sample digests as rows of `table`, each under `ids[row]` of its record
        (as `_write_chunks`); how many."""
        rows = sample_rows(cols, ids)
        if rows:
            with cur.copy(_COPY[table]) as copy:
                copy.set_types([t for _, t in _SAMPLE_COLUMNS])
                for row in rows:
                    copy.write_row(row)
        return len(rows)

    @staticmethod
    def _write(cur: psycopg.Cursor, table: str, data: bytes) -> None:
        """One binary COPY of a prepared buffer (`pg_copy.copy_buffer`)."""
        with cur.copy(_COPY[table]) as copy:
            copy.write(data)

    def close_session(self, req: pb.CloseSessionRequest) -> int:
        self.session(req.session_id, lock=True)
        self.raw.execute(
            "UPDATE sessions SET closed=%s, records_sent=%s, records_dropped=%s,"
            " capture_errors=%s, dropped_by_reason=%s WHERE session_id=%s",
            (time.time(), req.records_sent, req.records_dropped, req.capture_errors,
             json.dumps(dict(req.dropped_by_reason), sort_keys=True), req.session_id))
        return one(self.raw.execute("SELECT COUNT(*) FROM records WHERE session_id = %s",
                                    (req.session_id,)))[0]
