"""The batch checksum both ends compute: what `RecordBatch.records_crc32` holds.

Definition (docs/protocol.md): the CRC-32 (zlib), chained in order, of the bytes of every
`records` entry (field 4) and of the `packed` message (field 6) exactly as they appear in the
serialized RecordBatch. The daemon
computes it from the bytes it received, before parsing them into anything else
(`received_records_checksum`), so any valid encoding a client chooses (field order, packed or
unpacked repeated fields) checks as long as the client summed what it sent.

The agent's sender writes its batches' bytes itself, checksum included (wire/sealed.py).
`batch_checksum` gives the value from a message: a protobuf serializer embeds each record's own
serialization, so summing each record's `SerializeToString()` is the same.

`crc32(data, value=0)` is zlib's CRC-32 (the one every checksum of the protocol, spool frames and
payloads uses), from ISA-L where its wheel is installed: 16-18 GB/s against zlib's 1.8-2.2 GB/s
on this machine's Xeon, with the same values (tests/wire/test_checksum.py).
"""

from __future__ import annotations

try:  # ISA-L's CRC-32: the same function as zlib's, about 10x faster (PCLMULQDQ folding)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - a platform without isal wheels
    from zlib import crc32

RECORDS_FIELD = 4
"""Field number of `RecordBatch.records`."""
PACKED_FIELD = 6
"""Field number of `RecordBatch.packed`."""
_SUMMED = (RECORDS_FIELD, PACKED_FIELD)


def records_checksum(records) -> int:
    """CRC-32 of each record's serialization, chained in batch order (the sender's side)."""
    crc = 0
    for r in records:
        crc = crc32(r.SerializeToString(deterministic=True), crc)
    return crc


def batch_checksum(batch) -> int:
    """The sender's checksum of a whole batch: its records, then its packed records (the order
    protobuf serializes them in)."""
    crc = records_checksum(batch.records)
    if batch.HasField("packed"):
        crc = crc32(batch.packed.SerializeToString(deterministic=True), crc)
    return crc


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def received_records_checksum(data: bytes) -> int:
    """The checksum of the `records` entries and `packed` message of a serialized RecordBatch,
    from its bytes as received (the daemon's side). ValueError when the bytes are not protobuf
    wire format."""
    return _walk(data)


def _walk(data: bytes) -> int:
    """The checksum of fields 4 and 6 of a serialized RecordBatch."""
    view = memoryview(data)
    crc, i, n = 0, 0, len(data)
    while i < n:
        tag, i = _varint(data, i)
        wire_type = tag & 7
        if wire_type == 0:
            _, i = _varint(data, i)
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        elif wire_type == 2:
            length, i = _varint(data, i)
            if tag >> 3 in _SUMMED:
                crc = crc32(view[i:i + length], crc)
            i += length
        else:
            raise ValueError(f"wire type {wire_type} at top level")
        if i > n:
            raise ValueError("field runs past the end")
    return crc
