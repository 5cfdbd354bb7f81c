"""The node sidecar: a per-node process that relays the ranks' records to the auditor.

    python -m numaudit.agents.sidecar --listen unix:///tmp/numaudit.sock --auditor HOST:PORT
                                      --spool DIR

Ranks in sidecar mode (`NUMAUDIT_SIDECAR=unix:///...`) hand their batches over a Unix socket
(framed like the spool, no gRPC in the training process). The sidecar appends each batch to the
session's spool file and fdatasyncs it before acknowledging it to the rank, so an ack from the
sidecar means the batch is on stable storage: it survives a crash of the training process, of
the sidecar and of the machine; a write that fails (disk full) is truncated back to the last
complete frame and answered UNAVAILABLE, and the rank resends. It then delivers every session
to the auditor with the same acked-resend logic as a rank (agents/delivery/delivery.py), keeping the
rank's session id and sequence numbers, so the auditor's idempotence covers every path: live,
sidecar resend after restart, and `auditor ingest` of a spool.

An ack from the sidecar is not an ack from the auditor. What became of a session upstream
(records acked by the auditor, still held in the spool, dropped: a batch the auditor rejected,
a session it refused) is counted per session; the CloseSession the sidecar forwards adds those
drops to the rank's, and a rank that asks (an outcome frame, at its close) is told them, so its
summary says what the auditor stored, as in direct mode. Run names and session ids are checked
as the daemon checks them (wire/names.py) before any path is built from them.

A restarted sidecar reads its spool directory and resumes every session it had not finished.
Without `--auditor` it only spools; `auditor ingest DIR` loads the files later. A delivered
session's spool file is deleted; one the auditor refused is kept for inspection.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from numaudit.agents.delivery.delivery import Delivery
from numaudit.agents.delivery.transport import GrpcTransport, unix_path
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.batches import batch_capture_count
from numaudit.wire.channels import tls_from_env
from numaudit.wire.names import BadName, check_run_name, check_session_id
from numaudit.wire.spool import (
    KIND_BATCH,
    KIND_CLOSE,
    KIND_OUTCOME,
    KIND_REGISTER,
    SpoolError,
    SpoolWriter,
    decode,
    encode,
    encode_error,
    encode_outcome,
    read_frame,
    read_spool,
    spool_files,
)
from numaudit.wire.tls import TLSConfig, TLSError

log = logging.getLogger("numaudit.agents.sidecar")

SYNC_INTERVAL_S = 0.2
"""Spool files are fsynced this often (and at session close)."""
PUMP_INTERVAL_S = 0.005
DEFAULT_MAX_SPOOL_BYTES = 4 << 30
RELAY_TAG = ".relay"
"""Suffix of the sidecar's spool files, apart from any spill file of the agent's own."""
MAX_OUTCOME_WAIT_S = 60.0
"""Longest a rank may ask the sidecar to wait for its session's upstream outcome."""


@dataclass
class Session:
    """One rank session relayed by this sidecar."""

    register: pb.RegisterRequest
    spool: SpoolWriter
    delivery: Delivery | None
    spooled_seq: int = 0
    close: pb.CloseSessionRequest | None = None
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    dropped: Counter = field(default_factory=Counter)
    """Records dropped upstream, by reason (rejected, refused, buffer_full)."""
    spooled_records: int = 0
    """Records of the session in the spool file."""
    forwarded: bool = False
    """The session's close reached the auditor (and with it the drop counts)."""
    pump_error: str = ""
    """The last failure of this session's forwarding step, logged once (the others go on)."""

    def outcome(self) -> dict:
        """What became of the session's records upstream, as a rank is told at its close."""
        acked = self.delivery.acked_records if self.delivery is not None else 0
        # In the spool and neither stored nor dropped: delivered later, or by `auditor ingest`.
        held = max(0, self.spooled_records - acked - sum(self.dropped.values()))
        return {"session_id": self.register.session_id, "acked": acked, "held": held,
                "dropped_by_reason": dict(self.dropped), "done": self.done,
                "forwarded": self.forwarded, "spool": str(self.spool.path),
                "auditor": self.delivery is not None,
                "run": self.delivery.registered_run if self.delivery is not None else ""}


