"""A torch.compile'd model keeps correct captures, and toggling capture between steps does not
recompile it (docs/agent.md, torch.compile)."""

from __future__ import annotations

import pytest
import torch

from numaudit.agents.capture.capture import Capturer, Counters
from numaudit.agents.config import AgentConfig
from numaudit.agents.identity import RankIdentity

pytestmark = pytest.mark.timeout(120)
STEPS = 6


def _train(compiled: bool, graphs: list[int]) -> tuple[dict, list[int]]:
    """Six steps, capture on every other one; returns digest rows by key and the number of
    graphs compiled so far after each step. `graphs` gets, per compiled graph, the number of
    its nodes that come from the agent's code."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batches = []
    cap = Capturer(AgentConfig(step_every=2, phases=("fwd", "bwd")), RankIdentity(),
                   batches.append, Counters())
    cap.hook_modules(model)

    def backend(gm, example_inputs):
        graphs.append(sum("/agents/" in (n.meta.get("stack_trace") or "") for n in gm.graph.nodes))
        return gm.forward

    run = torch.compile(model, backend=backend) if compiled else model
    x = torch.randn(5, 8)
    after_step = []
    for step in range(STEPS):
        cap.start_step(step)
        run(x).sum().backward()
        cap.flush()
        after_step.append(len(graphs))
    rows = {(c.step, c.phase, c.site, c.call): (b.f64[c.row], b.i64[c.row])
            for b in batches for c in b.captures}
    return rows, after_step


def test_compiled_model_captures_like_eager_and_does_not_recompile_on_toggle():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ref, _ = _train(False, [])
    graphs: list[int] = []
    counters.clear()
    got, after_step = _train(True, graphs)
    # Dynamo never traces the agent's hooks (agents.capture.hooks.not_traced): the one graph break
    # is where a compiled frame calls a disabled hook; none inside the hook's own code, and no frame
    # of it is compiled (that would be another break, at the disabled call within).
    breaks = [k.splitlines()[0] for k in counters["graph_break"]]
    assert breaks and set(breaks) == {"Skip inlining `torch.compiler.disable()`d function"}, \
        breaks
    assert graphs, "the model was not compiled"
    assert not any(graphs), "the agent's own code was traced into the model's graphs"
    assert sorted(got) == sorted(ref)
    assert {k[0] for k in got} == {0, 2, 4}
    for key, (f64, i64) in ref.items():
        assert torch.equal(got[key][1], i64), key
        assert torch.equal(got[key][0], f64), key
    # every graph is compiled in the first step; steps that turn capture off and on add none
    assert after_step == [after_step[0]] * STEPS, after_step


class _Explicit(torch.nn.Module):
    """A model whose forward captures a tensor itself (Agent.capture in user code)."""

    def __init__(self, cap: Capturer) -> None:
        super().__init__()
        self.cap, self.a, self.b = cap, torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.cap.capture(h, phase="fwd", site="mid")
        return self.b(h)


def test_capture_called_from_compiled_code_runs_eagerly():
    from torch._dynamo.utils import counters

    out = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        batches = []
        cap = Capturer(AgentConfig(phases=("fwd",)), RankIdentity(), batches.append, Counters())
        model = _Explicit(cap)
        run = torch.compile(model, backend="eager") if compiled else model
        for step in range(3):
            cap.start_step(step)
            run(torch.randn(5, 8, generator=torch.Generator().manual_seed(step)))
            cap.flush()
        out.append({(c.step, c.site): (b.f64[c.row], b.i64[c.row])
                    for b in batches for c in b.captures})
        if compiled:
            breaks = {k.splitlines()[0] for k in counters["graph_break"]}
            assert breaks == {"Skip inlining `torch.compiler.disable()`d function"}, breaks
    eager, compiled = out
    assert sorted(eager) == sorted(compiled) == [(s, "mid") for s in range(3)]
    for key, (f64, i64) in eager.items():
        assert torch.equal(compiled[key][1], i64) and torch.equal(compiled[key][0], f64), key
