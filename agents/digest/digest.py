"""Digests of tensor pieces, computed on the tensor's own device (DESIGN.md "digest").

A digest is two small device tensors per piece, so that a batch of captures can be stacked and
sent to the host in one transfer (:func:`digest_batch_to_host`):

- ``f64`` row, length ``5 + k``: ``[sum, sum_sq, min, max, abs_max, sketch_0 .. sketch_{k-1}]``,
  moments over the finite elements only (NaN/Inf excluded; ``min=+inf, max=-inf, abs_max=0``
  when there is no finite element). Integer and bool pieces have no moments: their row is the
  merge identity ``[0, 0, +inf, -inf, 0, 0 .. 0]`` and :func:`has_moments` says so.
- ``i64`` row, length 6: ``[numel, nan, posinf, neginf, zeros, fingerprint]``; the fingerprint is
  a uint64 stored as its two's-complement int64.

Everything here merges across pieces by addition (min/max by min/max), which is what lets the
auditor rebuild the digest of a logical tensor from shards laid out any way. The scheme, seeds,
error bands and costs are documented in docs/digests.md; ``auditor/digests.py`` is the host side.

Hash scheme (version 3, agents/digest/hashing.py): the fingerprint is ``sum_i K(i) * V(x_i) mod
2**64`` with the odd geometric key ``K(i) = u * h**i`` (a lane table times a per-block power) and
``V`` the raw element zero-extended to 64 bits (floats: their bit pattern; integers: their value),
through mix64 for float64, integers and bool; the sketch
adds ``sign(i) * x_i`` (finite elements, float64) to bucket ``bucket(i)``. Keys, buckets and
signs depend on the global flat index only, so pieces merge by addition.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from numaudit.agents.digest import hashing
from numaudit.agents.layout import PieceLayout, complex_real_layout

logger = logging.getLogger(__name__)

DEFAULT_SKETCH_K = 256
"""Sketch buckets. The L2-distance estimate's relative sigma is 1/sqrt(2k): 4.4% at 256, for
2 KiB per record; docs/digests.md has the measured cost of other k."""

FINGERPRINT_SEED = hashing.FINGERPRINT_SEED
"""Written to Digest.fingerprint_seed: it names the hash scheme (agents/digest/hashing.py)."""

SKETCH_SEED = hashing.SKETCH_SEED
"""Written to Digest.sketch_seed."""

N_MOMENTS = 5
F64_FIELDS = ("sum", "sum_sq", "min", "max", "abs_max")
I64_FIELDS = ("numel", "nan", "posinf", "neginf", "zeros", "fingerprint")

CHUNK_ELEMENTS_CPU = 1 << 18
"""Elements per chunk on CPU: the reused temporaries stay in L2/L3; fresh large allocations
(page faults) are never made; FIELD-NOTES measured bf16 reductions 20x slower unchunked."""
CHUNK_ELEMENTS_CUDA = 1 << 20
"""Elements per chunk on accelerators: large enough to hide kernel launches; the workspace is
then about 40 MiB per device and capturing thread (forward and autograd threads each have one)."""

_SIGNED_VIEW = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
_BITS_VIEW = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}


def has_moments(dtype: torch.dtype) -> bool:
    """Float and complex pieces get moments and a sketch; integer and bool pieces do not."""
    return dtype.is_floating_point or dtype.is_complex


def row_length(sketch_k: int = DEFAULT_SKETCH_K) -> int:
    """Length of the f64 row for a sketch of ``sketch_k`` buckets."""
    return N_MOMENTS + sketch_k


# --------------------------------------------------------------------------- workspace


class _Workspace:
    """Reused per-thread, per-device buffers (about 40 bytes per chunk element): large fresh
    temporaries cost page faults on CPU and allocator churn on accelerators."""

    def __init__(self, device: torch.device, chunk: int) -> None:
        self.chunk = chunk
        self.device = device
        # Keys and bins of a contiguous range are built for whole blocks of LANES indices and
        # then viewed at the range's offset: room for one block more on each side.
        grid = chunk + 2 * hashing.LANES
        i64 = torch.int64
        self.key = torch.empty(grid, dtype=i64, device=device)
        self.bins = torch.empty(grid, dtype=i64, device=device)
        self.tmp = torch.empty(grid, dtype=i64, device=device)
        self.term = torch.empty(grid, dtype=i64, device=device)
        self.f64 = torch.empty(chunk, dtype=torch.float64, device=device)
        self._f32: torch.Tensor | None = None

    @property
    def f32(self) -> torch.Tensor:
        """Staging buffer for float16 upcasts, made on first use."""
        if self._f32 is None:
            self._f32 = torch.empty(self.chunk, dtype=torch.float32, device=self.device)
        return self._f32


_local = threading.local()


def _workspace(device: torch.device) -> _Workspace:
    cache: dict = _local.__dict__.setdefault("ws", {})
    ws = cache.get(device)
    chunk = CHUNK_ELEMENTS_CPU if device.type == "cpu" else CHUNK_ELEMENTS_CUDA
    if ws is None or ws.chunk != chunk:
        ws = cache[device] = _Workspace(device, chunk)
    return ws


def release_workspaces() -> None:
    """Free this thread's digest buffers (they are recreated on the next digest)."""
    _local.__dict__.pop("ws", None)


