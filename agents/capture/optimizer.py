"""Gradients as the optimizer sees them, and the update it applies (phases optim_grad, update).

Parameter gradients (phase `grad`) are captured when a step block exits: after backward, before
anything the training loop does to them after the block (or, when an optimizer steps inside the
block, just before it: `Agent._optimizer_stepping`). What the optimizer consumes can differ —
gradient clipping, unscaling, a gradient transformation — and a bug there (each pipeline stage
clipping by its local norm instead of the global one) would otherwise show only one step later,
as weights that differ with no cause. `OptimizerWatch` hooks `optimizer.step`:

- a step pre-hook captures every parameter's `.grad` as phase `optim_grad` (None recorded
  explicitly, as for `grad`), and, when updates are captured, keeps a copy of each parameter;
- a step post-hook captures `parameter - copy` as phase `update` and frees the copies.

Both are keyed by the agent's current step (the last `agent.step(i)` block entered, so calling
`optimizer.step()` after the block is fine) and by the parameter's normalized name in the watched
model (an FSDP1 FlatParameter: each original parameter's, agents/capture/fsdp1.py). Cost: one digest
per parameter per phase; capturing updates holds one copy of the parameters on their device during
`optimizer.step()`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from numaudit.agents.capture import fsdp1
from numaudit.agents.capture.capture import STEP_LEVEL, Capturer
from numaudit.agents.capture.sites import normalize_site
from numaudit.agents.config import step_selected

log = logging.getLogger(__name__)


class OptimizerWatch:
    """Hooks on one optimizer; `remove()` takes them off. Never raises into training.

    Made by `Agent.watch_optimizer` (only where the agent is on) from what the hooks need of
    the agent: its `capturer` (the current step, its step selection, the captures) and
    `models`, the agent's watched ``(module, stage)`` list itself, read at every step so that
    modules watched later are named too.
    """

    def __init__(self, capturer: Capturer, models: Sequence[tuple[torch.nn.Module, int]],
                 optimizer: torch.optim.Optimizer, *, updates: bool) -> None:
        self.capturer = capturer
        self.models = models
        self.optimizer = optimizer
        self.updates = updates
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _named(self) -> list[tuple[str, int, torch.Tensor]]:
        """(site, stage, parameter) of every parameter the optimizer holds, in its order."""
        names: dict[int, tuple[str, int]] = {}
        for module, stage in self.models:
            for name, p in module.named_parameters():
                names.setdefault(id(p), (normalize_site(name), stage))
        out = []
        for g, group in enumerate(self.optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                site, stage = names.get(id(p), (f"optimizer.param_groups.{g}.{k}", -1))
                out.append((site, stage, p))
        return out

    def _pre(self, optimizer, args, kwargs) -> None:
        capturer = self.capturer
        self._before.clear()
        try:
            if not self._stepping():
                return
            named = self._named()
            views = capturer.flat_views(module for module, _ in self.models)
            # one sweep: every gradient digested in one kernel call
            capturer.capture_values(fsdp1.sweep(named, views, True, capturer._failed),
                                    phase="optim_grad")
            if self.updates:
                self._before.extend((p, p.detach().clone()) for _, _, p in named)
        except Exception as exc:
            self._before.clear()
            capturer._failed("optimizer step pre-hook", exc)

    def _post(self, optimizer, args, kwargs) -> None:
        capturer = self.capturer
        try:
            if not self._before:
                return
            names = {id(p): (site, stage) for site, stage, p in self._named()}
            views = capturer.flat_views(module for module, _ in self.models)
            for p, before in self._before:
                site, stage = names[id(p)]
                update = p.detach() - before
                for view in views.get(id(p), ()):  # FSDP1: each original parameter's (sharded)
                    capturer.capture(view.part(update), phase="update", site=view.site,
                                     role="value", microbatch=STEP_LEVEL, stage=stage,
                                     layout=view.layout)
                if id(p) not in views:
                    capturer.capture(update, phase="update", site=site, role="value",
                                     microbatch=STEP_LEVEL, stage=stage)
            capturer.flush()
        except Exception as exc:
            capturer._failed("optimizer step post-hook", exc)
        finally:
            self._before.clear()

    def _stepping(self) -> bool:
        """Whether this step is captured at all: the step selection (`steps`, `step_every`,
        `step_first`) takes the capturer's current step."""
        return step_selected(self.capturer.config, self.capturer.step)
