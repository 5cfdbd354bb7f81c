"""Bodies of the Compare and Watch RPCs (wired into `auditor.daemon.server.AuditorService`).

    async def Compare(self, request, context):
        return await rpc_compare.compare(self, request)

    async def Watch(self, request, context):
        async for event in rpc_compare.watch(self, request):
            yield event

Both validate first (run names, policy text, intervals) and raise `ValidationError`s naming the
field, which the server's `_rpc` decorator maps to INVALID_ARGUMENT; an unknown run is
NOT_FOUND. A comparison runs in a worker process (`CompareWorkers`): it never holds the daemon's
GIL, its threads or its memory, so it cannot delay an Ingest ack, and a comparison past its time
budget is killed and answered DEADLINE_EXCEEDED. Watch polls run on their own threads
(`watch_threads`), never on the validation threads. Both are capped by `admission`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import multiprocessing
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from wire import limits
from auditor.compare.columns import KeyRangeError
from auditor.compare.engine import compare_runs
from auditor.compare.live import LiveComparison, LiveEvent
from auditor.compare.policy import Policy, PolicyError, resolve_policy
from auditor.compare.result import Report
from auditor.report.json_report import to_json
from auditor.store import Reader, StoreError
from auditor.daemon.admission import Admission, ServerLimits
from auditor.daemon.auth import Unauthenticated, bearer_token
from auditor.daemon.validate import ValidationError, check_run_name
from protos import numaudit_pb2 as pb

log = logging.getLogger(__name__)

RESPONSE_BUDGET_BYTES = limits.MAX_MESSAGE_BYTES - (1 << 20)
"""Largest report_json the Compare RPC returns; bigger reports drop identical findings first,
then passing ones (the JSON says which, in `findings_included`)."""
DEFAULT_POLL_S = 1.0
"""Watch: how often the store is re-read when the request leaves it to the server."""
MIN_POLL_S = 0.05
MAX_WAIT_S = 24 * 3600.0


class CompareTimeout(Exception):
    """A comparison ran past its budget and was stopped (DEADLINE_EXCEEDED)."""


class WorkerLost(Exception):
    """The comparison's worker process died (UNAVAILABLE: retry)."""


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop


