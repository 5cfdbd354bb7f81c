"""Runs of a reference that is nondeterministic as a GPU's attention backward is (issue 39).

    torchrun --standalone --nproc-per-node 2 tests/e2e/noise_job.py ref:ref ref:ref2 ...

Every case is DDP over 2 ranks (gloo) of a small two-block transformer in float32, 2 steps of
SGD on the same 8 sequences (4 a rank). Each block's attention passes its queries through
`Nondeterministic`, whose backward moves a random 1/64 of the query-gradient elements one
bfloat16 ulp (up or down), drawn from a generator seeded by the OS: what a GPU's atomic
accumulation does to an attention backward, so two runs of one case are never bitwise equal
there, and everything backward reaches from there (and all of the next step) differs too. In
the reference configuration only rank 0's attention is nondeterministic: rank 1's pieces of
the attention's activation gradients are bitwise equal from run to run.

Cases:
- ``ref``: the reference configuration (run it several times: reruns and clean candidates);
- ``scaled``: as ref, but ``layers.1.mlp.w1.weight``'s gradient is scaled by 1.01 in step 0
  (within the bf16 preset's tolerance; its reruns are bitwise equal, being computed before
  backward reaches an attention);
- ``x125``: as ref, but ``layers.1.attn``'s query gradient is scaled by 1.25 in step 0 (a noisy
  site);
- ``rank1``: as ref, but rank 1's attention is nondeterministic too: its pieces differ by as
  much as rank 0's do, which a band pooled over ranks would excuse;
- ``acc2``: as ref, but each rank accumulates two microbatches of 2 (the loss divided by 2,
  no_sync on the first) and sends no payloads: another configuration, whose activations the
  auditor regroups into the reference's microbatch and measures from per-sample digests;
- ``acc2_rank1``: as acc2, with rank 1's attention nondeterministic too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402
from tests.e2e.helpers import run_cases  # noqa: E402

VOCAB, DIM, HIDDEN, SEQ, BATCH, STEPS = 32, 32, 64, 8, 8, 2
LOSS_SCALE = 1024.0
"""Backward runs on the loss times this (a power of two, as a loss scaler's), so gradients are
large enough for ulp-level noise to exceed the fp32 preset's atol (1e-5)."""
NOISE_SHARE = 1 / 64
SCALED_PARAM = "layers.1.mlp.w1.weight"
STATE: dict = {"noisy": False, "scale": {}, "gen": None}


class Nondeterministic(torch.autograd.Function):
    """The identity forward; backward moves a random NOISE_SHARE of the gradient's elements one
    bfloat16 ulp of their magnitude, up or down (and multiplies by a planted scale, if any)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, site: str) -> torch.Tensor:
        ctx.site = site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if STATE["noisy"]:
            gen = STATE["gen"]
            hit = torch.rand(g.shape, generator=gen) < NOISE_SHARE
            sign = torch.where(torch.rand(g.shape, generator=gen) < 0.5, -1.0, 1.0)
            _, exp = torch.frexp(g)
            ulp = torch.ldexp(torch.ones_like(g), (exp - 8).to(torch.int32))
            g = torch.where(hit & (g != 0), g + sign * ulp, g)
        return g * STATE["scale"].get(ctx.site, 1.0), None


class Attention(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.q = torch.nn.Linear(DIM, DIM, bias=False)
        self.k = torch.nn.Linear(DIM, DIM, bias=False)
        self.v = torch.nn.Linear(DIM, DIM, bias=False)
        self.o = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = Nondeterministic.apply(self.q(x), self.name)
        att = (q @ self.k(x).transpose(1, 2)) / DIM ** 0.5
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return self.o(att @ self.v(x))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


class Block(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.attn = Attention(name)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(f"layers.{i}.attn") for i in range(2)])
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def step_tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def train(case: str, run: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    STATE["gen"] = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    STATE["noisy"] = rank == 0 or case.endswith("rank1")
    model = DDP(Model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 / LOSS_SCALE)
    acc = 2 if case.startswith("acc2") else 1
    agent = numaudit.attach(model, run=run, **({"payload_max_bytes": 0} if acc > 1 else {}))
    for step in range(STEPS):
        STATE["scale"] = {"layers.1.attn": 1.25} if case == "x125" and step == 0 else {}
        share = step_tokens(step).chunk(world)[rank]
        with agent.step(step):
            for j, rows in enumerate(share.chunk(acc)):
                sync = model.no_sync() if j < acc - 1 else contextlib.nullcontext()
                with sync, agent.microbatch(j):
                    logits = model(rows[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                             rows[:, 1:].reshape(-1))
                    agent.capture(loss, site="loss", phase="loss")
                    (loss * LOSS_SCALE / acc).backward()
            if case == "scaled" and step == 0:
                model.module.get_parameter(SCALED_PARAM).grad.mul_(1.01)
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


if __name__ == "__main__":
    run_cases(train)
