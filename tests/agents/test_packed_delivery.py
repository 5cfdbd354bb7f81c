"""Packed batches end to end: an agent sends them to a real daemon; a peer that does not say
`packed_batches` gets per-record batches, one that does not say `packed_payloads` gets the
payload records per record; spools of either kind replay into the same rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import grpc
import pytest
import torch

import numaudit
from numaudit.agents.delivery.delivery import Delivery
from numaudit.agents.delivery.transport import GrpcTransport
from numaudit.auditor.daemon.replay import replay_into_db
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches as WB
from numaudit.wire import record_form as RF
from numaudit.wire.checksum import batch_checksum, received_records_checksum
from numaudit.wire.spool import SpoolWriter, read_spool
from tests.auditor.builders import record, register_request

pytestmark = pytest.mark.timeout(120)


def _capture(agent, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        with agent.step(step), agent.microbatch(0):
            for i in range(5):
                agent.capture(torch.randn(4, 3, generator=g), site=f"m{i}", phase="fwd")
            agent.capture(torch.arange(6), site="ids", phase="input")
            agent.capture(None, site="none", phase="input")
            agent.capture(torch.randn(2, 2, generator=g), site="pay", phase="input")


def _stored(db) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT s.name, r.step, r.microbatch, r.phase, r.role, r.is_none, r.dtype, r.shape,"
            " r.numel, r.sum, r.fingerprint, r.sketch, r.content_hash FROM records r JOIN sites s"
            " USING (site_id) ORDER BY s.name, r.step, r.phase").fetchall()
    finally:
        conn.close()


def _spooled_session(tmp_path) -> Path:
    """The spool file of an agent that captured `_capture`'s records (spool_mode always)."""
    agent = numaudit.attach(None, run="packed", spool_dir=str(tmp_path / "spool"),
                          spool_mode="always", phases=("input", "fwd"), payload=("input:pay",),
                          sketch_k=32, batch_records=8)
    _capture(agent)
    agent.close(timeout=5.0)
    (path,) = sorted((tmp_path / "spool").glob("*.spool"))
    return path


def test_agent_sends_packed_batches_that_replay_like_per_record_ones(tmp_path):
    path = _spooled_session(tmp_path)
    contents = read_spool(path)
    assert any(b.HasField("packed") for b in contents.batches)
    assert any(len(b.packed.payloads) for b in contents.batches)  # the payload records, packed
    assert not any(len(b.records) for b in contents.batches)
    for b in contents.batches:
        assert received_records_checksum(b.SerializeToString()) == b.records_crc32
    total = sum(WB.batch_record_count(b) for b in contents.batches)
    assert total == 2 * 8
    # the same session written as a spool of an earlier build: per-record batches only
    old = SpoolWriter(tmp_path / "old", contents.register.run, 0, contents.register.session_id)
    old.append(contents.register)
    for b in contents.batches:
        old.append(WB.unpacked_batch(b))
    old.append(contents.close)
    old.close()
    (new_result,) = replay_into_db([path], tmp_path / "new.db")
    (old_result,) = replay_into_db([old.path], tmp_path / "old.db")
    assert new_result.stored == old_result.stored == total and not new_result.rejected
    assert _stored(tmp_path / "new.db") == _stored(tmp_path / "old.db")
    # replaying the old spool into the store of the new one: all duplicates (same hashes)
    (again,) = replay_into_db([old.path], tmp_path / "new.db")
    assert (again.stored, again.duplicates, again.conflicts) == (0, total, 0)


def test_agent_to_a_real_daemon_stores_every_record(tmp_path):
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        agent = numaudit.attach(None, address=srv.address, run="live", phases=("input", "fwd"),
                              payload=("input:pay",), sketch_k=16, batch_records=8)
        _capture(agent, steps=3)
        agent.close(timeout=10.0)
        assert agent._sender.delivery.transport.packed_batches
    rows = _stored(tmp_path / "audit.db")
    assert len(rows) == 3 * 8
    assert sum(1 for r in rows if r[5]) == 3  # the None captures


