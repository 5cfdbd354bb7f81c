"""Delivery: one session's numbered batches to the next hop, at least once, never blocking its
owner.

A `Delivery` is pumped by its owner's thread (`service()` every few milliseconds): it registers
the session when there is something to send, streams pending batches, drops them as acks arrive
(an ack names the highest sequence durably stored downstream), and after any failure reconnects
with backoff, re-registers (the peer says what it already has) and resends the rest. The agent's
sender uses one for the rank's session; the node sidecar uses one per relayed session.

Failure policy, by status code:
- the peer refused the batch at the head of the queue for its content (INVALID_ARGUMENT,
  DATA_LOSS, RESOURCE_EXHAUSTED, OUT_OF_RANGE): after REFUSAL_RETRIES resends (bytes corrupted
  in transit look the same) that batch is dropped and counted as `rejected`, the rest are resent;
- ABORTED (the batch checksum did not match: corrupted in transit): resent;
- RESOURCE_EXHAUSTED whose details start with `wire.limits.BUSY_PREFIX` (the daemon is at a
  capacity cap: streams, bytes in flight): not a refusal; reconnect with backoff and resend;
- UNAVAILABLE whose details start with `wire.limits.ENDED_PREFIX` (the daemon ended the stream:
  idle, or its receive slot or its place under the stream cap was wanted): the peer is up; keep
  the channel, open a new stream after RECONNECT_BACKOFF_MIN_S and resend. Not an outage: the
  backoff does not grow and the peer is not reported unreachable;
- the peer refused the session (UNAUTHENTICATED, PERMISSION_DENIED, UNIMPLEMENTED, or a
  registration refused for what it says): give up, everything pending is counted `refused`;
- anything else (UNAVAILABLE, DEADLINE_EXCEEDED, a hung peer caught by the ack watchdog):
  reconnect after 50 ms, doubling to at most 1 s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from numaudit.agents.delivery.transport import (
    EOF_MARK,
    Stream,
    Transport,
    TransportError,
    as_transport_error,
)
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from numaudit.wire.batches import for_peer

log = logging.getLogger(__name__)

# The first retry comes quickly so a restarted auditor is resumed within about a second;
# repeated failures back off to one attempt a second.
RECONNECT_BACKOFF_MIN_S = 0.05
RECONNECT_BACKOFF_MAX_S = 1.0

UNREACHABLE_WARN_S = 1.0
"""A peer that cannot be reached for this long (no ack since) is reported once at WARNING."""

REFUSAL_RETRIES = 2
"""Times a refused registration or batch is tried again before it is believed (and dropped)."""

_REJECTED = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
}
_FATAL = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ALREADY_EXISTS}
RUN_NAME_TAKEN = "run_name_taken"
_DROP_REASON = {grpc.StatusCode.ALREADY_EXISTS: RUN_NAME_TAKEN}
"""Reason a refused session's records are counted under, where more telling than `refused`."""


@dataclass
class PendingBatch:
    seq: int
    message: pb.RecordBatch | None
    """The batch as a message; None for a batch the agent sealed straight to bytes
    (wire/sealed.py), parsed from `body` only to convert it for a peer of an earlier build."""
    records: int
    nbytes: int
    body: bytes | None = None
    """The batch serialized (sealed). With a message, kept until its first send (sent as it is
    instead of serialized again; resends and conversions serialize the message); without one,
    the batch's only form, kept until acked."""

    def parsed(self) -> pb.RecordBatch:
        return self.message if self.message is not None else pb.RecordBatch.FromString(self.body)


