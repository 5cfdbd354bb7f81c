"""The queue in front of a store's writer threads, shared by both backends.

Handlers `submit` work (a callable taking the store) from any thread and get a future that
resolves only after the transaction holding that work has committed — which is what lets the
server ack a batch only once it is durable. Writer threads `_take` what is queued as one group
and commit it with their backend's strategy: SQLite's one thread (`auditor.store.writer`), or
PostgreSQL's few connections with races retried (`auditor.store.postgres_writer`). Both run a
group in one transaction, each item in a savepoint of its own (`_run_group`), so one failing
item rolls back alone.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

Work = Callable[[Any], Any]
Item = tuple[Work, concurrent.futures.Future]
Outcome = tuple[concurrent.futures.Future, bool, Any]


class WriterClosed(RuntimeError):
    pass


class QueuedWriter:
    """`submit(work)` from any thread, `close()` commits what is queued and stops the threads.

    Subclasses implement `_serve` (one writer thread's loop, `_take` then commit) and may
    override `_after_close` (release connections once every thread stopped)."""

    max_items: int = 256
    """Work items one transaction takes at most."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders submit() against close(): nothing queued after the
                                       # stop
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}" if threads > 1
                                          else name, daemon=True) for i in range(threads)]

    def _start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, work: Work) -> concurrent.futures.Future:
        """Queue work; the future resolves after its transaction commits. A future cancelled
        before a writer thread picks it up is skipped (its work never runs)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise WriterClosed("the store writer is closed")
            self._queue.put((work, fut))
        return fut

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is queued, then stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._after_close()

    def _after_close(self) -> None:
        """Hook run once the threads stopped (or the close timed out)."""

    def _serve(self) -> None:
        raise NotImplementedError

    def _take(self) -> tuple[list[Item], bool]:
        """Block for the next group: the items queued now (up to `max_items`) whose futures
        were not cancelled — they can no longer be, so setting their result after the commit
        cannot raise InvalidStateError — and whether this thread must stop after it."""
        items = [self._queue.get()]
        while items[-1] is not None and len(items) < self.max_items:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        stop = items[-1] is None
        live = [(w, f) for w, f in (i for i in items if i is not None)
                if f.set_running_or_notify_cancel()]
        return live, stop


def run_group(store: Any, items: list[Item], abort: tuple[type[BaseException], ...] = ()
              ) -> list[Outcome]:
    """Run `items` in one transaction on `store`, each in a savepoint, and commit. An item that
    raises rolls back alone (its outcome carries the exception) unless the exception is one of
    `abort`, which propagates, as does a failing begin or commit: the caller rolls back."""
    outcomes: list[Outcome] = []
    store.begin()
    for n, (work, fut) in enumerate(items):
        sp = f"item{n}"
        store.savepoint(sp)
        try:
            value = work(store)
        except abort:
            raise
        except Exception as exc:  # this item only: its savepoint rolls back
            store.rollback_to(sp)
            outcomes.append((fut, False, exc))
        else:
            store.release(sp)
            outcomes.append((fut, True, value))
    store.commit()
    return outcomes


def resolve(outcomes: list[Outcome]) -> None:
    """Hand each committed item's result (or its own exception) to its future."""
    for fut, ok, value in outcomes:
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


def fail(items: list[Item], exc: BaseException) -> None:
    """Every item of a group whose transaction failed gets its exception."""
    for _, fut in items:
        if not fut.done():
            fut.set_exception(exc)
