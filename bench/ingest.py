"""Benchmark: end-to-end ingest into real `auditor serve` processes, acked after commit.

    python -m bench.ingest [--quick] [--store PATH_OR_URL] [--replicas 1 2] [--sessions 8]
                           [--clients 2] [--k 64 256] [--batch 512] [--batches N] [--window 2]
                           [--format packed split records] [--payloads N]
                           [--payload-codec zstd|raw] [--sync full|normal] [--server-root DIR]

Simulated ranks: `--sessions` sessions (one gRPC stream each, like one rank's agent) spread over
`--clients` client processes. Each session registers as one rank of run "bench-kK-FORMAT", then
streams its batches, pipelined as the agent does (up to `--window` batches unacked). Batches
are built and serialized before the clock starts (realistic digests: site names of a transformer,
2-D shapes, float32 moments, random fingerprints and normal sketches of k buckets), so the
figures are the daemon's: gRPC receive, checksum, validation, hashing, the store's commit, ack.

The store: `--store` is a store file path (default: a fresh file per configuration in a temporary
directory; SQLite, one daemon) or a PostgreSQL server's URL (`postgresql://USER@HOST:PORT/DB`, a
database the user may create databases from): each configuration then gets a fresh database on
that server, served by `--replicas` daemons at once (one process each), and every session's
channel lists all of them (gRPC round robin, `wire.channels`), as agents do.

`--format packed` sends packed batches (RecordBatch.packed, payloads in PackedRecords.payloads);
`split` sends the payload-carrying records per record beside the packed rest (agents before
packed payloads); `records` sends every record as one message (agents before packed batches).
`--server-root` runs the daemon from another checkout (e.g. an export of an older commit) for a
before/after comparison.

Printed per configuration: records/s and MB/s of record bytes (the serialized records on the
wire) from the first send to the last ack, ack latency p50/p99 (send of a batch to its ack), the
load average, and the CPU seconds the daemons and the client processes used while streaming
(the clients share the machine's cores with the daemons). Under load the ack latency is mostly
queueing (Little's law: sessions x window batches in flight at the measured rate); for one
batch's latency use `--sessions 2 --window 1`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _sites(n: int) -> list[str]:
    kinds = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm")
    return [f"model.layers.{i // len(kinds)}.{kinds[i % len(kinds)]}" for i in range(n)]


PAYLOAD_ELEMENTS = 2048
"""Elements of a payload-carrying record (bfloat16: 4 KiB of raw bytes, under the agent's
default payload_max_bytes of 16 KiB, so the agent would send its bytes)."""


def build_batches(rank: int, n_batches: int, per_batch: int, k: int, fmt: str,
                  session_id: str, seed: int = 0,
                  payload_every: int = 0, payload_codec: str = "zstd") -> tuple[list[bytes], int]:
    """Serialized RecordBatches of one session, and the records' bytes on the wire.

    `payload_every` N > 0: every N-th record is a small piece (PAYLOAD_ELEMENTS) carrying its
    raw bytes as a payload, as the agent sends pieces of up to 16 KiB (packed payloads in
    the packed format): `payload_codec` "zstd" (a zstd frame, as agents before codec raw sent
    every payload) or "raw" (the bytes as they are: what the agent sends where zstd does not
    shrink them by 10 %, as for float noise)."""
    import zstandard

    from numaudit.protos import numaudit_pb2 as pb
    from numaudit.wire.batches import packed_batch, split_batch
    from numaudit.wire.checksum import crc32, records_checksum
    from numaudit.wire.packed import HAS_MOMENTS, SCALAR_COLUMNS, RecordColumns
    from numaudit.wire.record_form import to_records

    rng = np.random.default_rng(seed + rank)
    sites = _sites(256)
    out, record_bytes = [], 0
    dt = dict(SCALAR_COLUMNS)
    for b in range(n_batches):
        n = per_batch
        g = b * n + np.arange(n)  # global record number within the session
        cols = {name: np.zeros(n, t) for name, t in SCALAR_COLUMNS}
        cols["site"][:] = g % len(sites)
        cols["step"][:] = g // (len(sites) * 32)
        cols["microbatch"][:] = (g // len(sites)) % 32
        cols["phase"][:] = 1 + (g // (len(sites) * 16)) % 2  # fwd, bwd
        cols["role"][:] = np.where(cols["phase"] == 1, 1, 3)
        cols["stage"][:] = -1
        cols["flags"][:] = HAS_MOMENTS
        cols["ndim"][:] = 3
        numel = 4 * 4096 * 2
        cols["numel"][:] = numel
        cols["zero_count"][:] = rng.integers(0, 8, n)
        sums = rng.normal(0, 50, n)
        cols["sum"][:] = sums
        cols["sum_sq"][:] = rng.uniform(1e3, 1e4, n)
        cols["min"][:] = -rng.uniform(3, 6, n)
        cols["max"][:] = rng.uniform(3, 6, n)
        cols["abs_max"][:] = np.maximum(-cols["min"], cols["max"])
        odd = rng.integers(0, 1 << 63, n, dtype=np.int64).astype(np.uint64) * 2 + 1
        cols["fingerprint"][:] = odd
        cols["fingerprint_seed"][:] = 0x5EED
        cols["sketch_seed"][:] = 0x5CE7
        cols["sketch_len"][:] = k
        big = np.array([4, 4096 * 8, 2, 0, (4096 * rank) % (4096 * 8), 0, 4, 4096, 2], np.int64)
        small = np.array([PAYLOAD_ELEMENTS, 0, PAYLOAD_ELEMENTS], np.int64)
        carries = (g % payload_every == 0) if payload_every else np.zeros(n, bool)
        cols["ndim"][carries] = 1
        cols["numel"][carries] = PAYLOAD_ELEMENTS
        dims = np.concatenate([small if p else big for p in carries.tolist()])
        c = RecordColumns(n, {name: a.astype(dt[name]) for name, a in cols.items()},
                          sites, ["bfloat16"], dims,
                          rng.normal(0, 30, n * k).astype("<f8"))
        c.cols["dtype"][:] = 0
        zstd = zstandard.ZstdCompressor(level=-1, write_content_size=True)
        for row in np.flatnonzero(carries).tolist():
            data = rng.bytes(2 * PAYLOAD_ELEMENTS)
            if payload_codec == "zstd":
                data = zstd.compress(data)
            c.payloads[row] = pb.Payload(codec=payload_codec, raw_nbytes=2 * PAYLOAD_ELEMENTS,
                                         compressed_nbytes=len(data), crc32=crc32(data),
                                         chunk_index=0, chunk_count=1, data=data)
        if fmt in ("packed", "split"):
            msg = (split_batch(session_id, b + 1, c, None) if fmt == "packed"
                   else packed_batch(session_id, b + 1, c))
            record_bytes += msg.packed.ByteSize() + sum(r.ByteSize() for r in msg.records)
        else:
            msg = pb.RecordBatch(schema_version=1, session_id=session_id, seq=b + 1)
            msg.records.extend(to_records(c))
            msg.records_crc32 = records_checksum(msg.records)
            record_bytes += sum(r.ByteSize() for r in msg.records)
        out.append(msg.SerializeToString())
    return out, record_bytes


def _session(address: str, run: str, rank: int, world: int, batches: list[bytes],
             window: int, start: threading.Barrier, out: dict) -> None:
    from numaudit.protos import numaudit_pb2 as pb
    from numaudit.protos import numaudit_pb2_grpc
    from numaudit.wire.channels import open_channel

    channel = open_channel(address)  # several replicas: round robin
    stub = numaudit_pb2_grpc.AuditorStub(channel)
    sid = out["session_id"]
    stub.Register(pb.RegisterRequest(schema_version=1, run=run, session_id=sid, rank=rank,
                                     world_size=world, job_id=run), timeout=60)
    call = channel.stream_stream("/numaudit.v1.Auditor/Ingest",
                                 request_serializer=None, response_deserializer=pb.Ack.FromString)
    sent_at: dict[int, float] = {}
    slots = threading.Semaphore(window)

    def requests():
        for i, data in enumerate(batches):
            slots.acquire()
            sent_at[i + 1] = time.perf_counter()
            yield data

    start.wait()
    t0 = time.perf_counter()
    latencies, stored = [], 0
    for ack in call(requests(), timeout=600):
        now = time.perf_counter()
        for seq in [s for s in sent_at if s <= ack.acked_seq]:  # an ack covers what precedes it
            latencies.append(now - sent_at.pop(seq))
            slots.release()
        stored += ack.stored
    out.update(t0=t0, t1=time.perf_counter(), latencies=latencies, stored=stored)
    channel.close()


def _client(address: str, run: str, ranks: list[int], world: int, args: dict,
            ready: mp.Barrier, results: mp.Queue) -> None:
    """One client process: builds its sessions' batches, then streams them (one thread each)."""
    sys.path.insert(0, str(ROOT))
    built = {}
    for r in ranks:
        sid = f"bench{os.getpid():x}r{r:06d}"
        built[r] = (sid, *build_batches(r, args["batches"], args["batch"], args["k"],
                                        args["format"], sid, payload_every=args["payloads"],
                                        payload_codec=args["payload_codec"]))
    start = threading.Barrier(len(ranks) + 1)
    outs = {r: {"session_id": built[r][0]} for r in ranks}
    threads = [threading.Thread(target=_session, args=(address, run, r, world, built[r][1],
                                                       args["window"], start, outs[r]))
               for r in ranks]
    for t in threads:
        t.start()
    ready.wait()  # every client has built its batches
    start.wait()
    cpu0 = time.process_time()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu0  # this process's share of the machine while streaming
    for r in ranks:
        o = outs[r]
        results.put(dict(rank=r, t0=o["t0"], t1=o["t1"], latencies=o["latencies"],
                         stored=o["stored"], records=args["batches"] * args["batch"],
                         record_bytes=built[r][2], client_cpu=cpu / len(ranks)))


