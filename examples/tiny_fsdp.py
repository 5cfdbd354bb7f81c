"""A small model trained with FSDP2 under torchrun, audited by numaudit.

    torchrun --nproc-per-node 2 examples/tiny_fsdp.py --name tiny

One step of a few microbatches; `head.unused` is a parameter deliberately left out of the graph,
so the auditor must hold an explicit "grad is None" record for it. The run name is taken as
`--name` (torchrun claims `--run`) or from NUMAUDIT_RUN.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # repo root: `examples.*`

import numaudit  # noqa: E402
from examples.teardown import exit_rank  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.proj(self.norm(x)))


class Head(torch.nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.out = torch.nn.Linear(dim, classes)
        self.unused = torch.nn.Parameter(torch.zeros(3))  # never used: its grad stays None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


class TinyNet(torch.nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, dim)
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = Head(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default=os.environ.get("NUMAUDIT_RUN", "tiny"))
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--payload", default="", help="payload globs, e.g. 'fwd:head'")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(args.seed)
    model = TinyNet()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    agent = numaudit.attach(model, run=args.name, mesh=mesh, dp_dim="dp", dtype="float32",
                          seed=args.seed, payload=tuple(filter(None, args.payload.split(","))))
    gen = torch.Generator().manual_seed(args.seed + 1000 * mesh.get_local_rank("dp"))
    for step in range(args.steps):
        with agent.step(step):
            for j in range(args.microbatches):
                with agent.microbatch(j):
                    x = torch.randn(args.microbatch_size, 8, generator=gen)
                    y = torch.randint(0, 5, (args.microbatch_size,), generator=gen)
                    agent.capture(x, site="x", phase="input")
                    loss = torch.nn.functional.cross_entropy(model(x), y) / args.microbatches
                    agent.capture(loss, site="loss", phase="loss")
                    loss.backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank()  # skips a gloo teardown abort (examples/teardown.py)
