"""Bodies of the Compare and Watch RPCs (wired into `auditor.daemon.server.AuditorService`).

    async def Compare(self, request, context):
        return await rpc_compare.compare(self, request, context)

    async def Watch(self, request, context):
        async for event in rpc_compare.watch(self, request, context):
            yield event

Both validate first (run names, policy text, intervals) and raise `ValidationError`s naming the
field, which the server's `_rpc` decorator maps to INVALID_ARGUMENT; an unknown run is
NOT_FOUND. A comparison runs in a worker process (`CompareWorkers`): it never holds the daemon's
GIL, its threads or its memory, so it cannot delay an Ingest ack, and a comparison past its time
budget is killed and answered DEADLINE_EXCEEDED. Every live comparison (Watch) sits in one watch
worker process. Both are capped by `admission`; the engine never loads in the daemon itself.
Replies cross from the workers already serialized, a Watch's in chunks, and the daemon sends
those bytes as they are (`server._serializer`): a report of tens of MB never becomes a message
on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from numaudit.auditor.compare.policy.load import Policy, PolicyError, resolve_policy
from numaudit.auditor.daemon.admission import Admission, ServerLimits
from numaudit.auditor.daemon.auth import Unauthenticated, bearer_token
from numaudit.auditor.daemon.validate import ValidationError, check_run_name
from numaudit.auditor.daemon.workers import BudgetExceeded, WorkerLost, Workers
from numaudit.auditor.store import Reader, StoreError
from numaudit.auditor.store.location import store_location
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits

log = logging.getLogger(__name__)

RESPONSE_BUDGET_BYTES = limits.MAX_MESSAGE_BYTES - (1 << 20)
"""Largest report_json the Compare RPC returns; bigger reports drop identical findings first,
then passing ones (the JSON says which, in `findings_included`)."""
DEFAULT_POLL_S = 1.0
"""Watch: how often the store is re-read when the request leaves it to the server."""
MIN_POLL_S = 0.05
MAX_WAIT_S = 24 * 3600.0


# Kept for callers that catch the old names.
CompareTimeout = BudgetExceeded


def _db_path(service: Any) -> Path | str:
    return store_location(service._db_path)  # a SQLite path or a postgresql:// URL


def _admission(service: Any) -> Admission:
    adm = getattr(service, "_admission", None)
    if adm is None:
        adm = service._admission = Admission(ServerLimits())
    return adm


def _workers(service: Any, kind: str) -> Workers:
    """The service's worker pool for "compare" or "watch" (created on first use)."""
    attr = f"_{kind}_workers"
    w = getattr(service, attr, None)
    if w is None:
        n = _admission(service).limits.compare_processes if kind == "compare" else 1
        w = Workers(kind.capitalize(), n)
        setattr(service, attr, w)
    return w


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


def report_json_within(report: Any, budget: int = RESPONSE_BUDGET_BYTES) -> str:
    """The JSON report, dropping identical then passing findings until it fits ``budget``."""
    from numaudit.auditor.report.json_report import to_json

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


def _compare(db: Path, ref: str, cand: str, policy_toml: str,
             preset: str) -> tuple[bytes, int, int]:
    """Runs in a worker process: the policy travels as text (compiled patterns do not pickle).

    Returns the CompareResponse already serialized (with the exit code and the report's size,
    for the log): the daemon hands those bytes to gRPC as they are. A report runs to tens of
    MB (37 MB for 50,000 keys per run with identical findings); built into a message and
    serialized in the daemon, it held the daemon's GIL and event loop for about 60 ms per
    compare, and Ingest acks waited behind it."""
    from numaudit.auditor.compare.engine import compare_runs
    from numaudit.auditor.compare.read.columns import KeyRangeError

    policy = resolve_policy(policy_toml, preset, source="policy_toml")
    reader = Reader(db)
    try:
        report = compare_runs(reader, ref, cand, policy)
    except KeyRangeError as exc:
        raise StoreError(str(exc)) from None
    finally:
        reader.close()
    text = report_json_within(report)
    reply = pb.CompareResponse(report_json=text, exit_code=report.exit_code)
    return reply.SerializeToString(), report.exit_code, len(text)