class _OldPeer:
    """A Transport to a daemon of an earlier build: the real gRPC transport, whose Register
    answer lacks packed_batches (as an old daemon's would), or only packed_payloads."""

    def __init__(self, address: str, packed_batches: bool = False) -> None:
        self.inner = GrpcTransport(address)
        self.sent: list[pb.RecordBatch] = []
        self.says_packed = packed_batches
        self.packed_batches = self.packed_payloads = False

    def register(self, req, timeout, abort=lambda: False):
        acked = self.inner.register(req, timeout, abort)
        self.packed_batches, self.packed_payloads = self.says_packed, False
        return acked

    def open_stream(self):
        stream = self.inner.open_stream()
        send = stream.send

        def recording_send(batch, body=None):
            self.sent.append(batch)
            send(batch, body)
        stream.send = recording_send
        return stream

    def close_session(self, req, timeout):
        self.inner.close_session(req, timeout)

    def close(self):
        self.inner.close()


def _deliver(peer, batch: pb.RecordBatch, n: int) -> Delivery:
    req = register_request(run="old", session_id="old-0")
    d = Delivery(peer, lambda: req, on_drop=lambda reason, n: None)
    assert d.offer(batch, n, batch.ByteSize())
    import time
    deadline = time.monotonic() + 20
    while d.pending and time.monotonic() < deadline:
        d.service()
        time.sleep(0.01)
    d.shutdown()
    return d


def test_a_peer_without_packed_batches_gets_per_record_batches(tmp_path):
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        peer = _OldPeer(srv.address)
        records = [record(0, j) for j in range(4)] + [record(0, 4, payload=b"\x05" * 48)]
        packed = WB.split_batch("old-0", 1, RF.from_records(records), None)
        assert len(packed.packed.payloads) == 1
        d = _deliver(peer, packed, 5)
        assert not d.pending and d.acked_records == 5
        assert peer.sent and not any(b.HasField("packed") for b in peer.sent)
        assert list(peer.sent[0].records) == records
        assert peer.sent[0].records_crc32 == batch_checksum(peer.sent[0])


def test_a_peer_without_packed_payloads_gets_the_payload_records_per_record(tmp_path):
    """A daemon of the build before packed payloads would drop PackedRecords.payloads (an
    unknown field) and store the records without them: it gets them per record instead."""
    records = [record(0, j, payload=b"\x05" * 48 if j % 2 else None) for j in range(5)]
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        peer = _OldPeer(srv.address, packed_batches=True)
        packed = WB.split_batch("old-0", 1, RF.from_records(records), None)
        d = _deliver(peer, packed, 5)
        assert not d.pending and d.acked_records == 5
        (sent,) = peer.sent
        assert sent.packed.count == 3 and not len(sent.packed.payloads)
        assert [r.key.microbatch for r in sent.records] == [1, 3]
        assert all(r.HasField("payload") for r in sent.records)
        assert sent.records_crc32 == batch_checksum(sent)
    conn = sqlite3.connect(tmp_path / "audit.db")
    try:
        assert conn.execute("SELECT COUNT(*) FROM payload_chunks").fetchone()[0] == 2
    finally:
        conn.close()


def test_a_packed_batch_that_does_not_convert_is_rejected_and_the_rest_delivered(tmp_path):
    """A sidecar relays what a local process sends: a packed batch whose columns do not fit
    cannot be converted for a peer of an earlier build. It is dropped as rejected (any peer
    would refuse it); the delivery goes on with the next batch instead of raising."""
    drops = []
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        peer = _OldPeer(srv.address)
        req = register_request(run="old", session_id="old-0")
        d = Delivery(peer, lambda: req, on_drop=lambda reason, n: drops.append((reason, n)))
        bad = WB.split_batch("old-0", 1, RF.from_records([record(0, j) for j in range(3)]), None)
        bad.packed.dims = bad.packed.dims[:-8]
        good = WB.split_batch("old-0", 2, RF.from_records([record(1, j) for j in range(2)]), None)
        assert d.offer(bad, 3, bad.ByteSize()) and d.offer(good, 2, good.ByteSize())
        import time
        deadline = time.monotonic() + 20
        while d.pending and time.monotonic() < deadline:
            d.service()
            time.sleep(0.01)
        d.shutdown()
        assert drops == [("rejected", 3)]
        assert not d.pending and d.acked_records == 2
        assert [b.seq for b in peer.sent] == [2]


