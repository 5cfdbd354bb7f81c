"""The spool: an append-only file of framed protobuf messages, for records the auditor has not
acked.

An agent (or node sidecar) writes one spool file per session when there is no auditor, when it
is hung at close, or always as a durable buffer; `auditor ingest SPOOL...` replays it later
through the same idempotent store path, so a batch that was also delivered live is stored once.

Frame (format 2): the 4-byte marker MAGIC, 4-byte little-endian body length, 4-byte CRC-32 of
(length, kind byte, body), 1 kind byte, body. Kinds: 1 RegisterRequest, 2 RecordBatch,
3 CloseSessionRequest. The marker lets a reader that meets a torn or corrupted frame skip only
that frame: it searches for the next marker whose frame checks out and goes on from there, and
reports what it skipped (`SpoolContents.skipped_frames`, `.skipped_bytes`). Files of format 1
(the same frame without the marker and with the CRC over kind + body only) are still read; they
end at their first bad frame, and what follows it is reported as skipped.

A writer never leaves a partial frame behind it: when a write (or the fsync of a durable append)
fails, the file is truncated back to the end of the last complete frame before the error is
raised, so the next append starts a clean frame.

Also the framing of the sidecar's Unix-socket protocol (kind 4: Ack; kind 5: an error, its body
"STATUS_NAME:details" in UTF-8; kind 6: the sidecar's outcome of a session, JSON), so one codec
serves both. Rank and sidecar of one node must run the same format.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from numaudit.wire.checksum import crc32
from numaudit.wire.names import spool_file_name

KIND_REGISTER = 1
KIND_BATCH = 2
KIND_CLOSE = 3
KIND_ACK = 4
KIND_ERROR = 5
KIND_OUTCOME = 6
_TYPES = {KIND_REGISTER: pb.RegisterRequest, KIND_BATCH: pb.RecordBatch,
          KIND_CLOSE: pb.CloseSessionRequest, KIND_ACK: pb.Ack}
_KINDS = {v: k for k, v in _TYPES.items()}
_RAW_KINDS = (KIND_ERROR, KIND_OUTCOME)
MAGIC = b"\xabNS2"
"""Frame marker of format 2 (0xAB is not ASCII, so text files never start with it)."""
_HEADER = struct.Struct("<4sIIB")  # magic, length, crc, kind
_LEGACY_HEADER = struct.Struct("<IIB")  # length, crc, kind (format 1)
MAX_FRAME_BYTES = limits.MAX_MESSAGE_BYTES
SUFFIX = ".spool"


class SpoolError(ValueError):
    """A spool that cannot be read at all, or a bad frame on the socket: names what and where."""


def _crc(length: int, kind: int, body: bytes) -> int:
    return crc32(body, crc32(struct.pack("<IB", length, kind)))


def _frame(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(body), _crc(len(body), kind, body), kind) + body


def encode(message, body: bytes | None = None) -> bytes:
    """A frame of a protobuf message (kinds 1-4), or of an error's raw bytes (kind 5). `body`:
    the message already serialized (a sealed batch: `wire.checksum.seal`); with ``message``
    None, the bytes of a RecordBatch that exists only serialized (`wire.sealed`)."""
    if isinstance(message, bytes):
        return _frame(KIND_ERROR, message)
    if message is None:
        if body is None:
            raise ValueError("a batch frame without a message needs its serialized bytes")
        return _frame(KIND_BATCH, body)
    return _frame(_KINDS[type(message)], message.SerializeToString() if body is None else body)


def encode_error(code_name: str, details: str) -> bytes:
    return _frame(KIND_ERROR, f"{code_name}:{details}".encode("utf-8", "replace"))


def encode_outcome(outcome: dict) -> bytes:
    """The sidecar's answer to a session close: what became of the session's records upstream."""
    return _frame(KIND_OUTCOME, json.dumps(outcome, sort_keys=True).encode())


def read_frame(read) -> tuple[int, bytes] | None:
    """(kind, body) from a `read(n)` callable; None at a clean end; SpoolError when corrupt."""
    header = read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise SpoolError("torn frame header")
    magic, length, crc, kind = _HEADER.unpack(header)
    if magic != MAGIC:
        raise SpoolError("no frame marker")
    if (kind not in _TYPES and kind not in _RAW_KINDS) or length > MAX_FRAME_BYTES:
        raise SpoolError(f"bad frame (kind {kind}, length {length})")
    body = read(length)
    if len(body) < length:
        raise SpoolError("torn frame body")
    if _crc(length, kind, body) != crc:
        raise SpoolError("frame checksum mismatch")
    return kind, body


def decode(kind: int, body: bytes):
    if kind == KIND_ERROR:
        return body
    if kind == KIND_OUTCOME:
        return json.loads(body)
    message = _TYPES[kind]()
    message.ParseFromString(body)
    return message


class SpoolWriter:
    """Appends whole frames to one session's spool file; a failed append leaves no partial frame.

    `append(..., durable=True)` returns only after the frame is on stable storage (fdatasync):
    that is what the node sidecar does before it acks a batch to a rank. Without it a frame is
    in the OS's hands when `append` returns (it survives a killed process, not an OS crash) and
    `sync()` makes everything so far durable.
    """

    def __init__(self, directory: str | Path, run: str, rank: int, session_id: str,
                 tag: str = "") -> None:
        """`tag` keeps writers of one session apart (the sidecar's relay copy vs the agent's).

        Raises wire.names.BadName (a ValueError) for a run name or session id that could not be
        registered: no path is built from such a name.
        """
        name = spool_file_name(run, rank, session_id, tag, SUFFIX)
        self._open(Path(directory) / name)

    @classmethod
    def reopen(cls, path: str | Path, truncate_to: int | None = None) -> SpoolWriter:
        """Append to an existing spool file (a restarted sidecar resuming a session).

        `truncate_to` (SpoolContents.end) first cuts off a torn tail, so new frames follow the
        last complete one.
        """
        writer = cls.__new__(cls)
        writer._open(Path(path), truncate_to)
        return writer

    def _open(self, path: Path, truncate_to: int | None = None) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        size = os.fstat(self._fd).st_size
        if truncate_to is not None and truncate_to < size:
            os.ftruncate(self._fd, truncate_to)
            size = truncate_to
        self.bytes_written = size
        """Offset of the end of the last complete frame (the file's size after each append)."""

    @property
    def closed(self) -> bool:
        return self._fd is None

    def append(self, message, *, durable: bool = False, body: bytes | None = None) -> int:
        """Write one frame (`body`: the message already serialized); raise OSError (with the
        file back at its last frame) if it fails."""
        if self._fd is None:
            raise ValueError(f"{self.path}: spool writer is closed")
        data = encode(message, body)
        good = self.bytes_written
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                if n <= 0:  # pragma: no cover - a zero-length write is an error here
                    raise OSError(f"{self.path}: short write")
                view = view[n:]
            if durable:
                os.fdatasync(self._fd)
        except BaseException:
            self._truncate(good)
            raise
        self.bytes_written = good + len(data)
        return len(data)

    def _truncate(self, good: int) -> None:
        """Cut the file back to `good` bytes; if even that fails, later appends refuse."""
        fd = self._fd
        if fd is None:
            return
        try:
            os.ftruncate(fd, good)
        except OSError:
            os.close(fd)
            self._fd = None

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass
class SpoolContents:
    """What one spool file holds, in order, and what of it could not be read.

    `skipped_frames` counts frames that were torn or corrupt (each bad frame marker, or a bad
    region without one, counts once), `skipped_bytes` the bytes passed over; `torn` describes
    the first problem (None when the whole file was readable). `end` is the offset just past
    the last good frame (a writer resuming the file truncates a torn tail to it).
    """

    path: Path
    register: pb.RegisterRequest | None
    batches: list[pb.RecordBatch]
    close: pb.CloseSessionRequest | None
    torn: str | None = None
    skipped_frames: int = 0
    skipped_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    end: int = 0

    @property
    def clean(self) -> bool:
        return not self.skipped_frames and not self.skipped_bytes


def _parse_at(buf, pos: int, size: int) -> tuple[int, bytes, int] | str:
    """(kind, body, next offset) of the format-2 frame at `pos`, or why there is none."""
    if size - pos < _HEADER.size:
        return "torn frame header"
    magic, length, crc, kind = _HEADER.unpack_from(buf, pos)
    if magic != MAGIC:
        return "no frame marker"
    if kind not in _TYPES or length > MAX_FRAME_BYTES:
        return f"bad frame (kind {kind}, length {length})"
    start = pos + _HEADER.size
    if size - start < length:
        return "torn frame body"
    body = bytes(buf[start:start + length])
    if _crc(length, kind, body) != crc:
        return "frame checksum mismatch"
    return kind, body, start + length


def _parse_legacy_at(buf, pos: int, size: int) -> tuple[int, bytes, int] | str:
    if size - pos < _LEGACY_HEADER.size:
        return "torn frame header"
    length, crc, kind = _LEGACY_HEADER.unpack_from(buf, pos)
    if kind not in _TYPES or length > MAX_FRAME_BYTES:
        return f"bad frame (kind {kind}, length {length})"
    start = pos + _LEGACY_HEADER.size
    if size - start < length:
        return "torn frame body"
    body = bytes(buf[start:start + length])
    if crc32(bytes([kind]) + body) != crc:
        return "frame checksum mismatch"
    return kind, body, start + length


def read_spool(path: str | Path) -> SpoolContents:
    """Read every intact frame of a spool file, skipping (and counting) torn or corrupt ones.

    Raises SpoolError when the file holds no readable registration (not a numaudit spool).
    """
    path = Path(path)
    out = SpoolContents(path, None, [], None)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise SpoolError(f"{path}: empty; not a numaudit spool")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _read_frames(buf, size, out)
    if out.register is None:
        raise SpoolError(f"{path}: no registration frame; not a numaudit spool")
    return out


def _read_frames(buf, size: int, out: SpoolContents) -> None:
    pos = 0
    legacy = buf[:4] != MAGIC and isinstance(_parse_legacy_at(buf, 0, size), tuple)
    while pos < size:
        if legacy and buf[pos:pos + 4] != MAGIC:
            parsed = _parse_legacy_at(buf, pos, size)
        else:
            legacy = False
            parsed = _parse_at(buf, pos, size)
        if isinstance(parsed, tuple):
            kind, body, nxt = parsed
            try:
                message = decode(kind, body)
            except Exception:
                parsed = "undecodable frame"
            else:
                _take(out, kind, message)
                out.end = pos = nxt
                continue
        # A bad frame: note it and resynchronize on the next marker whose frame checks out.
        out.skipped_frames += 1
        out.problems.append(f"{parsed} at byte {pos}")
        if out.torn is None:
            out.torn = out.problems[-1]
        nxt = buf.find(MAGIC, pos + 1)
        if nxt < 0:
            out.skipped_bytes += size - pos
            return
        out.skipped_bytes += nxt - pos
        legacy, pos = False, nxt


def _take(out: SpoolContents, kind: int, message) -> None:
    if kind == KIND_REGISTER:
        if out.register is None:
            out.register = message
    elif kind == KIND_BATCH:
        out.batches.append(message)
    elif kind == KIND_CLOSE:
        out.close = message


def spool_files(paths: list[str | Path]) -> Iterator[Path]:
    """Files named directly, and every *.spool file under named directories, sorted."""
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(p.rglob(f"*{SUFFIX}"))
        else:
            yield p
