"""The auditor daemon: the numaudit.v1.Auditor gRPC service on grpc.aio.

Every handler is wrapped by `_rpc`, the one place where exceptions become status codes
(`status_for`), so no input can produce INTERNAL or UNKNOWN. Requests are parsed by our own
deserializer: bytes that are not a valid message arrive as a `MalformedRequest` and are refused
with INVALID_ARGUMENT instead of gRPC's INTERNAL.

Ingest: each batch is validated whole (off the event loop), handed to the single store writer,
and acked only when the transaction holding it has committed. One stream is processed in order,
one batch at a time, so `acked_seq` never runs ahead of a batch that failed.

Isolation: the event loop and the validation threads serve ingest only; DescribeRun, ListRuns,
Compare and Watch run in spawned worker processes, and what a client may make the daemon hold
(streams, watches, comparisons, bytes in flight) is capped by `admission.ServerLimits`.

Access control (`tokens`) is an interceptor (auditor/daemon/auth.py) whose refusals go through the
same `status_for`; TLS and mutual TLS come from `ServerTLS` (wire/tls.py).

Directives (`auditor watch --escalate`, docs/drill-down.md) ride on Ingest's Acks: the watch
posts them on the service's `DirectiveBoard`, and each stream sends its session's run's
directives on its next Ack, or on an Ack of their own while it waits (auditor/daemon/directives.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypedDict

import grpc
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from numaudit.auditor.daemon import reads
from numaudit.auditor.daemon.admission import (
    MEMORY_PER_WIRE_BYTE,
    Admission,
    IdleStream,
    ServerLimits,
    TooBusy,
)
from numaudit.auditor.daemon.auth import (
    AuthInterceptor,
    PermissionDenied,
    Unauthenticated,
    check_escalate,
    check_rename,
    current_grant,
)
from numaudit.auditor.daemon.directives import DirectiveBoard, StreamDirectives
from numaudit.auditor.daemon.ingest_wait import next_batch
from numaudit.auditor.daemon.metrics import DaemonMetrics
from numaudit.auditor.daemon.parsing import (  # noqa: F401 (MalformedRequest, CorruptBatch re-exported)
    CorruptBatch,
    MalformedRequest,
    _lenient_parser,
    _parsed,
    _parsed_stream,
    _serializer,
)
from numaudit.auditor.daemon.receive_slots import ReceiveSlots, StreamSlot
from numaudit.auditor.daemon.reflection import enable_reflection
from numaudit.auditor.daemon.tokens import Tokens
from numaudit.auditor.daemon.validate import (
    ValidationError,
    validate_batch,
    validate_close,
    validate_describe,
    validate_register,
)
from numaudit.auditor.daemon.workers import BudgetExceeded, WorkerLost, Workers
from numaudit.auditor.store import Reader, RunNameTaken, Store, StoreError, UnknownRun
from numaudit.auditor.store.backend import describe, open_writer, store_location
from numaudit.auditor.store.files import readable_by_others
from numaudit.auditor.store.location import is_postgres_url
from numaudit.auditor.store.writer import StoreWriter, WriterClosed
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from numaudit.wire.content_hash import content_hashes
from numaudit.wire.packed import RecordColumns
from numaudit.wire.tls import ServerTLS

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Auditor"].full_name  # "numaudit.v1.Auditor"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}


# -- Errors and their status codes -------------------------------------------------------------

class Unimplemented(Exception):
    """An RPC this build does not provide (UNIMPLEMENTED)."""


class ShuttingDown(Exception):
    """The daemon is stopping; the agent should reconnect and resend (UNAVAILABLE)."""


_KIND_STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "version": grpc.StatusCode.FAILED_PRECONDITION,
    "corrupt": grpc.StatusCode.DATA_LOSS,
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "transit": grpc.StatusCode.ABORTED,
}


def status_for(exc: BaseException, method: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and details a handler answers for an exception. The only such mapping."""
    if isinstance(exc, ValidationError):
        return _KIND_STATUS[exc.kind], str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, UnknownRun):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, RunNameTaken):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, StoreError):  # unknown session, or contradicts what is stored
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, Unimplemented):
        return grpc.StatusCode.UNIMPLEMENTED, str(exc)
    if isinstance(exc, ShuttingDown):
        return grpc.StatusCode.UNAVAILABLE, "auditor: shutting down; reconnect and resend"
    if isinstance(exc, TooBusy):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, limits.BUSY_PREFIX + str(exc)
    if isinstance(exc, IdleStream):
        return grpc.StatusCode.UNAVAILABLE, limits.ENDED_PREFIX + str(exc)
    if isinstance(exc, BudgetExceeded):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, WorkerLost):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, (sqlite3.Error, OSError, WriterClosed)):
        log.error("%s: store error: %s: %s", method, type(exc).__name__, exc)
        return grpc.StatusCode.UNAVAILABLE, f"store: {type(exc).__name__}: {exc}; retry later"
    # A bug. Answer UNAVAILABLE (never INTERNAL/UNKNOWN) and leave the traceback in the log.
    log.error("%s: unexpected error", method, exc_info=exc)
    return (grpc.StatusCode.UNAVAILABLE,
            f"auditor: unexpected {type(exc).__name__} (logged); retry later")


