"""Benchmark: checkpoint audit throughput against reading the same files.

    python -m bench.checkpoint [--quick] [--mib 512] [--dtype float32 bfloat16]
                               [--max-memory 256MiB] [--threads 1]

Per dtype, one DCP directory of `--mib` MiB of model weights (24 tensors of equal size, one
process: what a rank of an FSDP save writes) is saved to a temporary directory; then, in one
run and on the same warm page cache, in turns (best of three each):

- read: every tensor chunk's bytes read from its .distcp file into one reused buffer, as the
  checkpoint reader does (positioned `readinto` of its boxes), and nothing else;
- digest: the same bytes digested in memory by the agent's digest (the fused CPU kernel)
  without reading them, for the split of the time;
- audit: `auditor.checkpoint.digest.digest_checkpoint` of the directory into a fresh store
  through an in-process daemon: read, digest, records acked after commit.

Printed: GB/s of each and audit/read, the issue-31 figure (target: >= 0.5 for float32 and
bfloat16 on one core: `--threads 1` sets torch's intra-op threads; the reader, the kernel and
the digest are one thread in any case, the daemon's commit another).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch


def _save(root: Path, dtype: torch.dtype, mib: int) -> Path:
    import torch.distributed.checkpoint as dcp

    n_tensors = 24
    per = max(1, (mib << 20) // n_tensors // torch.empty((), dtype=dtype).element_size())
    cols = 1024
    rows = max(1, per // cols)
    g = torch.Generator().manual_seed(0)
    sd = {"model": {f"layers.{i}.w": torch.randn(rows, cols, generator=g).to(dtype)
                    for i in range(n_tensors)}}
    path = root / str(dtype).removeprefix("torch.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path


def _read_only(path: Path, box_bytes: int) -> int:
    """Every chunk read the way the checkpoint reader reads it, nothing digested."""
    from auditor.checkpoint.formats import open_source
    from auditor.checkpoint.sources import boxes

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
    from agents.agent import Agent
    from agents.config import AgentConfig
    from agents.identity import RankIdentity
    from agents.layout import PieceLayout
    from auditor.checkpoint.formats import open_source

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
    from auditor.checkpoint.digest import digest_checkpoint
    from auditor.checkpoint.formats import open_source
    from auditor.daemon.server import BackgroundServer

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
    ap.add_argument("--max-memory", default=str(256 << 20))
    ap.add_argument("--threads", type=int, default=1)
    args, _ = ap.parse_known_args(argv)
    from auditor.cli.checkpoint import _size

    torch.set_num_threads(args.threads)
    mib = 64 if args.quick else args.mib
    cap = _size(args.max_memory)
    print(f"checkpoint audit vs read: {mib} MiB per dtype, max-memory {cap >> 20} MiB, "
          f"{args.threads} torch thread(s), warm page cache, best of 3")
    print(f"{'dtype':>9} {'read GB/s':>10} {'digest GB/s':>12} {'audit GB/s':>11} "
          f"{'audit/read':>11}")
    with tempfile.TemporaryDirectory(prefix="numaudit-bench-ckpt-") as tmp:
        for name in args.dtype:
            dtype = getattr(torch, name)
            path = _save(Path(tmp), dtype, mib)
            _read_only(path, cap // 2)  # warm the page cache
            rb, rt = _best(lambda: _read_only(path, cap // 2))
            db, dt = _best(lambda: _digest_only(path))
            ab, at = _best(lambda: _audit(path, cap))
            read, dig, aud = rb / rt / 1e9, db / dt / 1e9, ab / at / 1e9
            print(f"{name:>9} {read:>10.2f} {dig:>12.2f} {aud:>11.2f} {aud / read:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
