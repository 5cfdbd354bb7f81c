"""Access control against a real daemon: the token x run x RPC matrix, streams, the token file.

The matrix (`TABLE`) is written out by hand, not derived from auditor/daemon/auth.py, so that it
states the rules: 7 tokens x 2 runs x 7 RPCs = 98 cells, each asserting an exact outcome. Compare
and Watch answer whatever their handler says once authorized ("H": what an open daemon with the same
store answers, UNIMPLEMENTED until the engine is wired), so auth provably runs before them.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from numaudit.auditor.daemon import auth
from numaudit.auditor.daemon.server import SERVICE_NAME, BackgroundServer
from numaudit.auditor.daemon.tokens import TokenFileError, Tokens
from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire.channels import open_channel
from tests.auditor.builders import batch, record, register_request

T = 10
REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(60)

RUN = {"A": "run-a", "B": "run-b"}
SECRET = {  # token name -> the secret a client presents (None = no token)
    "none": None,
    "wrong": "not-a-token-of-this-daemon-0000",
    "read-A": "tok-read-a-6f1c0b7e9d2a4c11",
    "write-A": "tok-write-a-2b9e4f0d1c7a5e33",
    "write-B": "tok-write-b-8d3a6c2f5e1b9a44",
    "rw-*": "tok-rw-all-4e7b1d9c3a6f2e55",
    "admin": "tok-admin-9c5e2a8f1d4b7c66",
}
TOKEN_FILE = f"""
[[token]]
name = "read-A"
token = "{SECRET['read-A']}"
read = ["run-a"]

[[token]]
name = "write-A"
token = "{SECRET['write-A']}"
write = ["run-a"]

[[token]]
name = "write-B"
sha256 = "{hashlib.sha256(SECRET['write-B'].encode()).hexdigest()}"
write = ["run-b*"]

[[token]]
name = "rw-all"
token = "{SECRET['rw-*']}"
read = ["*"]
write = ["*"]

[[token]]
name = "admin"
token = "{SECRET['admin']}"
admin = true
"""

RPCS = ("Register", "Ingest", "CloseSession", "ListRuns", "DescribeRun", "Compare", "Watch")
U, D, OK, H = "UNAUTHENTICATED", "PERMISSION_DENIED", "OK", "H"
L, N = "listed", "not listed"  # ListRuns answered OK, with or without the run
#            Register   Ingest     Close      ListRuns  Describe   Compare   Watch      (A, B)
TABLE = {
    "none":    [(U, U),   (U, U),   (U, U),   (U, U),   (U, U),   (U, U),   (U, U)],
    "wrong":   [(U, U),   (U, U),   (U, U),   (U, U),   (U, U),   (U, U),   (U, U)],
    "read-A":  [(D, D),   (D, D),   (D, D),   (L, N),   (OK, D),  (H, D),   (H, D)],
    "write-A": [(OK, D),  (OK, D),  (OK, D),  (D, D),   (D, D),   (D, D),   (D, D)],
    "write-B": [(D, OK),  (D, OK),  (D, OK),  (D, D),   (D, D),   (D, D),   (D, D)],
    "rw-*":    [(OK, OK), (OK, OK), (OK, OK), (L, L),   (OK, OK), (H, H),   (H, H)],
    "admin":   [(OK, OK), (OK, OK), (OK, OK), (L, L),   (OK, OK), (H, H),   (H, H)],
}
CELLS = [(tok, run, rpc, TABLE[tok][i][j])
         for tok in TABLE for i, rpc in enumerate(RPCS) for j, run in enumerate(RUN)]


def stub_for(address: str, token: str | None) -> numaudit_pb2_grpc.AuditorStub:
    return numaudit_pb2_grpc.AuditorStub(open_channel(address, token=token))


def seed(address: str, token: str | None) -> None:
    """Both runs exist, with a few records, registered through `token`."""
    stub = stub_for(address, token)
    for x, run in RUN.items():
        stub.Register(register_request(run=run, session_id=f"seed-{x}"), timeout=T)
        list(stub.Ingest(iter([batch(1, [record(0, 0, "layers.0")], session_id=f"seed-{x}")]),
                         timeout=T))


def outcome(call) -> str:
    try:
        result = call()
    except grpc.RpcError as exc:
        return exc.code().name
    return result


def attempt(stub, admin, rpc: str, run_key: str, cell: str) -> str:
    """Performs one cell's call; "OK", "listed"/"not listed", or the status code's name."""
    run = RUN[run_key]
    if rpc in ("Ingest", "CloseSession"):  # a session of `run`, registered by the admin
        admin.Register(register_request(run=run, session_id=cell), timeout=T)

    def call() -> str:
        if rpc == "Register":
            stub.Register(register_request(run=run, session_id=cell), timeout=T)
        elif rpc == "Ingest":
            records = [record(0, 0, f"site.{cell}")]  # a key of its own: stored, not a duplicate
            (ack,) = stub.Ingest(iter([batch(1, records, session_id=cell)]), timeout=T)
            assert ack.stored == 1
        elif rpc == "CloseSession":
            stub.CloseSession(pb.CloseSessionRequest(schema_version=1, session_id=cell), timeout=T)
        elif rpc == "ListRuns":
            listed = {r.run for r in stub.ListRuns(pb.ListRunsRequest(), timeout=T).runs}
            return L if run in listed else N
        elif rpc == "DescribeRun":
            assert stub.DescribeRun(pb.DescribeRunRequest(run=run), timeout=T).summary.run == run
        elif rpc == "Compare":
            stub.Compare(pb.CompareRequest(ref=run, cand=run), timeout=T)
        elif rpc == "Watch":
            list(stub.Watch(pb.WatchRequest(ref=run, cand=run, timeout_s=0.2,
                                            poll_interval_s=0.05), timeout=T))
        return OK

    return outcome(call)


def store_effect(db_path: Path, rpc: str, run_key: str, cell: str) -> bool | None:
    """Whether the cell's write landed: session registered / record stored / session closed."""
    if rpc not in ("Register", "Ingest", "CloseSession"):
        return None
    reader = Reader(db_path)
    try:
        sessions = {s["session_id"]: s for s in reader.sessions(RUN[run_key])}
    finally:
        reader.close()
    if rpc == "Register":
        return cell in sessions
    if rpc == "Ingest":
        return sessions[cell]["records_stored"] == 1
    return bool(sessions[cell]["closed"])


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("auth")
    (d / "tokens.toml").write_text(TOKEN_FILE)
    with BackgroundServer("127.0.0.1:0", d / "audit.db", synchronous="NORMAL", grace=0.5,
                          tokens=Tokens.load(d / "tokens.toml")) as server:
        seed(server.address, SECRET["admin"])
        yield server


