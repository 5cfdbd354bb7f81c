"""Pipeline parallelism: key captures of torch.distributed.pipelining runs by microbatch and stage.

A pipeline schedule (GPipe, 1F1B, Interleaved1F1B, ZBV, DualPipeV, ...) owns the microbatch loop,
so the training script cannot wrap each microbatch in `agent.microbatch(j)`. Every schedule
drives its stages through the same three `PipelineStage` methods, each given the microbatch
("chunk") id: `forward_one_chunk`, `backward_one_chunk` (the whole backward, or only the
input-gradient half when the schedule splits backward) and `backward_weight_one_chunk` (the
weight-gradient half). `watch_stages` wraps those methods on each stage object so that whatever
the hooks capture inside them is keyed by that chunk id and the stage's index. Stage modules
built from the full model keep its FQNs, so their sites align with an unpipelined reference.

    stages = [PipelineStage(module, i, ...) for i, module in ...]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn=agent_loss(agent, loss_fn))
    watch_stages(agent, stages)
    with agent.step(step):
        schedule.step(...)            # parameter gradients are captured when the block exits
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from numaudit.agents.agent import Agent
from numaudit.agents.capture.normalization import note_schedule

log = logging.getLogger(__name__)

_CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def watch_stages(agent: Agent, stages: Sequence[Any], *, schedule: Any = None) -> None:
    """Hook each stage's module and key its captures by the schedule's microbatch ids.

    With `schedule`, the run's labels record what it does to parameter gradients (scale_grads
    divides them by n_microbatches); activation gradients keep the loss function's scale, so the
    run's grad_scale is unchanged (agents/capture/normalization.py).
    """
    stages = list(stages)
    agent.ident.stages = tuple(sorted(int(s.stage_index) for s in stages))
    if schedule is not None:
        note_schedule(agent.ident, schedule)
    for stage in stages:
        agent.watch(stage.submod, stage=int(stage.stage_index), pipelined=True)
        for name in _CHUNK_METHODS:
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, _keyed(agent, int(stage.stage_index), method))


def _keyed(agent: Agent, stage_index: int, method: Callable) -> Callable:
    forward = method.__name__ == "forward_one_chunk"

    @functools.wraps(method)
    def run_chunk(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        capturer = agent.capturer
        # Left set after the call on purpose: the schedule computes the loss of this chunk right
        # after its forward, and `agent_loss` reads the microbatch from here.
        capturer.microbatch, capturer.stage = int(chunk_id), stage_index
        capturer.in_chunk += 1
        capturer.outside_chunk = False  # the schedule's shape inference, if any, is over
        try:
            result = method(chunk_id, *args, **kwargs)
            if forward:
                capturer.loss_microbatch = int(chunk_id)
            return result
        finally:
            capturer.in_chunk -= 1
            capturer.flush()

    return run_chunk


def agent_loss(agent: Agent, loss_fn: Callable[..., torch.Tensor], *,
               site: str = "loss") -> Callable[..., torch.Tensor]:
    """Wrap a schedule's loss function so each microbatch's loss is captured (phase `loss`)."""

    @functools.wraps(loss_fn)
    def loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        value = loss_fn(*args, **kwargs)
        capturer = agent.capturer
        # Only the loss of a forward chunk the schedule ran: a schedule inferring shapes calls
        # the loss function once more, outside any chunk, and that value is no microbatch's
        # (agent.capture counts it as not captured: capturer.outside_chunk).
        if capturer.loss_microbatch is not None:
            agent.capture(value, site=site, phase="loss", microbatch=capturer.loss_microbatch)
            capturer.loss_microbatch = None
        elif capturer.outside_chunk:
            agent.capture(value, site=site, phase="loss")
        return value

    return loss
