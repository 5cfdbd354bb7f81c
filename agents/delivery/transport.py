"""Transports: how a session's batches reach the next hop (the auditor over gRPC, or the node
sidecar).

Both offer the same four operations to `agents.delivery.delivery.Delivery` — register, open a stream
of batches whose acks arrive on a queue, close the session, close the transport — and report
failures as `TransportError` carrying a gRPC status code, so the delivery logic (what to resend,
what to drop, when to give up) is written once.

The sidecar transport speaks the spool's framing (wire/spool.py) over a Unix stream socket and
never touches gRPC, so a training process in sidecar mode holds no gRPC channel at all (fork
safety, grpc/grpc#32992).
"""

from __future__ import annotations

import queue
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire.channels import open_channel
from numaudit.wire.spool import (
    KIND_ACK,
    KIND_ERROR,
    KIND_OUTCOME,
    SpoolError,
    decode,
    encode,
    encode_outcome,
    read_frame,
)
from numaudit.wire.tls import TLSConfig

ABORT_POLL_S = 0.02
"""How often a blocking call checks whether its owner has given up on it (close deadline)."""
EOF_MARK = object()
"""Put on a stream's ack queue when the peer ended the stream cleanly."""


class TransportError(Exception):
    """A failed call, shaped like grpc.RpcError: `.code()` and `.details()`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def as_transport_error(exc: Exception) -> TransportError:
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, grpc.RpcError):
        return TransportError(exc.code(), exc.details() or "")
    return TransportError(grpc.StatusCode.UNAVAILABLE, repr(exc))


class Stream(Protocol):
    acks: queue.Queue
    """pb.Ack items, then EOF_MARK or a TransportError."""

    def send(self, batch: pb.RecordBatch | None, body: bytes | None = None) -> None:
        """Queue `batch` (`body`: its serialization, sent as it is when given; ``batch`` is
        None for a batch that exists only as these bytes)."""

    def cancel(self) -> None: ...


class Transport(Protocol):
    def register(self, req: pb.RegisterRequest, timeout: float,
                 abort: Callable[[], bool] = ...) -> int: ...

    def open_stream(self) -> Stream: ...

    def close_session(self, req: pb.CloseSessionRequest, timeout: float) -> None: ...

    def close(self) -> None: ...


# -- gRPC ---------------------------------------------------------------------------------------

def replica_addresses(address: str) -> list[str]:
    """The daemon replicas of a comma-separated `address` ("10.0.0.1:50551,10.0.0.2:50551"),
    each dialed on its own; [] for one address or a gRPC target URI (dns:, ipv4:, ipv6:, unix:),
    which the channel resolves itself."""
    parts = [p.strip() for p in address.split(",") if p.strip()]
    if len(parts) < 2 or address.startswith(("dns:", "ipv4:", "ipv6:", "unix:")):
        return []
    return parts


INGEST_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Auditor'].full_name}/Ingest"


def _request_bytes(item) -> bytes:
    """The Ingest call's request serializer: a sealed batch's bytes as they are (the sender
    encoded the batch once, checksum included: wire/sealed.py), a message serialized."""
    return item if type(item) is bytes else item.SerializeToString()


class _GrpcStream:
    """One Ingest call: sends are queued for grpc's request iterator; a thread reads acks."""

    def __init__(self, ingest, on_directives: Callable | None = None) -> None:
        self._outbox: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()
        self._on_directives = on_directives
        self.call = ingest(self._requests())
        threading.Thread(target=self._read, name="numaudit-acks", daemon=True).start()

    def _requests(self):
        while True:
            item = self._outbox.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for ack in self.call:
                if ack.directives and self._on_directives is not None:
                    try:  # handed over here: the sender may sleep while training runs
                        self._on_directives(list(ack.directives))
                    except Exception:  # never lose the ack to a directive
                        pass
                self.acks.put(ack)
            self.acks.put(EOF_MARK)
        except Exception as exc:
            self.acks.put(as_transport_error(exc))

    def send(self, batch: pb.RecordBatch | None, body: bytes | None = None) -> None:
        self._outbox.put(batch if body is None else body)

    def cancel(self) -> None:
        self._outbox.put(None)
        self.call.cancel()


