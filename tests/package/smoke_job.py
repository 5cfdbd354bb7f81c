"""One rank of the installed-wheel smoke test: a user's script, `import numaudit` and nothing else
of ours (it runs from a directory outside the checkout, with numaudit installed from its wheel).

    torchrun --nproc-per-node 2 smoke_job.py

DDP over gloo, two steps of two microbatches; NUMAUDIT_ADDR and NUMAUDIT_RUN come from the
environment, as a user's launcher sets them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import numaudit


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = numaudit.attach(ddp)
    data = torch.Generator().manual_seed(1)
    for step in range(2):
        with agent.step(step):
            for mb in range(2):
                x = torch.randn(4 * world, 8, generator=data)[4 * rank:4 * (rank + 1)]
                with agent.microbatch(mb):
                    loss = ddp(x).pow(2).mean() / 2
                    agent.capture(loss, site="loss", phase="loss")
                    loss.backward()
        opt.step()
        opt.zero_grad()
    agent.close()
    dist.destroy_process_group()
    print(f"rank {rank}: done as {os.environ.get('NUMAUDIT_RUN')}")


if __name__ == "__main__":
    main()
