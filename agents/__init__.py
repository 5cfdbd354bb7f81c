"""numaudit's rank agent: hooks, on-device digests and background delivery to the auditor.

    import agents
    agent = agents.attach(model, run="ref")
    with agent.step(0):
        with agent.microbatch(0):
            loss = loss_fn(model(x)); loss.backward()
    agent.close()
"""

from agents.attach import Agent, attach
from agents.config import AgentConfig

__all__ = ["Agent", "AgentConfig", "attach"]
