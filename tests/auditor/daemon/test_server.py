"""The daemon over real sockets and a real SQLite file: round trip, acks, idempotence, bad input."""

from __future__ import annotations

import math
import queue
import resource
import sqlite3
import time
from pathlib import Path

import grpc
import pytest
import zstandard
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.store import RECORD_COLUMNS, Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
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

T = 10  # deadline of every call, seconds
pytestmark = pytest.mark.timeout(60)


def dump(db_path: Path, *, skip: dict[str, set[str]] | None = None) -> dict[str, list[tuple]]:
    """Every row of every table, in a stable order (columns in `skip` left out)."""
    skip = skip or {}
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        out = {}
        tables = [r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        for t in tables:
            cols = [r[1] for r in conn.execute(f"PRAGMA table_info({t})")
                    if r[1] not in skip.get(t, set())]
            out[t] = conn.execute(f"SELECT {', '.join(cols)} FROM {t} ORDER BY 1, 2").fetchall()
        return out
    finally:
        conn.close()


def ingest(stub, batches) -> list[pb.Ack]:
    return list(stub.Ingest(iter(batches), timeout=T))


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    """The error a call ends with (for streaming calls, after reading the whole stream)."""
    with pytest.raises(grpc.RpcError) as info:
        result = fn(*args, timeout=T, **kw)
        if not isinstance(result, Message):
            list(result)
    return info.value


def registered(stub, **kw) -> pb.RegisterResponse:
    return stub.Register(register_request(**kw), timeout=T)


# -- Round trip ------------------------------------------------------------------------------------

def test_round_trip(auditor_server, auditor_stub):
    stub = auditor_stub
    for rank in range(2):
        resp = registered(stub, session_id=f"s{rank}", rank=rank)
        assert resp.session_id == f"s{rank}" and resp.acked_seq == 0
    payload = float32_bytes(12)
    acks = ingest(stub, [
        batch(1, [record(0, j, site) for j in range(2) for site in ("layers.0", "layers.1")],
              session_id="s0"),
        batch(2, [record(0, 0, "layers.2", payload=payload), none_record(0, "layers.0.weight")],
              session_id="s0"),
    ])
    assert [(a.session_id, a.acked_seq, a.stored, a.duplicates, a.conflicts) for a in acks] == [
        ("s0", 1, 4, 0, 0), ("s0", 2, 2, 0, 0)]
    assert ingest(stub, [batch(1, [record(0, 0, "layers.0")], session_id="s1")])[0].stored == 1
    closed = stub.CloseSession(pb.CloseSessionRequest(
        schema_version=1, session_id="s0", records_sent=6, records_dropped=3,
        dropped_by_reason={"queue_full": 3}), timeout=T)
    assert closed.records_stored == 6

    runs = stub.ListRuns(pb.ListRunsRequest(), timeout=T).runs
    assert [(r.run, r.world_size, r.ranks_registered, r.ranks_closed, r.records) for r in runs] == [
        ("ref", 2, 2, 1, 7)]

    d = stub.DescribeRun(pb.DescribeRunRequest(run="ref"), timeout=T)
    assert list(d.mesh_shape) == [2] and list(d.mesh_dim_names) == ["dp"]
    assert (d.torch_version, d.dtype, d.seed, dict(d.labels)) == ("2.13.0", "float32", 1234,
                                                                  {"model": "tiny"})
    ranks = {r.rank: r for r in d.ranks}
    assert ranks[0].closed and ranks[0].records_sent == 6 and ranks[0].records_dropped == 3
    assert dict(ranks[0].dropped_by_reason) == {"queue_full": 3}
    assert not ranks[1].closed and ranks[1].records_sent == -1 and ranks[1].records_dropped == -1
    assert (ranks[0].records_stored, ranks[1].records_stored) == (6, 1)
    assert list(ranks[1].mesh_coordinate) == [1] and list(ranks[1].stages) == [0]
    assert list(d.steps) == [0] and d.microbatches == 2
    phases = {p.phase: (p.sites, p.records, p.none_records) for p in d.phases}
    assert phases == {pb.PHASE_FWD: (3, 6, 0), pb.PHASE_GRAD: (1, 1, 1)}
    assert list(d.none_grad_sites) == ["layers.0.weight"] and d.conflicts == 0

    reader = Reader(auditor_server.db_path)
    try:
        rid = next(r[RECORD_COLUMNS.index("record_id")] for r in reader.records("ref")
                   if r[3] == "layers.2")
        header, data = reader.payload(rid)
        assert zstandard.ZstdDecompressor().decompress(data) == payload
    finally:
        reader.close()


def test_an_empty_batch_is_acked_and_the_stream_goes_on(auditor_server, auditor_stub):
    """A batch of no records breaks no rule: acked with nothing stored, and the next batch on
    the stream is stored (it was UNAVAILABLE 'unexpected ValueError' from the column checks)."""
    registered(auditor_stub, session_id="e0")
    acks = ingest(auditor_stub, [batch(1, [], session_id="e0"),
                                 batch(2, [record(0, 0, "layers.0")], session_id="e0")])
    assert [(a.acked_seq, a.stored) for a in acks] == [(1, 0), (2, 1)]


def test_ack_only_after_commit(auditor_server, auditor_stub):
    """Each ack is read back through a separate connection before the next batch is sent."""
    registered(auditor_stub)
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (item := outbox.get()) is not None:
            yield item

    acks = auditor_stub.Ingest(requests(), timeout=T)
    for seq in range(1, 4):
        outbox.put(batch(seq, [record(seq, j) for j in range(3)]))
        ack = next(acks)
        assert ack.acked_seq == seq and ack.stored == 3
        conn = sqlite3.connect(f"file:{auditor_server.db_path}?mode=ro", uri=True)
        try:
            assert conn.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 3 * seq
            assert conn.execute("SELECT acked_seq FROM sessions").fetchone()[0] == seq
        finally:
            conn.close()
    outbox.put(None)
    assert list(acks) == []


def test_register_resumes_session(auditor_stub):
    registered(auditor_stub)
    ingest(auditor_stub, [batch(1, [record()]), batch(2, [record(1)])])
    assert registered(auditor_stub).acked_seq == 2


# -- Idempotence and conflicts ---------------------------------------------------------------------

def _batches():
    return [batch(1, [record(0, j) for j in range(4)]),
            batch(2, [record(1, 0, payload=float32_bytes(12)), none_record(1)]),
            batch(3, [record(2, j, "layers.3") for j in range(3)])]


def test_same_batches_twice_leave_the_same_store(auditor_server, auditor_stub):
    registered(auditor_stub)
    first = ingest(auditor_stub, _batches())
    before = dump(auditor_server.db_path)
    again = ingest(auditor_stub, _batches())
    assert dump(auditor_server.db_path) == before
    assert [a.acked_seq for a in again] == [3, 3, 3]
    assert [a.stored for a in again] == [0, 0, 0]
    assert [a.duplicates for a in again] == [len(b.records) for b in _batches()]
    assert sum(a.stored for a in first) == 9


def test_records_resent_under_new_seq_are_stored_once(auditor_server, auditor_stub):
    registered(auditor_stub)
    ingest(auditor_stub, _batches())
    skip = {"sessions": {"acked_seq"}}
    before = dump(auditor_server.db_path, skip=skip)
    resent = [batch(3 + b.seq, b.records) for b in _batches()]
    acks = ingest(auditor_stub, resent)
    assert dump(auditor_server.db_path, skip=skip) == before
    assert [(a.acked_seq, a.stored, a.conflicts) for a in acks] == [(4, 0, 0), (5, 0, 0), (6, 0, 0)]


def test_conflict_is_flagged_and_the_original_kept(auditor_server, auditor_stub):
    registered(auditor_stub)
    ingest(auditor_stub, [batch(1, [record(fingerprint=1)])])
    ack = ingest(auditor_stub, [batch(2, [record(fingerprint=2), record(1)])])[0]
    assert (ack.stored, ack.duplicates, ack.conflicts) == (1, 0, 1)
    reader = Reader(auditor_server.db_path)
    try:
        fingerprints = [r[28] for r in reader.records("ref") if r[0] == 0]
        assert fingerprints == [1]
        assert reader.conflicts("ref") == 1
    finally:
        reader.close()
    assert auditor_stub.DescribeRun(pb.DescribeRunRequest(run="ref"), timeout=T).conflicts == 1


# -- Bad input -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One daemon for the many bad-input cases; session "sess-0" registered, seq 1 stored."""
    db = tmp_path_factory.mktemp("bad") / "audit.db"
    with BackgroundServer("127.0.0.1:0", db, grace=1.0) as server:
        with grpc.insecure_channel(server.address, options=limits.client_options()) as channel:
            stub = numaudit_pb2_grpc.AuditorStub(channel)
            registered(stub)
            ingest(stub, [batch(1, [record()])])
            yield server, stub, channel


def _valid_batch() -> pb.RecordBatch:
    return batch(2, [record(1, 0), record(1, 1, payload=float32_bytes(12)), none_record(1)])


def _set(path: str, value):
    """A mutation setting a field (dotted path, records[i] allowed) of a valid batch."""
    def mutate(b: pb.RecordBatch) -> None:
        *parents, leaf = path.split(".")
        msg = b
        for part in parents:
            if part.startswith("records["):
                msg = msg.records[int(part[8:-1])]
            else:
                msg = getattr(msg, part)
        field = msg.DESCRIPTOR.fields_by_name[leaf]
        if field.is_repeated:
            msg.ClearField(leaf)
            getattr(msg, leaf).extend(value)
        else:
            setattr(msg, leaf, value)
    return mutate


def _payload(raw_nbytes: int, data: bytes, **kw):
    def mutate(b: pb.RecordBatch) -> None:
        b.records[1].payload.CopyFrom(payload_for(data, raw_nbytes=raw_nbytes, **kw))
    return mutate


def _then(*mutations):
    def mutate(b):
        for m in mutations:
            m(b)
    return mutate


_GOOD_FRAME = zstandard.ZstdCompressor(level=1).compress(float32_bytes(12))
_NO_SIZE = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(float32_bytes(12))
INVALID, PRECONDITION, DATA_LOSS, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED)

