"""`auditor ingest SPOOL...`: replay spool files through the daemon's own ingest path.

Replay uses the same RPCs as a live agent (Register with the spooled session id, Ingest, then
CloseSession), so it gets the same validation and the same idempotence: batches the auditor
already stored live are acknowledged without being stored twice, and a spool replayed twice
changes nothing. A daemon of an earlier build gets what it takes, as from a live agent:
per-record batches, or the payload records per record, where its RegisterResponse does not say
packed_batches or packed_payloads. With a database path instead of an address, an in-process
daemon is started on that file for the replay.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire.batches import batch_capture_count, for_peer
from numaudit.wire.channels import open_channel
from numaudit.wire.packed import PackedFormatError
from numaudit.wire.spool import SpoolError, read_spool, spool_files
from numaudit.wire.tls import TLSConfig

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0


@dataclass
class ReplayResult:
    """What replaying one spool file did."""

    path: Path
    run: str = ""
    rank: int = -1
    batches: int = 0
    records: int = 0
    stored: int = 0
    duplicates: int = 0
    conflicts: int = 0
    rejected: list[str] = field(default_factory=list)
    """One line per batch the auditor refused (status and message)."""
    skipped_frames: int = 0
    """Frames that could not be read (torn by a crash mid-write, or corrupted) and were skipped."""
    skipped_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    """Why each skipped frame was unreadable, and where (wire.spool.SpoolContents.problems)."""
    error: str | None = None
    """Why the file could not be replayed at all."""


def replay(paths: Iterable[str | Path], address: str, *, token: str | None = None,
           tls: TLSConfig | None = None, run: str = "") -> list[ReplayResult]:
    """Replay every spool file named (or under a named directory) into the daemon at `address`.

    `tls` and `token` as for any client (wire.channels.open_channel); `run` registers the
    sessions under that run name instead of the spooled one (a job whose name was taken)."""
    metadata = ()  # the channel carries the token
    results = []
    with open_channel(address, tls=tls, token=token) as channel:
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        for path in spool_files(list(paths)):
            results.append(_replay_file(stub, path, metadata, run))
    return results


def replay_into_db(paths: Iterable[str | Path], db_path: str | Path, *,
                   run: str = "") -> list[ReplayResult]:
    """Replay into a database file through an in-process daemon bound to loopback."""
    from numaudit.auditor.daemon.server import BackgroundServer

    with BackgroundServer("127.0.0.1:0", db_path, grace=1.0) as server:
        return replay(paths, server.address, run=run)


def _replay_file(stub, path: Path, metadata, run: str = "") -> ReplayResult:
    result = ReplayResult(path)
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the read forever
            result.error = f"{path}: not a regular file"
            return result
        spool = read_spool(path)
    except (OSError, SpoolError) as exc:
        result.error = str(exc)
        return result
    result.skipped_frames, result.skipped_bytes = spool.skipped_frames, spool.skipped_bytes
    result.problems = list(spool.problems)
    assert spool.register is not None  # read_spool refuses a spool without one
    if run:
        spool.register.run = run
    result.run, result.rank = spool.register.run, spool.register.rank
    try:
        peer = stub.Register(spool.register, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        result.error = f"Register: {exc.code().name}: {exc.details()}"
        return result
    for batch in spool.batches:
        result.batches += 1
        result.records += batch_capture_count(batch)  # a payload in chunks: one record
        try:  # as a live agent sends it, for a daemon of an earlier build
            batch = for_peer(batch, peer.packed_batches, peer.packed_payloads)
        except PackedFormatError as exc:
            result.rejected.append(f"seq {batch.seq}: {exc} (not converted for an auditor of "
                                   "an earlier build)")
            continue
        try:
            (ack,) = list(stub.Ingest(iter([batch]), timeout=CALL_TIMEOUT_S, metadata=metadata))
        except grpc.RpcError as exc:
            result.rejected.append(f"seq {batch.seq}: {exc.code().name}: {exc.details()}")
            continue
        result.stored += ack.stored
        result.duplicates += ack.duplicates
        result.conflicts += ack.conflicts
    if spool.close is not None:
        try:
            stub.CloseSession(spool.close, timeout=CALL_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as exc:
            result.rejected.append(f"close: {exc.code().name}: {exc.details()}")
    return result
