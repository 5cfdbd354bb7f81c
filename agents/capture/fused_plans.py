"""Captures through plans cached for the fused kernel: the Capturer's fast path.

Functions of the `Capturer` (agents/capture/capture.py binds them as its methods, `cap` being
the capturer). Everything but a plain CPU tensor's data pointer is the same for every capture
of a site, role, shape, strides and dtype (its layout, dtype name, descriptor base and tail,
payload size), so it is worked out once (`new_plan`: a `FusedPlan`; `new_split_plan`: a
`SplitPlan` for row segments) and kept in the capturer's `PlanCache` (``cap._plans``); a capture
then is a dict lookup, one struct pack and the Capture (`capture_fast`; `split_fast` for row
segments, `capture_split`). Also the dtype names a Capture carries (`dtype_name`).

The plans are NamedTuples, so that each field says what it is. Unpacking one costs a capture
~45 ns more than a plain tuple would (CPython 3.11 specializes unpacking for exact tuples only):
within the noise of `bench.overhead`'s ~6 us capture; a dataclass's attribute loads cost more.
"""

from __future__ import annotations

import math
import struct
from typing import Literal, NamedTuple

import torch

from numaudit.agents.capture.piece_layouts import MAX_CACHED_LAYOUTS
from numaudit.agents.capture.sharding import avg_ranks, is_dtensor, local_shard
from numaudit.agents.digest.batching import Capture
from numaudit.agents.digest.digest import has_moments
from numaudit.agents.kernels.cpu import DTYPE_CODES, descriptor_tail, pack_head
from numaudit.agents.layout import PieceLayout
from numaudit.wire.vocabulary import PHASE_IDS, ROLE_IDS


class FusedPlan(NamedTuple):
    """What every capture of a plain CPU tensor (or a DTensor's local shard) at one site and
    role, of one shape, strides and dtype, shares: all of it but the data pointer
    (`capture_fast`). Built by `new_plan`; `code`, `ndim`, `base` and `tail` are the digest's
    `FusedDescriptor` (agents/digest/fastpath.py)."""

    layout: PieceLayout
    """Where the piece sits in its logical tensor; the same object for every capture."""
    dtype: str
    """The dtype's name as a Capture carries it (`dtype_name`: "float32")."""
    moments: bool
    """Whether the digest has float moments for this dtype (digest.has_moments)."""
    code: int
    """The fused kernel's code of the dtype (agents/kernels/cpu.py ``DTYPE_CODES``)."""
    ndim: int
    """The piece's number of dims."""
    base: int
    """Flat index, in the logical tensor, of the piece's first element."""
    tail: bytes
    """The descriptor's part after its head: ``(size, stride, gstride)`` per dim, packed."""
    payload_n: int
    """Bytes of the payload buffer each capture gets for the kernel to copy the piece into
    (small pieces, or the `payload` globs ask for them); 0: no payload."""
    phase_id: int
    """The phase's wire id (wire.vocabulary ``PHASE_IDS``)."""
    role_id: int
    """The role's wire id (wire.vocabulary ``ROLE_IDS``)."""


class SplitPlan(NamedTuple):
    """What the row segments ``t.split(counts)`` of a tensor like ``t`` share at one site and
    role, for `split_fast`: the segments' descriptors differ only in their row count, address
    and base, worked out per segment from these. Built by `new_split_plan`."""

    dtype: str
    """The dtype's name as a Capture carries it (`dtype_name`)."""
    moments: bool
    """Whether the digest has float moments for this dtype (digest.has_moments)."""
    code: int
    """The fused kernel's code of the dtype (agents/kernels/cpu.py ``DTYPE_CODES``)."""
    ndim: int
    """The tensor's (and each segment's) number of dims."""
    row_bytes: int
    """Bytes of one row's elements: a segment's payload is its rows times this."""
    row_gstride: int
    """Elements of one row in the logical tensor: a segment's base is its layout's first row
    times this."""
    row_step: int
    """Bytes from one row of ``t`` to the next: the next segment's address is this segment's
    plus its rows times this."""
    stride0: int
    """``t.stride(0)``, in elements: dim 0's stride in each segment's descriptor."""
    tail: bytes
    """The descriptor's entries of dims 1.. (packed ``(size, stride, gstride)``): the same for
    every segment."""
    payload_all: bool
    """The `payload` globs ask for every segment's bytes; else only segments up to
    ``payload_max_bytes`` carry theirs."""
    phase_id: int
    """The phase's wire id (wire.vocabulary ``PHASE_IDS``)."""
    role_id: int
    """The role's wire id (wire.vocabulary ``ROLE_IDS``)."""


PlanKey = (tuple[str, str, str, int, torch.Size, tuple[int, ...], torch.dtype]
           | tuple[str, str, str, int, torch.Size, tuple[int, ...], torch.dtype, int])
"""What a `FusedPlan` is cached under: ``(phase, site, role, batch dim, shape, strides,
dtype)``, a DTensor's local shard's with ``id`` of its DTensor layout appended (the batch dim:
-1 unless a torch module states one for the output, `Capturer._batch_dims`)."""
SplitPlanKey = tuple[str, str, str, torch.Size, tuple[int, ...], torch.dtype]
"""What a `SplitPlan` is cached under: ``(phase, site, role, inner shape (dims 1..), strides,
dtype)``."""