@pytest.fixture(scope="module")
def handler_answers(tmp_path_factory) -> dict[tuple[str, str], str]:
    """What Compare and Watch answer on an open daemon holding the same runs."""
    d = tmp_path_factory.mktemp("open")
    with BackgroundServer("127.0.0.1:0", d / "audit.db", synchronous="NORMAL",
                          grace=0.5) as server:
        seed(server.address, None)
        stub = stub_for(server.address, None)
        answers = {(rpc, x): attempt(stub, stub, rpc, x, f"open-{rpc}-{x}")
                   for rpc in ("Compare", "Watch") for x in RUN}
    assert not {U, D} & set(answers.values())
    return answers


def test_matrix_covers_every_token_run_and_rpc():
    service = pb.DESCRIPTOR.services_by_name["Auditor"]
    assert set(RPCS) == {m.name for m in service.methods} == set(auth.RULES)
    assert len(CELLS) == len(SECRET) * len(RUN) * len(RPCS) == 98
    assert len({(tok, run, rpc) for tok, run, rpc, _ in CELLS}) == 98


@pytest.mark.parametrize("token, run, rpc, expected", CELLS,
                         ids=[f"{tok}-{run}-{rpc}" for tok, run, rpc, _ in CELLS])
def test_matrix_cell(secured, handler_answers, token, run, rpc, expected):
    stub = stub_for(secured.address, SECRET[token])
    admin = stub_for(secured.address, SECRET["admin"])
    want = handler_answers[(rpc, run)] if expected == H else expected
    cell = f"cell-{token}-{run}-{rpc}"
    assert attempt(stub, admin, rpc, run, cell) == want
    effect = store_effect(secured.db_path, rpc, run, cell)  # a refused write leaves nothing
    assert effect is None or effect == (expected == OK)


# -- Beyond the matrix -------------------------------------------------------------------------

@pytest.mark.parametrize("ref, cand", [("A", "B"), ("B", "A")])
def test_compare_and_watch_need_read_on_both_runs(secured, ref, cand):
    read_a = stub_for(secured.address, SECRET["read-A"])
    rw = stub_for(secured.address, SECRET["rw-*"])
    kw = dict(ref=RUN[ref], cand=RUN[cand])
    watch = pb.WatchRequest(timeout_s=0.2, poll_interval_s=0.05, **kw)
    assert outcome(lambda: read_a.Compare(pb.CompareRequest(**kw), timeout=T)) == D
    assert outcome(lambda: list(read_a.Watch(watch, timeout=T))) == D
    assert outcome(lambda: rw.Compare(pb.CompareRequest(**kw), timeout=T) and OK) not in (U, D)
    assert outcome(lambda: list(rw.Watch(watch, timeout=T)) and OK) not in (U, D)


