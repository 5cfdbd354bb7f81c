"""Capture: module and parameter hooks → digests on the tensor's device → batched host transfer.

Everything here runs on the training thread, so it is bounded and cheap: a hook computes the
digest of each tensor it sees on that tensor's device (vectorized, no host sync on CUDA). CPU
pieces go through the fused kernel, which writes their rows straight into the host batch's
buffers and copies small pieces' payload bytes in the same pass; rows computed on an
accelerator are kept, and every `device_batch` captures (or at a microbatch or step boundary)
stacked and sent to the host in one asynchronous copy (agents/digest/batching.py). The sender thread
waits for that copy, builds records and does all network I/O. No hook ever raises into training:
failures are counted, logged once per kind with the rank, and the capture is dropped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import struct
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch.utils._pytree import tree_leaves

from numaudit.agents.capture import fsdp1
from numaudit.agents.capture.hooks import add_grad_hook, grad_role, graph_task_id, not_traced
from numaudit.agents.capture.sites import matches, normalize_site, select_modules
from numaudit.agents.config import AgentConfig, step_selected
from numaudit.agents.digest.batching import Batcher, Capture, Counters, HostBatch  # noqa: F401 (re-exported)
from numaudit.agents.digest.device_copy import payload_copy
from numaudit.agents.digest.digest import has_moments
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.identity import RankIdentity
from numaudit.agents.kernels.cpu import DTYPE_CODES, descriptor_tail, pack_head
from numaudit.agents.layout import (
    PieceLayout,
    batch_layout,
    batch_rows,
    complex_real_layout,
    dim_shard_layout,
    dtensor_layout,
    holds_batch,
    ragged_layout,
    reduction_layout,
)
from numaudit.protos import numaudit_pb2 as pb

log = logging.getLogger(__name__)

PHASE_IDS = {
    "fwd": pb.PHASE_FWD, "bwd": pb.PHASE_BWD, "grad": pb.PHASE_GRAD,
    "param": pb.PHASE_PARAM, "loss": pb.PHASE_LOSS, "input": pb.PHASE_INPUT,
    "optim_grad": pb.PHASE_OPTIM_GRAD, "update": pb.PHASE_UPDATE, "state": pb.PHASE_STATE,
}
ROLE_IDS = {
    "output": pb.ROLE_OUTPUT, "input": pb.ROLE_INPUT, "grad_output": pb.ROLE_GRAD_OUTPUT,
    "grad_input": pb.ROLE_GRAD_INPUT, "value": pb.ROLE_VALUE,
}
STEP_LEVEL = -1  # microbatch id of per-step captures (grad, param, optim_grad, update)
PER_STEP_PHASES = ("grad", "param", "optim_grad", "update", "state")
"""Phases captured once per step, of parameters and state_dict entries: full tensors (replicas
over dp) unless DTensors."""
MAX_NO_GRAD_CALLS = 64
"""No-grad forwards remembered per (step, microbatch, site) for a reentrant checkpoint's replay."""
NOT_CAPTURED_AMBIGUOUS = "checkpoint_reentrant_ambiguous"
NOT_CAPTURED_SHAPE_INFERENCE = "pipeline_shape_inference"
"""Captures made while a watched pipeline stage's module ran outside the schedule's chunk
methods: the schedule inferring shapes on the first step. No microbatch was running, so no key
is right for them (see :attr:`Capturer.outside_chunk`)."""
AUTO = "auto"
"""`reduce` default of capture(): "mean" for phase loss (a per-rank mean loss; a per-sample loss
vector is the batch's rows instead), else no reduction."""
MAX_CACHED_LAYOUTS = 8192


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class Capturer:
    """Turns hooks into captures for one rank. Owned by the training thread."""

    def __init__(
        self,
        config: AgentConfig,
        ident: RankIdentity,
        sink: Callable[[HostBatch], None],
        counters: Counters,
    ) -> None:
        self.config = config
        self.ident = ident
        self.counters = counters
        self.step = 0
        self.microbatch = 0
        self.stage = -1
        self._calls: Counter[tuple[int, str]] = Counter()
        self._bwd_seen: set[tuple] = set()
        self._no_grad_calls: dict[tuple, deque] = {}
        """(step, microbatch, site) → calls of forwards run without grad (reentrant checkpoint)."""
        self._ambiguous: set[tuple] = set()
        self.in_chunk = 0
        """Depth of pipeline-schedule chunk methods running now (agents/pipeline.py)."""
        self.outside_chunk = False
        """A watched pipeline stage's module started a forward outside any chunk method, and
        no chunk or step has started since: the schedule's shape inference (forward, then the
        loss and backward it runs to infer the gradients' shapes), which runs stage 0 on
        microbatch 0's data and later stages on empty tensors. What is captured meanwhile (the
        hooks' captures and `capture()` calls from the user's own hooks) would be stored under
        microbatch 0's key and conflict with the real one: counted as not captured instead
        (NOT_CAPTURED_SHAPE_INFERENCE). Set by the stage module's pre-hook, which runs before
        any other hook of it; cleared by the chunk methods (agents/pipeline.py)."""
        self.loss_microbatch: int | None = None
        """Microbatch of the last forward chunk whose loss has not been captured yet."""
        self._payload_sites: dict[tuple[str, str, str], bool] = {}
        """(phase, site, role) -> whether the `payload` globs ask for its bytes."""
        self._layouts: dict[tuple, PieceLayout] = {}
        """(phase, site, shape, replicate) -> layout of a plain tensor: the same for every
        capture of a site and shape (invalidated when hook_modules learns column shards)."""
        self._plans: dict[tuple, tuple | None] = {}
        """(phase, site, role, shape, strides, dtype) -> what every capture of such a plain CPU
        tensor shares (layout, dtype name, descriptor base and tail, payload size, ...), or None
        when it takes the general path: see :meth:`_capture_fast`. A DTensor's local shard is
        keyed by its DTensor layout too."""
        self._ragged_layouts: dict[tuple, PieceLayout] = {}
        """(rows, inner shape, offset, total, part, parts, span) -> a segment's ragged layout."""
        self._dtensor_layouts: dict[tuple, tuple] = {}
        """(id(mesh), placements, global shape, phase) -> (weak reference to the mesh, layout
        of this rank's shard): worked out once (torch's local shape and offset computation
        cost ~50 us a capture). The reference tells a reused id apart without keeping the
        mesh, and with it its process groups, alive until the interpreter's teardown."""
        self._batch_dims: dict[tuple[str, int], int] = {}
        """(site, output index) -> the dim a torch module's output holds the batch on, where
        it is not `config.batch_dim` (`output_batch_dims`)."""
        self._flat_views: dict[int, tuple] = {}
        """id(model) -> (weak reference to it, its FSDP1 views): `flat_views`."""
        self._logged: set[str] = set()
        self._handles: list = []
        self._local_batch: dict[tuple[int, int], int] = {}
        """(step, microbatch) -> dim 0 of this rank's input capture: the default reduce weight."""
        self._rows: int | None = config.microbatch_size
        """This rank's samples in the running microbatch (the watched model's input, else the
        input capture)."""
        self._batchless: set[tuple[str, tuple[int, ...]]] = set()
        """(site, shape) of module outputs that do not hold the batch (layout.holds_batch:
        size 1 on the batch dim, computed from an input holding the microbatch's `_rows`):
        replicas, their gradients addends of a sum over dp. Kept for the run: the same output
        in a microbatch of one sample per rank is the replica it was."""
        self._output_shards: dict[str, tuple[int, int, int]] = {}
        """Module site -> (dim, shards, coordinate) of a tensor-parallel output that each rank
        holds a block of as a plain tensor (:func:`output_sharding`, :meth:`_follow_shards`)."""
        self._declared: set[str] = set()
        """Sites whose output layout a tensor-parallel style states: not inferred from their
        inputs."""
        self._follow = ident.ranks_per_dp_rank > 1
        """Ranks besides the dp ranks exist (tp, cp, ep): plain outputs may be shards."""
        self._last_output: tuple | None = None
        """(site, shape, block or None) of the last hooked output: a module's hook runs after
        its submodules', so when that is a submodule's, it ran in this call of the module."""
        self._digester = Digester(config.digest)
        self._batches = Batcher(self._digester, config, sink, counters, self._failed,
                                batch_dims=self._batch_dims)
        """Captures of the running hook whose digests are not computed yet, and the batch
        their rows go to: :meth:`_drain` digests them in one call before the hook returns."""
        self._phases = frozenset(config.phases)
        self._fwd_on, self._bwd_on = "fwd" in self._phases, "bwd" in self._phases
        self._step_on = step_selected(config, self.step)
        self.op_frames: list = []
        """Frames of modules whose operations are captured now (agents/capture/ops.py): while any is
        open, the agent's own hooks pause that capture (`_paused`)."""
        self.ops_paused = 0
        self._run_grad_hook = not_traced(self._grad_hook_body)
        self._run_backward_hook = not_traced(self._backward_hook_body)
        """The gradient hooks' bodies, run eagerly under torch.compile (hooks.not_traced): one
        wrapper each for the capturer, bound into a partial per hooked tensor."""

    # -- what to capture ----------------------------------------------------------------------

    def wants(self, phase: str) -> bool:
        """Whether this phase is captured in the current step (cached per step: hooks ask
        this on every module call)."""
        return self._step_on and phase in self._phases

    def _wants_payload(self, phase: str, site: str, role: str) -> bool:
        key = (phase, site, role)
        wanted = self._payload_sites.get(key)
        if wanted is None:
            globs = self.config.payload
            wanted = matches(f"{phase}:{site}", globs) or matches(f"{phase}:{site}:{role}", globs)
            if len(self._payload_sites) >= MAX_CACHED_LAYOUTS:
                self._payload_sites.clear()
            self._payload_sites[key] = wanted
        return wanted

    # -- hooks ----------------------------------------------------------------------------------

    def hook_modules(self, model: torch.nn.Module, stage: int = -1, *,
                     pipelined: bool = False) -> int:
        """Hook every selected module of `model` (a whole model or one pipeline stage).

        `pipelined`: the module is driven by a pipeline schedule, and only forwards inside the
        schedule's chunk methods (`in_chunk`) are captured — not the schedule's own shape
        inference, which runs the stage once outside them: what it would capture is counted
        as not captured, and so is whatever `capture()` is asked for until the next chunk
        (:attr:`outside_chunk`).
        """
        n = 0
        cfg = self.config
        if pipelined:
            self._handles.append(model.register_forward_pre_hook(
                not_traced(self._stage_pre_hook), prepend=True))
        self._handles.append(model.register_forward_pre_hook(
            not_traced(self._rows_pre_hook), with_kwargs=True))
        for site, module in select_modules(model, cfg.modules, cfg.exclude, cfg.max_depth,
                                           cfg.block_depth):
            declared, shards = output_sharding(module, self.ident)
            if declared:
                self._declared.add(site)
                self._set_shards(site, shards)
            for index, dim in output_batch_dims(module).items():
                self._batch_dims[(site, index)] = dim
            hook = self._forward_hook(site, stage, pipelined)
            self._handles.append(module.register_forward_hook(hook))
            n += 1
        return n

    def _rows_pre_hook(self, module, args, kwargs) -> None:
        """Runs at every forward of a watched model or stage: its input's samples (`_rows`)."""
        if self._step_on:
            try:
                self._set_rows(batch_rows(args, kwargs, self.config.batch_dim))
            except Exception as exc:  # never into training
                self._failed("reading the batch size", exc)

    def _set_rows(self, rows: int | None) -> None:
        if rows is not None:
            self._rows = rows
            self._batches.rows = rows  # only pieces of this many samples get sample digests

    def _note_batchless(self, site: str, inputs: tuple, tensors: list) -> None:
        """Mark this call's outputs that do not hold the batch (`_batchless`); only outputs of
        size 1 on the batch dim are looked at further (rarely any)."""
        dim = self.config.batch_dim
        for index, t in enumerate(tensors):
            d = self._batch_dims.get((site, index), dim) if self._batch_dims else dim
            shape = tuple(t.shape)
            if len(shape) <= d or shape[d] != 1 or (site, shape) in self._batchless:
                continue
            if not holds_batch(shape, d, self._rows, [tuple(x.shape) for x in inputs
                                                     if isinstance(x, torch.Tensor)]):
                self._batchless.add((site, shape))
                self._layouts.clear()  # its plans and layouts were a share's
                self._plans.clear()

    def _stage_pre_hook(self, module, inputs) -> None:
        """Runs first at every forward of a pipeline stage's module: outside a chunk method it
        is the schedule's shape inference (:attr:`outside_chunk`)."""
        if not self.in_chunk:
            self.outside_chunk = True

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, site: str, stage: int, pipelined: bool = False):
        # Runs at every call of every hooked module: what it reads is cached (the phases in
        # _fwd_on / _bwd_on; the call counter inlined), each call level costing a microsecond
        # or two in a training step.
        def hook(module, inputs, output):
            if not self._step_on:  # a step the selection leaves out: nothing else to do
                return
            if self.op_frames and not self.ops_paused:  # inside a module whose operations
                return self._paused(hook, module, inputs, output)  # are captured (ops.py)
            try:
                if graph_task_id() != -1:  # in backward: a checkpoint's recomputation
                    self._replayed(site, stage, output)
                    return
                fwd, bwd = self._fwd_on, self._bwd_on
                if not (fwd or bwd):
                    return
                if pipelined and not self.in_chunk:  # the schedule's shape inference
                    self._skip_outside_chunk(output, fwd, bwd)
                    return
                mb = self.microbatch
                calls, key = self._calls, (mb, site)
                call = calls[key]
                calls[key] = call + 1
                st = stage if stage >= 0 else self.stage
                tensors = ([output] if type(output) is torch.Tensor else
                           [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)])
                if self._follow:
                    self._follow_shards(site, inputs, tensors)
                if self._rows is not None and self._rows > 1:
                    self._note_batchless(site, inputs, tensors)
                for index, t in enumerate(tensors):
                    if fwd and not self._capture_fast(t, "fwd", site, "output", index, call,
                                                      mb, st, self.step):
                        self._capture_one(t, phase="fwd", site=site, role="output",
                                          index=index, call=call, microbatch=mb, stage=st)
                    if bwd and t.requires_grad:  # self._grad_hook(...), inlined
                        add_grad_hook(t, functools.partial(self._run_grad_hook, site, index, call,
                                                           mb, st, self.step, None, "grad_output"))
                if bwd and tensors and not torch.is_grad_enabled():
                    # Maybe a reentrant checkpoint: its forward runs without grad and is run
                    # again in backward; remember the call so the replay keys its gradients.
                    key = (self.step, mb, site)
                    calls = self._no_grad_calls.setdefault(key, deque(maxlen=MAX_NO_GRAD_CALLS))
                    calls.append((call, st))
            except Exception as exc:  # never into training
                self._failed("forward hook", exc)
            self._batches.drain()

        wrapped = not_traced(hook)
        wrapped._numaudit_capture = True  # agents/capture/ops.py runs its own hook before this one
        return wrapped

    def _paused(self, fn, *args, **kwargs):
        """`fn` with op-level capture paused: the agent's own digest work is not the model's
        operations (agents/capture/ops.py)."""
        self.ops_paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.ops_paused -= 1

    def set_payload_globs(self, globs: tuple[str, ...]) -> tuple[str, ...]:
        """Make `globs` the payload globs (a directive's, for one step); returns the old ones.
        The plans and payload decisions cached per site are worked out again."""
        old = self.config.payload
        if globs != old:
            self.config = dataclasses.replace(self.config, payload=globs)
            self._payload_sites.clear()
            self._plans.clear()
        return old

    def _skip_outside_chunk(self, output, fwd: bool, bwd: bool) -> None:
        """Count what a hooked module's output outside any chunk would have been captured as."""
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        n = len(tensors) * fwd + sum(t.requires_grad for t in tensors) * bwd
        if n:
            self.counters.miss(NOT_CAPTURED_SHAPE_INFERENCE, n)

    def _set_shards(self, site: str, shards: tuple[int, int, int] | None) -> None:
        if self._output_shards.get(site) == shards:
            return
        if shards is None:
            del self._output_shards[site]
        else:
            self._output_shards[site] = shards
        self._layouts.clear()  # cached layouts and plans of this site are stale
        self._plans.clear()

    def _follow_shards(self, site: str, inputs: tuple, tensors: list) -> None:
        """Follow tensor-parallel blocks held as plain tensors through modules no style
        declares, and mark this call's plain outputs with their block (SHARD_MARK).

        A sequence-parallel model passes each rank's tokens between blocks as plain tensors
        (``x + self.w2(...)`` of two local blocks): a transformer block's output holds the
        same tokens as its input. So a module whose positional input is marked as a block of
        dim d, and whose output has that dim at the same size, outputs the same block; a
        module that gathers the dim (another size) or reduces it away does not. Without a
        marked input (a pipeline stage's first block, fed by the previous stage; a module
        whose input a PrepareModuleInput style gathers), a module whose last hooked submodule
        in this call output a block of its output's shape outputs that block (the residual
        add). Inferred wrongly either way, the pieces do not rebuild the reference's logical
        tensor and the comparison breaches: never a false pass.
        """
        shards = self._output_shards.get(site)
        if site not in self._declared:
            found = None
            for x in inputs:
                mark = _mark_of(x) if isinstance(x, torch.Tensor) else None
                if mark is not None:
                    found = _followed(mark, x, tensors)
                    break
            last = self._last_output
            if (found is None and last is not None and last[2] is not None and tensors
                    and last[0].startswith(f"{site}." if site else "")
                    and last[1] == tuple(tensors[0].shape) and not _is_dtensor(tensors[0])):
                # No marked input (a pipeline stage's first block gets its tokens from the
                # previous stage; PrepareModuleInput hands a module its input gathered), but
                # the submodule that ran last in this call output a block of this output's
                # shape: ``x + self.w2(...)`` adds that block to x.
                found = last[2]
            if found != shards:
                self._set_shards(site, found)
                shards = found
        if shards is not None:
            for t in tensors:  # plain tensors, and the AsyncCollectiveTensor a style's
                if not _is_dtensor(t):  # redistribute(async_op=True) leaves before to_local()
                    _mark(t, shards)
        if tensors:
            self._last_output = (site, tuple(tensors[0].shape), shards)

    def _replayed(self, site: str, stage: int, output) -> None:
        """A forward run again during backward: a checkpoint's recomputation, not a new call.

        A non-reentrant checkpoint's original outputs carry the gradient hooks already. A
        reentrant one (use_reentrant=True) ran its forward without grad, so the gradients flow
        only through this replay: hook its outputs under the original call's key. Which call a
        replay belongs to is known when the site ran once (without grad) in this microbatch;
        with several such calls the segments may replay in any order, so those are counted as
        not captured (NOT_CAPTURED_AMBIGUOUS) rather than keyed by a guess.
        """
        if not self.wants("bwd") or not torch.is_grad_enabled():
            return
        key = (self.step, self.microbatch, site)
        calls = self._no_grad_calls.get(key)
        if not calls:
            return
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
        if len(calls) > 1 or key in self._ambiguous:
            self._ambiguous.add(key)
            calls.popleft()
            self.counters.miss(NOT_CAPTURED_AMBIGUOUS, sum(t.requires_grad for t in tensors))
            return
        call, st = calls.popleft()
        for index, t in enumerate(tensors):  # indexed as in the original forward
            if t.requires_grad:
                add_grad_hook(t, self._grad_hook(site, index, call, self.microbatch, st, self.step))

    def _grad_hook(self, site: str, index: int, call: int, mb: int, stage: int, step: int,
                   layout: PieceLayout | None = None, role: str = "grad_output"):
        """The hook capturing the gradient of one hooked tensor (see :meth:`_backward_hook`:
        the same rules, in one partial, since one is made per hooked tensor and forward)."""
        return functools.partial(self._run_grad_hook, site, index, call, mb, stage, step,
                                 layout, role)

    def _grad_hook_body(self, site: str, index: int, call: int, mb: int, stage: int,
                        step: int, layout: PieceLayout | None, role: str, grad) -> None:
        try:
            key = (step, mb, site, index, call, role)
            if grad is None or key in self._bwd_seen:
                return
            self._bwd_seen.add(key)
            if layout is None and self._capture_fast(grad, "bwd", site, role, index, call, mb,
                                                     stage, step):
                self._batches.drain()
                return
            saved = self.step
            self.step = step  # the general path keys captures by self.step
            try:
                self._capture_one(grad, phase="bwd", site=site, role=role, index=index,
                                  call=call, microbatch=mb, stage=stage, layout=layout)
                self._batches.drain()
            finally:
                self.step = saved
        except Exception as exc:
            self._failed("backward hook", exc)

    def _backward_hook(self, key: tuple, step: int, capture: Callable[[torch.Tensor], None]):
        """A tensor hook that captures the gradient once per key, keyed by the forward's step.

        Split backward (ZBV, DualPipeV) can run a tensor's hooks in both the input-gradient and
        the weight-gradient action: one capture per key. Never raises into backward. (A
        partial of one function disabled for torch.compile once: wrapping a closure per
        registration cost tens of microseconds per hooked tensor.)
        """
        return functools.partial(self._run_backward_hook, key, step, capture)

    def _backward_hook_body(self, key: tuple, step: int, capture, grad) -> None:
        try:
            if grad is not None and key not in self._bwd_seen:
                self._bwd_seen.add(key)
                saved = self.step
                self.step = step
                try:
                    capture(grad)
                finally:
                    self.step = saved
        except Exception as exc:
            self._failed("backward hook", exc)

    def start_step(self, step: int) -> None:
        """Calls are numbered per (microbatch, site) within a step; a new step starts afresh."""
        self.step = step
        self._step_on = step_selected(self.config, step)
        self.microbatch = 0
        self.outside_chunk = False
        self._calls.clear()
        self._bwd_seen.clear()
        self._local_batch.clear()
        self._no_grad_calls.clear()
        self._ambiguous.clear()

    @contextlib.contextmanager
    def at_step(self, step: int) -> Iterator[None]:
        """Key the captures inside the block by `step` (selected whatever the step selection),
        then return to the current step: a checkpoint saved or loaded between steps."""
        saved = self.step, self._step_on
        self.step, self._step_on = step, True
        try:
            yield
        finally:
            self.step, self._step_on = saved

    # -- captures -------------------------------------------------------------------------------

    @not_traced
    def capture(
        self,
        t: torch.Tensor | None,
        *,
        phase: str,
        site: str,
        role: str = "value",
        index: int = 0,
        call: int = 0,
        microbatch: int | None = None,
        stage: int | None = None,
        layout: PieceLayout | None = None,
        rows=None,
        backward: bool = False,
        reduce: str | None = AUTO,
        weight: float | None = None,
        replicate: bool | None = None,
    ) -> None:
        """Digest one tensor (or record that it is None). Never raises.

        `rows` (agents.ragged.RaggedRows) makes it a ragged piece; `backward` also captures the
        gradient reaching `t` under phase bwd with the same layout. `reduce` ("mean" | "sum" |
        None; AUTO = "mean" for phase loss) says the tensor is this rank's reduction over its
        batch share, `weight` the elements a mean averaged over (default: microbatch_size, else
        dim 0 of this microbatch's input capture, else 1). `replicate` overrides whether a plain
        tensor is a replica over the non-dp mesh dims. Nothing is captured in a step that the
        step selection (`steps`, `step_every`, `step_first`) leaves out, nor during a pipeline
        schedule's shape inference (:attr:`outside_chunk`: counted as not captured).
        """
        if not self._step_on:
            return
        if self.outside_chunk:
            self.counters.miss(NOT_CAPTURED_SHAPE_INFERENCE)
            return
        if (layout is None and rows is None and not backward and replicate is None
                and t is not None and phase != "loss" and reduce in (AUTO, None)
                and self._capture_fast(t, phase, site, role, index, call,
                                       self.microbatch if microbatch is None else microbatch,
                                       self.stage if stage is None else stage, self.step)):
            self._drain()
            return
        self._capture_one(t, phase=phase, site=site, role=role, index=index, call=call,
                          microbatch=microbatch, stage=stage, layout=layout, rows=rows,
                          backward=backward, reduce=reduce, weight=weight, replicate=replicate)
        self._drain()

    def _capture_one(self, t, *, phase, site, role="value", index=0, call=0, microbatch=None,
                     stage=None, layout=None, rows=None, backward=False, reduce=AUTO,
                     weight=None, replicate=None) -> None:
        """Queue one capture for :meth:`_drain`. Never raises."""
        try:
            microbatch = self.microbatch if microbatch is None else microbatch
            stage = self.stage if stage is None else stage
            if reduce == AUTO:
                reduce = "mean" if phase == "loss" and not self._per_sample(t) else None
            if (layout is None and rows is None and reduce is not None and t is not None
                    and _is_dtensor(t)):
                layout, t = self._dtensor_reduction(t, reduce, weight, microbatch, phase, site,
                                                    replicate)
            plain = layout is None and t is not None and not _is_dtensor(t)
            if rows is not None and t is not None:
                layout = ragged_layout(tuple(t.shape), rows.offset, rows.total, part=rows.part,
                                       parts=rows.parts, span=rows.span)
            elif plain and reduce is not None:
                layout = reduction_layout(
                    tuple(t.shape), reduce, self._weight(weight, microbatch), self.ident.dp_rank,
                    self.ident.dp_size, replica=self.replicated(phase, site, replicate))
            elif plain:
                layout = self._plain_layout(t, phase, site, replicate, index)
            self._capture(t, phase, site, role, index, call, microbatch, stage, layout)
            if (backward and phase == "fwd" and self.wants("bwd") and t is not None
                    and t.requires_grad):
                add_grad_hook(t, self._grad_hook(site, index, call, microbatch, stage, self.step,
                                                 layout, grad_role(role)))
        except Exception as exc:
            self._failed(f"capture of {phase}:{site}", exc)

    def _per_sample(self, t: torch.Tensor | None) -> bool:
        """A loss that holds the batch (``reduction="none"``): not a 0-dim scalar, and as many
        elements on the batch dim as this rank's samples in the microbatch (`_rows`). It is
        this rank's rows of the batch's losses, joined with the other dp ranks' on that dim,
        not a reduction over them. False where the samples are not known."""
        if t is None or t.dim() == 0 or _is_dtensor(t) or self._rows is None:
            return False
        dim = self.config.batch_dim if self.config.batch_dim < t.dim() else 0
        return int(t.shape[dim]) == self._rows

    def _dtensor_reduction(self, t, reduce: str, weight, microbatch: int, phase: str, site: str,
                           replicate) -> tuple[PieceLayout | None, torch.Tensor]:
        """(layout, tensor) of a DTensor that is this rank's reduction over its batch share: a
        loss computed from DTensor logits. Replicated (loss_parallel's cross entropy): its
        local tensor is the value, an addend over dp like a plain loss. A mean left
        Partial(avg) (``logits.square().mean()`` of column-sharded logits): its local tensor
        is one addend of a mean over the partial mesh dims too, so the addends are indexed
        over dp x those dims. Anything else: (None, t), placed by its own layout."""
        from torch.distributed.tensor.placement_types import Partial, Replicate

        placements = tuple(t.placements)
        mesh = t.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return None, t
        partial = [d for d, p in enumerate(placements)
                   if isinstance(p, Partial) and p.reduce_op == "avg"]
        if any(not isinstance(p, Replicate) for d, p in enumerate(placements)
               if d not in partial) or (partial and reduce != "mean"):
            return None, t
        index, count = 0, 1
        for d in partial:
            index, count = index * mesh.size(d) + int(coordinate[d]), count * mesh.size(d)
        ident = self.ident
        if not ident.spans_dp(mesh):
            index, count = ident.dp_rank * count + index, ident.dp_size * count
        local = _local_shard(t)
        layout = reduction_layout(tuple(local.shape), reduce, self._weight(weight, microbatch),
                                  index, count, replica=self.replicated(phase, site, replicate))
        return layout, local

    def _weight(self, weight: float | None, microbatch: int) -> float:
        if weight is not None:
            return float(weight)
        if self.config.microbatch_size is not None:
            return float(self.config.microbatch_size)
        return float(self._local_batch.get((self.step, microbatch), 1))

    def replicated(self, phase: str, site: str, override: bool | None = None) -> bool:
        """Whether a plain tensor captured here is a replica of the same box on other ranks.

        Per capture `replicate=`, then `shard_sites` / `replicate_sites` globs on "phase:site";
        else inferred: every rank holding the same dp rank (tp, cp, ep ranks) captures it too.
        """
        if override is not None:
            return override
        key = f"{phase}:{site}"
        if self.config.shard_sites and matches(key, self.config.shard_sites):
            return False
        if self.config.replicate_sites and matches(key, self.config.replicate_sites):
            return True
        return self.ident.ranks_per_dp_rank > 1

    def _plain_layout(self, t: torch.Tensor, phase: str, site: str,
                      replicate: bool | None, index: int = 0) -> PieceLayout:
        shape = tuple(t.shape)
        if phase == "input" and shape:
            dim = self.config.batch_dim
            rows = self._local_batch[(self.step, self.microbatch)] = shape[dim if dim < len(shape)
                                                                           else 0]
            if rows > 1 or self._rows is None:
                self._set_rows(rows)
        dim = self._batch_dims.get((site, index), self.config.batch_dim)
        key = (phase, site, shape, replicate, dim)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= MAX_CACHED_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = self._new_plain_layout(shape, phase, site, replicate,
                                                                 dim)
        return layout

    def _new_plain_layout(self, shape: tuple[int, ...], phase: str, site: str,
                          replicate: bool | None, dim: int) -> PieceLayout:
        if phase in PER_STEP_PHASES:
            layout = PieceLayout.full(shape)
            replica = self.ident.dp_size > 1 or self.replicated(phase, site, replicate)
            return dataclasses.replace(layout, replica=replica)
        if (site, shape) in self._batchless and phase in ("fwd", "bwd"):
            # the same on every dp rank (rotary cos/sin): a replica; its gradient, each dp
            # rank's sum over its samples, an addend of a sum over the dp ranks
            replica = self.ident.dp_size > 1 or self.replicated(phase, site, replicate)
            if phase == "bwd" and self.ident.dp_size > 1:
                return reduction_layout(shape, "sum", 1.0, self.ident.dp_rank,
                                        self.ident.dp_size,
                                        replica=self.replicated(phase, site, replicate))
            return dataclasses.replace(PieceLayout.full(shape), replica=replica)
        layout = batch_layout(shape, self.ident.dp_rank, self.ident.dp_size, dim)
        shards = self._output_shards.get(site) if phase in ("fwd", "bwd") else None
        if shards is not None and replicate is None and not (
                self.config.replicate_sites
                and matches(f"{phase}:{site}", self.config.replicate_sites)):
            return dim_shard_layout(layout, *shards)
        return dataclasses.replace(layout, replica=self.replicated(phase, site, replicate))

    def capture_segments(self, t: torch.Tensor, counts, rows, *, phase: str, site: str,
                         role: str, microbatch: int | None = None, stage: int | None = None,
                         backward: bool = False) -> None:
        """Capture ``t.split(counts)`` as ragged pieces, segment e under index e. Never raises.

        `backward`: one hook on `t` itself (the segments are views autograd never reaches)
        splits the gradient the same way and captures each segment under phase bwd. Nothing
        is captured in a step that the step selection leaves out, nor during a pipeline
        schedule's shape inference (counted as not captured, one per segment).
        """
        if not self._step_on:
            return
        if self.outside_chunk:
            self.counters.miss(NOT_CAPTURED_SHAPE_INFERENCE, len(counts))
            return
        try:
            microbatch = self.microbatch if microbatch is None else microbatch
            stage = self.stage if stage is None else stage
            counts = [int(c) for c in counts]
            layouts = self._segment_layouts(tuple(t.shape[1:]), counts, rows)
            if len(layouts) != len(counts):
                raise ValueError(f"rows: {len(layouts)} places for {len(counts)} segments")
            self._capture_split(t, counts, layouts, phase, site, role, microbatch, stage,
                                self.step)
            self._drain()
            if backward and phase == "fwd" and self.wants("bwd") and t.requires_grad:
                t.register_hook(self._segments_grad_hook(site, counts, layouts, microbatch,
                                                         stage, self.step, grad_role(role)))
        except Exception as exc:
            self._failed(f"capture of {phase}:{site}", exc)

    def _segments_grad_hook(self, site: str, counts: list[int], layouts: list[PieceLayout],
                            mb: int, stage: int, step: int, role: str = "grad_output"):
        def capture(grad):
            self._capture_split(grad, counts, layouts, "bwd", site, role, mb, stage, step)
            self._drain()

        return self._backward_hook((step, mb, site, "segments", role), step, capture)

    def _segment_layouts(self, rest: tuple[int, ...], counts: list[int],
                         rows) -> list[PieceLayout]:
        """The ragged layout of each segment (``rows[e]`` places segment e's ``counts[e]``
        rows), one object per distinct place: cached, as a segment's layout repeats whenever
        its expert's share of the routing does."""
        cache = self._ragged_layouts
        out = []
        for n, r in zip(counts, rows):
            key = (n, rest, r.offset, r.total, r.part, r.parts, r.span)
            layout = cache.get(key)
            if layout is None:
                layout = ragged_layout((n, *rest), r.offset, r.total, part=r.part,
                                       parts=r.parts, span=r.span)
                if len(cache) >= MAX_CACHED_LAYOUTS:
                    cache.clear()
                cache[key] = layout
            out.append(layout)
        return out

    def _capture_split(self, t: torch.Tensor, counts: list[int], layouts: list[PieceLayout],
                       phase: str, site: str, role: str, microbatch: int, stage: int,
                       step: int) -> None:
        """Queue ``t.split(counts)`` under ``layouts``, segment e under index e: through a
        plan cached per site, inner shape, strides and dtype when the fused kernel reads ``t``
        (the segments' descriptors then differ only in their row count, address and base),
        else piece by piece through the general path. Raises for counts that do not split
        ``t``."""
        if self._split_fast(t, counts, layouts, phase, site, role, microbatch, stage, step):
            return
        saved = self.step
        self.step = step  # the general path keys captures by self.step
        try:
            for e, (piece, layout) in enumerate(zip(t.split(counts), layouts)):
                self._capture(piece, phase, site, role, e, 0, microbatch, stage, layout)
        finally:
            self.step = saved

    def _split_fast(self, t: torch.Tensor, counts: list[int], layouts: list[PieceLayout],
                    phase: str, site: str, role: str, microbatch: int, stage: int,
                    step: int) -> bool:
        if type(t) is not torch.Tensor or not t.is_cpu or not t.dim() or sum(counts) != len(t):
            return False
        key = ("split", phase, site, role, t.shape[1:], t.stride(), t.dtype)
        plan: tuple | Literal[False] | None = self._plans.get(key, False)
        if plan is False:
            plan = self._new_split_plan(t, phase, site, role)
            if len(self._plans) >= MAX_CACHED_LAYOUTS:
                self._plans.clear()
            self._plans[key] = plan
        if plan is None:
            return False
        dtype, moments, code, ndim, row_bytes, row_gstride, row_step, stride0, tail, \
            payload_all, phase_id, role_id = plan
        limit = self.config.payload_max_bytes
        batches = self._batches
        queue = batches.fused
        at = t.data_ptr()
        for e, (n, layout) in enumerate(zip(counts, layouts)):
            nbytes = n * row_bytes
            payload, payload_at = (batches.payload_buffer(nbytes)
                                   if payload_all or 0 < nbytes <= limit else (None, 0))
            queue.append((
                Capture(step, microbatch, phase_id, site, role_id, e, 0, stage, layout, dtype,
                        False, moments, False, -1, payload),
                pack_head(at, code, ndim, layout.offsets[0] * row_gstride, payload_at)
                + _DIM(n, stride0, row_gstride) + tail, t))
            at += n * row_step
        self.counters.captured += len(counts)
        return True

    def _new_split_plan(self, t: torch.Tensor, phase: str, site: str, role: str) -> tuple | None:
        """What :meth:`_split_fast` needs for row segments of tensors like ``t``; None when the
        fused kernel does not read it (complex included)."""
        if t.dtype.is_complex or not self._digester.takes(t):
            return None
        rest = tuple(t.shape[1:])
        gstrides = [1] * t.dim()
        for d in range(t.dim() - 2, -1, -1):  # row-major over the logical (rows, *rest)
            gstrides[d] = gstrides[d + 1] * t.shape[d + 1]
        stride0 = t.stride(0)
        tail = descriptor_tail(t, gstrides)[_DIM_BYTES:]  # dims 1..: the same for every segment
        return (_dtype_name(t.dtype), has_moments(t.dtype), DTYPE_CODES[t.dtype], t.dim(),
                math.prod(rest) * t.element_size(), gstrides[0], stride0 * t.element_size(),
                stride0, tail, bool(self.config.payload and self._wants_payload(phase, site, role)),
                PHASE_IDS[phase], ROLE_IDS[role])

    def _capture_fast(self, t: torch.Tensor, phase: str, site: str, role: str, index: int,
                      call: int, microbatch: int, stage: int, step: int,
                      layout: PieceLayout | None = None) -> bool:
        """Capture a plain CPU tensor with the default layout through a cached plan; False
        (nothing done) when it takes the general path (:meth:`_capture_one`). Never raises.

        Everything but the data pointer is the same for every capture of a site, role, shape,
        strides and dtype, so it is worked out once (:meth:`_new_plan`): a capture here is one
        dict lookup, the descriptor (one struct pack), the Capture and, for small pieces, the
        payload buffer. In a training step Python runs with cold caches between the model's
        ops, where each line of the general path cost several times what a loop over it
        measures. `layout`: a plain tensor's layout when the caller worked it out (op-level
        captures, agents/capture/ops.py; the same object for every capture it holds for).
        """
        try:
            tt = type(t)
            dt_layout = layout
            if tt is not torch.Tensor and tt is not torch.nn.Parameter:
                if not _is_dtensor(t):
                    return False
                # A DTensor (an FSDP2 parameter or its gradient, a tensor-parallel activation):
                # its local shard with the DTensor's layout, without the DTensor ops that
                # detach() and to_local() dispatch (~35 us a capture).
                try:
                    dt_layout = self._dtensor_layout(t, phase)
                except Exception:  # placements it cannot place: the general path reports it
                    return False
                if dt_layout.partial and _avg_ranks(t) > 1:  # its addend is not its bytes
                    return False
                t = _local_shard(t)
                if type(t) is not torch.Tensor:  # e.g. a collective's result not waited for yet
                    return False
            if not t.is_cpu:
                return False
            # the batch dim, where a torch module states one for this output (rarely: no lookup
            # when none does), so that captures under other indices share the plan
            dim = self._batch_dims.get((site, index), -1) if self._batch_dims else -1
            key = ((phase, site, role, dim, t.shape, t.stride(), t.dtype) if dt_layout is None
                   else (phase, site, role, dim, t.shape, t.stride(), t.dtype, id(dt_layout)))
            plan: tuple | Literal[False] | None = self._plans.get(key, False)
            if plan is False or (dt_layout is not None and plan is not None
                                 and plan[0] is not dt_layout):
                plan = self._new_plan(t, phase, site, role, dt_layout, index)
                if len(self._plans) >= MAX_CACHED_LAYOUTS:
                    self._plans.clear()
                self._plans[key] = plan
            if plan is None:
                return False
            layout, dtype, moments, code, ndim, base, tail, payload_n, phase_id, role_id = plan
            self.counters.captured += 1  # Counters.add_captured, without the call
            payload, payload_at = (self._batches.payload_buffer(payload_n) if payload_n
                                   else (None, 0))
            self._batches.fused.append((
                Capture(step, microbatch, phase_id, site, role_id, index, call, stage,
                        layout, dtype, False, moments, False, -1, payload),
                pack_head(t.data_ptr(), code, ndim, base, payload_at) + tail, t))
        except Exception as exc:
            self._failed(f"capture of {phase}:{site}", exc)
        return True

    def _new_plan(self, t: torch.Tensor, phase: str, site: str, role: str,
                  layout: PieceLayout | None = None, index: int = 0) -> tuple | None:
        """What :meth:`_capture_fast` needs for tensors like ``t`` (of ``layout``; None: a plain
        tensor's); None for the general path (no fused kernel, a dtype it does not read,
        complex)."""
        if phase == "input":  # its layout also records the microbatch's batch size
            return None
        if layout is None:
            layout = self._plain_layout(t, phase, site, None, index)
        plan = self._digester.fused_plan(t, layout)
        if plan is None:
            return None
        nbytes = t.nbytes
        payload_n = nbytes if ((0 < nbytes <= self.config.payload_max_bytes) or (
            self.config.payload and self._wants_payload(phase, site, role))) else 0
        return (layout, _dtype_name(t.dtype), has_moments(t.dtype), *plan, payload_n,
                PHASE_IDS[phase], ROLE_IDS[role])

    def _dtensor_layout(self, t, phase: str) -> PieceLayout:
        """The layout of this rank's shard of DTensor ``t`` (agents.layout.dtensor_layout)
        captured under `phase` (:meth:`_in_world`), cached per mesh, placements, global
        shape and phase."""
        mesh = t.device_mesh
        key = (id(mesh), tuple(t.placements), t.shape, phase)
        hit = self._dtensor_layouts.get(key)
        if hit is None or hit[0]() is not mesh:
            # raises for placements it cannot place: not cached
            layout = self._in_world(dtensor_layout(t), mesh, phase)
            if len(self._dtensor_layouts) >= MAX_CACHED_LAYOUTS:
                self._dtensor_layouts.clear()
            hit = self._dtensor_layouts[key] = (weakref.ref(mesh), layout)
        return hit[1]

    def _in_world(self, layout: PieceLayout, mesh, phase: str) -> PieceLayout:
        """Place a DTensor whose mesh leaves out some dims of the job's mesh (the one given to
        attach). Without the dp dim (a tensor-parallel activation on ``mesh["tp"]`` beside
        FSDP2 or DDP) it is one dp rank's value: its activations are that dp rank's rows of
        the batch, placed as a plain tensor's are, and its per-step values replicas over dp.
        Without another dim (an FSDP2 parameter on ``mesh["dp"]`` that no tensor-parallel plan
        covers) the ranks along that dim hold copies of it: replicas, which the comparison
        checks against each other. (Along a pipeline's dim the copies are other stages' other
        sites: each box still has one holder.)"""
        ident = self.ident
        beside_dp = ident.dp_size > 1 and bool(ident.dp_dim_names) and not ident.spans_dp(mesh)
        copies = ident.lacks_peers(mesh)
        if (beside_dp and phase in PER_STEP_PHASES) or (copies and not layout.partial):
            layout = dataclasses.replace(layout, replica=True)
        if not beside_dp or phase in PER_STEP_PHASES or phase == "loss" or not layout.shape:
            return layout
        rows = layout.logical_shape[0]
        return dataclasses.replace(
            layout, logical_shape=(rows * ident.dp_size, *layout.logical_shape[1:]),
            offsets=(layout.offsets[0] + ident.dp_rank * rows, *layout.offsets[1:]))

    def _capture(self, t, phase, site, role, index, call, microbatch, stage, layout) -> None:
        cap = Capture(
            step=self.step, microbatch=microbatch, phase=PHASE_IDS[phase], site=site,
            role=ROLE_IDS[role], index=index, call=call, stage=stage, layout=None, dtype="",
        )
        self.counters.add_captured(1)
        if t is None:
            cap.is_none, cap.moments = True, False
            self._batches.add_none(cap)
            return
        if _is_dtensor(t):
            local = _local_shard(t)
            if layout is None:
                layout = self._dtensor_layout(t, phase)
                n = _avg_ranks(t) if layout.partial else 1
                if n > 1 and (local.dtype.is_floating_point or local.dtype.is_complex):
                    # Partial("avg"): the value is the mean of the addends, so each is its local
                    # tensor over their count as a Partial sum's addend
                    local = local.detach() / n
        else:
            if type(t) is not torch.Tensor:
                t = t.detach()  # a Parameter becomes a plain tensor, which the fused kernel reads
            local = t
            if layout is None:
                layout = self._plain_layout(t, phase, site, None, index)
        cap.dtype = _dtype_name(local.dtype)
        if local.dtype.is_complex:  # the dtype attribute: Tensor.is_complex() is a dispatched call
            local = torch.view_as_real(local.detach())
            layout = complex_real_layout(layout)
            cap.complex_as_real = True
            cap.dtype = _dtype_name(local.dtype)
        cap.layout = layout
        cap.moments = has_moments(local.dtype)
        fused = self._digester.takes(local)
        if not fused:
            local = local.detach()  # the fused kernel reads the bytes; eager ops need no graph
        payload_at = 0 if fused else None
        nbytes = local.nbytes
        if ((0 < nbytes <= self.config.payload_max_bytes)
                or (self.config.payload and self._wants_payload(phase, site, role))):
            # A copy taken now: the tensor may be changed in place after the hook returns. The
            # fused kernel copies the bytes while it digests them; from an accelerator the copy
            # is started, never waited for (agents/digest/device_copy.py).
            if fused:
                cap.payload, payload_at = self._batches.payload_buffer(nbytes)
            elif local.is_cpu:
                cap.payload = local.to("cpu", copy=True).contiguous()
            else:
                cap.payload = payload_copy(local)
        self._batches.add(cap, local, layout, payload_at)

    def _drain(self) -> None:
        """Digest the pending captures in one call (agents/digest/batching.py). Never raises.

        Runs before the hook that queued them returns, so no tensor can have been changed in
        place in between (an in-place ReLU after the module, the optimizer after the sweep).
        """
        self._batches.drain()

    def capture_parameters(self, model: torch.nn.Module, *, grads: bool, stage: int = -1) -> None:
        """Capture every parameter's gradient (None recorded explicitly) or value."""
        phase = "grad" if grads else "param"
        if not self.wants(phase):
            return
        items = ((normalize_site(name), stage, p) for name, p in model.named_parameters())
        self.capture_values(fsdp1.sweep(items, self.flat_views([model]), grads, self._failed),
                            phase=phase)

    def flat_views(self, models) -> dict[int, list[fsdp1.FlatView]]:
        """The FSDP1 FlatParameters of `models`, as views per original parameter
        (agents.capture.fsdp1.expand). Worked out at a model's first sweep and kept: FSDP1 makes its
        FlatParameters when it wraps the model, before training (a walk over the modules cost
        1.8 ms a sweep for 1,200 of them), and the views read gradients when asked. Never
        raises: FSDP1 internals it does not know leave that model's flat parameters as they
        are (counted)."""
        views: dict[int, list[fsdp1.FlatView]] = {}
        for model in models:
            hit = self._flat_views.get(id(model))
            if hit is None or hit[0]() is not model:
                try:
                    found = fsdp1.expand(model, self.ident.dp_size,
                                         self.ident.ranks_per_dp_rank > 1)
                except Exception as exc:
                    self._failed("reading FSDP1's flat parameters", exc)
                    found = {}
                hit = self._flat_views[id(model)] = (weakref.ref(model), found)
            views.update(hit[1])
        return views

    def capture_values(self, items, *, phase: str) -> None:
        """Capture step-level values, ``(site, stage, tensor or None, layout or None)`` items,
        under ``phase`` (role value; None recorded explicitly; layout None: the tensor's own): a
        sweep over parameters or their gradients, digested in one kernel call and handed to the
        sender. Never raises."""
        if not self._step_on:
            return
        try:
            for site, stage, t, layout in items:
                if t is None or layout is not None or not self._capture_fast(
                        t, phase, site, "value", 0, 0, STEP_LEVEL, stage, self.step):
                    self._capture_one(t, phase=phase, site=site, role="value",
                                      microbatch=STEP_LEVEL, stage=stage, layout=layout)
        except Exception as exc:
            self._failed(f"sweep of {phase}", exc)
        self._drain()
        self.flush()

    def flush(self) -> None:
        """Hand the pending digests to the sender (see Batcher.flush)."""
        self._batches.flush()

    def unsent(self) -> int:
        """Captures not handed to the sender yet (see Batcher.unsent)."""
        return self._batches.unsent()

    def _failed(self, what: str, exc: Exception) -> None:
        self.counters.error()
        if what not in self._logged:
            self._logged.add(what)
            log.warning("rank %d: numaudit %s failed (further failures counted silently): %r",
                        self.ident.rank, what, exc)


