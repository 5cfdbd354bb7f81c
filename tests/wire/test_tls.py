"""TLS and mutual TLS with a throwaway CA: the agent, the CLI and raw clients against real
daemons."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from numaudit.auditor.daemon.server import BackgroundServer
from numaudit.auditor.daemon.tokens import Tokens
from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire.channels import open_channel
from numaudit.wire.tls import ServerTLS, TLSConfig, TLSError
from tests.auditor.pki import PKI, make_pki

T = 5
REPO = Path(__file__).resolve().parents[2]
WRITER = "tok-tls-writer-5a1e9c3b7d2f4e60"
READER = "tok-tls-reader-0d8b2e6a4c1f9b37"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tokens() -> Tokens:
    return Tokens.parse({"token": [{"name": "writer", "token": WRITER, "write": ["tls-*"]},
                                   {"name": "reader", "token": READER, "read": ["tls-*"]}]})


@pytest.fixture
def tls_server(pki, tmp_path):
    """TLS, tokens required, no client certificates."""
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL", grace=0.5,
                          tokens=tokens(), tls=ServerTLS(str(pki.server_cert),
                                                         str(pki.server_key))) as server:
        yield server


@pytest.fixture
def mtls_server(pki, tmp_path):
    """Mutual TLS (client certificates signed by the test CA) and tokens."""
    tls = ServerTLS(str(pki.server_cert), str(pki.server_key), client_ca=str(pki.ca))
    with BackgroundServer("127.0.0.1:0", tmp_path / "audit.db", synchronous="NORMAL", grace=0.5,
                          tokens=tokens(), tls=tls) as server:
        yield server


def list_runs(address: str, tls: TLSConfig | None, token: str | None = READER) -> str:
    """"OK" or the status code's name."""
    with open_channel(address, tls=tls, token=token) as channel:
        try:
            numaudit_pb2_grpc.AuditorStub(channel).ListRuns(pb.ListRunsRequest(), timeout=T)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def deliver(address: str, run: str, **tls_options) -> dict:
    """An agent captures three tensors and closes; returns its summary."""
    import torch

    import numaudit

    agent = numaudit.attach(None, run=run, address=address, token=WRITER, spool_mode="off",
                          flush_timeout_s=5.0, **tls_options)
    with agent.step(0), agent.microbatch(0):
        for i in range(3):
            agent.capture(torch.full((4, 2), float(i)), site=f"x{i}", phase="input")
    return agent.close()


def stored(db_path: Path, run: str) -> int:
    reader = Reader(db_path)
    try:
        return len(list(reader.records(run)))
    finally:
        reader.close()


# -- The agent ---------------------------------------------------------------------------------

def test_agent_delivers_over_mutual_tls_with_its_token(pki, mtls_server):
    s = deliver(mtls_server.address, "tls-mutual", tls_ca=str(pki.ca),
                tls_cert=str(pki.client_cert), tls_key=str(pki.client_key))
    assert s["acked"] == s["sent"] == s["captured"] == 3 and s["dropped"] == 0
    assert stored(mtls_server.db_path, "tls-mutual") == 3


def test_agent_takes_tls_files_from_the_environment(pki, tls_server, monkeypatch):
    monkeypatch.setenv("NUMAUDIT_TLS_CA", str(pki.ca))
    s = deliver(tls_server.address, "tls-env")
    assert s["acked"] == s["captured"] == 3
    assert stored(tls_server.db_path, "tls-env") == 3


def test_agent_refuses_a_certificate_without_its_key(pki):
    import numaudit

    with pytest.raises(ValueError, match="tls_cert/tls_key"):
        numaudit.attach(None, run="tls-x", address="127.0.0.1:1", tls_cert=str(pki.client_cert))
    with pytest.raises(ValueError, match="tls_ca: cannot read"):
        numaudit.attach(None, run="tls-x", address="127.0.0.1:1", tls_ca="/nonexistent/ca.pem")


# -- Clients that must fail, and the ones that must not ------------------------------------------

def test_tls_needs_the_ca(pki, tls_server):
    assert list_runs(tls_server.address, TLSConfig(ca=str(pki.ca))) == "OK"
    assert list_runs(tls_server.address, TLSConfig()) == "UNAVAILABLE"  # system roots: untrusted
    assert list_runs(tls_server.address, None) == "UNAVAILABLE"  # plaintext to a TLS port


def test_token_travels_as_call_credentials_over_tls(pki, tls_server):
    tls = TLSConfig(ca=str(pki.ca))
    with open_channel(tls_server.address, tls=tls, token=READER) as channel:
        assert not isinstance(channel, grpc._interceptor._Channel)  # no metadata interceptor
        numaudit_pb2_grpc.AuditorStub(channel).ListRuns(pb.ListRunsRequest(), timeout=T)
    assert list_runs(tls_server.address, tls, token=None) == "UNAUTHENTICATED"
    assert list_runs(tls_server.address, tls, token="not-a-known-token-000") == "UNAUTHENTICATED"
    assert list_runs(tls_server.address, tls, token=WRITER) == "PERMISSION_DENIED"