def test_ingest_stream_is_checked_again_when_the_session_changes(secured):
    admin = stub_for(secured.address, SECRET["admin"])
    for x in RUN:
        admin.Register(register_request(run=RUN[x], session_id=f"switch-{x}"), timeout=T)
    write_a = stub_for(secured.address, SECRET["write-A"])
    call = write_a.Ingest(iter([batch(1, [record(0, 0, "s")], session_id="switch-A"),
                                batch(1, [record(0, 0, "s")], session_id="switch-B")]), timeout=T)
    acks = []
    with pytest.raises(grpc.RpcError) as info:
        for ack in call:
            acks.append(ack)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "run 'run-b'" in info.value.details() and "write-A" in info.value.details()
    assert [(a.session_id, a.stored) for a in acks] == [("switch-A", 1)]
    reader = Reader(secured.db_path)
    try:
        stored = {s["session_id"]: s["records_stored"] for s in reader.sessions(RUN["B"])}
    finally:
        reader.close()
    assert stored["switch-B"] == 0


def test_unknown_session_is_a_precondition_not_a_leak(secured):
    write_a = stub_for(secured.address, SECRET["write-A"])
    assert outcome(lambda: list(write_a.Ingest(iter([batch(1, [record()], session_id="nope")]),
                                               timeout=T))) == "FAILED_PRECONDITION"
    assert outcome(lambda: write_a.CloseSession(pb.CloseSessionRequest(
        schema_version=1, session_id="nope"), timeout=T)) == "FAILED_PRECONDITION"


def test_read_token_cannot_open_an_ingest_stream(secured):
    read_a = stub_for(secured.address, SECRET["read-A"])
    assert outcome(lambda: list(read_a.Ingest(iter([]), timeout=T))) == D


@pytest.mark.parametrize("metadata", [
    (("authorization", "Basic dXNlcjpwYXNz"),),
    (("authorization", "Bearer"),),
    (("authorization", f"Bearer {SECRET['admin']}"), ("authorization", f"Bearer {SECRET['rw-*']}")),
])
def test_malformed_or_ambiguous_authorization_is_unauthenticated(secured, metadata):
    with grpc.insecure_channel(secured.address) as channel:
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        assert outcome(lambda: stub.ListRuns(pb.ListRunsRequest(), timeout=T,
                                             metadata=metadata)) == U


def test_same_token_twice_is_one_token(secured):
    """Over TLS a client may send call credentials and explicit metadata: equal values are fine."""
    entry = ("authorization", f"Bearer {SECRET['read-A']}")
    with grpc.insecure_channel(secured.address) as channel:
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        runs = stub.ListRuns(pb.ListRunsRequest(), timeout=T, metadata=(entry, entry)).runs
    assert [r.run for r in runs] == [RUN["A"]]


def test_health_and_reflection_stay_open(secured):
    with grpc.insecure_channel(secured.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=T)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=T)
        names = {s.name for r in reflect for s in r.list_services_response.service}
    assert SERVICE_NAME in names


# -- The token file ----------------------------------------------------------------------------

def test_identify_matches_plaintext_and_sha256_entries():
    tokens = Tokens.parse({"token": [
        {"name": "p", "token": "x" * 16, "read": ["a*"]},
        {"name": "h", "sha256": hashlib.sha256(b"y" * 16).hexdigest().upper(), "write": "b"},
    ]})
    assert tokens.identify("x" * 16).name == "p"
    grant = tokens.identify("y" * 16)
    assert grant.name == "h" and grant.may("write", "b") and not grant.may("write", "bb")
    assert tokens.identify("z" * 16) is None and tokens.identify("") is None
    assert "x" * 16 not in repr(tokens.grants) and grant.digest.hex() not in repr(grant)


@pytest.mark.parametrize("entries, message", [
    ([], "no [[token]] entries"),
    ([{"token": "s" * 16, "read": ["*"]}], "token[0]: name: required"),
    ([{"name": "n", "read": ["*"]}], "token[0] (n): give exactly one of token"),
    ([{"name": "n", "token": "s" * 16, "sha256": "0" * 64, "read": ["*"]}], "exactly one"),
    ([{"name": "n", "token": "short-secret", "read": ["*"]}], "token: must be a string of 16"),
    ([{"name": "n", "token": "s" * 15 + " ", "read": ["*"]}], "without spaces"),
    ([{"name": "n", "sha256": "abc", "read": ["*"]}], "sha256: must be 64 hex digits"),
    ([{"name": "n", "token": "s" * 16}], "grants nothing"),
    ([{"name": "n", "token": "s" * 16, "read": "ref, pp8"}], "read: must be a list of run-name"),
    ([{"name": "n", "token": "s" * 16, "write": [1]}], "write: must be a list"),
    ([{"name": "n", "token": "s" * 16, "admin": "yes"}], "admin: must be true or false"),
    ([{"name": "n", "token": "s" * 16, "writes": ["*"]}], "unknown key(s) ['writes']"),
    ([{"name": "n", "token": "s" * 16, "read": ["*"]},
      {"name": "n", "token": "t" * 16, "read": ["*"]}], "token[1] (n): name: used by an earlier"),
    ([{"name": "n", "token": "s" * 16, "read": ["*"]},
      {"name": "m", "sha256": hashlib.sha256(b"s" * 16).hexdigest(), "read": ["*"]}],
     "token[1] (m): the same token as entry 'n'"),
])
def test_token_file_errors_name_the_file_and_entry_never_the_secret(entries, message):
    with pytest.raises(TokenFileError) as info:
        Tokens.parse({"token": entries}, "/etc/numaudit/tokens.toml")
    text = str(info.value)
    assert text.startswith("tokens: /etc/numaudit/tokens.toml: ") and message in text, text
    assert "\n" not in text
    for entry in entries:
        if "token" in entry:
            assert entry["token"] not in text