SHARD_MARK = "_numaudit_shard"
"""Attribute a plain tensor-parallel output carries: its (dim, shards, coordinate), so that the
modules it flows into can tell their outputs are blocks too (`Capturer._follow_shards`)."""


def _mark(t: torch.Tensor, shards: tuple[int, int, int]) -> None:
    """Mark `t`, and its base when `t` is a whole view of it: a module's input is often such
    a view of what an earlier module returned (FSDP2's pre-forward hands its module views of
    the arguments, and their base is the tensor the previous module's view was made from)."""
    try:
        setattr(t, SHARD_MARK, shards)
        if t._is_view():
            base = t._base  # a view's: not None
            if base is not None and base.shape == t.shape:
                setattr(base, SHARD_MARK, shards)
    except (AttributeError, TypeError, RuntimeError):  # a subclass without attributes: the
        pass  # modules it flows into are taken as replicas


def _mark_of(x: torch.Tensor) -> tuple[int, int, int] | None:
    """The block `x` is marked as: its own mark, or its base's when it is a whole view of it."""
    mark = getattr(x, SHARD_MARK, None)
    if mark is None and x._is_view():
        base = x._base  # a view's: not None
        if base is not None and base.shape == x.shape:
            mark = getattr(base, SHARD_MARK, None)
    return mark


