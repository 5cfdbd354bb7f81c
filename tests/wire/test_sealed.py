"""wire.sealed writes the batch protobuf would: the same bytes as the deterministic
serialization of split_batch's message (its checksum set to what the daemon computes), for any
columns the agent builds, payload chunks given as views included."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches as WB
from numaudit.wire import checksum
from numaudit.wire import packed as P
from numaudit.wire import record_form as RF
from numaudit.wire.sealed import sealed_batch
from tests.auditor.builders import none_record, record


def _protobufs(session: str, seq: int, cols: P.RecordColumns) -> bytes:
    msg = WB.split_batch(session, seq, cols, None, checksum=False)
    msg.records_crc32 = checksum.batch_checksum(msg)
    return msg.SerializeToString(deterministic=True)


def _check(session: str, seq: int, cols: P.RecordColumns) -> bytes:
    body = sealed_batch(session, seq, cols)
    assert body == _protobufs(session, seq, cols)
    msg = pb.RecordBatch.FromString(body)
    assert checksum.received_records_checksum(body) == msg.records_crc32
    return body


@st.composite
def _records(draw):
    out = []
    for j in range(draw(st.integers(0, 12))):
        if draw(st.booleans()) and j % 3 == 2:
            out.append(none_record(step=draw(st.integers(0, 3)), site=f"p{j}"))
            continue
        shape = (draw(st.integers(1, 5)), draw(st.integers(1, 4)))
        payload = (None if draw(st.booleans())
                   else draw(st.binary(min_size=0, max_size=300)))
        r = record(draw(st.integers(0, 1 << 40)), draw(st.integers(-1, 9)),
                   draw(st.sampled_from(["a", "layers.0.mlp", "é∂", "x" * 200])),
                   phase=draw(st.sampled_from([pb.PHASE_FWD, pb.PHASE_BWD, pb.PHASE_GRAD])),
                   shape=shape, fingerprint=draw(st.integers(0, (1 << 64) - 1)),
                   payload=payload)
        r.stage = draw(st.integers(-1, 3))
        r.capture_order = draw(st.integers(0, 1 << 53))  # field 39: written after payloads
        r.digest.sum = draw(st.floats(allow_nan=True, allow_infinity=True))
        out.append(r)
    return out


@given(_records(), st.integers(1, (1 << 62)), st.sampled_from(["s", "", "session-é" * 9]))
def test_the_sealed_bytes_are_protobufs_serialization(records, seq, session):
    _check(session, seq, RF.from_records(records))


def test_raw_payload_views_and_chunks_encode_as_their_bytes():
    """The agent's payload chunks (PayloadChunk, their data a memoryview of its host copy, a
    large payload cut into chunks) encode as the same Payload messages would."""
    records = [record(0, j, site=f"m{j}") for j in range(5)]
    cols = RF.from_records(records)
    raw = np.random.default_rng(0).standard_normal(3000).astype("<f4")
    view = memoryview(raw).cast("B")
    cols.payloads = {
        0: P.PayloadChunk("raw", view.nbytes, view.nbytes, zlib.crc32(view), 0, 1, view),
        3: P.PayloadChunk("raw", view.nbytes, view.nbytes, zlib.crc32(view), 1, 3,
                          view[4000:8000]),
        4: P.PayloadChunk("zstd", 10, 0, 0, 0, 1, b""),  # zero fields and no data: left out
    }
    body = _check("s", 7, cols)
    got = pb.RecordBatch.FromString(body).packed.payloads
    assert [p.row for p in got] == [0, 3, 4]
    assert got[0].payload.data == raw.tobytes() and got[0].payload.codec == "raw"
    assert got[1].payload.data == raw.tobytes()[4000:8000] and got[1].payload.chunk_index == 1
    assert got[2].payload.data == b"" and got[2].payload.raw_nbytes == 10


def test_a_batch_without_records_has_no_packed_field():
    body = _check("s", 1, P.empty())
    assert not pb.RecordBatch.FromString(body).HasField("packed")


def test_columns_with_records_they_cannot_hold_are_refused():
    """Records whose layout lists differ in length travel per record (packed_batch); the
    encoder, which writes columns only, refuses them rather than dropping them."""
    odd = record(0, 1)
    odd.layout.offsets.append(0)  # 3 offsets for a 2-dim tensor: not a column row
    cols = RF.from_records([record(0, 0), odd])
    assert cols.unfit
    with pytest.raises(ValueError, match="cols.unfit: 1 records"):
        sealed_batch("s", 1, cols)
