"""Issue 10 item 1: what a Compare request carries cannot freeze the daemon.

Rename patterns run on RE2 (linear time), policy text is bounded in size and nesting
(INVALID_ARGUMENT naming policy_toml), and a comparison runs in a worker process with a time
budget (DEADLINE_EXCEEDED), so Ingest keeps acking whatever a reader asks."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from numaudit.auditor.daemon.admission import ServerLimits
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import batch, record, register_request

T = 10
pytestmark = pytest.mark.timeout(120)
SITE = "a" * 28  # 2^28 backtracking steps for the pattern below under Python's re
EVIL = "[[rename]]\nregex = '^(.|.)*!$'\nreplace = 'x'\n"


def _runs(stub) -> None:
    for run in ("ref", "cand"):
        stub.Register(register_request(run=run, session_id=run), timeout=T)
        list(stub.Ingest(iter([batch(1, [record(0, 0, SITE)], session_id=run)]), timeout=T))


def _ack_latency(stub, session: str, seqs) -> list[float]:
    out = []
    for seq in seqs:
        t0 = time.monotonic()
        list(stub.Ingest(iter([batch(seq, [record(seq, 0, "layers.9")], session_id=session)]),
                         timeout=T))
        out.append(time.monotonic() - t0)
    return out


@pytest.fixture
def server(tmp_path):
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0) as srv:
        with grpc.insecure_channel(srv.address, options=limits.client_options()) as ch:
            yield srv, numaudit_pb2_grpc.AuditorStub(ch)


def test_catastrophic_regex_neither_freezes_nor_delays_ingest(server):
    _, stub = server
    _runs(stub)
    stub.Register(register_request(run="live", session_id="live"), timeout=T)
    result: dict = {}

    def compare() -> None:
        t0 = time.monotonic()
        result["resp"] = stub.Compare(pb.CompareRequest(ref="ref", cand="cand", policy_toml=EVIL),
                                      timeout=60)
        result["s"] = time.monotonic() - t0

    th = threading.Thread(target=compare)
    th.start()
    latencies = _ack_latency(stub, "live", range(1, 41))
    th.join(60)
    assert "resp" in result and result["resp"].report_json
    assert result["s"] < 20, result  # Python's re: 36 s at 28 characters, doubling per character
    assert max(latencies) < 1.0, latencies


@pytest.mark.parametrize("text, why", [
    ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper"),
    ("# " + "x" * (300 << 10) + "\n", "exceed the limit"),
    ("[[rename]]\nregex = '(a)\\1'\nreplace = 'x'\n", "RE2"),
])
def test_policy_text_limits_are_invalid_argument(server, text, why):
    _, stub = server
    _runs(stub)
    with pytest.raises(grpc.RpcError) as info:
        stub.Compare(pb.CompareRequest(ref="ref", cand="cand", policy_toml=text), timeout=T)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("policy_toml:") and why in info.value.details()


def test_compare_past_its_budget_is_deadline_exceeded_and_ingest_goes_on(tmp_path):
    tight = ServerLimits(compare_budget_s=0.05)  # less than a worker takes to start
    with BackgroundServer("127.0.0.1:0", tmp_path / "a.db", grace=1.0,
                          server_limits=tight) as srv:
        with grpc.insecure_channel(srv.address, options=limits.client_options()) as ch:
            stub = numaudit_pb2_grpc.AuditorStub(ch)
            _runs(stub)
            with pytest.raises(grpc.RpcError) as info:
                stub.Compare(pb.CompareRequest(ref="ref", cand="cand"), timeout=T)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "budget" in info.value.details()
            stub.Register(register_request(run="live", session_id="live"), timeout=T)
            assert max(_ack_latency(stub, "live", (1, 2))) < 1.0