async def compare(service: Any, request: pb.CompareRequest, context: Any = None) -> bytes:
    """Compare two stored runs; the serialized CompareResponse (the JSON report, and the exit
    code: 0 within policy, 1 not), which the server's response serializer passes through."""
    request_policy(request)  # refuse a bad policy here, with the field named
    started = time.monotonic()
    adm = _admission(service)
    with adm.compare():
        reply, code, size = await _workers(service, "compare").run(
            adm.limits.compare_budget_s, _compare, _db_path(service), request.ref, request.cand,
            request.policy_toml, request.preset)
    log.info("compare %s vs %s: exit %d, %d bytes in %.2fs", request.ref, request.cand, code,
             size, time.monotonic() - started)
    return reply


# -- Watch: every live comparison of the daemon sits in one worker process ---------------------
# (LiveComparison keeps state between polls, so its polls must reach the same process.)

WATCH_EVENTS_PER_CALL = 2048
"""Most events one call to the watch worker returns. The first poll of a watch on stored runs
finds every key at once (100,000 events for two runs of 50,000 keys): returned in one piece,
their unpickling held the daemon's GIL for 40-60 ms, and Ingest acks waited behind it."""

_LIVE: dict[int, tuple[Reader, Any, list[bytes], list[bool]]] = {}
_watch_ids = itertools.count(1)


def _event_bytes(ev: Any) -> tuple[bytes, bool]:
    """A live comparison's event as a serialized WatchEvent, and whether it is a finding."""
    if ev.finding is None:
        extra = ev.drill or ev.directive
        return pb.WatchEvent(status=ev.status, drill_json=json.dumps(
            {"drill": ev.drill} if ev.drill else {"directive": ev.directive}, allow_nan=False)
            if extra else "").SerializeToString(), False
    return pb.WatchEvent(finding_json=json.dumps(ev.finding.as_dict(), allow_nan=False),
                         first_divergence=ev.first_divergence).SerializeToString(), True


def _live_open(key: int, db: Path, ref: str, cand: str, policy_toml: str, preset: str,
               escalate: bool = False) -> None:
    """In the watch worker."""
    from numaudit.auditor.compare.live import LiveComparison
    from numaudit.auditor.compare.read.columns import KeyRangeError

    policy = resolve_policy(policy_toml, preset, source="policy_toml")
    reader = Reader(db)
    try:
        live = LiveComparison(reader, ref, cand, policy, escalate=escalate)
    except KeyRangeError as exc:
        reader.close()
        raise StoreError(str(exc)) from None
    except BaseException:
        reader.close()
        raise
    _LIVE[key] = (reader, live, [], [])


def _live_poll(key: int, flush: bool,
               limit: int) -> tuple[list[bytes], int, bool, int, int, list[dict]]:
    """In the watch worker: ``(events, findings among them, finished, emitted, events left,
    directives to send)`` (directives: `watch --escalate`, auditor.compare.ops.escalation).

    Events a poll (or the final flush) found are handed out ``limit`` at a time;
    the store is read again only once they are all out. Each event is a serialized WatchEvent,
    which the daemon sends as it is."""
    from numaudit.auditor.compare.read.columns import KeyRangeError

    if key not in _LIVE:
        raise WorkerLost("Watch: the watch worker was restarted; watch again")
    _, live, pending, is_finding = _LIVE[key]
    directives = []
    if not pending:
        try:
            events = live.flush() if flush else live.poll()
        except KeyRangeError as exc:
            raise StoreError(str(exc)) from None
        directives = [ev.directive for ev in events if ev.directive]
        for ev in events:
            data, finding = _event_bytes(ev)
            pending.append(data)
            is_finding.append(finding)
    out, findings = pending[:limit], sum(is_finding[:limit])
    del pending[:limit], is_finding[:limit]
    return out, findings, live.finished, live.emitted, len(pending), directives


def _live_close(key: int) -> None:
    entry = _LIVE.pop(key, None)
    if entry is not None:
        entry[0].close()


