"""Agent step overhead on the DS3-style model of examples/dsv3, in one process.

Identical models (same init) train side by side; one has an agent attached, one not. Steps
alternate off, on, ... so that machine load drifts into every side alike, and each step's CPU
time (the whole process: the sender thread's work counts) is recorded. The printed ratio of a
side is the median over the rounds of (its step / the "off" step of the same round), per
configuration: scale 1 and scale 8, each with the `fwd,grad,loss,input` captures of
examples/dsv3 (depth 4, logits payload) and with `bwd` added.

The agent has no auditor address (spooling off): digests, host transfer and record building run,
network I/O does not. Each "on" step ends when the sender has built that step's records and cut
them into a wire batch (`Sender.wait_idle`, a sleep): its work is charged to its own step, not
left to run during the next side's step. A third model with an agent whose batches are dropped
before the sender (its capturer's sink replaced) gives the "capture only" ratio: hooks, layouts,
digests and row batches, without the sender thread's record building (agents/delivery/sender.py). A
fourth model with an agent whose step selection (`step_every`) leaves the measured steps out
gives what a step that is not captured costs: the module hooks are installed and return at
once. A fifth model without an agent ("off again") measures the noise floor: its ratio would be
1.00x on a quiet machine, and its distance from 1 is how far any other ratio of the same run
can move by chance (identical models have differed by up to 6 % on this shared 2-core
machine). The last column is the "on" agent's sender thread CPU per step (median), part of
its on/off ratio. One intra-op thread, as in bench/digest.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

import numaudit
from examples.dsv3.auditing import CAPTURE_DEPTH, EXCLUDE, LOSS_SITE, PAYLOAD, capture_input_tokens
from examples.dsv3.data import batches
from examples.dsv3.model import ModelArgs, Transformer

MICROBATCHES, MICROBATCH_SIZE, SEQ_LEN = 8, 4, 63


def _model(scale: int) -> Transformer:
    model = Transformer(ModelArgs().scaled(scale))
    model.init_weights(0)
    return model


def _step(model: torch.nn.Module, agent, step: int, microbatches,
          sender_cpu: list[float] | None = None) -> float:
    """One training step (no optimizer: the weights stay put so every step costs the same);
    returns its process CPU seconds (``sender_cpu``, if given, gets the agent's sender thread's
    share of them appended)."""
    sender = getattr(agent, "_sender", None)
    clock = (time.pthread_getcpuclockid(sender._thread.ident)
             if sender is not None and sender_cpu is not None else None)
    start = time.process_time()
    sender_start = time.clock_gettime(clock) if clock is not None else 0.0
    ctx = agent.step(step) if agent is not None else _null()
    with ctx:
        for j, (tokens, targets) in enumerate(microbatches):
            mb = agent.microbatch(j) if agent is not None else _null()
            with mb:
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                if agent is not None:
                    agent.capture(loss, site=LOSS_SITE, phase="loss")
                (loss / MICROBATCHES).backward()
    model.zero_grad(set_to_none=True)
    if sender is not None:
        # The sender's records of this step are built before the clock stops, so its work is
        # this step's, not the next side's (it runs on its own thread, counted in the
        # process CPU time).
        sender.wait_idle(10.0)
    if clock is not None:
        sender_cpu.append(time.clock_gettime(clock) - sender_start)
    return time.process_time() - start


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _attach(model: torch.nn.Module, phases: tuple[str, ...], **config):
    agent = numaudit.attach(model, run="bench", phases=phases, max_depth=CAPTURE_DEPTH,
                          exclude=EXCLUDE, payload=PAYLOAD, spool_mode="off", **config)
    capture_input_tokens(agent, model)
    return agent


def measure(scale: int, bwd: bool, repeats: int) -> dict[str, float]:
    """Step CPU seconds without the agent, with it, with its batches dropped before the sender
    ("capture only"), with an agent whose step selection leaves the measured steps out ("step
    not selected": its hooks are installed and return at once), and of a second model without
    the agent ("off again"), interleaved; each side's ratio to "off" is the median over the
    rounds of that round's ratio (steps a second apart see the same machine load), and "off
    again" gives the noise floor of those ratios in this run."""
    off, on, capture_only, idle, off2 = (_model(scale) for _ in range(5))
    phases = ("fwd", "grad", "loss", "input") + (("bwd",) if bwd else ())
    agent, quiet = _attach(on, phases), _attach(capture_only, phases)
    quiet.capturer._batches._sink = lambda batch: None  # the Batcher holds the sink
    unselected = _attach(idle, phases, step_every=1 << 30)  # captures step 0 only
    data = batches(0, 0, MICROBATCHES, MICROBATCH_SIZE, SEQ_LEN, ModelArgs().vocab_size)
    mbs = next(data)
    sides = ((off, None), (on, agent), (capture_only, quiet), (idle, unselected), (off2, None))
    for model, a in sides:  # warm-up every side
        _step(model, a, 0, mbs)
    times: list[list[float]] = [[] for _ in sides]
    sender_cpu: list[float] = []  # the "on" agent's sender thread, per step
    for i in range(repeats):
        for (model, a), t in zip(sides, times):
            t.append(_step(model, a, i + 1, mbs, sender_cpu if a is agent else None))
    summary = agent.close(timeout=5.0)
    quiet.close(timeout=5.0)
    unselected.close(timeout=5.0)
    params = sum(p.numel() for p in on.parameters())
    ratios = [statistics.median(x / y for x, y in zip(t, times[0])) for t in times[1:]]
    return {"off": statistics.median(times[0]), "on": statistics.median(times[1]),
            "on_ratio": ratios[0], "capture_ratio": ratios[1], "unselected_ratio": ratios[2],
            "noise_ratio": ratios[3], "params": params,
            "sender_ms": 1e3 * statistics.median(sender_cpu),
            "captured": summary["captured"] / (repeats + 1), "errors": summary["errors"]}


def capture_cost(nbytes: int = 4096, repeats: int = 2000) -> tuple[float, float]:
    """Median CPU microseconds of one capture of a float32 tensor of `nbytes` (hook to rows
    ready: layout, digest, row queued, payload copied), with the fused kernel and with the
    eager digest. Batches are handed to a sink that drops them; the flush every
    `device_batch` captures is in the mean, not in the median."""
    from numaudit.agents.capture.capture import Capturer, Counters
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.identity import RankIdentity

    t = torch.randn(nbytes // 4)
    out = []
    for mode in ("auto", "eager"):
        cap = Capturer(AgentConfig(digest=mode), RankIdentity(), lambda batch: None, Counters())
        times = []
        for i in range(repeats):
            start = time.thread_time_ns()
            cap.capture(t, phase="fwd", site="x", index=i)
            times.append(time.thread_time_ns() - start)
        out.append(statistics.median(times) / 1e3)
    return out[0], out[1]


def kind_costs(repeats: int = 1000) -> dict[str, float]:
    """Median CPU microseconds of the captures that take their own fast path: a DTensor's
    (4 KiB float32 local shard, Shard(0)) and one segment of ``capture_segments`` (8 segments of
    a (64, 64) float32 tensor per call), in a process group of one gloo rank made here."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from numaudit.agents.capture.capture import Capturer, Counters
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.identity import RankIdentity
    from numaudit.agents.ragged import rows_from_counts

    if dist.is_initialized():
        raise RuntimeError("kind_costs makes its own process group")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method=f"file://{os.path.join(tmp, 'store')}")
        try:
            dt = distribute_tensor(torch.randn(1024), init_device_mesh("cpu", (1,)), [Shard(0)])
            cap = Capturer(AgentConfig(), RankIdentity(), lambda batch: None, Counters())
            times = []
            for i in range(repeats):
                start = time.thread_time_ns()
                cap.capture(dt, phase="fwd", site="x", index=i % 64)
                times.append(time.thread_time_ns() - start)
            out = {"dtensor": statistics.median(times) / 1e3}
        finally:
            dist.destroy_process_group()
    counts = [9, 3, 0, 14, 7, 5, 11, 15]
    x, rows = torch.randn(64, 64), rows_from_counts([counts], 0)
    cap = Capturer(AgentConfig(phases=("fwd",)), RankIdentity(), lambda batch: None, Counters())
    times = []
    for i in range(repeats):
        cap.microbatch = i
        start = time.thread_time_ns()
        cap.capture_segments(x, counts, rows, phase="fwd", site="experts", role="output")
        times.append(time.thread_time_ns() - start)
    out["segment"] = statistics.median(times) / 1e3 / len(counts)
    return out


def depth_cost(repeats: int) -> dict[str, float] | None:
    """Step CPU seconds of a transformers LlamaForCausalLM (4 decoder layers of width 256, 4
    microbatches of 4 x 128 tokens) without the agent, with it at the default depth (one level
    inside every decoder block: attention, MLP and norms) and with the absolute max_depth of 3
    alone (block_depth=0: the blocks' outputs only), and a second model without it (the noise
    floor), interleaved as `measure`'s sides are; None where transformers is not installed."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128, use_cache=False)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, 1024, (4, 128), generator=g) for _ in range(4)]
    phases = ("fwd", "grad", "loss")
    sides = [(model(), None), (model(), "block_depth=1"), (model(), "block_depth=0"),
             (model(), None)]
    agents_ = [None if how is None else numaudit.attach(
        m, run="bench", phases=phases, spool_mode="off", block_depth=int(how[-1]))
        for m, how in sides]

    def step(m, agent, i: int) -> float:
        start = time.process_time()
        with agent.step(i) if agent is not None else _null():
            for j, x in enumerate(mbs):
                with agent.microbatch(j) if agent is not None else _null():
                    loss = F.cross_entropy(m(x).logits.flatten(0, 1), x.flatten())
                    if agent is not None:
                        agent.capture(loss, site="loss", phase="loss")
                    (loss / len(mbs)).backward()
        m.zero_grad(set_to_none=True)
        sender = getattr(agent, "_sender", None)
        if sender is not None:
            sender.wait_idle(10.0)
        return time.process_time() - start

    for (m, _), a in zip(sides, agents_):
        step(m, a, 0)
    times: list[list[float]] = [[] for _ in sides]
    for i in range(repeats):
        for (m, _), a, t in zip(sides, agents_, times):
            t.append(step(m, a, i + 1))
    captured = [a.close(timeout=5.0)["captured"] / (repeats + 1) for a in agents_[1:3]]
    ratios = [statistics.median(x / y for x, y in zip(t, times[0])) for t in times[1:]]
    return {"off": statistics.median(times[0]), "inside": ratios[0], "blocks": ratios[1],
            "noise": ratios[2], "inside_captures": captured[0], "blocks_captures": captured[1]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--scales", default="1,8")
    parser.add_argument("--repeats", type=int, default=None)
    args, _ = parser.parse_known_args(argv)
    torch.set_num_threads(1)
    repeats = args.repeats or (3 if args.quick else 9)
    from numaudit.agents.config import AgentConfig, apply_env
    from numaudit.agents.kernels import cpu

    fused = apply_env(AgentConfig()).digest == "auto" and cpu.load() is not None
    print(f"## Agent step overhead (torch {torch.__version__}, 1 thread, {MICROBATCHES} "
          f"microbatches of {MICROBATCH_SIZE}x{SEQ_LEN} tokens, {repeats} interleaved repeats, "
          f"fused kernel: {'yes' if fused else 'no (NUMAUDIT_DIGEST=eager or not built)'})")
    fused_us, eager_us = capture_cost()
    print(f"one 4 KiB float32 capture (hook to rows ready, median CPU time): fused "
          f"{fused_us:.1f} us, eager {eager_us:.1f} us")
    kinds = kind_costs()
    print(f"one capture of a DTensor's 4 KiB shard: {kinds['dtensor']:.1f} us; one expert "
          f"segment of capture_segments (8 a call): {kinds['segment']:.1f} us")
    print("| scale | params | phases | captures/step | off (s) | on (s) | on/off | "
          "capture only/off | step not selected/off | off again/off (noise) | sender (ms/step) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for scale in (int(s) for s in args.scales.split(",")):
        for bwd in (False, True):
            r = measure(scale, bwd, repeats)
            phases = "fwd,grad,loss,input" + (",bwd" if bwd else "")
            print(f"| {scale} | {r['params'] / 1e6:.1f}M | {phases} | {r['captured']:.0f} | "
                  f"{r['off']:.3f} | {r['on']:.3f} | {r['on_ratio']:.2f}x | "
                  f"{r['capture_ratio']:.2f}x | {r['unselected_ratio']:.2f}x | "
                  f"{r['noise_ratio']:.2f}x | {r['sender_ms']:.1f} |", flush=True)
    cost = depth_cost(repeats)
    if cost is not None:
        print(f"transformers Llama (4 layers x 256, 4 microbatches of 4x128 tokens, fwd,grad,loss; "
              f"off {cost['off']:.3f} s/step): default depth (inside every block, "
              f"{cost['inside_captures']:.0f} captures/step) {cost['inside']:.2f}x; "
              f"max_depth 3 alone (block outputs, {cost['blocks_captures']:.0f} captures/step) "
              f"{cost['blocks']:.2f}x; off again {cost['noise']:.2f}x (noise)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