def test_mutual_tls_refuses_clients_without_a_ca_signed_certificate(pki, mtls_server):
    ca = str(pki.ca)
    assert list_runs(mtls_server.address, TLSConfig(ca=ca)) == "UNAVAILABLE"
    rogue = TLSConfig(ca=ca, cert=str(pki.rogue_cert), key=str(pki.rogue_key))
    assert list_runs(mtls_server.address, rogue) == "UNAVAILABLE"
    good = TLSConfig(ca=ca, cert=str(pki.client_cert), key=str(pki.client_key))
    assert list_runs(mtls_server.address, good) == "OK"
    assert list_runs(mtls_server.address, good, token=None) == "UNAUTHENTICATED"


def test_unreadable_tls_files_name_the_option(tmp_path):
    with pytest.raises(TLSError, match=r"^tls-ca: cannot read .*missing\.pem"):
        open_channel("127.0.0.1:1", tls=TLSConfig(ca=str(tmp_path / "missing.pem")))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TLSError, match=r"^tls-ca: .*junk\.pem is not a PEM file"):
        open_channel("127.0.0.1:1", tls=TLSConfig(ca=str(tmp_path / "junk.pem")))
    with pytest.raises(TLSError, match="tls-cert/tls-key"):
        TLSConfig.from_files(cert="c.pem")


# -- The CLI as a user runs it -------------------------------------------------------------------

def test_serve_and_runs_over_mutual_tls(pki, tmp_path):
    tokens_file = tmp_path / "tokens.toml"
    tokens_file.write_text(f'[[token]]\nname = "ops"\ntoken = "{READER}"\nadmin = true\n')
    tokens_file.chmod(0o600)
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "numaudit.auditor", "serve", "--listen", "127.0.0.1:0", "--db",
         str(tmp_path / "audit.db"), "--port-file", str(port_file), "--tokens", str(tokens_file),
         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
         "--tls-client-ca", str(pki.ca), "--grace", "1"],
        cwd=REPO, stderr=subprocess.PIPE, text=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMAUDIT_")}
    env["NUMAUDIT_TOKEN"] = READER

    def auditor(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "numaudit.auditor", *args], cwd=REPO,
                              text=True, capture_output=True, timeout=30,
                              env={**env, **extra_env})

    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        with open_channel(address, token=READER, tls=TLSConfig(
                str(pki.ca), str(pki.client_cert), str(pki.client_key))) as channel:
            stub = numaudit_pb2_grpc.AuditorStub(channel)
            stub.Register(pb.RegisterRequest(schema_version=1, run="tls-cli", session_id="s0",
                                             rank=0, world_size=1), timeout=T)
        ok = auditor("runs", "--address", address, "--format", "json", "--tls-ca", str(pki.ca),
                     "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key))
        assert ok.returncode == 0, ok.stderr
        assert [r["run"] for r in json.loads(ok.stdout)] == ["tls-cli"]
        from_env = auditor("show", "tls-cli", "--address", address, "--format", "json",
                           NUMAUDIT_TLS_CA=str(pki.ca), NUMAUDIT_TLS_CERT=str(pki.client_cert),
                           NUMAUDIT_TLS_KEY=str(pki.client_key))
        assert from_env.returncode == 0 and json.loads(from_env.stdout)["run"] == "tls-cli"
        no_cert = auditor("runs", "--address", address, "--tls-ca", str(pki.ca), "--timeout", "2")
        assert no_cert.returncode == 2 and "cannot reach the auditor" in no_cert.stderr
        half = auditor("runs", "--address", address, "--tls-cert", str(pki.client_cert))
        assert half.returncode == 2 and half.stderr.count("\n") == 1 and "tls-key" in half.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        _, log = proc.communicate(timeout=30)
    assert proc.returncode == 0, log
    assert "mutual TLS: client certificates required" in log and READER not in log


def test_sidecar_relays_over_mutual_tls_with_its_token(pki, mtls_server, tmp_path):
    """The rank speaks to the sidecar over a local socket; the sidecar to the auditor over mTLS."""
    import time

    import torch

    import numaudit
    from numaudit.agents.sidecar import Sidecar

    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay", auditor=mtls_server.address, token=WRITER,
                      tls=TLSConfig.from_files(str(pki.ca), str(pki.client_cert),
                                               str(pki.client_key)))
    sidecar.start()
    try:
        agent = numaudit.attach(None, run="tls-sidecar", sidecar=sock)
        with agent.step(0), agent.microbatch(0):
            agent.capture(torch.ones(3), site="x", phase="input")
        assert agent.close()["acked"] == 1
        deadline = time.monotonic() + 20
        while not sidecar._all_done() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sidecar.stop(grace=2)
    assert stored(mtls_server.db_path, "tls-sidecar") == 1
