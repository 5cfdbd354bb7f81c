"""Candidate run: the DS3-style model on 2 pipeline ranks x the reference's 4-rank dp mesh (ZBV).

    torchrun --nproc-per-node 8 examples/dsv3_pp.py --name pp8 [--dump /tmp/pp.pt]

Mesh ("pp", "dp") of shape (2, 4): global rank = pp_rank * 4 + dp_rank, so dp rank d sees the same
data as dp rank d of the reference. The model is cut by layers into 4 stages placed in V order
(pp rank 0 holds stages 0 and 3, pp rank 1 holds stages 1 and 2) and driven by
`ScheduleZBVZeroBubble`, which splits backward into input-grad (I) and weight-grad (W) actions.
Each stage is FSDP2-sharded over the dp mesh.

Microbatches: the schedule gets the local batch (the 16 microbatches of the reference concatenated
in order) and splits it with `tensor_split` along dim 0 into 16 equal chunks, so its microbatch j is
exactly the reference's microbatch j.

Gradient scaling: as in the reference, backward runs on each microbatch's mean cross-entropy
divided by n_microbatches (`MicrobatchMean`, torchtitan's `rescale_accumulated_loss`), and the
schedule's own `scale_grads` is off; FSDP2's reduce-scatter averages over the dp ranks. So every
gradient flowing backward, not only the accumulated ones, is the reference's, and an audit with
`--bwd` compares activation gradients too. The audit captures the loss before the division.

FSDP2 inside the stages uses reshard_after_forward=False; with FSDP2's default (True for non-root
modules) the ZBV split backward silently loses layer gradients. `--inject reshard-after-forward`
brings that bug back on purpose; docs/dsv3.md explains it, and `INJECTIONS` lists the other faults
an audit must catch.

Auditing: `watch_stages` keys every capture by the schedule's microbatch (chunk) id and stage
index, and `agent_loss` captures each microbatch's loss where the schedule computes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root: `examples.*`, `agents`

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

import numaudit
from examples.dsv3.auditing import (
    LOSS_SITE,
    add_audit_args,
    agent_options,
    capture_experts,
    capture_input_tokens,
    close_agent,
)
from examples.dsv3.data import batches, local_batch
from examples.dsv3.model import ModelArgs, Transformer, loss_fn, prune_to_stage
from examples.dsv3_spmd import full_grads
from examples.teardown import exit_rank

RUN_ENV = "NUMAUDIT_RUN"
"""Run name when --name is not given. The agent reads it too and, when both are set, lets it win
over --name (docs/agent.md: the environment overrides arguments)."""
DEFAULT_RUN = "pp8"
PP_DEGREE = 2
STAGES_PER_RANK = 2  # ZBV needs exactly two, in V order


@dataclasses.dataclass
class PipelineRun:
    """Everything one rank holds; what an audit agent or a fault injection needs to reach."""

    mesh: DeviceMesh
    """The ("pp", "dp") mesh."""
    modules: list[Transformer]
    """This rank's stage modules (FSDP2-sharded, full-model FQNs), in stage order."""
    stages: list[PipelineStage]
    """The pipelining stages wrapping `modules`."""
    schedule: ScheduleZBVZeroBubble
    """The schedule; `schedule.step(...)` runs all microbatches of one step."""
    optimizer: torch.optim.Optimizer
    """One optimizer over the parameters of both local stages."""
    loss: MicrobatchMean
    """The schedule's loss function (per-microbatch loss / n_microbatches)."""

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()


def _inject_reshard_after_forward(run: PipelineRun) -> None:
    """Reshard layers after forward (FSDP2's default): the ZBV split backward then drops their
    grads.

    The origin bug: stage 3's layer gradients are None, stages 1 and 2 hold sums over only some
    microbatches (docs/dsv3.md).
    """
    for module in run.modules:
        for layer in module.layers.values():
            layer.set_reshard_after_forward(True, recurse=False)


BREAK_AT_STAGE = 1
"""`break-backward` cuts the backward graph at the input of this stage."""


def _inject_break_backward(run: PipelineRun) -> None:
    """Cut the backward graph at stage 1's input, keeping a path that carries a zero gradient.

    `h.detach() + 0 * h` has h's value (bitwise) but passes back a zero gradient, so the schedule
    still finds a graph to run through: stage 1 sends zeros to stage 0, whose parameters
    (`tok_embeddings`, `layers.0.*`) end the step with all-zero gradients. Forward is untouched.
    """

    def cut(module: torch.nn.Module, inputs: tuple) -> tuple:
        h = inputs[0]
        return (h.detach() + 0 * h, *inputs[1:])

    for stage in run.stages:
        if stage.stage_index == BREAK_AT_STAGE:
            stage.submod.register_forward_pre_hook(cut)


