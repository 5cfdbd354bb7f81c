"""Processes and store checks shared by the fault tests.

- `Auditor`: `python -m numaudit.auditor serve` on a fixed loopback port and db, so it can be
  SIGKILLed, SIGSTOPped, SIGTERMed and started again on the same address and file.
- `Writer`: tests/faults/writer_job.py as a subprocess ("the training process"), and readers for
  what it logged (batches cut, acks, failures, its final report).
- `StoreView`: what a store file holds for a run, checked against what the writers produced.

Every wait here is bounded; a helper that times out raises with the process's log tail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], bool], timeout: float, what: str, poll: float = 0.01) -> float:
    """Poll `pred` until true; returns the monotonic time it became true; raises after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(poll)


def figure(name: str, value) -> None:
    """Record a measured figure: printed (pytest -s / -rA) and appended to $NUMAUDIT_FIGURES."""
    line = json.dumps({"figure": name, "value": value})
    print(line)
    path = os.environ.get("NUMAUDIT_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


# -- the auditor daemon ----------------------------------------------------------------------------

class Auditor:
    """`auditor serve` on 127.0.0.1:`port` over `db`; restartable on the same address and file."""

    def __init__(self, tmp: Path, *, db: Path | None = None, port: int | None = None,
                 grace: float = 1.0, preexec_fn: Callable[[], None] | None = None,
                 extra: Iterable[str] = ()) -> None:
        self.tmp = tmp
        self.db = db or tmp / "audit.db"
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.grace = grace
        self.preexec_fn = preexec_fn
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.ready_at: list[float] = []
        self.start_s: list[float] = []
        """Seconds from each Popen to listening: the restart cost (imports, store open)."""
        self.log = tmp / "auditor.log"

    def start(self, timeout: float = 30.0) -> float:
        """Start and wait until it listens; returns the monotonic time it was seen ready."""
        port_file = self.tmp / "auditor.port"
        port_file.unlink(missing_ok=True)
        with open(self.log, "a") as out:  # the daemon writes its own copy of the descriptor
            out.write(f"--- start {self.starts} at {time.monotonic():.3f}\n")
            out.flush()
            self.proc = subprocess.Popen(
                [PY, "-m", "numaudit.auditor", "serve", "--listen", self.address,
                 "--db", str(self.db), "--port-file", str(port_file),
                 "--grace", str(self.grace), *self.extra],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=self.preexec_fn,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        proc, launched = self.proc, time.monotonic()

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"auditor exited {proc.returncode}:\n{_tail(self.log)}")
            return port_file.exists() and bool(port_file.read_text().strip())

        t = wait_until(ready, timeout, "the auditor to listen", poll=0.005)
        self.starts += 1
        self.ready_at.append(t)
        self.start_s.append(t - launched)
        return t

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap (the port is free again when this returns)."""
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (after SIGCONT, in case it is stopped); returns the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise

    def close(self) -> None:
        """For fixtures' teardown: never leave a process behind, whatever state it is in."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


# -- the training process --------------------------------------------------------------------------

class Writer:
    """tests/faults/writer_job.py in a subprocess, with readers for its logs.

    `inprocess=True` runs the same job on a thread of the test process instead (rank 0 of 1):
    for tests whose fault is not in the training process itself, it saves the ~2-5 s of
    importing torch in a fresh interpreter on a loaded 2-core machine.
    """

    def __init__(self, tmp: Path, name: str = "writer", *, records: int, address: str | None,
                 rank: int = 0, world_size: int = 1, extra: Iterable[str] = (),
                 env: dict | None = None, inprocess: bool = False) -> None:
        self.out = tmp / name
        self.out.mkdir(parents=True, exist_ok=True)
        self.spool = tmp / f"{name}-spool"
        self.rank = rank
        self.log = tmp / f"{name}.log"
        args = ["--out", str(self.out), "--records", str(records), "--spool", str(self.spool),
                *extra]
        if address:
            args += ["--address", address]
        self.started = time.monotonic()
        self.proc = None
        if inprocess:
            assert rank == 0 and world_size == 1 and not env, "in-process jobs are rank 0 of 1"
            self._start_thread(args)
            return
        cmd = [PY, "-m", "tests.faults.writer_job", *args]
        full_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        **(env or {}))
        full_env.pop("NUMAUDIT_ADDR", None)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=full_env)

    def _start_thread(self, args: list[str]) -> None:
        import threading
        import traceback

        from tests.faults import writer_job

        self._rc: int | None = None

        def run() -> None:
            try:
                self._rc = writer_job.main(args)
            except BaseException:
                self.log.write_text(traceback.format_exc())
                self._rc = 1

        self._thread = threading.Thread(target=run, name="writer-job", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> int:
        if self.proc is None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise AssertionError(f"in-process writer still running after {timeout}s")
            return self._rc
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"writer still running after {timeout}s:\n{_tail(self.log)}") from None
        return rc

    def finish(self, timeout: float) -> dict:
        """Wait for a clean exit and return its report."""
        rc = self.wait(timeout)
        assert rc == 0, f"writer exited {rc}:\n{_tail(self.log)}"
        return self.report()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def report(self) -> dict:
        return json.loads((self.out / "report.json").read_text())

    def progress(self) -> int:
        try:
            return int((self.out / "progress").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _jsonl(self, name: str) -> list[dict]:
        out = []
        try:
            lines = (self.out / name).read_text().splitlines()
        except OSError:
            return out
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line torn by SIGKILL
        return out

    def batches(self) -> dict[int, dict]:
        """seq -> {"k": keys, "h": content hashes} of every batch the sender cut."""
        return {b["seq"]: b for b in self._jsonl("batches.jsonl") if "seq" in b}

    def acks(self) -> list[dict]:
        return self._jsonl("acks.jsonl")

    def fails(self) -> list[dict]:
        return self._jsonl("fails.jsonl")

    def first_ack_after(self, t: float) -> float | None:
        times = [a["t"] for a in self.acks() if a["t"] >= t]
        return min(times) if times else None

    def manifest(self) -> dict[tuple, str]:
        """(key..., rank) -> content hash of every record this writer put in a batch."""
        out = {}
        for b in self.batches().values():
            for k, h in zip(b["k"], b["h"]):
                out[tuple(k) + (self.rank,)] = h
        return out

    def acked_keys(self) -> set[tuple]:
        """Keys of every record in a batch the agent saw acked."""
        batches = self.batches()
        keys = set()
        for a in self.acks():
            for seq in a["seqs"]:
                keys.update(tuple(k) + (self.rank,) for k in batches[seq]["k"])
        return keys

    def expected_keys(self, n: int, per_step: int = 50) -> set[tuple]:
        from numaudit.protos import numaudit_pb2 as pb

        return {(i // per_step, 0, pb.PHASE_INPUT, f"s{i % per_step}", pb.ROLE_VALUE, 0, 0,
                 self.rank) for i in range(n)}

    def spool_files(self) -> list[Path]:
        return sorted(self.spool.glob("*.spool")) if self.spool.exists() else []


# -- what the store holds --------------------------------------------------------------------------

def _segments_match(conn: sqlite3.Connection, run_id: int) -> bool:
    from numaudit.auditor.store import key_segments

    rids = sorted(r for (r,) in conn.execute("SELECT record_id FROM records WHERE run_id = ?",
                                              (run_id,)))
    in_segments = sorted(rid for (blob,) in conn.execute(
        "SELECT data FROM segments WHERE run_id = ?", (run_id,))
        for rid in key_segments.decode(blob)[0]["record_id"].tolist())
    return rids == in_segments


@dataclass
class StoreView:
    """Rows of one run in a store file, with the checks every fault test makes."""

    rows: dict[tuple, str]
    count: int
    distinct: int
    integrity: str
    sessions: list[dict] = field(default_factory=list)
    segments_match: bool = True
    """The run's key segments hold exactly its records, by record id
    (auditor.store.key_segments)."""

    @classmethod
    def read(cls, db: Path, run: str = "faults") -> StoreView:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
        try:
            integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
            run_row = conn.execute("SELECT run_id FROM runs WHERE name = ?", (run,)).fetchone()
            if run_row is None:
                return cls({}, 0, 0, integrity)
            run_id = run_row[0]
            rows = conn.execute(
                "SELECT r.step, r.microbatch, r.phase, s.name, r.role, r.idx, r.call, r.rank,"
                " hex(r.content_hash) FROM records r JOIN sites s ON s.site_id = r.site_id"
                " WHERE r.run_id = ?", (run_id,)).fetchall()
            count = conn.execute("SELECT COUNT(*) FROM records WHERE run_id = ?",
                                 (run_id,)).fetchone()[0]
            distinct = conn.execute(
                "SELECT COUNT(*) FROM (SELECT DISTINCT step, microbatch, phase, site_id, role,"
                " idx, call, rank FROM records WHERE run_id = ?)", (run_id,)).fetchone()[0]
            sessions = [dict(zip(("session_id", "rank", "acked_seq", "closed", "records_sent",
                                  "records_dropped", "dropped_by_reason"), r))
                        for r in conn.execute(
                            "SELECT session_id, rank, acked_seq, closed, records_sent,"
                            " records_dropped, dropped_by_reason FROM sessions WHERE run_id = ?",
                            (run_id,))]
            segments_match = _segments_match(conn, run_id)
        finally:
            conn.close()
        return cls({tuple(r[:8]): r[8].lower() for r in rows}, count, distinct, integrity,
                   sessions, segments_match)

    def garbage(self, *manifests: dict[tuple, str]) -> list[tuple]:
        """Stored rows that no writer produced (unknown key, or known key with other content)."""
        known: dict[tuple, str] = {}
        for m in manifests:
            known.update(m)
        return [k for k, h in self.rows.items() if known.get(k) != h]

    def check_clean(self, *manifests: dict[tuple, str]) -> None:
        """Integrity ok, no key stored twice, nothing stored that the writers did not produce."""
        assert self.integrity == "ok", self.integrity
        assert self.count == self.distinct == len(self.rows), (self.count, self.distinct)
        assert self.segments_match, "the run's key segments do not hold exactly its records"
        bad = self.garbage(*manifests)
        assert not bad, f"{len(bad)} stored rows no writer produced, e.g. {bad[:3]}"


def replay_into_file(spools: Iterable[Path], db: Path):
    """`auditor ingest` of spool files into the store file `db` (an in-process daemon)."""
    from numaudit.auditor.daemon.replay import replay_into_db

    assert str(db).endswith(".db"), f"{db}: not a store file (an address?)"
    files = list(spools)
    return replay_into_db(files, db) if files else []
