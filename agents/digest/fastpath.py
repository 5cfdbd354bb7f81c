"""Which implementation digests a capture: the fused kernel when it can, the eager reference
otherwise.

The fused CPU kernel (agents/kernels/cpu.py) computes the same digest as agents/digest/digest.py in
one pass and takes a whole list of pieces per call, so the captures of one hook (all outputs of a
module) or of one parameter sweep cost one kernel call. Accelerator pieces go to the Triton
digest where it is installed and passed its self-check on that device and dtype
(agents/kernels/accel.py), likewise a whole list per call (a few launches, whatever its
length). Other pieces (float8 types, pieces Triton does not take) and every piece when the
kernels are unavailable or switched off (``NUMAUDIT_DIGEST=eager``) go to the eager path, one
piece at a time.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from numaudit.agents.digest.digest import N_MOMENTS, digest_piece
from numaudit.agents.digest.rows import RowBatch
from numaudit.agents.digest.sample_digest import SamplePlan, digest_samples_eager, plan_samples
from numaudit.agents.layout import PieceLayout

log = logging.getLogger(__name__)

DIGEST_MODES = ("auto", "eager")
"""``auto``: the fused kernel where it applies; ``eager``: always the torch reference."""

Rows = tuple[torch.Tensor, torch.Tensor]
Piece = tuple[torch.Tensor, PieceLayout, int | None]
"""A local tensor (complex ones viewed as real, with the real view's layout), its layout, and
``None`` for the eager path, else (the caller checked :meth:`Digester.takes`) 0 or the address
where the kernel also copies the piece's bytes. Eager pieces must be detached."""

MAX_CACHED_MAPS = 4096


class FusedDescriptor(NamedTuple):
    """What every fused-kernel descriptor of a piece shares, whatever its data and payload
    addresses (`Digester.fused_plan`): a caller that caches it per site, shape, strides and
    dtype builds a capture's descriptor as ``pack_head(t.data_ptr(), code, ndim, base,
    payload_at) + tail`` (agents/kernels/cpu.py ``descriptor``)."""

    code: int
    """The kernel's code of the piece's dtype (agents/kernels/cpu.py ``DTYPE_CODES``)."""
    ndim: int
    """The piece's number of dims (the tail holds one entry per dim)."""
    base: int
    """Flat index, in the logical tensor, of the piece's first element (its offsets times the
    logical tensor's row-major strides: agents/kernels/cpu.py ``index_map``)."""
    tail: bytes
    """The descriptor's part after its head: ``(size, stride, gstride)`` of each dim as int64s
    (agents/kernels/cpu.py ``descriptor_tail``)."""


SampleItem = tuple[torch.Tensor, PieceLayout, int, int]
"""A piece whose samples are digested one by one (agents/digest/sample_digest.py): the local tensor,
the samples' common layout (`sample_digest.sample_layout`), its batch dim and the sketch's k."""


class Digester:
    """Digests lists of pieces; holds the implementation choice made once at attach time."""

    def __init__(self, mode: str = "auto", *, triton_devices: tuple[str, ...] = ("cuda",)) -> None:
        if mode not in DIGEST_MODES:
            raise ValueError(f"digest: {mode!r} is not one of {', '.join(DIGEST_MODES)}")
        self._cpu = None
        self._triton = None
        if mode == "auto":
            from numaudit.agents.kernels import cpu
            from numaudit.agents.kernels.accel import TritonDigest

            if cpu.load() is not None:  # else cpu.load() has logged the one warning
                self._cpu = cpu
            self._triton = TritonDigest(triton_devices)
        self._sample_rows: dict[int, _SampleRows] = {}
        """Host rows the fused kernel writes sample digests into, per bucket count."""
        self._sample_plans: dict[tuple, tuple[PieceLayout, SamplePlan | None]] = {}
        """(id(layout), shape, strides, dtype, batch dim, phase) -> (the layout, the plan of
        such captures' sample digests or None): `sample_plan`."""
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

    def fused_plan(self, t: torch.Tensor, layout: PieceLayout) -> FusedDescriptor | None:
        """What every descriptor of a piece like ``t`` placed by ``layout`` shares, when the
        fused kernel takes it, else None: what a caller caches per site, shape, strides and
        dtype so that a capture's descriptor is one ``pack_head(t.data_ptr(), code, ndim,
        base, payload) + tail`` (agents/kernels/cpu.py). ``t`` may be a Parameter (its data is
        a plain tensor's)."""
        cpu = self._cpu
        if cpu is None or t.dtype.is_complex:
            return None
        plain = t.detach() if type(t) is not torch.Tensor else t
        if not cpu.supports(plain):
            return None
        base, gs = cpu.index_map(tuple(t.shape), layout)
        return FusedDescriptor(cpu.DTYPE_CODES[t.dtype], t.dim(), base,
                               cpu.descriptor_tail(t, gs))

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
        if fused_at and cpu is not None:  # fused_at: only with the kernel
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

    def digest_samples(self, items: list[SampleItem]) -> list:
        """Per item, the digests of its samples along its batch dim, ``(f64 [n, 5 + k], i64
        [n, 6])`` on its device (row s: sample s as a piece of ``layout``), or the exception
        that failed it. A sample is a piece: CPU pieces the fused kernel reads go to it, all
        samples of all such items of one k in one call (their descriptors are one numpy array
        per item); accelerator pieces to Triton where trusted, one call per k; the rest to the
        vectorized eager digest (`sample_digest.digest_samples_eager`)."""
        out: list = [None] * len(items)
        fused: dict[int, list[int]] = {}
        triton: dict[int, list[int]] = {}
        for i, (t, _, _, k) in enumerate(items):
            if self._cpu is not None and self._cpu.supports(t) and not t.dtype.is_complex:
                fused.setdefault(k, []).append(i)
            elif self._triton is not None and t.device.type in self._triton.device_types:
                triton.setdefault(k, []).append(i)
        for k, at in fused.items():
            self._samples_fused(items, at, k, out)
        for k, at in triton.items():
            self._samples_triton(items, at, k, out)
        for i, item in enumerate(items):
            if out[i] is None:
                t, layout, dim, k = item
                try:
                    out[i] = digest_samples_eager(t, layout, dim, k)
                except Exception as exc:
                    out[i] = exc
        return out

    def sample_plan(self, t: torch.Tensor, layout: PieceLayout, dim: int,
                    phase: int) -> SamplePlan | None:
        """The plan of the sample digests of a capture of ``t`` placed by ``layout`` (None: it
        gets none), worked out once per layout, shape, strides, dtype, dim and phase; the fused
        kernel's descriptors of its samples, relative to its address, where the kernel reads
        it (each is the piece's descriptor with the batch dim at size 1 and global stride 0,
        one sample further: built for all samples in one numpy operation)."""
        key = (id(layout), t.shape, t.stride(), t.dtype, dim, phase)
        hit = self._sample_plans.get(key)
        if hit is not None and hit[0] is layout:
            return hit[1]
        plan = plan_samples(layout, dim, t.dtype, phase)
        cpu = self._cpu
        if plan is not None and cpu is not None and cpu.supports(t) and not t.dtype.is_complex:
            first = t.narrow(dim, 0, 1)  # the batch dim kept at size 1: global stride 0
            base, gs = cpu.index_map(tuple(first.shape), plan.slayout)
            row = np.array([0, cpu.DTYPE_CODES[t.dtype], t.dim(), base, 0]
                           + [v for d in zip(first.shape, first.stride(), gs) for v in d],
                           np.int64)
            plan.descriptors = np.repeat(row[None, :], plan.count, axis=0)
            plan.descriptors[:, 0] = (t.stride(dim) * t.element_size()
                                      * np.arange(plan.count, dtype=np.int64))
        if len(self._sample_plans) >= MAX_CACHED_MAPS:
            self._sample_plans.clear()
        self._sample_plans[key] = (layout, plan)
        return plan

    def digest_planned(self, items: list[tuple[SamplePlan, torch.Tensor]]) -> list:
        """Per item, the digests of its samples with ``plan.kd`` buckets, ``(f64 [n, 5 + kd],
        i64 [n, 6])`` (numpy arrays on the host, tensors on an accelerator), or the exception
        that failed it: the fused kernel for planned descriptors, all samples of one kd in one
        call, into rows cut from a host arena (`_SampleRows`: an allocation, torch's or
        numpy's, costs more than the kernel call on small pieces); the rest through
        `digest_samples`."""
        out: list = [None] * len(items)
        groups: dict[int, list[int]] = {}
        rest: list[int] = []
        for i, (plan, _) in enumerate(items):
            (groups.setdefault(plan.kd, []) if plan.descriptors is not None else rest).append(i)
        for kd, at in groups.items():
            descs = []
            for i in at:
                plan, t = items[i]
                assert plan.descriptors is not None  # grouped: only plans with descriptors
                arr = plan.descriptors.copy()
                arr[:, 0] += t.data_ptr()
                descs.append(arr.tobytes())
            # the kernel reads descriptors one after another: pieces of another ndim have rows
            # of another width, which one array could not hold (join of one is that one)
            blob = b"".join(descs)
            counts = [items[i][0].count for i in at]
            total = sum(counts)
            arena = self._sample_rows.get(kd)
            if arena is None:
                arena = self._sample_rows[kd] = _SampleRows(kd)
            f64, i64, f64_at, i64_at = arena.take(total)
            cpu = self._cpu
            assert cpu is not None  # descriptors are planned only with the kernel
            if _sample_kernel(cpu, total, blob, kd, f64_at, i64_at, at, out):
                _deal_rows(out, at, counts, f64, i64)
        if rest:
            got = self.digest_samples([(t, p.slayout, p.dim, p.kd)
                                       for p, t in (items[i] for i in rest)])
            for i, res in zip(rest, got):
                out[i] = res
        return out

    def _samples_fused(self, items: list[SampleItem], at: list[int], k: int, out: list) -> None:
        cpu = self._cpu
        if cpu is None:  # called only with the kernel; the eager path stands in
            return
        descs: list[bytes] = []
        counts: list[int] = []
        ok: list[int] = []
        for i in at:
            t, layout, dim, _ = items[i]
            try:
                sample0 = t.narrow(dim, 0, 1)
                base, gs = cpu.index_map(tuple(sample0.shape), layout)
                row = np.array([0, cpu.DTYPE_CODES[t.dtype], t.dim(), base, 0]
                               + [v for d in zip(sample0.shape, sample0.stride(), gs)
                                  for v in d],
                               np.int64)
                n = t.shape[dim]
                arr = np.repeat(row[None, :], n, axis=0)
                arr[:, 0] = t.data_ptr() + t.stride(dim) * t.element_size() * np.arange(
                    n, dtype=np.int64)
                descs.append(arr.tobytes())
                counts.append(n)
                ok.append(i)
            except Exception as exc:
                out[i] = exc
        total = sum(counts)
        if not total:
            return
        f64 = torch.empty((total, N_MOMENTS + k), dtype=torch.float64)
        i64 = torch.empty((total, 6), dtype=torch.int64)
        if _sample_kernel(cpu, total, b"".join(descs), k, f64.data_ptr(), i64.data_ptr(), ok,
                          out):
            _deal_rows(out, ok, counts, f64, i64)

    def _samples_triton(self, items: list[SampleItem], at: list[int], k: int, out: list) -> None:
        triton = self._triton
        if triton is None:  # called only with Triton; the eager path stands in
            return
        pieces: list[tuple[torch.Tensor, PieceLayout]] = []
        owner: list[tuple[int, int]] = []
        for i in at:
            t, layout, dim, _ = items[i]
            views = t.unbind(dim)
            pieces.extend((v, layout) for v in views)
            owner.append((i, len(views)))
        try:
            got = triton.digest_many(pieces, k)
        except Exception:  # digest_many never raises; the eager path stands in if it does
            return
        first = 0
        for i, n in owner:
            rows = got[first:first + n]
            first += n
            done = [r for r in rows if r is not None]
            if n and len(done) == len(rows):
                out[i] = (torch.stack([r[0] for r in done]), torch.stack([r[1] for r in done]))


class _SampleRows:
    """Host rows for sample digests of one bucket count, cut from blocks of ARENA_ROWS rows: a
    capture's rows are views of a block (the block lives while any of them does), so its
    samples cost no allocation."""

    ARENA_ROWS = 4096

    __slots__ = ("k", "f64", "i64", "used", "f64_at", "i64_at")

    def __init__(self, k: int) -> None:
        self.k = k
        self.used = self.ARENA_ROWS

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Rows for n samples: (f64 [n, 5 + k], i64 [n, 6], their addresses)."""
        if self.used + n > self.ARENA_ROWS:
            rows = max(n, self.ARENA_ROWS)
            self.f64 = np.empty((rows, N_MOMENTS + self.k))
            self.i64 = np.empty((rows, 6), np.int64)
            self.f64_at, self.i64_at = self.f64.ctypes.data, self.i64.ctypes.data
            self.used = 0
        a = self.used
        self.used = a + n
        return (self.f64[a:a + n], self.i64[a:a + n], self.f64_at + a * 8 * (N_MOMENTS + self.k),
                self.i64_at + a * 48)


def _sample_kernel(cpu, total: int, blob: bytes, k: int, f64_at: int, i64_at: int,
                   at: list[int], out: list) -> bool:
    """One fused-kernel call digesting ``total`` samples' descriptors into the rows at the two
    addresses; on failure each item of ``at`` gets the exception in ``out`` and False returns."""
    try:
        bad = cpu.kernel()(total, blob, k, f64_at, i64_at)
        if bad:
            raise RuntimeError(f"samples[{bad - 1}]: descriptor rejected by the kernel")
    except Exception as exc:
        for i in at:
            out[i] = exc
        return False
    return True


def _deal_rows(out: list, at: list[int], counts: list[int], f64, i64) -> None:
    """Consecutive rows of ``f64``/``i64`` to the items of ``at``, ``counts[j]`` to the j-th."""
    first = 0
    for i, n in zip(at, counts):
        out[i] = (f64[first:first + n], i64[first:first + n])
        first += n
