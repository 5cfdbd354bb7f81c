"""A packed RecordBatch written straight to its bytes, checksum included: the sender's encoder.

`sealed_batch(session_id, seq, cols)` returns the bytes of the `RecordBatch` that
`wire.batches.split_batch` builds from `cols`, with `records_crc32` set to the checksum the daemon
computes from them: the same bytes as protobuf's deterministic serialization of that message,
written without building it. Each column array, sketch and payload chunk is copied once, into
the returned bytes. Built through protobuf, a payload's bytes were copied into the message, then
again by its serialization (the DS3-style model's logits: ~6 MB a step at scale 1), each copy
into freshly allocated memory, and every column went through `tobytes` first.

The encoding is protobuf's wire format as the schema (protos/numaudit.proto) defines it; fields
are written in number order and zero scalars and empty columns are left out, as protobuf does.
tests/wire/test_sealed.py holds the result to the protobuf-built batch, byte for byte.

The agent's delivery keeps these bytes until the batch is acked, and parses them back into a
message only for a peer of an earlier build that needs the batch converted.
"""

from __future__ import annotations

import numpy as np

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.checksum import crc32
from numaudit.wire.packed import SCALAR_COLUMNS, PayloadChunk, RecordColumns

_LEN, _VARINT = 2, 0
_PACKED_FIELDS = pb.PackedRecords.DESCRIPTOR.fields_by_name


def _varint(value: int) -> bytes:
    """An unsigned varint; negative values as protobuf writes int32/int64 (two's complement,
    ten bytes)."""
    if value < 0:
        value += 1 << 64
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


_COLUMN_DTYPES = dict(SCALAR_COLUMNS)
_ARRAYS = {"dims": "<i8", "sketch": "<f8", "sample_values": "<f8", "sample_fingerprints": "<u8"}
_ATTRS = {"sample_fingerprints": "sample_fps"}
"""RecordColumns attribute of a PackedRecords array field, where the names differ."""
_FIELDS = tuple((f.name, _tag(f.number, _LEN)) for f in sorted(_PACKED_FIELDS.values(),
                                                                key=lambda f: f.number)
                if f.name != "count")
"""PackedRecords' length-delimited fields in number order (protobuf's order), with their tags."""
_COUNT = _tag(_PACKED_FIELDS["count"].number, _VARINT)
_PAYLOAD_TAG = _tag(_PACKED_FIELDS["payloads"].number, _LEN)
_ROW, _PAYLOAD = _tag(1, _VARINT), _tag(2, _LEN)
_CODEC, _RAW, _COMPRESSED, _CRC, _INDEX, _CHUNKS = (_tag(n, _VARINT if n > 1 else _LEN)
                                                    for n in range(1, 7))
_DATA = _tag(7, _LEN)
_SCHEMA, _SESSION, _SEQ = _tag(1, _VARINT), _tag(2, _LEN), _tag(3, _VARINT)
_BATCH_CRC, _BATCH_PACKED = _tag(5, _VARINT), _tag(6, _LEN)


def _bytes_field(out: list, tag: bytes, data) -> int:
    """Append a length-delimited field (``data``: bytes or a contiguous buffer); its size."""
    n = memoryview(data).nbytes
    head = tag + _varint(n)
    out.append(head)
    out.append(data)
    return len(head) + n


def _payload_header(p) -> bytes:
    """A `Payload` chunk's fields before its data."""
    if type(p) is not PayloadChunk:  # a Payload message (tests, conversions): all but data
        p = PayloadChunk(p.codec, p.raw_nbytes, p.compressed_nbytes, p.crc32, p.chunk_index,
                         p.chunk_count, b"")
    parts: list[bytes] = []
    if p.codec:
        codec = p.codec.encode()
        parts += (_CODEC, _varint(len(codec)), codec)
    for tag, value in ((_RAW, p.raw_nbytes), (_COMPRESSED, p.compressed_nbytes),
                       (_CRC, p.crc32), (_INDEX, p.chunk_index), (_CHUNKS, p.chunk_count)):
        if value:
            parts += (tag, _varint(value))
    return b"".join(parts)


def _packed_fields(cols: RecordColumns) -> tuple[list, int]:
    """The pieces of a `PackedRecords` message's encoding, in order, and their total size."""
    out: list = []
    size = 0
    if cols.n:
        head = _COUNT + _varint(cols.n)
        out.append(head)
        size += len(head)
    for name, tag in _FIELDS:
        if name in _COLUMN_DTYPES:
            a = cols.cols[name]
            if a.any():  # an all-zero column travels empty, as to_packed sends it
                size += _bytes_field(out, tag, np.ascontiguousarray(a, _COLUMN_DTYPES[name]))
        elif name in _ARRAYS:
            a = getattr(cols, _ATTRS.get(name, name))
            if len(a):
                size += _bytes_field(out, tag, np.ascontiguousarray(a, _ARRAYS[name]))
        elif name in ("sites", "dtypes"):
            for text in getattr(cols, name):
                size += _bytes_field(out, tag, text.encode())
        elif name == "payloads":  # in its place among the fields (columns follow it)
            size += _payloads(out, cols)
        else:
            raise AssertionError(f"PackedRecords.{name}: a field this encoder does not write")
    return out, size


def _payloads(out: list, cols: RecordColumns) -> int:
    """Append the `PackedRecords.payloads` entries, by row; their size."""
    size = 0
    for row in sorted(cols.payloads):
        p = cols.payloads[row]
        data = p.data
        n = memoryview(data).nbytes
        payload_head = _payload_header(p) + (_DATA + _varint(n) if n else b"")
        payload_size = len(payload_head) + n
        entry = (_ROW + _varint(row) if row else b"") + _PAYLOAD + _varint(payload_size)
        head = _PAYLOAD_TAG + _varint(len(entry) + payload_size) + entry + payload_head
        out.append(head)
        size += len(head) + n
        if n:
            out.append(data)
    return size


def sealed_batch(session_id: str, seq: int, cols: RecordColumns) -> bytes:
    """The bytes of ``split_batch(session_id, seq, cols, None)`` sealed (see the module).
    ValueError for columns with records they cannot hold as sent (``cols.unfit``, from records
    of other senders): those travel per record (`wire.batches.packed_batch`)."""
    if cols.unfit:
        raise ValueError(f"cols.unfit: {len(cols.unfit)} records the columns cannot hold; "
                         "send them with packed_batch")
    packed, size = _packed_fields(cols)
    crc = 0
    for piece in packed:
        crc = crc32(piece, crc)
    session = session_id.encode()
    head = [_SCHEMA, _varint(pb.SCHEMA_VERSION_1)]
    if session:
        head += (_SESSION, _varint(len(session)), session)
    if seq:
        head += (_SEQ, _varint(seq))
    head += (_BATCH_CRC, _varint(crc))
    if not cols.n:  # split_batch leaves `packed` unset without records
        return b"".join(head)
    head += (_BATCH_PACKED, _varint(size))
    return b"".join(head + packed)

