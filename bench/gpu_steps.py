"""Step overhead of the agent on the ~1B bf16 decoder (bench/gpu_model.py), on one GPU.

Three identical models (same weights, same batches) train side by side: agent off, the
README's defaults (``numaudit.attach(model, run=...)``: phases fwd, grad, loss, input, depth 3),
and depth 5 with ``bwd`` added. Steps are interleaved (off, defaults, deep, off, ...) so that
drift reaches every side alike; each step's wall time is taken with the device synchronized at
its start and end. The agents stream to a real ``auditor serve`` in its own process over a unix
socket. After each step with an agent, its sender is given time to build and send that step's
records before the next side runs (not counted: on a real run that work overlaps the device's).

Also measured per configuration: records and bytes digested per step (the cost model's input,
docs/benchmarks.md), and one depth-5 step under torch.profiler (where device and host time go).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import numaudit
from bench.gpu_model import DecoderArgs, batches, build, train_step

DEEP = {"max_depth": 5, "phases": ("fwd", "bwd", "grad", "loss", "input")}
CONFIGS = {
    "off": None,
    "README defaults": {},
    "depth 5 + bwd": DEEP,
}
MORE_CONFIGS = {
    "depth 5 + bwd, no per-sample digests": {**DEEP, "sample_digests": False},
}
"""Added without --quick: what per-sample digests (agents/digest/sample_digest.py) cost."""


@contextlib.contextmanager
def auditor_daemon():
    """``auditor serve`` in a child process on a unix socket; yields the address."""
    with tempfile.TemporaryDirectory(prefix="numaudit-gpu-") as tmp:
        sock = f"{tmp}/auditor.sock"
        proc = subprocess.Popen([sys.executable, "-m", "numaudit.auditor", "serve", "--listen",
                                 f"unix:{sock}", "--store", f"{tmp}/audit.db"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(sock):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"auditor serve did not start: "
                                       f"{proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.1)
            yield f"unix:{sock}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


class _Tally:
    """Bytes and pieces an agent digests (counted as its batcher drains them). With per-sample
    digests on (the default), a batch-holding capture (fwd, bwd, input) is read a second time,
    sample by sample: those bytes count twice."""

    def __init__(self, agent) -> None:
        from numaudit.agents.digest.sample_digest import SAMPLE_PHASES

        self.bytes = self.pieces = 0
        twice = agent.config.sample_digests
        batcher = agent.capturer._batches
        drain = batcher.drain

        def counted() -> None:
            queued = [(p[0], p[1]) for p in batcher._pending] + [(f[0], f[2])
                                                                  for f in batcher.fused]
            for cap, t in queued:
                self.bytes += t.nbytes * (2 if twice and cap.phase in SAMPLE_PHASES else 1)
            self.pieces += len(queued)
            drain()

        batcher.drain = counted


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def overhead(args: DecoderArgs, steps: int, device: str = "cuda",
             configs: dict | None = None) -> dict[str, dict]:
    """Interleaved steps of every configuration; per configuration its median step (ms), its
    ratio to "off" (the median of per-round ratios), records and bytes digested per step and
    the sender's drain after a step. Prints a table."""
    torch.manual_seed(0)
    mbs = batches(args, device)
    sides = {}
    with auditor_daemon() as address:
        for name, options in (configs or CONFIGS).items():
            model = build(args, device)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            agent = None
            if options is not None:
                slug = "".join(c if c.isalnum() else "-" for c in name)
                agent = numaudit.attach(model, run=f"gpu-{slug}-{os.getpid()}",
                                      address=address, spool_mode="off", **options)
            sides[name] = {"model": model, "opt": opt, "agent": agent, "times": [],
                           "drain": [], "tally": _Tally(agent) if agent else None}
        for i in range(steps + 1):  # step 0 warms up (compiles, self-checks, allocations)
            for side in sides.values():
                agent = side["agent"]
                captured0 = agent.counters.snapshot()[0] if agent else 0
                _sync(device)
                start = time.perf_counter()
                train_step(side["model"], side["opt"], agent, i, mbs)
                _sync(device)
                elapsed = time.perf_counter() - start
                drain = 0.0
                if agent is not None:
                    side["records"] = agent.counters.snapshot()[0] - captured0
                    t0 = time.perf_counter()
                    agent._sender.wait_idle(60.0)
                    drain = time.perf_counter() - t0
                if i:
                    side["times"].append(elapsed)
                    side["drain"].append(drain)
        out = {}
        for name, side in sides.items():
            agent, tally = side["agent"], side["tally"]
            summary = agent.close(timeout=60) if agent is not None else {}
            ratios = [t / o for t, o in zip(side["times"], sides["off"]["times"])]
            out[name] = {
                "ms": 1e3 * statistics.median(side["times"]),
                "ratio": statistics.median(ratios),
                "records": side.get("records", 0),
                "bytes": tally.bytes // (steps + 1) if tally else 0,
                "drain_ms": 1e3 * statistics.median(side["drain"]),
                "dropped": summary.get("dropped", 0),
            }
        for side in sides.values():
            side.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"| {args.dim} hidden, {args.layers} layers, {args.tokens_per_step} tokens a step | "
          f"step (ms) | on/off | records a step | MB digested a step | sender drain (ms) | "
          f"dropped |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, r in out.items():
        print(f"| {name} | {r['ms']:.1f} | {r['ratio']:.3f}x | {r['records']} | "
              f"{r['bytes'] / 1e6:.0f} | {r['drain_ms']:.1f} | {r['dropped']} |", flush=True)
    return out


def profile(args: DecoderArgs, rows: int = 14, device: str = "cuda") -> None:
    """One depth-5 + bwd step under torch.profiler: the device's and the host's top entries."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    mbs = batches(args, device)
    model = build(args, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    agent = numaudit.attach(model, run=f"gpu-profile-{os.getpid()}", spool_mode="off", **DEEP)
    for i in range(2):  # warm-up
        train_step(model, opt, agent, i, mbs)
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        train_step(model, opt, agent, 2, mbs)
        _sync(device)
    agent.close(timeout=60)
    events = prof.key_averages()
    table = "(no device events)"
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            table = events.table(sort_by=key, row_limit=rows, max_name_column_width=48)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    print("Device time of one depth-5 + bwd step (no auditor: records are dropped after the "
          "sender builds them):\n```\n" + table + "\n```")
    print("Host time of the same step:\n```\n"
          + events.table(sort_by="self_cpu_time_total", row_limit=rows,
                         max_name_column_width=48) + "\n```", flush=True)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()


def cost_model(results: dict[str, dict], gbps: float) -> None:
    """Bytes digested a step over the digest's measured throughput, against what was measured."""
    off = results["off"]["ms"]
    print(f"| configuration | MB a step | at {gbps:.0f} GB/s (ms) | predicted on/off | measured "
          f"on/off |\n|---|---:|---:|---:|---:|")
    for name, r in results.items():
        if name == "off":
            continue
        ms = r["bytes"] / (gbps * 1e6)
        print(f"| {name} | {r['bytes'] / 1e6:.0f} | {ms:.1f} | {(off + ms) / off:.3f}x | "
              f"{r['ratio']:.3f}x |", flush=True)


