"""The agent against a real auditor: what reaches the store, and what happens when it cannot."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import numaudit
from numaudit.agents.layout import PieceLayout
from numaudit.auditor.store import Reader, from_int64
from numaudit.protos import numaudit_pb2 as pb

pytestmark = pytest.mark.timeout(60)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)
        self.spare = torch.nn.Linear(2, 2)  # never called: grads stay None

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train(agent, model, steps=1, microbatches=2):
    for step in range(steps):
        with agent.step(step):
            for j in range(microbatches):
                with agent.microbatch(j):
                    loss = model(torch.randn(3, 4)).square().mean()
                    agent.capture(loss, site="loss", phase="loss")
                    loss.backward()


def _records(db, run):
    reader = Reader(db)
    try:
        return list(reader.records(run))
    finally:
        reader.close()


def test_records_reach_the_store_with_none_grads_explicit(auditor_server):
    model = Net()
    agent = numaudit.attach(model, run="ref", address=auditor_server.address)
    _train(agent, model)
    s = agent.close()
    assert s["dropped"] == 0 and s["errors"] == 0
    assert s["acked"] == s["sent"] == s["captured"] > 0
    rows = _records(auditor_server.db_path, "ref")
    assert len(rows) == s["captured"]
    keys = {(r[0], r[1], r[2], r[3]) for r in rows}
    for mb in (0, 1):
        for site in ("a", "b"):
            assert (0, mb, pb.PHASE_FWD, site) in keys
        assert (0, mb, pb.PHASE_LOSS, "loss") in keys
    none = {r[3] for r in rows if r[9]}
    assert none == {"spare.weight", "spare.bias"}
    grads = {r[3] for r in rows if r[2] == pb.PHASE_GRAD and not r[9]}
    assert grads == {"a.weight", "a.bias", "b.weight", "b.bias"}


def test_fingerprint_in_store_matches_digest_of_the_tensor(auditor_server):
    from numaudit.agents.digest.digest import digest_piece

    t = torch.randn(5, 3)
    agent = numaudit.attach(None, run="ref", address=auditor_server.address)
    with agent.step(0), agent.microbatch(0):
        agent.capture(t, site="x", phase="input")
    agent.close()
    (row,) = _records(auditor_server.db_path, "ref")
    _, i64 = digest_piece(t, PieceLayout.full((5, 3)))
    assert from_int64(row[28]) == int(i64[5]) % (1 << 64)


def test_payload_travels_compressed_and_round_trips(auditor_server):
    import zstandard

    t = torch.randn(1, 8).expand(256, 8).contiguous()  # 8 KiB that zstd shrinks
    agent = numaudit.attach(None, run="ref", address=auditor_server.address, payload=("input:x",))
    with agent.step(0), agent.microbatch(0):
        agent.capture(t, site="x", phase="input")
    agent.close()
    (row,) = _records(auditor_server.db_path, "ref")
    reader = Reader(auditor_server.db_path)
    header, data = reader.payload(row[30])
    assert header["codec"] == "zstd" and len(data) < t.numel() * 4 // 4
    raw = zstandard.ZstdDecompressor().decompress(data)
    assert header["raw_nbytes"] == t.numel() * 4
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(256, 8), t)


def test_incompressible_payloads_are_stored_raw_and_read_back_whole(auditor_server):
    """Float noise does not compress: after the first payload of a site the agent sends the
    bytes as they are (codec raw); every step's payload still reads back as its tensor."""
    from numaudit.auditor.compare.digests.metrics import bits_to_values, decode_payload

    steps = [torch.randn(256, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    agent = numaudit.attach(None, run="ref", address=auditor_server.address, payload=("input:x",))
    for s, t in enumerate(steps):
        with agent.step(s), agent.microbatch(0):
            agent.capture(t, site="x", phase="input")
    agent.close()
    reader = Reader(auditor_server.db_path)
    rows = sorted(_records(auditor_server.db_path, "ref"), key=lambda r: r[0])
    assert len(rows) == 4
    codecs = []
    for row, t in zip(rows, steps):
        header, data = reader.payload(row[30])
        codecs.append(header["codec"])
        bits = decode_payload(header, data, "float32", (256, 8), max_bytes=1 << 20)
        assert np.array_equal(bits_to_values(bits, "float32"), t.double().numpy())
    assert codecs == ["zstd", "raw", "raw", "raw"]


def test_payloads_larger_than_a_chunk_arrive_whole_raw_and_compressed(auditor_server,
                                                                      monkeypatch):
    """A payload over PAYLOAD_CHUNK_BYTES travels as chunks of the one stream (the sender
    writes them straight into the sealed batch from the agent's host copy): noise as codec raw
    after the first (level 1 judged on a probe), a compressible tensor as zstd; every step's
    payload reads back as its tensor from a real daemon's store."""
    from numaudit.auditor.compare.digests.metrics import bits_to_values, decode_payload
    from numaudit.wire import limits

    monkeypatch.setattr(limits, "PAYLOAD_CHUNK_BYTES", 48 << 10)
    g = torch.Generator().manual_seed(5)
    noise = [torch.randn(300, 256, generator=g) for _ in range(4)]  # 300 KiB each
    ramp = torch.arange(300 * 256, dtype=torch.float32).view(300, 256) % 7
    agent = numaudit.attach(None, run="ref", address=auditor_server.address,
                          payload=("input:x", "input:ramp"), batch_records=2)
    for s, t in enumerate(noise):
        with agent.step(s), agent.microbatch(0):
            agent.capture(t, site="x", phase="input")
            agent.capture(ramp, site="ramp", phase="input")
    summary = agent.close()
    assert summary["acked"] == 8 and summary["dropped"] == 0, summary
    reader = Reader(auditor_server.db_path)
    rows = _records(auditor_server.db_path, "ref")
    assert len(rows) == 8
    codecs: dict[str, list] = {"x": [], "ramp": []}
    for row in sorted(rows, key=lambda r: r[0]):
        header, data = reader.payload(row[30])
        chunks = reader.conn.execute("SELECT COUNT(*) FROM payload_chunks WHERE record_id = ?",
                                     (row[30],)).fetchone()[0]
        values = bits_to_values(decode_payload(header, data, "float32", (300, 256),
                                               max_bytes=1 << 22), "float32")
        if np.array_equal(values, ramp.double().numpy()):
            codecs["ramp"].append(header["codec"])
        else:
            assert np.array_equal(values, noise[row[0]].double().numpy())  # its step's tensor
            codecs["x"].append(header["codec"])
            assert chunks == -(-len(data) // (48 << 10)) > 1
    assert codecs == {"x": ["zstd", "raw", "raw", "raw"], "ramp": ["zstd"] * 4}


def test_checkpoint_recomputation_is_not_a_new_call(auditor_server):
    class Ckpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    model = Ckpt()
    agent = numaudit.attach(model, run="ref", address=auditor_server.address, phases=("fwd",))
    with agent.step(0), agent.microbatch(0):
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    agent.close()
    calls = [(r[3], r[6]) for r in _records(auditor_server.db_path, "ref")]
    assert calls == [("inner", 0)]


def test_repeated_calls_are_numbered(auditor_server):
    lin = torch.nn.Linear(2, 2)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    model = Twice()
    agent = numaudit.attach(model, run="ref", address=auditor_server.address, phases=("fwd",))
    with agent.step(0):
        for j in range(2):
            with agent.microbatch(j):
                model(torch.randn(1, 2))
    agent.close()
    keys = sorted((r[1], r[6]) for r in _records(auditor_server.db_path, "ref"))
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_auditor_never_blocks_training_and_drops_are_counted():
    model = Net()
    agent = numaudit.attach(model, run="ref", address=f"127.0.0.1:{_free_port()}",
                          flush_timeout_s=0.5, spool_mode="off")
    started = time.monotonic()
    _train(agent, model, steps=3)
    train_time = time.monotonic() - started
    started = time.monotonic()
    s = agent.close()
    assert time.monotonic() - started < 0.5 + 1.0 + 0.5
    assert train_time < 5.0
    assert s["acked"] == 0
    assert s["dropped"] == s["captured"] > 0
    assert set(s["dropped_by_reason"]) <= {"unacked_at_close", "unsent_at_close"}


def test_rejected_batch_is_dropped_and_counted_and_later_ones_delivered(auditor_server):
    agent = numaudit.attach(None, run="ref", address=auditor_server.address, batch_records=1)
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.ones(2), site="good1", phase="input")
        agent.capture(torch.ones(2), site="x" * 600, phase="input")  # site too long: refused
    with agent.step(0), agent.microbatch(1):
        agent.capture(torch.ones(2), site="good2", phase="input")
    s = agent.close()
    assert s["dropped_by_reason"] == {"rejected": 1}
    sites = sorted(r[3] for r in _records(auditor_server.db_path, "ref"))
    assert sites == ["good1", "good2"]


def test_queue_overflow_drops_and_counts_without_blocking(auditor_server, monkeypatch):
    """A sender stuck on its work (slow host copies, slow serialization) never stalls training."""
    import threading

    from numaudit.agents.delivery.sender import Sender

    release = threading.Event()
    original = Sender._add

    def stuck(self, batch):
        release.wait(10)
        original(self, batch)

    monkeypatch.setattr(Sender, "_add", stuck)
    agent = numaudit.attach(None, run="ref", address=auditor_server.address, queue_records=4,
                          device_batch=1)
    started = time.monotonic()
    with agent.step(0), agent.microbatch(0):
        for i in range(50):
            agent.capture(torch.ones(3), site=f"t{i}", phase="input")
    assert time.monotonic() - started < 2.0
    release.set()
    s = agent.close()
    assert s["captured"] == 50
    assert s["dropped_by_reason"]["queue_full"] >= 50 - 4 - 1
    assert s["acked"] + s["dropped"] == 50
    assert len(_records(auditor_server.db_path, "ref")) == s["acked"]


def test_hooks_never_raise_into_training(auditor_server, monkeypatch):
    import numaudit.agents.capture.capture as capture

    def broken(*a, **k):
        raise RuntimeError("digest exploded")

    monkeypatch.setattr(capture.Digester, "digest", broken)
    model = Net()
    agent = numaudit.attach(model, run="ref", address=auditor_server.address)
    _train(agent, model)  # must not raise
    s = agent.close()
    assert s["errors"] > 0


def test_disabled_agent_hooks_nothing(monkeypatch):
    monkeypatch.setenv("NUMAUDIT_DISABLE", "1")
    model = Net()
    agent = numaudit.attach(model, run="ref", address="127.0.0.1:1")
    _train(agent, model)
    assert agent.close()["captured"] == 0
    assert not model.a._forward_hooks


def test_drops_reach_the_auditor_even_when_nothing_was_sent(auditor_server):
    agent = numaudit.attach(None, run="ref", address=auditor_server.address, queue_records=1,
                          device_batch=1)
    agent._sender.submit = lambda batch: agent.counters.drop("queue_full", len(batch.captures))
    with agent.step(0), agent.microbatch(0):
        for i in range(3):
            agent.capture(torch.ones(2), site=f"t{i}", phase="input")
    agent.close()
    (session,) = Reader(auditor_server.db_path).sessions("ref")
    assert session["records_sent"] == 3
    assert session["records_dropped"] == 3
    assert session["dropped_by_reason"] == {"queue_full": 3}


def test_without_auditor_records_are_spooled_and_ingest_replays_them_once(tmp_path):
    from numaudit.auditor.daemon.replay import replay_into_db

    spool = tmp_path / "spool"
    model = Net()
    agent = numaudit.attach(model, run="offline", spool_dir=str(spool))
    _train(agent, model)
    s = agent.close()
    assert s["dropped"] == 0 and s["spooled"] == s["captured"] > 0
    db = tmp_path / "replay.db"
    (first,) = replay_into_db([spool], db)
    assert (first.run, first.stored, first.rejected, first.skipped_frames) == (
        "offline", s["captured"], [], 0)
    (again,) = replay_into_db([spool], db)
    assert again.stored == 0 and again.duplicates == s["captured"]
    rows = _records(db, "offline")
    assert len(rows) == s["captured"]
    (session,) = Reader(db).sessions("offline")
    assert session["closed"] and session["records_sent"] == s["captured"]


def test_hung_auditor_close_spills_and_returns_in_time(tmp_path):
    """An auditor that accepts connections but never answers (a listening socket, no server)."""
    spool = tmp_path / "spool"
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        model = Net()
        agent = numaudit.attach(model, run="ref", address=address, spool_dir=str(spool),
                              flush_timeout_s=1.0, connect_timeout_s=0.3)
        started = time.monotonic()
        _train(agent, model)
        assert time.monotonic() - started < 5.0
        started = time.monotonic()
        s = agent.close()
        assert time.monotonic() - started < 1.0 + 1.0 + 0.3
    assert s["spooled"] + s["dropped"] == s["captured"]
    assert s["spooled"] > 0


def test_registration_refused_for_its_content_is_final_not_retried(auditor_server, tmp_path):
    """A run registered with world size 2 refuses a rank claiming 3: the agent stops trying."""
    first = numaudit.attach(None, run="ref", address=auditor_server.address, dp_rank=0, dp_size=1)
    first.ident.world_size = 2
    with first.step(0), first.microbatch(0):
        first.capture(torch.ones(1), site="x", phase="input")
    first.close()
    other = numaudit.attach(None, run="ref", address=auditor_server.address, dp_rank=0, dp_size=1,
                          spool_mode="off")
    other.ident.world_size = 3
    with other.step(0), other.microbatch(0):
        other.capture(torch.ones(1), site="y", phase="input")
    started = time.monotonic()
    s = other.close(timeout=5.0)
    assert time.monotonic() - started < 2.0  # did not spend the flush timeout retrying
    assert s["dropped_by_reason"] == {"refused": 1}
    assert other._sender.reconnects == 0


def test_integer_records_carry_the_digest_seeds(auditor_server):
    """Seeds travel with every digest, so integer inputs compare like any other tensor."""
    from numaudit.agents.digest.digest import FINGERPRINT_SEED, SKETCH_SEED

    agent = numaudit.attach(None, run="ref", address=auditor_server.address)
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.arange(6), site="tokens", phase="input")
    agent.close()
    reader = Reader(auditor_server.db_path)
    (seeds,) = reader.conn.execute("SELECT fingerprint_seed, sketch_seed FROM records").fetchall()
    assert [from_int64(s) for s in seeds] == [FINGERPRINT_SEED, SKETCH_SEED]


def test_a_step_that_raises_captures_no_gradients(auditor_server):
    model = Net()
    agent = numaudit.attach(model, run="ref", address=auditor_server.address)
    with pytest.raises(RuntimeError, match="boom"):
        with agent.step(0), agent.microbatch(0):
            model(torch.randn(2, 4)).sum().backward()
            raise RuntimeError("boom")
    agent.close()
    phases = {r[2] for r in _records(auditor_server.db_path, "ref")}
    assert pb.PHASE_FWD in phases and pb.PHASE_GRAD not in phases


def test_a_gradient_hook_run_twice_is_captured_once(auditor_server):
    """Split backward can run a tensor's hooks twice; each key is captured once."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    agent = numaudit.attach(model, run="ref", address=auditor_server.address, phases=("bwd",))
    with agent.step(0), agent.microbatch(0):
        out = model(torch.randn(2, 3))
        loss = out.sum()
        torch.autograd.grad(loss, out, retain_graph=True)  # runs the hook once
        loss.backward()  # and again
    s = agent.close()
    assert s["captured"] == 1 and len(_records(auditor_server.db_path, "ref")) == 1


def test_without_a_run_name_auditing_is_off_and_nothing_is_spooled(tmp_path, caplog):
    model = Net()
    agent = numaudit.attach(model, spool_dir=str(tmp_path / "spool"))
    _train(agent, model)
    assert agent.close()["captured"] == 0
    assert not model.a._forward_hooks
    assert not (tmp_path / "spool").exists()
    assert "no run name" in caplog.text


def test_a_library_caller_waits_on_the_acks_instead_of_polling(auditor_server):
    """`backlog` counts what the auditor has not acked yet; `wait_for_acks` returns once more
    records are acked (or at its timeout), so a caller such as `auditor checkpoint` can bound
    what it holds without polling the agent's summary."""
    model = Net()
    agent = numaudit.attach(model, run="paced", address=auditor_server.address)
    try:
        _train(agent, model, steps=2)
        first = agent.backlog()
        assert isinstance(first, numaudit.agents.Backlog)  # exported for a caller's types
        assert first.captured > 0 and first.dropped == 0
        b = first
        for _ in range(400):  # each wait ends at an ack, or after its 0.05 s at the latest
            if b.waiting == 0:
                break
            agent.wait_for_acks(b.acked, 0.05)
            b = agent.backlog()
        assert b.waiting == 0 and b.acked == b.captured == first.captured
        agent.wait_for_acks(b.acked, 0.01)  # nothing more to ack: returns at its timeout
    finally:
        s = agent.close()
    assert s["acked"] == s["captured"]