BAD_BATCHES = {
    "schema_version_2": (_set("schema_version", 2), PRECONDITION,
                         "schema_version: version 2 is not supported; this auditor supports 1"),
    "schema_version_unset": (_set("schema_version", 0), INVALID, "schema_version: not set"),
    "unknown_session": (_set("session_id", "nobody"), PRECONDITION,
                        "session_id: 'nobody' is not registered"),
    "empty_session": (_set("session_id", ""), INVALID, "session_id: missing"),
    "seq_zero": (_set("seq", 0), INVALID, "seq: 0 is not >= 1"),
    "negative_step": (_set("records[0].key.step", -1), INVALID, "records[0].key.step"),
    "microbatch": (_set("records[0].key.microbatch", -2), INVALID, "records[0].key.microbatch"),
    "phase_unset": (_set("records[1].key.phase", 0), INVALID,
                    "records[1].key.phase: 0 is not a known Phase"),
    "phase_unknown": (_set("records[1].key.phase", 99), INVALID, "records[1].key.phase: 99"),
    "role_unknown": (_set("records[0].key.role", 42), INVALID, "records[0].key.role"),
    "site_empty": (_set("records[0].key.site", ""), INVALID, "records[0].key.site: missing"),
    "site_control": (_set("records[0].key.site", "a\x00b"), INVALID,
                     "records[0].key.site: contains non-printable"),
    "site_long": (_set("records[0].key.site", "x" * 513), INVALID,
                  "records[0].key.site: 513 characters"),
    "index": (_set("records[0].key.index", -1), INVALID, "records[0].key.index"),
    "call": (_set("records[0].key.call", -3), INVALID, "records[0].key.call"),
    "stage": (_set("records[0].stage", -2), INVALID, "records[0].stage"),
    "offset_past_shape": (
        _then(_set("records[0].layout.logical_shape", [10, 3]),
              _set("records[0].layout.offsets", [9, 0])),
        INVALID, "records[0].layout.offsets: offset 9 + shape 4 exceeds logical_shape 10 on dim 0"),
    "layout_lengths": (_set("records[0].layout.offsets", [0]), INVALID,
                       "records[0].layout.offsets: lengths differ"),
    "negative_dim": (_set("records[0].layout.logical_shape", [-8, 3]), INVALID,
                     "records[0].layout.logical_shape[0]: -8 is negative"),
    "dtype_unknown": (_set("records[0].layout.dtype", "float33"), INVALID,
                      "records[0].layout.dtype: 'float33' is not a known dtype"),
    "dtype_missing": (_set("records[0].layout.dtype", ""), INVALID,
                      "records[0].layout.dtype: missing"),
    "complex_as_real_shape": (_set("records[0].layout.complex_as_real", True), INVALID,
                              "records[0].layout.shape: complex_as_real needs a trailing dim of 2"),
    "complex_as_real_dtype": (
        _then(_set("records[0].layout.dtype", "int32"),
              _set("records[0].layout.complex_as_real", True)),
        INVALID, "records[0].layout.dtype: complex_as_real needs the real floating dtype"),
    "numel": (_set("records[0].digest.numel", 13), INVALID,
              "records[0].digest.numel: 13 != prod(layout.shape) = 12"),
    "nan_count": (_set("records[0].digest.nan_count", 13), INVALID, "records[0].digest.nan_count"),
    "negative_count": (_set("records[0].digest.zero_count", -1), INVALID,
                       "records[0].digest.zero_count"),
    "counts_sum": (_set("records[0].digest.posinf_count", 11), INVALID,
                   "records[0].digest.nan_count: nan + posinf"),
    "sum_nan": (_set("records[0].digest.sum", math.nan), INVALID, "records[0].digest.sum: NaN"),
    "max_nan": (_set("records[0].digest.max", math.nan), INVALID, "records[0].digest.max: NaN"),
    "sum_sq_negative": (_set("records[0].digest.sum_sq", -1.0), INVALID,
                        "records[0].digest.sum_sq"),
    "sketch_nan": (_set("records[0].digest.sketch", [0.0, math.nan]), INVALID,
                   "records[0].digest.sketch[1]: NaN"),
    "sketch_huge": (_set("records[0].digest.sketch", [0.0] * 65537), EXHAUSTED,
                    "records[0].digest.sketch: 65537 buckets"),
    "sketch_without_moments": (_set("records[0].digest.has_moments", False), INVALID,
                               "records[0].digest.sketch: must be empty"),
    "none_with_layout": (_set("records[2].layout.dtype", "float32"), INVALID,
                         "records[2].layout: must be empty when is_none"),
    "none_with_digest": (_set("records[2].digest.numel", 1), INVALID,
                         "records[2].digest: must be empty when is_none"),
    "codec": (_set("records[1].payload.codec", "lz4"), INVALID,
              "records[1].payload.codec: 'lz4' is not one of zstd, raw"),
    "raw_nbytes_vs_shape": (
        _payload(40, _GOOD_FRAME), INVALID,
        "records[1].payload.raw_nbytes: 40 != prod(layout.shape) 12 x itemsize 4 (float32) = 48"),
    "crc": (_set("records[1].payload.crc32", 12345), DATA_LOSS, "records[1].payload.crc32"),
    "compressed_nbytes": (_set("records[1].payload.compressed_nbytes", 5), DATA_LOSS,
                          "records[1].payload.data: "),
    "chunk_index": (_set("records[1].payload.chunk_index", 1), INVALID,
                    "records[1].payload.chunk_index: 1 is not in [0, chunk_count 1)"),
    "chunk_count": (_set("records[1].payload.chunk_count", 0), INVALID,
                    "records[1].payload.chunk_count"),
    "truncated_frame": (_payload(48, _GOOD_FRAME[:-6]), DATA_LOSS, "records[1].payload.data: zstd"),
    "garbage_frame": (_payload(48, _GOOD_FRAME[:6] + b"\xff" * 20), DATA_LOSS,
                      "records[1].payload.data: zstd decompression failed"),
    "not_zstd": (_payload(48, b"plain text, not a frame"), DATA_LOSS,
                 "records[1].payload.data: not a zstd frame"),
    "frame_without_size": (_payload(48, _NO_SIZE), INVALID,
                           "records[1].payload.data: zstd frame does not declare its content size"),
    "bomb_header_64GiB": (
        _payload(48, zstd_header(64 << 30)), DATA_LOSS,
        "records[1].payload.data: zstd frame declares 68719476736 bytes, raw_nbytes says 48"),
    "huge_window": (_payload(48, zstd_header(48, window_log=31)), EXHAUSTED,
                    "records[1].payload.data: zstd window of 2147483648 bytes"),
    "raw_size_mismatch": (_payload(48, bytes(47), codec="raw"), INVALID,
                          "records[1].payload.compressed_nbytes: 47 != raw_nbytes 48"),
    "too_many_records": (
        lambda b: b.records.extend([record(5, j) for j in range(limits.MAX_BATCH_RECORDS)]),
        EXHAUSTED, "records: 4099 records exceed the per-batch limit of 4096"),
}


