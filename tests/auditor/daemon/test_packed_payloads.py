"""Payloads inside packed batches (`PackedRecords.payloads`): the daemon checks them by the same
rules as per-record payloads, names a fault by the record (`packed[i].payload...`), applies the
batch's payload and decompression budgets to them, and stores what per-record payloads store."""

from __future__ import annotations

import sqlite3
import zlib

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from numaudit.auditor.daemon import validate_columns as vc
from numaudit.auditor.daemon.validate import CorruptPayload, TooLarge, validate_batch
from numaudit.auditor.store.writer import StoreWriter
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches as WB
from numaudit.wire import limits
from numaudit.wire import record_form as RF
from tests.auditor.builders import (
    batch,
    float32_bytes,
    none_record,
    payload_for,
    record,
    register_request,
)
from tests.auditor.daemon.test_packed_validate import _outcome

pytestmark = pytest.mark.timeout(60)


def _packed(records: list[pb.Record], seq: int = 1, session: str = "sess-0") -> pb.RecordBatch:
    """Every record packed, payloads included (what the agent sends a daemon of this build)."""
    b = WB.split_batch(session, seq, RF.from_records(records), None)
    assert not len(b.records)
    return b


def _zstd(raw: bytes) -> pb.Payload:
    data = zstandard.ZstdCompressor(level=1).compress(raw)
    return payload_for(data, raw_nbytes=len(raw))


def _records(p: pb.Payload) -> list[pb.Record]:
    carrier = record(site="carrier", shape=(4, 3))
    carrier.payload.CopyFrom(p)
    return [record(microbatch=1), none_record(), carrier, record(site="after", shape=(2, 3))]


_FAULTS = [
    ("codec", "lz4"), ("codec", ""), ("raw_nbytes", 47), ("raw_nbytes", -1),
    ("compressed_nbytes", 3), ("crc32", 12345), ("chunk_index", 1), ("chunk_count", 0),
    ("chunk_count", -2), ("data", b""), ("data", b"not a zstd frame at all"),
]


def test_payload_faults_get_the_per_record_verdict_named_by_the_packed_record():
    raw = float32_bytes(12)
    assert _outcome(batch(1, _records(_zstd(raw)))) is None
    assert _outcome(_packed(_records(_zstd(raw)))) is None
    refused = 0
    for name, value in _FAULTS:
        p = _zstd(raw)
        setattr(p, name, value)
        want = _outcome(batch(1, _records(p)))
        got = _outcome(_packed(_records(p)))
        refused += want is not None
        assert got == (None if want is None else want.replace("records[2]", "packed[2]")), name
        if want is not None:
            assert got.startswith("packed[2].payload"), got
    assert refused == len(_FAULTS)


