"""numaudit's rank agent: hooks, on-device digests and background delivery to the auditor.

    import numaudit
    agent = numaudit.attach(model, run="ref")
    with agent.step(0):
        with agent.microbatch(0):
            loss = loss_fn(model(x)); loss.backward()
    agent.close()

What a training script uses is exported here (docs/agent.md): `attach` (also `numaudit.attach`,
the user's door), the `Agent` it returns, its `AgentConfig`, and `Backlog`, what
`Agent.backlog()` returns. Pipeline schedules (`numaudit.agents.pipeline`) and ragged rows
(`numaudit.agents.ragged`) are their own modules. Imports are lazy so that
`python -m numaudit.agents.sidecar` does not load torch.

Owns the subpackages `capture` (hooks and what they capture, on the training thread), `digest`
(on-device digests gathered into host row batches), `delivery` (records streamed to the
auditor), `kernels` (the digest's fused implementations), and beside them the entry points
(`agent`, `config`), the rank's identity and pieces' layouts, the pipeline and ragged helpers,
the bounded unpickler, shutdown and the node sidecar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from numaudit.agents.agent import Agent, Backlog, attach
    from numaudit.agents.config import AgentConfig

__all__ = ["Agent", "AgentConfig", "Backlog", "attach"]


def __getattr__(name: str):
    if name in ("Agent", "Backlog", "attach"):
        from numaudit.agents import agent as module

        return getattr(module, name)
    if name == "AgentConfig":
        from numaudit.agents.config import AgentConfig

        return AgentConfig
    raise AttributeError(f"module 'numaudit.agents' has no attribute {name!r}")