def _assert_refused(server, stub, bad: pb.RecordBatch, code, message: str) -> None:
    before = dump(server.db_path)
    err = rpc_error(stub.Ingest, iter([bad]))
    assert err.code() == code, err.details()
    assert message in err.details()
    assert dump(server.db_path) == before


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batch_gets_its_status_and_stores_nothing(shared, case):
    server, stub, _ = shared
    mutate, code, message = BAD_BATCHES[case]
    bad = _valid_batch()
    mutate(bad)
    _assert_refused(server, stub, bad, code, message)


def test_zstd_bomb_claiming_64GiB_is_refused_before_allocating(shared):
    """A frame (and a layout) claiming 64 GiB: refused on the declared size, nothing allocated."""
    server, stub, _ = shared
    bad = _valid_batch()
    n = (64 << 30) // 4
    bad.records[1].layout.logical_shape[:] = [n]
    bad.records[1].layout.offsets[:] = [0]
    bad.records[1].layout.shape[:] = [n]
    bad.records[1].digest.numel = n
    bad.records[1].payload.CopyFrom(payload_for(zstd_header(64 << 30), raw_nbytes=64 << 30))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    _assert_refused(server, stub, bad, EXHAUSTED,
                    "records[1].payload.raw_nbytes: 68719476736 exceeds the per-record payload "
                    "limit")
    assert time.monotonic() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 256 << 10  # KiB


