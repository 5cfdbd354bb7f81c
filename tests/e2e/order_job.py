"""Execution order as executed (issue 37): a small transformer of mixed widths, trained as the
README says, whose LayerNorms' outputs (32 wide) travel as payloads and whose projections' (96
and 128 wide) are sketch-only, interleaved, so that the store holds each microbatch's records in
another order than the hooks fired.

    python tests/e2e/order_job.py single:ref                          # the reference
    torchrun --standalone --nproc-per-node 2 tests/e2e/order_job.py ddp:ddp ddp_ln_bug:bug

Cases: ``single`` (one process, the whole batch), ``ddp`` (DDP over 2 ranks, each its half of
every microbatch), ``ddp_ln_bug`` (as ddp, but rank 1's first LayerNorm, ``blocks.0.ln1``, is
built with eps 0.5: a forward bug on one rank). 1 step of 2 microbatches of 8 sequences of 16
tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402

DIM, QKV, HIDDEN, VOCAB = 32, 96, 128, 16
BLOCKS, MICROBATCHES, BATCH, SEQ = 2, 2, 8, 16
"""A LayerNorm's output of one microbatch is 8 x 16 x 32 float32 = 16 KiB, at most
payload_max_bytes (and 8 KiB per rank); a projection's is 48 or 64 KiB (24, 32 per rank)."""


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, QKV)
        self.proj = torch.nn.Linear(QKV, DIM)
        self.ln2 = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(torch.tanh(self.qkv(self.ln1(x))))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(BLOCKS)])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def train(case: str, run: str) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Model()
    if case == "ddp_ln_bug" and rank == 1:
        model.blocks[0].ln1.eps = 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    agent = numaudit.attach(model, run=run)
    g = torch.Generator().manual_seed(7)
    with agent.step(0):
        for mb in range(MICROBATCHES):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).chunk(world)[rank]
            with agent.microbatch(mb):
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                         tokens[:, 1:].reshape(-1))
                agent.capture(loss, site="loss", phase="loss")
                (loss / MICROBATCHES).backward()
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


if __name__ == "__main__":
    run_cases(train)
