"""Bodies of the Compare and Watch RPCs (wired into `auditor.daemon.server.AuditorService`).

    async def Compare(self, request, context):
        return await rpc_compare.compare(self, request)

    async def Watch(self, request, context):
        async for event in rpc_compare.watch(self, request):
            yield event

Both validate first (run names, policy text, intervals) and raise `ValidationError`s naming the
field, which the server's `_rpc` decorator maps to INVALID_ARGUMENT; an unknown run is
NOT_FOUND. The comparison itself runs on its own thread pool so that a long compare never
occupies the threads that validate ingest batches.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
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
from auditor.daemon.validate import ValidationError, check_run_name
from protos import numaudit_pb2 as pb

log = logging.getLogger(__name__)

COMPARE_THREADS = 2
"""Comparisons and watches that read the store at the same time."""
RESPONSE_BUDGET_BYTES = limits.MAX_MESSAGE_BYTES - (1 << 20)
"""Largest report_json the Compare RPC returns; bigger reports drop identical findings first,
then passing ones (the JSON says which, in `findings_included`)."""
DEFAULT_POLL_S = 1.0
"""Watch: how often the store is re-read when the request leaves it to the server."""
MIN_POLL_S = 0.05
MAX_WAIT_S = 24 * 3600.0

_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(COMPARE_THREADS,
                                                      thread_name_prefix="numaudit-compare")
    return _pool


async def _run(fn: Callable, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)


def _db_path(service: Any) -> Path:
    return Path(service._db_path)


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


def _compare(db: Path, ref: str, cand: str, policy: Policy) -> tuple[str, int]:
    reader = Reader(db)
    try:
        report = compare_runs(reader, ref, cand, policy)
    except KeyRangeError as exc:
        raise StoreError(str(exc)) from None
    finally:
        reader.close()
    return report_json_within(report), report.exit_code


async def compare(service: Any, request: pb.CompareRequest) -> pb.CompareResponse:
    """Compare two stored runs; the JSON report and the exit code (0 within policy, 1 not)."""
    policy = request_policy(request)
    started = time.monotonic()
    text, code = await _run(_compare, _db_path(service), request.ref, request.cand, policy)
    log.info("compare %s vs %s: exit %d, %d bytes in %.2fs", request.ref, request.cand, code,
             len(text), time.monotonic() - started)
    return pb.CompareResponse(report_json=text, exit_code=code)


def to_event(ev: LiveEvent) -> pb.WatchEvent:
    if ev.finding is None:
        return pb.WatchEvent(status=ev.status)
    return pb.WatchEvent(finding_json=json.dumps(ev.finding.as_dict(), allow_nan=False),
                         first_divergence=ev.first_divergence)


async def watch(service: Any, request: pb.WatchRequest) -> AsyncIterator[pb.WatchEvent]:
    """Stream findings while the runs are written; ends when both are finished or on timeout."""
    policy = request_policy(request)
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
        _executor().submit(locked(reader.close))
