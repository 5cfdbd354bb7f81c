"""A mixture of experts written the ordinary way, with nothing declared to the agent: each expert
is its own module, called on the tokens routed to it (not called when none are), and the agent's
module hooks capture it like any other module (issue 29). Under data parallelism each rank routes
its own tokens, so an expert's rows differ per rank, and some ranks route none to some experts.

    python tests/e2e/moe_glue_job.py ref:ref
    torchrun --standalone --nproc-per-node 2 tests/e2e/moe_glue_job.py ddp:ddp ddp_bug:ddp_bug

Cases: ``ref`` one process on the whole batch; ``ddp`` DDP on 2 ranks, each on its consecutive
half; ``ddp_bug`` as ddp, but expert 2 adds 1e-3 to its output on rank 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402

DIM, EXPERTS, TOKENS, STEPS = 8, 6, 12, 2
BUG_EXPERT = 2


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, 2 * DIM)
        self.w2 = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class MoE(torch.nn.Module):
    """Top-1 routing; expert e runs on its tokens in token order, skipped when it has none."""

    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList([Expert() for _ in range(EXPERTS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, DIM)
        probs = self.router(flat).softmax(-1)
        weight, choice = probs.max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = torch.nonzero(choice == e).flatten()
            if len(idx):
                out = out.index_add(0, idx, expert(flat[idx]) * weight[idx, None])
        return (flat + out).reshape(x.shape)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.inp(x)))


def train(case: str, run: str) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Model()
    if case.startswith("ddp_bug"):
        model.moe.experts[BUG_EXPERT].register_forward_hook(
            lambda m, i, out: out + 1e-3 if rank == 1 else out)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if world > 1:
        # experts that get no tokens on a rank take no part in its backward
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    # "_nopay": no payloads at all, so undeclared ragged experts are judged by their
    # fingerprints, moved to their places by the auditor (fingerprint version 3)
    options = dict(payload_max_bytes=0) if case.endswith("_nopay") else {}
    agent = numaudit.attach(model, run=run, **options)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        x = torch.randn(TOKENS, DIM, generator=g).chunk(world)[rank]
        with agent.step(step), agent.microbatch(0):
            loss = model(x).pow(2).mean()
            agent.capture(loss, site="loss", phase="loss")
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


if __name__ == "__main__":
    run_cases(train)
