"""Op-level captures (agents/capture/ops.py) against a real auditor: what is captured, where, and
what the comparison makes of it (issue 43)."""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.agents.delivery.directives import Directive
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.store import Reader
from numaudit.wire.ops import SCALAR_INDEX, parse_op_site
from numaudit.wire.plan import Plan, format_plan

pytestmark = pytest.mark.timeout(120)


class MLP(torch.nn.Module):
    def __init__(self, scale: float, bf16: bool = False) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)
        self.scale, self.bf16 = scale, bf16

    def forward(self, x):
        h = torch.relu(self.w1(x)) * self.scale
        if self.bf16:  # a matmul computed in bfloat16
            return torch.nn.functional.linear(h.bfloat16(), self.w2.weight.bfloat16(),
                                              self.w2.bias.bfloat16()).float()
        return self.w2(h)


class Net(torch.nn.Module):
    def __init__(self, scale: float = 0.5, bf16: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 8)
        self.mlp = MLP(scale, bf16)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.mlp(self.inp(x)).reshape(x.shape[0], -1))


def _train(agent, model, steps=2, microbatches=2):
    for step in range(steps):
        with agent.step(step):
            for j in range(microbatches):
                with agent.microbatch(j):
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + j))
                    model(x).square().mean().backward()
    return agent.close()


def _run(server, name, model, **options):
    agent = numaudit.attach(model, run=name, address=server.address,
                          phases=("fwd", "bwd", "grad"), **options)
    return agent, _train(agent, model)


def _op_sites(db, run: str) -> dict[str, set]:
    reader = Reader(db)
    try:
        rows = reader.conn.execute(
            "SELECT s.name, r.step, r.phase, r.role, r.idx FROM records r JOIN sites s ON "
            "s.site_id = r.site_id JOIN runs u ON u.run_id = r.run_id WHERE u.name = ?",
            (run,)).fetchall()
    finally:
        reader.close()
    out: dict[str, set] = {}
    for name, step, phase, role, index in rows:
        if parse_op_site(name) is not None:
            out.setdefault(name, set()).add((step, phase, role, index))
    return out


def test_operations_of_matching_modules_are_captured_and_the_scale_is_named(auditor_server):
    """Every operation of `mlp` (forward inputs and outputs, backward gradients), none of the
    other modules'; the comparison names the multiplication whose float argument differs."""
    _, ref = _run(auditor_server, "ref", Net(0.5), ops=("mlp",))
    _, cand = _run(auditor_server, "cand", Net(0.25), ops=("mlp",))
    assert ref["errors"] == cand["errors"] == 0 and not ref["not_captured"]
    sites = _op_sites(auditor_server.db_path, "ref")
    modules = {parse_op_site(s)[0] for s in sites}
    assert modules == {"mlp"}
    names = [parse_op_site(s)[2] for s in sorted(sites, key=lambda s: parse_op_site(s)[1])]
    assert names.count("aten.addmm") == 2 and "aten.relu" in names
    mul = next(s for s in sites if parse_op_site(s)[2].startswith("aten.mul"))
    roles = {(phase, role, index) for _, phase, role, index in sites[mul]}
    # input 0, the float argument (0.5), output 0; backward: the gradient arriving, produced
    assert {(1, 2, 0), (1, 2, SCALAR_INDEX), (1, 1, 0), (2, 3, 0), (2, 4, 0)} <= roles
    report = compare_runs(auditor_server.db_path, "ref", "cand", preset_policy("fp32"))
    fwd = [f for f in report.ops.calls if f.phase == "fwd"]
    assert len(fwd) == 4 and all(f.kind == "introduced" for f in fwd)
    assert all(f.op.startswith("aten.mul") for f in fwd)
    assert "float argument 0 differs (0.5 in ref, 0.25 in cand)" in fwd[0].reason
    doc = report.header_dict()
    assert doc["ops"]["calls"] == 8 and doc["ops"]["findings"][0]["kind"] == "introduced"
    # the module-level keys decide the exit code; ops explain
    assert report.exit_code == 1 and report.drill is None


