"""Worker processes for everything that reads the store for a client (reads, watches, compares).

They never run in the daemon's process: a long DescribeRun, a watch poll or a comparison holds
its own GIL, threads and memory, so it cannot delay an Ingest ack (issue 10: a compare and two
DescribeRuns on a 3M-record store delayed acks by seconds when they shared the daemon's threads).

Spawned, not forked: the daemon holds gRPC state that a fork would copy (FIELD-NOTES). A pool
starts on first use. A call past its time budget cannot be interrupted inside the engine, so the
pool's processes are killed and the pool replaced: that call ends with `BudgetExceeded`, others
running in the same pool with `WorkerLost`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger(__name__)


class BudgetExceeded(Exception):
    """A call ran past its time budget and was stopped (DEADLINE_EXCEEDED)."""


class WorkerLost(Exception):
    """The worker process running a call died or was replaced (UNAVAILABLE: retry)."""


WORKER_NICE = 10
"""Workers run at a lower CPU priority than the daemon: on a busy machine ingest goes first."""


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop
    try:
        os.nice(WORKER_NICE)
    except OSError:
        pass


class Workers:
    """A lazily started pool of `processes` spawned workers named `name` (for logs)."""

    def __init__(self, name: str, processes: int = 1) -> None:
        self.name = name
        self._processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._expired: set[concurrent.futures.Future] = set()
        self.generation = 0
        """Bumped whenever the pool is replaced (state held in old workers is gone)."""
        self.closed = False

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._processes, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init)
        return self._pool

    async def run(self, budget_s: float | None, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` in a worker. With a budget, `BudgetExceeded` after `budget_s`, enforced
        even when the caller goes away (a cancelled call leaves nothing running unbounded)."""
        if self.closed:
            raise WorkerLost(f"{self.name}: the daemon is stopping")
        try:
            pool = self._executor()
            fut = pool.submit(fn, *args)
        except (BrokenProcessPool, RuntimeError):  # broken meanwhile: start afresh once
            self._replace(self._pool)
            pool = self._executor()
            fut = pool.submit(fn, *args)
        timer = None
        if budget_s:
            timer = asyncio.get_running_loop().call_later(budget_s, self._expire, pool, fut,
                                                          budget_s)
        try:
            return await asyncio.wrap_future(fut)
        except BrokenProcessPool:
            if fut in self._expired:
                raise BudgetExceeded(f"{self.name}: stopped after its budget of {budget_s:g} s") \
                    from None
            self._replace(pool)
            raise WorkerLost(f"{self.name}: the worker process stopped; retry") from None
        finally:
            if timer is not None:
                timer.cancel()
            self._expired.discard(fut)

    def _expire(self, pool: concurrent.futures.ProcessPoolExecutor,
                fut: concurrent.futures.Future, budget_s: float) -> None:
        if fut.done():
            return
        log.warning("%s: past its budget of %g s; stopping the worker process", self.name,
                    budget_s)
        self._expired.add(fut)
        self._replace(pool)

    def _replace(self, pool: concurrent.futures.ProcessPoolExecutor | None) -> None:
        if pool is None:
            return
        if self._pool is pool:
            self._pool = None
            self.generation += 1
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self.closed = True
        self._replace(self._pool)
