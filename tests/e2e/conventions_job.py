"""Gradient bugs in runs whose per-rank loss is a sum over dp ranks (issue 37, point 3).

    torchrun --standalone --nproc-per-node 2 tests/e2e/conventions_job.py ref:ref sum:sum ...

Every case is DDP over 2 ranks on parallel_job's model and data (2 steps of 4 microbatches).
``ref`` is the README's snippet (each rank's loss the mean over its rows, DDP averaging). Every
other case normalizes as torchtitan does: each rank sums its per-token losses and divides by
the microbatch's global token count, so the ranks' losses add up to the whole batch's mean;
either backpropagated times the world size under DDP's averaging (style ``avg``) or as is with
the gradients summed over ranks by a comm hook, accumulated under no_sync (style ``sum``).
A case name ``NAME`` captures the loss as the README does (the default reduce, a mean);
``NAME_declared`` captures it with ``reduce="sum"``.

- ``sum`` (style sum), ``avg`` (style avg): clean;
- ``bucket`` (sum): no DDP; the gradients are summed over ranks by hand after the step's last
  backward, in buckets of 4 parameters (the last registered first, as DDP buckets them), and
  the first bucket's all-reduce is skipped (each rank keeps its own gradients of out and of
  the final norm);
- ``frozen`` (sum): ``layers.1.w1.weight`` is frozen (requires_grad=False);
- ``last_mb`` (avg): ``optimizer.zero_grad()`` before every microbatch's backward, so only the
  last microbatch is trained;
- ``shard`` (avg): rank 1 reads its rows off by one (rows 3, 0 instead of 2, 3);
- ``order`` (sum): the microbatches are fed in reverse order.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402
from tests.e2e.parallel_job import (  # noqa: E402
    BATCH,
    MICROBATCHES,
    STEPS,
    Model,
    _allreduce_summed,
    _globally_normalized,
    loss_fn,
    microbatch_tokens,
)

STYLE = {"ref": "ref", "avg": "avg", "sum": "sum", "bucket": "sum", "frozen": "sum",
         "last_mb": "avg", "shard": "avg", "order": "sum"}
FROZEN = "layers.1.w1.weight"


def _sum_by_hand(model: torch.nn.Module, skipped: int | None = None) -> None:
    """Sum every gradient over ranks in buckets of 4 parameters, the last registered first;
    bucket `skipped` is never all-reduced (each rank keeps its own)."""
    params = [p for p in model.parameters() if p.grad is not None][::-1]
    for b in range(0, len(params), 4):
        if b // 4 != skipped:
            for p in params[b:b + 4]:
                dist.all_reduce(p.grad)


def train(name: str, run: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = name.removesuffix("_declared")
    style = STYLE[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = Model()
    if case == "frozen":
        model.get_parameter(FROZEN).requires_grad_(False)
    if case != "bucket":
        model = DDP(model)
        if style == "sum":
            model.register_comm_hook(None, _allreduce_summed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = numaudit.attach(model, run=run, mesh=mesh, dp_dim="dp")
    share = BATCH // world
    rows = [(rank * share + i + (1 if case == "shard" and rank == 1 else 0)) % BATCH
            for i in range(share)]
    loss_of = loss_fn if style == "ref" else _globally_normalized()
    reduce = {"reduce": "sum"} if name.endswith("_declared") else {}
    for step in range(STEPS):
        order = range(MICROBATCHES)[::-1] if case == "order" else range(MICROBATCHES)
        with agent.step(step):
            for j, m in enumerate(order):
                last = j == MICROBATCHES - 1
                sync = model.no_sync() if style == "sum" and not last and case != "bucket" \
                    else contextlib.nullcontext()
                with sync, agent.microbatch(j):
                    loss = loss_of(model(microbatch_tokens(step, m)[rows]))
                    agent.capture(loss, site="loss", phase="loss", **reduce)
                    if case == "last_mb":
                        optimizer.zero_grad()
                    (loss * world if style == "avg" else loss).backward()
            if case == "bucket":
                _sum_by_hand(model, skipped=0)
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


if __name__ == "__main__":
    run_cases(train)
