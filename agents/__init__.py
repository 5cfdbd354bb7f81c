"""numaudit's rank agent: hooks, on-device digests and background delivery to the auditor.

    import numaudit
    agent = numaudit.attach(model, run="ref")
    with agent.step(0):
        with agent.microbatch(0):
            loss = loss_fn(model(x)); loss.backward()
    agent.close()

What a training script uses is exported here and from `numaudit` itself (docs/agent.md):
`attach` (the user's door), the `Agent` it returns, its `AgentConfig`, `Backlog` (what
`Agent.backlog()` returns), `ragged_rows` and `RaggedRows` (rows of a ragged output, from
`numaudit.agents.ragged`), and `watch_stages` and `agent_loss` (a pipeline schedule's stages and
loss, from `numaudit.agents.pipeline`). Imports are lazy so that
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
    from numaudit.agents.pipeline import agent_loss, watch_stages
    from numaudit.agents.ragged import RaggedRows, ragged_rows

USER_API = {
    "attach": "agent", "Agent": "agent", "Backlog": "agent", "AgentConfig": "config",
    "ragged_rows": "ragged", "RaggedRows": "ragged",
    "watch_stages": "pipeline", "agent_loss": "pipeline",
}
"""What a training script uses, and the module under `numaudit.agents` that defines each."""

__all__ = ["Agent", "AgentConfig", "Backlog", "RaggedRows", "agent_loss", "attach", "ragged_rows",
           "watch_stages"]


def __getattr__(name: str):
    if name in USER_API:
        import importlib

        return getattr(importlib.import_module(f"numaudit.agents.{USER_API[name]}"), name)
    raise AttributeError(f"module 'numaudit.agents' has no attribute {name!r}")
