"""atheris (libFuzzer) on the daemon's ingest path, in-process and coverage-guided.

    python -m tests.faults.fuzz_ingest CORPUS_DIR -runs=N -max_total_time=S

Each input is the bytes of one Ingest request. It goes through what the daemon's Ingest handler
does with it (auditor/daemon/server.py): the lenient parser, `_validate_and_hash` (validation and
content hashes), then `Store.ingest` inside a transaction on a real SQLite file, rolled back so
the store stays small. The only exceptions allowed are the ones the server maps to specific
status codes (ValidationError, StoreError); anything else — which `status_for` would answer as
UNAVAILABLE "unexpected", making agents resend a poison batch forever — is a crash that libFuzzer
reports with the input that caused it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["numaudit.auditor.daemon.validate",
                                         "numaudit.auditor.store"]):
    from numaudit.auditor.daemon.validate import ValidationError
    from numaudit.auditor.store import Store, StoreError

from numaudit.auditor.daemon.server import MalformedRequest, _lenient_parser, _validate_and_hash  # noqa: E402
from numaudit.protos import numaudit_pb2 as pb  # noqa: E402

SESSION = "fuzz-session"
_parse = _lenient_parser(pb.RecordBatch)
_store: Store | None = None


def _open_store() -> Store:
    from tests.auditor.builders import register_request

    path = Path(tempfile.mkdtemp(prefix="numaudit-fuzz-")) / "fuzz.db"
    store = Store(path, synchronous="OFF")
    store.begin()
    store.register(register_request(run="fuzz", session_id=SESSION, rank=0, world_size=1,
                                    mesh_shape=[], mesh_dim_names=[], mesh_coordinate=[]))
    store.commit()
    return store


def test_one_input(data: bytes) -> None:
    batch = _parse(data)
    if isinstance(batch, MalformedRequest):
        return  # INVALID_ARGUMENT "request: not a valid numaudit.v1.RecordBatch"
    try:
        hashes = _validate_and_hash(batch)
    except ValidationError:
        return  # INVALID_ARGUMENT / FAILED_PRECONDITION / DATA_LOSS / RESOURCE_EXHAUSTED
    batch.session_id = SESSION  # reach the store whatever session the input names
    _store.begin()
    try:
        _store.ingest(batch, hashes)
    except StoreError:
        pass  # FAILED_PRECONDITION
    finally:
        _store.rollback()


def main() -> None:
    global _store
    _store = _open_store()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
