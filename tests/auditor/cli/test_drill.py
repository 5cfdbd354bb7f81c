"""`auditor drill` end to end in one process: two runs that part ways in a module, the plan it
writes, both runs again with NUMAUDIT_PLAN, and the operation the comparison names."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import numaudit
from numaudit.auditor.cli import main
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.wire.plan import read_plan

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8, eps=eps)  # the bug: another epsilon
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


def _train(address: str, name: str, eps: float, steps: int = 3) -> None:
    model = Net(eps)
    agent = numaudit.attach(model, run=name, address=address, phases=("fwd", "bwd", "grad"))
    for step in range(steps):
        with agent.step(step), agent.microbatch(0):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                  ).square().mean().backward()
    agent.close()


def test_drill_writes_the_plan_and_the_rerun_names_the_operation(auditor_server, tmp_path,
                                                                  monkeypatch):
    db = str(auditor_server.db_path)
    _train(auditor_server.address, "ref", 1e-5)
    _train(auditor_server.address, "cand", 1e-1)
    plan_file = tmp_path / "plan.toml"
    res = CliRunner().invoke(main, ["drill", "ref", "cand", "--db", db, "--preset", "fp32",
                                    "-o", str(plan_file)])
    assert res.exit_code == 0, res.output
    plan = read_plan(plan_file)
    assert plan.ops == ("norm",) and plan.steps == (0,) and plan.payload == ("fwd:norm",)
    assert plan.runs == {"ref": "ref", "cand": "cand"} and "introduced" in plan.reason
    printed = CliRunner().invoke(main, ["drill", "ref", "cand", "--db", db, "--preset", "fp32"])
    assert printed.exit_code == 0 and printed.output == plan_file.read_text()

    monkeypatch.setenv("NUMAUDIT_PLAN", str(plan_file))
    _train(auditor_server.address, "ref.drill", 1e-5)
    _train(auditor_server.address, "cand.drill", 1e-1)
    report = compare_runs(db, "ref.drill", "cand.drill", preset_policy("fp32"))
    assert {f.step for f in report.ops.calls} == {0}  # the plan's step only
    fwd = next(f for f in report.ops.calls if f.phase == "fwd")
    assert fwd.kind == "introduced" and fwd.op.startswith("aten.native_layer_norm"), fwd
    assert "float argument 0 differs (1e-05 in ref.drill, 0.1 in cand.drill)" in fwd.reason
    assert report.drill is None  # nothing left to drill: the operation is named
    again = CliRunner().invoke(main, ["drill", "ref.drill", "cand.drill", "--db", db,
                                      "--preset", "fp32"])
    assert again.exit_code == 1 and "already captured" in again.output


def test_nothing_to_drill_exits_1_saying_why(auditor_server):
    db = str(auditor_server.db_path)
    _train(auditor_server.address, "a", 1e-5, steps=1)
    _train(auditor_server.address, "b", 1e-5, steps=1)
    res = CliRunner().invoke(main, ["drill", "a", "b", "--db", db, "--preset", "fp32"])
    assert res.exit_code == 1 and "do not diverge" in res.output
    res = CliRunner().invoke(main, ["drill", "a", "nope", "--db", db])
    assert res.exit_code == 2