def _inject_last_microbatch_only(run: PipelineRun) -> None:
    """Reset the accumulated gradients before the last microbatch's weight-gradient action.

    In ZBV every stage runs its W (weight-gradient) actions in microbatch order, and stage 0 does
    its whole backward in W, so clearing `.grad` just before W(n-1) leaves only the last
    microbatch's contribution (then divided by n_microbatches as usual). Forward is untouched.
    """
    last = run.schedule._n_microbatches - 1
    for stage in run.stages:
        method = stage.backward_weight_one_chunk

        def reset_then_run(chunk_id: int, *args, _method=method, _stage=stage, **kwargs):
            if chunk_id == last:
                for p in _stage.submod.parameters():  # the unsharded parameters during the step
                    p.grad = None
            return _method(chunk_id, *args, **kwargs)

        stage.backward_weight_one_chunk = reset_then_run


def _inject_grad_scale(run: PipelineRun) -> None:
    """Leave out the loss's division by n_microbatches, which the reference does.

    Every gradient, accumulated or flowing backward, is then n_microbatches (16) times the
    reference's: the sum over microbatches instead of the mean. Forward is untouched.
    """
    run.loss.divisor = 1


SWAP_DP_RANK = 1
"""`swap-microbatches` swaps two microbatches of this data-parallel rank ..."""
SWAP_MICROBATCHES = (3, 12)
"""... these two (tokens and targets together)."""


def _inject_swap_microbatches(run: PipelineRun) -> None:
    """Feed microbatches 3 and 12 of dp rank 1 in each other's place (a data-order bug).

    Both the tokens (first stage) and the targets (last stage) are swapped, so the step trains on
    the same samples; only those two microbatches' activations and losses differ from the
    reference's, on dp rank 1's piece. Gradients add up the same terms in another order.
    """
    if run.mesh["dp"].get_local_rank() != SWAP_DP_RANK:
        return
    n = run.schedule._n_microbatches
    a, b = SWAP_MICROBATCHES
    step = run.schedule.step

    def swap(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        chunks = list(t.tensor_split(n, dim=0))
        chunks[a], chunks[b] = chunks[b], chunks[a]
        return torch.cat(chunks)

    def swapped_step(*args, target=None, **kwargs):
        return step(*(swap(t) for t in args), target=swap(target), **kwargs)

    run.schedule.step = swapped_step


ULP_LAYER = "1"
"""`ulp-shared-expert` changes this layer's `moe.shared_experts.w1.weight[0, 0]` ..."""


def _inject_ulp_shared_expert(run: PipelineRun) -> None:
    """... by one unit in the last place (towards +inf) in the candidate only.

    The element lives in row 0, i.e. in the FSDP2 shard of dp rank 0 of the pipeline rank holding
    the layer; it is changed in that sharded parameter before the first step, so the schedule's
    all-gather hands every dp rank the changed weight.
    """
    if run.mesh["dp"].get_local_rank() != 0:
        return
    for module in run.modules:
        if ULP_LAYER in module.layers:
            weight = module.layers[ULP_LAYER].moe.shared_experts.w1.weight
            with torch.no_grad():
                local = weight.to_local()
                local[0, 0] = torch.nextafter(local[0, 0], torch.tensor(float("inf")))


DROP_LAYER, DROP_EXPERT = "2", 1
"""`drop-expert-tokens` drops the tokens routed to this expert of this layer ..."""


def _inject_drop_expert_tokens(run: PipelineRun) -> None:
    """... in the candidate only, as a capacity or dispatch bug would: the expert receives no
    rows and its top-k slot adds nothing. The router is untouched, so the audit should find the
    layer's experts first (that expert's input and output rows), then everything downstream."""
    for module in run.modules:
        if DROP_LAYER in module.layers:
            module.layers[DROP_LAYER].moe.drop_expert = DROP_EXPERT


SOFTMAX_LAYER = "1"
"""`softmax-scale` takes this layer's attention softmax scale from the wrong head width ..."""


def _inject_softmax_scale(run: PipelineRun) -> None:
    """... the value head's (v_head_dim**-0.5 = 0.25) instead of the query/key head's
    (qk_head_dim**-0.5 = 0.204), in the candidate only: a bug inside one operation (the
    attention kernel's `scale` argument). The module-level report finds the layer's attention;
    its operations (`--ops`, or the drill rerun) name the kernel and the argument."""
    for module in run.modules:
        if SOFTMAX_LAYER in module.layers:
            attention = module.layers[SOFTMAX_LAYER].attention
            attention.softmax_scale = attention.v_dim ** -0.5


BF16_LAYER = "1"
"""`bf16-matmul` computes this layer's `moe.shared_experts.w1` projection in bfloat16 ..."""


def _inject_bf16_matmul(run: PipelineRun) -> None:
    """... in the candidate only (inputs and weight cast to bfloat16, the result cast back): a
    mixed-precision slip inside one module. The module-level report finds the layer's shared
    experts; their operations name the casts and the matmul computed in bfloat16."""

    def bf16_linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.bfloat16(), self.weight.bfloat16()).float()

    for module in run.modules:
        if BF16_LAYER in module.layers:
            w1 = module.layers[BF16_LAYER].moe.shared_experts.w1
            w1.forward = types.MethodType(bf16_linear, w1)