def test_a_stream_of_chunks_is_verified_whole_when_the_batch_holds_it():
    raw = float32_bytes(12)
    data = zstandard.ZstdCompressor(level=1).compress(raw)
    size = -(-len(data) // 3)
    chunks = [pb.Payload(codec="zstd", raw_nbytes=len(raw), compressed_nbytes=len(data),
                         crc32=zlib.crc32(data), chunk_index=i, chunk_count=3,
                         data=data[i * size:(i + 1) * size]) for i in range(3)]

    def carriers(ps):
        out = []
        for p in ps:
            r = record(site="logits", shape=(4, 3))
            r.payload.CopyFrom(p)
            out.append(r)
        return [record(site="first")] + out

    cols = validate_batch(_packed(carriers(chunks)))
    assert sorted(cols.payloads) == [1, 2, 3]
    chunks[2].data = bytes(len(chunks[2].data))  # corrupted, still the right length
    with pytest.raises(CorruptPayload) as err:
        validate_batch(_packed(carriers(chunks)))
    assert err.value.field == "packed[1].payload.crc32"


def test_a_payload_row_outside_the_message_or_given_twice_is_refused():
    b = _packed(_records(_zstd(float32_bytes(12))))
    extra = b.packed.payloads.add(row=b.packed.count)
    extra.payload.CopyFrom(b.packed.payloads[0].payload)
    b.ClearField("records_crc32")
    assert _outcome(b) == "packed.payloads[1].row: 4 is not a record of this message (count 4)"
    b.packed.payloads[1].row = -1
    assert _outcome(b) == "packed.payloads[1].row: -1 is not a record of this message (count 4)"
    b.packed.payloads[1].row = 2
    assert _outcome(b) == "packed.payloads[1].row: record 2 already has a payload chunk"


def test_a_payload_on_a_none_record_is_refused_packed_too():
    records = _records(_zstd(float32_bytes(12)))
    b = _packed(records)
    b.packed.payloads.add(row=1).payload.CopyFrom(b.packed.payloads[0].payload)  # the None one
    b.ClearField("records_crc32")
    assert _outcome(b) == "packed[1].payload: must be absent when is_none is set"


def test_packed_payloads_count_toward_the_batch_budgets(monkeypatch):
    records = [record(0, j, payload=float32_bytes(12)) for j in range(3)]
    monkeypatch.setattr(limits, "MAX_BATCH_RAW_BYTES", 100)
    with pytest.raises(TooLarge, match="payloads would decompress to 144 bytes"):
        validate_batch(_packed(records))
    monkeypatch.setattr(limits, "MAX_BATCH_RAW_BYTES", 1 << 30)
    total = sum(len(r.payload.data) for r in records)
    monkeypatch.setattr(limits, "MAX_BATCH_PAYLOAD_BYTES", total - 1)
    with pytest.raises(TooLarge, match=f"records: payload data of {total} bytes exceeds"):
        validate_batch(_packed(records))


def test_packed_payloads_store_what_per_record_payloads_store(tmp_path):
    raw = float32_bytes(12)
    records = _records(_zstd(raw)) + [record(3, 0, site="raw", payload=raw)]
    w = StoreWriter(tmp_path / "audit.db", synchronous="NORMAL")
    try:
        w.submit(lambda s: s.register(register_request())).result(10)
        w.submit(lambda s: s.register(register_request(run="cand", session_id="sess-1"))).result(10)
        a = w.submit(lambda s: s.ingest(batch(1, records))).result(10)
        b = w.submit(lambda s: s.ingest(_packed(records, session="sess-1"))).result(10)
        again = w.submit(lambda s: s.ingest(_packed(records, seq=2, session="sess-1"))).result(10)
    finally:
        w.close()
    assert a.stored == b.stored == len(records) and again.duplicates == len(records)
    conn = sqlite3.connect(tmp_path / "audit.db")
    try:
        chunks = conn.execute(
            "SELECT u.name, s.name, c.chunk_index, c.chunk_count, c.codec, c.raw_nbytes,"
            " c.compressed_nbytes, c.crc32, c.data, r.content_hash FROM payload_chunks c"
            " JOIN records r USING (record_id) JOIN sites s USING (site_id)"
            " JOIN runs u ON u.run_id = r.run_id ORDER BY s.name, u.name").fetchall()
    finally:
        conn.close()
    ref = [c[1:] for c in chunks if c[0] == "ref"]
    cand = [c[1:] for c in chunks if c[0] == "cand"]
    assert len(ref) == 2 and ref == cand


def _every_row_checked(b: pb.RecordBatch) -> str | None:
    """The verdict when every record is rebuilt and checked by the per-record rules (what the
    daemon did before the vectorized rules marked suspects): the reference."""
    suspects = vc.suspects
    vc.suspects = lambda c, *args: np.arange(c.n)
    try:
        return _outcome(b)
    finally:
        vc.suspects = suspects


_PAYLOAD_MUTATIONS = [
    ("codec", ["lz4", "", "raw"]), ("raw_nbytes", [47, 0, -1, 1 << 40]),
    ("compressed_nbytes", [-1, 0, 5, 1 << 20]), ("chunk_index", [-1, 1, 2]),
    ("chunk_count", [0, -1, 2, 1 << 30]), ("data", [b"", b"x" * 7]), ("crc32", [0, 1]),
]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_payload_rows_get_the_verdict_of_checking_every_row(data):
    """Records with a payload are not all checked one by one any more: the vectorized rules
    try each payload's header and mark only the failing ones. Any mutation of payload fields
    (on records with a payload, on others, on an is_none record) gets the verdict and message
    of checking every record by the per-record rules, per record and packed."""
    raw = float32_bytes(12)
    records = _records(_zstd(raw)) + [record(2, 0, site="more", payload=raw)]
    for _ in range(data.draw(st.integers(1, 2))):
        r = records[data.draw(st.integers(0, len(records) - 1))]
        name, values = data.draw(st.sampled_from(_PAYLOAD_MUTATIONS))
        setattr(r.payload, name, data.draw(st.sampled_from(values)))
    per_record = batch(1, records)
    assert _outcome(per_record) == _every_row_checked(per_record)
    packed = _packed(records)
    assert _outcome(packed) == _every_row_checked(packed)
