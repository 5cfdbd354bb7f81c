"""`auditor ingest`: spool files into a store, idempotently, with exit codes a script can use."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.batches import batch_record_count
from numaudit.wire.spool import SpoolWriter

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[3]


def _spool(directory: Path, run: str = "offline", n: int = 3) -> Path:
    reg = pb.RegisterRequest(schema_version=1, run=run, session_id="s" * 32, rank=0, world_size=1)
    w = SpoolWriter(directory, run, 0, reg.session_id)
    w.append(reg)
    for seq in range(1, n + 1):
        b = pb.RecordBatch(schema_version=1, session_id=reg.session_id, seq=seq)
        r = b.records.add(stage=-1)
        r.key.step, r.key.microbatch, r.key.phase, r.key.site = 0, seq, pb.PHASE_INPUT, "x"
        r.key.role = pb.ROLE_VALUE
        r.layout.logical_shape[:] = r.layout.shape[:] = [2]
        r.layout.offsets[:] = [0]
        r.layout.dtype = "int64"
        r.digest.numel = 2
        w.append(b)
    w.append(pb.CloseSessionRequest(schema_version=1, session_id=reg.session_id, records_sent=n))
    w.close()
    return w.path


def _ingest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numaudit.auditor", "ingest", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_ingest_loads_a_spool_directory_once(tmp_path):
    _spool(tmp_path / "spool")
    db = tmp_path / "a.db"
    first = _ingest(str(tmp_path / "spool"), "--db", str(db))
    assert first.returncode == 0, first.stderr
    assert "3 stored, 0 already stored" in first.stdout
    again = _ingest(str(tmp_path / "spool"), "--db", str(db))
    assert again.returncode == 0 and "0 stored, 3 already stored" in again.stdout
    assert len(list(Reader(db).records("offline"))) == 3
    assert Reader(db).sessions("offline")[0]["closed"]


def test_torn_tail_is_reported_the_intact_part_loaded_and_the_exit_is_1(tmp_path):
    path = _spool(tmp_path / "spool")
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the process died mid-write of the close frame
    out = _ingest(str(path), "--db", str(tmp_path / "a.db"))
    assert out.returncode == 1, out.stderr
    assert "1 unreadable frames" in out.stdout and "3 stored" in out.stdout
    assert "unreadable:" in out.stderr


def test_a_flipped_byte_mid_file_costs_only_its_frame(tmp_path):
    from numaudit.wire.spool import read_spool

    path = _spool(tmp_path / "spool")
    whole = read_spool(path)
    assert whole.clean and len(whole.batches) >= 2
    data = bytearray(path.read_bytes())
    # a byte inside the first batch frame's body: its session id (the register frame, which
    # holds the first copy of the session id, comes before it)
    sid = whole.register.session_id.encode()
    first_batch = data.find(sid, data.find(sid) + 1)
    data[first_batch + 3] ^= 0xFF
    path.write_bytes(bytes(data))
    out = _ingest(str(path), "--db", str(tmp_path / "a.db"))
    assert out.returncode == 1
    assert "1 unreadable frames" in out.stdout
    stored = len(list(Reader(tmp_path / "a.db").records("offline")))
    assert stored == sum(batch_record_count(b) for b in whole.batches[1:])


def test_usage_errors_exit_2_with_one_line(tmp_path):
    out = _ingest(str(tmp_path / "nope"), "--db", str(tmp_path / "a.db"))
    assert out.returncode == 2
    assert "no such spool file" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    out = _ingest(str(tmp_path / "empty"), "--db", str(tmp_path / "a.db"))
    assert out.returncode == 2 and "no *.spool files" in out.stderr


def test_a_file_that_is_not_a_spool_fails_with_exit_1(tmp_path):
    bad = tmp_path / "bad.spool"
    bad.write_bytes(b"not a spool at all")
    out = _ingest(str(bad), "--db", str(tmp_path / "a.db"))
    assert out.returncode == 1 and "not loaded" in out.stderr
