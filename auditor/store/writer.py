"""The single writer thread: group commit of everything that changes a SQLite store.

Handlers submit work (a callable taking the `Store`) and get a future that resolves only after
the transaction holding that work has committed — which is what lets the server ack a batch only
once it is durable. Work queued while a commit runs is committed together in the next
transaction; each item sits in its own savepoint, so one failing item rolls back alone
(`auditor.store.work_queue`).

The WAL is checkpointed by a second thread on its own connection (`Checkpointer`), not at
commit: a checkpoint copies pages into the database and syncs it, which on a busy disk took
30-340 ms, and a commit that ran it held every ack of its group that long (while readers hold
old snapshots the WAL stays past the threshold and every commit tried again). SQLite lets a
checkpoint run beside the writer; the writer checkpoints itself only past WAL_BACKSTOP_BYTES.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sqlite3
import threading
from pathlib import Path

from numaudit.auditor.store import Store
from numaudit.auditor.store.sqlite import WAL_BACKSTOP_BYTES
from numaudit.auditor.store.work_queue import QueuedWriter, WriterClosed, fail, resolve, run_group

log = logging.getLogger(__name__)

__all__ = ["Checkpointer", "StoreWriter", "WriterClosed"]

CHECKPOINT_INTERVAL_S = 0.25
"""How often the checkpointer looks for committed pages to copy into the database."""
HELD_BACK_WARN_BYTES = WAL_BACKSTOP_BYTES // 4
"""WAL a checkpoint could not copy (a reader still needs the pages it would overwrite) past
which the checkpointer warns, once until it catches up."""


class Checkpointer:
    """Checkpoints a store's WAL (PRAGMA wal_checkpoint(PASSIVE): never waits for the writer or
    readers; copies what no reader still needs) on its own connection and thread, at most every
    CHECKPOINT_INTERVAL_S and only after a commit (`committed`)."""

    def __init__(self, path: str | Path, synchronous: str) -> None:
        self._conn = sqlite3.connect(str(path), check_same_thread=False, timeout=30,
                                     isolation_level=None)
        self._conn.execute(f"PRAGMA synchronous={synchronous}")
        self._page = self._conn.execute("PRAGMA page_size").fetchone()[0]
        self._held_back = False
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self.commits = 0
        """Commits the writer reported (`committed`)."""
        self.covered = 0
        """Commits whose pages the last finished checkpoint was run after."""
        self.checkpoints = 0
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="numaudit-store-checkpoint",
                                        daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """The writer committed: there may be pages to checkpoint (writer thread only)."""
        self.commits += 1
        self._dirty.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._dirty.wait(CHECKPOINT_INTERVAL_S) and not self._stop.is_set():
                self._dirty.clear()
                upto = self.commits  # read after the clear: a later commit sets it again
                try:
                    _, frames, copied = self._conn.execute(
                        "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self._report((frames - copied) * self._page)
                    self.checkpoints += 1
                    self.covered = upto  # last: whoever waits on it finds the rest done
                except sqlite3.Error as exc:  # the writer's backstop checkpoints instead
                    if not self._failed:
                        log.warning("store checkpoint failed (the writer checkpoints past "
                                    "%d MiB of WAL): %s", WAL_BACKSTOP_BYTES >> 20, exc)
                        self._failed = True
                self._stop.wait(CHECKPOINT_INTERVAL_S)

    def _report(self, held_back: int) -> None:
        """Say when a reader keeps checkpoints from copying the WAL (it grows until the reader
        ends), and when they caught up."""
        if held_back > HELD_BACK_WARN_BYTES and not self._held_back:
            self._held_back = True
            log.warning("store checkpoints are held back: %.1f MiB of WAL cannot be copied into "
                        "the database while a reader keeps an older snapshot (a long compare, "
                        "watch or read); the WAL grows until it ends", held_back / (1 << 20))
        elif held_back == 0 and self._held_back:
            self._held_back = False
            log.info("store checkpoints caught up")

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        self._thread.join(30)
        self._conn.close()


class StoreWriter(QueuedWriter):
    """Owns the write connection; `submit` from any thread, `close` flushes and stops."""

    max_items = 256

    def __init__(self, path: str | Path, *, synchronous: str = "FULL") -> None:
        super().__init__(1, "numaudit-store-writer")
        self._path, self._synchronous = path, synchronous
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._start()
        self._ready.result()  # raises if the store could not be opened

    def _serve(self) -> None:
        store = None
        try:
            store = Store(self._path, synchronous=self._synchronous,
                          checkpoint_bytes=WAL_BACKSTOP_BYTES)
            checkpointer = Checkpointer(self._path, self._synchronous)
        except BaseException as exc:  # reported to the constructor
            if store is not None:
                store.close()
            self._ready.set_exception(exc)
            return
        self.checkpointer = checkpointer
        self._ready.set_result(None)
        try:
            stop = False
            while not stop:
                items, stop = self._take()
                if items:
                    self._commit(store, items, checkpointer)
        finally:
            checkpointer.close()  # first: the writer's connection, closed last, checkpoints all
            store.close()

    @staticmethod
    def _commit(store: Store, items: list, checkpointer: Checkpointer) -> None:
        try:
            outcomes = run_group(store, items)
            checkpointer.committed()  # before the acks: whoever got one can wait for its pages
        except Exception as exc:  # the commit itself failed (disk full, I/O error)
            log.error("store commit failed: %s", exc)
            try:
                store.rollback()
            except Exception as rollback_exc:  # the connection may be unusable; keep serving
                log.error("store rollback failed: %s", rollback_exc)
            fail(items, exc)
            return
        resolve(outcomes)
