"""The module hooks and gradient hooks of the Capturer: what runs at every hooked call.

Functions of the `Capturer` (agents/capture/capture.py binds them as its methods, `cap` being
the capturer): hooking a model's selected modules (`hook_modules`) and their forward hook
(`forward_hook`, the hottest path: each call level costs a microsecond or two in a training
step); the batch's rows read at the model's forward; following tensor-parallel blocks held as
plain tensors through modules no style declares (`follow_shards`); a checkpoint's recomputation
(`replayed`); a pipeline schedule's shape inference (`skip_outside_chunk`); and the gradient
hooks, one capture per key, keyed by the forward's step (`grad_hook`, `backward_hook`).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._pytree import tree_leaves

from numaudit.agents.capture.hooks import add_grad_hook, graph_task_id, not_traced
from numaudit.agents.capture.sharding import (
    OutputBlock,
    followed,
    is_dtensor,
    mark_of,
    output_batch_dims,
    output_sharding,
    set_mark,
)
from numaudit.agents.capture.sites import select_modules
from numaudit.agents.layout import PieceLayout, batch_rows, holds_batch

MAX_NO_GRAD_CALLS = 64
"""No-grad forwards remembered per (step, microbatch, site) for a reentrant checkpoint's replay."""
NOT_CAPTURED_AMBIGUOUS = "checkpoint_reentrant_ambiguous"
NOT_CAPTURED_SHAPE_INFERENCE = "pipeline_shape_inference"
"""Captures made while a watched pipeline stage's module ran outside the schedule's chunk
methods: the schedule inferring shapes on the first step. No microbatch was running, so no key
is right for them (see :attr:`Capturer.outside_chunk`)."""


class LastOutput(NamedTuple):
    """The last hooked module output when it is a tensor-parallel block
    (`Capturer._last_output`, set by `follow_shards`; None when the last output is not a
    block): a module's hook runs after its submodules', so when this is a submodule's, it ran
    in this call of the module."""

    site: str
    """The module that output it."""
    shape: tuple[int, ...]
    """Its first output tensor's shape."""
    block: OutputBlock
    """The tensor-parallel block that output is."""


def hook_modules(cap, model: torch.nn.Module, stage: int = -1, *,
                 pipelined: bool = False) -> int:
    """Hook every selected module of `model` (a whole model or one pipeline stage).

    `pipelined`: the module is driven by a pipeline schedule, and only forwards inside the
    schedule's chunk methods (`in_chunk`) are captured — not the schedule's own shape
    inference, which runs the stage once outside them: what it would capture is counted
    as not captured, and so is whatever `capture()` is asked for until the next chunk
    (:attr:`outside_chunk`).
    """
    n = 0
    cfg = cap.config
    if pipelined:
        cap._handles.append(model.register_forward_pre_hook(
            not_traced(cap._stage_pre_hook), prepend=True))
    cap._handles.append(model.register_forward_pre_hook(
        not_traced(cap._rows_pre_hook), with_kwargs=True))
    for site, module in select_modules(model, cfg.modules, cfg.exclude, cfg.max_depth,
                                       cfg.block_depth):
        declared, shards = output_sharding(module, cap.ident)
        if declared:
            cap._declared.add(site)
            cap._set_shards(site, shards)
        for index, dim in output_batch_dims(module).items():
            cap._batch_dims[(site, index)] = dim
        hook = cap._forward_hook(site, stage, pipelined)
        cap._handles.append(module.register_forward_hook(hook))
        n += 1
    return n


def rows_pre_hook(cap, module, args, kwargs) -> None:
    """Runs at every forward of a watched model or stage: its input's samples (`_rows`)."""
    if cap._step_on:
        try:
            cap._set_rows(batch_rows(args, kwargs, cap.config.batch_dim))
        except Exception as exc:  # never into training
            cap._failed("reading the batch size", exc)


def set_rows(cap, rows: int | None) -> None:
    if rows is not None:
        cap._rows = rows
        cap._batches.rows = rows  # only pieces of this many samples get sample digests


def note_batchless(cap, site: str, inputs: tuple, tensors: list) -> None:
    """Mark this call's outputs that do not hold the batch (`_batchless`); only outputs of
    size 1 on the batch dim are looked at further (rarely any)."""
    dim = cap.config.batch_dim
    for index, t in enumerate(tensors):
        d = cap._batch_dims.get((site, index), dim) if cap._batch_dims else dim
        shape = tuple(t.shape)
        if len(shape) <= d or shape[d] != 1 or (site, shape) in cap._batchless:
            continue
        if not holds_batch(shape, d, cap._rows, [tuple(x.shape) for x in inputs
                                                 if isinstance(x, torch.Tensor)]):
            cap._batchless.add((site, shape))
            cap._layouts.plain.clear()  # its plans and layouts were a share's
            cap._plans.clear()


