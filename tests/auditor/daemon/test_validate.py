"""validate.py as pure functions: what passes, what is refused, and with which field and kind."""

from __future__ import annotations

import math
import zlib

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from numaudit.auditor.daemon.validate import (
    ITEMSIZE,
    CorruptPayload,
    TooLarge,
    UnsupportedVersion,
    ValidationError,
    check_run_name,
    check_zstd_header,
    validate_batch,
    validate_close,
    validate_record,
    validate_register,
)
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from tests.auditor.builders import (
    batch,
    float32_bytes,
    none_record,
    payload_for,
    record,
    register_request,
    zstd_header,
)


def refused(fn, *args) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        fn(*args)
    return info.value


def test_valid_messages_pass():
    validate_register(register_request())
    validate_register(register_request(mesh_shape=[], mesh_dim_names=[], mesh_coordinate=[]))
    validate_batch(batch(1, [record(), none_record(), record(payload=float32_bytes(12))]))
    validate_close(pb.CloseSessionRequest(schema_version=1, session_id="s", records_sent=3,
                                          dropped_by_reason={"queue_full": 1}))


def test_error_message_is_field_colon_why():
    r = record()
    r.layout.logical_shape[:] = [10, 3]
    r.layout.offsets[:] = [9, 0]
    err = refused(validate_batch, batch(1, [record(), record(), record(), r]))
    assert str(err) == ("records[3].layout.offsets: offset 9 + shape 4 exceeds logical_shape 10 "
                        "on dim 0")
    assert (err.field, err.kind) == ("records[3].layout.offsets", "invalid")


def test_schema_versions():
    err = refused(validate_batch, pb.RecordBatch(schema_version=2, session_id="s", seq=1))
    assert isinstance(err, UnsupportedVersion) and "supports 1" in str(err)
    err = refused(validate_batch, pb.RecordBatch(session_id="s", seq=1))
    assert type(err) is ValidationError and str(err).startswith("schema_version: not set")


@pytest.mark.parametrize("name,ok", [("ref", True), ("pp8.zbv-2", True), ("a" * 128, True),
                                     ("", False), ("a" * 129, False), ("a b", False),
                                     ("../x", False), ("r\u00e9f", False)])
def test_run_names(name, ok):
    if ok:
        check_run_name(name)
    else:
        assert refused(check_run_name, name).field == "run"


# -- Records that are unusual but valid ------------------------------------------------------------

def _piece(dtype="float32", logical=(4,), offsets=(0,), shape=(4,), **digest) -> pb.Record:
    numel = math.prod(shape)
    d = dict(numel=numel, has_moments=dtype in ("float32", "float64", "bfloat16"),
             sum=0.0, sum_sq=0.0, min=0.0, max=0.0, abs_max=0.0)
    d.update(digest)
    return pb.Record(key=pb.Key(step=0, microbatch=0, phase=pb.PHASE_FWD, site="m",
                                role=pb.ROLE_OUTPUT),
                     stage=-1, layout=pb.Layout(logical_shape=logical, offsets=offsets, shape=shape,
                                                dtype=dtype),
                     digest=pb.Digest(**d))


def test_unusual_valid_records():
    validate_record(_piece(logical=(), offsets=(), shape=()))                  # 0-dim tensor
    validate_record(_piece(logical=(0, 5), offsets=(0, 0), shape=(0, 5)))      # empty tensor
    validate_record(_piece(dtype="int64", sketch=[]))                          # no moments
    validate_record(_piece(nan_count=2, posinf_count=1, neginf_count=1, min=math.inf,
                           max=-math.inf, abs_max=0.0))                        # no finite element
    validate_record(_piece(sum=math.inf, sum_sq=math.inf))                     # float64 overflow
    r = _piece(logical=(3, 2), offsets=(1, 0), shape=(2, 2))
    r.layout.complex_as_real = True
    validate_record(r)
    r.layout.replica = r.layout.partial = True                                 # Partial x Replicate
    validate_record(r)