def test_batch_payload_total_is_limited(shared):
    server, stub, _ = shared
    raw = bytes(4 << 20)
    per_record = pb.Payload(codec="raw", raw_nbytes=len(raw), compressed_nbytes=len(raw), crc32=0,
                            chunk_count=1, data=raw)
    bad = batch(2, [])
    for j in range(13):  # 52 MiB of payload in a message under the 64 MiB limit
        r = record(3, j, shape=(1 << 20, 1))
        r.payload.CopyFrom(per_record)
        bad.records.append(r)
    _assert_refused(server, stub, bad, EXHAUSTED, "records: payload data of 54525952 bytes exceeds")


def test_oversize_message_is_resource_exhausted(shared):
    server, _, _ = shared
    big = _valid_batch()
    big.records[1].payload.data = bytes(limits.MAX_MESSAGE_BYTES + 1)
    with grpc.insecure_channel(server.address) as channel:  # no client-side send limit
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        err = rpc_error(stub.Ingest, iter([big]))
    assert err.code() == EXHAUSTED


def test_rejected_batch_ends_the_stream_after_earlier_acks(shared):
    server, stub, _ = shared
    good, bad = _valid_batch(), _valid_batch()
    bad.seq, bad.records[0].digest.sum = 3, math.nan
    acks = stub.Ingest(iter([good, bad]), timeout=T)
    assert next(acks).acked_seq == 2
    with pytest.raises(grpc.RpcError) as info:
        next(acks)
    assert info.value.code() == INVALID
    assert "records[0].digest.sum: NaN" in info.value.details()
    assert registered(stub).acked_seq == 2
    # The next stream resumes at seq 3.
    bad.records[0].digest.sum = 1.0
    assert ingest(stub, [bad])[0].acked_seq == 3