def _followed(mark: tuple[int, int, int], x: torch.Tensor,
              tensors: list) -> tuple[int, int, int] | None:
    """The block of a module's output whose input `x` is the block `mark`: the same when the
    first output keeps x's rank and the sharded dim's size, else None."""
    dim, shards, coordinate = mark
    n = x.dim()
    d = dim + n if dim < 0 else dim
    out = tensors[0] if tensors else None
    if (out is None or _is_dtensor(out) or out.dim() != n or not 0 < d < n
            or out.shape[d] != x.shape[d]):
        return None
    return d, shards, coordinate


def output_sharding(module: torch.nn.Module,
                    ident: RankIdentity) -> tuple[bool, tuple[int, int, int] | None]:
    """(declared, block): whether a tensor-parallel style states `module`'s output layout,
    and if so the (dim, shards, coordinate) of the plain tensor each rank holds (None: a
    replica, or a DTensor that carries its own layout).

    A ColwiseParallel or RowwiseParallel module converts its output to ``output_layouts`` in a
    forward hook (``torch.distributed.tensor.parallel``), and hands each rank its local tensor
    when ``use_local_output``: a Shard(d) there is a block of dim d (Colwise's default Shard(-1)
    is a column block, a sequence-parallel Rowwise's Shard(1) a block of tokens); Replicate is
    a replica. PrepareModuleOutput states it the same way. (A sharded weight says nothing by
    itself: FSDP2 shards weights on dim 0 too, and gathers them before the forward.)
    """
    declared = _style_output(module)
    if declared is None:
        return False, None
    placements, local, mesh = declared
    return True, (_mesh_block(placements, mesh, ident) if local else None)


