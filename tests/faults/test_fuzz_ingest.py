"""Fuzzing the ingest path with mutated *real* batches (tests/auditor/daemon/test_server.py fuzzes
synthetic ones field by field, and random bytes).

- hypothesis, over gRPC against a daemon subprocess: real agent batches mutated byte-wise (flips,
  truncation, insertion, splices of two batches) and field-wise (payload bytes and chunk headers,
  shapes, dtypes, counts, keys). Every answer is an ack or a specific refusal; a refusal stores
  nothing; the daemon survives and its file passes integrity_check.
- atheris (if installed), in-process and coverage-guided on the same handler path
  (tests/faults/fuzz_ingest.py), seeded with the same real batches.
"""

from __future__ import annotations

import itertools
import re
import sqlite3
import subprocess
import sys

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import batches as WB
from numaudit.wire import packed as P
from tests.faults.corpus import real_session
from tests.faults.harness import ROOT, Auditor, figure

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED}
T = 10
_counter = itertools.count()
_tried = {"bytes": 0, "fields": 0, "accepted": 0, "refused": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    register, batches = real_session(tmp / "spool")
    auditor = Auditor(tmp)
    auditor.start()
    channel = grpc.insecure_channel(auditor.address)
    try:
        yield auditor, channel, register, batches
    finally:
        channel.close()
        alive = auditor.alive()
        code = auditor.stop()
        auditor.close()
        figure("fuzz.hypothesis_cases", dict(_tried))
        assert alive and code == 0, "the daemon did not survive the fuzzing"
        conn = sqlite3.connect(f"file:{auditor.db}?mode=ro", uri=True)
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        finally:
            conn.close()


def _counts(db) -> tuple[int, int, int]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return tuple(conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                     for t in ("records", "payload_chunks", "conflicts"))
    finally:
        conn.close()


def _fresh_session(channel, register: pb.RegisterRequest) -> str:
    sid = f"fz-{next(_counter):08d}"  # fixed length: mutant positions must not depend on it
    req = pb.RegisterRequest()
    req.CopyFrom(register)
    req.session_id = sid
    numaudit_pb2_grpc.AuditorStub(channel).Register(req, timeout=T)
    return sid


def _send_raw(channel, data: bytes) -> grpc.StatusCode | None:
    call = channel.stream_stream("/numaudit.v1.Auditor/Ingest")  # identity serializers
    try:
        list(call(iter([data]), timeout=T))
        return None
    except grpc.RpcError as exc:
        assert exc.code() in REFUSALS, f"{exc.code()}: {exc.details()}"
        return exc.code()


def _check_one(daemon, data: bytes) -> None:
    auditor, channel, _, _ = daemon
    before = _counts(auditor.db)
    code = _send_raw(channel, data)
    after = _counts(auditor.db)
    if code is None:
        _tried["accepted"] += 1
    else:
        _tried["refused"] += 1
        assert after == before, f"{code.name} but the store changed: {before} -> {after}"


@st.composite
def _byte_mutants(draw, batches):
    base = draw(st.sampled_from(batches)).SerializeToString()
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "splice", "dup"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            other = draw(st.sampled_from(batches)).SerializeToString()
            j = draw(st.integers(0, len(other)))
            data[i:] = other[j:]
        else:
            j = draw(st.integers(i, min(len(data), i + 64)))
            data[j:j] = data[i:j]
    return bytes(data)


_SPECIAL = [-1, 0, 1, 2, 3, 255, 1 << 31, 1 << 40, -(1 << 62)]


def _mutate_packed(draw, b: pb.RecordBatch) -> None:
    """One value of one column of the packed records, a column cut short, or one packed
    payload's row, header or bytes."""
    m = b.packed
    if len(m.payloads) and draw(st.integers(0, 3)) == 0:
        pp = m.payloads[draw(st.integers(0, len(m.payloads) - 1))]
        field = draw(st.sampled_from(["row", "data", "raw_nbytes", "chunk_count", "crc32"]))
        if field == "row":
            pp.row = draw(st.sampled_from([-1, m.count, pp.row + 1, 0]))
        elif field == "data":
            pp.payload.data = pp.payload.data[:draw(st.integers(0, len(pp.payload.data)))]
        else:
            value = getattr(pp.payload, field) + draw(st.sampled_from([-1, 1, 1 << 20]))
            setattr(pp.payload, field, min(max(value, 0), (1 << 31) - 1))
        return
    name, dt = draw(st.sampled_from(P.SCALAR_COLUMNS + (("dims", "<i8"), ("sketch", "<f8"))))
    size = np.dtype(dt).itemsize
    raw = getattr(m, name) or (bytes(m.count * size) if name not in ("dims", "sketch") else b"")
    a = np.frombuffer(raw[:len(raw) - len(raw) % size], dt).copy()
    if not len(a) or draw(st.integers(0, 5)) == 0:
        setattr(m, name, raw[:max(0, len(raw) - draw(st.integers(1, 9)))])
        return
    i = draw(st.integers(0, len(a) - 1))
    if dt == "<f8":
        a[i] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 1e308]))
    else:
        info = np.iinfo(np.dtype(dt))
        a[i] = min(max(draw(st.sampled_from(_SPECIAL)), info.min), info.max)
    setattr(m, name, a.tobytes())


