"""A training process that ends without calling `agent.close()`: by an exception out of
`agent.step`, by SIGTERM (torchrun stopping the job), or by simply returning.

    python -m tests.faults.exit_job --how raise|sigterm|exit --records N

Address, run, spool and flush timeout come from NUMAUDIT_* variables, as under torchrun. Prints
"ready" once its records are captured (the SIGTERM test waits for it), then ends as told.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import agents


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--how", choices=("raise", "sigterm", "exit"), required=True)
    p.add_argument("--records", type=int, default=30)
    args = p.parse_args()
    agent = agents.attach(None, batch_records=8)
    with agent.step(0):
        with agent.microbatch(0):
            for i in range(args.records):
                agent.capture(torch.full((4,), float(i)), site=f"t{i}", phase="input")
        if args.how == "raise":
            raise RuntimeError("training failed")  # out of agent.step, then out of the script
    print("ready", flush=True)
    if args.how == "sigterm":
        time.sleep(120)  # killed long before


if __name__ == "__main__":
    sys.exit(main())
