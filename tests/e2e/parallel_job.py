"""One job of the parallelism matrix (issue 9): a small model, trained as users write it.

    python tests/e2e/parallel_job.py single:ref                       # the reference, one process
    torchrun --standalone --nproc-per-node 2 tests/e2e/parallel_job.py ddp:ddp fsdp:fsdp ...

Each argument is CASE:RUN (CASE+rename: with NUMAUDIT_RENAME_IF_TAKEN=1); the cases of one job run
one after another in the same process group, each with a fresh model (same seed), its own agent and
run name. Every non-pipelined case runs the README's snippet verbatim (per-rank mean loss, DDP/FSDP
averaging, `bwd` captured, every rank attached); pipelined cases use agents.pipeline as the README
says. Planted bugs are cases too. Environment: NUMAUDIT_ADDR (the shared daemon), NUMAUDIT_PHASES
(bwd added by the test).

Gradient clipping (issue 11): `single_clip` is the reference (the README loop with
`torch.nn.utils.clip_grad_norm_` before `optimizer.step()`, the optimizer watched: phases
optim_grad and update); `pp_clip_global` clips the two stages by the global norm, computed as
clip_grad_norm_ does; `pp_clip_local` is the bug: each stage clips by its own norm.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.teardown import exit_rank  # noqa: E402
from numaudit import agents  # noqa: E402
from numaudit.agents.pipeline import agent_loss, watch_stages  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402

VOCAB, DIM, HIDDEN, LAYERS = 16, 8, 16, 4
MICROBATCHES, BATCH, SEQ, STEPS = 4, 4, 4, 2
"""4 microbatches of 4 sequences (the global batch of each microbatch) of 4 tokens, 2 steps."""

DP_CASES = {"ddp", "fsdp", "ddp_skip_allreduce", "ddp_loss_quarter", "ddp_frozen",
            "ddp_wrong_data", "ddp_no_sync", "ddp_no_sync_always", "fsdp_no_mesh", "hsdp",
            "fsdp1", "fsdp1_orig", "fsdp1_comm_sum", "fsdp1_frozen", "fsdp1_hybrid", "fsdp1_clip",
            "fsdp1_clip_local", "ddp_loss_sum", "ddp_grad_sum", "ddp_loss_sum_bug",
            "ddp_acc_div"}
TP_CASES = {"tp", "tp_partial", "tp_dtensor_logits", "tp_sp", "tp_sp_ac", "tp_sp_norm_plain",
            "fsdp_tp_sp", "fsdp_tp_sp_norm_plain"}
PP_CASES = {"pp_gpipe", "pp_1f1b", "pp_interleaved", "pp_detach", "pp_swap", "pp_clip_global",
            "pp_clip_local", "pp_tp_sp"}
MAX_NORM = 0.5
"""Clipping threshold of the clip cases: the total gradient norm is ~2.5 in both steps and each
stage's own norm is above it too (~0.7 and ~2.4), so every clip is active."""


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM)
        self.detach_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.detach_input:  # planted: gradients stop here (exactly zero upstream)
            x = x.detach() + 0 * x
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Model(torch.nn.Module):
    """Embedding, LAYERS blocks, norm, head; a pipeline stage keeps a subset (others None)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = torch.nn.LayerNorm(DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.out(self.norm(h)) if self.out is not None else h


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    """Per-rank mean loss over this rank's share of the microbatch."""
    return out.square().mean()


def microbatch_tokens(step: int, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + j)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def readme_loop(agent, model, optimizer, microbatches_of, loss_of=loss_fn, clip=None,
                no_sync=None, backward=torch.Tensor.backward) -> None:
    """The README's snippet, verbatim but for where the microbatches and loss_fn come from
    (and `clip(model)` before the optimizer step, when given; DDP's gradient accumulation,
    `no_sync(j)` a context for microbatch j, when given; and `backward(loss)`, for code that
    backpropagates a scaled loss)."""
    n = STEPS
    for step in range(n):
        microbatches = microbatches_of(step)
        loss_fn = loss_of
        with agent.step(step):                 # parameter gradients captured when the block exits
            for j, x in enumerate(microbatches):
                with (no_sync(j) if no_sync else contextlib.nullcontext()), agent.microbatch(j):
                    loss = loss_fn(model(x))
                    agent.capture(loss, site="loss", phase="loss")
                    backward(loss)
        if clip is not None:
            clip(model)
        optimizer.step()
        optimizer.zero_grad()


