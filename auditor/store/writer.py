"""The single writer thread: group commit of everything that changes the store.

Handlers submit work (a callable taking the `Store`) and get a future that resolves only after
the transaction holding that work has committed — which is what lets the server ack a batch only
once it is durable. Work queued while a commit runs is committed together in the next
transaction; each item sits in its own savepoint, so one failing item rolls back alone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable

from auditor.store import Store

log = logging.getLogger(__name__)

MAX_ITEMS_PER_TRANSACTION = 256


class WriterClosed(RuntimeError):
    pass


class StoreWriter:
    """Owns the write connection; `submit` from any thread, `close` flushes and stops."""

    def __init__(self, path: str | Path, *, synchronous: str = "FULL") -> None:
        self._path, self._synchronous = path, synchronous
        self._queue: queue.Queue = queue.Queue()
        self._ready = concurrent.futures.Future()
        self._closed = False
        self._lock = threading.Lock()  # orders submit() against close(): nothing queued after the stop
        self._thread = threading.Thread(target=self._run, name="numaudit-store-writer", daemon=True)
        self._thread.start()
        self._ready.result()  # raises if the store could not be opened

    def submit(self, work: Callable[[Store], Any]) -> concurrent.futures.Future:
        """Queue work; the future resolves after its transaction commits. A future cancelled
        before the writer picks it up is skipped (its work never runs)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise WriterClosed("the store writer is closed")
            self._queue.put((work, fut))
        return fut

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            store = Store(self._path, synchronous=self._synchronous)
        except BaseException as exc:  # reported to the constructor
            self._ready.set_exception(exc)
            return
        self._ready.set_result(None)
        try:
            stop = False
            while not stop:
                items = [self._queue.get()]
                while len(items) < MAX_ITEMS_PER_TRANSACTION:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if None in items:
                    stop = True
                    items = [i for i in items if i is not None]
                # Cancelled futures are dropped; the rest can no longer be cancelled, so setting
                # their result after the commit cannot raise InvalidStateError.
                items = [(work, fut) for work, fut in items if fut.set_running_or_notify_cancel()]
                if items:
                    self._commit(store, items)
        finally:
            store.close()

    def _commit(self, store: Store, items: list) -> None:
        results: list[tuple[concurrent.futures.Future, bool, Any]] = []
        try:
            store.begin()
            for n, (work, fut) in enumerate(items):
                sp = f"item{n}"
                store.savepoint(sp)
                try:
                    value = work(store)
                except Exception as exc:  # this item only: its savepoint rolls back
                    store.rollback_to(sp)
                    results.append((fut, False, exc))
                else:
                    store.release(sp)
                    results.append((fut, True, value))
            store.commit()
        except Exception as exc:  # the commit itself failed (disk full, I/O error)
            log.error("store commit failed: %s", exc)
            try:
                store.rollback()
            except Exception as rollback_exc:  # the connection may be unusable; keep serving
                log.error("store rollback failed: %s", rollback_exc)
            for _, fut in items:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for fut, ok, value in results:
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)