def stage_pre_hook(cap, module, inputs) -> None:
    """Runs first at every forward of a pipeline stage's module: outside a chunk method it
    is the schedule's shape inference (:attr:`outside_chunk`)."""
    if not cap.in_chunk:
        cap.outside_chunk = True


def remove_hooks(cap) -> None:
    for h in cap._handles:
        h.remove()
    cap._handles.clear()


def forward_hook(cap, site: str, stage: int, pipelined: bool = False):
    # Runs at every call of every hooked module: what it reads is cached (the phases in
    # _fwd_on / _bwd_on; the call counter inlined), each call level costing a microsecond
    # or two in a training step.
    def hook(module, inputs, output):
        if not cap._step_on:  # a step the selection leaves out: nothing else to do
            return
        if cap.op_frames and not cap.ops_paused:  # inside a module whose operations
            return cap._paused(hook, module, inputs, output)  # are captured (ops.py)
        try:
            if graph_task_id() != -1:  # in backward: a checkpoint's recomputation
                cap._replayed(site, stage, output)
                return
            fwd, bwd = cap._fwd_on, cap._bwd_on
            if not (fwd or bwd):
                return
            if pipelined and not cap.in_chunk:  # the schedule's shape inference
                cap._skip_outside_chunk(output, fwd, bwd)
                return
            mb = cap.microbatch
            calls, key = cap._calls, (mb, site)
            call = calls[key]
            calls[key] = call + 1
            st = stage if stage >= 0 else cap.stage
            tensors = ([output] if type(output) is torch.Tensor else
                       [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)])
            if cap._follow:
                cap._follow_shards(site, inputs, tensors)
            if cap._rows is not None and cap._rows > 1:
                cap._note_batchless(site, inputs, tensors)
            for index, t in enumerate(tensors):
                if fwd and not cap._capture_fast(t, "fwd", site, "output", index, call,
                                                  mb, st, cap.step):
                    cap._capture_one(t, phase="fwd", site=site, role="output",
                                      index=index, call=call, microbatch=mb, stage=st)
                if bwd and t.requires_grad:  # cap._grad_hook(...), inlined
                    add_grad_hook(t, functools.partial(cap._run_grad_hook, site, index, call,
                                                       mb, st, cap.step, None, "grad_output"))
            if bwd and tensors and not torch.is_grad_enabled():
                # Maybe a reentrant checkpoint: its forward runs without grad and is run
                # again in backward; remember the call so the replay keys its gradients.
                key = (cap.step, mb, site)
                calls = cap._no_grad_calls.setdefault(key, deque(maxlen=MAX_NO_GRAD_CALLS))
                calls.append((call, st))
        except Exception as exc:  # never into training
            cap._failed("forward hook", exc)
        cap._batches.drain()

    wrapped = not_traced(hook)
    wrapped._numaudit_capture = True  # agents/capture/ops.py runs its own hook before this one
    return wrapped


def skip_outside_chunk(cap, output, fwd: bool, bwd: bool) -> None:
    """Count what a hooked module's output outside any chunk would have been captured as."""
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    n = len(tensors) * fwd + sum(t.requires_grad for t in tensors) * bwd
    if n:
        cap.counters.miss(NOT_CAPTURED_SHAPE_INFERENCE, n)


def set_shards(cap, site: str, shards: OutputBlock | None) -> None:
    if cap._output_shards.get(site) == shards:
        return
    if shards is None:
        del cap._output_shards[site]
    else:
        cap._output_shards[site] = shards
    cap._layouts.plain.clear()  # cached layouts and plans of this site are stale
    cap._plans.clear()