class _OldDaemonStub:
    """The real Auditor stub of a daemon, whose Register answer says what a daemon of an earlier
    build would (no packed payloads, or no packed batches at all); records what Ingest got."""

    def __init__(self, stub, packed_batches: bool) -> None:
        self.stub, self.packed_batches, self.sent = stub, packed_batches, []

    def Register(self, req, **kw):
        resp = self.stub.Register(req, **kw)
        resp.packed_batches, resp.packed_payloads = self.packed_batches, False
        return resp

    def Ingest(self, batches, **kw):
        batches = list(batches)
        self.sent.extend(batches)
        return self.stub.Ingest(iter(batches), **kw)

    def CloseSession(self, req, **kw):
        return self.stub.CloseSession(req, **kw)


@pytest.mark.parametrize("packed_batches", [True, False])
def test_replay_sends_an_auditor_of_an_earlier_build_what_it_takes(tmp_path, packed_batches):
    from numaudit.auditor.daemon.replay import _replay_file
    from numaudit.protos import numaudit_pb2_grpc

    path = _spooled_session(tmp_path)
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = _OldDaemonStub(numaudit_pb2_grpc.AuditorStub(channel), packed_batches)
            result = _replay_file(stub, path, None)
    assert not result.rejected and result.error is None and result.stored == 2 * 8
    assert not any(len(b.packed.payloads) for b in stub.sent)
    assert any(len(b.records) for b in stub.sent)  # the payload records, per record
    assert all(b.HasField("packed") for b in stub.sent) == packed_batches
    (direct,) = replay_into_db([path], tmp_path / "direct.db")
    assert direct.stored == 2 * 8
    assert _stored(tmp_path / "audit.db") == _stored(tmp_path / "direct.db")


class _RecordingPeer:
    """The real gRPC transport to a current daemon; records what each send was given."""

    def __init__(self, address: str) -> None:
        self.inner = GrpcTransport(address)
        self.sent: list[tuple[pb.RecordBatch, bytes | None]] = []

    def __getattr__(self, name):  # packed_batches, packed_payloads, close_session, close ...
        return getattr(self.inner, name)

    def register(self, req, timeout, abort=lambda: False):
        return self.inner.register(req, timeout, abort)

    def open_stream(self):
        stream = self.inner.open_stream()
        send = stream.send

        def recording_send(batch, body=None):
            self.sent.append((batch, body))
            send(batch, body)
        stream.send = recording_send
        return stream


def _sealed(seq: int) -> bytes:
    from numaudit.wire.sealed import sealed_batch

    return sealed_batch("seal-0", seq, RF.from_records(
        [record(seq, j, payload=b"\x07" * 48 if j == 1 else None) for j in range(4)]))


def _service_until_acked(d: Delivery) -> None:
    import time
    deadline = time.monotonic() + 20
    while d.pending and time.monotonic() < deadline:
        d.service()
        time.sleep(0.01)


