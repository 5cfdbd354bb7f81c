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
         max_norm: float = 0.5, watch: bool = True, inside: bool = False) -> dict:
    """Two microbatches a step, then clipping, `opt.step()` and `opt.zero_grad()` after the
    step block (`inside`: at the end of the block, as most training loops have them)."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # no watched parameter
    if via_attach:
        agent = numaudit.attach(model, run=run, address=address, optimizer=opt)
    else:
        agent = numaudit.attach(model, run=run, address=address, phases=("fwd", "grad", "param"))
        if watch:
            agent.watch_optimizer(opt)
    gen = torch.Generator().manual_seed(1)

    def update() -> None:
        if clip == "none":
            pass
        elif clip == "global":
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        else:  # each "stage" by its own norm
            torch.nn.utils.clip_grad_norm_(model.a.parameters(), max_norm=max_norm)
            torch.nn.utils.clip_grad_norm_(model.b.parameters(), max_norm=max_norm)
        opt.step()
        opt.zero_grad()

    for step in range(steps):
        with agent.step(step):
            for j in range(2):
                with agent.microbatch(j):
                    loss = model(torch.randn(4, 8, generator=gen)).square().mean() * 10
                    loss.backward()
                    other.step()  # steps nothing watched: takes no gradients early
            if inside:
                update()
        if not inside:
            update()
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


@pytest.mark.parametrize("watch", [True, False], ids=["optimizer_watched", "optimizer_unknown"])
def test_an_optimizer_stepping_inside_the_step_block_is_seen_before_it_clears_the_gradients(
        auditor_server, watch):
    """`opt.step(); opt.zero_grad()` at the end of the step block, as most loops have it: the
    parameter gradients and values are captured just before the optimizer steps (whether or not
    the agent was given it), so they equal those of the same run stepping after the block, not
    None in both runs at the block's exit (which compared "identical" whatever the gradients)."""
    addr, db = auditor_server.address, auditor_server.db_path
    ref, cand = f"after-{watch}", f"inside-{watch}"
    _job(addr, ref, "none", watch=watch)  # (clipping inside the block would come before them)
    _job(addr, cand, "none", watch=watch, inside=True)
    reader = Reader(db)
    try:
        grads = {(r[0], r[3]): r for r in reader.records(cand) if r[2] == pb.PHASE_GRAD}
    finally:
        reader.close()
    assert grads  # both steps' gradients, of a.weight ... spare.bias
    report = compare_runs(db, ref, cand, preset_policy("bitwise"))
    assert report.exit_code == 0 and report.first is None
    found = {(f.key.step, f.key.phase, f.key.site): f for f in report.findings()}
    for step in (0, 1):
        for site in ("a.weight", "b.bias"):
            f = found[(step, "grad", site)]
            assert f.verdict == "identical" and f.dtype == {"ref": "float32", "cand": "float32"}
            assert found[(step, "param", site)].verdict == "identical"
    assert found[(0, "grad", "spare.weight")].dtype == {"ref": None, "cand": None}  # never used


def test_gradients_captured_by_hand_inside_the_block_are_not_captured_again_at_its_exit(
        auditor_server):
    """A hand-written update (no torch.optim optimizer to hook) that clears the gradients inside
    the step block, after `agent.capture_gradients()`: the gradients are those of backward, each
    captured once (no conflict with a second, None capture at the block's exit)."""
    addr, db = auditor_server.address, auditor_server.db_path
    _job(addr, "by-hand-ref", "none", watch=False)
    model = Net()
    agent = numaudit.attach(model, run="by-hand", address=addr, phases=("fwd", "grad", "param"))
    gen = torch.Generator().manual_seed(1)
    for step in range(2):
        with agent.step(step):
            for j in range(2):
                with agent.microbatch(j):
                    model(torch.randn(4, 8, generator=gen)).square().mean().mul(10).backward()
            agent.capture_gradients()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
    summary = agent.close()
    assert summary["conflicts"] == 0 and summary["dropped"] == 0, summary
    report = compare_runs(db, "by-hand-ref", "by-hand", preset_policy("bitwise"))
    found = {(f.key.step, f.key.phase, f.key.site): f for f in report.findings()}
    assert found[(0, "grad", "a.weight")].verdict == "identical"
    assert found[(0, "grad", "a.weight")].dtype == {"ref": "float32", "cand": "float32"}
    assert not [w for w in report.warnings if "None in both runs" in w]
