"""Benchmark: comparing two stored runs of 100k and 1M logical keys (goal: 1M keys < 10 s).

    python -m bench.compare [--quick] [--keys 100000 1000000] [--pieces 1] [--dir DIR]
                            [--store postgresql://...]

The runs are synthetic and written straight into a store file with the store's own schema
(`auditor.store.connect`), bypassing the gRPC ingest (which has its own benchmark) so that
building a million-key database takes seconds, not minutes. Each key is a float32 tensor; the
candidate differs from the reference in 0.1% of keys by a rounding-size change (`close`) and in
0.01% by a large one (`diverged`), so the slow path (moments and sketches read from the store)
runs too. With ``--pieces N`` each key is split in N shards in the candidate (one piece in the
reference), so the tiling merge is measured as well.

Reported per size: time to build the report (engine), time to render text and JSON, keys/s.
Databases are cached under --dir (default: $TMPDIR/numaudit-bench) by their parameters.

With ``--store postgresql://...`` (an empty database, or one this benchmark loaded before) the
same runs are also copied into PostgreSQL (COPY, then VACUUM ANALYZE) and compared there, so the
two backends are measured in one run on the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SKETCH_K = 16
"""Default sketch buckets of the synthetic records (the agent's default is 256, 2 KiB a record;
16 keeps the million-key store at 600 MB; identical keys never read their sketches, but wider
rows spread the records over more pages: --sketch-k 256 measures that)."""
CLOSE_FRACTION = 1e-3
DIVERGED_FRACTION = 1e-4


def _shape_for(n_keys: int) -> tuple[int, int, int, int]:
    """(steps, microbatches, modules, params) giving about n_keys keys."""
    steps, mbs = 5, 16
    per_step = max(1, n_keys // steps)
    params = max(1, per_step // 25)
    modules = max(1, (per_step - 2 * params) // (2 * mbs))
    return steps, mbs, modules, params


def build_store(path: Path, n_keys: int, pieces: int, seed: int = 0,
                sketch_k: int = SKETCH_K, close_fraction: float = CLOSE_FRACTION) -> dict:
    """Write runs "ref" (1 piece per key) and "cand" (``pieces`` shards per key)."""
    from numaudit.auditor.compare.digests.algebra import (
        FINGERPRINT_SEED,
        SKETCH_SEED,
        fingerprint_to_int64,
    )
    from numaudit.auditor.store import connect

    steps, mbs, modules, params = _shape_for(n_keys)
    rng = np.random.default_rng(seed)
    conn = connect(path, synchronous="OFF")
    conn.execute("PRAGMA journal_mode=OFF")
    conn.execute("BEGIN")
    site_names = [f"layers.{i // 4}.block{i % 4}" for i in range(modules)] + \
        [f"layers.{i // 8}.p{i % 8}.weight" for i in range(params)]
    conn.executemany("INSERT INTO sites (site_id, name) VALUES (?, ?)",
                     list(enumerate(site_names, start=1)))
    mod_ids = np.arange(1, modules + 1)
    par_ids = np.arange(modules + 1, modules + params + 1)
    keys = []
    for step in range(steps):
        for mb in range(mbs):
            for phase, role in ((1, 1), (2, 3)):
                keys.append(np.stack([np.full(modules, step), np.full(modules, mb),
                                      np.full(modules, phase), mod_ids, np.full(modules, role)], 1))
        for phase in (4, 3):  # param, grad
            keys.append(np.stack([np.full(params, step), np.full(params, -1),
                                  np.full(params, phase), par_ids, np.full(params, 5)], 1))
    keys = np.concatenate(keys)
    n = len(keys)
    fps = rng.integers(-(1 << 63), (1 << 63) - 1, size=n, dtype=np.int64)
    sketches = rng.standard_normal((n, sketch_k))
    sum_sq = (sketches ** 2).sum(1)
    kind = np.zeros(n, np.int8)
    pick = rng.random(n)
    kind[pick < close_fraction] = 1
    kind[pick < DIVERGED_FRACTION] = 2
    fs, ss = fingerprint_to_int64(FINGERPRINT_SEED), fingerprint_to_int64(SKETCH_SEED)
    numel = 4096
    for run_id, name, n_pieces in ((1, "ref", 1), (2, "cand", pieces)):
        conn.execute("INSERT INTO runs (run_id, name, created, world_size, mesh_shape,"
                     " mesh_dim_names, torch_version, dtype, seed, labels)"
                     " VALUES (?,?,?,?,?,?,?,?,?,?)",
                     (run_id, name, time.time(), n_pieces, "[]", "[]", "2.13.0", "float32", 0,
                      "{}"))
        for r in range(n_pieces):
            conn.execute("INSERT INTO sessions (session_id, run_id, rank, local_rank, host,"
                         " mesh_coordinate, stages, registered, closed) VALUES (?,?,?,?,?,?,?,?,?)",
                         (f"{name}-{r}", run_id, r, r, "bench", "[]", "[]", time.time(),
                          time.time()))
        rows = []
        cand = name == "cand"
        fp_run = fps.copy()
        sk_run = sketches.copy()
        if cand:
            fp_run[kind > 0] ^= 0x5A5A
            sk_run[kind == 1] *= 1 + 1e-7
            sk_run[kind == 2] *= 1.5
        ss_run = (sk_run ** 2).sum(1) if cand else sum_sq
        for i in range(n):
            step, mb, phase, site, role = (int(v) for v in keys[i])
            for r in range(n_pieces):
                rows_per = numel // n_pieces
                if n_pieces == 1:
                    lay = ("[64, 64]", "[0, 0]", "[64, 64]")
                    fp = int(fp_run[i])
                    sk = sk_run[i]
                    s2 = float(ss_run[i])
                else:
                    h = 64 // n_pieces
                    lay = ("[64, 64]", f"[{r * h}, 0]", f"[{h}, 64]")
                    # shards whose fingerprints and sketches add up to the logical tensor's
                    fp = int(fp_run[i]) if r == 0 else 0
                    sk = sk_run[i] if r == 0 else np.zeros(sketch_k)
                    s2 = float(ss_run[i]) if r == 0 else 0.0
                rows.append((run_id, step, mb, phase, site, role, 0, 0, r, -1, 0, "float32",
                             lay[0], lay[1], lay[2], 0, 0, 0, rows_per if n_pieces > 1 else numel,
                             0, 0, 0, 0, 1, 0.0, s2, -3.0, 3.0, 3.0, fp, fs,
                             struct.pack(f"<{sketch_k}d", *sk), ss, b"", f"{name}-{r}", 1, 0.0,
                             i + 1))  # capture order: each rank numbers its keys in key order
            if len(rows) >= 100_000:
                _insert(conn, rows)
                rows = []
        _insert(conn, rows)
    conn.execute("COMMIT")
    conn.close()
    return {"keys": n, "steps": steps, "microbatches": mbs, "modules": modules, "params": params}


def _insert(conn, rows) -> None:
    conn.executemany(
        "INSERT INTO records (run_id, step, microbatch, phase, site_id, role, idx, call, rank,"
        " stage, is_none, dtype, logical_shape, offsets, shape, replica, partial, complex_as_real,"
        " numel, nan, posinf, neginf, zeros, has_moments, sum, sum_sq, min, max, abs_max,"
        " fingerprint, fingerprint_seed, sketch, sketch_seed, content_hash, session_id, seq,"
        " received, capture_order)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        rows)


def _ensure_segments(db: Path) -> None:
    """Key segments for runs whose records the build wrote as rows (`key_segments.backfill`; a
    store the agent's batches filled has them from ingest)."""
    from numaudit.auditor.store import connect, key_segments

    conn = connect(db, synchronous="OFF")
    try:
        for (run_id,) in conn.execute("SELECT run_id FROM runs").fetchall():
            if not key_segments.complete(conn, run_id):
                key_segments.backfill(conn, run_id)
    finally:
        conn.close()


def copy_to_postgres(db: Path, url: str) -> str:
    """The runs of store file `db` in a database of the PostgreSQL server of `url` named after
    the file (created and loaded on first use); returns that database's URL."""
    import sqlite3

    import psycopg

    from numaudit.auditor.store.postgres import pg_connect

    name = "bench_" + "".join(c if c.isalnum() else "_" for c in db.stem)
    target = url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(url, autocommit=True) as admin:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            return target
        admin.execute(f'CREATE DATABASE "{name}"')
    conn = pg_connect(target, synchronous="NORMAL")
    src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        for table in ("runs", "sessions", "sites", "records"):
            cols = [r[1] for r in src.execute(f"PRAGMA table_info({table})")]
            with conn.cursor().copy(f"COPY {table} ({', '.join(cols)}) FROM STDIN") as copy:
                for row in src.execute(f"SELECT {', '.join(cols)} FROM {table}"):
                    copy.write_row(row)
        for table, key in (("runs", "run_id"), ("sites", "site_id"), ("records", "record_id")):
            conn.execute(f"SELECT setval(pg_get_serial_sequence('{table}', '{key}'),"
                         f" (SELECT COALESCE(MAX({key}), 1) FROM {table}))")
        conn.execute("VACUUM ANALYZE")
    finally:
        src.close()
        conn.close()
    return target


def run_one(directory: Path, n_keys: int, pieces: int, sketch_k: int = SKETCH_K,
            close_fraction: float = CLOSE_FRACTION, store: str | None = None) -> dict:
    from numaudit.auditor.compare.engine import compare_runs
    from numaudit.auditor.report.json_report import write_json
    from numaudit.auditor.report.text import to_text

    directory.mkdir(parents=True, exist_ok=True)
    tag = "" if close_fraction == CLOSE_FRACTION else f"-close{close_fraction:g}"
    db = directory / f"compare-{n_keys}-{pieces}-k{sketch_k}{tag}-v2.db"  # v2: numbered
    meta_path = db.with_suffix(".json")
    if not (db.exists() and meta_path.exists()):
        for p in (db, meta_path):
            p.unlink(missing_ok=True)
        t = time.perf_counter()
        meta = build_store(db, n_keys, pieces, sketch_k=sketch_k, close_fraction=close_fraction)
        meta["build_s"] = time.perf_counter() - t
        meta_path.write_text(json.dumps(meta))
    meta = json.loads(meta_path.read_text())
    _ensure_segments(db)
    location: Path | str = db
    if store:
        t = time.perf_counter()
        location = copy_to_postgres(db, store)
        meta["copy_s"] = time.perf_counter() - t
    t0 = time.perf_counter()
    c0 = time.process_time()
    report = compare_runs(location, "ref", "cand")
    t1 = time.perf_counter()
    cpu = time.process_time() - c0
    text = to_text(report, width=120)
    t2 = time.perf_counter()
    with open(os.devnull, "w") as sink:
        write_json(report, sink)
    t3 = time.perf_counter()
    keys = meta["keys"]
    return {
        "keys": keys, "pieces": pieces, "compare_s": t1 - t0, "compare_cpu_s": cpu,
        "text_s": t2 - t1, "load": os.getloadavg()[0],
        "json_s": t3 - t2, "keys_per_s": keys / (t1 - t0), "timings": report.comparison.timings,
        "verdicts": {k: v for k, v in report.counts.items() if v}, "text_lines": text.count("\n"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.compare", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10k and 100k keys only")
    ap.add_argument("--keys", type=int, nargs="+", default=None)
    ap.add_argument("--pieces", type=int, default=1, help="shards per key in the candidate")
    ap.add_argument("--sketch-k", type=int, default=SKETCH_K, help="sketch buckets per record")
    ap.add_argument("--close-fraction", type=float, default=CLOSE_FRACTION,
                    help="keys that differ by a rounding-size change (1 = all: the bf16 case)")
    ap.add_argument("--store", default=None, metavar="URL",
                    help="also compare on PostgreSQL: a postgresql:// URL of the server (the "
                         "benchmark creates a database per size there)")
    ap.add_argument("--dir", type=Path,
                    default=Path(tempfile.gettempdir()) / "numaudit-bench")
    args, _ = ap.parse_known_args(argv)  # `python -m bench` hands every benchmark the same argv
    sizes = args.keys or ([10_000, 100_000] if args.quick else [100_000, 1_000_000])
    print(f"## Comparison (candidate: {args.pieces} piece(s) per key, sketch k={args.sketch_k}, "
          f"{args.close_fraction:g} of keys close)")
    print("| store | keys | compare (wall) | compare (CPU) | keys/s (wall) | text report | "
          "JSON report (all findings) | load average |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for n, store in ((n, s) for n in sizes for s in [None] + ([args.store] if args.store else [])):
        r = run_one(args.dir, n, args.pieces, args.sketch_k, args.close_fraction, store)
        print(f"| {'PostgreSQL' if store else 'SQLite'} "
              f"| {r['keys']:,} | {r['compare_s']:.2f} s | {r['compare_cpu_s']:.2f} s | "
              f"{r['keys_per_s']:,.0f} | {r['text_s']:.2f} s | {r['json_s']:.2f} s | "
              f"{r['load']:.1f} |", flush=True)
        print(f"<!-- stages: {json.dumps({k: round(v, 3) for k, v in r['timings'].items()})} "
              f"verdicts: {json.dumps(r['verdicts'])} -->", flush=True)
        if r["keys"] >= 1_000_000 and r["compare_s"] > 10:
            ok = False
    if not ok:
        print("goal missed: 1M keys took more than 10 s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
