"""Issue 10 item 9: every command given a bad --db, spool or TLS file says so in one line and
exits 2 (spools: 1, the file is reported), leaves another application's SQLite file untouched,
and never hangs on a FIFO."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.auditor.pki import make_pki

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(180)


def auditor(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numaudit.auditor", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    (d / "random.db").write_bytes(os.urandom(4096))
    (d / "text.db").write_text("hello, I am a text file\n" * 50)
    foreign = d / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    conn.execute("INSERT INTO notes (body) VALUES ('mine')")
    conn.commit()
    conn.close()
    spool = d / "spools"
    spool.mkdir()
    os.mkfifo(spool / "stuck.spool")
    return {"random": d / "random.db", "text": d / "text.db", "foreign": foreign,
            "missing_dir": d / "nope" / "a.db", "devnull": Path("/dev/null"), "spools": spool}


DBS = ["random", "text", "foreign", "missing_dir", "devnull"]


def _one_line_exit_2(proc: subprocess.CompletedProcess) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("auditor: error: db: "), proc.stderr


@pytest.mark.parametrize("which", DBS)
def test_ingest_into_a_bad_db(bad, which, tmp_path):
    spool = tmp_path / "x.spool"
    spool.write_bytes(b"")
    _one_line_exit_2(auditor("ingest", spool, "--db", bad[which]))


@pytest.mark.parametrize("which", DBS)
@pytest.mark.parametrize("command", [["runs"], ["show", "ref"], ["compare", "ref", "cand"]])
def test_readers_of_a_bad_db(bad, which, command):
    _one_line_exit_2(auditor(*command, "--db", bad[which]))


@pytest.mark.parametrize("which", DBS)
def test_serve_on_a_bad_db(bad, which):
    _one_line_exit_2(auditor("serve", "--listen", "127.0.0.1:0", "--db", bad[which]))


def test_foreign_sqlite_file_is_left_untouched(bad, tmp_path):
    before = hashlib.sha256(bad["foreign"].read_bytes()).hexdigest()
    spool = tmp_path / "x.spool"
    spool.write_bytes(b"")
    proc = auditor("ingest", spool, "--db", bad["foreign"])
    assert "another application's SQLite file" in proc.stderr
    assert hashlib.sha256(bad["foreign"].read_bytes()).hexdigest() == before
    assert not Path(str(bad["foreign"]) + "-wal").exists()


def test_fifo_spool_does_not_hang_ingest(bad, tmp_path):
    proc = auditor("ingest", bad["spools"], "--db", tmp_path / "a.db", timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "not a regular file" in proc.stderr and "Traceback" not in proc.stderr


def test_tls_key_of_another_certificate_is_one_line(tmp_path):
    pki = make_pki(tmp_path)
    proc = auditor("serve", "--listen", "127.0.0.1:0", "--db", tmp_path / "a.db",
                   "--tls-cert", pki.server_cert, "--tls-key", pki.client_key)
    _one_line_tls(proc)
    proc = auditor("runs", "--address", "127.0.0.1:1", "--tls-ca", pki.ca,
                   "--tls-cert", pki.client_cert, "--tls-key", pki.server_key)
    _one_line_tls(proc)


def _one_line_tls(proc: subprocess.CompletedProcess) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "does not match the certificate" in lines[0], proc.stderr
