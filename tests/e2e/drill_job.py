"""Op-level captures of a tensor-parallel block (issue 43): one job, several runs.

    torchrun --standalone --nproc-per-node 2 tests/e2e/drill_job.py tp:tp_ref tp_noreduce:tp_cand

(In the test suite these cases run inside the parallelism matrix's job, tests/e2e/parallel_job.py,
as `drill_tp` and `drill_tp_noreduce`.)
A Megatron-style MLP split over the job's 2 ranks (mesh dim "tp"): w1 column-sharded, w2
row-sharded, then the all-reduce that sums the ranks' partial outputs
(`torch.distributed.nn.functional.all_reduce`, which dispatches `c10d.allreduce_`). Case
`tp_noreduce` leaves the all-reduce out: each rank returns its partial sum. Every case captures
the operations of `block` (NUMAUDIT_OPS), so the report can name the collective that is absent.
Environment: NUMAUDIT_ADDR (the shared daemon).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from examples.teardown import exit_rank  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402

DIM, HIDDEN, BATCH, MICROBATCHES = 8, 16, 4, 2


class TPBlock(torch.nn.Module):
    """Column-sharded w1, row-sharded w2, and the all-reduce of the partial sums."""

    def __init__(self, rank: int, world: int, reduce: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        full1, full2 = torch.nn.Linear(DIM, HIDDEN), torch.nn.Linear(HIDDEN, DIM, bias=False)
        cols = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        self.w1 = torch.nn.Linear(DIM, HIDDEN // world)
        self.w2 = torch.nn.Linear(HIDDEN // world, DIM, bias=False)
        with torch.no_grad():
            self.w1.weight.copy_(full1.weight[cols])
            self.w1.bias.copy_(full1.bias[cols])
            self.w2.weight.copy_(full2.weight[:, cols])
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w2(torch.relu(self.w1(x)))
        if self.reduce:
            from torch.distributed.nn.functional import all_reduce

            y = all_reduce(y)
        return y


class Model(torch.nn.Module):
    def __init__(self, rank: int, world: int, reduce: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = torch.nn.Linear(DIM, DIM)
        self.block = TPBlock(rank, world, reduce)
        torch.manual_seed(2)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.block(self.inp(x)))


def run_one(case: str, run: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = Model(rank, world, reduce=case != "tp_noreduce")
    agent = numaudit.attach(model, run=run, mesh=mesh, ops=("block",),
                          phases=("fwd", "bwd", "grad"))
    for step in range(1):
        with agent.step(step):
            for mb in range(MICROBATCHES):
                with agent.microbatch(mb):
                    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(mb))
                    model(x).square().mean().backward()
    agent.close()


if __name__ == "__main__":
    run_cases(run_one)
    exit_rank()
