"""Disk full and I/O errors while the auditor commits.

Guarantees checked: the daemon answers UNAVAILABLE (never INTERNAL or UNKNOWN) and logs the store
error, nothing acked is lost, it recovers by itself when space returns, the agent's resends are
stored once, and the file passes `PRAGMA integrity_check`. A write that still fits is stored and
acked: commits no longer checkpoint (a background thread does, auditor/store/writer.py), so a
fresh client's one-record batch only appends a few WAL frames, which may fit under the limit
where the writer's batches of hundreds of records no longer do; whatever it was told, it was
told the truth.

Two ways to run out of space: a tiny tmpfs filled up by a file (needs root and CAP_SYS_ADMIN;
skipped otherwise), and RLIMIT_FSIZE lowered on the running daemon with prlimit (any Linux), which
makes its writes fail with EFBIG (Python ignores SIGXFSZ).
"""

from __future__ import annotations

import errno
import resource
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2_grpc
from tests.auditor.builders import batch, record, register_request
from tests.faults.harness import Auditor, StoreView, Writer, figure, wait_until

pytestmark = pytest.mark.timeout(90)

FULL_FOR_S = 2.5


def _probe(address: str) -> grpc.StatusCode | None:
    """What a fresh client gets for a write now (None = it succeeded)."""
    with grpc.insecure_channel(address) as channel:
        stub = numaudit_pb2_grpc.AuditorStub(channel)
        try:
            sid = f"probe-{time.monotonic_ns()}"
            stub.Register(register_request(run="probe", session_id=sid), timeout=10)
            list(stub.Ingest(iter([batch(1, [record(0, 0, "probe")] * 1, session_id=sid)]),
                             timeout=10))
            return None
        except grpc.RpcError as exc:
            return exc.code()


def _run_with_full_disk(tmp_path: Path, auditor: Auditor, make_full, make_room) -> dict:
    writer = None
    try:
        auditor.start()
        writer = Writer(tmp_path, records=2000, address=auditor.address, inprocess=True,
                        extra=["--rate", "400", "--flush-timeout", "20"])
        wait_until(lambda: writer.acks(), 60, "first acks")
        make_full()
        full_at = time.monotonic()
        wait_until(lambda: any(f["code"] != "CANCELLED" for f in writer.fails()
                               if f["t"] >= full_at), 30, "a failed commit")
        probe_full = _probe(auditor.address)
        time.sleep(FULL_FOR_S)
        acked_while_full = StoreView.read(auditor.db)
        make_room()
        room_at = time.monotonic()
        wait_until(lambda: writer.first_ack_after(room_at), 30, "acks once space returned")
        recovered_s = writer.first_ack_after(room_at) - room_at
        rep = writer.finish(60)
        probe_after = _probe(auditor.address)
        assert auditor.stop() == 0
    finally:
        if writer:
            writer.kill()
        auditor.close()
    return dict(rep=rep, writer=writer, probe_full=probe_full, probe_after=probe_after,
                recovered_s=recovered_s, full_at=full_at, room_at=room_at,
                acked_while_full=acked_while_full)


def _check(name: str, run: dict, auditor: Auditor) -> None:
    rep, writer = run["rep"], run["writer"]
    s = rep["summary"]
    codes = [f["code"] for f in writer.fails()]
    details = [f["details"] for f in writer.fails() if f["code"] == "UNAVAILABLE"]
    figure(f"{name}.failures_seen", {c: codes.count(c) for c in set(codes)})
    figure(f"{name}.probe_while_full", run["probe_full"].name if run["probe_full"] else "ok")
    figure(f"{name}.recovered_s", round(run["recovered_s"], 3))
    assert codes, "no commit failed: the fault was not injected"
    assert set(codes) <= {"UNAVAILABLE"}, codes  # never INTERNAL/UNKNOWN, never a rejection
    assert any(d.startswith("store: ") for d in details), details[:3]
    if run["probe_full"] is not None:
        assert run["probe_full"] == grpc.StatusCode.UNAVAILABLE
    else:  # acked while the writer's batches failed: it must be stored
        reader = Reader(auditor.db)
        try:
            assert sum(1 for _ in reader.records("probe")) >= 1
        finally:
            reader.close()
    assert run["probe_after"] is None  # it serves writes again without a restart
    assert "store commit failed" in auditor.log.read_text()
    view = StoreView.read(auditor.db)
    view.check_clean(writer.manifest())
    assert s["dropped"] == 0 and s["acked"] == s["captured"] == 2000, s
    assert set(view.rows) == writer.expected_keys(2000)
    assert set(run["acked_while_full"].rows) <= set(view.rows)


def test_disk_full_on_tmpfs_then_space_returns(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); the RLIMIT_FSIZE "
                    "test covers the same path")
    try:
        auditor = Auditor(tmp_path, db=disk / "audit.db")
        filler = disk / "filler"

        def make_full() -> None:
            with open(filler, "wb") as f:
                try:
                    for _ in range(64):  # bounded: 8 MiB of 128 KiB writes at most
                        f.write(b"\0" * (128 << 10))
                        f.flush()
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC

        run = _run_with_full_disk(tmp_path, auditor, make_full, lambda: filler.unlink())
        _check("disk_full_tmpfs", run, auditor)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_file_size_limit_io_errors_then_lifted(tmp_path):
    auditor = Auditor(tmp_path)

    def make_full() -> None:
        biggest = max(p.stat().st_size for p in tmp_path.glob("audit.db*"))
        resource.prlimit(auditor.pid, resource.RLIMIT_FSIZE, (biggest, resource.RLIM_INFINITY))

    def make_room() -> None:
        resource.prlimit(auditor.pid, resource.RLIMIT_FSIZE,
                         (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    run = _run_with_full_disk(tmp_path, auditor, make_full, make_room)
    _check("fsize_limit", run, auditor)
