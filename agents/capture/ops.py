"""Op-level captures: every operation inside the forward and backward of named modules.

A drill-down (docs/drill-down.md) asks where inside a module two runs part ways: the matmul, the
softmax scale, a cast to bfloat16, a collective left out. For the modules whose site matches
`AgentConfig.ops` (``NUMAUDIT_OPS``, a plan file, or a live directive of the auditor), on the
selected steps only:

- forward: a TorchDispatchMode is entered by the module's forward pre-hook and left by its
  forward hook, so it sees every aten operation the module runs (and torch's collectives as
  dispatch exposes them: ``c10d.allreduce_`` and the other in-place ProcessGroup ops, the
  functional ``_c10d_functional.*`` ones), below autograd, DTensor ops as DTensor ops. Each
  operation's tensor inputs are digested before it runs and its outputs after, under the site
  ``<module>/<n>:<op>`` (wire/ops.py), role input/output, the module's call. A collective is
  waited for before its outputs are read (the values the training will read after its own
  wait; it only moves that wait earlier);
- backward: autograd runs backward nodes outside any mode the forward entered, so each forward
  operation's autograd node gets a hook instead: when it runs, the gradients reaching the
  operation's outputs (role grad_output) and those it produces for its inputs (grad_input) are
  captured under the forward operation's site, phase bwd.

Modules that do not match are never touched: no hook, no mode. Layouts follow what the data
flows from: a module's tensor inputs hold the batch (parameters, buffers and views of them do
not, nor tensors of one row when the microbatch has more), an operation's outputs hold it when
an input does, and the others are replicas over dp (their gradients each dp rank's addend of a
sum); DTensors carry their own layout. Nothing here raises into training: an operation whose
tensors cannot be digested is counted (``summary()["not_captured"]``) and skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from numaudit.agents.capture.hooks import graph_task_id, not_traced
from numaudit.agents.capture.sites import matches, normalize_site
from numaudit.agents.layout import PieceLayout, batch_layout, reduction_layout
from numaudit.wire.ops import SCALAR_INDEX, op_name, op_site

log = logging.getLogger(__name__)

NOT_CAPTURED_OP = "op_not_digestible"
"""summary()["not_captured"] reason: an operation's tensor that could not be digested or placed
(a value reduced over this rank's samples, a tensor subclass the digest does not read)."""
PASS_THROUGH = frozenset({
    "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd",
    "aten.empty.memory_format", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.empty.names", "aten.empty_permuted",
})
"""Operations not numbered: waits on a collective's result (the collective is its own
operation), and allocations whose memory holds no values yet (what fills it is)."""
C10D_OUTPUT_ARGS = frozenset({"output_tensors", "output_tensor", "output", "out_tensors",
                              "output_lists", "out"})
"""Argument names of torch's collectives that only receive results (read before, they hold
whatever the buffer held)."""
C10D_RECV = frozenset({"c10d.recv_", "c10d.recv_any_source_"})
MAX_DIRECTIVES = 16
"""Directives from the auditor kept until their step comes; older ones are dropped."""


@dataclass
class Frame:
    """One call of a module whose operations are captured."""

    module_id: int
    site: str
    call: int
    microbatch: int
    stage: int
    step: int
    batch: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    """Tensors of this call that hold the batch (the module's inputs, outputs computed from
    them)."""
    ops: int = 0
    last: tuple | None = None
    """(site, outputs, tensor inputs' batch flags, outputs' batch flags) of the last operation:
    its autograd node is read when the next one starts (autograd has set it by then)."""


class _Mode(TorchDispatchMode):
    """Sees every operation while a watched module's frame is open (`OpCapture.frames`)."""

    def __init__(self, owner: OpCapture) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        frames = owner.frames
        if owner.paused or not frames:
            return func(*args, **kwargs)
        name = op_name(func)
        if name in PASS_THROUGH:
            return func(*args, **kwargs)
        frame = frames[-1]
        try:
            prep = owner.before(frame, func, name, args, kwargs)
        except Exception as exc:  # never into training
            owner.failed("operation inputs", exc)
            prep = None
        out = func(*args, **kwargs)
        if prep is not None:
            try:
                owner.after(frame, prep, name, args, kwargs, out)
            except Exception as exc:
                owner.failed("operation outputs", exc)
        return out


class OpCapture:
    """Op-level captures of one rank: the modules' hooks, the mode, the backward node hooks,
    and the directives the auditor sent (applied at the start of the step they name)."""

    def __init__(self, capturer, config, ident) -> None:
        self.capturer = capturer
        self.config = config
        self.ident = ident
        self.globs: tuple[str, ...] = tuple(config.ops)
        self.frames: list[Frame] = capturer.op_frames
        """Open frames, innermost last (the capturer's own list: its hooks pause the mode
        while they digest)."""
        self._mode: _Mode | None = None
        self._models: list[tuple[torch.nn.Module, int]] = []
        self._hooked: dict[int, list] = {}
        """id(module) -> its hooks' handles (static globs and this step's directives)."""
        self._step_hooked: set[int] = set()
        self._calls: Counter = Counter()
        self._bwd_seen: set[tuple] = set()
        self.on = False
        """Operations are captured in the current step."""
        self._step_globs: tuple[str, ...] = ()
        self.inbox: deque = deque(maxlen=MAX_DIRECTIVES)
        """Directives from the auditor (the sender's ack reader appends), oldest first."""
        self._waiting: list = []
        self._seen_ids: set[int] = set()
        self._lock = threading.Lock()
        self._saved_payload: tuple[str, ...] | None = None
        self._layouts: dict[tuple, PieceLayout | bool] = {}
        """(phase, shape, holds the batch, replica) -> layout: one object per kind, so the
        capturer's cached plans are reused across microbatches."""
        self.late = 0
        """Directives that arrived after the step they named had started."""
        self.applied: list[tuple[int, int]] = []
        """(directive id, step) of the directives acted on."""
        self.seen = {"calls": 0, "ops": 0}
        """Module calls whose operations were captured, and their operations (forward)."""

    @property
    def paused(self) -> int:
        return self.capturer.ops_paused

    # -- which modules ------------------------------------------------------------------------

    def watch(self, model: torch.nn.Module, stage: int) -> int:
        """Hook the modules of `model` that the static globs match; returns how many."""
        self._models.append((model, stage))
        if not self.globs:
            return 0
        return sum(self._hook(m, site, stage) for site, m in self._matching(model, self.globs))

    def _matching(self, model: torch.nn.Module, globs: tuple[str, ...]):
        seen = set()
        for fqn, module in model.named_modules():
            site = normalize_site(fqn)
            if site and site not in seen and matches(site, globs):
                seen.add(site)
                yield site, module

    def _hook(self, module: torch.nn.Module, site: str, stage: int) -> bool:
        if id(module) in self._hooked:
            return False
        pre = module.register_forward_pre_hook(
            not_traced(functools.partial(self._enter, site, stage)), with_kwargs=True)
        post = module.register_forward_hook(not_traced(functools.partial(self._leave)),
                                            always_call=True)
        self._hooked[id(module)] = [pre, post]
        # the capturer's hook of this module runs after this one: its digests are not ops
        # torch types it as a dict; Module keeps its hooks in an OrderedDict
        hooks = cast(OrderedDict[int, Callable[..., Any]], module._forward_hooks)
        for key, fn in list(hooks.items()):
            if getattr(fn, "_numaudit_capture", False):
                hooks.move_to_end(key)
        return True

    # -- steps and directives -----------------------------------------------------------------

    def start_step(self, step: int, selected: bool) -> bool:
        """Called when a step starts: the directives for it are applied (hooks on the modules
        they name, their payload globs), those for earlier steps dropped as late. Returns
        whether a directive forces this step to be captured."""
        self._end_directives()
        self._calls.clear()
        self._bwd_seen.clear()
        forced = self._directives_for(step) if (self.inbox or self._waiting) else []
        self.on = selected or bool(forced)
        if forced:
            self._apply(forced, step)
        return bool(forced)

    def _directives_for(self, step: int) -> list:
        with self._lock:
            while self.inbox:
                d = self.inbox.popleft()
                if d.id not in self._seen_ids:
                    self._seen_ids.add(d.id)
                    self._waiting.append(d)
        now, later = [], []
        for d in self._waiting:
            if d.step == step:
                now.append(d)
            elif d.step > step:
                later.append(d)
            else:
                self.late += 1
                log.warning("rank %d: numaudit directive %d for step %d came after that step "
                            "had started (now %d): ignored", self.ident.rank, d.id, d.step, step)
        self._waiting = later[-MAX_DIRECTIVES:]
        return now

    def _apply(self, directives: list, step: int) -> None:
        globs = tuple(dict.fromkeys(g for d in directives for g in d.ops))
        payload = tuple(dict.fromkeys(g for d in directives for g in d.payload))
        n = 0
        for model, stage in self._models:
            for site, module in self._matching(model, globs):
                if self._hook(module, site, stage):
                    self._step_hooked.add(id(module))
                n += 1
        if payload:
            self._saved_payload = self.capturer.set_payload_globs(
                tuple(dict.fromkeys((*self.capturer.config.payload, *payload))))
        self._step_globs = globs
        self.applied.extend((d.id, step) for d in directives)
        log.info("rank %d: numaudit directive(s) %s: step %d captured with the operations of %s "
                 "(%d modules here)%s", self.ident.rank, ", ".join(str(d.id) for d in directives),
                 step, ", ".join(globs), n, f"; payloads of {', '.join(payload)}" if payload
                 else "")

    def end_step(self) -> None:
        """The step block ended: its directives' hooks and payload globs end with it."""
        try:
            self._end_directives()
        except Exception as exc:  # never into training
            self.failed("op-level capture", exc)

    def _end_directives(self) -> None:
        """Undo the last step's directives: their hooks and payload globs."""
        if self._saved_payload is not None:
            self.capturer.set_payload_globs(self._saved_payload)
            self._saved_payload = None
        if self._step_hooked:
            for key in self._step_hooked:
                for h in self._hooked.pop(key, ()):
                    h.remove()
            self._step_hooked.clear()
        self._step_globs = ()

    def remove_hooks(self) -> None:
        for handles in self._hooked.values():
            for h in handles:
                h.remove()
        self._hooked.clear()
        self._step_hooked.clear()

    # -- frames ---------------------------------------------------------------------------------

    def _enter(self, site: str, stage: int, module, args, kwargs) -> None:
        cap = self.capturer
        if not self.on or graph_task_id() != -1 or cap.outside_chunk or cap.ops_paused:
            return  # not this step; a checkpoint's recomputation; a schedule's shape inference
        if not ("fwd" in cap.config.phases or "bwd" in cap.config.phases):
            return
        try:
            mb = cap.microbatch
            key = (mb, site)
            call = self._calls[key]
            self._calls[key] = call + 1
            frame = Frame(id(module), site, call, mb, stage if stage >= 0 else cap.stage,
                          cap.step)
            self._seed_batch(frame, module, args, kwargs)
            if not self.frames:
                if self._mode is None:
                    self._mode = _Mode(self)
                self._mode.__enter__()
            self.frames.append(frame)
            self.seen["calls"] += 1
        except Exception as exc:
            self.failed("operation capture", exc)

    def _leave(self, module, args, output) -> None:
        frames = self.frames
        if not frames or not any(f.module_id == id(module) for f in frames):
            return
        try:
            while frames:
                frame = frames.pop()
                self._finish_last(frame)
                if frame.module_id == id(module):
                    break
        except Exception as exc:
            self.failed("operation capture", exc)
        finally:
            if not frames and self._mode is not None:
                try:
                    self._mode.__exit__(None, None, None)
                except Exception as exc:
                    self.failed("leaving operation capture", exc)

    def _seed_batch(self, frame: Frame, module, args, kwargs) -> None:
        """Mark the module's tensor inputs that hold the batch: not parameters or buffers (or
        views of them), not one row while the microbatch has more."""
        rows = self.capturer._rows
        dim = self.config.batch_dim
        owned = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
        leaves, _ = tree_flatten((args, kwargs))
        for t in leaves:
            if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
                continue
            base = t._base if t._is_view() else None
            if id(t) in owned or (base is not None and (id(base) in owned or isinstance(
                    base, torch.nn.Parameter))):
                continue
            if t.dim() > dim and (t.shape[dim] != 1 or rows in (None, 1)):
                frame.batch[t] = True

    # -- operations -------------------------------------------------------------------------

    def before(self, frame: Frame, func, name: str, args, kwargs):
        """Number the operation and digest its inputs (before it runs: an in-place operation
        overwrites them). Returns what `after` needs."""
        self._finish_last(frame)
        n = frame.ops
        frame.ops = n + 1
        self.seen["ops"] += 1
        site = op_site(frame.site, n, name)
        outputs_only, mutated = _written_args(func, name, args, kwargs)
        cap = self.capturer
        fwd = "fwd" in cap.config.phases
        tensors, holds, scalars = [], [], []
        leaves, _ = tree_flatten((args, kwargs))
        for x in leaves:
            if isinstance(x, torch.Tensor):
                if id(x) in outputs_only:
                    continue
                tensors.append(x)
                holds.append(x in frame.batch)
            elif isinstance(x, float):
                scalars.append(x)
        batch = any(holds)
        if fwd:
            for i, (t, h) in enumerate(zip(tensors, holds)):
                self._capture(t, frame, site, "fwd", "input", i, h)
            for k, v in enumerate(scalars):
                self._capture(torch.tensor(v, dtype=torch.float64), frame, site, "fwd",
                              "input", SCALAR_INDEX + k, False)
            if mutated:  # digested before the operation writes them; else with its outputs
                cap._drain()
        return site, batch, holds, mutated

    def after(self, frame: Frame, prep, name: str, args, kwargs, out) -> None:
        """Wait for a collective, digest the operation's outputs, remember them for the
        backward node hook."""
        site, batch, holds, mutated = prep
        _wait_collective(name, out)
        leaves, _ = tree_flatten(out)
        outs = [x for x in leaves if isinstance(x, torch.Tensor)]
        ids = {id(x) for x in outs}
        outs += [x for x in mutated if id(x) not in ids]
        numbers = [x for x in leaves if isinstance(x, (int, float)) and not isinstance(x, bool)]
        for t in outs:
            if batch:
                frame.batch[t] = True
        if "fwd" in self.capturer.config.phases:
            for j, t in enumerate(outs):
                self._capture(t, frame, site, "fwd", "output", j, batch)
            for k, v in enumerate(numbers):  # .item(), .tolist(): a number, not a tensor
                self._capture(torch.tensor(v), frame, site, "fwd", "output", len(outs) + k,
                              False)
            self.capturer._drain()
        if "bwd" in self.capturer.config.phases and outs:
            frame.last = (site, outs, holds, batch)

    def _finish_last(self, frame: Frame) -> None:
        """Hook the last operation's autograd node, which autograd has made by now."""
        last, frame.last = frame.last, None
        if last is None:
            return
        site, outs, holds, batch = last
        node = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
        if node is None:
            return
        node.register_hook(not_traced(functools.partial(
            self._node_hook, site, frame.call, frame.microbatch, frame.stage, frame.step,
            tuple(holds), batch)))

    def _node_hook(self, site: str, call: int, mb: int, stage: int, step: int,
                   holds: tuple, batch: bool, grad_inputs, grad_outputs) -> None:
        """Backward of one operation: the gradients reaching its outputs and those produced for
        its inputs, keyed by the forward's step, microbatch and call, each once. A split
        backward (ZBV, DualPipeV) runs a node twice: for the inputs' gradients, then for the
        weights' (the first run gives None for those). Never raises."""
        cap = self.capturer
        saved = cap.step
        cap.step = step
        seen = self._bwd_seen
        try:
            frame = Frame(0, "", call, mb, stage, step)
            for role, grads in (("grad_output", grad_outputs), ("grad_input", grad_inputs)):
                for j, g in enumerate(grads):
                    key = (step, mb, site, call, role, j)
                    if not isinstance(g, torch.Tensor) or key in seen:
                        continue
                    seen.add(key)
                    holds_j = (batch if role == "grad_output" else
                               holds[j] if j < len(holds) else batch)
                    self._capture(g, frame, site, "bwd", role, j, holds_j)
            cap._drain()
        except Exception as exc:
            self.failed("backward operation capture", exc)
        finally:
            cap.step = saved

    def _capture(self, t: torch.Tensor, frame: Frame, site: str, phase: str, role: str,
                 index: int, holds: bool) -> None:
        cap = self.capturer
        try:
            if t.device.type == "meta" or t.is_sparse:
                cap.counters.miss(NOT_CAPTURED_OP)
                return
            layout = None if _is_dtensor(t) else self._layout(t, phase, site, holds)
            if layout is False:
                cap.counters.miss(NOT_CAPTURED_OP)
                return
            if cap._capture_fast(t, phase, site, role, index, frame.call, frame.microbatch,
                                 frame.stage, cap.step, layout):
                return
            cap._capture_one(t, phase=phase, site=site, role=role, index=index,
                             call=frame.call, microbatch=frame.microbatch, stage=frame.stage,
                             layout=layout)
        except Exception as exc:
            cap.counters.miss(NOT_CAPTURED_OP)
            self.failed("operation digest", exc)

    def _layout(self, t: torch.Tensor, phase: str, site: str, holds: bool):
        """The layout of a plain tensor of an operation (module docstring); False where it
        cannot be placed (a value of the rank's samples that holds no batch dim)."""
        shape = tuple(t.shape)
        replica = self.capturer.replicated(phase, site, None)
        key = (phase, shape, holds, replica)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 4096:
                self._layouts.clear()
            layout = self._layouts[key] = self._new_layout(shape, phase, holds, replica)
        return layout

    def _new_layout(self, shape: tuple, phase: str, holds: bool, replica: bool):
        ident = self.ident
        if ident.dp_size == 1:
            return dataclasses.replace(PieceLayout.full(shape), replica=replica)
        dim = self.config.batch_dim
        if holds:
            if len(shape) <= dim:
                return False
            return dataclasses.replace(batch_layout(shape, ident.dp_rank, ident.dp_size, dim),
                                       replica=replica)
        if phase == "bwd":  # each dp rank's sum over its samples: an addend
            return reduction_layout(shape, "sum", 1.0, ident.dp_rank, ident.dp_size,
                                    replica=replica)
        return dataclasses.replace(PieceLayout.full(shape), replica=True)

    def failed(self, what: str, exc: Exception) -> None:
        self.capturer._failed(what, exc)


def _written_args(func, name: str, args, kwargs) -> tuple[set[int], list[torch.Tensor]]:
    """(ids of tensors that only receive the result, tensors the operation writes): an
    ``out=`` argument, a collective's output buffers, ``recv``'s tensors, an in-place self."""
    outputs_only: set[int] = set()
    mutated: list[torch.Tensor] = []
    collective = name.startswith("c10d.")
    try:
        schema = func._schema.arguments
    except AttributeError:
        return outputs_only, mutated
    values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
    for a, v in zip(schema, values):
        written = a.alias_info is not None and a.alias_info.is_write
        only = a.name in C10D_OUTPUT_ARGS or (collective and name in C10D_RECV
                                              and a.name == "tensors")
        if collective and a.name in ("tensors", *C10D_OUTPUT_ARGS):
            written = True
        if not (written or only):
            continue
        leaves, _ = tree_flatten(v)
        for x in leaves:
            if isinstance(x, torch.Tensor):
                mutated.append(x)
                if only:
                    outputs_only.add(id(x))
    return outputs_only, mutated


def _wait_collective(name: str, out) -> None:
    """Wait for a collective before its results are read: a functional one's tensor, an
    in-place one's Work (the last element of what it returns)."""
    if name.startswith("_c10d_functional") and isinstance(out, torch.Tensor):  # autograd's too
        torch.ops._c10d_functional.wait_tensor(out)
    elif name.startswith("_c10d_functional") and isinstance(out, (list, tuple)):
        for t in out:
            if isinstance(t, torch.Tensor):
                torch.ops._c10d_functional.wait_tensor(t)
    elif name.startswith("c10d.") and isinstance(out, tuple) and out:
        work = out[-1]
        if hasattr(work, "wait"):
            work.wait()
    elif name.startswith("c10d.") and hasattr(out, "wait"):
        out.wait()


def _is_dtensor(t) -> bool:
    from numaudit.agents.capture.sharding import is_dtensor as is_dt

    return is_dt(t)
