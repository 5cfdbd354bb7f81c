"""A training run and its resumption from a checkpoint, audited (tests/e2e/test_resume.py).

    python tests/e2e/resume_job.py full RUN CKPT             # steps 0-3, saves CKPT after step 1
    python tests/e2e/resume_job.py resume RUN CKPT [CASE]    # loads CKPT, trains steps 2-3

One process each, the daemon's address from NUMAUDIT_ADDR. A small model with dropout (so the
forward consumes the global RNG), Adam, the same batch for a step in every run. The agent watches
the model and the optimizer (phases fwd, grad, loss, input, update). `full` saves after step 1 a
DCP checkpoint of ``{"model", "optim", "rng"}`` (``get_state_dict``, the optimizer flattened as
torchtitan saves it; ``torch.get_rng_state()``) and captures that state dict under step 1
(`Agent.capture_state_dict`) as it saves. `resume` builds the model afresh, loads the checkpoint,
restores what its CASE says, captures the state it then holds under step 1, and trains steps 2-3
under their real step numbers. CASE:

- ``clean`` (default): model, optimizer and RNG restored: steps 2-3 equal the full run's.
- ``noopt``: the optimizer is not restored: a fresh Adam (which ``get_state_dict`` initializes
  with one zero-gradient step at lr 0: step count 1, moments zero). Step 2's forward, loss and
  gradients match, its update does not.
- ``norng``: the RNG is not restored: step 2's dropout draws another mask.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numaudit  # noqa: E402

FEATURES, HIDDEN, CLASSES, BATCH = 8, 16, 4, 8
STEPS, SAVED_AFTER = 4, 1
"""The full run trains steps 0..3 and saves after step 1; a resumed one trains steps 2..3."""
PHASES = ("fwd", "grad", "loss", "input", "update")
CASES = ("clean", "noopt", "norng")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(FEATURES, HIDDEN)
        self.drop = torch.nn.Dropout(0.5)
        self.out = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.drop(self.inp(x))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, FEATURES, generator=g),
            torch.randint(0, CLASSES, (BATCH,), generator=g))


def train(agent, model: Model, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, target = batch(step)
    with agent.step(step):
        with agent.microbatch(0):
            agent.capture(x, site="x", phase="input")
            loss = F.cross_entropy(model(x), target)
            agent.capture(loss, site="loss", phase="loss")
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def state_dict(model: Model, optimizer: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS)
    return {"model": msd, "optim": osd, "rng": torch.get_rng_state()}


def full(run: str, ckpt: Path) -> None:
    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    agent = numaudit.attach(model, run=run, optimizer=optimizer, phases=PHASES)
    for step in range(STEPS):
        train(agent, model, optimizer, step)
        if step == SAVED_AFTER:
            sd = state_dict(model, optimizer)
            dcp.save(sd, checkpoint_id=ckpt, no_dist=True)
            agent.capture_state_dict(sd, step=SAVED_AFTER)
    agent.close()


def resume(run: str, ckpt: Path, case: str) -> None:
    model = Model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    agent = numaudit.attach(model, run=run, optimizer=optimizer, phases=PHASES)
    sd = state_dict(model, optimizer)  # the placeholders DCP loads into, in place
    if case == "noopt":  # planted: the optimizer's state is not loaded
        del sd["optim"]
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    if "optim" in sd:
        set_state_dict(model, optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"], options=OPTIONS)
    else:
        set_model_state_dict(model, sd["model"], options=OPTIONS)
    if case != "norng":  # planted (norng): the RNG state is not restored
        torch.set_rng_state(sd["rng"])
    agent.capture_state_dict(state_dict(model, optimizer), step=SAVED_AFTER)
    for step in range(SAVED_AFTER + 1, STEPS):
        train(agent, model, optimizer, step)
    agent.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, run, ckpt, *rest = sys.argv[1:] + [""] * (3 - len(sys.argv[1:]))
    case = rest[0] if rest else "clean"
    if mode not in ("full", "resume") or not run or not ckpt or case not in CASES:
        sys.exit(f"usage: {sys.argv[0]} full|resume RUN CKPT [{'|'.join(CASES)}]")
    if mode == "full":
        full(run, Path(ckpt))
    else:
        resume(run, Path(ckpt), case)