def test_batches_with_their_bytes_go_out_as_those_bytes_and_resends_serialize_again(tmp_path):
    """A batch offered as a message with its bytes (what a node sidecar relays) goes to gRPC as
    those bytes; one offered before the stream is open, or pending when it breaks, is
    serialized at its send instead (its bytes are not held twice while it waits)."""
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        peer = _RecordingPeer(srv.address)
        req = register_request(run="seal", session_id="seal-0")
        drops = []
        d = Delivery(peer, lambda: req, on_drop=lambda reason, n: drops.append((reason, n)))
        b1, b2, b3 = _sealed(1), _sealed(2), _sealed(3)
        m1, m2, m3 = (pb.RecordBatch.FromString(b) for b in (b1, b2, b3))
        assert d.offer(m1, 4, len(b1), b1)  # no stream yet: its bytes are not kept
        _service_until_acked(d)
        assert d.offer(m2, 4, len(b2), b2)
        _service_until_acked(d)
        assert d.offer(m3, 4, len(b3), b3)
        d._drop_stream()  # the stream breaks before batch 3 goes out
        _service_until_acked(d)
        d.shutdown()
        assert not drops and not d.pending and d.acked_records == 12
        assert [(m.seq, body) for m, body in peer.sent] == [(1, None), (2, b2), (3, None)]
    assert len(_stored(tmp_path / "audit.db")) == 12
    assert m2.records_crc32 == batch_checksum(m2)


def test_sealed_batches_are_kept_as_their_bytes_and_parsed_only_for_an_older_peer(tmp_path):
    """The agent's batches exist only as sealed bytes (wire/sealed.py): sent as they are, also
    when offered before the stream opens or resent after it breaks; a peer that does not take
    packed payloads gets the batch parsed and its payload records moved out."""
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        peer = _RecordingPeer(srv.address)
        req = register_request(run="seal", session_id="seal-0")
        drops = []
        d = Delivery(peer, lambda: req, on_drop=lambda reason, n: drops.append((reason, n)))
        bodies = [_sealed(seq) for seq in (1, 2, 3)]
        assert d.offer_sealed(1, 4, len(bodies[0]), bodies[0])  # before the stream opens
        _service_until_acked(d)
        assert d.offer_sealed(2, 4, len(bodies[1]), bodies[1])
        d._drop_stream()  # breaks before batch 2 goes out: its bytes stay, its only form
        _service_until_acked(d)
        assert d.offer_sealed(3, 4, len(bodies[2]), bodies[2])
        _service_until_acked(d)
        d.shutdown()
        assert not drops and not d.pending and d.acked_records == 12
        assert peer.sent == [(None, b) for b in bodies]
    assert len(_stored(tmp_path / "audit.db")) == 12

    with BackgroundServer("127.0.0.1:0", tmp_path / "old.db", synchronous="NORMAL") as srv:
        old = _OldPeer(srv.address, packed_batches=True)
        d = Delivery(old, lambda: req, on_drop=lambda reason, n: drops.append((reason, n)))
        assert d.offer_sealed(1, 4, len(bodies[0]), bodies[0])
        _service_until_acked(d)
        d.shutdown()
        assert not drops and d.acked_records == 4
        (sent,) = old.sent
        assert sent.packed.count == 3 and not len(sent.packed.payloads)
        assert [r.key.microbatch for r in sent.records] == [1]
        assert sent.records[0].payload.data and sent.records_crc32 == batch_checksum(sent)
    assert len(_stored(tmp_path / "old.db")) == 4


def test_a_batch_that_fails_to_encode_is_counted_and_the_sender_goes_on(tmp_path, monkeypatch):
    """An encoder failure (a bug) loses that batch only: its records are counted as
    build_error, the sender thread keeps running, and later batches are stored."""
    from numaudit.agents.delivery import sender as agents_sender

    real, calls = agents_sender.sealed_batch, []

    def flaky(session_id, seq, cols):
        calls.append(seq)
        if len(calls) == 1:
            raise RuntimeError("injected encoder failure")
        return real(session_id, seq, cols)

    monkeypatch.setattr(agents_sender, "sealed_batch", flaky)
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL") as srv:
        agent = numaudit.attach(None, address=srv.address, run="flaky", phases=("input", "fwd"),
                              payload=("input:pay",), sketch_k=16, batch_records=8)
        _capture(agent, steps=3)
        s = agent.close(timeout=10.0)
    assert s["captured"] == 24 and s["dropped_by_reason"] == {"build_error": 8}, s
    assert s["acked"] == 16 and s["errors"] == 0, s
    assert len(_stored(tmp_path / "audit.db")) == 16
    assert len(calls) >= 3
