"""`auditor compare` / `auditor watch` and the Compare / Watch RPCs, against real stores and a
real daemon (tests talk to servers, never to mocks of gRPC)."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import grpc
import pytest

from numaudit.protos import numaudit_pb2 as pb
from tests.auditor.cli.three_runs import cli, runs
from tests.auditor.synth import send, write_runs

ROOT = Path(__file__).resolve().parents[3]
T = 30.0  # deadline of every RPC in these tests




@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "audit.db"
    return write_runs(path, *runs())




def test_exit_codes(db):
    ok = cli("compare", "ref", "same", "--db", str(db), "--preset", "bitwise")
    assert ok.exit_code == 0, ok.output
    assert "all within policy" in ok.output and "First divergence: none" in ok.output
    bad = cli("compare", "ref", "bumped", "--db", str(db))
    assert bad.exit_code == 1
    assert "First divergence" in bad.output and "fwd layers.1 output @ step 0 mb 1" in bad.output


@pytest.mark.parametrize("args, message", [
    (("compare", "ref", "nope"), "no run named 'nope'"),
    (("compare", "ref", "same", "--address", "127.0.0.1:1"), "either --db or --address"),
    (("compare", "ref", "same", "--format", "pdf"), "pdf"),
    (("compare", "ref", "same", "-o", "/nonexistent/dir/report.txt"), "does not exist"),
])
def test_usage_and_input_errors_exit_2_in_one_line(db, args, message):
    res = cli(*args, "--db", str(db))
    assert res.exit_code == 2
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_malformed_policy_is_one_line_naming_file_rule_field(db, tmp_path):
    bad = tmp_path / "p.toml"
    bad.write_text('[[rule]]\nname = "router"\nmetric = "cosin"\n')
    res = cli("compare", "ref", "same", "--db", str(db), "--policy", str(bad))
    assert res.exit_code == 2
    assert f"{bad}: rule 1 (router): field 'metric'" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_formats_and_output_file(db, tmp_path):
    out = tmp_path / "r.json"
    res = cli("compare", "ref", "bumped", "--db", str(db), "--format", "json", "-o", str(out))
    assert res.exit_code == 1 and res.output == ""
    doc = json.loads(out.read_text())
    assert doc["summary"]["exit_code"] == 1 and doc["first_divergence"]["key"]["site"] == "layers.1"
    junit = cli("compare", "ref", "bumped", "--db", str(db), "--format", "junit")
    root = ET.fromstring(junit.output)
    assert int(root.get("failures")) >= 1
    every = cli("compare", "ref", "bumped", "--db", str(db), "--all", "--limit", "0")
    assert "identical" in every.output.split("Findings, by phase and stage")[1]


def test_json_output_beside_any_format(db, tmp_path, daemon):
    """One comparison gives the printed report and the JSON artifact: --json-output writes what
    --format json would, whatever --format prints, from a store file or the daemon."""
    alone = tmp_path / "alone.json"
    assert cli("compare", "ref", "bumped", "--db", str(db), "--format", "json", "-o",
               str(alone)).exit_code == 1
    srv, _ = daemon

    def drop(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("generated_unix", "timings")}

    for source in (("--db", str(db)), ("--address", srv.address)):
        for fmt in ("text", "junit"):
            both = tmp_path / f"both-{fmt}-{source[0][2:]}.json"
            res = cli("compare", "ref", "bumped", *source, "--format", fmt, "--json-output",
                      str(both))
            assert res.exit_code == 1 and res.output.strip()
            assert drop(json.loads(both.read_text())) == drop(json.loads(alone.read_text()))
    same = cli("compare", "ref", "bumped", "--db", str(db), "-o", str(alone), "--json-output",
               str(alone))
    assert same.exit_code == 2 and "also the --output file" in same.output
    gone = cli("compare", "ref", "bumped", "--db", str(db), "--json-output",
               str(tmp_path / "no" / "r.json"))
    assert gone.exit_code == 2 and "json-output: directory" in gone.output


def test_policy_file_with_preset_override(db):
    policy = ROOT / "examples" / "policies" / "default.toml"
    res = cli("compare", "ref", "same", "--db", str(db), "--policy", str(policy), "--preset",
              "bitwise")
    assert res.exit_code == 0
    assert "policy: default" in res.output


def test_the_installed_command_runs(db):
    proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", "compare", "ref", "bumped",
                           "--db", str(db), "--format", "json"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["summary"]["breaches"] >= 1


def test_watch_on_a_store_file(db):
    res = cli("watch", "ref", "bumped", "--db", str(db), "--poll", "0.05")
    assert res.exit_code == 1
    assert res.output.count("FIRST DIVERGENCE: diverged: fwd layers.1 output @ step 0 mb 1") == 1
    js = cli("watch", "ref", "same", "--db", str(db), "--format", "json", "--poll", "0.05")
    assert js.exit_code == 0
    events = [json.loads(line) for line in js.output.splitlines()]
    assert events[-2]["event"] == "status" and events[-2]["status"].startswith("done")
    assert events[-1]["event"] == "summary" and events[-1]["summary"]["exit_code"] == 0


# -- through a running daemon -----------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from numaudit.auditor.daemon.server import BackgroundServer
    from numaudit.protos import numaudit_pb2_grpc
    from numaudit.wire import limits

    d = tmp_path_factory.mktemp("daemon")
    with BackgroundServer("127.0.0.1:0", d / "audit.db", synchronous="NORMAL", grace=0.5) as srv:
        with grpc.insecure_channel(srv.address, options=limits.client_options()) as channel:
            stub = numaudit_pb2_grpc.AuditorStub(channel)
            for run in runs():
                send(stub, run)
            yield srv, stub


def test_compare_rpc_returns_the_json_report(daemon):
    srv, stub = daemon
    resp = stub.Compare(pb.CompareRequest(ref="ref", cand="bumped"), timeout=T)
    assert resp.exit_code == 1
    doc = json.loads(resp.report_json)
    assert doc["schema_version"] == 5 and doc["findings_included"] == "all"
    assert doc["first_divergence"]["key"]["microbatch"] == 1
    same = stub.Compare(pb.CompareRequest(ref="ref", cand="same", preset="bitwise"), timeout=T)
    assert same.exit_code == 0


@pytest.mark.parametrize("request_kw, code, field", [
    (dict(ref="ref", cand="nope"), grpc.StatusCode.NOT_FOUND, "nope"),
    (dict(ref="r e f", cand="same"), grpc.StatusCode.INVALID_ARGUMENT, "ref:"),
    (dict(ref="ref", cand="same", preset="fp31"), grpc.StatusCode.INVALID_ARGUMENT, "preset:"),
    (dict(ref="ref", cand="same", policy_toml="[[rule]]\nphase = 'x'"),
     grpc.StatusCode.INVALID_ARGUMENT, "policy_toml: rule 1: field 'phase'"),
])
def test_compare_rpc_errors_name_the_field(daemon, request_kw, code, field):
    _, stub = daemon
    with pytest.raises(grpc.RpcError) as err:
        stub.Compare(pb.CompareRequest(**request_kw), timeout=T)
    assert err.value.code() == code
    assert field in err.value.details()


def test_cli_against_the_daemon_prints_the_same_report(daemon, db):
    srv, _ = daemon
    remote = cli("compare", "ref", "bumped", "--address", srv.address)
    local = cli("compare", "ref", "bumped", "--db", str(db))
    assert remote.exit_code == local.exit_code == 1
    strip = lambda s: s.split("\n", 3)[3]  # noqa: E731 - after the header lines
    assert strip(remote.output) == strip(local.output)
    junit = cli("compare", "ref", "bumped", "--address", srv.address, "--format", "junit")
    assert ET.fromstring(junit.output).get("failures") is not None
    gone = cli("compare", "ref", "nope", "--address", srv.address)
    assert gone.exit_code == 2 and "nope" in gone.output


def test_watch_rpc_hands_a_large_poll_out_in_chunks(daemon, monkeypatch):
    """A poll that finds many keys at once reaches the client in chunks of
    WATCH_EVENTS_PER_CALL events from the watch worker: the same events, in the same order, as
    in one piece (the daemon never unpickles a whole store's findings at once)."""
    from numaudit.auditor.daemon import compare_service

    _, stub = daemon
    request = pb.WatchRequest(ref="ref", cand="bumped", poll_interval_s=0.05, timeout_s=5)
    whole = [e.SerializeToString() for e in stub.Watch(request, timeout=T)]
    monkeypatch.setattr(compare_service, "WATCH_EVENTS_PER_CALL", 2)
    chunked = [e.SerializeToString() for e in stub.Watch(request, timeout=T)]
    events = [pb.WatchEvent.FromString(e) for e in whole]
    findings = [e for e in events if e.finding_json and not e.first_divergence]
    assert len(findings) > 4  # several chunks of 2
    assert chunked == whole
    assert events[-1].status == f"done: both runs finished, {len(findings)} keys compared"


def test_watch_rpc_streams_findings_and_announces_once(daemon):
    _, stub = daemon
    events = list(stub.Watch(pb.WatchRequest(ref="ref", cand="bumped", poll_interval_s=0.05,
                                             timeout_s=5), timeout=T))
    firsts = [e for e in events if e.first_divergence]
    assert len(firsts) == 1
    assert json.loads(firsts[0].finding_json)["key"]["site"] == "layers.1"
    assert events[-1].status.startswith("done")
    findings = [json.loads(e.finding_json) for e in events if e.finding_json and
                not e.first_divergence]
    assert len(findings) == len({json.dumps(f["key"], sort_keys=True) for f in findings})
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Watch(pb.WatchRequest(ref="ref", cand="bumped", timeout_s=-1), timeout=T))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in \
        err.value.details()
    res = cli("watch", "ref", "bumped", "--address", _addr(daemon), "--poll", "0.05")
    assert res.exit_code == 1 and res.output.count("FIRST DIVERGENCE") == 1


def _addr(daemon) -> str:
    return daemon[0].address