def _style_output(module: torch.nn.Module):
    """(output placements, use_local_output, mesh) a tensor-parallel style's forward hook on
    `module` converts its output to, or None (no such hook, or one this cannot read)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import PrepareModuleOutput
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    for hook in module._forward_hooks.values():
        cells = []
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
        if mesh is None:
            continue
        for c in cells:
            if (isinstance(c, functools.partial) and len(c.args) == 2
                    and getattr(c.func, "__name__", "") == "_prepare_output_fn"):
                return tuple(c.args[0]), bool(c.args[1]), mesh  # Colwise/RowwiseParallel
            if isinstance(c, PrepareModuleOutput) and len(c.desired_output_layouts) == 1:
                return tuple(c.desired_output_layouts), bool(c.use_local_output), mesh
    return None


def _mesh_block(placements: tuple, mesh, ident: RankIdentity) -> tuple[int, int, int] | None:
    """(dim, shards, coordinate) of this rank's local tensor under `placements` on a 1-dim
    non-dp `mesh` when they shard one dim; None for a replica (or what this cannot place)."""
    from torch.distributed.tensor.placement_types import Shard

    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
        return None
    coordinate = mesh.get_coordinate()
    if coordinate is None or ident.is_dp_mesh(mesh):
        return None
    return int(placements[0].dim), int(mesh.size(0)), int(coordinate[0])


_DTENSOR: list = []

_DIM_STRUCT = struct.Struct("<3q")
"""One dim of a descriptor's tail: ``(size, stride, gstride)``."""
_DIM, _DIM_BYTES = _DIM_STRUCT.pack, _DIM_STRUCT.size


