"""The spool: an append-only file of framed protobuf messages, for records the auditor has not acked.

An agent (or node sidecar) writes one spool file per session when there is no auditor, when it
is hung at close, or always as a durable buffer; `auditor ingest SPOOL...` replays it later
through the same idempotent store path, so a batch that was also delivered live is stored once.

Frame: 4-byte little-endian length, 4-byte CRC-32 of (kind byte + body), 1 kind byte, body.
Kinds: 1 RegisterRequest, 2 RecordBatch, 3 CloseSessionRequest. A torn tail (crash mid-write)
or a corrupt frame ends the readable part of a file: everything before it is intact and used.
Also the framing of the sidecar's Unix-socket protocol (kind 4: Ack; kind 5: an error, its body
"STATUS_NAME:details" in UTF-8), so one codec serves both.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from wire import limits
from protos import numaudit_pb2 as pb

KIND_REGISTER = 1
KIND_BATCH = 2
KIND_CLOSE = 3
KIND_ACK = 4
KIND_ERROR = 5
_TYPES = {KIND_REGISTER: pb.RegisterRequest, KIND_BATCH: pb.RecordBatch,
          KIND_CLOSE: pb.CloseSessionRequest, KIND_ACK: pb.Ack, KIND_ERROR: bytes}
_KINDS = {v: k for k, v in _TYPES.items()}
_HEADER = struct.Struct("<IIB")
MAX_FRAME_BYTES = limits.MAX_MESSAGE_BYTES
SUFFIX = ".spool"


class SpoolError(ValueError):
    """A spool that cannot be read at all (not a torn tail): names the file and offset."""


def encode(message) -> bytes:
    kind = _KINDS[type(message)]
    body = message if kind == KIND_ERROR else message.SerializeToString()
    crc = zlib.crc32(bytes([kind]) + body)
    return _HEADER.pack(len(body), crc, kind) + body


def read_frame(read) -> tuple[int, bytes] | None:
    """(kind, body) from a `read(n)` callable; None at a clean end; SpoolError when corrupt."""
    header = read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise SpoolError("torn frame header")
    length, crc, kind = _HEADER.unpack(header)
    if kind not in _TYPES or length > MAX_FRAME_BYTES:
        raise SpoolError(f"bad frame (kind {kind}, length {length})")
    body = read(length)
    if len(body) < length:
        raise SpoolError("torn frame body")
    if zlib.crc32(bytes([kind]) + body) != crc:
        raise SpoolError("frame checksum mismatch")
    return kind, body


def encode_error(code_name: str, details: str) -> bytes:
    return encode(f"{code_name}:{details}".encode("utf-8", "replace"))


def decode(kind: int, body: bytes):
    if kind == KIND_ERROR:
        return body
    message = _TYPES[kind]()
    message.ParseFromString(body)
    return message


class SpoolWriter:
    """Appends frames to one session's spool file; `sync()` makes them durable."""

    def __init__(self, directory: str | Path, run: str, rank: int, session_id: str,
                 tag: str = "") -> None:
        """`tag` keeps writers of one session apart (the sidecar's relay copy vs the agent's)."""
        self._open(Path(directory) / f"{run}-rank{rank}-{session_id}{tag}{SUFFIX}")

    @classmethod
    def reopen(cls, path: str | Path) -> "SpoolWriter":
        """Append to an existing spool file (a restarted sidecar resuming a session)."""
        writer = cls.__new__(cls)
        writer._open(Path(path))
        return writer

    def _open(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = open(self.path, "ab")
        self.bytes_written = self._file.tell()

    def append(self, message) -> int:
        data = encode(message)
        self._file.write(data)
        self._file.flush()  # in the OS's hands: survives a killed process (fsync: an OS crash)
        self.bytes_written += len(data)
        return len(data)

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()


@dataclass
class SpoolContents:
    """What one spool file holds, in order; `torn` says whether its tail was unreadable."""

    path: Path
    register: pb.RegisterRequest | None
    batches: list[pb.RecordBatch]
    close: pb.CloseSessionRequest | None
    torn: str | None = None


def read_spool(path: str | Path) -> SpoolContents:
    """Read every intact frame of a spool file. Raises SpoolError when it has no registration."""
    path = Path(path)
    out = SpoolContents(path, None, [], None)
    with open(path, "rb") as f:
        while True:
            offset = f.tell()
            try:
                frame = read_frame(f.read)
            except SpoolError as exc:
                out.torn = f"{exc} at byte {offset}"
                break
            if frame is None:
                break
            kind, body = frame
            try:
                message = decode(kind, body)
            except Exception:
                out.torn = f"undecodable frame at byte {offset}"
                break
            if kind == KIND_REGISTER:
                out.register = message
            elif kind == KIND_BATCH:
                out.batches.append(message)
            elif kind == KIND_CLOSE:
                out.close = message
    if out.register is None:
        raise SpoolError(f"{path}: no registration frame; not a numaudit spool")
    return out


def spool_files(paths: list[str | Path]) -> Iterator[Path]:
    """Files named directly, and every *.spool file under named directories, sorted."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(p.rglob(f"*{SUFFIX}"))
        else:
            yield p