def test_a_bf16_matmul_is_named_with_its_dtype(auditor_server):
    _run(auditor_server, "f32", Net(0.5), ops=("mlp",))
    _run(auditor_server, "bf16", Net(0.5, bf16=True), ops=("mlp",))
    report = compare_runs(auditor_server.db_path, "f32", "bf16", preset_policy("fp32"))
    for f in report.ops.calls:  # every call, forward and backward: the matmul, its dtype
        assert f.kind == "introduced" and f.op.startswith("aten.addmm"), f
        assert "computes in bfloat16 in bf16 and in float32 in f32" in f.reason, f.reason
        assert any("cast aten._to_copy" in line for line in f.structure)


def test_identical_runs_have_identical_operations_and_no_drill(auditor_server):
    _run(auditor_server, "a", Net(), ops=("mlp",))
    _run(auditor_server, "b", Net(), ops=("mlp",))
    report = compare_runs(auditor_server.db_path, "a", "b", preset_policy("bitwise"))
    assert report.exit_code == 0 and report.ops.breaches == 0
    assert {f.kind for f in report.ops.calls} == {"identical"}
    assert report.drill is None


def test_without_op_captures_the_report_says_how_to_drill(auditor_server):
    _run(auditor_server, "r", Net(0.5))
    _run(auditor_server, "c", Net(0.25))
    report = compare_runs(auditor_server.db_path, "r", "c", preset_policy("fp32"))
    assert report.ops is None
    assert report.first.key.site == "mlp.w2" and report.first.cause.kind == "introduced"
    assert report.drill["env"] == "NUMAUDIT_OPS=mlp.w2,mlp NUMAUDIT_STEPS=0"
    assert report.drill["command"] == "auditor drill r c -o plan.toml"


def test_modules_that_do_not_match_are_not_touched():
    model = Net()
    before = {n: (len(m._forward_pre_hooks), len(m._forward_hooks))
              for n, m in model.named_modules()}
    agent = numaudit.attach(model, run="x", ops=("mlp",), spool_mode="off")
    hooked = {n for n, m in model.named_modules()
              if len(m._forward_pre_hooks) != before[n][0]}
    assert hooked == {"", "mlp"}  # the root's batch-size pre-hook is the agent's as ever
    # and its hook runs before the capturer's, so the agent's digests are not operations
    hooks = list(model.mlp._forward_hooks.values())
    assert getattr(hooks[-1], "_numaudit_capture", False)
    agent.close()


def test_only_selected_steps_capture_operations(auditor_server):
    _run(auditor_server, "s", Net(), ops=("mlp",), steps=frozenset({1}))
    assert {step for keys in _op_sites(auditor_server.db_path, "s").values()
            for step, *_ in keys} == {1}


def test_a_plan_file_sets_ops_steps_and_payload(tmp_path, monkeypatch):
    plan = tmp_path / "plan.toml"
    plan.write_text(format_plan(Plan(ops=("mlp", "mlp.w2"), steps=(3,),
                                     payload=("fwd:mlp.w2",))))
    monkeypatch.setenv("NUMAUDIT_PLAN", str(plan))
    agent = numaudit.attach(Net(), run="p", payload=("fwd:out",), spool_mode="off")
    cfg = agent.config
    assert cfg.ops == ("mlp", "mlp.w2") and cfg.steps == frozenset({3})
    assert cfg.payload == ("fwd:out", "fwd:mlp.w2")
    agent.close()
    monkeypatch.setenv("NUMAUDIT_STEPS", "5")  # a variable wins over the plan
    agent = numaudit.attach(Net(), run="p", spool_mode="off")
    assert agent.config.steps == frozenset({5}) and agent.config.ops == ("mlp", "mlp.w2")
    agent.close()
    plan.write_text("version = 1\nops = []\n")
    with pytest.raises(ValueError, match="ops: no module to drill into"):
        numaudit.attach(Net(), run="p", spool_mode="off")
    plan.write_text("version = 2\nops = ['mlp']\n")
    with pytest.raises(ValueError, match="version"):
        numaudit.attach(Net(), run="p", spool_mode="off")


