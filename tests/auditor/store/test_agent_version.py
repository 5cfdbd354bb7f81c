"""Sessions keep the agent version of their Register, on both backends, and a store written
before the column existed still opens: read-only (the column reads as "") and for writing (the
column is added)."""

from __future__ import annotations

import pytest

from numaudit.auditor.store import Reader, summary
from numaudit.auditor.store.backend import open_writer
from tests.auditor.builders import register_request

pytestmark = pytest.mark.timeout(60)


def _register(location, **kw) -> None:
    w = open_writer(location, synchronous="NORMAL")
    try:
        w.submit(lambda s: s.register_session(register_request(**kw))).result(20)
    finally:
        w.close()


def _versions(location) -> list[str]:
    reader = Reader(location)
    try:
        return [r.agent_version for r in summary.describe_run(reader, "ref").ranks]
    finally:
        reader.close()


def _drop_agent_version(location) -> None:
    if str(location).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(location), autocommit=True) as conn:
            conn.execute("ALTER TABLE sessions DROP COLUMN agent_version")
        return
    import sqlite3

    conn = sqlite3.connect(location)
    try:
        conn.execute("ALTER TABLE sessions DROP COLUMN agent_version")
    finally:
        conn.close()


def test_sessions_keep_the_agent_version(store_location):
    _register(store_location, session_id="s0", rank=0, agent_version="0.1.0")
    _register(store_location, session_id="s1", rank=1)  # an agent of an earlier build
    assert _versions(store_location) == ["0.1.0", ""]


def test_a_store_from_before_agent_versions_opens(store_location):
    _register(store_location, session_id="s0", rank=0, agent_version="0.0.9")
    _drop_agent_version(store_location)
    assert _versions(store_location) == [""]  # read-only: a view supplies the default
    _register(store_location, session_id="s1", rank=1, agent_version="0.1.0")  # adds the column
    assert _versions(store_location) == ["", "0.1.0"]