class CompareWorkers:
    """Comparisons in spawned worker processes, each bounded by a time budget.

    Spawned, not forked: the daemon holds gRPC state that a fork would copy (FIELD-NOTES). The
    pool starts on the first comparison (numpy and the engine load then, in the worker). A
    comparison past its budget cannot be interrupted inside the engine, so the pool's processes
    are killed and the pool replaced; other comparisons running in it end with `WorkerLost`.
    """

    def __init__(self, processes: int = 1) -> None:
        self._processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._expired: set[concurrent.futures.Future] = set()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._processes, mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init)
        return self._pool

    async def run(self, budget_s: float, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` in a worker; CompareTimeout after `budget_s` (enforced even when the
        caller goes away: a cancelled call does not leave a comparison running unbounded)."""
        pool = self._executor()
        fut = pool.submit(fn, *args)
        timer = asyncio.get_running_loop().call_later(budget_s, self._expire, pool, fut)
        try:
            return await asyncio.wrap_future(fut)
        except BrokenProcessPool:
            if fut in self._expired:
                raise CompareTimeout(f"Compare: stopped after its budget of {budget_s:g} s") \
                    from None
            raise WorkerLost("Compare: the comparison worker stopped; retry") from None
        finally:
            timer.cancel()
            self._expired.discard(fut)

    def _expire(self, pool: concurrent.futures.ProcessPoolExecutor,
                fut: concurrent.futures.Future) -> None:
        if fut.done():
            return
        log.warning("compare: past its budget; stopping the worker process")
        self._expired.add(fut)
        self._kill(pool)

    def _kill(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._kill(self._pool)


def _db_path(service: Any) -> Path:
    return Path(service._db_path)


def _admission(service: Any) -> Admission:
    adm = getattr(service, "_admission", None)
    if adm is None:
        adm = service._admission = Admission(ServerLimits())
    return adm


def _workers(service: Any) -> CompareWorkers:
    w = getattr(service, "_compare_workers", None)
    if w is None:
        w = service._compare_workers = CompareWorkers(_admission(service).limits.compare_processes)
    return w


def _watch_pool(service: Any) -> concurrent.futures.ThreadPoolExecutor:
    pool = getattr(service, "_watch_pool", None)
    if pool is None:
        pool = service._watch_pool = concurrent.futures.ThreadPoolExecutor(
            _admission(service).limits.watch_threads, thread_name_prefix="numaudit-watch")
    return pool


def caller_of(context: Any) -> str:
    """Who a call counts against for per-caller caps: its token (by digest), else its host."""
    if context is None:
        return ""
    try:
        return "token:" + hashlib.sha256(
            bearer_token(context.invocation_metadata()).encode()).hexdigest()[:16]
    except Unauthenticated:
        peer = context.peer() or ""
        return "peer:" + peer.rsplit(":", 1)[0]


def request_policy(request: pb.CompareRequest | pb.WatchRequest) -> Policy:
    """The policy a request names; ValidationError naming policy_toml or preset otherwise."""
    check_run_name(request.ref, "ref")
    check_run_name(request.cand, "cand")
    try:
        return resolve_policy(request.policy_toml, request.preset, source="policy_toml")
    except PolicyError as exc:
        text = str(exc)
        if text.startswith("policy_toml: "):
            raise ValidationError("policy_toml", text.removeprefix("policy_toml: ")) from None
        raise ValidationError("preset", text.removeprefix("preset: ")) from None


def report_json_within(report: Report, budget: int = RESPONSE_BUDGET_BYTES) -> str:
    """The JSON report, dropping identical then passing findings until it fits ``budget``."""
    text = to_json(report, include_identical=True) if len(report.comparison) < 200_000 else ""
    if text and len(text.encode()) <= budget:
        return text
    text = to_json(report, include_identical=False)
    if len(text.encode()) <= budget:
        return text
    doc = json.loads(text)
    doc["findings"] = [f for f in doc["findings"] if f["breach"]]
    doc["findings_included"] = "breaches"
    doc["findings_omitted"] = {k: v for k, v in doc["summary"]["verdicts"].items()
                               if k in ("identical", "close") and v}
    text = json.dumps(doc, allow_nan=False)
    while len(text.encode()) > budget and doc["findings"]:
        doc["findings"] = doc["findings"][: len(doc["findings"]) // 2]
        doc["findings_included"] = "first_breaches"
        text = json.dumps(doc, allow_nan=False)
    return text


def _compare(db: Path, ref: str, cand: str, policy_toml: str, preset: str) -> tuple[str, int]:
    """Runs in a worker process: the policy travels as text (compiled patterns do not pickle)."""
    policy = resolve_policy(policy_toml, preset, source="policy_toml")
    reader = Reader(db)
    try:
        report = compare_runs(reader, ref, cand, policy)
    except KeyRangeError as exc:
        raise StoreError(str(exc)) from None
    finally:
        reader.close()
    return report_json_within(report), report.exit_code


async def compare(service: Any, request: pb.CompareRequest,
                  context: Any = None) -> pb.CompareResponse:
    """Compare two stored runs; the JSON report and the exit code (0 within policy, 1 not)."""
    request_policy(request)  # refuse a bad policy here, with the field named
    started = time.monotonic()
    adm = _admission(service)
    with adm.compare():
        text, code = await _workers(service).run(
            adm.limits.compare_budget_s, _compare, _db_path(service), request.ref, request.cand,
            request.policy_toml, request.preset)
    log.info("compare %s vs %s: exit %d, %d bytes in %.2fs", request.ref, request.cand, code,
             len(text), time.monotonic() - started)
    return pb.CompareResponse(report_json=text, exit_code=code)


def to_event(ev: LiveEvent) -> pb.WatchEvent:
    if ev.finding is None:
        return pb.WatchEvent(status=ev.status)
    return pb.WatchEvent(finding_json=json.dumps(ev.finding.as_dict(), allow_nan=False),
                         first_divergence=ev.first_divergence)


async def watch(service: Any, request: pb.WatchRequest,
                context: Any = None) -> AsyncIterator[pb.WatchEvent]:
    """Stream findings while the runs are written; ends when both are finished or on timeout."""
    with _admission(service).watch(caller_of(context)):
        async for event in _watch(service, request):
            yield event


async def _watch(service: Any, request: pb.WatchRequest) -> AsyncIterator[pb.WatchEvent]:
    policy = request_policy(request)
    pool = _watch_pool(service)

    async def _run(fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    for name in ("poll_interval_s", "timeout_s"):
        v = getattr(request, name)
        if not (v >= 0 and v < MAX_WAIT_S):  # also refuses NaN
            raise ValidationError(name, f"{v} is not in [0, {MAX_WAIT_S:.0f}) seconds")
    poll = max(MIN_POLL_S, request.poll_interval_s or DEFAULT_POLL_S)
    stopping = getattr(service, "_stopping", None)
    lock = threading.Lock()  # the reader is used by one pool thread at a time, closed last

    def locked(fn: Callable) -> Callable:
        def run(*args: Any) -> Any:
            with lock:
                return fn(*args)
        return run

    reader = await _run(Reader, _db_path(service))
    try:
        live = await _run(locked(LiveComparison), reader, request.ref, request.cand, policy)
        yield pb.WatchEvent(status=f"watching {request.ref} vs {request.cand}")
        last_news = time.monotonic()
        while True:
            started = time.monotonic()
            try:
                events = await _run(locked(live.poll))
            except KeyRangeError as exc:
                raise StoreError(str(exc)) from None
            for ev in events:
                yield to_event(ev)
            if any(ev.finding is not None for ev in events):
                last_news = time.monotonic()
            if live.finished:
                for ev in await _run(locked(live.flush)):
                    yield to_event(ev)
                yield pb.WatchEvent(status=f"done: both runs finished, {live.emitted} findings")
                return
            if request.timeout_s and time.monotonic() - last_news > request.timeout_s:
                for ev in await _run(locked(live.flush)):
                    yield to_event(ev)
                yield pb.WatchEvent(status=f"timed out: no new keys for {request.timeout_s:g}s, "
                                           f"{live.emitted} findings")
                return
            if stopping is not None and stopping.is_set():
                yield pb.WatchEvent(status="auditor shutting down")
                return
            # a poll evaluates every pending key: never spend most of the time polling
            spent = time.monotonic() - started
            await asyncio.sleep(max(poll, 2 * spent))
    finally:
        pool.submit(locked(reader.close))