class GrpcTransport:
    """The auditor daemon over gRPC; the channel is created on first use."""

    def __init__(self, address: str, token: str | None = None,
                 tls: TLSConfig | None = None, on_directives: Callable | None = None) -> None:
        self.address, self._token, self._tls = address, token, tls
        self._replicas = replica_addresses(address)
        """Replicas of the daemon listed in `address`, dialed one at a time (see `close`)."""
        self._at = random.randrange(len(self._replicas)) if self._replicas else 0
        """The replica dialed next: a random start spreads ranks over the replicas."""
        self._on_directives = on_directives
        """Called from the ack reader thread with an Ack's directives (docs/drill-down.md)."""
        self._channel = None
        self._stub = None
        self._ingest = None
        self.registered_run = ""
        """The run name the auditor registered last (RegisterResponse.run; differs when renamed)."""
        self.packed_batches = False
        """The auditor said it takes packed batches (RegisterResponse.packed_batches)."""
        self.packed_payloads = False
        """... and packed payloads (RegisterResponse.packed_payloads)."""

    def _connect(self):
        if self._stub is None:
            target = self._replicas[self._at] if self._replicas else self.address
            self._channel = open_channel(target, tls=self._tls, token=self._token)
            self._stub = numaudit_pb2_grpc.AuditorStub(self._channel)
            # The generated stub's Ingest, with a serializer that also takes sealed bytes.
            self._ingest = self._channel.stream_stream(
                INGEST_METHOD, request_serializer=_request_bytes,
                response_deserializer=pb.Ack.FromString, _registered_method=True)
        return self._stub

    def register(self, req: pb.RegisterRequest, timeout: float,
                 abort: Callable[[], bool] = lambda: False) -> int:
        """Register; gives up early (DEADLINE_EXCEEDED) as soon as `abort()` turns true."""
        future = self._connect().Register.future(req, timeout=timeout)
        while True:
            try:
                response = future.result(timeout=ABORT_POLL_S)
                self.registered_run = response.run
                self.packed_batches = response.packed_batches
                self.packed_payloads = response.packed_payloads
                return response.acked_seq
            except grpc.FutureTimeoutError:
                if abort():
                    future.cancel()
                    raise TransportError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         "register: given up at close") from None
            except grpc.RpcError as exc:
                raise as_transport_error(exc) from None

    def open_stream(self) -> _GrpcStream:
        self._connect()
        return _GrpcStream(self._ingest, self._on_directives)

    def close_session(self, req: pb.CloseSessionRequest, timeout: float) -> None:
        try:
            self._connect().CloseSession(req, timeout=timeout)
        except grpc.RpcError as exc:
            raise as_transport_error(exc) from None

    def close(self) -> None:
        """Closes the channel; the next call dials the next replica when several are listed.

        The delivery closes the transport on every failure (refused, unreachable, a stream
        without acks), so a failure moves the agent to another replica. One channel across all
        of them (round robin) could place the new stream on the replica that just hung: a
        SIGSTOPped daemon still completes TCP handshakes, and one rank in four kept returning to
        it for a whole 7 s freeze (tests/faults/test_replicas.py)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = self._ingest = None
            if self._replicas:
                self._at = (self._at + 1) % len(self._replicas)


# -- node sidecar over a Unix socket ------------------------------------------------------------

SEND_TIMEOUT_S = 2.0
"""A sidecar that does not take a batch within this long is treated as hung."""


def unix_path(address: str) -> str:
    """`unix:///run/numaudit.sock` or `unix:/x` or a plain path → the socket's path."""
    for prefix in ("unix://", "unix:"):
        if address.startswith(prefix):
            return address[len(prefix):]
    return address