def output_batch_dims(module: torch.nn.Module) -> dict[int, int]:
    """Output index -> the dim holding the batch, for torch modules that say so themselves:
    RNNs (output: 0 with `batch_first`, else 1; the hidden states (h_n, c_n): always 1),
    MultiheadAttention (output as `batch_first` says; attention weights: 0) and the Transformer
    layers and stacks (`batch_first`). Other modules: {} (config.batch_dim)."""
    nn = torch.nn
    if isinstance(module, nn.RNNBase):
        return {0: 0 if module.batch_first else 1, 1: 1, 2: 1}
    if isinstance(module, nn.MultiheadAttention):
        return {0: 0 if module.batch_first else 1, 1: 0}
    if isinstance(module, nn.Transformer):
        first = module.batch_first
    elif isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        first = module.self_attn.batch_first
    elif isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and module.layers:
        first = module.layers[0].self_attn.batch_first
    else:
        return {}
    return {0: 0 if first else 1}


def _avg_ranks(t) -> int:
    """The addends a DTensor's Partial("avg") placements average over (1: none)."""
    n = 1
    for d, p in enumerate(t.placements):
        if p.is_partial() and getattr(p, "reduce_op", "") == "avg":
            n *= t.device_mesh.size(d)
    return n


def _local_shard(t):
    """A DTensor's local shard as its bytes are: the tensor it wraps (``to_local()`` would
    dispatch an autograd function to return a view of it)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def _is_dtensor(t: torch.Tensor) -> bool:
    if type(t) is torch.Tensor:  # the common case, without the isinstance below
        return False
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR.append(())  # isinstance against no type: never a DTensor
        else:
            _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])