def run_single(run: str, clip: bool = False) -> None:
    model = Model()
    mesh = None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # With clip, the optimizer is watched too: phases optim_grad and update.
    agent = agents.attach(model, run=run, mesh=mesh, dp_dim="dp",
                          optimizer=optimizer if clip else None)
    readme_loop(agent, model, optimizer,
                lambda step: [microbatch_tokens(step, j) for j in range(MICROBATCHES)],
                clip=(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
                if clip else None)
    agent.close()


def run_dp(case: str, run: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    shard_mesh = mesh
    if case == "hsdp":  # FSDP2 sharding over dp_shard, replicated over dp_replicate
        shard_mesh = init_device_mesh("cpu", (2, world // 2),
                                      mesh_dim_names=("dp_replicate", "dp_shard"))
        mesh = shard_mesh["dp_replicate", "dp_shard"]._flatten("dp")  # the batch split
    model = Model()
    if case in ("ddp_frozen", "fsdp1_frozen"):
        model.layers["1"].w1.weight.requires_grad_(False)
    if case.startswith("fsdp1"):  # FSDP1: FlatParameters (use_orig_params=False: the default)
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        hybrid = {}
        if case == "fsdp1_hybrid":  # sharded over 2 ranks, replicated over the 2 such groups
            from torch.distributed.fsdp import ShardingStrategy

            hybrid = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                          device_mesh=init_device_mesh("cpu", (world // 2, 2),
                                                       mesh_dim_names=("replicate", "shard")))
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         use_orig_params=case in ("fsdp1_orig", "fsdp1_frozen"),
                                         device_id=torch.device("cpu"), **hybrid)
        if case == "fsdp1_comm_sum":  # planted: the gradients' reduce-scatter sums, not averages
            model.register_comm_hook(None, _reduce_scatter_summed)
    elif case in ("fsdp", "fsdp_no_mesh", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    else:
        model = DDP(model)
        if case == "ddp_skip_allreduce":
            model.register_comm_hook(None, _allreduce_skipped_on_rank(1))
        elif case == "ddp_grad_sum":  # gradients summed over ranks, as torchtitan's are
            model.register_comm_hook(None, _allreduce_summed)
    share = BATCH // world
    reader = 0 if case == "ddp_wrong_data" else rank  # planted: rank 1 reads rank 0's rows
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = None
    if case.startswith("fsdp1_clip"):  # the optimizer watched, as in ref_clip
        # FSDP1's own clip_grad_norm_ takes the norm over every rank's shard; planted: torch's,
        # which sees only this rank's shard of each FlatParameter, so each rank clips by its own
        clip = ((lambda m: m.clip_grad_norm_(MAX_NORM)) if case == "fsdp1_clip" else
                (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)))
    if case == "fsdp_no_mesh":  # no mesh given: the batch split is the whole world
        agent = agents.attach(model, run=run)
    else:
        agent = agents.attach(model, run=run, mesh=mesh, dp_dim="dp",
                              optimizer=optimizer if clip else None)
    loss_of = (lambda out: loss_fn(out) / 4) if case == "ddp_loss_quarter" else loss_fn
    backward = torch.Tensor.backward
    if case in ("ddp_loss_sum", "ddp_grad_sum", "ddp_loss_sum_bug"):
        # torchtitan's normalization: each rank sums its per-token losses and divides by the
        # microbatch's global token count (an all-reduce of the ranks' counts; per microbatch,
        # as the reference's loss is), so the ranks' losses add up to the single process's.
        # Either backward on loss * world, so that DDP's averaging gives the single process's
        # gradients (ddp_loss_sum), or backward as is with the gradients summed (ddp_grad_sum;
        # accumulated under no_sync: DDP all-reduces a parameter's accumulated gradient, so a
        # sum in every microbatch's backward would add the earlier microbatches' again).
        # Planted (ddp_loss_sum_bug): rank 1 divides by its own token count.
        loss_of = _globally_normalized(rank == 1 and case == "ddp_loss_sum_bug")
        if case != "ddp_grad_sum":
            backward = lambda loss: (loss * world).backward()  # noqa: E731
    if case == "ddp_acc_div":  # gradient accumulation done right: each microbatch's loss (as
        # captured) divided by the accumulation count before backward; `ddp` does not divide
        backward = lambda loss: (loss / MICROBATCHES).backward()  # noqa: E731
    # Gradient accumulation as DDP and FSDP1 users write it: no all-reduce (reduce-scatter) but
    # in the last microbatch's backward (ddp_no_sync, fsdp1_orig); planted: in none of them
    # (ddp_no_sync_always).
    def no_sync(j: int):
        last = j == MICROBATCHES - 1 and case != "ddp_no_sync_always"
        return contextlib.nullcontext() if last else model.no_sync()

    readme_loop(agent, model, optimizer,
                lambda step: [microbatch_tokens(step, j)[reader * share:(reader + 1) * share]
                              for j in range(MICROBATCHES)], loss_of, clip=clip,
                no_sync=no_sync if "no_sync" in case or case in ("fsdp1_orig", "ddp_grad_sum")
                else None,
                backward=backward)
    agent.close()


def _globally_normalized(local: bool = False):
    """A loss function that sums this rank's per-token losses (loss_fn's, per token) and divides
    by the global token count of the microbatch; by its own count when `local` (the bug)."""
    def loss_of(out: torch.Tensor) -> torch.Tensor:
        per_token = out.square().mean(-1)
        tokens = torch.tensor(per_token.numel())
        global_tokens = tokens.clone()
        dist.all_reduce(global_tokens)
        return per_token.sum() / (tokens if local else global_tokens)
    return loss_of


def _reduce_scatter_summed(state, grad: torch.Tensor, output: torch.Tensor) -> None:
    """An FSDP1 comm hook that forgets to average: each rank's shard is the sum over ranks."""
    dist.reduce_scatter_single(output, grad)


def _allreduce_summed(state, bucket):
    """A DDP comm hook that sums the gradients over ranks (no division by the world size)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
        lambda f: f.value()[0])


def _allreduce_skipped_on_rank(bad: int):
    """A DDP comm hook: every rank joins the all-reduce, but rank `bad` keeps its own gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def hook(state, bucket):
        local = bucket.buffer()
        reduced = local.clone().div_(world)
        fut = dist.all_reduce(reduced, async_op=True).get_future()
        if rank == bad:
            return fut.then(lambda f: local)
        return fut.then(lambda f: f.value()[0])

    return hook


def run_tp(case: str, run: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    two_d = case.startswith("fsdp_")  # 2-D: FSDP2 over dp x tensor and sequence parallel
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2) if two_d else (1, world),
                            mesh_dim_names=("dp", "tp"))
    model = Model()
    plan = {}
    if "tp_sp" in case:
        plan = _sequence_parallel_plan(case)
    else:
        for i in range(LAYERS):
            plan[f"layers.{i}.w1"] = ColwiseParallel()
            partial = case == "tp_partial" and i == 1  # planted: the all-reduce is missing
            plan[f"layers.{i}.w2"] = RowwiseParallel(output_layouts=Partial() if partial else None)
        if case == "tp_dtensor_logits":  # the head's logits stay DTensors (column-sharded), so
            plan["out"] = ColwiseParallel(use_local_output=False)  # the loss is Partial(avg)
    parallelize_module(model, mesh["tp"], plan)
    if case == "tp_sp_ac":  # activation checkpointing on every block, as torchtitan applies it
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for name in list(model.layers.keys()):
            model.layers[name] = checkpoint_wrapper(model.layers[name])
    if two_d:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    agent = agents.attach(model, run=run, mesh=mesh, dp_dim="dp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dp, share = mesh["dp"].get_local_rank(), BATCH // mesh["dp"].size()
    readme_loop(agent, model, optimizer,
                lambda step: [microbatch_tokens(step, j)[dp * share:(dp + 1) * share]
                              for j in range(MICROBATCHES)])
    agent.close()


def _sequence_parallel_plan(case: str) -> dict:
    """Tensor parallelism with sequence parallelism, as torchtitan plans a transformer: the
    embedding's output and every block's output are each rank's block of tokens (Shard(1),
    plain tensors), norms run on them under SequenceParallel, Colwise layers gather the tokens
    and Rowwise layers reduce-scatter them back; the head gathers them and replicates its
    output. Planted (*tp_sp_norm_plain): layers.1.norm left out of the plan, so its parameters
    stay plain and each rank's gradient for them covers its own tokens only (the all-reduce
    SequenceParallel's replicated parameters get is missing)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(LAYERS):
        if not (case.endswith("tp_sp_norm_plain") and i == 1):
            plan[f"layers.{i}.norm"] = SequenceParallel()
        plan[f"layers.{i}.w1"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"layers.{i}.w2"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def stage_module(model: Model, layers: list[int], first: bool, last: bool) -> Model:
    """A stage built from the full model: the full model's names, other parts removed."""
    stage = copy.deepcopy(model)
    for i in range(LAYERS):
        if i not in layers:
            del stage.layers[str(i)]
    if not first:
        stage.tok = None
    if not last:
        stage.norm = stage.out = None
    return stage


def _present(module: torch.nn.Module, name: str) -> bool:
    """Whether `module` has the submodule `name` (a stage keeps only its own parts)."""
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def run_pp(case: str, run: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    world = dist.get_world_size()
    tp = 2 if case == "pp_tp_sp" else 1  # 3-D: pipeline stages, each TP + SP over 2 ranks
    mesh = (init_device_mesh("cpu", (1, world // tp, tp), mesh_dim_names=("dp", "pp", "tp"))
            if tp > 1 else init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "pp")))
    rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
    model = Model()
    interleaved = case == "pp_interleaved"
    n_stages = 2 * pp if interleaved else pp
    per_stage = LAYERS // n_stages
    mine = [rank, rank + pp] if interleaved else [rank]
    stages, params = [], []
    for s in mine:
        module = stage_module(model, list(range(s * per_stage, (s + 1) * per_stage)),
                              s == 0, s == n_stages - 1)
        if case == "pp_detach" and s == 1:
            module.layers[str(per_stage)].detach_input = True  # planted: the boundary is cut
        if tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(module, mesh["tp"], {
                name: style for name, style in _sequence_parallel_plan(case).items()
                if _present(module, name)})
        params += list(module.parameters())
        stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"),
                                    group=mesh.get_group("pp")))
    agent = agents.attach(None, run=run, mesh=mesh, dp_dim="dp")
    # Each microbatch's loss is its mean; gradients are summed over microbatches, as the
    # reference's loop does (loss.backward() per microbatch): scale_grads=False.
    pp_loss = agent_loss(agent, lambda out, target: loss_fn(out))
    if interleaved:
        schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=pp_loss, scale_grads=False)
    else:
        kind = Schedule1F1B if case in ("pp_1f1b", "pp_detach") else ScheduleGPipe
        schedule = kind(stages[0], MICROBATCHES, loss_fn=pp_loss, scale_grads=False)
    watch_stages(agent, stages, schedule=schedule)
    optimizer = torch.optim.SGD(params, lr=0.1)
    if case in ("pp_clip_global", "pp_clip_local"):
        agent.watch_optimizer(optimizer)
    for step in range(STEPS):
        order = list(range(MICROBATCHES))
        if case == "pp_swap":
            order[1], order[2] = order[2], order[1]  # planted: microbatches 1 and 2 swapped
        x = torch.cat([microbatch_tokens(step, j) for j in order])
        target = torch.zeros(MICROBATCHES * BATCH)
        with agent.step(step):
            if rank == 0:  # the first stage (every tp rank of it feeds the same batch)
                schedule.step(x)
            else:
                schedule.step(target=target)
        if case == "pp_clip_global":
            clip_global(params, MAX_NORM, mesh.get_group("pp"))
        elif case == "pp_clip_local":  # planted: each stage clips by its own gradient norm
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


