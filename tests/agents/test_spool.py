"""Spool framing (wire/spool.py): a bad frame costs only itself, and a failed write leaves none."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.spool import MAGIC, SpoolWriter, read_spool

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
SID = "s" * 32


def _batch(seq: int, pad: int = 0) -> pb.RecordBatch:
    b = pb.RecordBatch(schema_version=1, session_id=SID, seq=seq)
    r = b.records.add(stage=-1)
    r.key.step, r.key.microbatch, r.key.phase, r.key.site = 0, seq, pb.PHASE_INPUT, "x" * (1 + pad)
    return b


def _write(directory: Path, n: int, pad: int = 0) -> tuple[Path, list[int]]:
    w = SpoolWriter(directory, "run", 0, SID)
    offsets = [w.bytes_written]
    w.append(pb.RegisterRequest(schema_version=1, run="run", session_id=SID, world_size=1))
    for seq in range(1, n + 1):
        offsets.append(w.bytes_written)
        w.append(_batch(seq, pad))
    offsets.append(w.bytes_written)
    w.append(pb.CloseSessionRequest(schema_version=1, session_id=SID, records_sent=n))
    w.close()
    return w.path, offsets


def test_a_flipped_byte_mid_file_skips_only_that_frame(tmp_path):
    path, offsets = _write(tmp_path, 8, pad=100)
    data = bytearray(path.read_bytes())
    data[offsets[4] + 40] ^= 0xFF  # inside batch 4's body
    path.write_bytes(bytes(data))
    c = read_spool(path)
    assert [b.seq for b in c.batches] == [1, 2, 3, 5, 6, 7, 8]
    assert c.close is not None and c.register is not None
    assert (c.skipped_frames, c.skipped_bytes) == (1, offsets[5] - offsets[4])
    assert "checksum" in c.torn and f"byte {offsets[4]}" in c.torn


def test_a_flipped_length_or_marker_byte_skips_only_that_frame(tmp_path):
    path, offsets = _write(tmp_path, 6, pad=50)
    for where in (0, 5):  # in the marker, in the length
        data = bytearray(path.read_bytes())
        data[offsets[3] + where] ^= 0x40
        broken = tmp_path / f"b{where}.spool"
        broken.write_bytes(bytes(data))
        c = read_spool(broken)
        assert [b.seq for b in c.batches] == [1, 2, 4, 5, 6], where
        assert c.skipped_frames == 1 and c.skipped_bytes == offsets[4] - offsets[3]


def test_a_torn_tail_is_counted(tmp_path):
    path, offsets = _write(tmp_path, 3)
    path.write_bytes(path.read_bytes()[:-5])
    c = read_spool(path)
    assert [b.seq for b in c.batches] == [1, 2, 3] and c.close is None
    assert c.skipped_frames == 1 and c.skipped_bytes == path.stat().st_size - offsets[-1]
    assert c.end == offsets[-1]


def test_a_reopened_writer_cuts_a_torn_tail_before_appending(tmp_path):
    path, offsets = _write(tmp_path, 3)
    path.write_bytes(path.read_bytes()[:offsets[3] + 7])  # batch 3 torn
    c = read_spool(path)
    w = SpoolWriter.reopen(path, truncate_to=c.end)
    w.append(_batch(3))
    w.close()
    again = read_spool(path)
    assert [b.seq for b in again.batches] == [1, 2, 3] and again.clean


def test_format_1_files_are_still_read(tmp_path):
    """The framing before the marker: length, CRC-32 of kind + body, kind, body."""
    def frame(kind, msg):
        body = msg.SerializeToString()
        return struct.pack("<IIB", len(body), zlib.crc32(bytes([kind]) + body), kind) + body

    reg = pb.RegisterRequest(schema_version=1, run="old", session_id=SID, world_size=1)
    path = tmp_path / "old.spool"
    path.write_bytes(frame(1, reg) + frame(2, _batch(1)) + frame(2, _batch(2)))
    c = read_spool(path)
    assert c.register.run == "old" and [b.seq for b in c.batches] == [1, 2] and c.clean
    assert not path.read_bytes().startswith(MAGIC)


_FILL = r"""
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.agents.test_spool import _batch, SID
from numaudit.wire.spool import SpoolWriter
from numaudit.protos import numaudit_pb2 as pb
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death, as on a full disk
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
w = SpoolWriter(Path(sys.argv[1]), "run", 0, SID)
w.append(pb.RegisterRequest(schema_version=1, run="run", session_id=SID, world_size=1))
resource.setrlimit(resource.RLIMIT_FSIZE, (w.bytes_written + 2500, hard))
written, failed = [], []
for seq in range(1, 9):
    try:
        w.append(_batch(seq, pad=1000), durable=True)
        written.append(seq)
    except OSError:
        failed.append(seq)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
for seq in failed:
    w.append(_batch(seq, pad=1000), durable=True)  # the rank resends what was not acked
    written.append(seq)
w.close()
print(len(failed), ",".join(map(str, written)))
"""


def test_a_failed_write_is_truncated_so_nothing_after_it_is_lost(tmp_path):
    out = subprocess.run([sys.executable, "-c", _FILL, str(tmp_path), str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    failed, written = out.stdout.split()
    assert int(failed) >= 1  # the limit did cut a frame in two
    (path,) = tmp_path.glob("*.spool")
    c = read_spool(path)
    assert c.clean, c.problems
    assert [b.seq for b in c.batches] == [int(s) for s in written.split(",")]
    assert sorted(b.seq for b in c.batches) == list(range(1, 9))
