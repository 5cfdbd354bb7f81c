"""numaudit's rank agent: hooks, on-device digests and background delivery to the auditor.

    import numaudit
    agent = numaudit.attach(model, run="ref")
    with agent.step(0):
        with agent.microbatch(0):
            loss = loss_fn(model(x)); loss.backward()
    agent.close()

Imports are lazy so that `python -m numaudit.agents.sidecar` does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from numaudit.agents.agent import Agent, attach
    from numaudit.agents.config import AgentConfig

__all__ = ["Agent", "AgentConfig", "attach"]


def __getattr__(name: str):
    if name in ("Agent", "attach"):
        from numaudit.agents import agent as module

        return getattr(module, name)
    if name == "AgentConfig":
        from numaudit.agents.config import AgentConfig

        return AgentConfig
    raise AttributeError(f"module 'agents' has no attribute {name!r}")
