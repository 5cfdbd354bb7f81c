"""Issue 10 item 8: `records_crc32` is checked against the bytes as received.

A valid alternative encoding of a batch (here: each record's fields in reverse order) with the
checksum of what was sent is stored, not ABORTED on every resend; a flipped byte is still
ABORTED; unknown fields are ignored (dropped on receipt, never stored or hashed)."""

from __future__ import annotations

import zlib

import grpc
import pytest

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.checksum import received_records_checksum, records_checksum
from tests.auditor.builders import V1, batch, record, register_request

T = 10
pytestmark = pytest.mark.timeout(60)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _fields(data: bytes) -> list[bytes]:
    """The top-level fields of a message, each as its raw bytes (tag included)."""
    from numaudit.wire.checksum import _varint as read_varint

    out, i = [], 0
    while i < len(data):
        start = i
        tag, i = read_varint(data, i)
        wt = tag & 7
        if wt == 0:
            _, i = read_varint(data, i)
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            n, i = read_varint(data, i)
            i += n
        out.append(data[start:i])
    return out


def _encode_batch(seq: int, session: str, record_bytes: list[bytes]) -> bytes:
    head = pb.RecordBatch(schema_version=V1, session_id=session, seq=seq).SerializeToString()
    body = b"".join(b"\x22" + _varint(len(r)) + r for r in record_bytes)  # field 4, wire type 2
    crc = 0
    for r in record_bytes:
        crc = zlib.crc32(r, crc)
    return head + body + b"\x28" + _varint(crc)  # field 5 (records_crc32), varint


def _raw_ingest(channel, data: bytes) -> list[pb.Ack]:
    call = channel.stream_stream("/numaudit.v1.Auditor/Ingest", request_serializer=None,
                                 response_deserializer=pb.Ack.FromString)
    return list(call(iter([data]), timeout=T))


def test_agent_and_daemon_sums_agree():
    b = batch(1, [record(0, i, "layers.0") for i in range(5)])
    b.records_crc32 = records_checksum(b.records)
    assert received_records_checksum(b.SerializeToString()) == b.records_crc32


def test_alternative_encoding_is_stored_not_aborted(auditor_server, auditor_stub):
    auditor_stub.Register(register_request(), timeout=T)
    recs = [record(0, i, "layers.0") for i in range(3)]
    reordered = [b"".join(reversed(_fields(r.SerializeToString()))) for r in recs]
    assert all(pb.Record.FromString(x) == r for x, r in zip(reordered, recs))
    assert reordered != [r.SerializeToString() for r in recs]
    with grpc.insecure_channel(auditor_server.address) as ch:
        (ack,) = _raw_ingest(ch, _encode_batch(1, "sess-0", reordered))
        assert ack.stored == 3
        sent = _encode_batch(2, "sess-0", [reordered[0]])
        corrupt = sent.replace(b"layers.0", b"layers.1")  # still parses; not what was summed
        with pytest.raises(grpc.RpcError) as info:
            _raw_ingest(ch, corrupt)
        assert info.value.code() == grpc.StatusCode.ABORTED
        assert info.value.details().startswith("records_crc32:")


def test_unknown_fields_are_ignored(auditor_server, auditor_stub):
    auditor_stub.Register(register_request(), timeout=T)
    r = record(0, 0, "layers.0")
    extended = r.SerializeToString() + b"\xf8\x06\x07"  # field 111, varint 7: unknown to v1
    with grpc.insecure_channel(auditor_server.address) as ch:
        (ack,) = _raw_ingest(ch, _encode_batch(1, "sess-0", [extended]))
    assert ack.stored == 1
    (ack,) = auditor_stub.Ingest(iter([batch(2, [r])]), timeout=T)
    assert (ack.stored, ack.duplicates, ack.conflicts) == (0, 1, 0)
