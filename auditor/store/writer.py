"""The single writer thread: group commit of everything that changes a SQLite store.

Handlers submit work (a callable taking the `Store`) and get a future that resolves only after
the transaction holding that work has committed — which is what lets the server ack a batch only
once it is durable. Work queued while a commit runs is committed together in the next
transaction; each item sits in its own savepoint, so one failing item rolls back alone
(`auditor.store.work_queue`).
"""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path

from auditor.store import Store
from auditor.store.work_queue import QueuedWriter, WriterClosed, fail, resolve, run_group

log = logging.getLogger(__name__)

__all__ = ["StoreWriter", "WriterClosed"]


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
        try:
            store = Store(self._path, synchronous=self._synchronous)
        except BaseException as exc:  # reported to the constructor
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        try:
            stop = False
            while not stop:
                items, stop = self._take()
                if items:
                    self._commit(store, items)
        finally:
            store.close()

    @staticmethod
    def _commit(store: Store, items: list) -> None:
        try:
            outcomes = run_group(store, items)
        except Exception as exc:  # the commit itself failed (disk full, I/O error)
            log.error("store commit failed: %s", exc)
            try:
                store.rollback()
            except Exception as rollback_exc:  # the connection may be unusable; keep serving
                log.error("store rollback failed: %s", rollback_exc)
            fail(items, exc)
            return
        resolve(outcomes)