class Delivery:
    """Acked delivery of one session over one transport. Not thread-safe: one owner thread."""

    def __init__(
        self,
        transport: Transport,
        register: Callable[[], pb.RegisterRequest],
        *,
        on_drop: Callable[[str, int], None],
        connect_timeout_s: float = 5.0,
        ack_timeout_s: float = 10.0,
        max_unacked_bytes: int = 256 << 20,
        name: str = "",
        target: str = "",
        fallback: str = "",
        keep_refused: frozenset[str] = frozenset(),
    ) -> None:
        """`target` (the peer's address) and `fallback` (where records go instead) make the
        one WARNING logged when the peer cannot be reached. A session refused for a reason in
        `keep_refused` keeps its pending batches for the owner (`take_pending`: the agent
        spools the records of a run name that is taken) instead of dropping them."""
        self.transport = transport
        self._register_request = register
        self._on_drop = on_drop
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.max_unacked_bytes = max_unacked_bytes
        self.name = name
        self.pending: deque[PendingBatch] = deque()
        self.pending_bytes = 0
        self.acked_records = 0
        self.acked_seq = 0
        self.progress = threading.Condition()
        """Notified whenever acks retire records (`acked_records` grew): a reader of the agent
        as a library waits on it instead of polling (`Agent.wait_for_acks`)."""
        self.reconnects = 0
        self.registered = False
        self.fatal: str | None = None
        self._stream: Stream | None = None
        self._sent_upto = 0
        self._last_progress = 0.0
        self._backoff = RECONNECT_BACKOFF_MIN_S
        self._next_attempt = 0.0
        self._refusals = 0
        self.conflicts = 0
        """Records the peer acked as conflicting with content it stored under the same key."""
        self.registered_run = ""
        """The run name the peer registered this session under (renamed when taken)."""
        self.target, self.fallback = target, fallback
        self.keep_refused = keep_refused
        self.unreachable_warned = False
        self._down_since: float | None = None
        self._last_error = ""

    # -- owner's calls ------------------------------------------------------------------------

    def offer(self, batch: pb.RecordBatch, records: int, nbytes: int,
              body: bytes | None = None) -> bool:
        """Queue a batch; False (nothing queued) when over the memory budget or given up.

        `body`: the batch serialized (as a rank sent it to the node sidecar), sent as it is.
        It is kept only while a stream is open (the batch goes out at the next `service`): a
        batch waiting for a connection would otherwise hold its bytes twice, outside the budget.
        """
        if self.fatal is not None or self.pending_bytes + nbytes > self.max_unacked_bytes:
            return False
        self.pending.append(PendingBatch(batch.seq, batch, records, nbytes,
                                         body if self._stream is not None else None))
        self.pending_bytes += nbytes
        return True

    def offer_sealed(self, seq: int, records: int, nbytes: int, body: bytes) -> bool:
        """:meth:`offer` for a batch that exists only as its sealed bytes (the agent's sender:
        wire/sealed.py), kept as they are until acked."""
        if self.fatal is not None or self.pending_bytes + nbytes > self.max_unacked_bytes:
            return False
        self.pending.append(PendingBatch(seq, None, records, nbytes, body))
        self.pending_bytes += nbytes
        return True

    @property
    def pending_records(self) -> int:
        return sum(b.records for b in self.pending)

    def take_pending(self) -> list[PendingBatch]:
        """Hand every pending batch to the owner (a refused session's, see keep_refused)."""
        taken = list(self.pending)
        self.pending.clear()
        self.pending_bytes = 0
        return taken

    def service(self, deadline: Callable[[], float] = lambda: float("inf"), *,
                connect: bool = True) -> None:
        """Connect if due, send what is pending, take acks, watch for a hung peer.

        `deadline()` is the owner's current give-up time (it moves when the owner closes).
        """
        if self.fatal is not None:
            return
        now = time.monotonic()
        if self._stream is None:
            if not connect or not self.pending or now < self._next_attempt or now >= deadline():
                return
            try:
                self._connect(deadline)
            except Exception as exc:
                self._failed(as_transport_error(exc), registering=True)
                return
        self._drain_acks()
        s = self._stream
        if s is None:
            return
        packed_ok = getattr(self.transport, "packed_batches", False)
        payloads_ok = getattr(self.transport, "packed_payloads", False)
        for b in list(self.pending):
            if b.seq > self._sent_upto:
                if b.message is not None or not (packed_ok and payloads_ok):
                    try:  # converted once for a peer of an earlier build, kept for resends
                        message = b.parsed()
                        converted = for_peer(message, packed_ok, payloads_ok)
                    except Exception as exc:  # columns that do not fit: refused content
                        self._drop_unconvertible(b, exc)
                        continue
                    if converted is not message:
                        b.message, b.body = converted, None
                s.send(b.message, b.body)
                if b.message is not None:
                    b.body = None
                self._sent_upto = b.seq
        if self.pending and time.monotonic() - self._last_progress > self.ack_timeout_s:
            log.warning("%s: no ack for %.1fs; reconnecting", self.name, self.ack_timeout_s)
            self._drop_stream()
            self.transport.close()
            self._next_attempt = time.monotonic()

    def register_only(self, timeout: float) -> bool:
        """Register without streaming (to close a session that never sent anything)."""
        if self.fatal is not None:
            return False
        try:
            self._ack(self.transport.register(self._register_request(), timeout))
            self._note_run()
            self.registered = True
            return True
        except Exception as exc:
            log.debug("%s: register failed: %r", self.name, exc)
            return False

    def close_session(self, req: pb.CloseSessionRequest, timeout: float) -> bool:
        """Tell the peer the session's totals; False when it could not be told."""
        self._drop_stream()
        if not self.registered or self.fatal is not None:
            return False
        try:
            self.transport.close_session(req, timeout)
            return True
        except Exception as exc:
            err = as_transport_error(exc)
            log.warning("%s: could not close the session: %s", self.name, err.code().name)
            return False

    def shutdown(self) -> None:
        self._drop_stream()
        self.transport.close()

    def warn_if_unreachable(self, force: bool = False) -> None:
        """Log the one WARNING when the peer has been unreachable long enough (or now: `force`)."""
        if self.unreachable_warned or self._down_since is None or self.fatal is not None:
            return
        if force or time.monotonic() - self._down_since >= UNREACHABLE_WARN_S:
            self.unreachable_warned = True
            log.warning("%s: cannot reach %s (%s); %s", self.name, self.target or "the peer",
                        self._last_error, self.fallback or "records are kept until it is back")

    # -- internals ----------------------------------------------------------------------------

    def _connect(self, deadline: Callable[[], float]) -> None:
        timeout = max(0.05, min(self.connect_timeout_s, deadline() - time.monotonic()))
        # The owner's deadline can arrive while the call is in flight (close() is called):
        # the call gives up then, so close() is never held past its budget.
        acked = self.transport.register(self._register_request(), timeout,
                                        lambda: time.monotonic() >= deadline())
        self._ack(acked)
        self._note_run()
        self.registered = True
        self._stream = self.transport.open_stream()
        self._sent_upto = self.acked_seq
        self._last_progress = time.monotonic()

    def _note_run(self) -> None:
        run = getattr(self.transport, "registered_run", "")
        if run and run != self.registered_run:
            self.registered_run = run

    def _drain_acks(self) -> None:
        while self._stream is not None:
            try:
                item = self._stream.acks.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, pb.Ack):
                self._down_since = None
                self._last_progress = time.monotonic()
                self._refusals = 0
                self._backoff = RECONNECT_BACKOFF_MIN_S  # progress, not just a registration
                self.conflicts += item.conflicts
                self._ack(item.acked_seq)
            elif item is EOF_MARK:
                self._drop_stream()
            else:
                self._failed(as_transport_error(item))

    def _ack(self, acked_seq: int) -> None:
        self.acked_seq = max(self.acked_seq, acked_seq)
        retired = False
        while self.pending and self.pending[0].seq <= acked_seq:
            b = self.pending.popleft()
            self.pending_bytes -= b.nbytes
            self.acked_records += b.records
            retired = True
        if retired:
            with self.progress:
                self.progress.notify_all()

    def _failed(self, err: TransportError, registering: bool = False) -> None:
        code = err.code()
        self._drop_stream()
        if code == grpc.StatusCode.UNAVAILABLE and err.details().startswith(limits.ENDED_PREFIX):
            # The daemon ended the stream and said so: it is up, and the channel is sound. A
            # new stream soon, but not in a loop should a peer answer nothing else.
            self.reconnects += 1
            self._next_attempt = time.monotonic() + RECONNECT_BACKOFF_MIN_S
            log.debug("%s: stream ended by the peer (%s); reconnecting", self.name,
                      err.details())
            return
        # A fresh connection next time: one whose bytes were corrupted or that hangs can stay
        # "up" while every call on it times out, so reusing the channel would never recover.
        self.transport.close()
        busy = (code == grpc.StatusCode.RESOURCE_EXHAUSTED
                and err.details().startswith(limits.BUSY_PREFIX))
        refused_for_content = not busy and (code in _REJECTED or (
            registering and code == grpc.StatusCode.FAILED_PRECONDITION))
        if refused_for_content and self._refusals < REFUSAL_RETRIES:
            # Bytes corrupted in transit are refused like bad content: try again before
            # believing it. A real refusal repeats and costs REFUSAL_RETRIES round trips.
            self._refusals += 1
            self._next_attempt = time.monotonic() + self._backoff
            log.debug("%s: refused (%s); retry %d", self.name, code.name, self._refusals)
            return
        if code in _FATAL or (registering and refused_for_content):
            self.fatal = _DROP_REASON.get(code, "refused")
            kept = self.fatal in self.keep_refused
            log.error("%s: refused (%s: %s); records are %s", self.name, code.name,
                      err.details(), "spooled" if kept else "dropped")
            if kept:
                return
            while self.pending:
                self._on_drop(self.fatal, self.pending.popleft().records)
            self.pending_bytes = 0
            return
        if refused_for_content and self.pending and self.registered:
            bad = self.pending.popleft()
            self.pending_bytes -= bad.nbytes
            self._on_drop("rejected", bad.records)
            log.warning("%s: batch %d rejected (%s: %s); dropped", self.name, bad.seq,
                        code.name, err.details())
            self._refusals = 0
            self._next_attempt = time.monotonic()
            return
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            self.registered = False  # an unknown session (a wiped store): register again
        self.reconnects += 1
        if self._down_since is None:
            self._down_since = time.monotonic()
        self._last_error = f"{code.name}: {err.details()[:200]}"
        self.warn_if_unreachable()
        self._next_attempt = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, RECONNECT_BACKOFF_MAX_S)
        log.debug("%s: connection failed (%s); retrying", self.name, code.name)

    def _drop_unconvertible(self, b: PendingBatch, exc: Exception) -> None:
        """A packed batch whose columns do not fit together cannot be converted for a peer of
        an earlier build (a node sidecar relays whatever a local process sends): any peer would
        refuse it for its content, so it is dropped as `rejected` now, and the rest go on."""
        self.pending.remove(b)
        self.pending_bytes -= b.nbytes
        self._on_drop("rejected", b.records)
        log.warning("%s: batch %d rejected (its packed records do not convert: %s); dropped",
                    self.name, b.seq, exc)

    def _drop_stream(self) -> None:
        for b in self.pending:  # resent on a new stream, serialized then (sealed bytes stay)
            if b.message is not None:
                b.body = None
        if self._stream is not None:
            try:
                self._stream.cancel()
            except Exception:
                pass
            self._stream = None
