"""Reference run: the DS3-style model with FSDP2 over a 4-rank data-parallel mesh.

    torchrun --nproc-per-node 4 examples/dsv3_spmd.py --name ref [--dump /tmp/ref.pt]

One step = every dp rank runs `--microbatches` microbatches of `--microbatch-size` samples
(forward + backward each), then one optimizer step.

Gradient scaling: each microbatch's loss is the mean cross-entropy over its tokens; backward runs on
loss / n_microbatches, and FSDP2's reduce-scatter averages over the dp ranks. The accumulated
gradient is therefore the mean over all microbatches of all dp ranks of the per-microbatch mean-loss
gradient (the gradient of the mean loss over the global batch, since all microbatches have equal
token counts). Gradient sync is off for all but the last microbatch, so FSDP2 accumulates the
unsharded gradients locally and reduce-scatters once per step, which is what the pipeline schedule
does too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root: `examples.*`, `agents`

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import numaudit
from examples.dsv3.auditing import (
    LOSS_SITE,
    add_audit_args,
    agent_options,
    capture_experts,
    capture_input_tokens,
    close_agent,
)
from examples.dsv3.data import batches
from examples.dsv3.model import ModelArgs, Transformer, loss_fn
from examples.teardown import exit_rank

RUN_ENV = "NUMAUDIT_RUN"
"""Run name when --name is not given. The agent reads it too and, when both are set, lets it win
over --name (docs/agent.md: the environment overrides arguments)."""
DEFAULT_RUN = "ref"

OnStep = Callable[[int, Transformer, list[float]], None]
"""Called after a step's backward passes, before the optimizer: (step, model, microbatch losses)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Not --run: torchrun's own parser takes --run as an abbreviation of --run-path.
    p.add_argument("--name", default=os.environ.get(RUN_ENV, DEFAULT_RUN),
                   help=f"run name for the audit (default: ${RUN_ENV} or '{DEFAULT_RUN}')")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=16, help="microbatches per dp rank and step")
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seeds both the weights and the data")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--scale", type=int, default=1, help="model width multiplier (ModelArgs.scaled)")
    p.add_argument("--dump", type=Path, default=None,
                   help="rank 0 writes full gradients, per-microbatch outputs and losses to this "
                        ".pt file")
    add_audit_args(p)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, dp_mesh) -> Transformer:
    model = Transformer(ModelArgs().scaled(args.scale))
    model.init_weights(args.seed)  # on the full, unsharded model: identical in every run
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def train(args: argparse.Namespace, on_step: OnStep | None = None) -> list[float]:
    """Run args.steps steps; returns the global mean loss of each step."""
    dp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    dp_rank = dp_mesh.get_local_rank()
    model = build_model(args, dp_mesh)
    # The audit agent: hooks every module and parameter of the model. The address comes from
    # $NUMAUDIT_ADDR; without one the agent counts its captures as dropped and training goes on.
    agent = numaudit.attach(model, run=args.name, mesh=dp_mesh, dp_dim="dp", **agent_options(args))
    capture_input_tokens(agent, model)
    capture_experts(agent, model, dp_mesh.get_group())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    margs = model.args
    data = batches(args.seed, dp_rank, args.microbatches, args.microbatch_size, margs.max_seq_len,
                   margs.vocab_size)
    n_mb = args.microbatches
    assert isinstance(model, FSDPModule)
    step_losses = []
    for step in range(args.steps):
        microbatches = next(data)
        losses, outputs = [], []
        with agent.step(step):  # on exit: every parameter gradient (None recorded explicitly)
            for j, (tokens, targets) in enumerate(microbatches):
                with agent.microbatch(j):
                    model.set_requires_gradient_sync(j == n_mb - 1)
                    logits = model(tokens)
                    loss = loss_fn(logits, targets)
                    # The unscaled microbatch mean, as the pipeline schedule's loss_fn returns it.
                    agent.capture(loss, site=LOSS_SITE, phase="loss")
                    (loss / n_mb).backward()
                losses.append(loss.item())
                if args.dump is not None:
                    outputs.append(logits.detach())
        if on_step is not None:
            on_step(step, model, losses)
        if args.dump is not None:
            dump_step(args.dump, step, model, outputs, losses, dp_mesh)
        optimizer.step()
        optimizer.zero_grad()
        step_losses.append(_global_mean(losses))
        if dist.get_rank() == 0:
            print(f"[{args.name}] step {step} loss {step_losses[-1]:.6f}", flush=True)
    close_agent(agent, args.name)
    return step_losses


def _global_mean(losses: list[float]) -> float:
    t = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient as a plain full tensor (collective over the mesh); None stays
    None."""
    grads = {}
    for name, param in model.named_parameters():
        g = param.grad
        if g is not None:
            g = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
        grads[name] = g
    return grads


def dump_step(path: Path, step: int, model: torch.nn.Module, outputs: list[torch.Tensor],
              losses: list[float], dp_mesh) -> None:
    """Rank 0 writes {step: {grads, outputs [dp, mb, ...], losses [dp, mb]}} to path (all steps
    so far)."""
    grads = full_grads(model)
    group = dp_mesh.get_group()
    local_out = torch.stack(outputs)
    gathered = [torch.empty_like(local_out) for _ in range(dp_mesh.size())]
    dist.all_gather(gathered, local_out, group=group)
    local_loss = torch.tensor(losses, dtype=torch.float64)
    gathered_loss = [torch.empty_like(local_loss) for _ in range(dp_mesh.size())]
    dist.all_gather(gathered_loss, local_loss, group=group)
    if dist.get_rank() == 0:
        record = torch.load(path) if step > 0 and path.exists() else {}
        record[step] = {"grads": grads, "outputs": torch.stack(gathered),
                        "losses": torch.stack(gathered_loss)}
        torch.save(record, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    start, cpu = time.perf_counter(), time.process_time()
    try:
        train(args)
        if dist.get_rank() == 0:
            print(f"[{args.name}] {args.steps} step(s) in {time.perf_counter() - start:.2f} s "
                  f"(rank 0 cpu {time.process_time() - cpu:.2f} s)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()  # skips a gloo teardown abort (examples/teardown.py)