class PlanCache:
    """The capturer's cached plans (``Capturer._plans``), one dict per kind, each bounded by
    MAX_CACHED_LAYOUTS. A plan is worked out from its site's layout and the payload globs: the
    capturer clears the cache when either changes (`Capturer.set_payload_globs`; a site's
    outputs found batchless or its tensor-parallel block changed, agents/capture/module_hooks.py).
    """

    __slots__ = ("fused", "split")

    def __init__(self) -> None:
        self.fused: dict[PlanKey, FusedPlan | None] = {}
        """A tensor's `FusedPlan`, or None when such tensors take the general path
        (`capture_fast`)."""
        self.split: dict[SplitPlanKey, SplitPlan | None] = {}
        """A tensor's `SplitPlan` for its row segments, or None when they take the general
        path (`split_fast`)."""

    def clear(self) -> None:
        self.fused.clear()
        self.split.clear()


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
    """`capture_split`'s fast path: every segment's Capture and descriptor from one cached
    `SplitPlan`; False (nothing done) when the fused kernel does not read ``t``."""
    if type(t) is not torch.Tensor or not t.is_cpu or not t.dim() or sum(counts) != len(t):
        return False
    key: SplitPlanKey = (phase, site, role, t.shape[1:], t.stride(), t.dtype)
    plans = cap._plans.split
    plan: SplitPlan | Literal[False] | None = plans.get(key, False)
    if plan is False:
        plan = new_split_plan(cap, t, phase, site, role)
        if len(plans) >= MAX_CACHED_LAYOUTS:
            plans.clear()
        plans[key] = plan
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


def new_split_plan(cap, t: torch.Tensor, phase: str, site: str, role: str) -> SplitPlan | None:
    """What `split_fast` needs for row segments of tensors like ``t``; None when the
    fused kernel does not read it (complex included)."""
    if t.dtype.is_complex or not cap._digester.takes(t):
        return None
    rest = tuple(t.shape[1:])
    gstrides = [1] * t.dim()
    for d in range(t.dim() - 2, -1, -1):  # row-major over the logical (rows, *rest)
        gstrides[d] = gstrides[d + 1] * t.shape[d + 1]
    stride0 = t.stride(0)
    tail = descriptor_tail(t, gstrides)[_DIM_BYTES:]  # dims 1..: the same for every segment
    return SplitPlan(
        dtype=dtype_name(t.dtype), moments=has_moments(t.dtype), code=DTYPE_CODES[t.dtype],
        ndim=t.dim(), row_bytes=math.prod(rest) * t.element_size(), row_gstride=gstrides[0],
        row_step=stride0 * t.element_size(), stride0=stride0, tail=tail,
        payload_all=bool(cap.config.payload and cap._wants_payload(phase, site, role)),
        phase_id=PHASE_IDS[phase], role_id=ROLE_IDS[role])


def capture_fast(cap, t: torch.Tensor, phase: str, site: str, role: str, index: int,
                  call: int, microbatch: int, stage: int, step: int,
                  layout: PieceLayout | None = None) -> bool:
    """Capture a plain CPU tensor with the default layout through a cached plan; False
    (nothing done) when it takes the general path (:meth:`_capture_one`). Never raises.

    Everything but the data pointer is the same for every capture of a site, role, shape,
    strides and dtype, so it is worked out once (`new_plan`): a capture here is one
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
        key: PlanKey = ((phase, site, role, dim, t.shape, t.stride(), t.dtype)
                        if dt_layout is None else
                        (phase, site, role, dim, t.shape, t.stride(), t.dtype, id(dt_layout)))
        plans = cap._plans.fused
        plan: FusedPlan | Literal[False] | None = plans.get(key, False)
        if plan is False or (dt_layout is not None and plan is not None
                             and plan.layout is not dt_layout):
            plan = new_plan(cap, t, phase, site, role, dt_layout, index)
            if len(plans) >= MAX_CACHED_LAYOUTS:
                plans.clear()
            plans[key] = plan
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
              layout: PieceLayout | None = None, index: int = 0) -> FusedPlan | None:
    """What `capture_fast` needs for tensors like ``t`` (of ``layout``; None: a plain
    tensor's); None for the general path (no fused kernel, a dtype it does not read,
    complex)."""
    if phase == "input":  # its layout also records the microbatch's batch size
        return None
    if layout is None:
        layout = cap._plain_layout(t, phase, site, None, index)
    desc = cap._digester.fused_plan(t, layout)
    if desc is None:
        return None
    nbytes = t.nbytes
    payload_n = nbytes if ((0 < nbytes <= cap.config.payload_max_bytes) or (
        cap.config.payload and cap._wants_payload(phase, site, role))) else 0
    return FusedPlan(layout=layout, dtype=dtype_name(t.dtype), moments=has_moments(t.dtype),
                     code=desc.code, ndim=desc.ndim, base=desc.base, tail=desc.tail,
                     payload_n=payload_n, phase_id=PHASE_IDS[phase], role_id=ROLE_IDS[role])