class _SocketStream:
    """Batches written as frames; a thread reads the sidecar's acks (and errors) in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.acks: queue.Queue = queue.Queue()
        self._closed = False
        threading.Thread(target=self._read, name="numaudit-sidecar-acks", daemon=True).start()

    def _read(self) -> None:
        reader = self._sock.makefile("rb")
        try:
            while True:
                frame = read_frame(reader.read)
                if frame is None:
                    self.acks.put(EOF_MARK)
                    return
                self.acks.put(_reply(*frame))
        except (OSError, SpoolError, ValueError) as exc:
            if not self._closed:
                self.acks.put(TransportError(grpc.StatusCode.UNAVAILABLE, f"sidecar: {exc}"))

    def send(self, batch: pb.RecordBatch | None, body: bytes | None = None) -> None:
        try:
            self._sock.sendall(encode(batch, body))
        except OSError as exc:
            self.acks.put(TransportError(grpc.StatusCode.UNAVAILABLE, f"sidecar: {exc!r}"))

    def cancel(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _reply(kind: int, body: bytes) -> Any:
    """An Ack (or an outcome dict), or the TransportError the sidecar sent back."""
    if kind in (KIND_ACK, KIND_OUTCOME):
        return decode(kind, body)
    if kind == KIND_ERROR:
        name, _, details = body.decode("utf-8", "replace").partition(":")
        code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNAVAILABLE)
        return TransportError(code, details)
    raise ValueError(f"unexpected frame kind {kind} from the sidecar")


class SidecarTransport:
    """The node sidecar (`python -m numaudit.agents.sidecar`) over its Unix socket."""

    def __init__(self, address: str) -> None:
        self.path = unix_path(address)
        self._sock: socket.socket | None = None
        self.packed_batches = False
        """The sidecar said it takes packed batches (its Ack to Register)."""
        self.packed_payloads = False
        """... and packed payloads."""

    def _call(self, message, timeout: float,
              abort: Callable[[], bool] = lambda: False) -> Any:
        """One request/reply on a fresh connection (Register opens the stream's connection)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            sock.connect(self.path)
            sock.sendall(message if isinstance(message, bytes) else encode(message))
            while not select.select([sock], [], [], ABORT_POLL_S)[0]:  # a hung sidecar
                if abort() or time.monotonic() >= deadline:
                    raise OSError("no reply (timed out or given up at close)")
            frame = read_frame(sock.makefile("rb").read)
        except (OSError, SpoolError) as exc:
            sock.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE,
                                 f"sidecar {self.path}: {exc}") from None
        if frame is None:
            sock.close()
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "sidecar closed the connection")
        reply = _reply(*frame)
        if isinstance(reply, TransportError):
            sock.close()
            raise reply
        sock.settimeout(SEND_TIMEOUT_S)
        self._sock = sock
        return reply

    def register(self, req: pb.RegisterRequest, timeout: float,
                 abort: Callable[[], bool] = lambda: False) -> int:
        self.close()
        reply = self._call(req, timeout, abort)
        self.packed_batches = reply.packed_batches
        self.packed_payloads = reply.packed_payloads
        return reply.acked_seq

    def open_stream(self) -> _SocketStream:
        if self._sock is None:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "sidecar: not registered")
        sock, self._sock = self._sock, None
        return _SocketStream(sock)

    def close_session(self, req: pb.CloseSessionRequest, timeout: float) -> None:
        self._call(req, timeout)
        self.close()

    def outcome(self, session_id: str, wait_s: float) -> dict:
        """What the sidecar did with the session upstream, once it is done or after `wait_s`.

        Keys: acked (records the auditor acked), held (still in the sidecar's spool, to be
        delivered later or loaded with `auditor ingest`), dropped_by_reason, done, forwarded
        (the close with the drop counts reached the auditor), spool (the sidecar's file).
        Raises TransportError (a sidecar that does not answer within wait_s + 0.5 s).
        """
        query = encode_outcome({"session_id": session_id, "wait_s": wait_s})
        try:
            return self._call(query, wait_s + 0.5)
        finally:
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def wait_for_socket(address: str, timeout: float) -> bool:
    """True once a sidecar accepts connections on `address` (bounded by `timeout`)."""
    path = unix_path(address)
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(path)
                return True
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
