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

Hash scheme (all arithmetic mod 2**64, done with int64 torch ops that wrap):

- index key ``h(i) = mix64(SKETCH_SEED + GOLDEN_GAMMA * i)`` for the global flat index ``i`` in
  the logical tensor (the i-th output of splitmix64 seeded with SKETCH_SEED). Computed once per
  element and shared by the sketch and the fingerprint.
- sketch: ``b = h & (2k - 1)``; bucket ``b mod k``, sign ``-1`` when ``b >= k``. Buckets
  accumulate ``sign * x`` in float64.
- fingerprint: ``sum_i mix64(h(i) ^ bits(x_i) ^ FINGERPRINT_SEED)`` where ``bits`` is the raw
  element zero-extended to 64 bits (floats: their bit pattern; integers: their value).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from agents.layout import PieceLayout, complex_real_layout

logger = logging.getLogger(__name__)

DEFAULT_SKETCH_K = 256
"""Sketch buckets. The L2-distance estimate's relative sigma is 1/sqrt(2k): 4.4% at 256, for
2 KiB per record; see docs/digests.md for the measured cost of other k."""

FINGERPRINT_SEED = 0x6E756D6175646974  # b"numaudit"
"""Seed folded into every fingerprint term; written to Digest.fingerprint_seed."""

SKETCH_SEED = 0x736B657463683031  # b"sketch01"
"""Seed of the index key that places elements in sketch buckets; written to Digest.sketch_seed.
The fingerprint's index key uses it too, so fingerprints compare only when both seeds agree."""

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB
MIX_SHIFTS = (30, 27, 31)
"""splitmix64's finalizer (Stafford's Mix13): z ^= z>>30; z *= C1; z ^= z>>27; z *= C2; z ^= z>>31."""

N_MOMENTS = 5
F64_FIELDS = ("sum", "sum_sq", "min", "max", "abs_max")
I64_FIELDS = ("numel", "nan", "posinf", "neginf", "zeros", "fingerprint")

CHUNK_ELEMENTS_CPU = 1 << 18
"""Elements per chunk on CPU: temporaries stay in cache and fresh large allocations (page
faults) are avoided; FIELD-NOTES measured bf16 reductions 20x slower unchunked."""
CHUNK_ELEMENTS_CUDA = 1 << 21
"""Elements per chunk on accelerators: large enough to hide kernel launches; the per-thread
workspace is then ~5 * 8 * 2M bytes = 80 MiB."""

_U64 = 1 << 64


def _s64(u: int) -> int:
    """A uint64 constant as the int64 torch needs (same bits)."""
    u %= _U64
    return u - _U64 if u >= 1 << 63 else u


_C1, _C2, _GAMMA = _s64(MIX_C1), _s64(MIX_C2), _s64(GOLDEN_GAMMA)
_FP_SEED = _s64(FINGERPRINT_SEED)
_LOW_MASK = {s: (1 << (64 - s)) - 1 for s in MIX_SHIFTS}  # emulates a logical right shift
_BITS_VIEW = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}


def has_moments(dtype: torch.dtype) -> bool:
    """Float and complex pieces get moments and a sketch; integer and bool pieces do not."""
    return dtype.is_floating_point or dtype.is_complex


def row_length(sketch_k: int = DEFAULT_SKETCH_K) -> int:
    """Length of the f64 row for a sketch of ``sketch_k`` buckets."""
    return N_MOMENTS + sketch_k


# --------------------------------------------------------------------------- workspace


class _Workspace:
    """Reused per-thread, per-device buffers: large fresh temporaries cost page faults on CPU."""

    def __init__(self, device: torch.device, chunk: int) -> None:
        self.chunk = chunk
        i64 = dict(dtype=torch.int64, device=device)
        self.arange = torch.arange(chunk, **i64)
        # GAMMA * j mod 2**64: a contiguous run of indices needs one add to get its keys.
        self.arange_gamma = self.arange * _GAMMA
        self.key = torch.empty(chunk, **i64)
        self.tmp = torch.empty(chunk, **i64)
        self.term = torch.empty(chunk, **i64)
        self.f64 = torch.empty(chunk, dtype=torch.float64, device=device)


_local = threading.local()


