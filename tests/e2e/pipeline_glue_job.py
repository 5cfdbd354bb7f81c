"""Jobs of tests/e2e/test_pipeline_glue.py: pipeline schedules that infer shapes, user hooks.

    python tests/e2e/pipeline_glue_job.py ref:ref                          # one process
    torchrun --standalone --nproc-per-node 2 tests/e2e/pipeline_glue_job.py gpipe:gpipe ...

The model, data and loss are tests/e2e/parallel_job.py's. Every run registers the same two user
forward pre-hooks that call `agent.capture`: one on the module that receives the tokens (the
model, or stage 0's module) captures them under phase input, one on `layers.2` captures that
block's input activation under phase fwd. The pipelined stages are built without input_args,
so each schedule infers shapes on the first step by running every stage's module once outside
its chunks (stages after the first on empty tensors). Cases:

- `gpipe`: 2 stages on 2 ranks, ScheduleGPipe; the optimizer steps (and zero_grad) inside the
  step block, where the reference steps after it.
- `dualpipev`, `dualpipev_detach`: 4 stages on 2 ranks in DualPipeV's V (rank 0 holds stages 0
  and 3, rank 1 stages 1 and 2); `_detach`: stage 2 detaches its input (planted: the gradient
  stops at the stage 1 -> 2 boundary, so stages 0 and 1 get all-zero parameter gradients).

Each rank writes its agent's close summary to $GLUE_OUT/RUN-rankR.json.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from examples.teardown import exit_rank  # noqa: E402
from numaudit.agents.pipeline import agent_loss, watch_stages  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402
from tests.e2e.parallel_job import (  # noqa: E402
    BATCH,
    LAYERS,
    MICROBATCHES,
    STEPS,
    Model,
    loss_fn,
    microbatch_tokens,
    readme_loop,
    stage_module,
)


def user_hooks(agent, module: torch.nn.Module, first: bool) -> None:
    """The user's own captures, from forward pre-hooks (the same in every run)."""
    if first:
        module.register_forward_pre_hook(
            lambda m, args: agent.capture(args[0], site="tokens", phase="input"))
    if "2" in module.layers:
        module.layers["2"].register_forward_pre_hook(
            lambda m, args: agent.capture(args[0], site="layers.2.input", phase="fwd"))


def write_summary(run: str, summary: dict) -> None:
    out = Path(os.environ["GLUE_OUT"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"{run}-rank{rank}.json").write_text(json.dumps(summary, default=str))


def run_ref(run: str) -> None:
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = numaudit.attach(model, run=run)
    user_hooks(agent, model, first=True)
    readme_loop(agent, model, optimizer,
                lambda step: [microbatch_tokens(step, j) for j in range(MICROBATCHES)])
    write_summary(run, agent.close())


def run_pp(case: str, run: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleGPipe

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "pp"))
    rank, pp = mesh["pp"].get_local_rank(), mesh["pp"].size()
    v = case.startswith("dualpipev")
    n_stages = 2 * pp if v else pp
    mine = [rank, n_stages - 1 - rank] if v else [rank]  # DualPipeV's V placement
    per_stage = LAYERS // n_stages
    model = Model()
    agent = numaudit.attach(None, run=run, mesh=mesh, dp_dim="dp")
    stages, params = [], []
    for s in mine:
        module = stage_module(model, list(range(s * per_stage, (s + 1) * per_stage)),
                              s == 0, s == n_stages - 1)
        if case == "dualpipev_detach" and s == 2:
            module.layers[str(s * per_stage)].detach_input = True  # planted
        user_hooks(agent, module, first=s == 0)
        params += list(module.parameters())
        stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"),  # no shapes
                                    group=mesh.get_group("pp")))
    pp_loss = agent_loss(agent, lambda out, target: loss_fn(out))
    if v:
        schedule = ScheduleDualPipeV(stages, MICROBATCHES, loss_fn=pp_loss, scale_grads=False)
    else:
        schedule = ScheduleGPipe(stages[0], MICROBATCHES, loss_fn=pp_loss, scale_grads=False)
    watch_stages(agent, stages, schedule=schedule)
    optimizer = torch.optim.SGD(params, lr=0.1)
    holds_first = 0 in mine
    holds_last = n_stages - 1 in mine
    for step in range(STEPS):
        x = torch.cat([microbatch_tokens(step, j) for j in range(MICROBATCHES)])
        target = torch.zeros(MICROBATCHES * BATCH)
        with agent.step(step):
            args = (x,) if holds_first else ()
            kwargs = {"target": target} if holds_last else {}
            schedule.step(*args, **kwargs)
            if case == "gpipe":  # as most loops have it: seen before it steps (agent.py)
                optimizer.step()
                optimizer.zero_grad()
        if case != "gpipe":
            optimizer.step()
            optimizer.zero_grad()
    write_summary(run, agent.close())


def run_case(case: str, run: str) -> None:
    if case == "ref":
        run_ref(run)
    elif case in ("gpipe", "dualpipev", "dualpipev_detach"):
        run_pp(case, run)
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_cases(run_case)
    exit_rank()