# --------------------------------------------------------------------------- index keys


@dataclass(frozen=True)
class _IndexMap:
    """Maps a piece's row-major flat index p to the logical tensor's flat index.

    ``global(p) = base + sum_d coord_d(p) * gstride_d`` over ``dims = ((size, gstride), ...)``,
    outermost first, after dropping size-1 dims and merging a dim into its outer neighbour when
    the piece spans it fully. Full tensors, Shard(0) and batch splits collapse to one dim with
    gstride 1 (a contiguous range), whose keys are built per whole block, without per-element
    hashing.
    """

    base: int
    dims: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, layout: PieceLayout) -> _IndexMap:
        gstrides = [math.prod(layout.logical_shape[d + 1:]) for d in range(len(layout.shape))]
        base = sum(o * s for o, s in zip(layout.offsets, gstrides))
        dims: list[tuple[int, int]] = []
        for size, gs in zip(layout.shape, gstrides):
            if size == 1:
                continue
            if dims and dims[-1][1] == size * gs:
                dims[-1] = (dims[-1][0] * size, gs)
            else:
                dims.append((size, gs))
        return cls(base, tuple(dims))

    @property
    def last(self) -> int:
        """The largest global flat index of the piece (a bound for the key tables)."""
        return self.base + sum((size - 1) * gs for size, gs in self.dims)

    @property
    def contiguous(self) -> bool:
        return not self.dims or (len(self.dims) == 1 and self.dims[0][1] == 1)

    def keys_into(
        self, start: int, m: int, ws: _Workspace, sketch_k: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fingerprint keys and (when ``sketch_k``) signed sketch bins ``bucket + k * sign``
        for piece indices [start, start + m), as int64 views into ``ws``."""
        g0 = self.base + start
        if self.contiguous:
            # Whole blocks: the lane table times one power per block, then a view at the offset.
            off, b0 = g0 & (hashing.LANES - 1), g0 >> hashing.LANE_BITS
            nb = (off + m + hashing.LANES - 1) >> hashing.LANE_BITS
            blocks = torch.arange(b0, b0 + nb, dtype=torch.int64, device=ws.device)
            keys, bins = _block_keys_and_bins(blocks, b0 + nb - 1, ws, sketch_k)
            return keys.view(-1)[off:off + m], None if bins is None else bins.view(-1)[off:off + m]
        gi = ws.term[:m]
        self._global_into(start, m, ws, gi)
        blocks = torch.bitwise_right_shift(gi, hashing.LANE_BITS)
        gi.bitwise_and_(hashing.LANES - 1)
        return _keys_and_bins(gi, blocks, self.last >> hashing.LANE_BITS, ws, sketch_k)

    def _global_into(self, start: int, m: int, ws: _Workspace, out: torch.Tensor) -> None:
        if self.contiguous:
            torch.arange(self.base + start, self.base + start + m, out=out)
            return
        q = ws.tmp[:m]
        torch.arange(start, start + m, out=q)
        out.fill_(self.base)
        coord = ws.key[:m]
        for d, (size, gs) in enumerate(reversed(self.dims)):
            if d == len(self.dims) - 1:
                out.add_(q, alpha=gs)
            else:
                torch.remainder(q, size, out=coord)
                out.add_(coord, alpha=gs)
                q.floor_divide_(size)


def _block_keys_and_bins(
    blocks: torch.Tensor, top: int, ws: _Workspace, sketch_k: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys and bins of every lane of whole blocks, as [nb, 256] grids in ws.key and ws.bins:
    a contiguous range needs no per-element lookups, only broadcasts against per-block words."""
    table, _, lane, bent_shifted, place_g, place_x = hashing.tables(ws.device)
    shape = (blocks.numel(), hashing.LANES)
    n = shape[0] * shape[1]
    keys = ws.key[:n].view(shape)
    torch.mul(table.unsqueeze(0), hashing.block_powers(blocks, top).unsqueeze(1), out=keys)
    if sketch_k is None:
        return keys, None
    w = hashing.block_words(blocks, hashing.SKETCH_SEED)
    bins = ws.bins[:n].view(shape)
    shift = torch.bitwise_right_shift(w, 32).bitwise_and_(hashing.LANES - 1)
    torch.index_select(bent_shifted, 0, shift, out=bins)  # bent(j ^ shift) per row
    bins.bitwise_xor_(torch.bitwise_right_shift(w, 63).bitwise_and_(1).unsqueeze(1))
    bins.mul_(sketch_k)
    rows = torch.bitwise_right_shift(w, 40).bitwise_and_(hashing.PLACE_ROWS - 1)
    # per block and lane group: 8 g + (r ^ x), as [nb, 32 groups, 8 lanes]
    tmp = ws.tmp[:n].view(shape[0], hashing.GROUPS, 8)
    torch.bitwise_xor(place_x.index_select(0, rows).unsqueeze(2), lane[:8], out=tmp)
    tmp.add_(place_g.index_select(0, rows).unsqueeze(2), alpha=8)
    tmp = tmp.view(shape)
    tmp.bitwise_xor_(w.bitwise_and(sketch_k - 1 & ~(hashing.LANES - 1)).unsqueeze(1))
    bins.add_(tmp.bitwise_and_(sketch_k - 1))
    return keys, bins


def _keys_and_bins(
    lanes: torch.Tensor, blocks: torch.Tensor, top: int, ws: _Workspace, sketch_k: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Keys ``T[j] * P(b)`` and bins ``bucket + k * sign`` per element of flat ``lanes`` and
    ``blocks`` (any global indices), into ws.key and ws.bins."""
    table, bent, _, _, place_g, place_x = hashing.tables(ws.device)
    n = lanes.numel()
    keys = ws.key[:n]
    torch.index_select(table, 0, lanes, out=keys)
    keys.mul_(hashing.block_powers(blocks, top))
    if sketch_k is None:
        return keys, None
    w = hashing.block_words(blocks, hashing.SKETCH_SEED)
    bins, tmp = ws.bins[:n], ws.tmp[:n]
    torch.bitwise_xor(lanes, torch.bitwise_right_shift(w, 32), out=tmp)
    tmp.bitwise_and_(hashing.LANES - 1)
    torch.index_select(bent, 0, tmp, out=bins)
    bins.bitwise_xor_(torch.bitwise_right_shift(w, 63).bitwise_and_(1))  # the sign bit
    bins.mul_(sketch_k)
    # placement entry of (row, group): flat index row * 32 + group
    torch.bitwise_right_shift(w, 40, out=tmp).bitwise_and_(hashing.PLACE_ROWS - 1)
    tmp.mul_(hashing.GROUPS).add_(torch.bitwise_right_shift(lanes, 3))
    x = place_x.view(-1).index_select(0, tmp)
    g = place_g.view(-1).index_select(0, tmp)
    torch.bitwise_and(lanes, 7, out=tmp).bitwise_xor_(x).add_(g, alpha=8)
    tmp.bitwise_xor_(w.bitwise_and_(sketch_k - 1 & ~(hashing.LANES - 1)))
    bins.add_(tmp.bitwise_and_(sketch_k - 1))
    return keys, bins


# --------------------------------------------------------------------------- chunks


def _chunks(t: torch.Tensor, chunk: int, start: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(flat_start, 1-D chunk)`` in row-major order, copying at most one chunk at a time.

    Contiguous tensors are viewed; non-contiguous ones are split along leading dims so no copy
    of the whole tensor is made.
    """
    n = t.numel()
    if n == 0:
        return
    if t.is_contiguous():
        flat = t.view(-1)
        for a in range(0, n, chunk):
            yield start + a, flat[a:a + chunk]
        return
    if n <= chunk:
        yield start, t.reshape(-1)
        return
    if t.dim() == 1:
        for a in range(0, n, chunk):
            yield start + a, t[a:a + chunk].contiguous()
        return
    inner = n // t.shape[0]
    rows = chunk // inner
    if rows >= 1:
        for r in range(0, t.shape[0], rows):
            yield start + r * inner, t[r:r + rows].reshape(-1)
        return
    for r in range(t.shape[0]):
        yield from _chunks(t[r], chunk, start + r * inner)


# --------------------------------------------------------------------------- digest


def digest_piece(
    t: torch.Tensor, layout: PieceLayout, *, sketch_k: int = DEFAULT_SKETCH_K
) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest one piece on its own device: ``(f64 row [5 + k], i64 row [6])``, both on t.device.

    ``layout`` places ``t`` in its logical tensor (``t.shape == layout.shape``; size-1 dims may
    differ). A complex ``t`` is digested as ``torch.view_as_real(t)``; pass either its complex
    layout or :func:`agents.layout.complex_real_layout` of it. ``t`` is never modified; it may be
    non-contiguous or require grad. On accelerators nothing waits on the device; on CPU a chunk's
    sum is read to decide whether NaN/Inf must be counted (counting is 20x dearer than a sum).
    """
    return _digest(t, layout, sketch_k, sync_free=None)


@torch.no_grad()
def _digest(
    t: torch.Tensor,
    layout: PieceLayout,
    sketch_k: int,
    *,
    sync_free: bool | None,
    timings: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """digest_piece with the sync policy explicit (tests run the accelerator path on CPU).

    ``timings``, when given, accumulates seconds per component (keys, fingerprint, moments,
    sketch) for the benchmark; it synchronizes the device and is not for production use.
    """
    t = t.detach()
    if hasattr(t, "to_local") and hasattr(t, "placements"):  # a DTensor: digest the local shard
        t = t.to_local()
    if t.is_complex():
        if len(layout.shape) == t.dim():
            layout = complex_real_layout(layout)
        t = torch.view_as_real(t)
    _check(t, layout, sketch_k)
    device = t.device
    if sync_free is None:
        sync_free = device.type != "cpu"
    moments = has_moments(t.dtype)
    n = t.numel()

    f64 = torch.zeros(N_MOMENTS + sketch_k, dtype=torch.float64, device=device)
    f64[2] = math.inf
    f64[3] = -math.inf
    counts = torch.zeros(6, dtype=torch.int64, device=device)
    counts[0] = n
    if n == 0:
        return f64, counts

    ws = _workspace(device)
    index_map = _IndexMap.of(layout)
    acc = _Accumulator(device, sketch_k)
    bits_dtype = _bits_view(t.dtype)
    mixed = hashing.mixed_dtype(t.dtype)
    lap = _Laps(timings, device)
    for start, x in _chunks(t, ws.chunk):
        m = x.numel()
        lap("chunking")
        keys, bins = index_map.keys_into(start, m, ws, sketch_k if moments else None)
        lap("keys")
        _chunk_fingerprint(x, ws, keys, acc, bits_dtype, mixed)
        lap("fingerprint")
        if moments:
            _chunk_moments(x, ws, m, acc, sync_free)
            lap("moments")
            assert bins is not None  # keys_into gives bins whenever sketch_k is passed
            acc.sketch2.scatter_add_(0, bins, ws.f64[:m])
            lap("sketch")
        else:
            # count_nonzero has no uint16/32/64 kernels: their signed views have the same zeros
            signed = _SIGNED_VIEW.get(x.dtype)
            acc.nz.append(torch.count_nonzero(x if signed is None else x.view(signed)))
            lap("moments")
    out = acc.finish(f64, counts, n, moments)
    lap("finish")
    return out


class _Laps:
    """Adds the time since the previous call to ``timings[name]``; a no-op without timings."""

    def __init__(self, timings: dict[str, float] | None, device: torch.device) -> None:
        self.timings = timings
        self.sync = device.type == "cuda"
        if timings is not None:
            self.last = self._now()

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def __call__(self, name: str) -> None:
        if self.timings is None:
            return
        now = self._now()
        self.timings[name] = self.timings.get(name, 0.0) + now - self.last
        self.last = now


def _chunk_fingerprint(
    x: torch.Tensor, ws: _Workspace, keys: torch.Tensor, acc: _Accumulator,
    bits_dtype: torch.dtype | None, mixed: bool,
) -> None:
    """Fingerprint terms ``K(i) * V(x_i)`` of one chunk, summed (int64 arithmetic wraps);
    ``V`` is the bits, through mix64 for ``mixed`` dtypes (hashing.mixed_dtype)."""
    m = keys.numel()
    term = ws.term[:m]
    term.copy_(x.view(bits_dtype) if bits_dtype is not None else x)  # zero-extends
    if mixed:
        hashing.mix64_(term, ws.tmp[:m])
    acc.fp.append(term.mul_(keys).sum())


class _Accumulator:
    """Per-chunk partial results, kept on the device and combined once per piece."""

    def __init__(self, device: torch.device, k: int) -> None:
        self.k = k
        self.sketch2 = torch.zeros(2 * k, dtype=torch.float64, device=device)
        self.fp: list[torch.Tensor] = []
        self.nz: list[torch.Tensor] = []
        self.sum: list[torch.Tensor] = []
        self.sum_sq: list[torch.Tensor] = []
        self.min: list[torch.Tensor] = []
        self.max: list[torch.Tensor] = []
        self.nonfinite: list[torch.Tensor] = []  # [nan, posinf, neginf] per masked chunk

    def finish(self, f64: torch.Tensor, counts: torch.Tensor, n: int, moments: bool):
        counts[4] = n - torch.stack(self.nz).sum()
        counts[5] = torch.stack(self.fp).sum()  # int64 sum wraps mod 2**64
        if not moments:
            return f64, counts
        if self.nonfinite:
            counts[1:4] = torch.stack(self.nonfinite).sum(0)
        lo = torch.stack(self.min).min()
        hi = torch.stack(self.max).max()
        f64[0] = torch.stack(self.sum).sum()
        f64[1] = torch.stack(self.sum_sq).sum()
        f64[2] = lo
        f64[3] = hi
        f64[4] = torch.where(lo <= hi, torch.maximum(lo.abs(), hi.abs()), 0.0)
        f64[N_MOMENTS:] = self.sketch2[:self.k] - self.sketch2[self.k:]
        return f64, counts


def _chunk_moments(
    x: torch.Tensor, ws: _Workspace, m: int, acc: _Accumulator, sync_free: bool
) -> None:
    """Moments of one float chunk over its finite elements; leaves the chunk in ``ws.f64`` as
    float64 with NaN/Inf replaced by 0, for the sketch."""
    f = ws.f64[:m]
    if x.dtype == torch.float16:  # f16 -> f64 has no fast path; via f32 is 4x faster
        f.copy_(ws.f32[:m].copy_(x))
    else:
        f.copy_(x)
    acc.nz.append(torch.count_nonzero(f if x.element_size() < 4 else x))
    s = f.sum()
    if not sync_free and math.isfinite(s.item()):
        lo, hi = torch.aminmax(x)
        acc.min.append(lo.to(torch.float64))
        acc.max.append(hi.to(torch.float64))
    else:
        # Something is NaN/Inf (or, on an accelerator, might be): count and mask on device.
        acc.nonfinite.append(torch.stack([torch.isnan(f).sum(), (f == math.inf).sum(),
                                          (f == -math.inf).sum()]))
        finite = torch.isfinite(f)
        acc.min.append(torch.where(finite, f, math.inf).min())
        acc.max.append(torch.where(finite, f, -math.inf).max())
        f.masked_fill_(finite.logical_not_(), 0.0)
        s = f.sum()
    acc.sum.append(s)
    acc.sum_sq.append(torch.dot(f, f))


def _bits_view(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to view elements as so that a copy to int64 zero-extends their raw bits.

    None for integers other than uint64: they enter the fingerprint by value, so an int32 and an
    int64 tensor with the same values get the same terms.
    """
    if dtype.is_floating_point or dtype == torch.bool:
        return _BITS_VIEW[dtype.itemsize]
    if dtype == torch.uint64:
        return torch.int64
    return None


def _check(t: torch.Tensor, layout: PieceLayout, sketch_k: int) -> None:
    if sketch_k < 1 or sketch_k & (sketch_k - 1) or sketch_k > 1 << 24:
        raise ValueError(f"sketch_k: {sketch_k} is not a power of two in [1, 2**24]")
    layout.validate()
    if tuple(t.shape) != layout.shape:
        squeeze = tuple(s for s in t.shape if s != 1)
        if squeeze != tuple(s for s in layout.shape if s != 1):
            raise ValueError(f"shape: tensor {tuple(t.shape)} != layout.shape {layout.shape}")
    if t.element_size() not in _BITS_VIEW:
        raise ValueError(f"dtype: {t.dtype} has an unsupported element size")


# --------------------------------------------------------------------------- host transfer


def digest_batch_to_host(
    rows_f64: list[torch.Tensor], rows_i64: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
    """Stack a batch of digest rows and start their one copy to the host.

    Returns ``(f64 [n, 5 + k], i64 [n, 6], event)`` with the tensors on the CPU. When the rows
    live on a CUDA device the copy is asynchronous into pinned memory and ``event`` is recorded
    on the current stream after it: the caller must ``event.synchronize()`` (from any thread)
    before reading the tensors. ``event`` is None when no wait is needed (CPU rows; other
    accelerators are copied synchronously). All rows must share one device and k.
    """
    if len(rows_f64) != len(rows_i64):
        raise ValueError(f"rows_i64: {len(rows_i64)} rows != {len(rows_f64)} f64 rows")
    if not rows_f64:
        raise ValueError("rows_f64: empty batch")
    lengths = {r.numel() for r in rows_f64}
    if len(lengths) != 1:
        raise ValueError(f"rows_f64: rows of different lengths {sorted(lengths)} (mixed sketch_k)")
    f64 = torch.stack(rows_f64)
    i64 = torch.stack(rows_i64)
    if f64.device.type == "cpu":
        return f64, i64, None
    if f64.device.type != "cuda":
        # Other accelerators have no event to wait on here: copy synchronously.
        return f64.cpu(), i64.cpu(), None
    host_f64 = torch.empty(f64.shape, dtype=f64.dtype, pin_memory=True)
    host_i64 = torch.empty(i64.shape, dtype=i64.dtype, pin_memory=True)
    host_f64.copy_(f64, non_blocking=True)
    host_i64.copy_(i64, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host_f64, host_i64, event