class Sidecar:
    """Accepts rank connections on a Unix socket; spools and forwards their sessions."""

    def __init__(self, listen: str, spool_dir: str | Path, *, auditor: str | None = None,
                 token: str | None = None, tls: TLSConfig | None = None,
                 max_spool_bytes: int = DEFAULT_MAX_SPOOL_BYTES,
                 exit_when_idle_s: float | None = None) -> None:
        """`tls` secures the upstream channel to the auditor (the rank side is a local socket)."""
        self.path = unix_path(listen)
        self.spool_dir = Path(spool_dir)
        self.auditor, self.token, self.tls = auditor, token, tls
        self.max_spool_bytes = max_spool_bytes
        self.exit_when_idle_s = exit_when_idle_s
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connections = 0
        self._last_activity = time.monotonic()
        self._server: socket.socket | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self._recover()
        if os.path.exists(self.path):
            os.unlink(self.path)  # a stale socket of a dead sidecar
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        os.chmod(self.path, 0o600)  # only this user's processes may hand records over
        self._server.listen(256)
        threading.Thread(target=self._accept, name="sidecar-accept", daemon=True).start()
        threading.Thread(target=self._pump, name="sidecar-pump", daemon=True).start()
        log.info("sidecar listening on unix://%s, spool %s, auditor %s", self.path,
                 self.spool_dir, self.auditor or "none (spool only)")

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting; give deliveries `grace` seconds; what is left stays in the spool."""
        if self._server is not None:
            self._server.close()
            self._server = None
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self._all_done():
            time.sleep(0.02)
        self._stop.set()
        with self._lock:
            sessions = list(self.sessions.values())
        for s in sessions:
            with s.lock:
                s.spool.close()
                if s.delivery is not None:
                    s.delivery.shutdown()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def wait(self) -> None:
        """Block until stopped, or idle long enough when `exit_when_idle_s` is set."""
        while not self._stop.wait(0.1):
            if self.exit_when_idle_s is None:
                continue
            idle = time.monotonic() - self._last_activity
            if self._connections == 0 and self._all_done() and idle > self.exit_when_idle_s:
                log.info("idle for %.0fs with every session delivered; exiting", idle)
                self.stop(grace=0)

    def _all_done(self) -> bool:
        with self._lock:
            return all(s.done for s in self.sessions.values())

    # -- recovery -----------------------------------------------------------------------------

    def _recover(self) -> None:
        for path in spool_files([self.spool_dir]):
            try:
                contents = read_spool(path)
            except (OSError, SpoolError) as exc:
                log.warning("unreadable spool %s left in place: %s", path, exc)
                continue
            reg = contents.register
            if reg is None:  # read_spool refuses a spool without one
                continue
            try:
                check_run_name(reg.run)
                check_session_id(reg.session_id)
            except BadName as exc:
                log.warning("spool %s left in place: %s", path, exc)
                continue
            # a torn tail (killed mid-write) is cut off so new frames follow the last good one
            session = self._new_session(reg, SpoolWriter.reopen(path, truncate_to=contents.end))
            for batch in contents.batches:
                session.spooled_seq = batch.seq
                session.spooled_records += batch_capture_count(batch)
                if session.delivery is not None:
                    self._offer(session, batch)
            session.close = contents.close
            self.sessions[reg.session_id] = session
            log.info("resuming session %s (run %s rank %d): %d batches spooled%s",
                     reg.session_id, reg.run, reg.rank, len(contents.batches),
                     f"; skipped {contents.skipped_frames} unreadable frames "
                     f"({contents.skipped_bytes} bytes): {contents.torn}"
                     if contents.torn else "")

    def _new_session(self, reg: pb.RegisterRequest, spool: SpoolWriter) -> Session:
        delivery = None
        if self.auditor:
            name = f"sidecar session {reg.session_id[:8]} (run {reg.run} rank {reg.rank})"
            session_box: list[Session] = []
            delivery = Delivery(
                GrpcTransport(self.auditor, self.token, tls=self.tls), lambda: reg,
                on_drop=lambda reason, n: self._count_drop(session_box, reason, n),
                max_unacked_bytes=self.max_spool_bytes, name=name)
            session = Session(reg, spool, delivery)
            session_box.append(session)
            return session
        return Session(reg, spool, None)

    @staticmethod
    def _count_drop(box: list[Session], reason: str, n: int) -> None:
        if box:
            box[0].dropped[reason] += n
        log.warning("dropped %d records upstream (%s)", n, reason)

    @staticmethod
    def _offer(s: Session, batch: pb.RecordBatch, body: bytes | None = None) -> None:
        """Hand a spooled batch to the session's delivery; count it if it cannot be taken.
        `body`: the bytes it arrived as (sent upstream as they are)."""
        d = s.delivery
        if d is None:  # offered only where the session has a delivery
            return
        n = batch_capture_count(batch)
        if d.offer(batch, n, batch.ByteSize() if body is None else len(body), body):
            return
        if d.fatal is not None:  # final, as in direct mode (the spool is kept for inspection)
            s.dropped[d.fatal] += n
            return
        s.dropped["buffer_full"] += n
        log.warning("session %s: batch %d not delivered upstream (buffer_full)",
                    s.register.session_id, batch.seq)

    # -- forwarding ---------------------------------------------------------------------------

    def _pump(self) -> None:
        last_sync = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                sessions = list(self.sessions.values())
            sync = time.monotonic() - last_sync > SYNC_INTERVAL_S
            for s in sessions:
                with s.lock:
                    if s.done:
                        continue
                    if sync:
                        self._safe_sync(s)
                    if s.delivery is None:
                        s.done = s.close is not None
                        continue
                    try:
                        s.delivery.service()
                        if s.close is not None and not s.delivery.pending:
                            self._finish_session(s)
                    except Exception as exc:  # a bug: this session retries, the others go on
                        if repr(exc) != s.pump_error:
                            log.exception("session %s: forwarding failed; retrying",
                                          s.register.session_id)
                            s.pump_error = repr(exc)
            if sync:
                last_sync = time.monotonic()
            time.sleep(PUMP_INTERVAL_S)

    def _finish_session(self, s: Session) -> None:
        d = s.delivery
        if d is None:  # finished here only where the session has a delivery
            return
        if d.fatal is not None:
            s.done = True
            log.error("session %s refused by the auditor; spool kept at %s",
                      s.register.session_id, s.spool.path)
            return
        if not d.registered and not d.register_only(1.0):
            return  # try again on the next pump
        if d.close_session(self._forwarded_close(s), timeout=2.0):
            s.done = s.forwarded = True
            s.spool.close()
            s.spool.path.unlink(missing_ok=True)
            d.shutdown()
            log.info("session %s delivered", s.register.session_id)

    @staticmethod
    def _forwarded_close(s: Session) -> pb.CloseSessionRequest:
        """The rank's close with what was dropped upstream added to its drop counts."""
        req = pb.CloseSessionRequest()
        req.CopyFrom(s.close)
        for reason, n in s.dropped.items():
            req.dropped_by_reason[reason] = req.dropped_by_reason.get(reason, 0) + n
            req.records_dropped += n
        return req

    @staticmethod
    def _safe_sync(s: Session) -> None:
        try:
            s.spool.sync()
        except (OSError, ValueError):
            pass

    # -- rank connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set() and self._server is not None:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections += 1
        reader = conn.makefile("rb")
        session: Session | None = None
        try:
            while not self._stop.is_set():
                try:
                    frame = read_frame(reader.read)
                except SpoolError as exc:
                    conn.sendall(encode_error("INVALID_ARGUMENT", f"frame: {exc}"))
                    return
                if frame is None:
                    return
                self._last_activity = time.monotonic()
                kind, body = frame
                reply, session = self._handle(kind, body, session)
                conn.sendall(reply)
        except OSError:
            return
        finally:
            with self._lock:
                self._connections -= 1
            self._last_activity = time.monotonic()
            conn.close()

    def _handle(self, kind: int, body: bytes,
                session: Session | None) -> tuple[bytes, Session | None]:
        try:
            message = decode(kind, body)
        except Exception:
            return encode_error("INVALID_ARGUMENT", "frame: undecodable message"), session
        if kind == KIND_REGISTER:
            return self._on_register(message)
        if kind == KIND_OUTCOME:
            return self._on_outcome(message), session
        if session is None or message.session_id != session.register.session_id:
            with self._lock:
                session = self.sessions.get(message.session_id)
            if session is None:
                return encode_error("FAILED_PRECONDITION", "session_id: register first"), None
        if kind == KIND_BATCH:
            return self._on_batch(session, message, body), session
        if kind == KIND_CLOSE:
            with session.lock:
                try:
                    session.spool.append(message, durable=True)
                except (OSError, ValueError) as exc:
                    return encode_error("UNAVAILABLE", f"sidecar spool: {exc}"), session
                session.close = message
            return encode(pb.Ack(session_id=session.register.session_id,
                                 acked_seq=session.spooled_seq)), session
        return encode_error("INVALID_ARGUMENT", f"frame: unexpected kind {kind}"), session

    def _on_outcome(self, query: dict) -> bytes:
        """Answer a rank's outcome query once its session is finished, or after `wait_s`."""
        try:
            sid = str(query["session_id"])
            wait = min(max(float(query.get("wait_s", 0.0)), 0.0), MAX_OUTCOME_WAIT_S)
        except (KeyError, TypeError, ValueError):
            return encode_error("INVALID_ARGUMENT", "outcome: session_id and wait_s required")
        with self._lock:
            session = self.sessions.get(sid)
        if session is None:
            return encode_error("FAILED_PRECONDITION", "session_id: register first")
        deadline = time.monotonic() + wait
        # An auditor the sidecar cannot reach will not answer within a rank's close: say so now
        # (the sidecar keeps the records and goes on trying).
        while (not (session.done or session.delivery is None or session.delivery.unreachable_warned)
               and time.monotonic() < deadline):
            time.sleep(0.01)
        with session.lock:
            return encode_outcome(session.outcome())

    def _on_register(self, reg: pb.RegisterRequest) -> tuple[bytes, Session | None]:
        try:  # before any path is built from them: refused as the daemon refuses them
            check_run_name(reg.run)
            check_session_id(reg.session_id)
        except BadName as exc:
            return encode_error("INVALID_ARGUMENT", str(exc)), None
        with self._lock:
            session = self.sessions.get(reg.session_id)
            if session is None:
                try:
                    writer = SpoolWriter(self.spool_dir, reg.run, reg.rank, reg.session_id,
                                         tag=RELAY_TAG)
                except BadName as exc:
                    return encode_error("INVALID_ARGUMENT", str(exc)), None
                except OSError as exc:
                    return encode_error("UNAVAILABLE", f"sidecar spool: {exc}"), None
                try:
                    writer.append(reg, durable=True)
                except (OSError, ValueError) as exc:
                    writer.close()
                    writer.path.unlink(missing_ok=True)
                    return encode_error("UNAVAILABLE", f"sidecar spool: {exc}"), None
                session = self._new_session(reg, writer)
                self.sessions[reg.session_id] = session
                log.info("session %s: run %s rank %d", reg.session_id, reg.run, reg.rank)
        return encode(pb.Ack(session_id=reg.session_id, acked_seq=session.spooled_seq,
                             packed_batches=True, packed_payloads=True)), session

    def _on_batch(self, s: Session, batch: pb.RecordBatch, body: bytes) -> bytes:
        """Spool a batch and relay it. `body` is the frame's bytes, which parse to `batch`:
        they are spooled and sent upstream as they are, not serialized again (an agent's
        are its sealed batch, wire.checksum.seal)."""
        with s.lock:
            if batch.seq > s.spooled_seq:
                if self._spool_bytes() + len(body) > self.max_spool_bytes:
                    return encode_error("RESOURCE_EXHAUSTED",
                                        "sidecar spool over its budget "
                                        f"({self.max_spool_bytes} bytes)")
                try:  # acked only once on stable storage; a failed write leaves no partial frame
                    s.spool.append(batch, durable=True, body=body)
                except (OSError, ValueError) as exc:
                    return encode_error("UNAVAILABLE", f"sidecar spool: {exc}")
                s.spooled_seq = batch.seq
                s.spooled_records += batch_capture_count(batch)
                if s.delivery is not None:
                    self._offer(s, batch, body)
            return encode(pb.Ack(session_id=s.register.session_id, acked_seq=s.spooled_seq))

    def _spool_bytes(self) -> int:
        with self._lock:
            return sum(s.spool.bytes_written for s in self.sessions.values() if not s.done)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m numaudit.agents.sidecar",
                                description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True, help="unix:///PATH of the socket ranks connect to")
    p.add_argument("--auditor", default=os.environ.get("NUMAUDIT_ADDR"),
                   help="auditor HOST:PORT; without it the sidecar only spools")
    p.add_argument("--spool", default="numaudit-spool", help="spool directory")
    p.add_argument("--max-spool-bytes", type=int, default=DEFAULT_MAX_SPOOL_BYTES)
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                   help="exit once every session is delivered and no rank is connected")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s numaudit-sidecar %(levelname)s %(message)s")
    try:  # NUMAUDIT_TLS_CA / _CERT / _KEY, as for the agent
        tls = tls_from_env()
    except (TLSError, OSError) as exc:
        print(f"sidecar: {exc}", file=sys.stderr)
        return 2
    sidecar = Sidecar(args.listen, args.spool, auditor=args.auditor,
                      token=os.environ.get("NUMAUDIT_TOKEN"), tls=tls,
                      max_spool_bytes=args.max_spool_bytes, exit_when_idle_s=args.exit_when_idle)
    try:
        sidecar.start()
    except OSError as exc:
        print(f"sidecar: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=sidecar.stop).start())
    signal.signal(signal.SIGINT, lambda *_: threading.Thread(target=sidecar.stop).start())
    sidecar.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