def follow_shards(cap, site: str, inputs: tuple, tensors: list) -> None:
    """Follow tensor-parallel blocks held as plain tensors through modules no style
    declares, and mark this call's plain outputs with their block (SHARD_MARK).

    A sequence-parallel model passes each rank's tokens between blocks as plain tensors
    (``x + cap.w2(...)`` of two local blocks): a transformer block's output holds the
    same tokens as its input. So a module whose positional input is marked as a block of
    dim d, and whose output has that dim at the same size, outputs the same block; a
    module that gathers the dim (another size) or reduces it away does not. Without a
    marked input (a pipeline stage's first block, fed by the previous stage; a module
    whose input a PrepareModuleInput style gathers), a module whose last hooked submodule
    in this call output a block of its output's shape outputs that block (the residual
    add). Inferred wrongly either way, the pieces do not rebuild the reference's logical
    tensor and the comparison breaches: never a false pass.
    """
    shards = cap._output_shards.get(site)
    if site not in cap._declared:
        found = None
        for x in inputs:
            mark = mark_of(x) if isinstance(x, torch.Tensor) else None
            if mark is not None:
                found = followed(mark, x, tensors)
                break
        last = cap._last_output
        if (found is None and last is not None and tensors
                and last.site.startswith(f"{site}." if site else "")
                and last.shape == tuple(tensors[0].shape) and not is_dtensor(tensors[0])):
            # No marked input (a pipeline stage's first block gets its tokens from the
            # previous stage; PrepareModuleInput hands a module its input gathered), but
            # the submodule that ran last in this call output a block of this output's
            # shape: ``x + cap.w2(...)`` adds that block to x.
            found = last.block
        if found != shards:
            cap._set_shards(site, found)
            shards = found
    if shards is not None:
        for t in tensors:  # plain tensors, and the AsyncCollectiveTensor a style's
            if not is_dtensor(t):  # redistribute(async_op=True) leaves before to_local()
                set_mark(t, shards)
    if tensors:
        cap._last_output = (LastOutput(site, tuple(tensors[0].shape), shards)
                            if shards is not None else None)


def replayed(cap, site: str, stage: int, output) -> None:
    """A forward run again during backward: a checkpoint's recomputation, not a new call.

    A non-reentrant checkpoint's original outputs carry the gradient hooks already. A
    reentrant one (use_reentrant=True) ran its forward without grad, so the gradients flow
    only through this replay: hook its outputs under the original call's key. Which call a
    replay belongs to is known when the site ran once (without grad) in this microbatch;
    with several such calls the segments may replay in any order, so those are counted as
    not captured (NOT_CAPTURED_AMBIGUOUS) rather than keyed by a guess.
    """
    if not cap.wants("bwd") or not torch.is_grad_enabled():
        return
    key = (cap.step, cap.microbatch, site)
    calls = cap._no_grad_calls.get(key)
    if not calls:
        return
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
    if len(calls) > 1 or key in cap._ambiguous:
        cap._ambiguous.add(key)
        calls.popleft()
        cap.counters.miss(NOT_CAPTURED_AMBIGUOUS, sum(t.requires_grad for t in tensors))
        return
    call, st = calls.popleft()
    for index, t in enumerate(tensors):  # indexed as in the original forward
        if t.requires_grad:
            add_grad_hook(t, cap._grad_hook(site, index, call, cap.microbatch, st, cap.step))


def grad_hook(cap, site: str, index: int, call: int, mb: int, stage: int, step: int,
               layout: PieceLayout | None = None, role: str = "grad_output"):
    """The hook capturing the gradient of one hooked tensor (see :meth:`_backward_hook`:
    the same rules, in one partial, since one is made per hooked tensor and forward)."""
    return functools.partial(cap._run_grad_hook, site, index, call, mb, stage, step,
                             layout, role)


def grad_hook_body(cap, site: str, index: int, call: int, mb: int, stage: int,
                    step: int, layout: PieceLayout | None, role: str, grad) -> None:
    try:
        key = (step, mb, site, index, call, role)
        if grad is None or key in cap._bwd_seen:
            return
        cap._bwd_seen.add(key)
        if layout is None and cap._capture_fast(grad, "bwd", site, role, index, call, mb,
                                                 stage, step):
            cap._batches.drain()
            return
        saved = cap.step
        cap.step = step  # the general path keys captures by cap.step
        try:
            cap._capture_one(grad, phase="bwd", site=site, role=role, index=index,
                              call=call, microbatch=mb, stage=stage, layout=layout)
            cap._batches.drain()
        finally:
            cap.step = saved
    except Exception as exc:
        cap._failed("backward hook", exc)


def backward_hook(cap, key: tuple, step: int, capture: Callable[[torch.Tensor], None]):
    """A tensor hook that captures the gradient once per key, keyed by the forward's step.

    Split backward (ZBV, DualPipeV) can run a tensor's hooks in both the input-gradient and
    the weight-gradient action: one capture per key. Never raises into backward. (A
    partial of one function disabled for torch.compile once: wrapping a closure per
    registration cost tens of microseconds per hooked tensor.)
    """
    return functools.partial(cap._run_backward_hook, key, step, capture)


def backward_hook_body(cap, key: tuple, step: int, capture, grad) -> None:
    try:
        if grad is not None and key not in cap._bwd_seen:
            cap._bwd_seen.add(key)
            saved = cap.step
            cap.step = step
            try:
                capture(grad)
            finally:
                cap.step = saved
    except Exception as exc:
        cap._failed("backward hook", exc)
