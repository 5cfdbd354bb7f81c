"""Benchmark: checkpoint audit throughput against reading the same files.

    python -m bench.checkpoint [--quick] [--mib 512] [--dtype float32 bfloat16]
                               [--format dcp safetensors] [--max-memory 256MiB] [--threads 1]
                               [--no-cold]

Per dtype and format, one checkpoint of `--mib` MiB of model weights (24 tensors of equal
size) is written to a temporary directory: a DCP directory as one rank of an FSDP save writes
it (each tensor a torch.save record at whatever byte the last one ended: most are not aligned
to their element size, so the reader copies them into aligned buffers) and a safetensors file
(every tensor aligned: the reader digests the file's mapped pages in place). Then, in one run
and in turns (best of three each):

- read: every tensor chunk's bytes read from its file into one reused buffer (positioned
  `readinto` of the reader's boxes), and nothing else: what any tool pays to look at the data;
- digest: the same bytes digested in memory by the agent's digest (the fused CPU kernel),
  without reading them, for the split of the time;
- audit: `auditor.checkpoint.digest.digest_checkpoint` of the checkpoint into a fresh store
  through an in-process daemon: read, digest, records acked after commit;
- cold read, cold audit: the same with the files evicted from the page cache first
  (posix_fadvise DONTNEED after fsync: no root needed), i.e. read from the disk as a checkpoint
  larger than memory is. A virtual machine's host may still cache them; the read rate shows it.

Printed: GB/s of each, audit/read warm and cold: the issue-31 figure (target: >= 0.5 for
float32 and bfloat16 on one core). `--threads 1` sets torch's intra-op threads; the kernel is
one thread in any case, the reader thread and the daemon's commit run beside it, so pin the
process (`taskset -c 0`) to hold it to one core.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch


def _save(root: Path, dtype: torch.dtype, mib: int, fmt: str) -> Path:
    import torch.distributed.checkpoint as dcp

    from numaudit.auditor.checkpoint.safetensors import write_safetensors

    n_tensors = 24
    per = max(1, (mib << 20) // n_tensors // torch.empty((), dtype=dtype).element_size())
    cols = 1024
    rows = max(1, per // cols)
    g = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.w": torch.randn(rows, cols, generator=g).to(dtype)
               for i in range(n_tensors)}
    path = root / f"{str(dtype).removeprefix('torch.')}-{fmt}"
    if fmt == "safetensors":
        return write_safetensors(path.with_suffix(".safetensors"), weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": weights}, checkpoint_id=str(path), no_dist=True)
    return path


def _evict(path: Path) -> None:
    """Drop the checkpoint's files from the page cache (clean pages only: fsync first)."""
    for f in [path] if path.is_file() else sorted(path.iterdir()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cold(fn, path: Path):
    def run():
        _evict(path)
        t0 = time.perf_counter()
        out = fn()
        return out if isinstance(out, tuple) else (out, time.perf_counter() - t0)
    return run


def _read_only(path: Path, box_bytes: int) -> int:
    """Every chunk read the way the checkpoint reader reads it, nothing digested."""
    from numaudit.auditor.checkpoint.formats import open_source
    from numaudit.auditor.checkpoint.sources import boxes

    src = open_source(str(path))
    buf = torch.empty(box_bytes, dtype=torch.uint8)
    try:
        for entry in src.entries():
            if entry.dtype is None:
                continue
            item = torch.empty((), dtype=entry.dtype).element_size()
            for chunk in entry.chunks:
                for _, shape, start in boxes(chunk.shape, box_bytes // item):
                    n = 1
                    for s in shape:
                        n *= s
                    chunk.read(start, n, buf)
        return src.files.bytes_read
    finally:
        src.close()


def _digest_only(path: Path) -> tuple[int, float]:
    """The same tensors digested in memory as the reader hands them over (the capturer's fused
    CPU kernel, boxes with their layouts), loaded first, off the clock; nothing sent."""
    from numaudit.agents.agent import Agent
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.identity import RankIdentity
    from numaudit.agents.layout import PieceLayout
    from numaudit.auditor.checkpoint.formats import open_source

    src = open_source(str(path))
    tensors = []
    try:
        for entry in src.entries():
            if entry.dtype is not None:
                c = entry.chunks[0]
                n = 1
                for s in c.shape:
                    n *= s
                tensors.append(c.read(0, n, None).reshape(c.shape).clone())
    finally:
        src.close()
    capturer = Agent(AgentConfig(phases=("state",), enabled=False), RankIdentity()).capturer
    t0 = time.perf_counter()
    with capturer.at_step(0):
        for i, t in enumerate(tensors):
            capturer.capture_values([(f"w{i}", -1, t, PieceLayout.full(t.shape))],
                                    phase="state")
    return sum(t.nbytes for t in tensors), time.perf_counter() - t0


def _audit(path: Path, max_memory: int) -> tuple[int, float]:
    from numaudit.auditor.checkpoint.digest import digest_checkpoint
    from numaudit.auditor.checkpoint.formats import open_source
    from numaudit.auditor.daemon.server import BackgroundServer

    with tempfile.TemporaryDirectory() as tmp, \
            BackgroundServer("127.0.0.1:0", Path(tmp) / "b.db", synchronous="NORMAL",
                             grace=1.0) as srv:
        src = open_source(str(path))
        try:
            t0 = time.perf_counter()
            stats = digest_checkpoint(src, address=srv.address, run="bench",
                                      max_memory=max_memory)
            return stats.bytes_read, time.perf_counter() - t0
        finally:
            src.close()


def _best(fn, repeats: int = 3) -> tuple[int, float]:
    best = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        if isinstance(out, tuple):
            nbytes, dt = out
        else:
            nbytes, dt = out, time.perf_counter() - t0
        best = (nbytes, dt) if best is None or dt < best[1] else best
    return best


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB per dtype")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--format", nargs="+", default=["dcp", "safetensors"],
                    choices=["dcp", "safetensors"])
    ap.add_argument("--max-memory", default=str(256 << 20))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold page-cache runs")
    args, _ = ap.parse_known_args(argv)
    from numaudit.auditor.cli.checkpoint import _size

    torch.set_num_threads(args.threads)
    mib = 64 if args.quick else args.mib
    cap = _size(args.max_memory)
    cold = not args.no_cold and hasattr(os, "posix_fadvise")
    print(f"checkpoint audit vs read: {mib} MiB a checkpoint, max-memory {cap >> 20} MiB, "
          f"{args.threads} torch thread(s), {len(os.sched_getaffinity(0))} core(s) allowed, "
          "best of 3 (GB/s)")
    print(f"{'dtype':>9} {'format':>12} {'read':>6} {'digest':>7} {'audit':>6} "
          f"{'audit/read':>11}" + (f" {'cold read':>10} {'cold audit':>11} {'audit/read':>11}"
                                   if cold else ""))
    with tempfile.TemporaryDirectory(prefix="numaudit-bench-ckpt-") as tmp:
        for name in args.dtype:
            for fmt in args.format:
                path = _save(Path(tmp), getattr(torch, name), mib, fmt)
                read_fn = partial(_read_only, path, cap // 3)
                audit_fn = partial(_audit, path, cap)
                read_fn()  # warm the page cache
                rb, rt = _best(read_fn)
                db, dt = _best(partial(_digest_only, path))
                ab, at = _best(audit_fn)
                read, dig, aud = rb / rt / 1e9, db / dt / 1e9, ab / at / 1e9
                line = (f"{name:>9} {fmt:>12} {read:>6.2f} {dig:>7.2f} {aud:>6.2f} "
                        f"{aud / read:>11.2f}")
                if cold:
                    crb, crt = _best(_cold(read_fn, path))
                    cab, cat = _best(_cold(audit_fn, path))
                    cread, caud = crb / crt / 1e9, cab / cat / 1e9
                    line += f" {cread:>10.2f} {caud:>11.2f} {caud / cread:>11.2f}"
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