def test_complex_as_real_rules():
    r = _piece(logical=(3, 2), offsets=(0, 0), shape=(3, 2), dtype="complex64")
    r.layout.complex_as_real = True
    assert refused(validate_record, r, "r").field == "r.layout.dtype"
    r = _piece(logical=(4, 2), offsets=(0, 1), shape=(4, 1))
    r.layout.complex_as_real = True
    assert refused(validate_record, r, "r").field == "r.layout.shape"


def test_none_record_must_be_bare():
    r = none_record()
    r.payload.codec = "raw"
    assert refused(validate_record, r, "r").field == "r.payload"


def test_logical_shape_beyond_int64():
    r = _piece(logical=(1 << 62, 4), offsets=(0, 0), shape=(1, 4))
    assert refused(validate_record, r, "r").field == "r.layout.logical_shape"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)), max_size=4),
       st.sampled_from(sorted(ITEMSIZE)))
def test_any_in_bounds_layout_passes_and_out_of_bounds_names_the_dim(dims, dtype):
    logical = [a + b + c for a, b, c in dims]
    offsets = [a for a, _, _ in dims]
    shape = [b for _, b, _ in dims]
    r = _piece(dtype=dtype, logical=logical, offsets=offsets, shape=shape, sketch=[])
    r.digest.has_moments = False
    validate_record(r)
    if dims:
        d = len(dims) - 1
        r.layout.offsets[d] = logical[d] - shape[d] + 1
        err = refused(validate_record, r, "r")
        assert str(err).startswith("r.layout.offsets: offset ") and str(err).endswith(f"on dim {d}")


# -- Payloads ------------------------------------------------------------------------------------

def _with_payload(p: pb.Payload, shape=(4, 3)) -> pb.Record:
    r = record(shape=shape)
    r.payload.CopyFrom(p)
    return r


def test_raw_codec_payload():
    raw = float32_bytes(12)
    validate_batch(batch(1, [_with_payload(payload_for(raw, raw_nbytes=48, codec="raw"))]))
    bad = payload_for(raw[:-1] + b"\x00", raw_nbytes=48, codec="raw")
    bad.crc32 ^= 1
    assert isinstance(refused(validate_batch, batch(1, [_with_payload(bad)])), CorruptPayload)


