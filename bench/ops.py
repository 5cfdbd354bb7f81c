"""Cost of op-level captures (issue 43, docs/drill-down.md): per operation and per module call.

On the DS3-style model of examples/dsv3 (scale 1, one process, one intra-op thread), identical
models train side by side, steps interleaved as in bench/overhead.py: the agent with the
examples' captures (`fwd,grad,loss,input,bwd`, depth 4) and no operations captured ("agent");
the same agent whose `ops` glob matches no module ("ops, none match": what a module that does
not match pays, nothing); operations of one attention module (`layers.1.attention`), of one
whole block (`layers.1`), and of every block (`layers.*`). Each step's process CPU time is
recorded; a configuration's extra time over "agent" (median over rounds of the per-round
difference) is divided by the operations and module calls it captured in the step (forward
operations: each also gets its backward captured through its autograd node). The agent has no
auditor (spooling off): digests, host transfers and record building run, network I/O does not.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

import torch

from bench.overhead import MICROBATCH_SIZE, MICROBATCHES, SEQ_LEN, _attach, _model, _step
from examples.dsv3.data import batches
from examples.dsv3.model import ModelArgs

CONFIGS = (("agent", ()), ("ops, none match", ("nothing.here",)),
           ("ops: layers.1.attention", ("layers.1.attention",)),
           ("ops: layers.1 (a block)", ("layers.1",)), ("ops: layers.* (every block)",
                                                        ("layers.*",)))


def measure(repeats: int) -> list[dict]:
    phases = ("fwd", "grad", "loss", "input", "bwd")
    models = [_model(1) for _ in CONFIGS]
    agents_ = [_attach(m, phases, ops=globs) for m, (_, globs) in zip(models, CONFIGS)]
    data = batches(0, 0, MICROBATCHES, MICROBATCH_SIZE, SEQ_LEN, ModelArgs().vocab_size)
    mbs = next(data)
    for m, a in zip(models, agents_):  # warm-up
        _step(m, a, 0, mbs)
    seen0 = [dict(a.ops.seen) for a in agents_]
    times: list[list[float]] = [[] for _ in CONFIGS]
    for i in range(repeats):
        for (m, a), t in zip(zip(models, agents_), times):
            t.append(_step(m, a, i + 1, mbs))
    out = []
    for (name, _), a, t, s0 in zip(CONFIGS, agents_, times, seen0):
        summary = a.close(timeout=5.0)
        ops = (a.ops.seen["ops"] - s0["ops"]) / repeats
        calls = (a.ops.seen["calls"] - s0["calls"]) / repeats
        extra = statistics.median(x - y for x, y in zip(t, times[0]))
        out.append({"name": name, "step": statistics.median(t), "extra": extra,
                    "ratio": statistics.median(x / y for x, y in zip(t, times[0])),
                    "ops": ops, "calls": calls, "errors": summary["errors"],
                    "not_captured": summary["not_captured"]})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ops",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args, _ = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    repeats = args.repeats or (3 if args.quick else 7)
    print(f"## Op-level capture cost (DS3-style model, scale 1, {MICROBATCHES} microbatches of "
          f"{MICROBATCH_SIZE}x{SEQ_LEN} tokens, fwd,grad,loss,input,bwd, 1 thread, {repeats} "
          "interleaved repeats)")
    print("| configuration | step (s) | /agent | module calls/step | operations/step | "
          "extra (ms/step) | per operation (us) | per module call (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    status = 0
    for r in measure(repeats):
        per_op = 1e6 * r["extra"] / r["ops"] if r["ops"] else float("nan")
        per_call = 1e3 * r["extra"] / r["calls"] if r["calls"] else float("nan")
        print(f"| {r['name']} | {r['step']:.3f} | {r['ratio']:.2f}x | {r['calls']:.0f} | "
              f"{r['ops']:.0f} | {1e3 * r['extra']:.1f} | "
              + (f"{per_op:.0f}" if r["ops"] else "-") + " | "
              + (f"{per_call:.2f}" if r["calls"] else "-") + " |", flush=True)
        if r["errors"]:
            print(f"  {r['name']}: {r['errors']} capture errors, not captured "
                  f"{r['not_captured']}")
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
