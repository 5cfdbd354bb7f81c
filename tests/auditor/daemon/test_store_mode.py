"""The store file is the daemon's data without its tokens (issue 40, item 6): under umask 022,
`auditor serve --tokens` created store.db 0644 in a 0755 directory, and a local user with no
token read a run and its records with the system's sqlite3. A store is now created 0600, and
its -wal and -shm files with it."""

from __future__ import annotations

import os
import stat

import pytest

from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.daemon.tokens import Tokens
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire.channels import open_channel
from tests.auditor.builders import batch, record, register_request

pytestmark = pytest.mark.timeout(60)
SECRET = "tok-writer-5d8a2c7e1f4b9a63"


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_new_store_and_its_wal_are_readable_by_their_owner_only(tmp_path, umask_022):
    db = tmp_path / "store.db"
    tokens = Tokens.parse({"token": [{"name": "w", "token": SECRET, "write": ["*"]}]})
    with BackgroundServer("127.0.0.1:0", db, tokens=tokens) as srv:
        stub = numaudit_pb2_grpc.AuditorStub(open_channel(srv.address, token=SECRET))
        stub.Register(register_request(run="ref", session_id="s"), timeout=10)
        acks = list(stub.Ingest(iter([batch(1, [record(0, 0, "l.0")], session_id="s")]),
                                timeout=10))
        assert acks[0].stored == 1
        files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()
                 if p.name.startswith("store.db")}
    assert {"store.db", "store.db-wal", "store.db-shm"} <= set(files), files
    assert all(mode == 0o600 for mode in files.values()), {k: oct(v) for k, v in files.items()}


def test_a_store_readable_by_others_is_named_in_a_warning(tmp_path, caplog):
    db = tmp_path / "store.db"
    with BackgroundServer("127.0.0.1:0", db):
        pass
    os.chmod(db, 0o644)
    tokens = Tokens.parse({"token": [{"name": "w", "token": SECRET, "write": ["*"]}]})
    with caplog.at_level("WARNING", logger="numaudit.auditor.daemon.server"):
        with BackgroundServer("127.0.0.1:0", db, tokens=tokens):
            pass
    assert any("can be read by other users" in r.getMessage() and str(db) in r.getMessage()
               for r in caplog.records)
