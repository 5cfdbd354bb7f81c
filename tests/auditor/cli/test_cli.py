"""`auditor` as a user runs it: serve as a subprocess, runs/show output, exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import batch, none_record, record, register_request

T = 10
REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(60)


def auditor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numaudit.auditor", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def populate(address: str) -> None:
    """Two ranks of run "ref": forward records, one None grad, rank 0 closed with drops."""
    with grpc.insecure_channel(address, options=limits.client_options()) as channel:
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        for rank in range(2):
            stub.Register(register_request(session_id=f"s{rank}", rank=rank), timeout=T)
            records = [record(step, mb, "layers.0") for step in (0, 1, 3) for mb in range(2)]
            records.append(none_record(0, "layers.1.weight"))
            list(stub.Ingest(iter([batch(1, records, session_id=f"s{rank}")]), timeout=T))
        stub.CloseSession(pb.CloseSessionRequest(
            schema_version=1, session_id="s0", records_sent=9, records_dropped=2,
            dropped_by_reason={"queue_full": 2}), timeout=T)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess_port_file_and_sigterm(tmp_path):
    db, port_file = tmp_path / "audit.db", tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "numaudit.auditor", "serve", "--listen", "127.0.0.1:0",
         "--db", str(db), "--port-file", str(port_file), "--grace", "2"],
        cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        line, seen = "", []
        deadline = time.monotonic() + 30
        while "numaudit auditor listening on" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
        m = re.search(r"numaudit auditor listening on (\S+):(\d+) db=(\S+)", line)
        assert m, line
        assert m.group(3) == str(db) and port_file.read_text().strip() == m.group(2)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        populate(address)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - start < 5
        log = "".join(seen) + proc.stderr.read()
        assert "plaintext" in log and "stopped; store flushed" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    reader = Reader(db)
    try:
        assert len(list(reader.records("ref"))) == 14
    finally:
        reader.close()


def test_serve_refuses_a_taken_port(auditor_server, tmp_path):
    result = auditor("serve", "--listen", auditor_server.address, "--db", tmp_path / "other.db")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"auditor: error: listen: {auditor_server.address}: address already in use")
    assert not (tmp_path / "other.db").exists()


def test_runs_and_show_from_store_and_address(auditor_server):
    populate(auditor_server.address)
    for where in (["--db", auditor_server.db_path], ["--address", auditor_server.address]):
        runs = auditor("runs", *where)
        assert runs.returncode == 0, runs.stderr
        header, row = runs.stdout.strip().splitlines()
        assert header.split()[:3] == ["run", "world", "size"]
        assert row.split()[:5] == ["ref", "2", "2", "1", "14"]

        show = auditor("show", "ref", *where)
        assert show.returncode == 0, show.stderr
        out = show.stdout
        assert "run ref: world size 2, 2 ranks registered, 1 closed, 14 records" in out
        assert "mesh: dp=2" in out
        assert "steps: 0-1, 3 (3); microbatches: 2" in out
        assert re.search(r"^0\s+0\s+0\s+node0\s+\?\s+7\s+9\s+2$", out, re.M), out
        assert re.search(r"^1\s+1\s+0\s+node0\s+\?\s+7\s+open\s+open$", out, re.M), out
        assert re.search(r"^fwd\s+1\s+12\s+0$", out, re.M)
        assert re.search(r"^grad\s+1\s+2\s+2$", out, re.M)
        assert "grad is None: 2 records at 1 sites: layers.1.weight" in out
        assert "drops reported by agents: 2\n  rank 0: queue_full=2" in out
        assert "conflicts: 0" in out

    as_json = json.loads(auditor("show", "ref", "--db", auditor_server.db_path,
                                 "--format", "json").stdout)
    assert as_json["grad_none"] == {"records": 2, "sites": ["layers.1.weight"]}
    assert as_json["mesh"] == {"shape": [2], "dim_names": ["dp"]}
    assert [(r["rank"], r["sent"], r["dropped"]) for r in as_json["ranks"]] == [(0, 9, 2),
                                                                                 (1, None, None)]
    assert as_json["steps"] == [0, 1, 3] and as_json["dropped"] == 2
    runs_json = json.loads(auditor("runs", "--format", "json",
                                   env={"NUMAUDIT_ADDR": auditor_server.address}).stdout)
    assert [(r["run"], r["records"]) for r in runs_json] == [("ref", 14)]


@pytest.mark.parametrize("args,message", [
    (["show", "nope", "--db", "{db}"], "auditor: error: run: no run named 'nope' in the store"),
    (["show", "nope", "--address", "{address}"], "auditor: error: run: no run named 'nope'"),
    (["runs", "--db", "{tmp}/missing.db"], "auditor: error: db: no store at"),
    (["runs", "--db", "{tmp}/junk.db"], "auditor: error: db: "),
    (["runs", "--address", "127.0.0.1:{free}", "--timeout", "3"],
     "auditor: error: cannot reach the auditor at 127.0.0.1:"),
    (["runs", "--db", "{db}", "--address", "{address}"], "auditor: error: give either --db or"),
    (["runs"], "auditor: error: give --store PATH|URL (or --db) or --address HOST:PORT"),
    (["show", "ref", "--db", "{db}", "--format", "xml"], "auditor: error: "),
    (["serve", "--db", "{tmp}/no/such/dir/a.db"], "auditor: error: db: directory"),
])
def test_exit_2_with_one_line(auditor_server, tmp_path, args, message):
    (tmp_path / "junk.db").write_bytes(b"not a database at all" * 100)
    fill = dict(db=auditor_server.db_path, address=auditor_server.address, tmp=tmp_path,
                free=free_port())
    env = {k: "" for k in ("NUMAUDIT_DB", "NUMAUDIT_ADDR")}
    start = time.monotonic()
    result = auditor(*(a.format(**fill) for a in args), env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr
    assert time.monotonic() - start < 15


def test_unreachable_hung_address_respects_the_deadline(tmp_path):
    """A listener that never answers (like a SIGSTOPped auditor): exit 2 after --timeout."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(1)
        start = time.monotonic()
        result = auditor("runs", "--address", f"127.0.0.1:{hung.getsockname()[1]}",
                         "--timeout", "1")
    assert result.returncode == 2 and "cannot reach the auditor" in result.stderr
    assert time.monotonic() - start < 10