def _workspace(device: torch.device) -> _Workspace:
    cache: dict = _local.__dict__.setdefault("ws", {})
    ws = cache.get(device)
    if ws is None:
        chunk = CHUNK_ELEMENTS_CPU if device.type == "cpu" else CHUNK_ELEMENTS_CUDA
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
    gstride 1 (a contiguous range), so their keys cost one add.
    """

    base: int
    dims: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, layout: PieceLayout) -> _IndexMap:
        gstrides = []
        acc = 1
        for g in reversed(layout.logical_shape):
            gstrides.append(acc)
            acc *= g
        gstrides.reverse()
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
    def contiguous(self) -> bool:
        return not self.dims or (len(self.dims) == 1 and self.dims[0][1] == 1)

    def keys_into(self, start: int, m: int, ws: _Workspace, out: torch.Tensor) -> None:
        """Write ``SKETCH_SEED + GAMMA * global(p)`` for p in [start, start+m) into ``out``."""
        if self.contiguous:
            torch.add(ws.arange_gamma[:m], _s64(SKETCH_SEED + GOLDEN_GAMMA * (self.base + start)),
                      out=out)
            return
        q = ws.tmp[:m]
        torch.add(ws.arange[:m], start, out=q)
        out.zero_()
        coord = ws.term[:m]
        for d, (size, gs) in enumerate(reversed(self.dims)):
            if d == len(self.dims) - 1:
                out.add_(q, alpha=gs)
            else:
                torch.remainder(q, size, out=coord)
                out.add_(coord, alpha=gs)
                q.floor_divide_(size)
        out.mul_(_GAMMA).add_(_s64(SKETCH_SEED + GOLDEN_GAMMA * self.base))


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place on int64 ``z`` (a bijection of 64-bit values).

    torch's ``>>`` on int64 is arithmetic, so each logical shift is a shift plus a mask.
    """
    for shift, mult in zip(MIX_SHIFTS, (_C1, _C2, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_(_LOW_MASK[shift])
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z


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
            block = t[r:r + rows]
            yield start + r * inner, block.reshape(-1)
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
    t: torch.Tensor, layout: PieceLayout, sketch_k: int, *, sync_free: bool | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """digest_piece with the sync policy explicit (tests run the accelerator path on CPU)."""
    t = t.detach()
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
    sketch2 = torch.zeros(2 * sketch_k, dtype=torch.float64, device=device)
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in
                                            ("sum", "sum_sq", "min", "max", "nz", "fp",
                                             "nan", "posinf", "neginf")}
    bits_dtype = _bits_view(t.dtype)
    for start, x in _chunks(t, ws.chunk):
        m = x.numel()
        key, tmp, term = ws.key[:m], ws.tmp[:m], ws.term[:m]
        index_map.keys_into(start, m, ws, key)
        _mix64_(key, tmp)
        # fingerprint term: mix64(h ^ bits ^ seed), raw bits zero-extended (ints by value)
        term.copy_(x.view(bits_dtype) if bits_dtype is not None else x)
        term.bitwise_xor_(key).bitwise_xor_(_FP_SEED)
        _mix64_(term, tmp)
        parts["fp"].append(term.sum())
        parts["nz"].append(torch.count_nonzero(x))
        if moments:
            _chunk_moments(x, key[:m], ws.f64[:m], sketch2, sketch_k, parts, sync_free, tmp)

    def total(name: str) -> torch.Tensor:
        return torch.stack(parts[name]).sum()

    counts[4] = n - total("nz")
    counts[5] = total("fp")
    if moments:
        for i, name in ((1, "nan"), (2, "posinf"), (3, "neginf")):
            if parts[name]:
                counts[i] = total(name)
        lo = torch.stack(parts["min"]).min()
        hi = torch.stack(parts["max"]).max()
        f64[0] = total("sum")
        f64[1] = total("sum_sq")
        f64[2] = lo
        f64[3] = hi
        f64[4] = torch.where(lo <= hi, torch.maximum(lo.abs(), hi.abs()), 0.0)
        f64[N_MOMENTS:] = sketch2[:sketch_k] - sketch2[sketch_k:]
    return f64, counts


def _chunk_moments(
    x: torch.Tensor,
    key: torch.Tensor,
    f: torch.Tensor,
    sketch2: torch.Tensor,
    k: int,
    parts: dict[str, list[torch.Tensor]],
    sync_free: bool,
    tmp: torch.Tensor,
) -> None:
    """Moments and sketch of one float chunk, finite elements only."""
    f.copy_(x)
    s = f.sum()
    if not sync_free and math.isfinite(s.item()):
        lo, hi = torch.aminmax(x)
        parts["min"].append(lo.to(torch.float64))
        parts["max"].append(hi.to(torch.float64))
    else:
        # Something is NaN/Inf (or, on an accelerator, might be): count and mask on device.
        parts["nan"].append(torch.isnan(f).sum())
        parts["posinf"].append((f == math.inf).sum())
        parts["neginf"].append((f == -math.inf).sum())
        finite = torch.isfinite(f)
        parts["min"].append(torch.where(finite, f, math.inf).min())
        parts["max"].append(torch.where(finite, f, -math.inf).max())
        f.masked_fill_(finite.logical_not_(), 0.0)
        s = f.sum()
    parts["sum"].append(s)
    parts["sum_sq"].append(torch.dot(f, f))
    bins = torch.bitwise_and(key, 2 * k - 1, out=tmp)
    if not sync_free:
        sketch2.add_(torch.bincount(bins, weights=f, minlength=2 * k))
    else:
        # bincount on CUDA reads the max index back to the host; index_add_ does not.
        sketch2.index_add_(0, bins, f)


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
    if sketch_k < 1 or sketch_k & (sketch_k - 1):
        raise ValueError(f"sketch_k: {sketch_k} is not a power of two")
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
    after it: the caller must ``event.synchronize()`` (from any thread) before reading the
    tensors. ``event`` is None when no wait is needed. All rows must share one device and k.
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
    pin = f64.device.type == "cuda"
    host_f64 = torch.empty(f64.shape, dtype=f64.dtype, pin_memory=pin)
    host_i64 = torch.empty(i64.shape, dtype=i64.dtype, pin_memory=pin)
    host_f64.copy_(f64, non_blocking=True)
    host_i64.copy_(i64, non_blocking=True)
    event = None
    if pin:
        event = torch.cuda.Event()
        event.record()
    return host_f64, host_i64, event
