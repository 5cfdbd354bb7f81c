r"""Several runs of examples/tiny_moe.py in one torchrun job, one after another.

    torchrun --standalone --nproc-per-node 2 tests/e2e/moe_job.py \
        "ddp --backward" "ep --ep --backward"

Each argument is one run: its run name, then tiny_moe.py's own options. Every run is tiny_moe's
`main()` with those options, as `torchrun ... examples/tiny_moe.py --name NAME OPTIONS...` runs it
(its own model, agent and run name), in this job's one process group. Most of a 2-rank CPU job is
starting it (three interpreters importing torch), so the runs of tests/e2e/test_moe_ragged.py
cost one start instead of one each.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples import tiny_moe  # noqa: E402
from examples.teardown import exit_rank  # noqa: E402


def main(runs: list[str]) -> None:
    dist.init_process_group("gloo")
    try:
        for run in runs:
            name, *options = shlex.split(run)
            tiny_moe.main(["--name", name, *options])
            dist.barrier()  # every rank is done with this run before the next one starts
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_rank()  # skips a gloo teardown abort (examples/teardown.py)
