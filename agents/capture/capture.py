"""Capture: module and parameter hooks → digests on the tensor's device → batched host transfer.

Everything here runs on the training thread, so it is bounded and cheap: a hook computes the
digest of each tensor it sees on that tensor's device (vectorized, no host sync on CUDA). CPU
pieces go through the fused kernel, which writes their rows straight into the host batch's
buffers and copies small pieces' payload bytes in the same pass; rows computed on an
accelerator are kept, and every `device_batch` captures (or at a microbatch or step boundary)
stacked and sent to the host in one asynchronous copy (agents/digest/batching.py). The sender thread
waits for that copy, builds records and does all network I/O. No hook ever raises into training:
failures are counted, logged once per kind with the rank, and the capture is dropped.

The `Capturer` owns the per-rank capture state and the captures' entry points; its module and
gradient hooks (module_hooks.py), the layouts of its pieces (piece_layouts.py) and its fast path
through cached fused-kernel plans (fused_plans.py) are functions of the capturer, bound in its
class body as its methods. The caches of those two are their modules' own types, held here:
`LayoutCache` (``_layouts``) and `PlanCache` (``_plans``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator

import torch

from numaudit.agents.capture import fsdp1, fused_plans, module_hooks, piece_layouts
from numaudit.agents.capture.fused_plans import PlanCache, dtype_name
from numaudit.agents.capture.hooks import add_grad_hook, grad_role, not_traced
from numaudit.agents.capture.module_hooks import NOT_CAPTURED_SHAPE_INFERENCE, LastOutput
from numaudit.agents.capture.piece_layouts import MAX_CACHED_LAYOUTS, LayoutCache
from numaudit.agents.capture.sharding import OutputBlock, avg_ranks, is_dtensor, local_shard
from numaudit.agents.capture.sites import matches, normalize_site
from numaudit.agents.config import AgentConfig, step_selected
from numaudit.agents.digest.batching import Batcher, Capture, Counters, HostBatch  # noqa: F401 (re-exported)
from numaudit.agents.digest.device_copy import payload_copy
from numaudit.agents.digest.digest import has_moments
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.identity import RankIdentity
from numaudit.agents.layout import PieceLayout, complex_real_layout, ragged_layout, reduction_layout
from numaudit.wire.vocabulary import PHASE_IDS, ROLE_IDS

log = logging.getLogger(__name__)

STEP_LEVEL = -1  # microbatch id of per-step captures (grad, param, optim_grad, update)
AUTO = "auto"
"""`reduce` default of capture(): "mean" for phase loss (a per-rank mean loss; a per-sample loss
vector is the batch's rows instead), else no reduction."""


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
        """Keys of the gradients captured in this step (a gradient hook's: step, microbatch,
        site, index, call, role; other backward hooks' their own): one capture per key."""
        self._no_grad_calls: dict[tuple[int, int, str], deque[tuple[int, int]]] = {}
        """(step, microbatch, site) -> (call, stage) of its forwards run without grad (a
        reentrant checkpoint's, replayed in backward: `replayed`)."""
        self._ambiguous: set[tuple[int, int, str]] = set()
        """(step, microbatch, site) whose no-grad forwards replay in an order not known."""
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
        self._layouts = LayoutCache()
        """Pieces' layouts, worked out once per site and shape (agents/capture/piece_layouts.py)."""
        self._plans = PlanCache()
        """The fast path's plans, worked out once per site, shape, strides and dtype
        (agents/capture/fused_plans.py)."""
        self._batch_dims: dict[tuple[str, int], int] = {}
        """(site, output index) -> the dim a torch module's output holds the batch on, where
        it is not `config.batch_dim` (`output_batch_dims`)."""
        self._flat_views: dict[int, tuple[weakref.ref, dict[int, list[fsdp1.FlatView]]]] = {}
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
        self._output_shards: dict[str, OutputBlock] = {}
        """Module site -> the block this rank holds of its tensor-parallel output, held as a
        plain tensor (:func:`output_sharding`, :meth:`_follow_shards`)."""
        self._declared: set[str] = set()
        """Sites whose output layout a tensor-parallel style states: not inferred from their
        inputs."""
        self._follow = ident.ranks_per_dp_rank > 1
        """Ranks besides the dp ranks exist (tp, cp, ep): plain outputs may be shards."""
        self._last_output: LastOutput | None = None
        """The last hooked output, when it is a tensor-parallel block (:meth:`_follow_shards`)."""
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

    # -- hooks: agents/capture/module_hooks.py ------------------------------------------------

    hook_modules = module_hooks.hook_modules
    _rows_pre_hook = module_hooks.rows_pre_hook
    _set_rows = module_hooks.set_rows
    _note_batchless = module_hooks.note_batchless
    _stage_pre_hook = module_hooks.stage_pre_hook
    remove_hooks = module_hooks.remove_hooks
    _forward_hook = module_hooks.forward_hook
    _skip_outside_chunk = module_hooks.skip_outside_chunk
    _set_shards = module_hooks.set_shards
    _follow_shards = module_hooks.follow_shards
    _replayed = module_hooks.replayed
    _grad_hook = module_hooks.grad_hook
    _grad_hook_body = module_hooks.grad_hook_body
    _backward_hook = module_hooks.backward_hook
    _backward_hook_body = module_hooks.backward_hook_body

    # -- layouts and fused-kernel plans: agents/capture/piece_layouts.py, fused_plans.py ------

    _per_sample = piece_layouts.per_sample
    _dtensor_reduction = piece_layouts.dtensor_reduction
    _weight = piece_layouts.weight
    replicated = piece_layouts.replicated
    _plain_layout = piece_layouts.plain_layout
    _new_plain_layout = piece_layouts.new_plain_layout
    _segment_layouts = piece_layouts.segment_layouts
    _dtensor_layout = piece_layouts.dtensor_piece_layout
    _in_world = piece_layouts.in_world
    _capture_split = fused_plans.capture_split
    _split_fast = fused_plans.split_fast
    _new_split_plan = fused_plans.new_split_plan
    _capture_fast = fused_plans.capture_fast
    _new_plan = fused_plans.new_plan

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
                    and is_dtensor(t)):
                layout, t = self._dtensor_reduction(t, reduce, weight, microbatch, phase, site,
                                                    replicate)
            plain = layout is None and t is not None and not is_dtensor(t)
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
        if is_dtensor(t):
            local = local_shard(t)
            if layout is None:
                layout = self._dtensor_layout(t, phase)
                n = avg_ranks(t) if layout.partial else 1
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
        cap.dtype = dtype_name(local.dtype)
        if local.dtype.is_complex:  # the dtype attribute: Tensor.is_complex() is a dispatched call
            local = torch.view_as_real(local.detach())
            layout = complex_real_layout(layout)
            cap.complex_as_real = True
            cap.dtype = dtype_name(local.dtype)
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