INJECTIONS: dict[str, Callable[[PipelineRun], None]] = {
    "reshard-after-forward": _inject_reshard_after_forward,
    "break-backward": _inject_break_backward,
    "last-microbatch-only": _inject_last_microbatch_only,
    "grad-scale": _inject_grad_scale,
    "swap-microbatches": _inject_swap_microbatches,
    "ulp-shared-expert": _inject_ulp_shared_expert,
    "drop-expert-tokens": _inject_drop_expert_tokens,
    "softmax-scale": _inject_softmax_scale,
    "bf16-matmul": _inject_bf16_matmul,
}
"""Faults `--inject NAME` plants after the run is built, to show what an audit catches."""

OnStep = Callable[[int, PipelineRun, list[float]], None]
"""Called after a step's schedule ran, before the optimizer: (step, run, this rank's microbatch
losses)."""


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
                   help="global rank 0 writes the full gradients of all stages, per-microbatch "
                        "outputs and losses to this .pt file")
    p.add_argument("--inject", choices=sorted(INJECTIONS), default=None,
                   help="plant a known fault (see INJECTIONS)")
    p.add_argument("--also", action="append", default=[], metavar="NAME:INJECT",
                   type=_also_case,
                   help="then run another candidate in the same job, under its own run name and "
                        "agent, with fault INJECT ('none' for none); repeatable. Saves the job's "
                        "start-up (most of an 8-rank CPU job) when auditing many faults")
    p.add_argument("--ops-only-for", action="append", default=[], metavar="INJECT",
                   choices=sorted(INJECTIONS),
                   help="with NUMAUDIT_OPS set: only the candidates with these faults capture "
                        "operations (the others run without it); repeatable")
    add_audit_args(p)
    return p.parse_args(argv)


def _also_case(text: str) -> tuple[str, str | None]:
    name, sep, inject = text.partition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--also: expected NAME:INJECT, got {text!r}")
    if inject not in INJECTIONS and inject != "none":
        raise argparse.ArgumentTypeError(
            f"--also: unknown fault {inject!r} (one of {', '.join(sorted(INJECTIONS))}, none)")
    return name, None if inject == "none" else inject


class MicrobatchMean:
    """The schedule's loss: a microbatch's loss divided by the number of microbatches.

    Backward on it accumulates the mean over microbatches, as the reference's `loss / n` does
    (the schedule's `scale_grads` is then off). `divisor` is an attribute so a fault can change it.
    """

    def __init__(self, loss: Callable[..., torch.Tensor], divisor: int) -> None:
        self.loss, self.divisor = loss, divisor

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.loss(*args, **kwargs) / self.divisor