BAD_REGISTER = {
    "run_name": (dict(run="bad name!"), INVALID, "run: 'bad name!' is not a run name"),
    "run_long": (dict(run="r" * 129), INVALID, "run: "),
    "world_size_zero": (
        dict(world_size=0, mesh_shape=[], mesh_dim_names=[], mesh_coordinate=[]), INVALID,
        "world_size: 0"),
    "rank_beyond": (dict(rank=2, mesh_coordinate=[1]), INVALID,
                    "rank: 2 is not in [0, world_size 2)"),
    "mesh_product": (dict(mesh_shape=[3], mesh_coordinate=[0]), INVALID,
                     "mesh_shape: [3] has 3 ranks, world_size is 2"),
    "mesh_coordinate": (dict(mesh_coordinate=[2]), INVALID,
                        "mesh_coordinate[0]: 2 is not in [0, mesh_shape 2)"),
    "mesh_names": (dict(mesh_dim_names=["a", "b"]), INVALID,
                   "mesh_dim_names: 2 names for 1 mesh dims"),
    "version": (dict(schema_version=7), PRECONDITION,
                "schema_version: version 7 is not supported; this auditor supports 1"),
    "world_size_changed": (dict(session_id="other", world_size=4, mesh_shape=[4]), PRECONDITION,
                           "world_size: 4 differs from run 'ref''s 2"),
    "session_other_rank": (dict(rank=1, mesh_coordinate=[1]), PRECONDITION,
                           "session_id: already registered"),
}


