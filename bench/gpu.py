"""The GPU checks and figures, in one run: ``python -m bench.gpu [--quick]``.

1. The Triton digest's self-check (agents/kernels/accel.py) per dtype: does the kernel keep the
   contract on this device (fingerprints, counts, min/max bitwise; sums and sketch within the
   float32-tile bound; the same bits twice)? Only where it does will the agent use it.
2. Digest throughput against a device-to-device copy of the same tensor (CUDA events, median),
   bfloat16 and float32 at 1, 16 and 256 MiB, through the agent's path (``digest_rows``); a
   transposed and a column-shard piece of 16 MiB; the eager digest at 16 MiB for scale.
3. A hook's list of 256 pieces of 4 KiB digested as one list against one piece at a time.
4. Captures of CUDA tensors through the agent's capture path with
   ``torch.cuda.set_sync_debug_mode("warn")``: host microseconds per capture, synchronizing
   calls (the agent must make none), and where a capture's host time goes (cProfile).
5. Step overhead on a ~1B-parameter bf16 decoder (bench/gpu_model.py, 16k tokens a step), agent
   off / README defaults / depth 5 + bwd, interleaved, streaming to a real ``auditor serve``
   (bench/gpu_steps.py; without ``--quick`` also depth 5 + bwd without per-sample digests);
   records and bytes digested a step, and the cost model's prediction from item 2's
   throughput against the measured overhead.
6. One depth-5 + bwd step under torch.profiler: where device and host time go.
7. Without ``--quick``: the DS3-style model's step overhead (scale 8), a checkpoint of CUDA
   tensors captured live against its DCP save read back, and a sweep of the tiles kernel's
   rows per loop step and warps (NUMAUDIT_TRITON_ROWS / NUMAUDIT_TRITON_WARPS, one child
   process each; 4 and 8 elements a thread and step). ``--pytest`` also runs the Triton tests
   on the device.

Prints "skipped: no CUDA device" and exits 0 elsewhere (`make bench` runs it on any machine).
Exits 1 when a check fails (a self-check, the checkpoint), never for a missed target.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial

import torch

MiB = 1 << 20
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool)


def _cuda_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def self_checks(k: int, dtypes: Sequence[torch.dtype]) -> bool:
    from numaudit.agents.kernels import accel

    impl = accel._load()
    if isinstance(impl, str):
        print(f"Triton unavailable: {impl}")
        return False
    print("| dtype | Triton keeps the contract |\n|---|---|")
    route = accel.TritonDigest(("cuda",))
    ok = True
    for dtype in dtypes:
        t0 = time.perf_counter()
        trusted = route.trusts(torch.device("cuda"), dtype, k)
        ok &= trusted
        print(f"| {dtype} | {'yes' if trusted else 'NO'} ({time.perf_counter() - t0:.1f} s with "
              f"compiling) |", flush=True)
    return ok


def throughput(k: int, sizes: list[int], repeats: int) -> dict[tuple, float]:
    """Prints the table; returns {(dtype, MiB): Triton GB/s}."""
    from numaudit.agents.digest.digest import digest_piece
    from numaudit.agents.kernels import accel
    from numaudit.agents.layout import PieceLayout

    impl = accel._load()
    print("| dtype | piece | copy GB/s | Triton GB/s | Triton/copy | eager GB/s |\n"
          "|---|---|---:|---:|---:|---:|")
    out = {}
    cases = [(dtype, mib, "whole") for dtype in (torch.bfloat16, torch.float32) for mib in sizes]
    cases += [(torch.bfloat16, 16, "transposed"), (torch.bfloat16, 16, "column shard")]
    for dtype, mib, kind in cases:
        n = mib * MiB // torch.tensor([], dtype=dtype).element_size()
        src = torch.randn(n, device="cuda").to(dtype)
        piece, layout = src, PieceLayout.full((n,))
        if kind == "transposed":  # lines of 4096 elements at memory stride 2048 (gathers)
            piece = src.view(4096, n // 4096).t()
            layout = PieceLayout.full(tuple(piece.shape))
        elif kind == "column shard":  # the right half of each row: lines of 2048
            rows = n // 2048
            piece = src.view(rows, 2048)
            layout = PieceLayout((rows, 4096), (0, 2048), (rows, 2048))
        dst = torch.empty_like(src)
        gb = src.nbytes / 1e9
        copy = gb / (_cuda_ms(partial(dst.copy_, src), repeats) / 1e3)
        eager = float("nan")
        if mib == 16 and kind == "whole":
            eager = gb / (_cuda_ms(partial(digest_piece, piece, layout, sketch_k=k), 3) / 1e3)
        tri = float("nan")
        if not isinstance(impl, str):
            prepared = [impl.prepare(piece, layout)]
            tri = gb / (_cuda_ms(partial(impl.digest_rows, prepared, sketch_k=k), repeats) / 1e3)
        out[(dtype, mib, kind)] = tri
        print(f"| {dtype} | {mib} MiB {kind} | {copy:.0f} | {tri:.0f} | {tri / copy:.0%} | "
              f"{eager:.0f} |", flush=True)
        del src, dst, piece
    return out


def lists(k: int, repeats: int, device: str = "cuda") -> None:
    """A list of 256 pieces of 4 KiB in one call against 256 calls of one piece (``device``
    "cpu" runs it under Triton's interpreter, where only whether it runs means anything)."""
    from numaudit.agents.kernels import accel
    from numaudit.agents.layout import PieceLayout

    impl = accel._load()
    if isinstance(impl, str):
        return
    prepared = [impl.prepare(torch.randn(1024, device=device), PieceLayout.full((1024,)))
                for _ in range(256)]

    def as_list():
        return impl.digest_rows(prepared, sketch_k=k)

    def one_by_one():
        return [impl.digest_rows([p], sketch_k=k) for p in prepared]

    print("| 256 pieces of 4 KiB float32 | host us per piece | device ms per list |\n"
          "|---|---:|---:|")
    for label, fn in (("one list", as_list), ("one piece at a time", one_by_one)):
        fn()
        host = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            host.append(time.perf_counter() - start)
        dev = _cuda_ms(fn, repeats) if device == "cuda" else float("nan")
        print(f"| {label} | {1e6 * statistics.median(host) / len(prepared):.1f} | {dev:.2f} |",
              flush=True)


def captures(n: int) -> None:
    from numaudit.agents.capture.capture import Capturer
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.digest.batching import Counters
    from numaudit.agents.identity import RankIdentity

    print("| tensor | host us per capture (median) | synchronizing calls |\n|---|---:|---:|")
    for label, shape, dtype in (("4 KiB float32 (a payload too)", (1024,), torch.float32),
                                ("64 KiB bfloat16", (32768,), torch.bfloat16),
                                ("16 MiB bfloat16", (8 * MiB,), torch.bfloat16)):
        t = torch.randn(shape, device="cuda").to(dtype)
        cap = Capturer(AgentConfig(), RankIdentity(), lambda batch: None, Counters())
        cap.capture(t, phase="fwd", site="warm", index=0)  # compiles, self-checks
        torch.cuda.synchronize()
        times = []
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(n):
                    start = time.perf_counter()
                    cap.capture(t, phase="fwd", site="x", index=i % 1000)
                    times.append(time.perf_counter() - start)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        print(f"| {label} | {1e6 * statistics.median(times):.1f} | {syncs} in {n} captures |",
              flush=True)
        if label.startswith("64 KiB"):
            prof = cProfile.Profile()
            prof.enable()
            for i in range(n):
                cap.capture(t, phase="fwd", site="x", index=i % 1000)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            lines = [ln for ln in text.getvalue().splitlines() if ln.strip()][-13:]
            print("Where a 64 KiB capture's host time goes (cProfile, tottime):\n```\n"
                  + "\n".join(lines) + "\n```", flush=True)


def sweep(k: int) -> None:
    """The tiles kernel's rows per loop step and warps, one child process per setting."""
    print("| rows per step | warps | bf16 256 MiB GB/s | fp32 256 MiB GB/s |\n"
          "|---:|---:|---:|---:|")
    for rows, warps in ((1, 2), (2, 2), (2, 4), (4, 4), (4, 8)):
        env = dict(os.environ, NUMAUDIT_TRITON_ROWS=str(rows),
                   NUMAUDIT_TRITON_WARPS=str(warps))
        out = subprocess.run([sys.executable, "-m", "bench.gpu", "--sweep-child",
                              "--sketch-k", str(k)], env=env, capture_output=True,
                             text=True, timeout=300)
        figures = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
        print(f"| {rows} | {warps} | {figures[0] if figures else 'failed'} |", flush=True)


def _sweep_child(k: int) -> int:
    from numaudit.agents.kernels import digest_triton as impl
    from numaudit.agents.layout import PieceLayout

    cells = []
    for dtype in (torch.bfloat16, torch.float32):
        n = 256 * MiB // torch.tensor([], dtype=dtype).element_size()
        src = torch.randn(n, device="cuda").to(dtype)
        prepared = [impl.prepare(src, PieceLayout.full((n,)))]
        ms = _cuda_ms(partial(impl.digest_rows, prepared, sketch_k=k), 10)
        cells.append(f"{src.nbytes / 1e6 / ms:.0f}")
    print(" | ".join(cells))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer dtypes, sizes and repeats")
    parser.add_argument("--sketch-k", type=int, default=256)
    parser.add_argument("--steps", type=int, default=0, help="timed steps a configuration")
    parser.add_argument("--no-model", action="store_true", help="skip items 5 and 6")
    parser.add_argument("--pytest", action="store_true",
                        help="run the Triton tests on the device")
    parser.add_argument("--sweep-child", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("## CUDA checks (bench/gpu.py): skipped: no CUDA device")
        return 0
    if args.sweep_child:
        return _sweep_child(args.sketch_k)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    began = time.perf_counter()

    def section(title: str) -> None:
        print(f"\n### {title} ({time.perf_counter() - began:.0f} s in)", flush=True)

    quick, k = args.quick, args.sketch_k
    print(f"## CUDA checks (torch {torch.__version__}, Triton {triton_version}, "
          f"{torch.cuda.get_device_name()})")
    section("1. Self-check")
    ok = self_checks(k, DTYPES[:2] + (torch.int64,) if quick else DTYPES)
    section("2. Throughput")
    gbps = throughput(k, [1, 16, 256], 5 if quick else 20)
    section("3. Lists")
    lists(k, 5 if quick else 20)
    section("4. Captures")
    captures(200 if quick else 2000)
    if not args.no_model:
        from bench import gpu_steps
        from bench.gpu_model import DecoderArgs, parameters

        model_args = DecoderArgs()
        section(f"5. Step overhead, {parameters(model_args) / 1e9:.2f}B-parameter bf16 decoder")
        configs = gpu_steps.CONFIGS if quick else {**gpu_steps.CONFIGS, **gpu_steps.MORE_CONFIGS}
        results = gpu_steps.overhead(model_args, args.steps or (3 if quick else 7),
                                     configs=configs)
        rate = gbps.get((torch.bfloat16, 16, "whole"), float("nan"))
        gpu_steps.cost_model(results, rate)
        section("6. Profile")
        gpu_steps.profile(model_args)
    if not quick:
        from bench.gpu_extra import checkpoint_roundtrip, ds3_overhead

        section("7. DS3-style model, checkpoint, sweep")
        ds3_overhead(7)
        print("| check | result | |\n|---|---|---|")
        ok &= checkpoint_roundtrip()
        sweep(k)
    if args.pytest:
        section("Triton tests on the device")
        code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/agents/test_triton_digest.py",
                               "tests/agents/test_accel_dispatch.py"]).returncode
        ok &= code == 0
    section("done")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
