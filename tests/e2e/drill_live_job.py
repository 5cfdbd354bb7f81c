"""One run for the live drill-down test (issue 43): `auditor watch --escalate` flags a module
while this run is still going, and the agent captures that module's operations at the step the
directive names.

    python tests/e2e/drill_live_job.py --name cand --scale 0.5

A small model whose `mlp` scales its hidden activations by --scale (the candidate's fault, from
step 0). The weights are not updated, so every step computes what step 0 did and a later step's
operations compare as step 0's would. Between step 0 and step 1 the run waits (at most
--wait seconds) until a directive of the auditor has arrived, as a slow step would: on a loaded
machine the watch's worker process takes seconds to start, and the test asserts step 1.
Environment: NUMAUDIT_ADDR.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)
        self.scale = scale

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)) * self.scale)


class Net(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.mlp = MLP(scale)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.mlp(self.inp(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--wait", type=float, default=60.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = Net(args.scale)
    agent = numaudit.attach(model, run=args.name, phases=("fwd", "bwd", "grad"))
    for step in range(args.steps):
        with agent.step(step):
            for mb in range(2):
                with agent.microbatch(mb):
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(mb))
                    model(x).square().mean().backward()
        model.zero_grad()
        if step == 0:
            deadline = time.monotonic() + args.wait
            while not agent.ops.inbox and time.monotonic() < deadline:
                time.sleep(0.05)
    agent.close()
    print(f"{args.name}: applied {agent.ops.applied}, late {agent.ops.late}", flush=True)


if __name__ == "__main__":
    main()