def make_mesh() -> DeviceMesh:
    """The ("pp", "dp") mesh of shape (PP_DEGREE, world / PP_DEGREE)."""
    world = dist.get_world_size()
    if world % PP_DEGREE:
        raise SystemExit(f"world size {world} is not a multiple of the pipeline degree {PP_DEGREE}")
    return init_device_mesh("cpu", (PP_DEGREE, world // PP_DEGREE), mesh_dim_names=("pp", "dp"))


def build(args: argparse.Namespace, mesh: DeviceMesh | None = None,
          loss: Callable[..., torch.Tensor] = loss_fn) -> PipelineRun:
    """This rank's two stages, FSDP2-sharded, and the ZBV schedule that drives them.

    `loss` is the per-microbatch loss (a mean over its tokens); the schedule backpropagates it
    divided by the number of microbatches (`MicrobatchMean`).
    """
    mesh = make_mesh() if mesh is None else mesh
    pp_mesh, dp_mesh = mesh["pp"], mesh["dp"]
    pp_rank = pp_mesh.get_local_rank()
    num_stages = PP_DEGREE * STAGES_PER_RANK
    margs = ModelArgs().scaled(args.scale)
    modules, stages = [], []
    for stage_index in (pp_rank, num_stages - 1 - pp_rank):  # V order
        module = Transformer(margs)
        module.init_weights(args.seed)  # full model first, so every weight equals the reference's
        prune_to_stage(module, stage_index, num_stages)
        # reshard_after_forward=False is required for correctness, not memory: the schedule's
        # UNSHARD/RESHARD actions bracket the whole step, and the I (input-grad) action collects
        # `stage.submod.parameters()` *before* autograd runs. A layer resharded after its forward
        # exposes its sharded DTensors there, which are not in the autograd graph, so the W action
        # silently computes no gradient for it (None, or partial sums). See docs/dsv3.md.
        for layer in module.layers.values():
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        modules.append(module)
        stages.append(PipelineStage(module, stage_index, num_stages, torch.device("cpu"),
                                    *_stage_metadata(args, margs, stage_index, num_stages),
                                    group=pp_mesh.get_group()))
    schedule_loss = MicrobatchMean(loss, args.microbatches)
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=args.microbatches,
                                     loss_fn=schedule_loss, scale_grads=False)
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=args.lr)
    return PipelineRun(mesh, modules, stages, schedule, optimizer, schedule_loss)


