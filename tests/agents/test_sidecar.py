"""The node sidecar: ranks hand records over a Unix socket; it spools them and owns the network."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from numaudit import agents
from numaudit.agents.delivery.transport import SidecarTransport, wait_for_socket
from numaudit.agents.sidecar import Sidecar
from numaudit.auditor.daemon.replay import replay_into_db
from numaudit.auditor.store import Reader, UnknownRun

pytestmark = pytest.mark.timeout(90)
ROOT = Path(__file__).resolve().parents[2]


def _capture(agent, n: int, start: int = 0, microbatch: int = 0) -> None:
    with agent.step(0), agent.microbatch(microbatch):
        for i in range(start, start + n):
            agent.capture(torch.full((4,), float(i)), site=f"t{i}", phase="input")


def _stored_sites(db: Path, run: str) -> list[str]:
    reader = Reader(db)
    try:
        return sorted(r[3] for r in reader.records(run))
    except UnknownRun:  # the sidecar has not registered the session upstream yet
        return []
    finally:
        reader.close()


def _wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_records_flow_through_the_sidecar_to_the_auditor(auditor_server, tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay", auditor=auditor_server.address)
    sidecar.start()
    try:
        agent = agents.attach(None, run="ref", sidecar=sock, batch_records=4)
        assert isinstance(agent._sender.delivery.transport, SidecarTransport)
        _capture(agent, 10)
        s = agent.close()
        assert s["acked"] == s["captured"] == 10 and s["dropped"] == 0
        assert _wait(lambda: sidecar._all_done())
    finally:
        sidecar.stop(grace=5)
    assert _stored_sites(auditor_server.db_path, "ref") == sorted(f"t{i}" for i in range(10))
    (session,) = Reader(auditor_server.db_path).sessions("ref")
    assert session["closed"] and session["records_sent"] == 10
    assert not list((tmp_path / "relay").glob("*.spool"))  # delivered sessions leave no spool


def test_no_grpc_channel_is_created_in_sidecar_mode(tmp_path):
    """Checked in a fresh interpreter: grpc's channel class is never instantiated."""
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay")  # spool only
    sidecar.start()
    try:
        code = (
            "import grpc, grpc._channel, torch, agents\n"
            "made = []\n"
            "orig = grpc._channel.Channel.__init__\n"
            "def spy(self, *a, **k):\n"
            "    made.append(1); orig(self, *a, **k)\n"
            "grpc._channel.Channel.__init__ = spy\n"
            f"a = agents.attach(None, run='ref', sidecar={sock!r})\n"
            "with a.step(0), a.microbatch(0):\n"
            "    a.capture(torch.ones(3), site='x', phase='input')\n"
            "s = a.close()\n"
            "assert (s['acked'], s['held_by_sidecar']) == (0, 1), s\n"
            "assert not made, 'a gRPC channel was created in the training process'\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    finally:
        sidecar.stop(grace=0)


def _start_sidecar(sock: str, spool: Path, auditor: str | None, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "numaudit.agents.sidecar", "--listen", sock, "--spool", str(spool)]
    if auditor:
        cmd += ["--auditor", auditor]
    with open(log, "ab") as out:  # the sidecar writes its own copy of the file descriptor
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    assert wait_for_socket(sock, 20), log.read_text()
    return proc


def test_sidecar_killed_and_restarted_with_its_spool_loses_nothing(auditor_server, tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    spool = tmp_path / "relay"
    log = tmp_path / "sidecar.log"
    proc = _start_sidecar(sock, spool, None, log)  # no auditor yet: everything stays spooled
    agent = agents.attach(None, run="ref", sidecar=sock, batch_records=5, flush_timeout_s=20,
                          spool_dir=str(tmp_path / "agent-spool"))
    _capture(agent, 20)
    assert _wait(lambda: agent._sender.delivery.acked_records == 20)  # durable at the sidecar
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # the rank keeps capturing while the sidecar is down; its sender reconnects later
    _capture(agent, 20, start=20, microbatch=1)
    proc = _start_sidecar(sock, spool, auditor_server.address, log)
    try:
        s = agent.close()
        assert s["acked"] == 40 and s["dropped"] == 0, s
        assert _wait(lambda: len(_stored_sites(auditor_server.db_path, "ref")) == 40)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    assert _stored_sites(auditor_server.db_path, "ref") == sorted(f"t{i}" for i in range(40))


def test_sidecar_without_auditor_spools_and_ingest_loads_it(tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay")
    sidecar.start()
    try:
        agent = agents.attach(None, run="offline", sidecar=sock)
        _capture(agent, 7)
        s = agent.close()  # spool only: the sidecar holds them, the auditor has none
        assert (s["acked"], s["held_by_sidecar"], s["spooled"], s["dropped"]) == (0, 7, 7, 0), s
    finally:
        sidecar.stop(grace=1)
    (result,) = replay_into_db([tmp_path / "relay"], tmp_path / "late.db")
    assert (result.stored, result.rejected) == (7, [])
    assert len(_stored_sites(tmp_path / "late.db", "offline")) == 7


def test_a_payload_in_chunks_counts_as_one_capture_through_the_sidecar(tmp_path, monkeypatch):
    """Each chunk of a large payload travels as a record of the same key; the rank's and the
    sidecar's counts count captures, so captured = acked + spooled + dropped still holds, the
    store keeps one record per capture, and the daemon's acks and `auditor ingest` count
    records, not chunks."""
    from numaudit.wire import limits

    monkeypatch.setattr(limits, "PAYLOAD_CHUNK_BYTES", 32 << 10)
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay")
    sidecar.start()
    try:
        agent = agents.attach(None, run="chunks", sidecar=sock, payload=("input:x",))
        for step in range(3):
            with agent.step(step), agent.microbatch(0):
                agent.capture(torch.randn(200, 256), site="x", phase="input")  # 200 KiB
        s = agent.close()
        assert (s["captured"], s["held_by_sidecar"], s["spooled"], s["dropped"]) == (3, 3, 3, 0), s
    finally:
        sidecar.stop(grace=1)
    (result,) = replay_into_db([tmp_path / "relay"], tmp_path / "late.db")
    assert (result.records, result.stored, result.duplicates, result.conflicts,
            result.rejected) == (3, 3, 0, 0, [])
    # again: every record already stored, each counted once (not once per chunk)
    (again,) = replay_into_db([tmp_path / "relay"], tmp_path / "late.db")
    assert (again.records, again.stored, again.duplicates, again.conflicts) == (3, 0, 3, 0)


def test_the_sidecar_spools_the_bytes_a_rank_sent(tmp_path, monkeypatch):
    """A rank encodes each batch once (wire.sealed); the sidecar spools those very
    bytes, and relays them upstream as they are, instead of serializing the parsed message
    again. The rank's bytes are marked here with an unknown field in front, where no
    serializer writes one (it puts unknown fields last)."""
    from numaudit.agents.delivery import sender as agents_sender
    from numaudit.protos import numaudit_pb2 as pb
    from numaudit.wire.checksum import received_records_checksum
    from numaudit.wire.spool import KIND_BATCH, read_frame

    mark = bytes((0xC0, 0x3E, 0x01))  # field 1000, varint 1: unknown to RecordBatch
    sent, seal = [], agents_sender.sealed_batch
    monkeypatch.setattr(agents_sender, "sealed_batch",
                        lambda *a: sent.append(mark + seal(*a)) or sent[-1])
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay")  # no auditor: the relay spool stays to be read
    sidecar.start()
    try:
        agent = agents.attach(None, run="held", sidecar=sock, batch_records=4)
        _capture(agent, 4)  # the first batch may go out before the stream is open (serialized)
        assert _wait(lambda: agent._sender.delivery.acked_records == 4)
        _capture(agent, 6, start=4)
        agent.close()
    finally:
        sidecar.stop(grace=1)
    (spool,) = (tmp_path / "relay").glob("*.spool")
    bodies = []
    with open(spool, "rb") as f:
        while (frame := read_frame(f.read)) is not None:
            if frame[0] == KIND_BATCH:
                bodies.append(frame[1])
    assert len(bodies) == 3  # 4 + 4 + 2 records
    assert bodies[1:] == sent[1:]  # the rank's own bytes, mark first
    for body in bodies[1:]:
        batch = pb.RecordBatch.FromString(body)
        assert not batch.SerializeToString().startswith(mark)  # what a re-serialization gives
        assert received_records_checksum(body) == batch.records_crc32


def test_attach_starts_the_node_sidecar_which_exits_when_idle(auditor_server, tmp_path,
                                                              monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    sock = f"unix://{tmp_path}/node.sock"
    agent = agents.attach(None, run="ref", sidecar=sock, start_sidecar=True,
                          address=auditor_server.address, spool_dir=str(tmp_path / "spool"))
    assert wait_for_socket(sock, 0)
    _capture(agent, 3)
    assert agent.close()["acked"] == 3
    assert _wait(lambda: len(_stored_sites(auditor_server.db_path, "ref")) == 3)
    pid = int(subprocess.run(["pgrep", "-f", f"numaudit.agents.sidecar --listen {sock}"],
                             capture_output=True, text=True).stdout.split()[0])
    os.kill(pid, signal.SIGTERM)  # don't wait the 10 s idle period in a test
    assert _wait(lambda: not wait_for_socket(sock, 0), 10)


def test_a_session_whose_forwarding_fails_does_not_stop_the_others(auditor_server, tmp_path,
                                                                   monkeypatch):
    """One relayed session's forwarding step raising (a bug) is logged and retried; the
    sidecar's other sessions keep flowing, and the failed one is delivered once it recovers."""
    from numaudit.agents.delivery.delivery import Delivery

    failures = {"left": 20}
    service = Delivery.service

    def flaky(self, *args, **kw):
        if "(run bad " in self.name and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("forwarding bug")
        return service(self, *args, **kw)

    monkeypatch.setattr(Delivery, "service", flaky)
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay", auditor=auditor_server.address)
    sidecar.start()
    try:
        bad = agents.attach(None, run="bad", sidecar=sock, batch_records=4)
        good = agents.attach(None, run="good", sidecar=sock, batch_records=4)
        _capture(bad, 6)
        _capture(good, 6, start=10)
        bad.close()
        good.close()
        assert _wait(lambda: len(_stored_sites(auditor_server.db_path, "good")) == 6)
        assert _wait(lambda: sidecar._all_done())
        assert failures["left"] == 0
    finally:
        sidecar.stop(grace=5)
    assert _stored_sites(auditor_server.db_path, "bad") == sorted(f"t{i}" for i in range(6))