def test_a_directive_captures_its_step_and_a_late_one_is_ignored(auditor_server):
    """A directive names a step: that step is captured (whatever the step selection) with the
    operations and payloads it asks for; one for a step already started is ignored."""
    model = Net()
    agent = numaudit.attach(model, run="d", address=auditor_server.address,
                          phases=("fwd", "bwd", "grad"), steps=frozenset({0}),
                          payload_max_bytes=0)
    agent.ops.inbox.append(Directive(1, 2, ("mlp",), ("fwd:mlp",), "test"))
    agent.ops.inbox.append(Directive(2, 0, ("out",), (), "too late by the time it is read"))
    for step in range(4):
        with agent.step(step):
            if step == 1:  # arrives while step 1 runs: too late for it
                agent.ops.inbox.append(Directive(3, 1, ("inp",), (), "late"))
            with agent.microbatch(0):
                model(torch.randn(4, 8)).square().mean().backward()
        assert agent.capturer.config.payload == ()  # a directive's globs last one step
    summary = agent.close()
    assert summary["errors"] == 0
    sites = _op_sites(auditor_server.db_path, "d")
    assert {parse_op_site(s)[0] for s in sites} == {"mlp", "out"}
    assert {step for s, keys in sites.items() if s.startswith("mlp/") for step, *_ in keys} \
        == {2}
    assert agent.ops.applied == [(2, 0), (1, 2)] and agent.ops.late == 1
    reader = Reader(auditor_server.db_path)
    try:
        steps = {s for (s,) in reader.conn.execute(
            "SELECT DISTINCT r.step FROM records r JOIN runs u ON u.run_id = r.run_id "
            "WHERE u.name = 'd'")}
        payload = reader.conn.execute(
            "SELECT COUNT(*) FROM payload_chunks c JOIN records r ON r.record_id = c.record_id "
            "JOIN sites s ON s.site_id = r.site_id WHERE s.name = 'mlp'").fetchone()[0]
    finally:
        reader.close()
    assert steps == {0, 2} and payload == 1  # step 2 forced on; mlp's output bytes there


def test_an_operation_that_cannot_be_digested_is_counted_not_raised(auditor_server):
    class Sparse(torch.nn.Module):
        def forward(self, x):
            return x.to_sparse().to_dense() * 2

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = Sparse()

        def forward(self, x):
            return self.s(x)

    model = M()
    agent = numaudit.attach(model, run="sp", address=auditor_server.address, ops=("s",))
    with agent.step(0), agent.microbatch(0):
        y = model(torch.randn(3, 3))
    summary = agent.close()
    assert torch.isfinite(y).all()
    assert summary["not_captured"].get("op_not_digestible", 0) >= 1


class Reduced(torch.nn.Module):
    """An MLP whose output goes through a functional all-reduce (over one rank: the identity)."""

    def __init__(self, reduce: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Linear(8, 8)
        self.reduce = reduce

    def forward(self, x):
        y = torch.relu(self.w(x))
        if self.reduce:
            import torch.distributed._functional_collectives as funcol

            y = funcol.all_reduce(y, "sum", torch.distributed.group.WORLD)
        return y * 2


def test_a_collective_one_run_adds_is_said_and_the_rest_still_pairs(auditor_server, tmp_path):
    """A functional all-reduce (waited for before its output is read) in one run only: the
    operations after it pair with the other run's, and the call says it adds the collective
    without a finding, since nothing it feeds differs (one rank: the sum is the identity)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", rank=0, world_size=1,
                            store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        for name, reduce in (("plain", False), ("reduced", True)):
            model = torch.nn.Sequential()
            model.add_module("m", Reduced(reduce))
            agent = numaudit.attach(model, run=name, address=auditor_server.address, ops=("m",))
            with agent.step(0), agent.microbatch(0):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
            assert agent.close()["errors"] == 0
    finally:
        dist.destroy_process_group()
    names = {parse_op_site(s)[2] for s in _op_sites(auditor_server.db_path, "reduced")}
    assert "_c10d_functional.all_reduce" in names and "aten.mul.Tensor" in names
    report = compare_runs(auditor_server.db_path, "plain", "reduced", preset_policy("bitwise"))
    (call,) = report.ops.calls
    assert call.kind == "identical" and not call.breach
    assert call.structure == [
        "reduced runs the collective _c10d_functional.all_reduce (op 4), which plain does not"]
    assert report.exit_code == 0
