"""Captures through plans cached for the fused kernel: the Capturer's fast path.

Functions of the `Capturer` (agents/capture/capture.py binds them as its methods, `cap` being
the capturer). Everything but a plain CPU tensor's data pointer is the same for every capture
of a site, role, shape, strides and dtype (its layout, dtype name, descriptor base and tail,
payload size), so it is worked out once (`new_plan`, `new_split_plan`) and kept in
``cap._plans``; a capture then is a dict lookup, one struct pack and the Capture
(`capture_fast`; `split_fast` for row segments, `capture_split`). Also owns the wire ids of
phases and roles and the dtype names a Capture carries.
"""

from __future__ import annotations

import math
import struct
from typing import Literal

import torch

from numaudit.agents.capture.piece_layouts import MAX_CACHED_LAYOUTS
from numaudit.agents.capture.sharding import avg_ranks, is_dtensor, local_shard
from numaudit.agents.digest.batching import Capture
from numaudit.agents.digest.digest import has_moments
from numaudit.agents.kernels.cpu import DTYPE_CODES, descriptor_tail, pack_head
from numaudit.agents.layout import PieceLayout
from numaudit.wire.vocabulary import PHASE_IDS, ROLE_IDS

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DIM_STRUCT = struct.Struct("<3q")
"""One dim of a descriptor's tail: ``(size, stride, gstride)``."""
_DIM, _DIM_BYTES = _DIM_STRUCT.pack, _DIM_STRUCT.size


def capture_split(cap, t: torch.Tensor, counts: list[int], layouts: list[PieceLayout],
                   phase: str, site: str, role: str, microbatch: int, stage: int,
                   step: int) -> None:
    """Queue ``t.split(counts)`` under ``layouts``, segment e under index e: through a
    plan cached per site, inner shape, strides and dtype when the fused kernel reads ``t``
    (the segments' descriptors then differ only in their row count, address and base),
    else piece by piece through the general path. Raises for counts that do not split
    ``t``."""
    if cap._split_fast(t, counts, layouts, phase, site, role, microbatch, stage, step):
        return
    saved = cap.step
    cap.step = step  # the general path keys captures by cap.step
    try:
        for e, (piece, layout) in enumerate(zip(t.split(counts), layouts)):
            cap._capture(piece, phase, site, role, e, 0, microbatch, stage, layout)
    finally:
        cap.step = saved


def split_fast(cap, t: torch.Tensor, counts: list[int], layouts: list[PieceLayout],
                phase: str, site: str, role: str, microbatch: int, stage: int,
                step: int) -> bool:
    if type(t) is not torch.Tensor or not t.is_cpu or not t.dim() or sum(counts) != len(t):
        return False
    key = ("split", phase, site, role, t.shape[1:], t.stride(), t.dtype)
    plan: tuple | Literal[False] | None = cap._plans.get(key, False)
    if plan is False:
        plan = new_split_plan(cap, t, phase, site, role)
        if len(cap._plans) >= MAX_CACHED_LAYOUTS:
            cap._plans.clear()
        cap._plans[key] = plan
    if plan is None:
        return False
    dtype, moments, code, ndim, row_bytes, row_gstride, row_step, stride0, tail, \
        payload_all, phase_id, role_id = plan
    limit = cap.config.payload_max_bytes
    batches = cap._batches
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
    cap.counters.captured += len(counts)
    return True


def new_split_plan(cap, t: torch.Tensor, phase: str, site: str, role: str) -> tuple | None:
    """What :meth:`_split_fast` needs for row segments of tensors like ``t``; None when the
    fused kernel does not read it (complex included)."""
    if t.dtype.is_complex or not cap._digester.takes(t):
        return None
    rest = tuple(t.shape[1:])
    gstrides = [1] * t.dim()
    for d in range(t.dim() - 2, -1, -1):  # row-major over the logical (rows, *rest)
        gstrides[d] = gstrides[d + 1] * t.shape[d + 1]
    stride0 = t.stride(0)
    tail = descriptor_tail(t, gstrides)[_DIM_BYTES:]  # dims 1..: the same for every segment
    return (dtype_name(t.dtype), has_moments(t.dtype), DTYPE_CODES[t.dtype], t.dim(),
            math.prod(rest) * t.element_size(), gstrides[0], stride0 * t.element_size(),
            stride0, tail, bool(cap.config.payload and cap._wants_payload(phase, site, role)),
            PHASE_IDS[phase], ROLE_IDS[role])


def capture_fast(cap, t: torch.Tensor, phase: str, site: str, role: str, index: int,
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
            if not is_dtensor(t):
                return False
            # A DTensor (an FSDP2 parameter or its gradient, a tensor-parallel activation):
            # its local shard with the DTensor's layout, without the DTensor ops that
            # detach() and to_local() dispatch (~35 us a capture).
            try:
                dt_layout = cap._dtensor_layout(t, phase)
            except Exception:  # placements it cannot place: the general path reports it
                return False
            if dt_layout.partial and avg_ranks(t) > 1:  # its addend is not its bytes
                return False
            t = local_shard(t)
            if type(t) is not torch.Tensor:  # e.g. a collective's result not waited for yet
                return False
        if not t.is_cpu:
            return False
        # the batch dim, where a torch module states one for this output (rarely: no lookup
        # when none does), so that captures under other indices share the plan
        dim = cap._batch_dims.get((site, index), -1) if cap._batch_dims else -1
        key = ((phase, site, role, dim, t.shape, t.stride(), t.dtype) if dt_layout is None
               else (phase, site, role, dim, t.shape, t.stride(), t.dtype, id(dt_layout)))
        plan: tuple | Literal[False] | None = cap._plans.get(key, False)
        if plan is False or (dt_layout is not None and plan is not None
                             and plan[0] is not dt_layout):
            plan = new_plan(cap, t, phase, site, role, dt_layout, index)
            if len(cap._plans) >= MAX_CACHED_LAYOUTS:
                cap._plans.clear()
            cap._plans[key] = plan
        if plan is None:
            return False
        layout, dtype, moments, code, ndim, base, tail, payload_n, phase_id, role_id = plan
        cap.counters.captured += 1  # Counters.add_captured, without the call
        payload, payload_at = (cap._batches.payload_buffer(payload_n) if payload_n
                               else (None, 0))
        cap._batches.fused.append((
            Capture(step, microbatch, phase_id, site, role_id, index, call, stage,
                    layout, dtype, False, moments, False, -1, payload),
            pack_head(t.data_ptr(), code, ndim, base, payload_at) + tail, t))
    except Exception as exc:
        cap._failed(f"capture of {phase}:{site}", exc)
    return True


def new_plan(cap, t: torch.Tensor, phase: str, site: str, role: str,
              layout: PieceLayout | None = None, index: int = 0) -> tuple | None:
    """What :meth:`_capture_fast` needs for tensors like ``t`` (of ``layout``; None: a plain
    tensor's); None for the general path (no fused kernel, a dtype it does not read,
    complex)."""
    if phase == "input":  # its layout also records the microbatch's batch size
        return None
    if layout is None:
        layout = cap._plain_layout(t, phase, site, None, index)
    plan = cap._digester.fused_plan(t, layout)
    if plan is None:
        return None
    nbytes = t.nbytes
    payload_n = nbytes if ((0 < nbytes <= cap.config.payload_max_bytes) or (
        cap.config.payload and cap._wants_payload(phase, site, role))) else 0
    return (layout, dtype_name(t.dtype), has_moments(t.dtype), *plan, payload_n,
            PHASE_IDS[phase], ROLE_IDS[role])