def _stage_metadata(args: argparse.Namespace, margs: ModelArgs, stage_index: int,
                    num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example (meta) input and output of one microbatch of a stage: its static metadata.

    Given these, the schedule skips its first-step metadata inference, which would otherwise run
    every stage's forward (and the loss, and a backward) once more on placeholder tensors: extra
    work, and forwards an audit agent would see as an extra call of every module in microbatch 0.
    """
    batch, seq = args.microbatch_size, margs.max_seq_len
    meta = torch.device("meta")
    # requires_grad matters: it tells the schedule which tensors carry gradients between stages.
    hidden = torch.empty(batch, seq, margs.dim, device=meta, requires_grad=True)
    inputs = torch.empty(batch, seq, dtype=torch.long, device=meta) if stage_index == 0 else hidden
    outputs = (torch.empty(batch, seq, margs.vocab_size, device=meta, requires_grad=True)
               if stage_index == num_stages - 1 else hidden)
    return inputs, outputs


def train(args: argparse.Namespace, on_step: OnStep | None = None) -> list[float]:
    """Run args.steps steps; returns the global mean loss of each step."""
    mesh = make_mesh()
    # The audit agent. Its stage modules are added by `watch_stages` once they exist; the
    # schedule's loss function is wrapped so each microbatch's (unscaled) loss is captured.
    agent = numaudit.attach(run=args.name, mesh=mesh, dp_dim="dp", **agent_options(args))
    run = build(args, mesh, loss=numaudit.agent_loss(agent, loss_fn, site=LOSS_SITE))
    if args.inject is not None:
        INJECTIONS[args.inject](run)
    numaudit.watch_stages(agent, run.stages)  # keyed by the schedule's microbatch and stage ids
    for module in run.modules:
        capture_input_tokens(agent, module)  # on the first stage only
        capture_experts(agent, module, run.mesh["dp"].get_group())
    dp_rank = run.mesh["dp"].get_local_rank()
    margs = run.modules[0].args
    data = batches(args.seed, dp_rank, args.microbatches, args.microbatch_size, margs.max_seq_len,
                   margs.vocab_size)
    step_losses = []
    for step in range(args.steps):
        tokens, targets = local_batch(next(data))
        losses: list[torch.Tensor] = []
        # The microbatch loop lives inside the schedule: it runs F, I (input grad) and W (weight
        # grad) actions for microbatches 0..n-1 of both local stages in ZBV order.
        with agent.step(step):  # on exit: every parameter gradient (None recorded explicitly)
            outputs = run.schedule.step(
                *((tokens,) if run.has_first_stage else ()),
                target=targets if run.has_last_stage else None,
                losses=losses if run.has_last_stage else None,
                return_outputs=args.dump is not None,
            )
        # the schedule returns the scaled losses; a power-of-two divisor undoes exactly
        mb_losses = [loss.item() * run.loss.divisor for loss in losses]
        _warn_missing_grads(run, args.name)
        if on_step is not None:
            on_step(step, run, mb_losses)
        if args.dump is not None:
            dump_step(args.dump, step, run, outputs, mb_losses, args.microbatches)
        run.optimizer.step()
        run.optimizer.zero_grad()
        step_losses.append(_global_mean(mb_losses))
        if dist.get_rank() == 0:
            print(f"[{args.name}] step {step} loss {step_losses[-1]:.6f}", flush=True)
    close_agent(agent, args.name)
    return step_losses


def _warn_missing_grads(run: PipelineRun, name: str) -> None:
    """Rank 0 prints how many parameter gradients are None across the job (should be none)."""
    params = list(run.parameters())
    t = torch.tensor([sum(p.grad is None for p in params), len(params)])
    dist.all_reduce(t)  # each parameter counted once per dp rank
    if dist.get_rank() == 0 and t[0] > 0:
        print(f"[{name}] WARNING: {t[0].item()} of {t[1].item()} parameter-gradient pieces are "
              "None", flush=True)


def _global_mean(losses: list[float]) -> float:
    """Mean over every microbatch loss in the job (only last-stage ranks hold any)."""
    t = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def dump_step(path: Path, step: int, run: PipelineRun, outputs: torch.Tensor | None,
              losses: list[float], n_microbatches: int) -> None:
    """Global rank 0 writes {step: {grads, outputs [dp, mb, ...], losses [dp, mb]}} to path.

    Grads: each pp rank gathers its stages' full gradients over its dp group, then the dp-rank-0
    member of each pp rank sends them to global rank 0 (same FQNs as the reference). Outputs and
    losses live on the ranks holding the last stage (pp rank 0 in V order); they are gathered over
    that rank's dp group.
    """
    grads: dict[str, torch.Tensor | None] = {}
    for module in run.modules:
        grads.update(full_grads(module))
    dp_mesh, pp_mesh = run.mesh["dp"], run.mesh["pp"]
    if dp_mesh.get_local_rank() == 0:
        shards: list | None = [None] * pp_mesh.size() if dist.get_rank() == 0 else None
        dist.gather_object(grads, shards, dst=0, group=pp_mesh.get_group())
        if shards is not None:
            grads = {k: v for shard in shards for k, v in shard.items()}
    record = {"grads": grads}
    if run.has_last_stage:
        group = dp_mesh.get_group()
        local_out = outputs.unflatten(0, (n_microbatches, -1)).contiguous()  # [mb, mb_size, ...]
        gathered = [torch.empty_like(local_out) for _ in range(dp_mesh.size())]
        dist.all_gather(gathered, local_out, group=group)
        local_loss = torch.tensor(losses, dtype=torch.float64)
        gathered_loss = [torch.empty_like(local_loss) for _ in range(dp_mesh.size())]
        dist.all_gather(gathered_loss, local_loss, group=group)
        record.update(outputs=torch.stack(gathered), losses=torch.stack(gathered_loss))
    if dist.get_rank() == 0:
        if not run.has_last_stage:
            raise AssertionError("global rank 0 must hold the last stage (V order) to dump outputs")
        saved = torch.load(path) if step > 0 and path.exists() else {}
        saved[step] = record
        torch.save(saved, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    start, cpu = time.perf_counter(), time.process_time()
    ops = os.environ.get("NUMAUDIT_OPS")
    try:
        for name, inject in [(args.name, args.inject), *args.also]:
            if RUN_ENV in os.environ:  # the agent lets the environment name the run
                os.environ[RUN_ENV] = name
            if ops is not None and args.ops_only_for:  # op-level captures where asked
                if inject in args.ops_only_for:
                    os.environ["NUMAUDIT_OPS"] = ops
                else:
                    os.environ.pop("NUMAUDIT_OPS", None)
            train(argparse.Namespace(**{**vars(args), "name": name, "inject": inject}))
            if dist.get_rank() == 0:
                print(f"[{name}] {args.steps} step(s) in {time.perf_counter() - start:.2f} s "
                      f"(rank 0 cpu {time.process_time() - cpu:.2f} s)", flush=True)
            start, cpu = time.perf_counter(), time.process_time()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()  # skips a gloo teardown abort (examples/teardown.py)