async def watch(service: Any, request: pb.WatchRequest,
                context: Any = None) -> AsyncIterator[pb.WatchEvent | bytes]:
    """Stream findings while the runs are written; ends when both are finished or on timeout.
    Events come serialized from the watch worker (bytes), statuses of the daemon's own as
    messages."""
    with _admission(service).watch(caller_of(context)):
        async for event in _watch(service, request):
            yield event


async def _watch(service: Any,
                 request: pb.WatchRequest) -> AsyncIterator[pb.WatchEvent | bytes]:
    request_policy(request)
    for name in ("poll_interval_s", "timeout_s"):
        v = getattr(request, name)
        if not (v >= 0 and v < MAX_WAIT_S):  # also refuses NaN
            raise ValidationError(name, f"{v} is not in [0, {MAX_WAIT_S:.0f}) seconds")
    poll = max(MIN_POLL_S, request.poll_interval_s or DEFAULT_POLL_S)
    stopping = getattr(service, "_stopping", None)
    workers = _workers(service, "watch")
    key = next(_watch_ids)
    generation = workers.generation
    await workers.run(None, _live_open, key, _db_path(service), request.ref, request.cand,
                      request.policy_toml, request.preset, request.escalate)
    board = getattr(service, "directives", None) if request.escalate else None
    if board is not None:
        board.arm()
    try:
        yield pb.WatchEvent(status=f"watching {request.ref} vs {request.cand}"
                                   + (" (escalating)" if board is not None else ""))
        last_news = time.monotonic()
        while True:
            started = time.monotonic()
            left = 1
            while left:  # a poll's events, a chunk per call
                events, findings, finished, emitted, left, directives = await workers.run(
                    None, _live_poll, key, False, WATCH_EVENTS_PER_CALL)
                for ev in events:
                    yield ev
                for ev in _post(board, request, directives):
                    yield ev
                if findings:
                    last_news = time.monotonic()
            timed_out = request.timeout_s and time.monotonic() - last_news > request.timeout_s
            if finished or timed_out:
                flush = True
                while flush or left:  # the final flush's events, a chunk per call
                    events, _, _, emitted, left, _ = await workers.run(
                        None, _live_poll, key, flush, WATCH_EVENTS_PER_CALL)
                    flush = False
                    for ev in events:
                        yield ev
                yield pb.WatchEvent(
                    status=f"done: both runs finished, {emitted} keys compared" if finished else
                    f"timed out: no new keys for {request.timeout_s:g}s, {emitted} keys compared")
                return
            if stopping is not None and stopping.is_set():
                yield pb.WatchEvent(status="auditor shutting down")
                return
            # a poll evaluates every pending key: never spend most of the time polling
            spent = time.monotonic() - started
            await asyncio.sleep(max(poll, 2 * spent))
    finally:
        if board is not None:
            board.disarm()
        if workers.generation == generation and not workers.closed:  # else its state is gone
            try:
                await asyncio.shield(workers.run(None, _live_close, key))
            except BaseException:  # the daemon stops meanwhile
                pass


def _post(board: Any, request: pb.WatchRequest, directives: list[dict]) -> list[pb.WatchEvent]:
    """Post an escalating watch's directives for both runs' agents on the daemon's board
    (auditor/daemon/directives.py); a status event says where each went, and plainly when a
    run's agents take none (a node sidecar relays no directive)."""
    out = []
    for d in directives if board is not None else ():
        sent = []
        for run in (request.ref, request.cand):
            posted = board.post(run, d["step"], d["ops"], d["payload"], d["reason"])
            takes, total = board.takers(run)
            plain = "" if takes or not total else (
                " (a node sidecar relays none, or the agents are of an earlier build or set "
                "NUMAUDIT_DIRECTIVES=0): escalation needs direct connections; drill with a "
                "rerun instead (`auditor drill`)")
            sent.append(f"{run}: directive {posted.id}, {takes} of {total} sessions take "
                        f"directives{plain}")
        log.info("watch %s vs %s: asked for the operations of %s at step %d (%s)",
                 request.ref, request.cand, ", ".join(d["ops"]), d["step"], "; ".join(sent))
        out.append(pb.WatchEvent(status=f"directives sent for step {d['step']} ("
                                        + "; ".join(sent) + ")",
                                 drill_json=json.dumps({"directive": d}, allow_nan=False)))
    return out