def clip_global(params: list, max_norm: float, group) -> torch.Tensor:
    """Clip a pipeline's gradients by the norm over all stages, bitwise as clip_grad_norm_ of
    the whole model: every gradient's own norm, gathered from the stages in stage order (the
    model's parameter order), stacked, and the norm of that vector."""
    grads = [p.grad for p in params if p.grad is not None]
    mine = [torch.linalg.vector_norm(g, 2) for g in grads]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    total = torch.linalg.vector_norm(torch.stack([n for norms in every for n in norms]), 2)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def run_case(case: str, run: str) -> None:
    case, _, option = case.partition("+")
    if option == "rename":  # as an operator would: NUMAUDIT_RENAME_IF_TAKEN=1 for this run
        os.environ["NUMAUDIT_RENAME_IF_TAKEN"] = "1"
    if case in ("single", "single_clip"):
        run_single(run, clip=case == "single_clip")
    elif case in DP_CASES:
        run_dp(case, run)
    elif case in TP_CASES:
        run_tp(case, run)
    elif case in PP_CASES:
        run_pp(case, run)
    elif case.startswith("drill_"):  # op-level captures of a TP block (tests/e2e/drill_job.py)
        from tests.e2e.drill_job import run_one as run_drill

        run_drill(case.removeprefix("drill_"), run)
    else:
        raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_cases(run_case)


if __name__ == "__main__":
    main()
    exit_rank()  # skips a gloo teardown abort (examples/teardown.py)