@pytest.mark.parametrize("case", sorted(BAD_REGISTER))
def test_bad_register(shared, case):
    server, stub, _ = shared
    fields, code, message = BAD_REGISTER[case]
    before = dump(server.db_path)
    err = rpc_error(stub.Register, register_request(**fields))
    assert (err.code(), message in err.details()) == (code, True), err.details()
    assert dump(server.db_path) == before


def test_bad_close_and_describe(shared):
    server, stub, _ = shared
    before = dump(server.db_path)
    err = rpc_error(stub.CloseSession,
                    pb.CloseSessionRequest(schema_version=1, session_id="nobody"))
    assert err.code() == PRECONDITION and "session_id: 'nobody' is not registered" in err.details()
    err = rpc_error(stub.CloseSession, pb.CloseSessionRequest(
        schema_version=1, session_id="sess-0", records_dropped=-1))
    assert err.code() == INVALID and "records_dropped: -1 is negative" in err.details()
    err = rpc_error(stub.DescribeRun, pb.DescribeRunRequest(run="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "run: no run named 'nope'" in err.details()
    err = rpc_error(stub.DescribeRun, pb.DescribeRunRequest(run="../etc"))
    assert err.code() == INVALID and err.details().startswith("run: ")
    assert dump(server.db_path) == before


def test_compare_and_watch_refuse_unknown_runs(shared):
    # the engine's handlers (tests/auditor/cli/test_compare.py) answer through the same mapping
    _, stub, _ = shared
    err = rpc_error(stub.Compare, pb.CompareRequest(ref="a", cand="b"))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND,
                                           "run: no run named 'a' in the store")
    err = rpc_error(stub.Watch, pb.WatchRequest(ref="a", cand="b"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


_METHODS = {
    "Register": ("unary_unary", "RegisterRequest"), "Ingest": ("stream_stream", "RecordBatch"),
    "CloseSession": ("unary_unary", "CloseSessionRequest"),
    "ListRuns": ("unary_unary", "ListRunsRequest"),
    "DescribeRun": ("unary_unary", "DescribeRunRequest"),
    "Compare": ("unary_unary", "CompareRequest"), "Watch": ("unary_stream", "WatchRequest"),
}


def _raw_call(channel, method: str, data: bytes):
    kind, _ = _METHODS[method]
    multi = getattr(channel, kind)(f"/numaudit.v1.Auditor/{method}")  # identity serializers
    request = iter([data]) if kind.startswith("stream") else data
    result = multi(request, timeout=T)
    return list(result) if kind.endswith("stream") else result


@pytest.mark.parametrize("method", sorted(_METHODS))
def test_malformed_protobuf_is_invalid_argument(shared, method):
    server, _, channel = shared
    before = dump(server.db_path)
    with pytest.raises(grpc.RpcError) as info:
        _raw_call(channel, method, b"\xff\xff\xff\xff\x0f")  # field number 0: never valid
    assert info.value.code() == INVALID
    assert info.value.details() == f"request: not a valid numaudit.v1.{_METHODS[method][1]}"
    assert dump(server.db_path) == before


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(sorted(_METHODS)), data=st.binary(max_size=512))
def test_random_bytes_never_internal(shared, method, data):
    _, _, channel = shared
    try:
        _raw_call(channel, method, data)
    except grpc.RpcError as exc:
        assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                  grpc.StatusCode.UNAVAILABLE), exc.details()


# -- Fuzzing the ingest path ---------------------------------------------------------------------

_INT_EXTREMES = {
    "int64": [-(1 << 63), -1, 0, 1, (1 << 31), (1 << 63) - 1],
    "int32": [-(1 << 31), -1, 0, 1, (1 << 31) - 1],
    "uint64": [0, 1, (1 << 64) - 1], "fixed64": [0, (1 << 64) - 1], "uint32": [0, (1 << 32) - 1],
}
_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, -0.0, 5e-324]
_TYPE_NAMES = {getattr(FieldDescriptor, f"TYPE_{name.upper()}"): name for name in (
    "double", "float", "int64", "int32", "uint64", "uint32", "fixed64", "fixed32", "sfixed32",
    "sfixed64", "sint32", "sint64", "bool", "string", "bytes", "enum")}