def test_serve_with_a_bad_token_file_exits_2_in_one_line(tmp_path):
    bad = tmp_path / "tokens.toml"
    bad.write_text('[[token]]\nname = "ci"\ntoken = "too-short"\nwrite = ["*"]\n')
    proc = subprocess.run([sys.executable, "-m", "numaudit.auditor", "serve", "--tokens", str(bad),
                           "--db", str(tmp_path / "a.db"), "--listen", "127.0.0.1:0"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"auditor: error: tokens: {bad}: token[0] (ci): token: must be a string of 16 to 4096 "
        "characters"]
    assert "too-short" not in proc.stderr


# -- The daemon's logs and the CLI as a user runs them ------------------------------------------

def test_tokens_never_reach_the_daemon_log_and_cli_uses_numaudit_token(tmp_path):
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(TOKEN_FILE)
    tokens_file.chmod(0o600)
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "numaudit.auditor", "serve", "--listen", "127.0.0.1:0", "--db",
         str(tmp_path / "audit.db"), "--port-file", str(port_file), "--tokens", str(tokens_file),
         "--log-level", "debug", "--grace", "1"],
        cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        seed(address, SECRET["admin"])
        for tok in TABLE:  # every token on every RPC, allowed or not
            stub, admin = stub_for(address, SECRET[tok]), stub_for(address, SECRET["admin"])
            for rpc in RPCS:
                attempt(stub, admin, rpc, "A", f"log-{tok}-{rpc}")
        env = {**os.environ, "NUMAUDIT_TOKEN": SECRET["read-A"]}
        env.pop("NUMAUDIT_DB", None)
        runs = subprocess.run([sys.executable, "-m", "numaudit.auditor", "runs",
                               "--address", address, "--format", "json"], cwd=REPO,
                              capture_output=True, text=True, timeout=30, env=env)
        assert runs.returncode == 0, runs.stderr
        assert [r["run"] for r in json.loads(runs.stdout)] == [RUN["A"]]
        env["NUMAUDIT_TOKEN"] = SECRET["wrong"]
        show = subprocess.run([sys.executable, "-m", "numaudit.auditor", "show", RUN["A"],
                               "--address", address], cwd=REPO, capture_output=True, text=True,
                              timeout=30, env=env)
        assert show.returncode == 2 and "UNAUTHENTICATED" in show.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        _, log = proc.communicate(timeout=30)
    assert proc.returncode == 0, log
    assert "refused: PERMISSION_DENIED" in log and "refused: UNAUTHENTICATED" in log
    assert "tokens from" in log  # it did log, at debug level
    for secret in filter(None, SECRET.values()):
        assert secret not in log
        assert hashlib.sha256(secret.encode()).hexdigest() not in log.lower()


def test_list_runs_is_filtered_whatever_form_the_reply_takes():
    """The ListRuns filter fails closed: a reply the handler serialized itself (bytes, as the
    Compare reply is) is parsed and filtered like a message, never passed through whole."""
    import asyncio

    from numaudit.auditor.daemon.tokens import Grant

    reply = pb.ListRunsResponse()
    for name in ("run-a", "run-b"):
        reply.runs.add(run=name)
    grant = Grant(name="reader-a", digest=b"", read=("run-a",))

    async def call(form):
        async def handler(request, context):
            return form(reply)
        inner = grpc.unary_unary_rpc_method_handler(handler)
        checked = auth._Checked(None, inner, "ListRuns", auth.RULES["ListRuns"], grant)
        return await checked.handler().unary_unary(pb.ListRunsRequest(), None)

    for form in (lambda r: r.SerializeToString(), lambda r: pb.ListRunsResponse.FromString(
            r.SerializeToString())):
        got = asyncio.run(call(form))
        assert [r.run for r in got.runs] == ["run-a"]
