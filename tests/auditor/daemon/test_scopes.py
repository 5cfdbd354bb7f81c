"""Token scopes against what a call turns into (issue 40, items 4 and 11): a Register renamed
because its name is another job's is checked on the name it would be registered under; runs
outside the read scope stay invisible; refusals by the token check are counted in the metrics."""

from __future__ import annotations

from functools import partial

import grpc
import pytest

from numaudit.auditor.daemon.metrics import DaemonMetrics
from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.daemon.tokens import Tokens
from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire.channels import open_channel
from tests.auditor.builders import register_request

T = 10
pytestmark = pytest.mark.timeout(60)

SECRET = {"owner": "tok-owner-7a1c9e3b5d2f4a60", "exp": "tok-exp-only-3c8e1a5f7b9d2e41",
          "family": "tok-exp-family-9b2d4f6a8c1e3a52", "reader": "tok-reader-exp-5e7a9c1b3d6f8a23"}
TOKENS = Tokens.parse({"token": [
    {"name": "owner", "token": SECRET["owner"], "write": ["exp"], "read": ["*"]},
    {"name": "exp", "token": SECRET["exp"], "write": ["exp"]},
    {"name": "family", "token": SECRET["family"], "write": ["exp", "exp.*"]},
    {"name": "reader", "token": SECRET["reader"], "read": ["exp"]},
]})


@pytest.fixture
def served(tmp_path):
    metrics = DaemonMetrics()
    with BackgroundServer("127.0.0.1:0", tmp_path / "s.db", tokens=TOKENS,
                          metrics=metrics) as srv:
        yield srv, metrics, tmp_path / "s.db"


def stub(address: str, who: str | None) -> numaudit_pb2_grpc.AuditorStub:
    return numaudit_pb2_grpc.AuditorStub(open_channel(address, token=SECRET.get(who or "")))


def code(call) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


def runs(db) -> list[str]:
    reader = Reader(db)
    try:
        return reader.run_names()
    finally:
        reader.close()


def test_a_rename_never_leaves_the_write_scope(served):
    """`exp` belongs to the owner's job; a token that may write `exp` only, registering `exp`
    for another job with rename_if_taken, was given `exp.2`: a run outside its scope (and with
    the owner's job id, a rank of the owner's runs). Now PERMISSION_DENIED, nothing created;
    a token whose scope holds `exp.*` is renamed as before."""
    srv, _, db = served
    stub(srv.address, "owner").Register(register_request(run="exp", session_id="o-0",
                                                         job_id="job-owner"), timeout=T)
    attacker = stub(srv.address, "exp")
    renamed = register_request(run="exp", session_id="a-0", job_id="job-attacker",
                               rename_if_taken=True)
    assert code(lambda: attacker.Register(renamed, timeout=T)) == "PERMISSION_DENIED"
    assert runs(db) == ["exp"]
    try:
        attacker.Register(renamed, timeout=T)
    except grpc.RpcError as exc:
        assert "exp.2" in exc.details() and "may not write" in exc.details()
    family = stub(srv.address, "family")
    reply = family.Register(register_request(run="exp", session_id="f-0", job_id="job-family",
                                             rename_if_taken=True), timeout=T)
    assert reply.run == "exp.2" and runs(db) == ["exp", "exp.2"]
    # the attacker joins nothing of the renamed run either, whatever job id it presents
    joined = register_request(run="exp", session_id="a-1", job_id="job-family",
                              rename_if_taken=True)
    assert code(lambda: attacker.Register(joined, timeout=T)) == "PERMISSION_DENIED"
    owner = stub(srv.address, "owner")
    described = owner.DescribeRun(pb.DescribeRunRequest(run="exp.2"), timeout=T)
    assert [r.session_id for r in described.ranks] == ["f-0"]


def test_runs_outside_the_read_scope_reveal_nothing(served):
    """DescribeRun and Watch on a run the token may not read: the same refusal whether the run
    exists or not, and ListRuns leaves it out."""
    srv, _, _ = served
    stub(srv.address, "family").Register(register_request(run="exp.2", session_id="f-0"),
                                         timeout=T)
    reader = stub(srv.address, "reader")
    details = {}
    for run in ("exp.2", "nothing-here"):
        with pytest.raises(grpc.RpcError) as err:
            reader.DescribeRun(pb.DescribeRunRequest(run=run), timeout=T)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        details[run] = err.value.details().replace(run, "RUN")
        with pytest.raises(grpc.RpcError) as err:
            list(reader.Watch(pb.WatchRequest(ref="exp", cand=run, timeout_s=1), timeout=T))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert details["exp.2"] == details["nothing-here"]
    listed = reader.ListRuns(pb.ListRunsRequest(), timeout=T)
    assert [r.run for r in listed.runs] == []


def test_refusals_of_the_token_check_are_counted(served):
    """200 UNAUTHENTICATED and 200 PERMISSION_DENIED calls left no refusals series: the
    interceptor mapped the status without counting it."""
    srv, metrics, _ = served
    nobody, reader = stub(srv.address, None), stub(srv.address, "reader")
    for i in range(20):
        assert code(lambda: nobody.ListRuns(pb.ListRunsRequest(), timeout=T)) == \
            "UNAUTHENTICATED"
        request = register_request(run="exp", session_id=f"r-{i}")
        assert code(partial(reader.Register, request, timeout=T)) == "PERMISSION_DENIED"

    def count(method: str, status: str) -> float:
        return sum(s.value for m in metrics.registry.collect() for s in m.samples
                   if s.name == "numaudit_auditor_refusals_total"
                   and s.labels["method"] == method and s.labels["code"] == status)

    assert count("ListRuns", "UNAUTHENTICATED") == 20
    assert count("Register", "PERMISSION_DENIED") == 20