def _field_paths() -> list[tuple[str, object]]:
    """(dotted path below a record or the batch, field descriptor) for every scalar field."""
    out = []

    def walk(desc, prefix):
        for f in desc.fields:
            if f.message_type is not None:
                walk(f.message_type, f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", f))
    for i in range(3):
        walk(pb.Record.DESCRIPTOR, f"records[{i}].")
    for name in ("schema_version", "seq"):
        out.append((name, pb.RecordBatch.DESCRIPTOR.fields_by_name[name]))
    return out


_PATHS = _field_paths()


def _value_for(field, draw):
    kind = _TYPE_NAMES[field.type]
    if kind in ("double", "float"):
        scalar = st.sampled_from(_FLOATS) | st.floats(allow_nan=True)
    elif kind in _INT_EXTREMES:
        scalar = st.sampled_from(_INT_EXTREMES[kind])
    elif kind == "enum":
        scalar = st.sampled_from([0, 1, 6, 7, 99, -1, (1 << 31) - 1])
    elif kind == "bool":
        scalar = st.booleans()
    elif kind == "string":
        scalar = st.text(max_size=600) | st.sampled_from(["", "float32", "zstd", "raw", "x" * 5000])
    else:  # bytes
        scalar = st.binary(max_size=256)
    if field.is_repeated:
        n = draw(st.sampled_from([0, 1, 3, 70, 70000]))
        return [draw(scalar)] * n
    return draw(scalar)


@st.composite
def _mutated_batches(draw):
    b = _valid_batch()
    for _ in range(draw(st.integers(1, 3))):
        path, field = draw(st.sampled_from(_PATHS))
        _set(path, _value_for(field, draw))(b)
    return b


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(bad=_mutated_batches())
def test_mutated_batches_never_internal(shared, bad):
    _, stub, _ = shared
    try:
        ingest(stub, [bad])
    except grpc.RpcError as exc:
        assert exc.code() in (INVALID, PRECONDITION, DATA_LOSS, EXHAUSTED), \
            f"{exc.code()}: {exc.details()}"


def test_server_still_serves_after_fuzzing(shared):
    server, stub, channel = shared
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=T)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    registered(stub, session_id="after-fuzz", rank=1, mesh_coordinate=[1])
    ack = ingest(stub, [batch(1, [record(9, 9, "after.fuzz")], session_id="after-fuzz")])[0]
    assert (ack.acked_seq, ack.stored) == (1, 1)
    conn = sqlite3.connect(f"file:{server.db_path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        conn.close()


# -- Standard services ---------------------------------------------------------------------------

def test_health_is_serving(auditor_server):
    with grpc.insecure_channel(auditor_server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "numaudit.v1.Auditor"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=T)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(auditor_server):
    with grpc.insecure_channel(auditor_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        [resp] = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=T))
        names = {s.name for s in resp.list_services_response.service}
        assert {"numaudit.v1.Auditor", "grpc.health.v1.Health"} <= names
        [resp] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="numaudit.v1.Auditor")]), timeout=T))
        assert resp.file_descriptor_response.file_descriptor_proto


def test_stop_ends_open_ingest_streams_promptly(tmp_path):
    """A graceful stop does not wait out the grace period for idle long-lived streams."""
    server = BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", grace=30.0)
    server.start()
    outbox: queue.Queue = queue.Queue()

    def requests():
        while (item := outbox.get()) is not None:
            yield item

    with grpc.insecure_channel(server.address) as channel:
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        registered(stub)
        acks = stub.Ingest(requests(), timeout=T)
        outbox.put(batch(1, [record()]))
        assert next(acks).acked_seq == 1
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 5
        with pytest.raises(grpc.RpcError) as info:
            next(acks)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        outbox.put(None)
    reader = Reader(tmp_path / "audit.db")
    try:
        assert len(list(reader.records("ref"))) == 1
    finally:
        reader.close()
