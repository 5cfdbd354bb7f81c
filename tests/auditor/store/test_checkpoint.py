"""The daemon's writer leaves WAL checkpoints to a background thread: a commit never copies pages
into the database or syncs it (that held acks for 30-340 ms on a busy disk), yet the WAL is
still checkpointed, and closing the writer leaves no WAL behind."""

from __future__ import annotations

import logging
import sqlite3

import pytest

from numaudit.auditor.store import Reader
from numaudit.auditor.store import writer as writer_module
from numaudit.auditor.store.sqlite import WAL_BACKSTOP_BYTES, WAL_CHECKPOINT_BYTES
from numaudit.auditor.store.writer import StoreWriter
from tests.auditor.builders import batch, record, register_request
from tests.faults.harness import wait_until

pytestmark = pytest.mark.timeout(60)


def _ingest(writer: StoreWriter, seq: int, n: int) -> None:
    writer.submit(lambda s: s.ingest(batch(seq, [record(seq, j, f"layers.{j}")
                                                 for j in range(n)]))).result(10)


def test_commits_leave_checkpoints_to_the_background_thread(tmp_path):
    db = tmp_path / "audit.db"
    w = StoreWriter(db, synchronous="NORMAL")
    try:
        # The writer's own connection checkpoints only past the backstop.
        page = w.submit(lambda s: s.conn.execute("PRAGMA page_size").fetchone()[0]).result(10)
        auto = w.submit(lambda s: s.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
        assert auto.result(10) == WAL_BACKSTOP_BYTES // page > WAL_CHECKPOINT_BYTES // page
        w.submit(lambda s: s.register(register_request())).result(10)
        for seq in range(1, 41):  # a few MB of WAL, in many small commits as agents send
            _ingest(w, seq, 32)
        # The background thread checkpoints after the last commit: every frame of the WAL is
        # then in the database (a passive checkpoint from here finds nothing left to copy).
        cp = w.checkpointer
        wait_until(lambda: cp.covered == cp.commits, 10, "a checkpoint after the last commit")
        assert cp.commits >= 41
        conn = sqlite3.connect(str(db))
        try:
            busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            conn.close()
        assert busy == 0 and frames == copied
    finally:
        w.close()
    # The writer's connection closed last, so SQLite checkpointed everything and removed the WAL.
    wal = db.with_name(db.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    reader = Reader(db)
    try:
        assert sum(1 for _ in reader.records("ref")) == 40 * 32
    finally:
        reader.close()


def test_a_reader_holding_a_snapshot_does_not_stop_commits(tmp_path, monkeypatch, caplog):
    """A passive checkpoint copies only what no reader still needs; the writer goes on, and the
    checkpointer says when a reader holds it back and when it caught up."""
    monkeypatch.setattr(writer_module, "HELD_BACK_WARN_BYTES", 16 << 10)
    caplog.set_level(logging.INFO, logger="numaudit.auditor.store.writer")
    db = tmp_path / "audit.db"
    w = StoreWriter(db, synchronous="NORMAL")
    cp = w.checkpointer
    try:
        w.submit(lambda s: s.register(register_request())).result(10)
        _ingest(w, 1, 8)
        reader = sqlite3.connect(str(db), isolation_level=None)
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM records").fetchone()[0] == 8
        for seq in range(2, 12):
            _ingest(w, seq, 8)
        wait_until(lambda: cp.covered == cp.commits, 10, "a checkpoint after the last commit")
        held = [r for r in caplog.records if "held back" in r.getMessage()]
        assert len(held) == 1 and held[0].levelno == logging.WARNING
        # The snapshot still reads what it saw; the writer's commits all landed.
        assert reader.execute("SELECT count(*) FROM records").fetchone()[0] == 8
        reader.execute("COMMIT")
        assert reader.execute("SELECT count(*) FROM records").fetchone()[0] == 88
        reader.close()
        _ingest(w, 12, 8)
        wait_until(lambda: cp.covered == cp.commits, 10, "a checkpoint after the reader ended")
        assert any("caught up" in r.getMessage() for r in caplog.records)
        assert len([r for r in caplog.records if "held back" in r.getMessage()]) == 1
    finally:
        w.close()
