"""The durable store: what was ingested, and how the comparison and the daemon read it.

Owns which files are stores (`files`: application id, checks before opening), the SQLite
schema and its single writer (`sqlite`: `Store`, `connect`; batches arrive as
`wire.packed.RecordColumns` and are inserted in bulk, `Store.ingest_columns`), the rows of the
records table built column-wise for any SQL backend (`rows`), each stored batch's comparison
columns in one blob (`key_segments`), the read side (`reader`), the
queue of work in front of the writers (`work_queue`), the group-commit writer thread
(`writer`; PostgreSQL's in `postgres_writer`) and run summaries (`summary`). It may import the wire
contract (`protos`, `wire`) and nothing else of numaudit: the store knows no service, no
comparison and no CLI.
"""

from numaudit.auditor.store.files import APPLICATION_ID, NotAStore, check_store_file
from numaudit.auditor.store.reader import Reader
from numaudit.auditor.store.sqlite import (
    RECORD_COLUMNS,
    SCHEMA_VERSION,
    IngestResult,
    RunNameTaken,
    Store,
    StoreError,
    UnknownRun,
    UnknownSession,
    connect,
    content_hash,
    from_int64,
    to_int64,
    unpack_sketch,
)

__all__ = ["APPLICATION_ID", "NotAStore", "check_store_file", "RECORD_COLUMNS", "SCHEMA_VERSION",
           "IngestResult", "Reader", "RunNameTaken", "Store", "StoreError", "UnknownRun",
           "UnknownSession", "connect", "content_hash", "from_int64", "to_int64", "unpack_sketch"]