@contextmanager
def _daemon(store: str, args: argparse.Namespace, tmp: Path, i: int):
    """One `auditor serve` process on `store`; yields its address, terminates it on the way
    out."""
    port_file, log_path = tmp / f"port{i}", tmp / f"auditor{i}.log"
    port_file.unlink(missing_ok=True)
    target = (["--store", store] if "://" in store else ["--db", store])
    server_root = Path(args.server_root).resolve()
    env = dict(os.environ, PYTHONPATH=str(server_root), PYTHONUNBUFFERED="1")
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "numaudit.auditor", "serve", "--listen",
                                 "127.0.0.1:0", *target, "--sync", args.sync, "--port-file",
                                 str(port_file), "--log-level", "warning"],
                                cwd=server_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"auditor serve did not start: {log_path.read_text()}")
            time.sleep(0.02)
        yield f"127.0.0.1:{port_file.read_text().strip()}", proc
    finally:
        proc.terminate()
        proc.wait(30)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def _fresh_store(args: argparse.Namespace, tmp: Path, label: str):
    """A store no configuration used before: a new SQLite file, or a new database on the
    PostgreSQL server of `--store` (dropped afterwards)."""
    if not (args.store and "://" in args.store):
        yield args.store or str(tmp / f"ingest-{label}-{uuid.uuid4().hex[:6]}.db")
        return
    import psycopg

    name = f"bench_ingest_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.store, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield args.store.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(args.store, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_one(k: int, fmt: str, replicas: int, args: argparse.Namespace, tmp: Path) -> dict:
    with ExitStack() as stack:
        store = stack.enter_context(_fresh_store(args, tmp, f"k{k}-{fmt}"))
        daemons = [stack.enter_context(_daemon(store, args, tmp, i)) for i in range(replicas)]
        address = ",".join(a for a, _ in daemons)
        run = f"bench-k{k}-{fmt}-{os.getpid()}-{int(time.time())}"
        clients = max(1, min(args.clients, args.sessions))
        ranks = [list(range(c, args.sessions, clients)) for c in range(clients)]
        ctx = mp.get_context("spawn")
        ready, results = ctx.Barrier(clients), ctx.Queue()
        per = dict(batches=args.batches, batch=args.batch, k=k, format=fmt, window=args.window,
                   payloads=args.payloads, payload_codec=args.payload_codec)
        procs = [ctx.Process(target=_client, args=(address, run, rs, args.sessions, per, ready,
                                                   results)) for rs in ranks]
        for p in procs:
            p.start()
        daemon_cpu0 = sum(_cpu_seconds(d.pid) for _, d in daemons)
        outs = []
        while len(outs) < args.sessions:
            try:
                outs.append(results.get(timeout=1.0))
            except Exception:  # queue.Empty: is every client, every daemon still there?
                if (any(p.exitcode not in (None, 0) for p in procs)
                        or any(d.poll() is not None for _, d in daemons)):
                    raise RuntimeError(
                        "a client or a daemon failed; see the output above") from None
        load = os.getloadavg()[0]
        daemon_cpu = sum(_cpu_seconds(d.pid) for _, d in daemons) - daemon_cpu0
        for p in procs:
            p.join(60)
    t0, t1 = min(o["t0"] for o in outs), max(o["t1"] for o in outs)
    lat = np.array([x for o in outs for x in o["latencies"]]) * 1e3
    records = sum(o["records"] for o in outs)
    stored = sum(o["stored"] for o in outs)
    nbytes = sum(o["record_bytes"] for o in outs)
    return dict(k=k, format=fmt, replicas=replicas, sessions=args.sessions, records=records,
                stored=stored, seconds=t1 - t0, records_s=records / (t1 - t0),
                mb_s=nbytes / (t1 - t0) / 1e6, bytes_per_record=nbytes / records,
                p50_ms=float(np.percentile(lat, 50)), p99_ms=float(np.percentile(lat, 99)),
                load=load, daemon_cpu=daemon_cpu,
                client_cpu=sum(o["client_cpu"] for o in outs))


