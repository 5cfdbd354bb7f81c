"""The sender: a background thread that turns host batches into records and streams them.

It owns all network I/O of the agent. Records are cut into batches by count, size and age, given
consecutive sequence numbers, and kept until the auditor acks them (an ack names the highest
sequence durably stored). After any stream failure the sender reconnects with backoff, resumes
its session (the auditor says what it already stored) and resends everything unacked; the
auditor stores resends once. Past the memory budget new records are dropped and counted. Nothing
here raises into the training thread; `submit` never blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass

import grpc
import torch
import zstandard

from agents.capture import Capture, Counters, HostBatch
from agents.config import AgentConfig
from agents.digest import FINGERPRINT_SEED, SKETCH_SEED
from agents.identity import RankIdentity
from auditor import limits
from auditor.spool import SpoolWriter
from protos import numaudit_pb2 as pb
from protos import numaudit_pb2_grpc

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
# Reconnect backoff: the first retry comes quickly so an auditor restart is resumed within about
# a second; repeated failures back off to at most a second between attempts.
RECONNECT_BACKOFF_MIN_S = 0.05
RECONNECT_BACKOFF_MAX_S = 1.0
_EOF = object()
# Status codes after which the batch at the head of the queue was refused for its content:
# resending it cannot succeed, so it is dropped and counted, and the stream is reopened.
_REJECTED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
}
# Status codes after which sending is pointless for the rest of the job.
_FATAL = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.UNIMPLEMENTED}


@dataclass
class _Batch:
    seq: int
    message: pb.RecordBatch
    records: int
    nbytes: int


class _Stream:
    """One Ingest call: an outbox feeding the request iterator and a thread reading acks."""

    def __init__(self, stub, metadata) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()
        self.sent_upto = 0
        self.last_progress = time.monotonic()
        self.call = stub.Ingest(self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="numaudit-acks", daemon=True)
        self._reader.start()

    def _requests(self):
        while True:
            item = self.outbox.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for ack in self.call:
                self.acks.put(ack)
            self.acks.put(_EOF)
        except grpc.RpcError as exc:
            self.acks.put(exc)
        except Exception as exc:  # pragma: no cover - grpc internals
            self.acks.put(exc)

    def cancel(self) -> None:
        self.outbox.put(None)
        self.call.cancel()


class Sender:
    """Background delivery of one rank's records to the auditor."""

    def __init__(self, config: AgentConfig, ident: RankIdentity, counters: Counters) -> None:
        self.config = config
        self.ident = ident
        self.counters = counters
        self.session_id = uuid.uuid4().hex
        self._in: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued = 0
        self._pending: deque[_Batch] = deque()
        self._pending_bytes = 0
        self._next_seq = 1
        self._records: list[pb.Record] = []
        self._records_bytes = 0
        self._batch_started = 0.0
        self._closing = False
        self._deadline = float("inf")
        self._fatal: str | None = None
        self._channel = None
        self._stub = None
        self._stream: _Stream | None = None
        self._registered = False
        self._backoff = RECONNECT_BACKOFF_MIN_S
        self._next_attempt = 0.0
        self._zstd = zstandard.ZstdCompressor(level=1, write_content_size=True)
        self.sent = 0
        self.acked = 0
        self.spooled = 0
        self.reconnects = 0
        self._spool: SpoolWriter | None = None
        self._metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()
        self._thread = threading.Thread(target=self._run, name="numaudit-sender", daemon=True)
        self._thread.start()

    # -- training thread ----------------------------------------------------------------------

    def submit(self, batch: HostBatch) -> None:
        """Queue a host batch for sending; drops and counts it when the queue is full."""
        n = len(batch.captures)
        with self._lock:
            if self._closing or self._queued + n > self.config.queue_records:
                self.counters.drop("queue_full", n)
                return
            self._queued += n
        self._in.put_nowait(batch)

    def close(self, timeout: float) -> None:
        """Flush for at most `timeout` seconds (+1 s for the session close), then stop."""
        with self._lock:
            self._closing = True
        self._deadline = time.monotonic() + timeout
        self._in.put(None)
        self._thread.join(timeout + 1.0)
        if self._thread.is_alive():
            log.warning("rank %d: numaudit sender did not stop in time", self.ident.rank)

    # -- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # pragma: no cover - a bug; never into training
            log.exception("rank %d: numaudit sender failed: %r", self.ident.rank, exc)
        finally:
            self._finish()

    def _loop(self) -> None:
        draining = False
        while True:
            try:
                item = self._in.get(timeout=0.0 if draining else 0.01)
            except queue.Empty:
                item = _EOF
            if item is None:
                draining = True
            elif item is not _EOF:
                with self._lock:
                    self._queued -= len(item.captures)
                self._add(item)
            now = time.monotonic()
            if self._records and (draining or now - self._batch_started >= self.config.batch_interval_s):
                self._cut()
            if self.config.address and self._fatal is None:
                self._service_connection(now)
            if draining and self._in.empty():
                if not self._records and (not self._pending or not self._can_send()):
                    return
                if now >= self._deadline:
                    return
                time.sleep(0.002)

    def _can_send(self) -> bool:
        return bool(self.config.address) and self._fatal is None

    def _add(self, batch: HostBatch) -> None:
        try:
            batch.wait()
            f64 = batch.f64.tolist() if batch.f64 is not None else []
            i64 = batch.i64.tolist() if batch.i64 is not None else []
        except Exception as exc:
            self.counters.drop("transfer_error", len(batch.captures))
            log.warning("rank %d: numaudit host transfer failed: %r", self.ident.rank, exc)
            return
        for cap in batch.captures:
            try:
                records = self._build(cap, f64, i64)
            except Exception as exc:
                self.counters.drop("build_error", 1)
                log.debug("record build failed: %r", exc)
                continue
            if not self._records:
                self._batch_started = time.monotonic()
            for r in records:
                size = r.ByteSize()
                if self._records and self._records_bytes + size > limits.MAX_BATCH_PAYLOAD_BYTES:
                    self._cut()
                    self._batch_started = time.monotonic()
                self._records.append(r)
                self._records_bytes += size
            if len(self._records) >= min(self.config.batch_records, limits.MAX_BATCH_RECORDS):
                self._cut()

    def _build(self, cap: Capture, f64: list, i64: list) -> list[pb.Record]:
        r = pb.Record(stage=cap.stage, is_none=cap.is_none)
        k = r.key
        k.step, k.microbatch, k.phase, k.site = cap.step, cap.microbatch, cap.phase, cap.site
        k.role, k.index, k.call = cap.role, cap.index, cap.call
        if cap.is_none:
            return [r]
        lay = cap.layout
        r.layout.logical_shape.extend(lay.logical_shape)
        r.layout.offsets.extend(lay.offsets)
        r.layout.shape.extend(lay.shape)
        r.layout.replica, r.layout.partial = lay.replica, lay.partial
        r.layout.dtype, r.layout.complex_as_real = cap.dtype, cap.complex_as_real
        ints, floats = i64[cap.row], f64[cap.row]
        d = r.digest
        d.numel, d.nan_count, d.posinf_count, d.neginf_count, d.zero_count = ints[:5]
        d.fingerprint = ints[5] & _MASK64
        d.fingerprint_seed = FINGERPRINT_SEED
        d.has_moments = cap.moments
        if cap.moments:
            d.sum, d.sum_sq, d.min, d.max, d.abs_max = floats[:5]
            d.sketch.extend(floats[5:])
            d.sketch_seed = SKETCH_SEED
        if cap.payload is None:
            return [r]
        if cap.payload.numel() * cap.payload.element_size() > limits.MAX_PAYLOAD_RAW_BYTES:
            return [r]  # the digest still travels; only the bytes are left out
        return self._with_payload(r, cap)

    def _with_payload(self, r: pb.Record, cap: Capture) -> list[pb.Record]:
        raw = cap.payload.reshape(-1).view(torch.uint8).numpy().tobytes()
        data = self._zstd.compress(raw)
        chunk = limits.PAYLOAD_CHUNK_BYTES
        n = max(1, -(-len(data) // chunk))
        crc = zlib.crc32(data)
        out = []
        for i in range(n):
            piece = pb.Record()
            piece.CopyFrom(r)
            p = piece.payload
            p.codec, p.raw_nbytes, p.compressed_nbytes, p.crc32 = "zstd", len(raw), len(data), crc
            p.chunk_index, p.chunk_count = i, n
            p.data = data[i * chunk:(i + 1) * chunk]
            out.append(piece)
        return out

    def _cut(self) -> None:
        records, self._records, nbytes = self._records, [], self._records_bytes
        self._records_bytes = 0
        if not records:
            return
        msg = pb.RecordBatch(schema_version=pb.SCHEMA_VERSION_1, session_id=self.session_id,
                             seq=self._next_seq)
        msg.records.extend(records)
        if not self._can_send():
            if self._spool_write(msg):
                self._next_seq += 1
                self.sent += len(records)
                self.spooled += len(records)
            else:
                reason = "no_auditor" if not self.config.address else self._fatal
                self.counters.drop(reason, len(records))
            return
        if self._pending_bytes + nbytes > self.config.max_unacked_bytes:
            self.counters.drop("buffer_full", len(records))
            return
        if self.config.spool_mode == "always" and not self._spool_write(msg):
            self.counters.drop("spool_error", len(records))
            return
        self._pending.append(_Batch(self._next_seq, msg, len(records), nbytes))
        self._pending_bytes += nbytes
        self._next_seq += 1
        self.sent += len(records)

    # -- connection ---------------------------------------------------------------------------

    def _service_connection(self, now: float) -> None:
        if self._stream is None:
            # Lazy: the first batch (or close) opens the session, so that registration carries
            # what was set up after attach (pipeline stages) and idle ranks hold no connection.
            if not self._pending and not self._closing:
                return
            if now < self._next_attempt or now >= self._deadline:
                return
            try:
                self._connect()
            except grpc.RpcError as exc:
                self._connection_failed(exc, registering=True)
                return
        self._drain_acks()
        s = self._stream
        if s is None:
            return
        for b in self._pending:
            if b.seq > s.sent_upto:
                s.outbox.put(b.message)
                s.sent_upto = b.seq
        if self._pending and time.monotonic() - s.last_progress > self.config.ack_timeout_s:
            log.warning("rank %d: no ack from the auditor for %.1fs; reconnecting",
                        self.ident.rank, self.config.ack_timeout_s)
            self._drop_stream()
            self._next_attempt = time.monotonic()

    def _connect(self) -> None:
        self._register(max(0.05, min(self.config.connect_timeout_s,
                                     self._deadline - time.monotonic())))
        self._stream = _Stream(self._stub, self._metadata)
        self._backoff = RECONNECT_BACKOFF_MIN_S

    def _register(self, timeout: float) -> None:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.config.address,
                                                  options=limits.client_options())
            self._stub = numaudit_pb2_grpc.AuditorStub(self._channel)
        resp = self._stub.Register(self._register_request(), timeout=timeout,
                                   metadata=self._metadata, wait_for_ready=False)
        self._ack(resp.acked_seq)
        self._registered = True

    def _register_request(self) -> pb.RegisterRequest:
        i = self.ident
        req = pb.RegisterRequest(
            schema_version=pb.SCHEMA_VERSION_1, run=self.config.run, session_id=self.session_id,
            rank=i.rank, world_size=i.world_size, torch_version=i.torch_version,
            host=i.host, local_rank=i.local_rank, dtype=i.dtype, seed=i.seed,
        )
        req.mesh_shape.extend(i.mesh_shape)
        req.mesh_dim_names.extend(i.mesh_dim_names)
        req.mesh_coordinate.extend(i.mesh_coordinate)
        req.stages.extend(i.stages)
        req.labels.update(i.labels)
        return req

    def _drain_acks(self) -> None:
        s = self._stream
        while s is not None:
            try:
                item = s.acks.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, pb.Ack):
                s.last_progress = time.monotonic()
                self._ack(item.acked_seq)
                continue
            if item is _EOF:
                self._drop_stream()
            else:
                self._connection_failed(item)
            return

    def _ack(self, acked_seq: int) -> None:
        while self._pending and self._pending[0].seq <= acked_seq:
            b = self._pending.popleft()
            self._pending_bytes -= b.nbytes
            self.acked += b.records

    def _connection_failed(self, exc: Exception, registering: bool = False) -> None:
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        self._drop_stream()
        # A registration refused for what it says (schema version, world size, bad field) will
        # be refused again: give up rather than retry forever.
        if code in _FATAL or (registering and (code in _REJECTED
                                               or code == grpc.StatusCode.FAILED_PRECONDITION)):
            self._fatal = "refused"
            log.error("rank %d: the auditor refused this agent (%s: %s); records are dropped",
                      self.ident.rank, code.name, exc.details())
            while self._pending:
                self.counters.drop("refused", self._pending.popleft().records)
            self._pending_bytes = 0
            return
        if code in _REJECTED and self._pending and self._registered:
            bad = self._pending.popleft()
            self._pending_bytes -= bad.nbytes
            self.counters.drop("rejected", bad.records)
            log.warning("rank %d: the auditor rejected batch %d (%s: %s); dropped",
                        self.ident.rank, bad.seq, code.name, exc.details())
            self._next_attempt = time.monotonic()
            return
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            self._registered = False  # unknown session (a wiped store): register again
        self.reconnects += 1
        self._next_attempt = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RECONNECT_BACKOFF_MAX_S)
        log.debug("rank %d: auditor connection failed (%s); retrying", self.ident.rank, code)

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    def _finish(self) -> None:
        """Count what never got acked, tell the auditor the totals, close the channel."""
        self._cut()
        unacked = sum(b.records for b in self._pending)
        if unacked and self.config.spool_mode == "spill":
            if all(self._spool_write(b.message) for b in self._pending):
                self.spooled += unacked
                unacked = 0
        elif unacked and self.config.spool_mode == "always":
            self.spooled += unacked  # already written ahead
            unacked = 0
        self.counters.drop("unacked_at_close", unacked)
        while not self._in.empty():
            item = self._in.get_nowait()
            if item is not None:
                self.counters.drop("unsent_at_close", len(item.captures))
        self._drop_stream()
        if (self._can_send() and not self._registered and self.counters.snapshot()[0]
                and time.monotonic() < self._deadline):
            try:  # nothing was ever sent: register anyway so the drop counts reach the auditor
                self._register(max(0.05, min(1.0, self._deadline - time.monotonic())))
            except grpc.RpcError:
                pass
        if self._channel is not None and self._registered and self._fatal is None:
            captured, errors, dropped = self.counters.snapshot()
            req = pb.CloseSessionRequest(
                schema_version=pb.SCHEMA_VERSION_1, session_id=self.session_id,
                records_sent=captured, records_dropped=sum(dropped.values()),
                capture_errors=errors,
            )
            req.dropped_by_reason.update(dropped)
            self._spool_close(req)
            try:
                self._stub.CloseSession(req, timeout=0.9, metadata=self._metadata)
            except grpc.RpcError as exc:
                log.warning("rank %d: could not close the auditor session: %s",
                            self.ident.rank, exc.code().name)
        else:
            self._spool_close(None)
        if self._channel is not None:
            self._channel.close()

    # -- spool ----------------------------------------------------------------------------------

    def _spool_write(self, batch: pb.RecordBatch) -> bool:
        """Append a batch to this session's spool file (opened with its registration)."""
        if self.config.spool_mode == "off":
            return False
        try:
            if self._spool is None:
                self._spool = SpoolWriter(self.config.spool_dir, self.config.run or "unnamed",
                                          self.ident.rank, self.session_id)
                self._spool.append(self._register_request())
                log.info("rank %d: numaudit spooling to %s", self.ident.rank, self._spool.path)
            self._spool.append(batch)
            return True
        except OSError as exc:
            log.warning("rank %d: numaudit spool write failed: %r", self.ident.rank, exc)
            return False

    def _spool_close(self, req: pb.CloseSessionRequest | None) -> None:
        if self._spool is None:
            return
        try:
            if req is None:
                captured, errors, dropped = self.counters.snapshot()
                req = pb.CloseSessionRequest(
                    schema_version=pb.SCHEMA_VERSION_1, session_id=self.session_id,
                    records_sent=captured, records_dropped=sum(dropped.values()),
                    capture_errors=errors)
                req.dropped_by_reason.update(dropped)
            self._spool.append(req)
            self._spool.close()
        except OSError as exc:
            log.warning("rank %d: numaudit spool close failed: %r", self.ident.rank, exc)
