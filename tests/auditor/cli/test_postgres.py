"""`auditor serve/runs/show/compare/watch` on a PostgreSQL store (`--store postgresql://...`),
against a real PostgreSQL server: the same answers as on a SQLite file."""

from __future__ import annotations

import json

import grpc
import pytest

from numaudit.protos import numaudit_pb2 as pb
from tests.auditor.cli.three_runs import cli, runs
from tests.auditor.synth import send, write_runs

pytestmark = pytest.mark.timeout(180)
T = 30.0






def _timeless(doc):
    """A runs/show document without what differs between two writes of the same runs."""
    if isinstance(doc, list):
        return [_timeless(d) for d in doc]
    if isinstance(doc, dict):
        return {k: _timeless(v) for k, v in doc.items()
                if k not in ("created_unix", "created", "session_id")}
    return doc


def test_commands_read_a_postgresql_store_as_a_sqlite_file(pg_url, tmp_path):
    db = write_runs(tmp_path / "audit.db", *runs())
    write_runs(pg_url, *runs())
    for cmd in (("runs", "--format", "json"), ("show", "ref", "--format", "json")):
        on_pg, on_file = cli(*cmd, "--store", pg_url), cli(*cmd, "--db", db)
        assert on_pg.exit_code == on_file.exit_code == 0, on_pg.output
        drop = lambda d: json.dumps(d, sort_keys=True)  # noqa: E731
        a, b = json.loads(on_pg.output), json.loads(on_file.output)
        assert drop(_timeless(a)) == drop(_timeless(b))
    bad = cli("compare", "ref", "bumped", "--store", pg_url)
    assert bad.exit_code == 1 and "fwd layers.1 output @ step 0 mb 1" in bad.output
    ok = cli("compare", "ref", "same", "--store", pg_url, "--preset", "bitwise")
    assert ok.exit_code == 0, ok.output
    watch = cli("watch", "ref", "bumped", "--store", pg_url, "--poll", "0.05")
    assert watch.exit_code == 1
    assert watch.output.count("FIRST DIVERGENCE: diverged: fwd layers.1 output @ step 0 mb 1") == 1
    missing = cli("show", "nope", "--store", pg_url)
    assert missing.exit_code == 2 and "nope" in missing.output


def test_a_database_that_is_not_there_is_one_line(pg_server):
    res = cli("runs", "--store", pg_server.url("no_such_db"))
    assert res.exit_code == 2 and "cannot connect" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_the_daemon_serves_a_postgresql_store(pg_url):
    from numaudit.auditor.daemon.server import BackgroundServer
    from numaudit.protos import numaudit_pb2_grpc
    from numaudit.wire import limits

    with BackgroundServer("127.0.0.1:0", pg_url, synchronous="NORMAL", grace=0.5) as srv:
        with grpc.insecure_channel(srv.address, options=limits.client_options()) as channel:
            stub = numaudit_pb2_grpc.AuditorStub(channel)
            for run in runs():
                send(stub, run)
            resp = stub.Compare(pb.CompareRequest(ref="ref", cand="bumped"), timeout=T)
            assert resp.exit_code == 1
            assert json.loads(resp.report_json)["first_divergence"]["key"]["microbatch"] == 1
            desc = stub.DescribeRun(pb.DescribeRunRequest(run="same"), timeout=T)
            assert desc.summary.ranks_closed == 4 and desc.summary.records > 0
            remote = cli("compare", "ref", "bumped", "--address", srv.address)
    local = cli("compare", "ref", "bumped", "--store", pg_url)
    assert remote.exit_code == local.exit_code == 1
    strip = lambda s: s.split("\n", 3)[3]  # noqa: E731 - after the header lines
    assert strip(remote.output) == strip(local.output)