_SEGMENT_SCHEMA = """
CREATE TABLE probe_batches (segment INTEGER PRIMARY KEY, run_id INTEGER, session_id TEXT,
                            seq INTEGER, n INTEGER, columns BLOB);
CREATE TABLE probe_keys (run_id INTEGER, step INTEGER, microbatch INTEGER, phase INTEGER,
                   site_id INTEGER, role INTEGER, idx INTEGER, call INTEGER, rank INTEGER,
                   content_hash BLOB, segment INTEGER, row INTEGER,
                   PRIMARY KEY (run_id, step, microbatch, phase, site_id, role, idx, call, rank))
                   WITHOUT ROWID;
"""


def store_probe(k: int, batch: int, n_batches: int = 64, group: int = 8) -> None:
    """The store's share of a batch, in this process: rows as `Store.ingest_columns` writes them
    (`record_columns` + `insert_rows` into `records`, and the batch's key segment) against a
    columnar layout that is NOT the store's (one row per batch holding the packed columns as
    received, plus a narrow WITHOUT ROWID key table that keeps (run, key, rank) unique with the
    content hash for conflicts). Same batches, group commits of `group` batches, synchronous=FULL;
    wall and this thread's CPU per batch, and bytes per record on disk after a checkpoint."""
    import itertools

    from numaudit.auditor.daemon.validate import validate_batch
    from numaudit.auditor.store import key_segments
    from numaudit.auditor.store.rows import insert_rows, record_columns, rows_of
    from numaudit.auditor.store.sqlite import connect
    from numaudit.protos import numaudit_pb2 as pb
    from numaudit.wire.content_hash import content_hashes

    per = n_batches // 8
    batches = []
    for s in range(8):
        for data in build_batches(s, per, batch, k, "packed", f"s{s}")[0]:
            msg = pb.RecordBatch.FromString(data)
            cols = validate_batch(msg)
            batches.append((s, cols, content_hashes(cols), msg.packed.SerializeToString()))
    sites = list(range(1, 257))
    one = "(" + ",".join("?" * 12) + ")"

    def rows(conn, i):
        rank, cols, hashes, _ = batches[i]
        columns = record_columns(cols, sites, 1, rank, hashes, f"s{rank}", i, 0.0)
        top = conn.execute("SELECT COALESCE(MAX(record_id), 0) FROM records").fetchone()[0]
        insert_rows(conn, rows_of(columns))
        key_segments.store(conn, 1, columns, range(top + 1, top + 1 + cols.n))

    def segment(conn, i):
        rank, cols, hashes, packed = batches[i]
        c = cols.cols
        seg = conn.execute("INSERT INTO probe_batches (run_id, session_id, seq, n, columns)"
                           " VALUES (1, ?, ?, ?, ?)", (f"s{rank}", i, cols.n, packed)).lastrowid
        keys = list(zip([1] * cols.n, c["step"].tolist(), c["microbatch"].tolist(),
                        c["phase"].tolist(), np.asarray(sites)[c["site"]].tolist(),
                        c["role"].tolist(), c["index"].tolist(), c["call"].tolist(),
                        [rank] * cols.n, hashes, [seg] * cols.n, range(cols.n)))
        for j in range(0, len(keys), 256):
            part = keys[j:j + 256]
            conn.execute(f"INSERT INTO probe_keys VALUES {','.join([one] * len(part))}"
                         " ON CONFLICT DO NOTHING", list(itertools.chain.from_iterable(part)))

    with tempfile.TemporaryDirectory(prefix="numaudit-probe-") as d:
        for rep in range(2):
            for label, write, schema in (("rows", rows, ""), ("segments", segment,
                                                              _SEGMENT_SCHEMA)):
                path = Path(d) / f"{label}{rep}.db"
                conn = connect(path, synchronous="FULL")
                conn.executescript(schema)
                t0, c0 = time.perf_counter(), time.thread_time()
                for g in range(0, len(batches), group):
                    conn.execute("BEGIN IMMEDIATE")
                    for i in range(g, min(g + group, len(batches))):
                        write(conn, i)
                    conn.execute("COMMIT")
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                conn.close()
                n = len(batches) * batch
                print(f"  store probe k={k:<4} {label:<9} {1e3 * wall / len(batches):6.2f} ms "
                      f"wall {1e3 * cpu / len(batches):6.2f} ms CPU per batch: "
                      f"{n / wall:>9,.0f} records/s, {n / cpu:>9,.0f} per CPU-second; "
                      f"{path.stat().st_size / n:5.0f} B/record on disk", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    parser.add_argument("--store", default=None, help="store file or postgresql:// URL of a "
                        "server (default: a fresh SQLite file per configuration)")
    parser.add_argument("--replicas", type=int, nargs="+", default=None,
                        help="daemons serving the store at once (PostgreSQL only; default 1)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--k", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--batch", type=int, default=512, help="records per batch (the "
                        "agent's default batch_records)")
    parser.add_argument("--batches", type=int, default=None, help="batches per session")
    parser.add_argument("--window", type=int, default=2, help="unacked batches per session "
                        "(ack latency grows with it: batches wait in the daemon's queue)")
    parser.add_argument("--format", nargs="+", default=["packed"],
                        choices=["packed", "split", "records"])
    parser.add_argument("--payloads", type=int, default=0, metavar="N",
                        help="every N-th record a small piece carrying its bytes (a 4 KiB zstd "
                        "payload), as the agent sends pieces up to 16 KiB; 0: none")
    parser.add_argument("--payload-codec", default="zstd", choices=["zstd", "raw"],
                        help="the payloads' codec: zstd frames, or raw bytes (what the agent "
                        "sends where zstd does not pay)")
    parser.add_argument("--sync", default="full", choices=["full", "normal"],
                        help="the daemons' --sync (durability of an acked batch)")
    parser.add_argument("--server-root", default=str(ROOT))
    parser.add_argument("--store-probe", action="store_true", help="instead: the SQLite "
                        "store's share of a batch, rows as stored today against a columnar-"
                        "segment layout (in this process; see store_probe)")
    args, _ = parser.parse_known_args(argv)
    if args.store_probe:
        for k in args.k:
            store_probe(k, args.batch)
        return 0
    if args.batches is None:
        args.batches = 10 if args.quick else 40
    pg = bool(args.store and "://" in args.store)
    if args.replicas is None:
        args.replicas = [1]
    elif not pg and args.replicas != [1]:
        parser.error("--replicas needs a postgresql:// --store (a SQLite file has one writer)")
    print(f"bench.ingest: {'PostgreSQL' if pg else 'SQLite'}, {args.sessions} sessions over "
          f"{args.clients} client processes, {args.batches} batches x {args.batch} records each, "
          f"window {args.window}, sync {args.sync}, acked after commit (server {args.server_root})"
          + (f"; every {args.payloads}th record carries a 4 KiB {args.payload_codec} payload"
             if args.payloads else ""))
    with tempfile.TemporaryDirectory(prefix="numaudit-ingest-") as d:
        for replicas in args.replicas:
            for k in args.k:
                for fmt in args.format:
                    r = run_one(k, fmt, replicas, args, Path(d))
                    print(f"  {replicas} daemon{'s' if replicas > 1 else ' '} k={r['k']:<4} "
                          f"{r['format']:<8} {r['records']:>8} records in {r['seconds']:6.2f} s: "
                          f"{r['records_s']:>9,.0f} records/s {r['mb_s']:7.1f} MB/s "
                          f"({r['bytes_per_record']:.0f} B/record)  ack p50 {r['p50_ms']:.1f} ms "
                          f"p99 {r['p99_ms']:.1f} ms  stored {r['stored']}  "
                          f"load {r['load']:.1f}  CPU s: daemons {r['daemon_cpu']:.1f}, clients "
                          f"{r['client_cpu']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
