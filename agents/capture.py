"""Capture: module and parameter hooks → digests on the tensor's device → batched host transfer.

Everything here runs on the training thread, so it is bounded and cheap: a hook computes the
digest of each tensor it sees on that tensor's device (vectorized, no host sync on CUDA), keeps
the two small result rows, and every `device_batch` captures (or at a microbatch or step
boundary) stacks them and starts one asynchronous copy to the host. The sender thread waits for
that copy, builds records and does all network I/O. No hook ever raises into training: failures
are counted, logged once per kind with the rank, and the capture is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

from agents.config import AgentConfig, step_selected
from agents.digest import digest_batch_to_host, has_moments
from agents.fastpath import Digester
from agents.identity import RankIdentity
from agents.layout import PieceLayout, batch_layout, complex_real_layout, dtensor_layout
from agents.sites import matches, normalize_site, select_modules
from protos import numaudit_pb2 as pb

log = logging.getLogger(__name__)

PHASE_IDS = {
    "fwd": pb.PHASE_FWD, "bwd": pb.PHASE_BWD, "grad": pb.PHASE_GRAD,
    "param": pb.PHASE_PARAM, "loss": pb.PHASE_LOSS, "input": pb.PHASE_INPUT,
}
ROLE_IDS = {
    "output": pb.ROLE_OUTPUT, "input": pb.ROLE_INPUT, "grad_output": pb.ROLE_GRAD_OUTPUT,
    "grad_input": pb.ROLE_GRAD_INPUT, "value": pb.ROLE_VALUE,
}
STEP_LEVEL = -1  # microbatch id of per-step captures (grad, param)


@dataclass(slots=True)
class Capture:
    """Host-side metadata of one captured piece; its digest rows travel in the HostBatch."""

    step: int
    microbatch: int
    phase: int
    site: str
    role: int
    index: int
    call: int
    stage: int
    layout: PieceLayout | None
    dtype: str
    is_none: bool = False
    moments: bool = True
    complex_as_real: bool = False
    row: int = -1
    """Row of this capture's digest in the batch's tensors; -1 for None captures."""
    payload: torch.Tensor | None = None
    """A host copy of the piece when its bytes travel too."""


@dataclass
class HostBatch:
    """Captures whose digests were stacked and sent to the host in one transfer."""

    captures: list[Capture]
    f64: torch.Tensor | None
    i64: torch.Tensor | None
    ready: object = None
    """A CUDA event to synchronize on before reading f64/i64; None on CPU."""

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class Counters:
    """Thread-safe counts the agent reports at close."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.captured = 0
        self.errors = 0
        self.dropped: Counter[str] = Counter()

    def add_captured(self, n: int) -> None:
        with self._lock:
            self.captured += n

    def drop(self, reason: str, n: int) -> None:
        if n:
            with self._lock:
                self.dropped[reason] += n

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def snapshot(self) -> tuple[int, int, dict[str, int]]:
        with self._lock:
            return self.captured, self.errors, dict(self.dropped)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def in_backward() -> bool:
    """True while the autograd engine runs: forwards seen now are checkpoint recomputations."""
    return torch._C._current_graph_task_id() != -1


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
        self._sink = sink
        self.counters = counters
        self.step = 0
        self.microbatch = 0
        self.stage = -1
        self._calls: Counter[tuple[int, str]] = Counter()
        self._bwd_seen: set[tuple] = set()
        self.in_chunk = 0
        """Depth of pipeline-schedule chunk methods running now (agents/pipeline.py)."""
        self.loss_microbatch: int | None = None
        """Microbatch of the last forward chunk whose loss has not been captured yet."""
        self._captures: list[Capture] = []
        self._f64: list[torch.Tensor] = []
        self._i64: list[torch.Tensor] = []
        self._logged: set[str] = set()
        self._handles: list = []
        self._pending: list[tuple[Capture, torch.Tensor, PieceLayout]] = []
        """Captures of the running hook (or parameter sweep) whose digests are not computed
        yet: :meth:`_drain` digests them in one call before the hook returns to training."""
        self._digester = Digester(config.digest)
        self._phases = frozenset(config.phases)
        self._step_on = step_selected(config, self.step)

    # -- what to capture ----------------------------------------------------------------------

    def wants(self, phase: str) -> bool:
        """Whether this phase is captured in the current step (cached per step: hooks ask
        this on every module call)."""
        return self._step_on and phase in self._phases

    def _wants_payload(self, phase: str, site: str, role: str) -> bool:
        globs = self.config.payload
        return matches(f"{phase}:{site}", globs) or matches(f"{phase}:{site}:{role}", globs)

    # -- hooks ----------------------------------------------------------------------------------

    def hook_modules(self, model: torch.nn.Module, stage: int = -1, *,
                     pipelined: bool = False) -> int:
        """Hook every selected module of `model` (a whole model or one pipeline stage).

        `pipelined`: the module is driven by a pipeline schedule, and only forwards inside the
        schedule's chunk methods (`in_chunk`) are captured — not the schedule's own shape
        inference, which runs the stage once outside them.
        """
        n = 0
        cfg = self.config
        for site, module in select_modules(model, cfg.modules, cfg.exclude, cfg.max_depth):
            hook = self._forward_hook(site, stage, pipelined)
            self._handles.append(module.register_forward_hook(hook))
            n += 1
        return n

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _forward_hook(self, site: str, stage: int, pipelined: bool = False):
        def hook(module, inputs, output):
            try:
                if in_backward() or not (self.wants("fwd") or self.wants("bwd")):
                    return
                if pipelined and not self.in_chunk:
                    return
                mb = self.microbatch
                call = self._next_call(site)
                st = stage if stage >= 0 else self.stage
                tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
                for index, t in enumerate(tensors):
                    if self.wants("fwd"):
                        self._capture_one(t, phase="fwd", site=site, role="output",
                                          index=index, call=call, microbatch=mb, stage=st)
                    if self.wants("bwd") and t.requires_grad:
                        t.register_hook(self._grad_hook(site, index, call, mb, st, self.step))
            except Exception as exc:  # never into training
                self._failed("forward hook", exc)
            self._drain()

        return _not_traced(hook)

    def _grad_hook(self, site: str, index: int, call: int, mb: int, stage: int, step: int):
        key = (step, mb, site, index, call)

        def hook(grad):
            try:
                # Split backward (ZBV, DualPipeV) can run a tensor's hooks in both the
                # input-gradient and the weight-gradient action: one capture per key.
                if grad is not None and key not in self._bwd_seen:
                    self._bwd_seen.add(key)
                    saved = self.step
                    self.step = step
                    try:
                        self.capture(grad, phase="bwd", site=site, role="grad_output",
                                     index=index, call=call, microbatch=mb, stage=stage)
                    finally:
                        self.step = saved
            except Exception as exc:
                self._failed("backward hook", exc)
            return None

        return _not_traced(hook)

    def _next_call(self, site: str) -> int:
        key = (self.microbatch, site)
        call = self._calls[key]
        self._calls[key] = call + 1
        return call

    def start_step(self, step: int) -> None:
        """Calls are numbered per (microbatch, site) within a step; a new step starts afresh."""
        self.step = step
        self._step_on = step_selected(self.config, step)
        self.microbatch = 0
        self._calls.clear()
        self._bwd_seen.clear()

    # -- captures -------------------------------------------------------------------------------

    @torch.compiler.disable
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
    ) -> None:
        """Digest one tensor (or record that it is None). Never raises."""
        self._capture_one(t, phase=phase, site=site, role=role, index=index, call=call,
                          microbatch=microbatch, stage=stage, layout=layout)
        self._drain()

    def _capture_one(self, t, *, phase, site, role="value", index=0, call=0, microbatch=None,
                     stage=None, layout=None) -> None:
        """Queue one capture for :meth:`_drain`. Never raises."""
        try:
            self._capture(t, phase, site, role, index, call,
                          self.microbatch if microbatch is None else microbatch,
                          self.stage if stage is None else stage, layout)
        except Exception as exc:
            self._failed(f"capture of {phase}:{site}", exc)

    def _capture(self, t, phase, site, role, index, call, microbatch, stage, layout) -> None:
        cap = Capture(
            step=self.step, microbatch=microbatch, phase=PHASE_IDS[phase], site=site,
            role=ROLE_IDS[role], index=index, call=call, stage=stage, layout=None, dtype="",
        )
        self.counters.add_captured(1)
        if t is None:
            cap.is_none, cap.moments = True, False
            self._captures.append(cap)
            return
        t = t.detach()
        local = t
        if layout is None:
            if _is_dtensor(t):
                layout = dtensor_layout(t)
                local = t.to_local()
            elif phase in ("grad", "param"):
                layout = PieceLayout.full(tuple(t.shape))
                if self.ident.dp_size > 1:
                    layout = PieceLayout(layout.logical_shape, layout.offsets, layout.shape,
                                         replica=True)
            else:
                layout = batch_layout(tuple(t.shape), self.ident.dp_rank, self.ident.dp_size)
        elif _is_dtensor(t):
            local = t.to_local()
        cap.dtype = _dtype_name(local.dtype)
        if local.is_complex():
            local = torch.view_as_real(local)
            layout = complex_real_layout(layout)
            cap.complex_as_real = True
            cap.dtype = _dtype_name(local.dtype)
        cap.layout = layout
        cap.moments = has_moments(local.dtype)
        if self.config.payload and self._wants_payload(phase, site, role):
            # A host copy taken now: the tensor may be changed in place after the hook returns.
            cap.payload = local.to("cpu", copy=True).contiguous()
        self._pending.append((cap, local, layout))

    def _drain(self) -> None:
        """Digest the pending captures in one call and queue their rows. Never raises.

        Runs before the hook that queued them returns, so no tensor can have been changed in
        place in between (an in-place ReLU after the module, the optimizer after the sweep).
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        try:
            rows = self._digester.digest([(t, layout) for _, t, layout in pending],
                                         self.config.sketch_k)
        except Exception:
            # One bad piece must not cost its neighbours: digest them one at a time.
            rows = []
            for cap, t, layout in pending:
                try:
                    rows.extend(self._digester.digest([(t, layout)], self.config.sketch_k))
                except Exception as exc:
                    rows.append(None)
                    self._failed(f"capture of {cap.site}", exc)
        for (cap, _, _), row in zip(pending, rows):
            if row is None:
                continue
            cap.row = len(self._f64)
            self._f64.append(row[0])
            self._i64.append(row[1])
            self._captures.append(cap)
        if len(self._f64) >= self.config.device_batch:
            self.flush()

    def capture_parameters(self, model: torch.nn.Module, *, grads: bool, stage: int = -1) -> None:
        """Capture every parameter's gradient (None recorded explicitly) or value."""
        phase = "grad" if grads else "param"
        if not self.wants(phase):
            return
        for name, p in model.named_parameters():
            site = normalize_site(name)
            t = p.grad if grads else p
            self._capture_one(t, phase=phase, site=site, role="value", microbatch=STEP_LEVEL,
                              stage=stage)
        self._drain()
        self.flush()

    def flush(self) -> None:
        """Start one host transfer for the pending digests and hand the batch to the sender."""
        self._drain()
        if not self._captures:
            return
        captures, f64, i64 = self._captures, self._f64, self._i64
        self._captures, self._f64, self._i64 = [], [], []
        try:
            if f64:
                host_f64, host_i64, event = digest_batch_to_host(f64, i64)
            else:
                host_f64 = host_i64 = event = None
            self._sink(HostBatch(captures, host_f64, host_i64, event))
        except Exception as exc:
            self.counters.drop("transfer_error", len(captures))
            self._failed("host transfer", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        self.counters.error()
        if what not in self._logged:
            self._logged.add(what)
            log.warning("rank %d: numaudit %s failed (further failures counted silently): %r",
                        self.ident.rank, what, exc)


def _not_traced(hook):
    """Hooks run eagerly even inside a ``torch.compile``d model: traced, the agent's code would
    put guards on its own state (site names, data pointers, whether this step is captured) into
    the model's graphs, and turning capture on or off would recompile them. A disabled hook is a
    graph break at each hooked module instead (docs/agent.md, torch.compile)."""
    return torch.compiler.disable(hook)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)