def _mutate_fields(draw, b: pb.RecordBatch) -> None:
    if b.HasField("packed") and draw(st.booleans()):
        _mutate_packed(draw, b)
        b.ClearField("records_crc32")  # past the checksum: exercise validation
        return
    if b.HasField("packed"):
        try:
            b.CopyFrom(WB.unpacked_batch(b))
        except P.PackedFormatError:  # a column cut short by an earlier mutation: leave it
            return
    r = b.records[draw(st.integers(0, len(b.records) - 1))]
    payload = [x for x in b.records if x.HasField("payload")]
    choice = draw(st.sampled_from(["payload_data", "payload_header", "shape", "dtype", "counts",
                                   "key", "sketch", "none", "duplicate"]))
    if choice.startswith("payload") and payload:
        p = draw(st.sampled_from(payload)).payload
        if choice == "payload_data" and p.data:
            d = bytearray(p.data)
            cut = draw(st.integers(0, len(d) - 1))
            if draw(st.booleans()):
                d[cut] ^= draw(st.integers(1, 255))
            else:
                del d[cut:]
            p.data = bytes(d)
        else:
            field = draw(st.sampled_from(["raw_nbytes", "compressed_nbytes", "chunk_index",
                                          "chunk_count", "crc32"]))
            delta = draw(st.sampled_from([-1, 1, 1 << 20, 1 << 40]))
            value = getattr(p, field) + delta
            lo, hi = {"crc32": (0, (1 << 32) - 1), "chunk_index": (-(1 << 31), (1 << 31) - 1),
                      "chunk_count": (-(1 << 31), (1 << 31) - 1),
                      }.get(field, (-(1 << 63), (1 << 63) - 1))
            setattr(p, field, min(max(value, lo), hi))
    elif choice == "shape" and not r.is_none and r.layout.shape:
        dim = draw(st.integers(0, len(r.layout.shape) - 1))
        target = draw(st.sampled_from(["shape", "offsets", "logical_shape"]))
        getattr(r.layout, target)[dim] += draw(st.sampled_from([-1, 1, 1 << 31]))
    elif choice == "dtype" and not r.is_none:
        r.layout.dtype = draw(st.sampled_from(["bfloat16", "float16", "int8", "float64", "bool",
                                               "complex64", "", "float32 "]))
    elif choice == "counts" and not r.is_none:
        field = draw(st.sampled_from(["numel", "nan_count", "posinf_count", "zero_count"]))
        setattr(r.digest, field, getattr(r.digest, field) + draw(st.sampled_from([-1, 1, 1 << 40])))
    elif choice == "key":
        r.key.step = draw(st.sampled_from([-1, 0, 1, (1 << 63) - 1]))
        r.key.site = draw(st.sampled_from(["", "a", "a" * 513, "x\x00y", "layers.0"]))
    elif choice == "sketch" and not r.is_none:
        r.digest.sketch.append(draw(st.sampled_from([float("nan"), float("inf"), 1e308])))
    elif choice == "none":
        r.is_none = not r.is_none
    else:
        b.records.append(b.records[0])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
@pytest.mark.timeout(120)
def test_mutated_real_batches_over_grpc(daemon, data):
    _, channel, register, batches = daemon
    sid = _fresh_session(channel, register)
    if data.draw(st.booleans()):
        b = pb.RecordBatch()
        b.CopyFrom(data.draw(st.sampled_from(batches)))
        b.session_id, b.seq = sid, 1
        for _ in range(data.draw(st.integers(1, 3))):
            _mutate_fields(data.draw, b)
        _tried["fields"] += 1
        _check_one(daemon, b.SerializeToString())
    else:
        renamed = []
        for original in batches:
            b = pb.RecordBatch()
            b.CopyFrom(original)
            b.session_id, b.seq = sid, 1
            renamed.append(b)
        _tried["bytes"] += 1
        _check_one(daemon, data.draw(_byte_mutants(renamed)))


@pytest.mark.timeout(120)
def test_unmutated_real_batches_are_stored(daemon):
    """The control: the same real batches, untouched, are accepted and stored in full."""
    auditor, channel, register, batches = daemon
    sid = _fresh_session(channel, register)
    stub = numaudit_pb2_grpc.AuditorStub(channel)
    before = _counts(auditor.db)[0]
    renamed = []
    for original in batches:
        b = pb.RecordBatch()
        b.CopyFrom(original)
        b.session_id = sid
        renamed.append(b)
    acks = list(stub.Ingest(iter(renamed), timeout=T))
    assert [a.acked_seq for a in acks] == [b.seq for b in batches]
    assert sum(a.stored + a.duplicates + a.conflicts for a in acks) == sum(
        WB.batch_record_count(b) for b in batches)
    assert _counts(auditor.db)[0] == before + sum(a.stored for a in acks)  # acked = in the store


@pytest.mark.timeout(120)
def test_atheris_on_the_ingest_path(tmp_path):
    pytest.importorskip("atheris", reason="atheris is optional: pip install atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    _, batches = real_session(tmp_path / "spool")
    for i, b in enumerate(batches):
        (corpus / f"real-{i}").write_bytes(b.SerializeToString())
    runs = 30000
    proc = subprocess.run(
        [sys.executable, "-m", "tests.faults.fuzz_ingest", str(corpus), f"-runs={runs}",
         "-max_total_time=30", "-max_len=8192", "-seed=1", "-print_final_stats=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    done = re.search(r"Done (\d+) runs in (\d+) second", out)
    executed = (int(done.group(1)) if done else
                int(re.findall(r"stat::number_of_executed_units:\s*(\d+)", out)[-1]))
    figure("fuzz.atheris_runs", executed)
    assert executed >= 500, out[-2000:]
