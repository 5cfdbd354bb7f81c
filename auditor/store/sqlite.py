"""The auditor's durable store: one SQLite file in WAL mode.

Only one thread writes (see `auditor.store.writer.StoreWriter`); any number read, each with its
own connection (`auditor.store.reader`). Records are unique on (run, key, rank): a resent record is
counted as a duplicate and stored once; the same key with different content is kept as first stored
and the newcomer goes to the `conflicts` table. Batches are unique on (session, seq): a batch at or
below the session's acked sequence is a resend and is not stored again.

Durability: `synchronous=FULL` by default, so an acked batch survives a process crash and an OS
crash; `NORMAL` survives a process crash only (FIELD-NOTES: FULL costs ~28%).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from numaudit.auditor.store import key_segments
from numaudit.auditor.store.errors import RunNameTaken, StoreError, UnknownRun, UnknownSession  # noqa: F401  (re-exported)
from numaudit.auditor.store.files import APPLICATION_ID, check_store_file, create_private
from numaudit.auditor.store.jobs import resent, run_for_job
from numaudit.auditor.store.rows import (
    INSERT_COLUMNS,
    INSERT_SAMPLES,
    insert_rows,
    record_columns,
    rows_of,
    sample_rows,
)
from numaudit.auditor.store.rows import INSERT_RECORD as _INSERT_RECORD
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.batches import batch_columns
from numaudit.wire.content_hash import content_hashes
from numaudit.wire.packed import PayloadChunk, RecordColumns
from numaudit.wire.record_form import from_records

SCHEMA_VERSION = 5
"""2 added the reduction columns of records and the job and gradient scale of sessions, 3 the
agent version of sessions, 4 the capture order of records, 5 the sample_digests table; a store
of an earlier version is upgraded in place when opened for writing (`_upgrade`) and read through
views that supply the defaults when opened read-only."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    run_id INTEGER PRIMARY KEY,
    name TEXT UNIQUE NOT NULL,
    created REAL NOT NULL,
    world_size INTEGER NOT NULL,
    mesh_shape TEXT NOT NULL,
    mesh_dim_names TEXT NOT NULL,
    torch_version TEXT NOT NULL,
    dtype TEXT NOT NULL,
    seed INTEGER NOT NULL,
    labels TEXT NOT NULL,
    job_id TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    run_id INTEGER NOT NULL REFERENCES runs(run_id),
    rank INTEGER NOT NULL,
    local_rank INTEGER NOT NULL,
    host TEXT NOT NULL,
    mesh_coordinate TEXT NOT NULL,
    stages TEXT NOT NULL,
    registered REAL NOT NULL,
    acked_seq INTEGER NOT NULL DEFAULT 0,
    closed REAL,
    records_sent INTEGER,
    records_dropped INTEGER,
    capture_errors INTEGER,
    dropped_by_reason TEXT,
    job_id TEXT NOT NULL DEFAULT '',
    grad_scale REAL NOT NULL DEFAULT 0,
    grad_scale_source TEXT NOT NULL DEFAULT '',
    agent_version TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS sites (site_id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    record_id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL,
    step INTEGER NOT NULL, microbatch INTEGER NOT NULL, phase INTEGER NOT NULL,
    site_id INTEGER NOT NULL, role INTEGER NOT NULL, idx INTEGER NOT NULL, call INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    stage INTEGER NOT NULL,
    is_none INTEGER NOT NULL,
    dtype TEXT NOT NULL,
    logical_shape TEXT NOT NULL, offsets TEXT NOT NULL, shape TEXT NOT NULL,
    replica INTEGER NOT NULL, partial INTEGER NOT NULL, complex_as_real INTEGER NOT NULL,
    numel INTEGER NOT NULL, nan INTEGER NOT NULL, posinf INTEGER NOT NULL, neginf INTEGER NOT NULL,
    zeros INTEGER NOT NULL, has_moments INTEGER NOT NULL,
    sum REAL, sum_sq REAL, min REAL, max REAL, abs_max REAL,
    fingerprint INTEGER NOT NULL, fingerprint_seed INTEGER NOT NULL,
    sketch BLOB NOT NULL, sketch_seed INTEGER NOT NULL,
    content_hash BLOB NOT NULL,
    session_id TEXT NOT NULL, seq INTEGER NOT NULL, received REAL NOT NULL,
    reduce INTEGER NOT NULL DEFAULT 0, reduce_weight REAL NOT NULL DEFAULT 1,
    reduce_index INTEGER NOT NULL DEFAULT 0, reduce_count INTEGER NOT NULL DEFAULT 1,
    ragged_parts INTEGER NOT NULL DEFAULT 0, ragged_first INTEGER NOT NULL DEFAULT 0,
    ragged_span INTEGER NOT NULL DEFAULT 0,
    flat INTEGER NOT NULL DEFAULT 0,
    capture_order INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS records_by_key
    ON records (run_id, step, microbatch, phase, site_id, role, idx, call, rank);
CREATE INDEX IF NOT EXISTS records_by_session ON records (session_id);
CREATE TABLE IF NOT EXISTS payload_chunks (
    record_id INTEGER NOT NULL REFERENCES records(record_id),
    chunk_index INTEGER NOT NULL,
    chunk_count INTEGER NOT NULL,
    codec TEXT NOT NULL,
    raw_nbytes INTEGER NOT NULL,
    compressed_nbytes INTEGER NOT NULL,
    crc32 INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (record_id, chunk_index)
);
CREATE TABLE IF NOT EXISTS sample_digests (
    record_id INTEGER PRIMARY KEY REFERENCES records(record_id),
    dim INTEGER NOT NULL, unit INTEGER NOT NULL, count INTEGER NOT NULL,
    sketch_k INTEGER NOT NULL,
    rows BLOB NOT NULL,
    fingerprints BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS conflicts (
    conflict_id INTEGER PRIMARY KEY,
    record_id INTEGER NOT NULL REFERENCES records(record_id),
    session_id TEXT NOT NULL, seq INTEGER NOT NULL,
    content_hash BLOB NOT NULL,
    received REAL NOT NULL
);
"""

PAGE_SIZE = 16384
"""Page size of a new store file (`connect`; existing files keep theirs). With 4 KiB pages a k=256
record (one ~2.3 kB row) took a page of its own: 4.2 kB a record on disk and in the WAL fsynced
at each commit. 16 KiB pages hold seven: 2.5 kB a record, and the store's share of a k=256 batch
fell from 14-20 to 9-11 ms CPU (no change at k=64; `bench.ingest --store-probe`,
docs/scaling.md). 4 KiB stayed the default while the comparison read every row of a run, which
larger pages slowed by 5-10%; it reads key segments now (`auditor.store.key_segments`)."""

WAL_CHECKPOINT_BYTES = 4 << 20
"""The WAL is checkpointed into the database when it passes this size (SQLite counts it in
pages, 1000 by default: 4 MiB with 4 KiB pages, 16 MiB with 16 KiB ones; the same bytes whatever
the page size keep the WAL file, and the disk it needs, as small as before). The daemon's writer
leaves this to a background checkpointer (`auditor.store.writer`) and checkpoints itself only
past WAL_BACKSTOP_BYTES."""
WAL_BACKSTOP_BYTES = 16 * WAL_CHECKPOINT_BYTES
"""The WAL size at which a writer whose checkpoints run in the background checkpoints at commit
anyway (the background thread fell behind, or stopped)."""

# Columns added after version 1 of the schema: (table, column, declaration), for `_upgrade`.
_ADDED_COLUMNS = (
    ("runs", "job_id", "TEXT NOT NULL DEFAULT ''"),
    ("sessions", "job_id", "TEXT NOT NULL DEFAULT ''"),
    ("sessions", "grad_scale", "REAL NOT NULL DEFAULT 0"),
    ("sessions", "grad_scale_source", "TEXT NOT NULL DEFAULT ''"),
    ("sessions", "agent_version", "TEXT NOT NULL DEFAULT ''"),
    ("records", "reduce", "INTEGER NOT NULL DEFAULT 0"),
    ("records", "reduce_weight", "REAL NOT NULL DEFAULT 1"),
    ("records", "reduce_index", "INTEGER NOT NULL DEFAULT 0"),
    ("records", "reduce_count", "INTEGER NOT NULL DEFAULT 1"),
    ("records", "ragged_parts", "INTEGER NOT NULL DEFAULT 0"),
    ("records", "ragged_first", "INTEGER NOT NULL DEFAULT 0"),
    ("records", "ragged_span", "INTEGER NOT NULL DEFAULT 0"),
    ("records", "flat", "INTEGER NOT NULL DEFAULT 0"),
    ("records", "capture_order", "INTEGER NOT NULL DEFAULT 0"),
)

# Columns of `records` as read by the comparison engine, in this order.
RECORD_COLUMNS = (
    "step", "microbatch", "phase", "site", "role", "idx", "call", "rank", "stage", "is_none",
    "dtype", "logical_shape", "offsets", "shape", "replica", "partial", "complex_as_real",
    "numel", "nan", "posinf", "neginf", "zeros", "has_moments",
    "sum", "sum_sq", "min", "max", "abs_max", "fingerprint", "sketch", "record_id", "has_payload",
    "reduce", "reduce_weight", "reduce_index", "reduce_count",
    "ragged_parts", "ragged_first", "ragged_span", "flat", "capture_order",
)


@dataclass
class IngestResult:
    acked_seq: int
    stored: int = 0
    duplicates: int = 0
    conflicts: int = 0
    resent_batch: bool = False


def to_int64(u: int) -> int:
    """uint64 → the int64 with the same bits (SQLite INTEGER is signed 64-bit)."""
    return u - (1 << 64) if u >= (1 << 63) else u


def from_int64(i: int) -> int:
    return i + (1 << 64) if i < 0 else i


def content_hash(record: pb.Record) -> bytes:
    """Hash of what a record says, payload chunking excluded: resends hash the same, and a
    record hashes the same whether it travelled packed or per record (`content_hashes`)."""
    return content_hashes(from_records([record]))[0]


def connect(path: str | Path, *, synchronous: str = "FULL", readonly: bool = False,
            checkpoint_bytes: int = WAL_CHECKPOINT_BYTES) -> sqlite3.Connection:
    """Open the store (creating the schema on first write) with the pragmas numaudit relies on;
    a writing connection checkpoints the WAL at commit once it passes `checkpoint_bytes`."""
    check_store_file(path, create=not readonly)
    if readonly:
        uri = f"file:{Path(path).resolve()}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30)
        _shadow_missing_columns(conn)
    else:
        create_private(path)  # 0600: the tokens of a daemon do not guard the file itself
        conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30, isolation_level=None)
        # Takes effect only when the file is new (before WAL mode and the schema).
        conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("PRAGMA journal_mode=WAL")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA wal_autocheckpoint = {max(1, checkpoint_bytes // page)}")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        _upgrade(conn)
        conn.executescript(_SCHEMA)
        key_segments.create_table(conn)
        conn.execute(
            "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _missing_columns(conn: sqlite3.Connection) -> list[tuple[str, str, str]]:
    """The `_ADDED_COLUMNS` entries a store written by an earlier schema version lacks."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    have = {t: {r[1] for r in conn.execute(f"PRAGMA table_info({t})")}
            for t in {t for t, _, _ in _ADDED_COLUMNS} & tables}
    return [(t, c, decl) for t, c, decl in _ADDED_COLUMNS if t in have and c not in have[t]]


def _upgrade(conn: sqlite3.Connection) -> None:
    """Add the columns of later schema versions to a store written by an earlier one."""
    for table, column, decl in _missing_columns(conn):
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _shadow_missing_columns(conn: sqlite3.Connection) -> None:
    """A store written before some of `_ADDED_COLUMNS` existed, opened read-only (no writer
    has upgraded it since, and this connection cannot): a temporary view named like each such
    table, which unqualified names find first, adds the missing columns with their defaults,
    so readers see the current schema."""
    missing: dict[str, list[str]] = {}
    for table, column, decl in _missing_columns(conn):
        missing.setdefault(table, []).append(f"{decl.rsplit('DEFAULT ', 1)[1]} AS {column}")
    for table, columns in missing.items():
        conn.execute(f"CREATE TEMP VIEW {table} AS SELECT *, {', '.join(columns)} "
                     f"FROM main.{table}")


class Store:
    """Write side of the store. Not thread-safe: owned by one writer thread."""

    def __init__(self, path: str | Path, *, synchronous: str = "FULL",
                 checkpoint_bytes: int = WAL_CHECKPOINT_BYTES) -> None:
        self.path = Path(path)
        self.conn = connect(path, synchronous=synchronous, checkpoint_bytes=checkpoint_bytes)
        self._site_ids: dict[str, int] = dict(
            (name, sid) for sid, name in self.conn.execute("SELECT site_id, name FROM sites")
        )

    def close(self) -> None:
        self.conn.close()

    # -- transactions -------------------------------------------------------------------------

    def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def commit(self) -> None:
        self.conn.execute("COMMIT")

    def rollback(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
        self._reload_sites()

    def _reload_sites(self) -> None:
        # Site ids assigned inside a rolled-back transaction or savepoint no longer exist; a
        # stale cache would give later records a dangling site_id.
        self._site_ids = dict(
            (name, sid) for sid, name in self.conn.execute("SELECT site_id, name FROM sites")
        )

    def savepoint(self, name: str) -> None:
        self.conn.execute(f"SAVEPOINT {name}")

    def release(self, name: str) -> None:
        self.conn.execute(f"RELEASE {name}")

    def rollback_to(self, name: str) -> None:
        self.conn.execute(f"ROLLBACK TO {name}")
        self.conn.execute(f"RELEASE {name}")
        self._reload_sites()

    # -- writes (inside a transaction) ----------------------------------------------------------

    def register(self, req: pb.RegisterRequest) -> int:
        """Create the run on its first rank, add or resume the session; returns its acked seq."""
        return self.register_session(req)[0]

    def register_session(self, req: pb.RegisterRequest) -> tuple[int, str]:
        """Like `register`; returns (acked seq, the run name registered: renamed when taken)."""
        name, row = run_for_job(self.conn, req)
        if row is None:
            cur = self.conn.execute(
                "INSERT INTO runs (name, created, world_size, mesh_shape, mesh_dim_names,"
                " torch_version, dtype, seed, labels, job_id) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (name, time.time(), req.world_size, json.dumps(list(req.mesh_shape)),
                 json.dumps(list(req.mesh_dim_names)), req.torch_version, req.dtype, req.seed,
                 json.dumps(dict(req.labels), sort_keys=True), req.job_id),
            )
            run_id = cur.lastrowid
        else:
            run_id, world_size, _ = row
            if world_size != req.world_size:
                raise StoreError(
                    f"world_size: {req.world_size} differs from run {name!r}'s {world_size}"
                )
        existing = self.conn.execute(
            "SELECT run_id, rank, acked_seq FROM sessions WHERE session_id = ?", (req.session_id,)
        ).fetchone()
        if existing is not None:
            if (existing[0], existing[1]) != (run_id, req.rank):
                raise StoreError("session_id: already registered for another run or rank")
            return existing[2], name
        self.conn.execute(
            "INSERT INTO sessions (session_id, run_id, rank, local_rank, host, mesh_coordinate,"
            " stages, registered, job_id, grad_scale, grad_scale_source, agent_version)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            (req.session_id, run_id, req.rank, req.local_rank, req.host,
             json.dumps(list(req.mesh_coordinate)), json.dumps(list(req.stages)), time.time(),
             req.job_id, req.grad_scale, req.grad_scale_source, req.agent_version),
        )
        return 0, name

    def session(self, session_id: str) -> tuple[int, int, int]:
        """(run_id, rank, acked_seq) of a session; UnknownSession if none."""
        row = self.conn.execute(
            "SELECT run_id, rank, acked_seq FROM sessions WHERE session_id = ?", (session_id,)
        ).fetchone()
        if row is None:
            raise UnknownSession(f"session_id: {session_id!r} is not registered")
        return row

    def _site_id(self, name: str) -> int:
        sid = self._site_ids.get(name)
        if sid is None:
            sid = self.conn.execute("INSERT INTO sites (name) VALUES (?)", (name,)).lastrowid
            assert sid is not None  # set by the INSERT just run
            self._site_ids[name] = sid
        return sid

    def ingest(self, batch: pb.RecordBatch, hashes: Sequence[bytes] | None = None) -> IngestResult:
        """Store one validated batch (packed, per record, or both). See `ingest_columns`."""
        return self.ingest_columns(batch.session_id, batch.seq, batch_columns(batch), hashes)

    def ingest_columns(self, session_id: str, seq: int, cols: RecordColumns,
                       hashes: Sequence[bytes] | None = None) -> IngestResult:
        """Store one validated batch of records given as columns, in bulk.

        A resent batch (seq <= acked) stores nothing (`jobs.resent`). Otherwise every record is
        inserted by multi-row statements (`rows.insert_rows`); when some key is already stored (a
        record sent again under a new sequence, a key repeated inside the batch) the bulk insert is
        rolled back to its savepoint and the batch goes row by row, counting duplicates and
        flagging conflicts.
        `hashes` are `wire.content_hash.content_hashes(cols)` (computed here when None).
        """
        run_id, rank, acked = self.session(session_id)
        now = time.time()
        if hashes is None:
            hashes = content_hashes(cols)
        if seq <= acked:
            duplicates, conflicts = resent(self.conn, self._site_ids, session_id, seq, cols,
                                           hashes, run_id, rank, now)
            return IngestResult(acked_seq=acked, duplicates=duplicates, conflicts=conflicts,
                                resent_batch=True)
        result = IngestResult(acked_seq=seq)
        if cols.n:
            columns = record_columns(cols, [self._site_id(name) for name in cols.sites], run_id,
                                     rank, hashes, session_id, seq, now)
            rows = rows_of(columns)
            self.conn.execute("SAVEPOINT bulk")
            before = self.conn.total_changes
            top = self.conn.execute("SELECT COALESCE(MAX(record_id), 0) FROM records").fetchone()[0]
            insert_rows(self.conn, rows)
            if self.conn.total_changes - before == cols.n:
                self.conn.execute("RELEASE bulk")
                result.stored = cols.n
                # every row went in, one after another, each taking the largest id + 1 (checked:
                # were it otherwise, the ids are looked up by key)
                rids: Sequence[int] = range(top + 1, top + 1 + cols.n)
                if (self.conn.execute("SELECT MAX(record_id) FROM records").fetchone()[0]
                        != rids[-1]):
                    rids = [self._record_id(row[:9])[0] for row in rows]
                for row in sorted(cols.payloads):
                    self._store_chunk(rids[row], cols.payloads[row])
                self.conn.executemany(INSERT_SAMPLES, sample_rows(cols, rids))
                key_segments.store(self.conn, run_id, columns, rids)
            else:
                self.conn.execute("ROLLBACK TO bulk")
                self.conn.execute("RELEASE bulk")
                stored, rids = self._ingest_rows(cols, rows, hashes, session_id, seq, now, result)
                if stored:
                    key_segments.store(self.conn, run_id, dict(zip(INSERT_COLUMNS, zip(*stored))),
                                   rids)
        self.conn.execute(
            "UPDATE sessions SET acked_seq = ? WHERE session_id = ?", (seq, session_id)
        )
        return result

    def _record_id(self, key_params: tuple) -> tuple[int, bytes]:
        return self.conn.execute(
            "SELECT record_id, content_hash FROM records WHERE run_id=? AND step=? AND"
            " microbatch=? AND phase=? AND site_id=? AND role=? AND idx=? AND call=?"
            " AND rank=?", key_params,
        ).fetchone()

    def _store_chunk(self, record_id: int, p: pb.Payload | PayloadChunk) -> None:
        self.conn.execute(
            "INSERT OR IGNORE INTO payload_chunks VALUES (?,?,?,?,?,?,?,?)",
            (record_id, p.chunk_index, p.chunk_count, p.codec, p.raw_nbytes,
             p.compressed_nbytes, p.crc32, p.data),
        )

    def _ingest_rows(self, cols: RecordColumns, rows: list[tuple], hashes: Sequence[bytes],
                     session_id: str, seq: int, now: float,
                     result: IngestResult) -> tuple[list[tuple], list[int]]:
        """One row at a time: for a batch some of whose keys are already stored. Returns the
        rows stored and their record ids."""
        stored: tuple[list[tuple], list[int]] = ([], [])
        repeated = cols.repeated_rows()  # counted, and flagged, with their record's first row
        for i, (row, chash) in enumerate(zip(rows, hashes)):
            cur = self.conn.execute(_INSERT_RECORD, row)
            found = self._record_id(row[:9])
            if cur.rowcount == 1:
                result.stored += 1
                stored[0].append(row)
                stored[1].append(found[0])
                self.conn.executemany(INSERT_SAMPLES,
                                      sample_rows(cols, {i: found[0]}, rows=[i]))
            elif found[1] != chash:
                if i not in repeated:
                    self.conn.execute(
                        "INSERT INTO conflicts (record_id, session_id, seq, content_hash,"
                        " received) VALUES (?,?,?,?,?)", (found[0], session_id, seq, chash, now))
                    result.conflicts += 1
                continue
            elif i not in repeated:
                result.duplicates += 1
            if i in cols.payloads:
                self._store_chunk(found[0], cols.payloads[i])
        return stored

    def close_session(self, req: pb.CloseSessionRequest) -> int:
        """Record what the agent reports at close; returns records stored for the session."""
        self.session(req.session_id)
        self.conn.execute(
            "UPDATE sessions SET closed=?, records_sent=?, records_dropped=?, capture_errors=?,"
            " dropped_by_reason=? WHERE session_id=?",
            (time.time(), req.records_sent, req.records_dropped, req.capture_errors,
             json.dumps(dict(req.dropped_by_reason), sort_keys=True), req.session_id),
        )
        return self.conn.execute(
            "SELECT COUNT(*) FROM records WHERE session_id = ?", (req.session_id,)
        ).fetchone()[0]


def unpack_sketch(blob: bytes) -> list[float]:
    import array

    a = array.array("d")
    a.frombytes(blob)
    return a.tolist()
