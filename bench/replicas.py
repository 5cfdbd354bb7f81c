"""Benchmark: ingest into a PostgreSQL store through 1 and 2 `auditor serve` replicas.

    python -m bench.replicas --store postgresql://USER@HOST:PORT/postgres [--sessions 8]
                             [--clients 2] [--batches 40] [--records 1024] [--sketch-k 64]
                             [--replicas 1 2] [--sync full]

Real daemons (`python -m auditor serve --store URL`, one process per replica) and real gRPC
clients in separate processes: each client process drives `sessions / clients` sessions, each a
Register and one Ingest stream of packed batches (built before timing, `wire.packed`), with at
most --window batches unacked per stream, over a channel listing every replica (round robin,
`wire.channels.channel_target`). Measured: records/s end to end (first batch sent to last ack,
all sessions) and ack latency p50/p99 (batch handed to gRPC to its ack). Each replica count gets
a fresh database on the server of --store.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _records(n: int, k: int, rank: int, seq: int):
    from protos import numaudit_pb2 as pb

    out = []
    for i in range(n):
        out.append(pb.Record(
            key=pb.Key(step=seq, microbatch=i // 256, phase=pb.PHASE_FWD,
                       site=f"layers.{(i % 256) // 4}.mlp.{i % 4}", role=pb.ROLE_OUTPUT),
            stage=0,
            layout=pb.Layout(logical_shape=[4096, 512], offsets=[rank * 512, 0],
                             shape=[512, 512], dtype="bfloat16"),
            digest=pb.Digest(numel=262144, zero_count=3, has_moments=True, sum=0.5 + i,
                             sum_sq=1.5 * i, min=-3.0, max=3.5, abs_max=3.5,
                             fingerprint=(seq * 1_000_003 + i * 7919 + rank) & ((1 << 64) - 1),
                             fingerprint_seed=7, sketch=[0.001 * (i + j) for j in range(k)],
                             sketch_seed=11)))
    return out


def _client(*args) -> None:
    out = args[-1]
    try:
        _drive(*args)
    except BaseException as exc:  # reported, so the parent does not wait forever
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def _drive(address: str, sessions: list[int], batches: int, n: int, k: int, window: int,
           start_at: float, out: multiprocessing.Queue) -> None:
    from protos import numaudit_pb2 as pb, numaudit_pb2_grpc
    from wire import limits
    from wire.channels import open_channel
    from wire.packed import from_records, packed_batch

    channel = open_channel(address)
    stub = numaudit_pb2_grpc.AuditorStub(channel)
    run = f"bench-{uuid.uuid4().hex[:6]}"
    prepared = {}
    for rank in sessions:
        sid = f"{run}-{rank}"
        stub.Register(pb.RegisterRequest(
            schema_version=limits.CURRENT_SCHEMA_VERSION, run="bench", session_id=sid, rank=rank,
            world_size=1024, mesh_shape=[1024], mesh_dim_names=["dp"], mesh_coordinate=[rank],
            torch_version="2.13.0",
            dtype="bfloat16", host="bench", local_rank=rank), timeout=60)
        prepared[sid] = [packed_batch(sid, seq, from_records(_records(n, k, rank, seq)))
                         for seq in range(1, batches + 1)]
    latencies: list[float] = []
    lock = threading.Lock()
    ends = []

    def stream(sid: str, msgs: list) -> None:
        sent: dict[int, float] = {}
        credit = threading.Semaphore(window)

        def gen():
            for m in msgs:
                credit.acquire()
                sent[m.seq] = time.perf_counter()
                yield m

        local = []
        for ack in stub.Ingest(gen(), timeout=600):
            now = time.perf_counter()
            for seq in [s for s in sent if s <= ack.acked_seq]:
                local.append(now - sent.pop(seq))
                credit.release()
        with lock:
            latencies.extend(local)
            ends.append(time.perf_counter())

    while time.time() < start_at:
        time.sleep(0.001)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream, args=item) for item in prepared.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put({"start": time.time() - (time.perf_counter() - t0), "seconds": max(ends) - t0,
             "records": len(sessions) * batches * n, "latencies": latencies})
    channel.close()


def _serve(url: str, sync: str, tmp: Path, i: int) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"port{i}"
    log = open(tmp / f"replica{i}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "auditor", "serve", "--listen", "127.0.0.1:0", "--store", url,
         "--sync", sync, "--port-file", str(port_file), "--log-level", "warning",
         "--max-inflight-mib", "1024"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"replica {i} did not start: {(tmp / f'replica{i}.log').read_text()}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def run_one(url: str, replicas: int, args: argparse.Namespace) -> dict:
    import psycopg

    name = f"bench_replicas_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    db = url.rsplit("/", 1)[0] + "/" + name
    tmp = Path(tempfile.mkdtemp(prefix="numaudit-replicas-"))
    procs = []
    try:
        for i in range(replicas):
            procs.append(_serve(db, args.sync, tmp, i))
        address = ",".join(a for _, a in procs)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        ranks = list(range(args.sessions))
        start_at = time.time() + 8 + 0.5 * args.sessions * args.batches * args.records / 100_000
        clients = [ctx.Process(target=_client, args=(
            address, ranks[c::args.clients], args.batches, args.records, args.sketch_k,
            args.window, start_at, out)) for c in range(args.clients)]
        for c in clients:
            c.start()
        results = [out.get(timeout=900) for _ in clients]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise RuntimeError(f"client failed: {errors[0]}")
        for c in clients:
            c.join(60)
    finally:
        for p, _ in procs:
            p.terminate()
        for p, _ in procs:
            p.wait(30)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    import numpy as np

    lat = np.array([x for r in results for x in r["latencies"]])
    first = min(r["start"] for r in results)
    last = max(r["start"] + r["seconds"] for r in results)
    records = sum(r["records"] for r in results)
    return {"replicas": replicas, "records": records, "seconds": last - first,
            "records_per_s": records / (last - first),
            "ack_p50_ms": float(np.percentile(lat, 50) * 1e3),
            "ack_p99_ms": float(np.percentile(lat, 99) * 1e3), "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.replicas", description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="postgresql:// URL of a server (a database "
                    "the user may create databases from)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--batches", type=int, default=40, help="batches per session")
    ap.add_argument("--records", type=int, default=1024, help="records per batch")
    ap.add_argument("--sketch-k", type=int, default=64)
    ap.add_argument("--window", type=int, default=4, help="unacked batches per stream")
    ap.add_argument("--sync", default="full", choices=["full", "normal"])
    args = ap.parse_args(argv)
    print(f"## Ingest into PostgreSQL through replicas ({args.sessions} sessions, "
          f"{args.batches} x {args.records} records, k={args.sketch_k}, sync={args.sync})")
    print("| replicas | records | seconds | records/s | ack p50 | ack p99 | load average |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.replicas:
        r = run_one(args.store, n, args)
        print(f"| {n} | {r['records']:,} | {r['seconds']:.2f} | {r['records_per_s']:,.0f} | "
              f"{r['ack_p50_ms']:.1f} ms | {r['ack_p99_ms']:.1f} ms | {r['load']:.1f} |",
              flush=True)
        print(f"<!-- {json.dumps(r)} -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
