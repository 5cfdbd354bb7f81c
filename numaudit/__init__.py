"""numaudit: prove two distributed PyTorch training runs compute the same thing, or show where
and why they part ways.

The user's door is this package:

    import numaudit
    agent = numaudit.attach(model, run="ref")
    with agent.step(0):
        with agent.microbatch(0):
            loss = loss_fn(model(x)); loss.backward()
    agent.close()

Everything lives under this one import root, so nothing collides with other installed packages:
`numaudit.agents` (the rank side), `numaudit.auditor` (daemon, store, comparison, reports, CLI),
`numaudit.wire` (the contract both sides share) and `numaudit.protos` (the generated wire format).

In the repository those are the top-level folders `agents/`, `auditor/`, `wire/` and `protos/`,
where the design puts them; an installed package holds them under `numaudit/` (setup.py maps
them). In a checkout this file lets the same names resolve to those folders. Imports are lazy,
so `import numaudit` loads no torch until `attach` is called.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING

SUBPACKAGES = ("agents", "auditor", "wire", "protos")
"""The subpackages, folders at the top of the repository (`setup.py` maps them under here)."""


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """In a checkout, `numaudit.<sub>` is the repository's `<sub>/` folder, for the four
    subpackages only; their own modules are then found by the usual path search."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parent, _, sub = fullname.partition(".")
        if parent != __name__ or sub not in SUBPACKAGES:
            return None
        folder = self.root / sub
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


_HERE = Path(__file__).resolve().parent
if not (_HERE / "agents").is_dir() and (_HERE.parent / "agents" / "__init__.py").is_file():
    sys.meta_path.insert(0, _CheckoutFolders(_HERE.parent))

if TYPE_CHECKING:
    from numaudit.agents.agent import Agent, Backlog, attach
    from numaudit.agents.config import AgentConfig
    from numaudit.agents.pipeline import agent_loss, watch_stages
    from numaudit.agents.ragged import RaggedRows, ragged_rows

__all__ = ["Agent", "AgentConfig", "Backlog", "RaggedRows", "agent_loss", "attach", "ragged_rows",
           "watch_stages"]
"""What a training script uses (`numaudit.agents.USER_API`): `import numaudit` is all it needs."""


def __getattr__(name: str):
    if name in __all__:
        from numaudit import agents

        return getattr(agents, name)
    raise AttributeError(f"module 'numaudit' has no attribute {name!r}")
