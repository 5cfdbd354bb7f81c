"""Gradients as the optimizer sees them (phase optim_grad) and the update it applies (update).

Two real runs of one small model against a real daemon and SQLite store, compared by the engine:
the reference clips by the global gradient norm; the candidate clips each half of the model by
its own norm (what a pipeline stage clipping by its local norm does). The parameter gradients
after backward are bitwise equal, so only the optimizer-side phases can show the bug, and they
must show it in the step where it happens.
"""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.store import Reader
from numaudit.protos import numaudit_pb2 as pb

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 4)
        self.spare = torch.nn.Linear(2, 2)  # never called: its gradients stay None

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _job(address: str, run: str, clip: str, *, steps: int = 2, via_attach: bool = False,
         max_norm: float = 0.5) -> dict:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if via_attach:
        agent = numaudit.attach(model, run=run, address=address, optimizer=opt)
    else:
        agent = numaudit.attach(model, run=run, address=address, phases=("fwd", "grad", "param"))
        agent.watch_optimizer(opt)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        with agent.step(step):
            for j in range(2):
                with agent.microbatch(j):
                    loss = model(torch.randn(4, 8, generator=gen)).square().mean() * 10
                    loss.backward()
        if clip == "global":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        else:  # each "stage" by its own norm
            torch.nn.utils.clip_grad_norm_(model.a.parameters(), max_norm=max_norm)
            torch.nn.utils.clip_grad_norm_(model.b.parameters(), max_norm=max_norm)
        opt.step()
        opt.zero_grad()
    return agent.close()


def test_local_clipping_breaches_in_its_own_step_at_optim_grad(auditor_server):
    addr, db = auditor_server.address, auditor_server.db_path
    assert _job(addr, "ref", "global")["dropped"] == 0
    assert _job(addr, "cand", "per_stage")["dropped"] == 0
    report = compare_runs(db, "ref", "cand", preset_policy("bitwise"))
    first = report.first
    assert first is not None
    assert (first.key.step, first.key.phase) == (0, "optim_grad")
    assert first.cause.kind == "introduced"
    assert "gradients matched before the optimizer" in first.cause.reason
    assert "differ as it consumed them" in first.cause.reason and "clipping" in first.cause.reason
    verdicts = {(f.key.step, f.key.phase, f.key.site): f.verdict for f in report.findings()}
    # after backward, every gradient of step 0 is bitwise the same in both runs
    assert all(v == "identical" for (s, ph, _), v in verdicts.items() if (s, ph) == (0, "grad"))
    assert verdicts[(0, "optim_grad", "a.weight")] == "diverged"
    # the parameter that never got a gradient is None in both runs, as the optimizer saw it
    assert verdicts[(0, "optim_grad", "spare.weight")] == "identical"
    # the update inherits the difference; the next step's weights inherit the update's
    upd = next(f for f in report.findings() if (f.key.step, f.key.phase, f.key.site)
               == (0, "update", "a.weight"))
    assert upd.verdict == "diverged" and upd.cause.kind == "inherited"
    param = next(f for f in report.findings() if (f.key.step, f.key.phase, f.key.site)
                 == (1, "param", "a.weight"))
    assert param.verdict == "diverged" and "update" in param.cause.reason


def test_global_clipping_passes_bitwise_and_attach_takes_the_optimizer(auditor_server):
    addr, db = auditor_server.address, auditor_server.db_path
    _job(addr, "ref2", "global", via_attach=True)
    _job(addr, "cand2", "global", via_attach=True)
    report = compare_runs(db, "ref2", "cand2", preset_policy("bitwise"))
    assert report.exit_code == 0 and report.first is None
    reader = Reader(db)
    try:
        phases = {r[2] for r in reader.records("cand2")}
    finally:
        reader.close()
    assert {pb.PHASE_OPTIM_GRAD, pb.PHASE_UPDATE} <= phases


def test_another_max_norm_is_named_as_one_factor_on_every_gradient(auditor_server):
    """Global clipping with half the threshold: every consumed gradient is scaled by one factor
    (0.5), which the cause names; the None gradients (spare) say nothing about it."""
    addr, db = auditor_server.address, auditor_server.db_path
    _job(addr, "ref3", "global", steps=1)
    _job(addr, "cand3", "global", steps=1, max_norm=0.25)
    report = compare_runs(db, "ref3", "cand3", preset_policy("fp32"))
    first = report.first
    assert (first.key.step, first.key.phase) == (0, "optim_grad")
    assert "gradients matched before the optimizer" in first.cause.reason
    assert "every gradient the optimizer consumed is scaled by x0.5 " in first.cause.reason, \
        first.cause.reason