def _chunks(raw: bytes, n: int) -> list[pb.Payload]:
    data = zstandard.ZstdCompressor(level=1).compress(raw)
    size = -(-len(data) // n)
    return [pb.Payload(codec="zstd", raw_nbytes=len(raw), compressed_nbytes=len(data),
                       crc32=zlib.crc32(data), chunk_index=i, chunk_count=n,
                       data=data[i * size:(i + 1) * size]) for i in range(n)]


def test_multi_chunk_payload_checked_whole_when_complete_in_one_batch():
    raw = float32_bytes(12)
    chunks = _chunks(raw, 3)
    validate_batch(batch(1, [_with_payload(c) for c in chunks]))
    corrupt = [pb.Payload() for _ in chunks]
    for c, src in zip(corrupt, chunks):
        c.CopyFrom(src)
    corrupt[2].data = bytes(len(corrupt[2].data))
    err = refused(validate_batch, batch(1, [_with_payload(c) for c in corrupt]))
    assert isinstance(err, CorruptPayload) and err.field == "records[0].payload.crc32"


def test_multi_chunk_payload_split_across_batches_gets_header_checks():
    chunks = _chunks(float32_bytes(12), 3)
    validate_batch(batch(1, [_with_payload(chunks[0])]))
    validate_batch(batch(2, [_with_payload(chunks[1]), _with_payload(chunks[2])]))
    bad = pb.Payload()
    bad.CopyFrom(chunks[0])
    bad.data = zstd_header(1 << 40)
    err = refused(validate_batch, batch(1, [_with_payload(bad)]))
    assert isinstance(err, CorruptPayload) and "declares 1099511627776 bytes" in str(err)


def test_zstd_header_checks_come_before_decompression():
    assert isinstance(refused(check_zstd_header, zstd_header(64 << 30), 48, "p"), CorruptPayload)
    assert isinstance(refused(check_zstd_header, zstd_header(48, window_log=30), 48, "p"), TooLarge)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(b"abc")
    assert type(refused(check_zstd_header, no_size, 3, "p")) is ValidationError
    check_zstd_header(zstd_header(48), 48, "p")


def test_frame_that_decompresses_past_its_declared_size_is_corrupt():
    raw = float32_bytes(12)
    frame = zstandard.ZstdCompressor(level=1).compress(raw)
    extra = zstandard.ZstdCompressor(level=1).compress(b"more")  # a second frame
    p = payload_for(frame + extra, raw_nbytes=48)
    assert isinstance(refused(validate_batch, batch(1, [_with_payload(p)])), CorruptPayload)


def test_batch_decompression_budget(monkeypatch):
    monkeypatch.setattr(limits, "MAX_BATCH_RAW_BYTES", 100)
    records = [record(0, j, payload=float32_bytes(12)) for j in range(3)]
    err = refused(validate_batch, batch(1, records))
    assert isinstance(err, TooLarge) and "144 bytes" in str(err)


def test_kinds_of_register_errors():
    assert refused(validate_register, register_request(rank=-1)).field == "rank"
    assert refused(validate_register, register_request(local_rank=-1)).field == "local_rank"
    assert refused(validate_register, register_request(stages=[-1])).field == "stages[0]"
    twice = register_request(mesh_shape=[2, 1], mesh_dim_names=["a", "a"], mesh_coordinate=[0, 0])
    assert refused(validate_register, twice).field == "mesh_dim_names"
    labels = {f"k{i}": "v" for i in range(limits.MAX_LABELS + 1)}
    assert isinstance(refused(validate_register, register_request(labels=labels)), TooLarge)
    assert refused(validate_register, register_request(session_id="x" * 65)).field == "session_id"


def _reduced(reduce=pb.REDUCTION_MEAN, index=1, count=2, weight=8.0) -> pb.Record:
    r = _piece(logical=(), offsets=(), shape=())
    r.layout.reduce, r.layout.reduce_index = reduce, index
    r.layout.reduce_count, r.layout.reduce_weight = count, weight
    return r


def test_reduction_fields():
    validate_record(_reduced())
    validate_record(_reduced(pb.REDUCTION_SUM, index=0, count=1, weight=0.0))
    assert str(refused(validate_record, _reduced(index=2))).startswith("record.layout.reduce_index")
    assert str(refused(validate_record, _reduced(count=0))).startswith("record.layout.reduce_count")
    assert str(refused(validate_record, _reduced(weight=0.0))).startswith(
        "record.layout.reduce_weight")
    assert str(refused(validate_record, _reduced(weight=math.nan))).startswith(
        "record.layout.reduce_weight")
    r = _reduced()
    r.layout.reduce = 7
    assert str(refused(validate_record, r)).startswith("record.layout.reduce:")
    r = _reduced()
    r.layout.partial = True
    assert str(refused(validate_record, r)).startswith("record.layout.partial")
    r = _piece(logical=(4,), offsets=(2,), shape=(2,))
    r.layout.reduce, r.layout.reduce_count = pb.REDUCTION_SUM, 2
    assert "whole logical tensor" in str(refused(validate_record, r))


def _ragged(first=1, span=1, parts=2, logical=(32, 3), offsets=(12, 0), shape=(20, 3)):
    r = _piece(logical=logical, offsets=offsets, shape=shape)
    r.layout.ragged_first, r.layout.ragged_span, r.layout.ragged_parts = first, span, parts
    return r


def test_ragged_fields():
    validate_record(_ragged())
    validate_record(_ragged(first=0, span=2))
    validate_record(_ragged(offsets=(32, 0), shape=(0, 3)))  # an empty part
    for bad, field in ((dict(parts=0), "ragged_parts"), (dict(first=2), "ragged_first"),
                       (dict(span=0), "ragged_span"), (dict(span=2), "ragged_span"),
                       (dict(offsets=(12, 1), shape=(20, 2)), "shape"),
                       (dict(logical=(), offsets=(), shape=()), "logical_shape")):
        assert str(refused(validate_record, _ragged(**bad))).startswith(
            f"record.layout.{field}"), bad
    r = _ragged()
    r.layout.reduce, r.layout.reduce_count = pb.REDUCTION_SUM, 2
    assert str(refused(validate_record, r)).startswith("record.layout.")


def _flat(logical=(12,), offsets=(5,), shape=(7,)) -> pb.Record:
    r = _piece(logical=logical, offsets=offsets, shape=shape)
    r.layout.flat = True
    return r


def test_flat_fields():
    validate_record(_flat())
    validate_record(_flat(offsets=(12,), shape=(0,)))  # a rank that holds none of it
    r = _flat()
    r.layout.replica = True  # the same range on another rank (hybrid sharding)
    validate_record(r)
    err = refused(validate_record, _flat(logical=(4, 3), offsets=(0, 0), shape=(2, 3)))
    assert str(err) == ("record.layout.logical_shape: a flat piece's logical_shape is its "
                        "tensor's flattening: one dim, not 2")
    assert refused(validate_record, _flat(logical=(), offsets=(), shape=())).field == \
        "record.layout.logical_shape"
    for name, value, field in (("ragged_parts", 2, "ragged_parts"),
                               ("ragged_span", 1, "ragged_parts"), ("partial", True, "partial"),
                               ("reduce", pb.REDUCTION_SUM, "reduce"),
                               ("complex_as_real", True, "complex_as_real")):
        r = _flat()
        setattr(r.layout, name, value)
        err = refused(validate_record, r)
        assert (err.field, err.kind) == (f"record.layout.{field}", "invalid"), name
        assert "a flat piece is not" in err.why, name
    # the batch names the record, as every other check does
    err = refused(validate_batch, batch(1, [record(), _flat(logical=(4, 3), offsets=(0, 0),
                                                            shape=(2, 3))]))
    assert err.field == "records[1].layout.logical_shape"


def test_a_none_record_carries_no_flat_flag():
    r = none_record()
    r.layout.flat = True
    assert str(refused(validate_record, r, "r")) == "r.layout: must be empty when is_none is set"


def test_register_identity_and_grad_scale_fields():
    validate_register(register_request(job_id="torchelastic-123", grad_scale=2.0,
                                       grad_scale_source="inferred: dp_size 2"))
    assert str(refused(validate_register, register_request(grad_scale=-1.0))).startswith(
        "grad_scale")
    assert str(refused(validate_register, register_request(grad_scale=math.inf))).startswith(
        "grad_scale")
    assert str(refused(validate_register, register_request(job_id="j" * 300))).startswith("job_id")


def test_a_failed_decompression_leaves_the_thread_able_to_check_the_next_payload():
    """The daemon reuses one zstd context per thread: a stream that fails (a cut frame, a
    frame that decompresses too far) must not change the verdict on the next one."""
    raw = float32_bytes(12)
    frame = zstandard.ZstdCompressor(level=1).compress(raw)
    extra = zstandard.ZstdCompressor(level=1).compress(b"more")
    for bad in (frame[:-3], frame + extra):
        assert isinstance(refused(validate_batch, batch(1, [_with_payload(
            payload_for(bad, raw_nbytes=48))])), CorruptPayload)
        validate_batch(batch(1, [_with_payload(payload_for(frame, raw_nbytes=48))]))


def test_capture_order_is_a_count_from_zero():
    """0 is an agent of an earlier build (not numbered); a negative number is refused by name,
    per record and packed alike."""
    from numaudit.wire import batches as WB
    from numaudit.wire import record_form as RF

    for order in (0, 1, limits.MAX_CAPTURE_ORDER):
        r = record()
        r.capture_order = order
        validate_record(r)
    bad = record(microbatch=1)
    bad.capture_order = -5
    err = refused(validate_batch, batch(1, [record(), bad]))
    assert str(err) == f"records[1].capture_order: -5 is not in [0, {limits.MAX_CAPTURE_ORDER}]"
    err = refused(validate_batch, WB.packed_batch("sess-0", 1, RF.from_records([record(), bad])))
    assert err.field == "packed[1].capture_order"
