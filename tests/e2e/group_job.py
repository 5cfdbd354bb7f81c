"""Runs whose steps group the same samples into other microbatches (issue 29), as users write
gradient accumulation: the README's loop, the loss captured as each microbatch's mean and
divided by the number of microbatches before backward.

    python tests/e2e/group_job.py acc1:acc1 acc4:acc4 acc4_bug:acc4_bug
    torchrun --standalone --nproc-per-node 2 tests/e2e/group_job.py ddp_local:ddp_local ...

Every step feeds the same 16 sequences. Cases:
- ``acc1``: one process, one microbatch of 16 (the reference);
- ``acc4``: one process, 4 microbatches of 4;
- ``acc4_bug``: as acc4, but ``layers.1`` adds 1e-3 to its output in microbatch 2 of step 0;
- ``ddp_local`` (2 ranks): DDP, each rank takes its consecutive half of the 16 and splits it
  into 2 local microbatches of 4 (no_sync on the first);
- ``ddp_local_bug`` (2 ranks): as ddp_local, but rank 1's ``layers.0`` adds 1e-3 to its output
  in its local microbatch 1 of step 0;
- ``ddp_rr`` (2 ranks): the 16 dealt round-robin (rank r takes sequences r, r+2, ...), as
  DistributedSampler does, in 2 local microbatches of 4;
- ``ddp_rr1`` (2 ranks): dealt round-robin, one local microbatch of 8 (grouped as acc1 is);
- ``shuffled``: one process, one microbatch of 16, the sequences in another order (reversed);
- ``ddp_rr_bug`` (2 ranks): as ddp_rr, but rank 1's ``layers.1`` adds 1e-3 to its output in
  its local microbatch 0 of step 0;
- ``acc4_declared``: as acc4, with the loss's division by 4 declared (``grad_scale=1/4``, as
  docs/parallelisms.md "What you declare" says);
- ``acc4_scaled``: as acc4, but ``layers.1`` scales its output by 1.01 in microbatch 2 of step 0;
- ``acc4_old``: as acc4, by an agent that sends no per-sample digests (an earlier build's).

A case named ``wide_CASE`` runs CASE with a model wide enough that every activation of a
microbatch of 2 is over the 16 KiB of automatic payloads (8 sequences of 32 tokens, width 128,
hidden 256, vocabulary 96): 4 microbatches of 2 against one of 8, or DDP-2 ranks with local
microbatches of 2, compare without payloads.
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

NARROW = dict(vocab=16, dim=8, hidden=16, seq=4, samples=16)
WIDE = dict(vocab=96, dim=128, hidden=256, seq=32, samples=8)
STEPS = 2
VOCAB, DIM, HIDDEN, SEQ, SAMPLES = NARROW.values()


def size(case: str) -> str:
    """The case without its ``wide_`` prefix, with the model's sizes set for it."""
    global VOCAB, DIM, HIDDEN, SEQ, SAMPLES
    wide = case.startswith("wide_")
    VOCAB, DIM, HIDDEN, SEQ, SAMPLES = (WIDE if wide else NARROW).values()
    return case.removeprefix("wide_")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.gelu(self.w1(self.norm(x))))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def step_tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=g)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def perturb(module: torch.nn.Module, when, scale: float | None = None) -> None:
    """A planted bug: the module adds 1e-3 to its output (or scales it by ``scale``) whenever
    ``when()`` holds."""
    module.register_forward_hook(lambda m, i, out: (out * scale if scale else out + 1e-3)
                                 if when() else out)


def train(case: str, run: str) -> None:
    case = size(case)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = Model()
    state = {"step": -1, "mb": -1}
    if case == "acc4_bug":
        perturb(model.layers[1], lambda: state["step"] == 0 and state["mb"] == 2)
    if case == "ddp_local_bug":
        perturb(model.layers[0], lambda: state["step"] == 0 and state["mb"] == 1 and rank == 1)
    if case == "ddp_rr_bug":
        perturb(model.layers[1], lambda: state["step"] == 0 and state["mb"] == 0 and rank == 1)
    if case == "acc4_scaled":
        perturb(model.layers[1], lambda: state["step"] == 0 and state["mb"] == 2, scale=1.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = world > 1
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    options = {"acc4_declared": {"grad_scale": 0.25}, "acc4_old": {"sample_digests": False}}
    agent = numaudit.attach(model, run=run, **options.get(case, {}))
    n_local = {"acc1": 1, "ddp_rr1": 1, "shuffled": 1}.get(case, 4 if world == 1 else 2)
    for step in range(STEPS):
        tokens = step_tokens(step)
        if case == "shuffled":
            tokens = tokens.flip(0)
        share = tokens[rank::world] if case.startswith("ddp_rr") else \
            tokens.chunk(world)[rank]
        state["step"] = step
        with agent.step(step):
            for j, rows in enumerate(share.chunk(n_local)):
                state["mb"] = j
                last = j == n_local - 1
                sync = model.no_sync() if ddp and not last else contextlib.nullcontext()
                with sync, agent.microbatch(j):
                    loss = loss_fn(model(rows[:, :-1]), rows[:, 1:])
                    agent.capture(loss, site="loss", phase="loss")
                    (loss / n_local).backward()
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


if __name__ == "__main__":
    run_cases(train)
