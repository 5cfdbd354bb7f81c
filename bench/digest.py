"""Digest throughput next to a plain copy of the same data (docs/benchmarks.md), and what
per-sample digests add to a batch-holding capture (time and record bytes).

For each dtype and size: the median time of ``dst.copy_(src)``, of the fused kernel and of the
eager ``digest_piece`` on one tensor, their ratios, and the eager digest's breakdown into its
components (index keys, fingerprint, moments, sketch). Throughput counts the source tensor's bytes
once. The copy and the fused kernel run in turn, and `fused/copy` is the median of each round's
ratio: timed apart, a neighbour's burst on this shared machine landed on one of them and moved
the 1 MiB ratio between 20 % and 58 % from run to run.

`fused` is the kernel called as the agent calls it: the piece's descriptor built once (the agent
caches it per site and shape) and the rows written into a buffer that exists already (the
agent's row batch). `op` is the torch op's body (`cpu.digest_rows`), which builds the
descriptor and allocates the two rows on every call: about 14 us more, a tenth of a 1 MiB
float32 digest.

The default is one intra-op thread: on a shared 2-core machine two threads spend their time
waiting for each other, and one thread is what FIELD-NOTES' floors were measured with.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from numaudit.agents.digest.digest import DEFAULT_SKETCH_K, _digest, digest_piece
from numaudit.agents.digest.rows import RowBatch
from numaudit.agents.kernels import cpu
from numaudit.agents.layout import PieceLayout

MiB = 1 << 20
COMPONENTS = ("keys", "fingerprint", "moments", "sketch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall time and median CPU time of this thread (the latter ignores preemption by
    other processes, which dominates wall time on a shared machine)."""
    fn()  # warm-up: workspaces, page faults
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
    return statistics.median(wall), statistics.median(cpu)


def _paired_seconds(first: Callable[[], object], second: Callable[[], object],
                    repeats: int) -> tuple[list[float], list[float], list[float]]:
    """Wall times of ``first`` and ``second`` called in turn, and second's CPU times: the two
    samples of a round are microseconds apart, so a neighbour's burst on this shared machine
    slows both alike, and the ratio of a round cancels it."""
    first()
    second()
    a, b, cpu_b = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        first()
        t1, c1 = time.perf_counter(), time.thread_time()
        second()
        cpu_b.append(time.thread_time() - c1)
        b.append(time.perf_counter() - t1)
        a.append(t1 - t0)
    return a, b, cpu_b


def _repeats(nbytes: int, quick: bool) -> int:
    if nbytes <= MiB:
        return 41 if quick else 81
    if nbytes <= 16 * MiB:
        return 5 if quick else 9
    return 3


