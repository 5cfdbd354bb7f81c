"""A drill-down plan applied to the agent's configuration (`NUMAUDIT_PLAN`, `attach(plan=)`).

The plan's settings sit between the arguments and the environment: its `ops` and `steps` replace
the arguments' unless a NUMAUDIT_* variable sets them, and its `payload` globs are added to
whatever payload globs are set (raw bytes of the drilled module's outputs come on top of what
the run already sends). The format is `wire.plan`'s, the one the auditor writes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from numaudit.wire.plan import read_plan

if TYPE_CHECKING:
    from numaudit.agents.config import AgentConfig


def apply_plan(config: AgentConfig, path: str, *, explicit: set[str]) -> AgentConfig:
    """`config` with the plan at `path` applied; `explicit`: fields the environment set (they
    win). ValueError naming the file and field for a plan that cannot be read."""
    plan = read_plan(path)
    changes: dict = {}
    if "ops" not in explicit:
        changes["ops"] = plan.ops
    if "steps" not in explicit:
        changes["steps"] = frozenset(plan.steps) if plan.steps else None
    changes["payload"] = tuple(dict.fromkeys((*config.payload, *plan.payload)))
    return dataclasses.replace(config, **changes)
