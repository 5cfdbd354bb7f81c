"""The sender: a background thread that turns host batches into records and delivers them.

It owns all I/O of the agent. A host batch becomes records as columns (`agents.delivery.columns`:
numpy over the digest rows, no protobuf message per record), sent as packed batches
(docs/protocol.md "Packed batches"); a peer that does not take them gets them per record
(`Delivery`). Records are cut into batches by count, size and age and given
consecutive sequence numbers; a `Delivery` (agents/delivery/delivery.py) streams them to the auditor
(or to the node sidecar) and keeps each until it is acked, resending after reconnects. Records that
cannot be delivered are written to the spool (wire/spool.py) for `auditor ingest`, or dropped
and counted. Nothing here raises into the training thread; `submit` never blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import deque
from typing import cast

from numaudit.agents.config import AgentConfig
from numaudit.agents.delivery.columns import Part, PayloadCompressor, part_columns, split_payloads
from numaudit.agents.delivery.delivery import RUN_NAME_TAKEN, Delivery
from numaudit.agents.delivery.transport import GrpcTransport, SidecarTransport
from numaudit.agents.digest.batching import Counters, HostBatch
from numaudit.agents.identity import RankIdentity
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from numaudit.wire.packed import RecordColumns, concat, empty
from numaudit.wire.sealed import sealed_batch
from numaudit.wire.spool import SpoolWriter
from numaudit.wire.tls import TLSConfig
from numaudit.wire.version import package_version

log = logging.getLogger(__name__)

SERVICE_INTERVAL_S = 0.01
"""How often the sender services a delivery that has batches in flight (acks, resends)."""


class Sender:
    """Background delivery of one rank's records (to the auditor, or the node sidecar)."""

    def __init__(self, config: AgentConfig, ident: RankIdentity, counters: Counters) -> None:
        self.config = config
        self.ident = ident
        self.counters = counters
        self.session_id = uuid.uuid4().hex
        self._in: queue.Queue = queue.Queue()
        self._lock = threading.RLock()  # re-entrant: close() may run in a SIGTERM handler
        self._queued = 0
        self._submitted = 0
        self._processed = 0
        """Host batches queued by submit, and those the loop has built into records."""
        self._cutting = False
        self._next_seq = 1
        self._pending: list[Part] = []
        """Records of the open batch: up to two parts per host batch (without and with
        payloads), built into columns when the batch is cut."""
        self._pending_n = 0
        self._records_bytes = 0
        self._batch_started = 0.0
        self._closing = False
        self._deadline = float("inf")
        self._compress = PayloadCompressor()
        self._spool: SpoolWriter | None = None
        self.sent = 0
        self.refused_warned = False
        self.spilled = 0
        """Records this rank wrote to its own spool file."""
        self.relay: dict | None = None
        """In sidecar mode, the sidecar's outcome of this session (SidecarTransport.outcome)."""
        self.delivery: Delivery | None = None
        self.directives: deque | None = None
        """Where directives of the auditor go (the op capture's inbox, set by the agent; a
        deque: the ack reader thread appends, the training thread takes them at step start).
        None: they are ignored (NUMAUDIT_DIRECTIVES=0)."""
        target = config.sidecar or config.address
        if target:
            transport = (SidecarTransport(config.sidecar) if config.sidecar
                         else GrpcTransport(target, config.token,  # target: the address
                                            TLSConfig.from_files(config.tls_ca, config.tls_cert,
                                                                 config.tls_key),
                                            on_directives=self._directed))
            fallback = {"spill": f"records are kept in memory (up to {config.max_unacked_bytes} "
                                 f"bytes) and spilled to {config.spool_dir} at close",
                        "always": f"records are written ahead to {config.spool_dir}",
                        "off": "records are kept in memory and dropped at close (spool_mode "
                               "off)"}[config.spool_mode]
            self.delivery = Delivery(
                transport, self._register_request, on_drop=counters.drop,
                connect_timeout_s=config.connect_timeout_s, ack_timeout_s=config.ack_timeout_s,
                max_unacked_bytes=config.max_unacked_bytes,
                name=f"rank {ident.rank}: numaudit {'sidecar' if config.sidecar else 'auditor'}",
                target=(f"the node sidecar at {config.sidecar}" if config.sidecar
                        else f"the auditor at {config.address}"),
                fallback=fallback,
                # a run name another job holds: the records go to the spool, for `auditor
                # ingest --run NEW` (nothing of this job is lost to a name clash)
                keep_refused=(frozenset() if config.sidecar or config.spool_mode == "off"
                              else frozenset({RUN_NAME_TAKEN})),
            )
        self._thread = threading.Thread(target=self._run, name="numaudit-sender", daemon=True)
        self._thread.start()

    @property
    def acked(self) -> int:
        """Records the auditor acked (in sidecar mode: as the sidecar reported at close)."""
        if self.delivery is None:
            return 0
        if self.config.sidecar:
            return int(self.relay["acked"]) if self.relay else 0
        return self.delivery.acked_records

    @property
    def held_by_sidecar(self) -> int:
        """Records durably in the sidecar's spool but not (yet) acked by the auditor."""
        if self.delivery is None or not self.config.sidecar:
            return 0
        if self.relay is None:  # the sidecar did not say: all it acked is in its spool
            return self.delivery.acked_records
        return int(self.relay["held"])

    @property
    def spooled(self) -> int:
        """Records in a spool instead of the store: this rank's own, and the sidecar's."""
        return self.spilled + self.held_by_sidecar

    @property
    def spool_path(self) -> str | None:
        if self.relay and self.relay.get("held"):
            return str(self.relay.get("spool"))
        return str(self._spool.path) if self._spool is not None else None

    @property
    def reconnects(self) -> int:
        return self.delivery.reconnects if self.delivery else 0

    @property
    def conflicts(self) -> int:
        return self.delivery.conflicts if self.delivery else 0

    @property
    def run(self) -> str | None:
        """The run name the auditor registered this session under (NAME.2 ... when renamed)."""
        d = self.delivery
        if self.relay and self.relay.get("run"):  # sidecar mode: the name it registered upstream
            return self.relay["run"]
        return (d.registered_run if d is not None and d.registered_run else self.config.run)

    def _directed(self, directives) -> None:
        """The auditor's directives, from the ack reader thread: handed to the op capture,
        which applies each at the start of the step it names (agents/capture/ops.py). Never
        blocks."""
        inbox = self.directives
        if inbox is None:
            return
        from numaudit.agents.delivery.directives import accepted

        for d in directives:
            ok = accepted(d)
            if ok is not None:
                inbox.append(ok)
            else:
                log.warning("rank %d: numaudit ignored a malformed directive of the auditor "
                            "(id %d)", self.ident.rank, d.id)

    # -- training thread ----------------------------------------------------------------------

    def submit(self, batch: HostBatch) -> None:
        """Queue a host batch for sending; drops and counts it when the queue is full."""
        n = len(batch.captures)
        with self._lock:
            if self._closing or self._queued + n > self.config.queue_records:
                self.counters.drop("queue_full", n)
                return
            self._queued += n
            self._submitted += 1
        self._in.put_nowait(batch)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every host batch submitted so far is built into records and cut into a
        wire batch; False after `timeout` seconds. For benchmarks, so that the sender's work
        for a step is charged to that step (it polls: never call it from a hook)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = self._processed == self._submitted
            if idle and not self._pending and not self._cutting:
                return True
            time.sleep(0.001)
        return False

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
                item = self._in.get(timeout=0.0 if draining else self._wait_s())
            except queue.Empty:
                item = False
            if item is None:
                draining = True
            elif item is not False:
                with self._lock:
                    self._queued -= len(item.captures)
                self._add(item)
            now = time.monotonic()
            if self._pending and (draining
                                  or now - self._batch_started >= self.config.batch_interval_s):
                self._cutting = True
                try:
                    self._cut()
                finally:
                    self._cutting = False
            if item:
                with self._lock:
                    self._processed += 1
            if self.delivery is not None:
                self.delivery.service(lambda: self._deadline)
                self._spool_refused()
            if draining and self._in.empty():
                if not self._pending and not self._deliverable():
                    return
                if now >= self._deadline:
                    return
                time.sleep(0.002)

    def _wait_s(self) -> float | None:
        """How long the loop may sleep for the next host batch: until the open batch is due,
        while the delivery has batches in flight SERVICE_INTERVAL_S (acks, reconnects), else
        until something arrives. Idle, the thread never wakes: on a 2-core machine each
        wake-up is the training thread's time (it polled every 10 ms before)."""
        wait = None
        if self._pending:
            wait = max(0.0, self._batch_started + self.config.batch_interval_s - time.monotonic())
        if self._deliverable():
            wait = SERVICE_INTERVAL_S if wait is None else min(wait, SERVICE_INTERVAL_S)
        return wait

    def _deliverable(self) -> bool:
        d = self.delivery
        return d is not None and d.fatal is None and bool(d.pending)

    def _add(self, batch: HostBatch) -> None:
        try:
            batch.wait()
            f64 = batch.f64.cpu().numpy() if batch.f64 is not None else None
            i64 = batch.i64.cpu().numpy() if batch.i64 is not None else None
        except Exception as exc:
            self.counters.drop("transfer_error", len(batch.captures))
            log.warning("rank %d: numaudit host transfer failed: %r", self.ident.rank, exc)
            return
        try:
            parts = split_payloads(batch.captures, f64, i64, self._compress)
        except Exception as exc:  # one bad capture: split them one by one, drop only it
            log.debug("record build failed: %r; building captures one by one", exc)
            parts = []
            for cap in batch.captures:
                try:
                    parts.extend(split_payloads([cap], f64, i64, self._compress))
                except Exception as exc1:
                    self.counters.drop("build_error", 1)
                    log.debug("record build failed: %r", exc1)
        for part in parts:
            self._append(part)

    def _append(self, part: Part) -> None:
        """Add records to the open batch, cutting it at the record and payload-size limits."""
        limit = min(self.config.batch_records, limits.MAX_BATCH_RECORDS)
        nbytes = part.record_bytes()
        if self._pending and self._records_bytes + nbytes > limits.MAX_BATCH_PAYLOAD_BYTES:
            self._cut()
        rest: Part | None = part
        while rest is not None and len(rest):  # (None: returned at the end of the body)
            if not self._pending:
                self._batch_started = time.monotonic()
            room = limit - self._pending_n
            if len(rest) <= room:
                head, rest, head_bytes = rest, None, nbytes
            else:
                head, rest = rest.slice(0, room), rest.slice(room, len(rest))
                head_bytes = head.record_bytes()
                nbytes -= head_bytes
            self._pending.append(head)
            self._pending_n += len(head)
            self._records_bytes += head_bytes
            if self._pending_n >= limit:
                self._cut()
            if rest is None:
                return

    def _columns(self, parts: list[Part]) -> RecordColumns:
        """The parts' records as columns; a part that fails is built capture by capture and
        only its bad captures are dropped (counted as build_error)."""
        if not parts:
            return empty()
        try:
            return part_columns(parts)
        except Exception as exc:
            log.debug("record build failed: %r; building parts one by one", exc)
        built = []
        for part in parts:
            try:
                built.append(part_columns([part]))
                continue
            except Exception:
                pass
            for i in range(len(part)):
                try:
                    built.append(part_columns([part.slice(i, i + 1)]))
                except Exception as exc1:
                    self.counters.drop("build_error", 1)
                    log.debug("record build failed: %r", exc1)
        return concat(built) if built else empty()

    def _cut(self) -> None:
        pending, self._pending = self._pending, []
        nbytes = self._records_bytes
        self._pending_n = self._records_bytes = 0
        if not pending:
            return
        # Payload records travel packed too (PackedRecords.payloads); the delivery moves them
        # out per record for a peer that does not take them (agents/delivery/delivery.py).
        cols = self._columns(pending)
        if not cols.n:
            return
        n = cols.captures()  # what the counts count: a payload in chunks is one capture
        # Encoded once, checksum included: these bytes are what gRPC, the sidecar socket or the
        # spool gets, and what the delivery keeps until acked (wire/sealed.py).
        try:
            body = sealed_batch(self.session_id, self._next_seq, cols)
        except Exception as exc:  # a bug: this batch is lost, counted, and the sender goes on
            self.counters.drop("build_error", n)
            log.warning("rank %d: numaudit could not encode a batch of %d records: %r",
                        self.ident.rank, n, exc)
            return
        # The delivery's memory budget counts the record bytes (what the message carries
        # beside a few framing bytes per field): msg.ByteSize() serialized the whole message
        # once more, milliseconds per batch with payloads.
        d = self.delivery
        if d is not None and d.fatal is not None:
            # The session was refused (a token without write scope, a run name taken): final,
            # like the records pending when it came, and as the node sidecar reports it. A
            # taken run name's records are spooled instead (keep_refused).
            if d.fatal in d.keep_refused and self._spool_write(None, body):
                self.spilled += n
                self._next_seq += 1
                self.sent += n
                return
            self.counters.drop(d.fatal, n)
            return
        if d is None:
            if self._spool_write(None, body):
                self.spilled += n
            else:
                self.counters.drop("no_auditor", n)
                return
        else:
            if self.config.spool_mode == "always" and not self._spool_write(None, body):
                self.counters.drop("spool_error", n)
                return
            if not d.offer_sealed(self._next_seq, n, nbytes, body):
                self.counters.drop("buffer_full", n)
                return
        self._next_seq += 1
        self.sent += n

    def _spool_refused(self) -> None:
        """Spool the batches a refused session kept (`Delivery.keep_refused`), once it is
        refused; written ahead already in spool mode always."""
        d = self.delivery
        if d is None or d.fatal is None or d.fatal not in d.keep_refused or not d.pending:
            return
        batches = d.take_pending()
        n = sum(b.records for b in batches)
        if self.config.spool_mode == "always" or all(
                self._spool_write(b.message, b.body) for b in batches):
            self.spilled += n
        else:
            self.counters.drop(d.fatal, n)
        if not self.refused_warned:
            self.refused_warned = True
            log.warning("rank %d: numaudit: run name %r is taken by another job; this job's "
                        "records are spooled to %s: %s", self.ident.rank, self.config.run,
                        self.spool_path, self.ingest_hint())

    def ingest_hint(self) -> str:
        """The command that stores this rank's spooled records ("" when none were spooled)."""
        path = self.spool_path
        if not path:
            return ""
        where = f" --address {self.config.address}" if self.config.address else \
            " --db STORE"
        d = self.delivery
        if d is not None and d.fatal == RUN_NAME_TAKEN:
            return f"`auditor ingest {path} --run NEW_NAME{where}` stores them under a new name"
        return f"`auditor ingest {path}{where}` stores them"

    def _register_request(self) -> pb.RegisterRequest:
        i = self.ident
        req = pb.RegisterRequest(
            schema_version=pb.SCHEMA_VERSION_1, run=self.run, session_id=self.session_id,
            rank=i.rank, world_size=i.world_size, torch_version=i.torch_version,
            host=i.host, local_rank=i.local_rank, dtype=i.dtype, seed=i.seed,
            job_id=i.job_id, rename_if_taken=self.config.rename_if_taken,
            grad_scale=i.grad_scale, grad_scale_source=i.grad_scale_source[:256],
            agent_version=package_version()[:256],
            takes_directives=bool(self.config.directives and not self.config.sidecar),
        )
        req.mesh_shape.extend(i.mesh_shape)
        req.mesh_dim_names.extend(i.mesh_dim_names)
        req.mesh_coordinate.extend(i.mesh_coordinate)
        req.stages.extend(i.stages)
        req.labels.update(i.labels)
        return req

    def _close_request(self) -> pb.CloseSessionRequest:
        captured, errors, dropped = self.counters.snapshot()
        req = pb.CloseSessionRequest(
            schema_version=pb.SCHEMA_VERSION_1, session_id=self.session_id,
            records_sent=captured, records_dropped=sum(dropped.values()), capture_errors=errors)
        req.dropped_by_reason.update(dropped)
        return req

    def _finish(self) -> None:
        """Spill what never got acked, tell the auditor the totals, close the connection."""
        self._cut()
        self._spool_refused()
        while not self._in.empty():
            item = self._in.get_nowait()
            if item is not None:
                self.counters.drop("unsent_at_close", len(item.captures))
        d = self.delivery
        if d is None:
            self._spool_close(self._close_request())
            return
        unacked = d.pending_records
        if unacked:
            d.warn_if_unreachable(force=True)
        if unacked and self.config.spool_mode == "spill":
            if all(self._spool_write(b.message, b.body) for b in d.pending):
                self.spilled += unacked
                unacked = 0
        elif unacked and self.config.spool_mode == "always":
            self.spilled += unacked  # already written ahead
            unacked = 0
        self.counters.drop("unacked_at_close", unacked)
        if (not d.registered and d.fatal is None and self.counters.snapshot().captured
                and time.monotonic() < self._deadline):
            # nothing was ever sent: register anyway so the drop counts reach the auditor
            d.register_only(max(0.05, min(1.0, self._deadline - time.monotonic())))
        req = self._close_request()
        self._spool_close(req)
        closed = d.close_session(req, timeout=0.9)
        if closed and self.config.sidecar:
            self._ask_sidecar(d)
        d.shutdown()

    def _ask_sidecar(self, d: Delivery) -> None:
        """Learn what the sidecar did upstream: the rank's counts then match direct mode."""
        wait = max(0.0, self._deadline - time.monotonic() - 0.3)
        try:
            # asked only in sidecar mode, where the transport is a SidecarTransport
            self.relay = cast(SidecarTransport, d.transport).outcome(self.session_id, wait)
        except Exception as exc:  # an older or hung sidecar: its acks stand as "held"
            log.warning("rank %d: numaudit sidecar did not report the session's outcome (%s); "
                        "%d records are in its spool", self.ident.rank, exc, d.acked_records)
            return
        for reason, n in self.relay.get("dropped_by_reason", {}).items():
            self.counters.drop(reason, int(n))

    # -- spool ----------------------------------------------------------------------------------

    def _spool_write(self, batch: pb.RecordBatch | None, body: bytes | None = None) -> bool:
        """Append a batch to this session's spool file (opened with its registration; `body`:
        the batch serialized; ``batch`` None for sealed bytes alone)."""
        if self.config.spool_mode == "off":
            return False
        try:
            if self._spool is None:
                self._spool = SpoolWriter(self.config.spool_dir, self.config.run or "unnamed",
                                          self.ident.rank, self.session_id)
                self._spool.append(self._register_request())
                log.info("rank %d: numaudit spooling to %s", self.ident.rank, self._spool.path)
            self._spool.append(batch, body=body)
            return True
        except OSError as exc:
            log.warning("rank %d: numaudit spool write failed: %r", self.ident.rank, exc)
            return False

    def _spool_close(self, req: pb.CloseSessionRequest) -> None:
        if self._spool is None:
            return
        try:
            self._spool.append(req)
            self._spool.close()
        except OSError as exc:
            log.warning("rank %d: numaudit spool close failed: %r", self.ident.rank, exc)