def measure(dtype: torch.dtype, nbytes: int, repeats: int, sketch_k: int) -> dict[str, float]:
    """GB/s of a copy, of the digest and of each digest component, medians of ``repeats``; the
    fused kernel's fraction of the copy is the median of per-round ratios (copy and kernel
    interleaved)."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(nbytes // dtype.itemsize, generator=g).to(dtype)
    dst = torch.empty_like(src)
    layout = PieceLayout.full(tuple(src.shape))
    eager_repeats = min(repeats, 11)  # ~0.2 GB/s: a few are plenty
    copy = lambda: dst.copy_(src)  # noqa: E731
    fused_rounds = None
    op_s = float("nan")
    if cpu.load() is not None:
        base, gs = cpu.index_map(tuple(src.shape), layout)
        desc = [cpu.descriptor(src, base, cpu.descriptor_tail(src, gs))]
        rows = RowBatch(1, sketch_k)  # the agent's row buffer, one row reserved
        f64_at, i64_at = rows.pointers(rows.reserve(1))
        fused_rounds = _paired_seconds(
            copy, lambda: cpu.digest_into(desc, sketch_k, f64_at, i64_at), repeats)
        f64, i64 = rows.rows()
        copy_s = statistics.median(fused_rounds[0])
        op_s, _ = _median_seconds(lambda: cpu.digest_rows([src], [base], list(gs), sketch_k),
                                  repeats)
        op_f64, op_i64 = cpu.digest_rows([src], [base], list(gs), sketch_k)
        if not (torch.equal(op_i64, i64) and torch.equal(op_f64.view(torch.int64),
                                                         f64.view(torch.int64))):
            raise AssertionError("the kernel's two call forms disagree")
    else:
        copy_s, _ = _median_seconds(copy, repeats)
    digest_s, digest_cpu_s = _median_seconds(
        lambda: digest_piece(src, layout, sketch_k=sketch_k), eager_repeats)
    parts: dict[str, list[float]] = {c: [] for c in COMPONENTS}
    for _ in range(eager_repeats):
        timings: dict[str, float] = {}
        _digest(src, layout, sketch_k, sync_free=None, timings=timings)
        for c in COMPONENTS:
            parts[c].append(timings.get(c, 0.0))
    def gbps(s: float) -> float:
        if math.isnan(s):  # not run (no fused kernel)
            return s
        return nbytes / s / 1e9 if s > 0 else float("inf")
    row = {"copy": gbps(copy_s), "digest": gbps(digest_s), "digest_cpu": gbps(digest_cpu_s),
           "ratio": digest_s / copy_s, "fused": float("nan"), "fused_ratio": float("nan"),
           "fused_cpu": float("nan"), "op": gbps(op_s)}
    if fused_rounds is not None:
        copies, fused, fused_cpu = fused_rounds
        row["fused"] = gbps(statistics.median(fused))
        row["fused_cpu"] = gbps(statistics.median(fused_cpu))
        row["fused_ratio"] = statistics.median(c / f for c, f in zip(copies, fused))
    row.update({c: gbps(statistics.median(parts[c])) for c in COMPONENTS})
    return row


SAMPLE_SHAPES = ((1, 512, 512), (2, 256, 512), (8, 64, 512), (16, 32, 512), (64, 8, 512),
                 (256, 2, 512))
"""[samples, tokens, width] float32 activations of 1 MiB: per-sample digests of 1 to 256
samples (units of 1 up to 16; of 4 and 16 samples beyond)."""


def measure_samples(shape: tuple[int, ...], dtype: torch.dtype, repeats: int,
                    sketch_k: int) -> dict[str, float]:
    """A batch-holding capture's digest (the fused kernel, as the agent calls it) against its
    per-sample digests (its cached plan, `Digester.digest_planned` and `combine_units`, as the
    agent's drain makes them): median CPU microseconds of each, paired round by round, and the
    record's bytes on the wire without and with them (`RecordColumns.record_bytes`)."""
    from numaudit.agents.delivery.columns import capture_columns
    from numaudit.agents.digest.batching import Capture
    from numaudit.agents.digest.fastpath import Digester
    from numaudit.agents.digest.sample_digest import (
        SampleDigests,
        combine_units,
        sample_layout,
        unit_plan,
    )

    g = torch.Generator().manual_seed(0)
    src = torch.randn(shape, generator=g).to(dtype)
    layout = PieceLayout.full(shape)
    digester = Digester("auto")
    unit, k = unit_plan(shape[0])
    slayout = sample_layout(layout, 0)
    numel_s = math.prod(slayout.logical_shape)

    plan = digester.sample_plan(src, layout, 0, 1)

    def samples():
        f64, i64 = digester.digest_planned([(plan, src)])[0]
        return combine_units(f64, i64, unit, numel_s, k)

    base, gs = cpu.index_map(shape, layout)
    desc = [cpu.descriptor(src, base, cpu.descriptor_tail(src, gs))]
    rows = RowBatch(1, sketch_k)
    f64_at, i64_at = rows.pointers(rows.reserve(1))
    main, _, main_cpu = _paired_seconds(samples, lambda: cpu.digest_into(desc, sketch_k, f64_at,
                                                                         i64_at), repeats)
    _, _, sample_cpu = _paired_seconds(lambda: cpu.digest_into(desc, sketch_k, f64_at, i64_at),
                                       samples, repeats)
    f64, i64 = rows.rows()
    cap = Capture(0, 0, 1, "layers.0", 1, 0, 0, -1, layout, str(dtype).removeprefix("torch."),
                  row=0)
    plain = capture_columns([cap], f64.numpy(), i64.numpy()).record_bytes
    units, fps = samples()
    cap.samples = SampleDigests(0, unit, shape[0], k, units, fps)
    with_samples = capture_columns([cap], f64.numpy(), i64.numpy()).record_bytes
    return {"digest_us": 1e6 * statistics.median(main_cpu),
            "samples_us": 1e6 * statistics.median(sample_cpu), "unit": unit, "k": k,
            "bytes": plain, "bytes_samples": with_samples}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 MiB only, fewer repeats")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")],
                        help="comma-separated sizes in MiB (default 1,16,64; quick 1,16)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--sketch-k", type=int, default=DEFAULT_SKETCH_K)
    args, _ = parser.parse_known_args(argv)
    sizes = args.sizes or ([1, 16] if args.quick else [1, 16, 64])
    torch.set_num_threads(args.threads)

    print(f"## Digest throughput (torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"k={args.sketch_k}, median GB/s of the source bytes)")
    print(f"fused kernel ISA level: {cpu.isa_level()} (4 = AVX-512, 3 = AVX2, 1 = baseline); "
          "`fused/copy` is the fused kernel's GB/s as a fraction of the copy's; `fused` calls "
          "the kernel as the agent does (descriptor cached, rows preallocated), `op` through "
          "`cpu.digest_rows`, which builds both on every call")
    print("| dtype | size | copy | fused | fused/copy | fused (CPU time) | op | eager | "
          "eager (CPU time) | eager/copy time | keys | fingerprint | moments | sketch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        for size in sizes:
            r = measure(DTYPES[name], size * MiB, _repeats(size * MiB, args.quick), args.sketch_k)
            print(f"| {name} | {size} MiB | {r['copy']:.2f} | {r['fused']:.2f} | "
                  f"{r['fused_ratio']:.0%} | {r['fused_cpu']:.2f} | {r['op']:.2f} | "
                  f"{r['digest']:.3f} | {r['digest_cpu']:.3f} | {r['ratio']:.0f}x | "
                  f"{r['keys']:.2f} | {r['fingerprint']:.2f} | {r['moments']:.2f} | "
                  f"{r['sketch']:.2f} |", flush=True)
    if cpu.load() is None:
        return 0
    print()
    print(f"## Per-sample digests of a batch-holding capture (float32, 1 MiB, k={args.sketch_k}; "
          "median CPU us of the fused digest and of the per-sample digests, paired; record "
          "bytes on the wire)")
    print("| samples x tokens x width | units x samples | buckets | digest | per-sample | "
          "per-sample / digest | record | with samples | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in SAMPLE_SHAPES:
        r = measure_samples(shape, torch.float32, 31 if args.quick else 101, args.sketch_k)
        print(f"| {' x '.join(map(str, shape))} | {-(-shape[0] // r['unit'])} x {r['unit']} | "
              f"{r['k']} | {r['digest_us']:.0f} | {r['samples_us']:.0f} | "
              f"{r['samples_us'] / r['digest_us']:.2f} | {r['bytes']} | {r['bytes_samples']} | "
              f"{r['bytes_samples'] / r['bytes']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
