"""Issue 10 item 2: DescribeRun, ListRuns, Compare and Watch never delay an Ingest ack.

Reads run on their own threads, comparisons in a worker process, watches on their own threads;
the validation threads and the event loop serve ingest only. The daemon runs as a subprocess
(its GIL is its own); a second process keeps show, runs, compare and watch busy on a store of
STORE_RECORDS records while this one times every ack."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time

import grpc
import pytest

from numaudit.auditor.store import Store
from numaudit.protos import numaudit_pb2_grpc
from numaudit.wire import limits
from tests.auditor.builders import batch, record, register_request
from tests.auditor.daemon.daemon_proc import REPO, daemon

pytestmark = pytest.mark.timeout(180)
STORE_RECORDS = 50_000
"""Per run (two runs): DescribeRun takes ~0.1 s and Compare ~1 s on this machine."""
ACKS = 250
P99_BOUND_S = 0.050

_READERS = r"""
import sys, threading, time, grpc
from numaudit.protos import numaudit_pb2 as pb, numaudit_pb2_grpc
stub = numaudit_pb2_grpc.AuditorStub(grpc.insecure_channel(sys.argv[1],
    options=[("grpc.max_receive_message_length", 64 << 20)]))
def loop(call):
    while True:
        try:
            call()
        except grpc.RpcError as exc:
            print("reader:", exc.code(), exc.details(), file=sys.stderr, flush=True)
            time.sleep(0.1)
show = lambda: stub.DescribeRun(pb.DescribeRunRequest(run="ref"), timeout=60)
runs = lambda: stub.ListRuns(pb.ListRunsRequest(), timeout=60)
compare = lambda: stub.Compare(pb.CompareRequest(ref="ref", cand="cand", preset="loose"),
                               timeout=120)
watch = lambda: [e for e in stub.Watch(pb.WatchRequest(ref="ref", cand="cand", timeout_s=0.2,
                                                        poll_interval_s=0.05), timeout=120)]
for name in sys.argv[2].split(","):
    call = globals()[name]
    threading.Thread(target=loop, args=(call,), daemon=True).start()
print("readers started", flush=True)
time.sleep(3600)
"""


def _build_store(db) -> None:
    """STORE_RECORDS records per run: 4096 ingested, the rest copied in SQL (seconds, not tens)."""
    store = Store(db, synchronous="NORMAL")
    try:
        store.begin()
        for run in ("ref", "cand", "live"):
            store.register(register_request(run=run, session_id=run))
        store.ingest(batch(1, [record(i // 64, 0, f"layers.{i % 64}") for i in range(4096)],
                           session_id="ref"))
        conn = store.conn
        cols = [r[1] for r in conn.execute("PRAGMA table_info(records)") if r[1] != "record_id"]
        steps = 4096 // 64
        for k in range(1, -(-STORE_RECORDS // 4096)):
            select = ", ".join(f"step + {k * steps}" if c == "step" else c for c in cols)
            conn.execute(f"INSERT INTO records ({', '.join(cols)}) SELECT {select} FROM records"
                         f" WHERE session_id = 'ref' AND step < {steps}")
        cand_run = conn.execute("SELECT run_id FROM runs WHERE name = 'cand'").fetchone()[0]
        select = ", ".join({"run_id": str(cand_run), "session_id": "'cand'"}.get(c, c)
                           for c in cols)
        conn.execute(f"INSERT INTO records ({', '.join(cols)}) SELECT {select} FROM records"
                     " WHERE session_id = 'ref'")
        store.commit()
    finally:
        store.close()


def test_ack_p99_stays_low_while_reads_and_compares_run(tmp_path):
    db = tmp_path / "a.db"
    t0 = time.monotonic()
    _build_store(db)
    print(f"store built in {time.monotonic() - t0:.1f} s")
    # --sync normal: fsync jitter from other jobs on the shared disk is not what this measures.
    with daemon(db, "--sync", "normal") as (proc, address):
        baseline = sorted(_timed_acks(address, "quiet"))  # same daemon, no readers
        # The readers stand for clients on other machines: niced, so that on this 2-core machine
        # they do not take the daemon's CPU (what is measured is the daemon's own isolation).
        which = os.environ.get("READERS", "show,show,runs,compare,watch")
        readers = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", _READERS, address,
                                    which], cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={"PYTHONPATH": str(REPO)})
        try:
            assert readers.stdout.readline().strip() == "readers started"
            time.sleep(2.0)  # the readers are mid-call (the compare worker has started)
            t0 = time.monotonic()
            latencies = _timed_acks(address, "live")
            print(f"acks timed in {time.monotonic() - t0:.1f} s")
        finally:
            readers.kill()
            _, reader_err = readers.communicate(timeout=30)
    latencies.sort()
    p99, base_p99 = _p99(latencies), _p99(baseline)
    print(f"FIGURE ack latency: quiet p50={baseline[len(baseline) // 2]*1e3:.1f} ms "
          f"p99={base_p99*1e3:.1f} ms; under reads n={len(latencies)} "
          f"p50={latencies[len(latencies) // 2]*1e3:.1f} ms p99={p99*1e3:.1f} ms "
          f"max={latencies[-1]*1e3:.1f} ms; load average {os.getloadavg()[0]:.1f}")
    assert "reader:" not in reader_err, reader_err[-2000:]
    # 50 ms on this machine when other jobs leave it its 2 cores; when neighbours load it (the
    # quiet baseline's own p99 is then tens of ms), reads may cost at most as much again.
    assert p99 <= max(P99_BOUND_S, 2 * base_p99), (p99, base_p99, latencies[-10:])


def _p99(sorted_latencies: list[float]) -> float:
    return sorted_latencies[int(len(sorted_latencies) * 0.99) - 1]


def _timed_acks(address: str, session: str) -> list[float]:
    with grpc.insecure_channel(address, options=limits.client_options()) as ch:
        stub = numaudit_pb2_grpc.AuditorStub(ch)
        stub.Register(register_request(run="live", session_id=session,
                                       rank=int(session == "quiet")), timeout=10)
        outbox: queue.Queue = queue.Queue()
        call = stub.Ingest(iter(outbox.get, None), timeout=120)
        acks = iter(call)
        out = []
        for seq in range(1, ACKS + 1):
            t0 = time.monotonic()
            outbox.put(batch(seq, [record(seq, 0, "live.0")], session_id=session))
            next(acks)
            out.append(time.monotonic() - t0)
            time.sleep(0.01)
        outbox.put(None)
        list(acks)
        return out
