"""wire.checksum.crc32 (ISA-L where installed) is zlib's CRC-32: every checksum on the wire and in
spools is that function, so an agent and an auditor of different builds, with or without isal,
must compute the same values."""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import given, settings, strategies as st

from wire import checksum


@settings(max_examples=200, derandomize=True)
@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1), st.integers(0, 3000))
def test_crc32_is_zlibs_for_any_bytes_start_value_and_split(data, start, cut):
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, start) == zlib.crc32(data, start)
    head, tail = data[:cut], data[cut:]
    assert checksum.crc32(tail, checksum.crc32(head)) == zlib.crc32(data)  # chained


def test_crc32_takes_every_buffer_the_callers_pass():
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    want = zlib.crc32(data)
    assert checksum.crc32(memoryview(data)) == want  # received_records_checksum slices a view
    assert checksum.crc32(bytearray(data)) == want
    assert checksum.crc32(memoryview(data)[17:4099]) == zlib.crc32(data[17:4099])
    assert checksum.crc32(b"") == 0


def test_the_fast_crc_is_the_one_in_use():
    """isal is a dependency (pyproject.toml): the zlib fallback is for platforms without its
    wheel, not what this install runs."""
    assert checksum.crc32.__module__.startswith("isal")


def test_a_sealed_batch_is_its_message_with_the_checksum_the_daemon_computes():
    """seal() serializes once and writes the checksum into its placeholder: the bytes parse to
    the message with records_crc32 set, and that value is both the sender's and the
    receiver's sum."""
    from protos import numaudit_pb2 as pb
    from tests.auditor.builders import record
    from wire import packed as P

    records = [record(0, j, payload=b"\x05" * 48 if j % 2 else None) for j in range(6)]
    for single in (None, P.from_records(records[:2])):  # packed only; packed and per record
        msg = P.split_batch("s", 3, P.from_records(records[2:]), single, checksum=False)
        assert not msg.HasField("records_crc32")
        body = checksum.seal(msg)
        assert msg.HasField("records_crc32")
        assert pb.RecordBatch.FromString(body) == msg
        assert msg.records_crc32 == checksum.batch_checksum(msg)
        assert checksum.received_records_checksum(body) == msg.records_crc32
        assert checksum.seal(msg) == body  # sealing again sums the same bytes


def test_seal_writes_the_checksum_into_its_one_serialization(monkeypatch):
    """The checksum's varint is padded to five bytes in place (no second serialization, no
    copy of the batch to append it): a checksum under 2**28, whose shortest varint is shorter,
    leaves the sealed bytes longer than a fresh serialization, and every decoder reads it."""
    from protos import numaudit_pb2 as pb
    from tests.auditor.builders import record
    from wire import packed as P

    padded = 0
    for seq in range(64):
        msg = P.split_batch("s", seq, P.from_records([record(seq, j) for j in range(3)]), None,
                            checksum=False)
        body = checksum.seal(msg)
        fresh = msg.SerializeToString(deterministic=True)
        assert pb.RecordBatch.FromString(body) == msg
        assert checksum.received_records_checksum(body) == msg.records_crc32
        assert checksum._varint5(msg.records_crc32) in body
        if msg.records_crc32 < 1 << 28:
            padded += 1
            assert len(body) > len(fresh)
        else:  # five bytes is the shortest form: the same bytes
            assert body == fresh
    assert padded  # 1 in 16 checksums is under 2**28: some of the 64 are

    serialize = []
    monkeypatch.setattr(checksum, "_fill", lambda *a: serialize.append(a) or False)
    msg = P.split_batch("s", 1, P.from_records([record(1, 0)]), None, checksum=False)
    body = checksum.seal(msg)  # bytes it may not write into: serialized again, checksum set
    assert serialize and body == msg.SerializeToString(deterministic=True)
    assert checksum.received_records_checksum(body) == msg.records_crc32
