"""Which implementation digests a capture: the fused kernel when it can, the eager reference
otherwise.

The fused CPU kernel (agents/kernels/cpu.py) computes the same digest as agents/digest.py in one
pass and takes a whole list of pieces per call, so the captures of one hook (all outputs of a
module) or of one parameter sweep cost one kernel call. Accelerator pieces go to the Triton
digest where it is installed and passed its self-check on that device and dtype
(agents/kernels/accel.py), likewise a whole list per call (a few launches, whatever its
length). Other pieces (float8 types, pieces Triton does not take) and every piece when the
kernels are unavailable or switched off (``NUMAUDIT_DIGEST=eager``) go to the eager path, one
piece at a time.
"""

from __future__ import annotations

import logging

import torch

from agents.digest import digest_piece
from agents.layout import PieceLayout
from agents.rows import RowBatch

log = logging.getLogger(__name__)

DIGEST_MODES = ("auto", "eager")
"""``auto``: the fused kernel where it applies; ``eager``: always the torch reference."""

Rows = tuple[torch.Tensor, torch.Tensor]
Piece = tuple[torch.Tensor, PieceLayout, int | None]
"""A local tensor (complex ones viewed as real, with the real view's layout), its layout, and
``None`` for the eager path, else (the caller checked :meth:`Digester.takes`) 0 or the address
where the kernel also copies the piece's bytes. Eager pieces must be detached."""

MAX_CACHED_MAPS = 4096


class Digester:
    """Digests lists of pieces; holds the implementation choice made once at attach time."""

    def __init__(self, mode: str = "auto", *, triton_devices: tuple[str, ...] = ("cuda",)) -> None:
        if mode not in DIGEST_MODES:
            raise ValueError(f"digest: {mode!r} is not one of {', '.join(DIGEST_MODES)}")
        self._cpu = None
        self._triton = None
        if mode == "auto":
            from agents.kernels import cpu
            from agents.kernels.accel import TritonDigest

            if cpu.load() is not None:  # else cpu.load() has logged the one warning
                self._cpu = cpu
            self._triton = TritonDigest(triton_devices)
        self._maps: dict[tuple, tuple[PieceLayout, int, bytes]] = {}
        """(id(layout), shape, strides) -> (layout, base, descriptor tail): the index map and
        descriptor of a piece are worked out once per site and shape, not per capture (the
        layout is kept so that its id is not reused while cached)."""

    @property
    def fused(self) -> bool:
        """The fused CPU kernel is in use."""
        return self._cpu is not None

    def takes(self, t: torch.Tensor) -> bool:
        """The fused kernel digests this piece (and can copy its payload bytes while at it)."""
        return self._cpu is not None and self._cpu.supports(t) and not t.dtype.is_complex

    def fused_plan(self, t: torch.Tensor, layout: PieceLayout) -> tuple[int, int, int, bytes] | None:
        """``(dtype code, ndim, base, descriptor tail)`` of a piece the fused kernel takes, else
        None: what a caller caches per site, shape, strides and dtype so that a capture's
        descriptor is one ``pack_head(t.data_ptr(), code, ndim, base, payload) + tail``
        (agents/kernels/cpu.py). ``t`` may be a Parameter (its data is a plain tensor's)."""
        cpu = self._cpu
        if cpu is None or t.dtype.is_complex:
            return None
        plain = t.detach() if type(t) is not torch.Tensor else t
        if not cpu.supports(plain):
            return None
        base, gs = cpu.index_map(tuple(t.shape), layout)
        return cpu.DTYPE_CODES[t.dtype], t.dim(), base, cpu.descriptor_tail(t, gs)

    def kernel(self):
        """The fused kernel's batch call (agents/kernels/cpu.py ``kernel``); None without it."""
        return self._cpu.kernel() if self._cpu is not None else None

    def digest(self, pieces: list[Piece], sketch_k: int, rows: RowBatch) -> list:
        """Digest each piece; returns per piece the row of ``rows`` that holds its digest (an
        int), its ``(f64, i64)`` rows on its device (pieces not on the CPU), or the exception
        that failed it (a bad layout: the caller decides what a failure costs).

        ``rows`` must have room for every piece. Pieces the kernel takes are digested in one
        call, straight into ``rows``; accelerator pieces Triton takes (where trusted) in one call
        per device; the rest one at a time by the eager reference.
        """
        out: list = [None] * len(pieces)
        cpu = self._cpu
        fused_at: list[int] = []
        descs: list[bytes] = []
        others: list[int] = []
        for i, (t, layout, payload) in enumerate(pieces):
            if payload is not None and cpu is not None:
                try:
                    descs.append(self._descriptor(cpu, t, layout, payload))
                    fused_at.append(i)
                except Exception as exc:
                    out[i] = exc
            else:
                others.append(i)
        if others:
            routed = (self._triton.digest_many([pieces[i][:2] for i in others], sketch_k)
                      if self._triton else [None] * len(others))
            for i, got in zip(others, routed):
                try:
                    t, layout, _ = pieces[i]
                    f64, i64 = got or digest_piece(t, layout, sketch_k=sketch_k)
                    if f64.is_cpu:
                        row = rows.reserve(1)
                        rows.put(row, f64, i64)
                        out[i] = row
                    else:
                        out[i] = (f64, i64)
                except Exception as exc:
                    out[i] = exc
        if fused_at:
            first = rows.reserve(len(fused_at))
            try:
                cpu.digest_into(descs, sketch_k, *rows.pointers(first))
                for j, i in enumerate(fused_at):
                    out[i] = first + j
            except Exception as exc:
                for i in fused_at:
                    out[i] = exc
        return out

    def _descriptor(self, cpu, t: torch.Tensor, layout: PieceLayout, payload: int) -> bytes:
        key = (id(layout), t.shape, t.stride())
        hit = self._maps.get(key)
        if hit is None or hit[0] is not layout:
            base, gs = cpu.index_map(tuple(t.shape), layout)
            if len(self._maps) >= MAX_CACHED_MAPS:
                self._maps.clear()
            hit = self._maps[key] = (layout, base, cpu.descriptor_tail(t, gs))
        return cpu.descriptor(t, hit[1], hit[2], payload)
