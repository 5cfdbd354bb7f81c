"""The `StoreWriter` interface over PostgreSQL: a transaction per work item, on a few
connections, with the races between replicas retried.

Unlike SQLite's single writer, work items run concurrently (PostgreSQL serializes what must be:
a session's batches by its row lock, names and ids by unique constraints; see
`auditor.store.postgres`). A transaction that loses a race to another replica is rolled back and
run again; so is one whose connection broke (a database restart): every work item the daemon
submits is idempotent (ingest by (session, seq) and by (run, key, rank), register by session id).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

import psycopg
from psycopg import errors as pg_errors

from auditor.store.files import NotAStore
from auditor.store.postgres import PgStore, pg_connect, redact
from auditor.store.writer import WriterClosed

log = logging.getLogger(__name__)

RETRYABLE = (pg_errors.SerializationFailure, pg_errors.DeadlockDetected,
             pg_errors.UniqueViolation)
"""A transaction that lost a race to another replica; run again, it sees the winner's rows."""
MAX_ATTEMPTS = 8
CONNECTIONS = 4
"""Connections (and threads) per daemon: batches of different sessions commit in parallel."""


class PgWriter:
    """The `StoreWriter` interface over PostgreSQL: `submit(work)` runs `work(store)` in a
    transaction of its own on one of `connections` connections; the future resolves after the
    commit. Transactions that lose a race to another replica run again (`RETRYABLE`); a broken
    connection is reopened and the work run again (each work item is idempotent: ingest by
    (session, seq) and (run, key, rank), register by session id)."""

    def __init__(self, url: str, *, synchronous: str = "FULL", connections: int = CONNECTIONS) -> None:
        self.url, self._synchronous = url, synchronous
        pg_connect(url, synchronous=synchronous).close()  # reachable, schema in place
        self._pool = concurrent.futures.ThreadPoolExecutor(
            connections, thread_name_prefix="numaudit-pg-writer")
        self._local = threading.local()
        self._stores: list[PgStore] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, work: Callable[[PgStore], Any]) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise WriterClosed("the store writer is closed")
            return self._pool.submit(self._run, work)

    def close(self, timeout: float = 30.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for store in self._stores:
            try:
                store.close()
            except Exception:  # already broken
                pass

    def _store(self) -> PgStore:
        store = getattr(self._local, "store", None)
        if store is None or store.raw.closed:
            store = PgStore(self.url, synchronous=self._synchronous)
            self._local.store = store
            with self._lock:
                self._stores.append(store)
        return store

    def _run(self, work: Callable[[PgStore], Any]) -> Any:
        delay = 0.01
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                store = self._store()
            except NotAStore as exc:  # the server is down or restarting
                if attempt == MAX_ATTEMPTS:
                    raise ConnectionError(str(exc)) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            try:
                store.begin()
                value = work(store)
                store.commit()
                return value
            except RETRYABLE as exc:
                store.rollback()
                if attempt == MAX_ATTEMPTS:
                    raise ConnectionError(f"store: gave up after {attempt} attempts: {exc}") \
                        from None
                log.debug("retrying a transaction that lost a race: %s", exc)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                # connection lost (server restart, network): the outcome of a commit in flight
                # is unknown, and running the work again is safe
                self._local.store = None
                try:
                    store.close()
                except Exception:
                    pass
                if attempt == MAX_ATTEMPTS:
                    raise ConnectionError(f"store: {redact(self.url)}: {exc}") from None
                log.warning("store connection lost (%s); reconnecting", exc)
            except BaseException:
                try:
                    store.rollback()
                except psycopg.Error:
                    self._local.store = None
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        raise AssertionError("unreachable")
