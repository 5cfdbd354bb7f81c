"""The durable store: what was ingested, and how the comparison and the daemon read it.

Owns the SQLite schema and its single writer (`sqlite`: `Store`, `Reader`, `connect`), the
group-commit writer thread (`writer`), the read side (`reader`) and run summaries (`store.summary`). It may import the wire
contract (`protos`, `wire`) and nothing else of numaudit: the store knows no service, no
comparison and no CLI.
"""

from auditor.store.reader import Reader
from auditor.store.sqlite import (
    RECORD_COLUMNS, SCHEMA_VERSION, IngestResult, Store, StoreError, UnknownRun, UnknownSession,
    connect, content_hash, from_int64, to_int64, unpack_sketch,
)

__all__ = ["RECORD_COLUMNS", "SCHEMA_VERSION", "IngestResult", "Reader", "Store", "StoreError",
           "UnknownRun", "UnknownSession", "connect", "content_hash", "from_int64", "to_int64",
           "unpack_sketch"]
