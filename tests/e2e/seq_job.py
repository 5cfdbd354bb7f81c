"""A recurrent and attention model as ordinary code writes it, for tests/e2e/test_batch_dims.py.

    python tests/e2e/seq_job.py single:ref                     # the reference, one process
    torchrun --standalone --nproc-per-node 2 tests/e2e/seq_job.py ddp:ddp fsdp:fsdp ...

Each argument is CASE:RUN; the cases run one after another in one process group. An embedding,
a 2-layer LSTM (its hidden states hold the batch on dim 1 whatever `batch_first` says), a
MultiheadAttention, a feed-forward module of the model's own, and a head tied to the embedding;
2 steps of 2 microbatches of 4 sequences of 5 tokens, each rank a share of every microbatch.
Cases with `_seq` build the sequence-first variant (`batch_first=False`, (seq, batch) tensors
throughout) and attach with `batch_dim=1`, but for `_seq_undeclared`.
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

VOCAB, DIM, BATCH, SEQ, STEPS, MICROBATCHES = 20, 8, 4, 5, 2, 2


class Net(torch.nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.lstm = torch.nn.LSTM(DIM, DIM, num_layers=2, batch_first=batch_first)
        self.attn = torch.nn.MultiheadAttention(DIM, 2, batch_first=batch_first)
        self.mix = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh())
        self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(x))
        a, _ = self.attn(h, h, h)
        return self.out(self.mix(a + h))


def run(case: str, name: str) -> None:
    seq_first = "_seq" in case
    model = Net(batch_first=not seq_first)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        if case.startswith("fsdp"):
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
    # sequence-first code says where its batch is (`_undeclared`: it does not)
    declared = seq_first and not case.endswith("_undeclared")
    agent = numaudit.attach(model, run=name, mesh=mesh, dp_dim="dp", batch_dim=1 if declared else 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    share = BATCH // world
    for step in range(STEPS):
        with agent.step(step):
            for j in range(MICROBATCHES):
                g = torch.Generator().manual_seed(100 * step + j)
                x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)[rank * share:][:share]
                if seq_first:
                    x = x.t()
                with agent.microbatch(j):
                    out = model(x)
                    loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB),
                                                             x.reshape(-1))
                    agent.capture(loss, site="loss", phase="loss")
                    loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    agent.close()


def main() -> None:
    run_cases(run)


if __name__ == "__main__":
    main()
    exit_rank()
