"""The CUDA checks, for a machine with a GPU: ``python -m bench.gpu [--quick]``.

One short run that says whether the accelerator paths hold and what they cost:

1. The Triton digest's self-check (agents/kernels/accel.py) per dtype: does the kernel agree with
   the eager reference on this device (fingerprints, counts, min/max bitwise; sums and sketch
   within float64 rounding)? Only where it does will the agent use it.
2. Digest throughput against a device-to-device copy of the same tensor (CUDA events, median):
   Triton and eager, float32 and bfloat16.
3. A hook's list of small pieces (256 float32 pieces of 4 KiB) digested as one list against one
   piece at a time: host microseconds per piece and device milliseconds per list.
4. Captures of CUDA tensors through the agent's capture path, with
   ``torch.cuda.set_sync_debug_mode("warn")``: host microseconds per capture and the number of
   synchronizing calls it made (the agent must make none per capture).
5. Step overhead on the DS3-style model (bench/overhead.py's configuration, scale 8, fwd+grad
   and +bwd) on the GPU: wall time per step with a device synchronize at its end, agent off and
   on, interleaved; the ratio of medians.
6. A checkpoint of CUDA tensors (a model and its Adam state, plus a bfloat16 tensor) captured
   live by `Agent.capture_state_dict` (digested on the device) against its DCP save read back by
   `auditor checkpoint` (digested on the host): every entry identical, and a copy with one
   element one ulp up diverging there alone.

Prints "skipped: no CUDA device" and exits 0 elsewhere (`make bench` runs it on any machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

MiB = 1 << 20


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


def self_checks(k: int) -> None:
    from agents.kernels import accel

    impl = accel._load()
    if isinstance(impl, str):
        print(f"Triton unavailable: {impl}")
        return
    print("| dtype | Triton agrees with the eager digest |\n|---|---|")
    route = accel.TritonDigest(("cuda",))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                  torch.int64, torch.uint8, torch.bool):
        t0 = time.perf_counter()
        ok = route.trusts(torch.device("cuda"), dtype, k)
        print(f"| {dtype} | {'yes' if ok else 'NO'} ({time.perf_counter() - t0:.1f} s with "
              f"compiling) |", flush=True)


def throughput(k: int, sizes: list[int], repeats: int) -> None:
    from agents.digest import digest_piece
    from agents.kernels import accel
    from agents.layout import PieceLayout

    impl = accel._load()
    print("| dtype | size | copy GB/s | Triton GB/s | Triton/copy | eager GB/s | eager/copy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for mib in sizes:
            n = mib * MiB // torch.tensor([], dtype=dtype).element_size()
            src = torch.randn(n, device="cuda").to(dtype)
            dst = torch.empty_like(src)
            layout = PieceLayout.full((n,))
            gb = src.nbytes / 1e9
            copy = gb / (_cuda_ms(lambda: dst.copy_(src), repeats) / 1e3)
            eager = gb / (_cuda_ms(lambda: digest_piece(src, layout, sketch_k=k), repeats) / 1e3)
            tri = float("nan") if isinstance(impl, str) else gb / (_cuda_ms(
                lambda: impl.digest_piece_triton(src, layout, sketch_k=k), repeats) / 1e3)
            print(f"| {dtype} | {mib} MiB | {copy:.0f} | {tri:.0f} | {tri / copy:.0%} | "
                  f"{eager:.0f} | {eager / copy:.0%} |", flush=True)


def lists(k: int, repeats: int, device: str = "cuda") -> None:
    """A list of 256 pieces of 4 KiB in one call against 256 calls of one piece (``device``
    "cpu" runs it under Triton's interpreter, where only whether it runs means anything)."""
    from agents.kernels import accel
    from agents.layout import PieceLayout

    impl = accel._load()
    if isinstance(impl, str):
        return
    pieces = [(torch.randn(1024, device=device), PieceLayout.full((1024,)))
              for _ in range(256)]

    def as_list():
        return impl.digest_pieces_triton(pieces, sketch_k=k)

    def one_by_one():
        return [impl.digest_piece_triton(t, layout, sketch_k=k) for t, layout in pieces]

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
        print(f"| {label} | {1e6 * statistics.median(host) / len(pieces):.1f} | {dev:.2f} |",
              flush=True)


def captures(n: int) -> None:
    from agents.batching import Counters
    from agents.capture import Capturer
    from agents.config import AgentConfig
    from agents.identity import RankIdentity

    print("| tensor | host us per capture (median) | synchronizing calls |\n|---|---:|---:|")
    for label, shape in (("4 KiB float32", (1024,)), ("16 MiB bfloat16", (8 * MiB,))):
        t = torch.randn(shape, device="cuda").to(torch.float32 if "float32" in label
                                                 else torch.bfloat16)
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


def step_overhead(repeats: int) -> None:
    from bench import overhead as O
    from examples.dsv3.data import batches
    from examples.dsv3.model import ModelArgs

    print("| scale | phases | off (ms) | on (ms) | on/off |\n|---:|---|---:|---:|---:|")
    for bwd in (False, True):
        off, on = O._model(8).cuda(), O._model(8).cuda()
        phases = ("fwd", "grad", "loss", "input") + (("bwd",) if bwd else ())
        agent = O._attach(on, phases)
        mbs = [(x.cuda(), y.cuda()) for x, y in next(batches(
            0, 0, O.MICROBATCHES, O.MICROBATCH_SIZE, O.SEQ_LEN, ModelArgs().vocab_size))]

        def step(model, ag, i):
            torch.cuda.synchronize()
            start = time.perf_counter()
            O._step(model, ag, i, mbs)
            torch.cuda.synchronize()
            return time.perf_counter() - start

        step(off, None, 0), step(on, agent, 0)
        t_off, t_on = [], []
        for i in range(repeats):
            t_off.append(step(off, None, i + 1))
            t_on.append(step(on, agent, i + 1))
        agent.close(timeout=5.0)
        a, b = statistics.median(t_off), statistics.median(t_on)
        print(f"| 8 | {','.join(phases)} | {1e3 * a:.1f} | {1e3 * b:.1f} | {b / a:.3f}x |",
              flush=True)


def checkpoint_roundtrip(device: str = "cuda") -> bool:
    """Check 6; True when it holds (each finding printed)."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import agents
    from auditor.daemon.server import BackgroundServer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(64, 1024, device=device)).square().mean().backward()
    optimizer.step()
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optim": osd,
          "extra": {"bf16": torch.randn(4096, 1024, device=device).to(torch.bfloat16)}}
    with tempfile.TemporaryDirectory(prefix="numaudit-gpu-ckpt-") as tmp, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        db = Path(tmp) / "a.db"
        with BackgroundServer(f"unix:{tmp}/s.sock", db, grace=1.0) as server:
            agent = agents.attach(None, run="live", address=server.address, spool_mode="off")
            agent.capture_state_dict(sd, step=0)
            summary = agent.close(timeout=120)
        w = msd["0.weight"].detach().clone()
        w[5, 7] = torch.nextafter(w[5, 7], torch.tensor(float("inf"), device=device))
        dcp.save(sd, checkpoint_id=f"{tmp}/same", no_dist=True)
        dcp.save({**sd, "model": {**msd, "0.weight": w}}, checkpoint_id=f"{tmp}/ulp",
                 no_dist=True)
        reports = {}
        for name in ("same", "ulp"):
            out = Path(tmp) / f"{name}.json"
            code = subprocess.run([sys.executable, "-m", "auditor", "checkpoint", "run:live",
                                   f"{tmp}/{name}", "--db", str(db), "--format", "json", "-o",
                                   str(out)], capture_output=True, timeout=300).returncode
            reports[name] = code, json.loads(out.read_text())
    (same_code, same), (ulp_code, ulp) = reports["same"], reports["ulp"]
    identical = same["summary"]["verdicts"].get("identical", 0)
    first = (ulp.get("first_divergence") or {}).get("key", {}).get("site")
    ok = (summary["dropped"] == 0 and same_code == 0 and identical == same["summary"]["keys"] > 0
          and ulp_code == 1 and ulp["summary"]["breaches"] == 1 and first == "model.0.weight")
    print(f"| checkpoint of {device} tensors | live vs files: {identical} of "
          f"{same['summary']['keys']} identical; one ulp: first divergence {first} | "
          f"{'holds' if ok else 'FAILS'} |", flush=True)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--sketch-k", type=int, default=256)
    args, _ = parser.parse_known_args(argv)
    if not torch.cuda.is_available():
        print("## CUDA checks (bench/gpu.py): skipped: no CUDA device")
        return 0
    print(f"## CUDA checks (torch {torch.__version__}, {torch.cuda.get_device_name()})")
    self_checks(args.sketch_k)
    throughput(args.sketch_k, [16, 256] if args.quick else [1, 16, 256, 1024],
               5 if args.quick else 20)
    lists(args.sketch_k, 5 if args.quick else 20)
    captures(200 if args.quick else 2000)
    step_overhead(3 if args.quick else 7)
    print("| check | result | |\n|---|---|---|")
    return 0 if checkpoint_roundtrip() else 1


if __name__ == "__main__":
    raise SystemExit(main())
