"""The `StoreWriter` interface over PostgreSQL: group commit on a few connections, with the
races between replicas retried.

Unlike SQLite's single writer, work items run concurrently (PostgreSQL serializes what must be:
a session's batches by its row lock, names and ids by unique constraints; see
`auditor.store.postgres`). Each connection's thread takes what is queued (up to
`MAX_ITEMS_PER_TRANSACTION` items) and commits it as one transaction, each item in a savepoint of
its own, so one failing item rolls back alone, as the SQLite writer does (both share
`auditor.store.work_queue`); futures resolve after the commit. A transaction that loses a race to
another replica, or whose connection broke (a database restart), is rolled back and its items run
again, one transaction each: every work item the daemon submits is idempotent (ingest by
(session, seq) and by (run, key, rank), register by session id).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from numaudit.auditor.store.files import NotAStore

# psycopg through the store's module: where it is not installed, that import says so (NotAStore)
from numaudit.auditor.store.postgres import PgStore, pg_connect, pg_errors, psycopg, redact
from numaudit.auditor.store.work_queue import QueuedWriter, fail, resolve, run_group

log = logging.getLogger(__name__)

RETRYABLE = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected,
             pg_errors.UniqueViolation, pg_errors.LockNotAvailable)
"""A transaction that lost a race to another replica (or a batch whose direct COPY met a stored
key, `PgStore.ingest_columns`), or waited past `lock_timeout` for another replica's lock
(`postgres.WRITER_TIMEOUTS`); run again, it sees the winner's rows."""
LOST = (psycopg.OperationalError, psycopg.InterfaceError,
        pg_errors.IdleInTransactionSessionTimeout)
"""The connection broke: the outcome of a commit in flight is unknown; running again is safe."""
MAX_ATTEMPTS = 8
CONNECTIONS = 2
"""Connections (and threads) per daemon: groups of batches commit in parallel. Two keep a
commit in flight while the next group is built; more only add processes to a small machine."""
MAX_ITEMS_PER_TRANSACTION = 16


class PgWriter(QueuedWriter):
    """The `StoreWriter` interface over PostgreSQL: `submit(work)` queues `work(store)`; the
    future resolves after the transaction holding it committed."""

    max_items = MAX_ITEMS_PER_TRANSACTION

    def __init__(self, url: str, *, synchronous: str = "FULL",
                 connections: int = CONNECTIONS) -> None:
        super().__init__(connections, "numaudit-pg-writer")
        self.url, self._synchronous = url, synchronous
        pg_connect(url, synchronous=synchronous).close()  # reachable, schema in place
        self._stores: list[PgStore] = []
        self._start()

    def _after_close(self) -> None:
        for store in self._stores:
            try:
                store.close()
            except Exception:  # already broken
                pass

    # -- the connection threads ---------------------------------------------------------------

    def _serve(self) -> None:
        store: PgStore | None = None
        stop = False
        while not stop:
            items, stop = self._take()
            if len(items) > 1:
                store = self._group(store, items)
            elif items:
                store = self._one(store, *items[0])

    def _connect(self, store: PgStore | None) -> PgStore:
        if store is not None and not store.raw.closed:
            return store
        store = PgStore(self.url, synchronous=self._synchronous)
        with self._lock:
            self._stores.append(store)
        return store

    def _group(self, store: PgStore | None, items: list) -> PgStore | None:
        """One transaction for several items, each in a savepoint; on a race or a lost
        connection, the items run again one transaction each."""
        try:
            store = self._connect(store)
            outcomes = run_group(store, items, abort=RETRYABLE + LOST)
        except (NotAStore,) + RETRYABLE + LOST:
            store = self._abandon(store)
            for work, fut in items:
                store = self._one(store, work, fut)
            return store
        except BaseException as exc:
            store = self._abandon(store)
            fail(items, exc)
            return store
        resolve(outcomes)
        return store

    @staticmethod
    def _abandon(store: PgStore | None) -> PgStore | None:
        """Roll back what the store's connection holds; None when it is unusable."""
        if store is None:
            return None
        try:
            store.rollback()
            return store
        except Exception:
            try:
                store.close()
            except Exception:
                pass
            return None

    def _one(self, store: PgStore | None, work: Callable[[PgStore], Any],
             fut: concurrent.futures.Future) -> PgStore | None:
        """`work` in a transaction of its own, run again after a race or a lost connection."""
        delay = 0.01
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                store = self._connect(store)
            except NotAStore as exc:  # the server is down or restarting
                if attempt == MAX_ATTEMPTS:
                    fut.set_exception(ConnectionError(str(exc)))
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                store.begin()
                value = work(store)
                store.commit()
            except RETRYABLE as exc:
                store = self._abandon(store)
                if attempt == MAX_ATTEMPTS:
                    fut.set_exception(ConnectionError(
                        f"store: gave up after {attempt} attempts: {exc}"))
                    return store
                log.debug("retrying a transaction that lost a race: %s", exc)
            except LOST as exc:
                store = self._abandon(store) if not store.raw.closed else None
                if store is not None:
                    try:
                        store.close()
                    except Exception:
                        pass
                    store = None
                if attempt == MAX_ATTEMPTS:
                    fut.set_exception(ConnectionError(f"store: {redact(self.url)}: {exc}"))
                    return None
                log.warning("store connection lost (%s); reconnecting", exc)
            except BaseException as exc:
                store = self._abandon(store)
                fut.set_exception(exc)
                return store
            else:
                fut.set_result(value)
                return store
            time.sleep(delay if attempt > 1 else 0)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")