def _rpc(kind: str) -> Callable:
    """Wraps a handler: parses requests, and maps every exception through `status_for`."""

    def decorate(fn: Callable) -> Callable:
        method = f"{SERVICE_NAME}/{fn.__name__}"

        async def abort(context: grpc.aio.ServicerContext, exc: Exception, self: Any) -> None:
            code, details = status_for(exc, method)
            self.metrics.refused(fn.__name__, code.name, exc)
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED):
                log.info("%s refused: %s %s", method, code.name, details)
            await context.abort(code, details)

        if kind == "unary_unary":
            @functools.wraps(fn)
            async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await fn(self, _parsed(request), context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await abort(context, exc, self)
            return unary

        @functools.wraps(fn)
        async def streaming(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                request = _parsed_stream(request) if kind == "stream_stream" else _parsed(request)
                async for response in fn(self, request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort(context, exc, self)
        return streaming

    return decorate


# -- The service ---------------------------------------------------------------------------------

def _validate_and_hash(batch: pb.RecordBatch) -> tuple[RecordColumns, list[bytes]]:
    """The batch's records as columns (packed and per record), validated, and their hashes."""
    cols = validate_batch(batch)
    return cols, content_hashes(cols)


class AuditorService(numaudit_pb2_grpc.AuditorServicer):
    """numaudit.v1.Auditor over one store. Register it with `add_auditor_service`."""

    def __init__(self, writer: StoreWriter, db_path: str | Path,
                 pool: concurrent.futures.Executor, *,
                 limits: ServerLimits | None = None, metrics: DaemonMetrics | None = None) -> None:
        """`pool` validates batches (the ingest path only); reads, watches and comparisons run
        in worker processes (`auditor.daemon.workers`), so that they can never delay an ack."""
        self._writer = writer
        self._db_path = store_location(db_path)  # a SQLite path or a postgresql:// URL
        self._pool = pool
        self._limits = limits or ServerLimits()
        self._admission = Admission(self._limits)
        self.metrics = metrics or DaemonMetrics()
        self._slots = ReceiveSlots.for_budget(self._limits.max_inflight_bytes,
                                              lambda: self._admission.inflight_bytes,
                                              per_byte=MEMORY_PER_WIRE_BYTE,
                                              on_evict=self.metrics.evictions.inc)
        self._admission.on_freed = self._slots.budget_freed
        self._admission.make_room = self._slots.make_room  # at the stream cap: a silent stream
        self.metrics.watch_admission(self._admission, self._slots)
        self._read_workers = Workers("Read", self._limits.read_processes)
        self._stopping = asyncio.Event()
        self.directives = DirectiveBoard()
        """Directives `watch --escalate` posts for the agents, sent on their Ingest streams."""

    def close(self) -> None:
        """Stops the worker processes of reads, watches and comparisons."""
        for kind in ("read", "compare", "watch"):
            workers = getattr(self, f"_{kind}_workers", None)
            if workers is not None:
                workers.close()

    def begin_shutdown(self) -> None:
        """Ingest streams end (UNAVAILABLE) after the batch they are committing."""
        self._stopping.set()

    async def _offload(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _commit(self, work: Callable[[Store], Any]) -> Any:
        """Runs `work` in the writer's next transaction; returns once it has committed."""
        return await asyncio.wrap_future(self._writer.submit(work))

    async def _read(self, fn: Callable[[Reader], Any]) -> Any:
        """`fn(reader)` on the validation threads: only for the ingest path's own one-row
        lookups (the auth check of an Ingest stream's session). Client reads run in the read
        worker processes (`_read_workers`), never here."""
        def run() -> Any:
            reader = Reader(self._db_path)
            try:
                return fn(reader)
            finally:
                reader.close()
        return await self._offload(run)

    async def _next_or_stop(self, batches: AsyncIterator[pb.RecordBatch],
                            slot: StreamSlot) -> pb.RecordBatch:
        return await next_batch(batches, slot, self._slots, self._stopping,
                                self._limits.idle_stream_s, ShuttingDown)

    @_rpc("unary_unary")
    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        validate_register(request)
        grant = current_grant()

        def register(store: Store) -> tuple[int, str]:
            acked, run = store.register_session(request)
            if run != request.run:  # renamed: the scope decides on the name written; raising
                check_rename(grant, request.run, run)  # here rolls the registration back
            return acked, run

        acked, run = await self._commit(register)
        self.directives.note_register(run, request.session_id, request.takes_directives)
        log.info("registered run=%s rank=%d/%d session=%s job=%s acked_seq=%d%s", run,
                 request.rank, request.world_size, request.session_id, request.job_id, acked,
                 f" (renamed from {request.run}: the name belongs to another job)"
                 if run != request.run else "")
        return pb.RegisterResponse(session_id=request.session_id, acked_seq=acked, run=run,
                                   packed_batches=True, packed_payloads=True)

    @_rpc("stream_stream")
    async def Ingest(self, request_iterator: AsyncIterator[pb.RecordBatch],
                     context: Any) -> AsyncIterator[pb.Ack]:
        slot = StreamSlot()
        with self._admission.ingest_stream(), self._slots.open(slot):
            directives = StreamDirectives(self.directives, self._session_run)
            while True:
                try:
                    if directives.listening():  # an escalating watch runs: directives too
                        nxt = asyncio.ensure_future(self._next_or_stop(request_iterator, slot))
                        async for ack in directives.while_waiting(nxt):
                            yield ack
                        batch = nxt.result()
                    else:
                        batch = await self._next_or_stop(request_iterator, slot)
                except StopAsyncIteration:
                    return
                t0, nbytes = time.monotonic(), batch.ByteSize()
                async with self._admission.bytes_in_flight(nbytes):
                    self._slots.release(slot)
                    cols, hashes = await self._offload(_validate_and_hash, batch)
                    session, seq = batch.session_id, batch.seq
                    # the defaults bind this batch's values; mypy cannot infer such a lambda
                    result = await self._commit(
                        lambda store, c=cols, h=hashes, s=session, q=seq:  # type: ignore[misc]
                            store.ingest_columns(s, q, c, h))
                    del batch, cols, hashes  # not held while the stream waits for the next one
                log.debug("session=%s seq=%d stored=%d duplicates=%d conflicts=%d", session, seq,
                          result.stored, result.duplicates, result.conflicts)
                self.metrics.acked(nbytes, result.stored, result.duplicates, result.conflicts,
                                   time.monotonic() - t0)
                ack = pb.Ack(session_id=session, acked_seq=result.acked_seq,
                             stored=result.stored, duplicates=result.duplicates,
                             conflicts=result.conflicts)
                await directives.on_ack(ack)
                yield ack

    @_rpc("unary_unary")
    async def CloseSession(self, request: pb.CloseSessionRequest,
                           context: Any) -> pb.CloseSessionResponse:
        validate_close(request)
        stored = await self._commit(lambda store: store.close_session(request))
        log.info("closed session=%s sent=%d dropped=%d stored=%d", request.session_id,
                 request.records_sent, request.records_dropped, stored)
        self.metrics.dropped.inc(request.records_dropped)
        return pb.CloseSessionResponse(records_stored=stored)

    @_rpc("unary_unary")
    async def ListRuns(self, request: pb.ListRunsRequest, context: Any) -> pb.ListRunsResponse:
        return await self._read_workers.run(None, reads.list_runs, self._db_path)

    @_rpc("unary_unary")
    async def DescribeRun(self, request: pb.DescribeRunRequest,
                          context: Any) -> pb.DescribeRunResponse:
        validate_describe(request)
        return await self._read_workers.run(None, reads.describe_run, self._db_path, request.run)

    # The comparison engine wires these two; the decorator already maps its errors.
    @_rpc("unary_unary")
    async def Compare(self, request: pb.CompareRequest, context: Any) -> bytes:
        from numaudit.auditor.daemon import (
            compare_service as rpc_compare,  # numpy and the engine load on the first compare
        )

        with self.metrics.compare_seconds.time():
            return await rpc_compare.compare(self, request, context)

    async def _session_run(self, session_id: str) -> str:
        return await self._read(lambda reader: reader.session_run(session_id))

    @_rpc("unary_stream")
    async def Watch(self, request: pb.WatchRequest,
                    context: Any) -> AsyncIterator[pb.WatchEvent | bytes]:
        from numaudit.auditor.daemon import compare_service as rpc_compare

        if request.escalate:  # only a token with the escalate scope on both runs
            check_escalate(current_grant(), request.ref, request.cand)

        async for event in rpc_compare.watch(self, request, context):
            yield event


def add_auditor_service(service: AuditorService, server: grpc.aio.Server) -> None:
    """Like the generated add_AuditorServicer_to_server, but with our lenient deserializers.

    The handlers are derived from the service in the proto (one source of truth): every method
    is served by the servicer method of the same name.
    """
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Auditor"].methods:
        make = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=_lenient_parser(GetMessageClass(method.input_type)),
            response_serializer=_serializer(GetMessageClass(method.output_type)))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# -- Running it ------------------------------------------------------------------------------------

def _check_synchronous(synchronous: str) -> str:
    level = synchronous.upper()
    if level not in ("FULL", "NORMAL", "EXTRA"):
        raise ValueError(f"synchronous: {synchronous!r} is not one of FULL, NORMAL, EXTRA")
    return level


@contextlib.asynccontextmanager
async def serve(listen: str = limits.DEFAULT_LISTEN, db_path: str | Path = "numaudit.db", *,
                synchronous: str = "FULL", grace: float = limits.SHUTDOWN_GRACE_S,
                tokens: Tokens | None = None, tls: ServerTLS | None = None,
                server_limits: ServerLimits | None = None, metrics: DaemonMetrics | None = None,
                metrics_listen: str | None = None) -> AsyncIterator[str]:
    """Runs the daemon while the block runs; yields the bound address ("HOST:PORT", or
    `listen` itself for a unix socket, ``unix:/PATH``).
    With `metrics_listen` the metrics (`metrics`, or its own) are served over HTTP there and
    `metrics.address` is the bound address (docs/metrics.md).

    `listen` may use port 0 (the yielded address has the real port). With `tokens` every Auditor
    call needs a token of the file with the right scope (health and reflection stay open); with
    `tls` the port serves TLS (mutual TLS when it names a client CA). On exit the server stops
    accepting, Ingest streams end after the batch they are committing, in-flight calls get
    `grace` seconds, then the writer commits what is queued and closes the store.
    """
    level = _check_synchronous(synchronous)
    host = listen.rsplit(":", 1)[0]
    credentials = tls.credentials() if tls is not None else None  # TLSError before anything starts
    writer = await asyncio.to_thread(open_writer, db_path, synchronous=level)
    if tokens is not None and not is_postgres_url(db_path) and readable_by_others(db_path):
        log.warning("the store %s can be read by other users of this machine: tokens guard "
                    "the daemon's port, not the file; chmod 600 it (new stores are created "
                    "0600)", db_path)
    pool = concurrent.futures.ThreadPoolExecutor(limits.VALIDATION_THREADS,
                                                 thread_name_prefix="numaudit-validate")
    service = AuditorService(writer, db_path, pool, limits=server_limits, metrics=metrics)
    interceptors = []
    if tokens is not None:
        async def session_run(session_id: str) -> str:
            return await service._read(lambda reader: reader.session_run(session_id))
        interceptors.append(AuthInterceptor(tokens, service=SERVICE_NAME, session_run=session_run,
                                            status_for=status_for,
                                            refused=service.metrics.refused))
    server = grpc.aio.server(options=limits.server_options(), interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    started = False
    try:
        add_auditor_service(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)  # v1 and v1alpha
        if credentials is not None:
            try:
                port = server.add_secure_port(listen, credentials)
            except RuntimeError as exc:  # gRPC says only "Failed to bind" for a bad key too
                assert tls is not None  # the credentials are made from it
                raise RuntimeError(f"{exc} (is the address free, and is {tls.key} the key of "
                                   f"{tls.cert}?)") from None
        else:
            port = server.add_insecure_port(listen)
        await server.start()
        started = True
        unix = listen.startswith("unix:")
        address = listen if unix else f"{host}:{port}"
        access = (f"tokens from {tokens.source} ({len(tokens)} entries)" if tokens is not None
                  else "open: no tokens")
        if tls is not None:
            log.info("listening on %s (%s) access=%s db=%s synchronous=%s", address,
                     "mutual TLS: client certificates required" if tls.mutual else "TLS",
                     access, describe(db_path), level)
        elif host in _LOOPBACK_HOSTS or unix:
            log.info("listening on %s (plaintext, %s) access=%s db=%s synchronous=%s", address,
                     "a unix socket: its file's permissions decide who connects" if unix
                     else "loopback only", access, describe(db_path), level)
        else:
            log.warning("listening on %s in PLAINTEXT (no TLS) on a non-loopback address%s; "
                        "access=%s db=%s synchronous=%s", address,
                        ": tokens cross the network in clear" if tokens is not None else "",
                        access, describe(db_path), level)
        if metrics_listen:
            service.metrics.serve_http(metrics_listen)
        yield address
    finally:
        log.info("stopping: no new calls, %.1f s grace for in-flight ones", grace)
        service.begin_shutdown()
        if started:
            await health_servicer.enter_graceful_shutdown()
        await server.stop(grace)
        await asyncio.to_thread(writer.close)
        service.close()
        service.metrics.close()
        pool.shutdown(wait=True)
        log.info("stopped; store flushed and closed")


class _ServeOptions(TypedDict):
    """`serve`'s keyword arguments, as a `BackgroundServer` keeps them."""

    synchronous: str
    grace: float
    tokens: Tokens | None
    tls: ServerTLS | None
    server_limits: ServerLimits | None
    metrics: DaemonMetrics | None
    metrics_listen: str | None


class BackgroundServer:
    """`serve` on its own event loop in a thread, for synchronous code (tests, scripts).

    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db") as srv:
        channel = grpc.insecure_channel(srv.address)
    """

    def __init__(self, listen: str = "127.0.0.1:0", db_path: str | Path = "numaudit.db", *,
                 synchronous: str = "FULL", grace: float = limits.SHUTDOWN_GRACE_S,
                 tokens: Tokens | None = None, tls: ServerTLS | None = None,
                 server_limits: ServerLimits | None = None,
                 metrics: DaemonMetrics | None = None, metrics_listen: str | None = None) -> None:
        self.listen, self.db_path = listen, store_location(db_path)
        self._kwargs = _ServeOptions(synchronous=synchronous, grace=grace, tokens=tokens,
                                     tls=tls, server_limits=server_limits, metrics=metrics,
                                     metrics_listen=metrics_listen)
        self.address = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="numaudit-auditor", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with serve(self.listen, self.db_path, **self._kwargs) as address:
                self.address = address
                self._ready.set()
                await self._stop.wait()
        try:
            asyncio.run(main())
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        if not self._ready.wait(timeout) or not self.address:
            raise RuntimeError(f"auditor did not start on {self.listen}: {self._error!r}")
        return self.address

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
