"""The digest of a list of pieces in a few Triton launches, for accelerator tensors (CUDA, ROCm).

Computes what agents/digest.py computes, on hash scheme version 3 (agents/hashing.py, whose
constants, lane table and block power table it uses): fingerprint
``sum_i T[j] * P(b) * V(x_i) mod 2**64`` (the geometric key ``u * h**i``), counts, float64 sum
and sum of squares, min/max/abs-max over finite elements, and the CountSketch, where
``j = i mod 256`` and ``b = i div 256`` split the global flat index ``i``. ``T[j] = u * h**j``
is the lane table, ``P(b) = h**(256 b)`` the product of ``POW[t][byte t of b]`` over the bytes
of ``b`` up to its highest non-zero one (``hashing.power_tensor``, [7, 256]: blocks below
2**56), and ``V(x)`` the element's bits zero-extended (float16, bfloat16, float32) or
``mix64`` of its 64-bit bits (float64, integers sign-extended, bool: ``hashing.mixed_dtype`` of
the piece's dtype, a compile-time flag per launch group). Sketch:
bucket ``((8 g + ((j & 7) ^ x)) ^ (W(b) & (k - 1) & ~255)) mod k`` with ``g`` and ``x`` read
from the placement table (``hashing.tables``' PLACE_G and PLACE_X, passed flattened) at row
``(W(b) >> 40) mod 4096``, column ``j >> 3``; sign from ``bent`` of the lane and ``W(b)``.

A hook's captures (every output of a module, every gradient of a parameter sweep) are digested
together, so their cost is per list, not per piece: one descriptor table (a row per piece) goes
to the device in one asynchronous copy, one zeroed output block holds every row, and per group
of pieces (same load dtype, float type, ``V`` rule and index path) two launches do the rest:

- ``_tiles_kernel``, one program per tile of ``ROWS x 256`` elements of any piece of the group:
  the program finds its piece by a binary search over the pieces' first tiles, reads the tile
  once, writes its fingerprint sum, counts, float64 sums and min/max as one row of partials,
  and adds its elements into its piece's sketch with ``tl.atomic_add`` (Triton has no
  block-local scatter into shared memory; k buckets are few, so the atomics hit L2). Pieces
  are addressed by their offset in elements from one of them (the anchor), so the tensors of
  a list need not be one allocation.
- ``_finish_kernel``, one program per piece: sums its tiles' partials into its row.

Before, each piece took its own launch and about fifteen small torch operations (allocations,
fills, reductions of the partials): on a GPU that per-piece cost, not the digest, is what a
model with thousands of captures a step would pay.

Two ways to map a tile onto indices, chosen per piece on the host:

- *aligned*: when the piece is one run of consecutive global indices (full tensors, Shard(0),
  batch splits; any memory stride), each tile row is one whole hash block, so ``T[j]`` is the
  table itself, a row's terms ``T[j] * V(x)`` are summed before one multiplication by ``P(b)``,
  ``W(b)`` is drawn once per row and a row's placement gathers touch one 32-entry table row;
  rows that stick out of the piece at either end are masked.
- *general*: any other piece (up to ``MAX_DIMS`` dims after merging): the tile is ``ROWS x 256``
  consecutive piece elements, each element's global index comes from its coordinates, and
  ``P(b)`` and the block words are drawn per element (``P``'s table bytes above the highest
  non-zero byte of the tile's largest block are skipped: their entries are 1).

The agent uses it for accelerator pieces once a self-check on that device, dtype and k agreed
with the eager reference (agents/kernels/accel.py, called from agents/fastpath.py). It is tested
against the eager reference (fingerprints, counts, min/max/abs-max bitwise; sums and
sketch within float64 rounding) under Triton's CPU interpreter only (``TRITON_INTERPRET=1``,
tests/agents/test_triton_digest.py): it has not been compiled, run or timed on a GPU. Triton is
optional: importing this module without it raises ImportError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from agents import hashing
from agents.digest import N_MOMENTS
from agents.kernels.cpu import index_map
from agents.layout import PieceLayout, complex_real_layout

MAX_DIMS = 4
"""Dims of a piece after merging those contiguous in both memory and the logical tensor."""

ROWS = 4
"""Tile rows per program; a tile is ``ROWS * 256`` elements."""

_LOAD_VIEW: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.uint32,
    torch.float64: torch.uint64,
    torch.bfloat16: torch.uint16,
    torch.float16: torch.uint16,
    torch.bool: torch.uint8,
    **{d: d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                      torch.uint16, torch.uint32, torch.uint64)},
}
"""The dtype each piece is loaded as. Widening the loaded value to int64 then gives ``bits``:
floats and bool are loaded as unsigned integers of their width, so their raw bits zero-extend;
integers keep their own signedness, so they enter by value (as in the eager path)."""

_FLOAT: dict[torch.dtype, tl.dtype] = {
    torch.float32: tl.float32, torch.float64: tl.float64,
    torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
}
"""Float dtypes, which get moments and a sketch: their loaded bits are bitcast back to these."""

# Compile-time constants for the kernels (Triton reads only constexpr globals).
_SK_SEED = tl.constexpr(hashing.SKETCH_SEED)
_GAMMA = tl.constexpr(hashing.GOLDEN_GAMMA)
_C1 = tl.constexpr(hashing.MIX_C1)
_C2 = tl.constexpr(hashing.MIX_C2)
_S1 = tl.constexpr(hashing.MIX_SHIFTS[0])
_S2 = tl.constexpr(hashing.MIX_SHIFTS[1])
_S3 = tl.constexpr(hashing.MIX_SHIFTS[2])
_LANE_BITS = tl.constexpr(hashing.LANE_BITS)
_LANES = tl.constexpr(hashing.LANES)
_GROUPS = tl.constexpr(hashing.GROUPS)
_PLACE_ROWS = tl.constexpr(hashing.PLACE_ROWS)
_POW_BYTES = tl.constexpr(hashing.POW_BYTES)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _mix64(z):
    """splitmix64's finalizer on uint64 (Triton's ``>>`` on unsigned is logical)."""
    z = z ^ (z >> _S1)
    z = z * _C1
    z = z ^ (z >> _S2)
    z = z * _C2
    return z ^ (z >> _S3)


@triton.jit
def _bent(u):
    """parity((u & 15) & (u >> 4)) for u in [0, 256)."""
    t = (u & 15) & (u >> 4)
    t = t ^ (t >> 2)
    t = t ^ (t >> 1)
    return t & 1


@triton.jit
def _bucket(lane, word, place_g_ptr, place_x_ptr, K: tl.constexpr):
    """The sketch bucket of int64 ``lane`` in the block of uint64 ``word`` (hashing.bucket_sign):
    placement row ``(word >> 40) mod 4096`` sends lane group ``lane >> 3`` to bucket group ``g``
    with its 8 lanes permuted by XOR ``x``; the bits of ``word`` above the lane bits pick which
    256 of k > 256 buckets. Every row and group is in range, so the gathers need no mask."""
    row = ((word >> 40) & (_PLACE_ROWS - 1)).to(tl.int64)
    slot = row * _GROUPS + (lane >> 3)
    g = tl.load(place_g_ptr + slot)
    x = tl.load(place_x_ptr + slot)
    high = ((word & (K - 1)) >> _LANE_BITS << _LANE_BITS).to(tl.int64)  # & (k - 1) & ~255
    return ((8 * g + ((lane & 7) ^ x)) ^ high) & (K - 1)


@triton.jit
def _block_power(pow_ptr, blk, top):
    """``P(b) = h**(256 b)`` as uint64 for int64 block indices ``blk`` (any shape, each in
    [0, 2**56)): the product of ``POW[t][(b >> 8 t) & 255]`` (``pow_ptr``: hashing.power_tensor,
    flattened). ``top`` (a scalar) is at least every ``b`` that counts: bytes above its highest
    non-zero one are skipped, as their entries are ``POW[t][0] == 1``. Every gather is in
    range, so they need no mask."""
    p = tl.load(pow_ptr + (blk & (_LANES - 1))).to(tl.uint64, bitcast=True)
    for t in tl.static_range(1, _POW_BYTES):
        if (top >> (8 * t)) != 0:
            byte = (blk >> (8 * t)) & (_LANES - 1)
            p = p * tl.load(pow_ptr + t * _LANES + byte).to(tl.uint64, bitcast=True)
    return p


@triton.jit
def _count(mask):
    return tl.sum(mask.to(tl.int64))


_NM = tl.constexpr(N_MOMENTS)
_W = tl.constexpr(19)
"""Columns of a piece's descriptor row (int64): its first tile in its group, its tiles, its
first element's offset in elements from the group's anchor tensor, numel, origin, lead, its row
in the output, then (size, stride, gstride) of its 4 merged dims as s0..s3, t0..t3, g0..g3."""


@triton.jit
def _tiles_kernel(
    x_ptr, desc_ptr, pieces, table_ptr, pow_ptr, place_g_ptr, place_x_ptr, part_i64_ptr,
    part_f64_ptr, f64_ptr,
    K: tl.constexpr, FLOAT: tl.constexpr, MIXED: tl.constexpr, ALIGNED: tl.constexpr,
    ROWS: tl.constexpr, SEARCH: tl.constexpr,
):
    """One tile (ROWS x 256 elements) of one piece of a group: a group's tiles are numbered
    piece after piece, so a program finds its piece by a binary search over the pieces' first
    tiles (SEARCH >= log2(pieces) steps). Writes the tile's partial fingerprint and counts
    (``part_i64[pid]``: fp, nan, +inf, -inf, zeros) and float64 sums and min/max
    (``part_f64[pid]``), and adds its elements into its piece's sketch, ``f64[row, 5:]``.
    MIXED: ``V(x) = mix64(bits)`` (float64, integers, bool), else the bits themselves.

    ALIGNED: the piece's elements have global indices ``origin * 256 + lead`` on, one after
    the other (any memory stride, ``t3``), and a tile row is one whole hash block. Otherwise
    element ``e``'s coordinates in the 4 merged dims give its memory offset and its global index
    from ``origin``. Pieces are addressed from ``x_ptr`` by their offset in elements (the
    anchor is one of the group's pieces), so one launch reads pieces of many tensors."""
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + pieces
    for _ in tl.static_range(SEARCH):
        mid = (lo + hi) // 2
        go = tl.load(desc_ptr + mid * _W) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    d = desc_ptr + lo * _W
    tile = pid - tl.load(d)
    n = tl.load(d + 3)
    origin = tl.load(d + 4)
    rows = tl.arange(0, ROWS).to(tl.int64)[:, None]
    cols = tl.arange(0, _LANES).to(tl.int64)[None, :]
    if ALIGNED:
        tile_row = tile * ROWS + rows  # [ROWS, 1]
        blk = origin + tile_row
        lane = cols  # [1, LANES]
        e = (tile_row << _LANE_BITS) + lane - tl.load(d + 5)
        live = (e >= 0) & (e < n)
        off = e * tl.load(d + 14)
    else:
        s1, s2, s3 = tl.load(d + 8), tl.load(d + 9), tl.load(d + 10)
        e = (tile * ROWS + rows) * _LANES + cols
        live = e < n
        c3 = e % s3
        r = e // s3
        c2 = r % s2
        r = r // s2
        c1 = r % s1
        c0 = r // s1
        off = (c0 * tl.load(d + 11) + c1 * tl.load(d + 12) + c2 * tl.load(d + 13)
               + c3 * tl.load(d + 14))
        g = (origin + c0 * tl.load(d + 15) + c1 * tl.load(d + 16) + c2 * tl.load(d + 17)
             + c3 * tl.load(d + 18))
        lane = g & (_LANES - 1)
        blk = g >> _LANE_BITS
    raw = tl.load(x_ptr + tl.load(d + 2) + off, mask=live, other=0)
    bits = raw.to(tl.int64).to(tl.uint64, bitcast=True)
    if MIXED:
        bits = _mix64(bits)
    blk_u = blk.to(tl.uint64, bitcast=True)
    lane_key = tl.load(table_ptr + lane).to(tl.uint64, bitcast=True)
    if ALIGNED:
        # One block per row: the row's sum of T[j] * V(x), then one multiplication by P(b).
        top = origin + tile * ROWS + (ROWS - 1)
        term = tl.where(live, lane_key * bits, 0).to(tl.int64, bitcast=True)
        row_sum = tl.sum(term, axis=1, keep_dims=True).to(tl.uint64, bitcast=True)  # [ROWS, 1]
        fp = tl.sum((row_sum * _block_power(pow_ptr, blk, top)).to(tl.int64, bitcast=True))
    else:
        top = tl.max(tl.where(live, blk, 0))
        key = lane_key * _block_power(pow_ptr, blk, top)
        fp = tl.sum(tl.where(live, key * bits, 0).to(tl.int64, bitcast=True))
    part_i64 = part_i64_ptr + pid * 5
    tl.store(part_i64, fp)  # int64 addition and multiplication wrap: the sum mod 2**64
    if FLOAT is None:
        tl.store(part_i64 + 4, _count(live & (raw == 0)))
    else:
        v = raw.to(FLOAT, bitcast=True).to(tl.float64)
        isnan = v != v
        posinf = v == _INF
        neginf = v == -_INF
        finite = live & ~isnan & ~posinf & ~neginf
        tl.store(part_i64 + 1, _count(live & isnan))
        tl.store(part_i64 + 2, _count(live & posinf))
        tl.store(part_i64 + 3, _count(live & neginf))
        tl.store(part_i64 + 4, _count(live & (v == 0.0)))
        f = tl.where(finite, v, 0.0)
        part_f64 = part_f64_ptr + pid * 4
        tl.store(part_f64, tl.sum(f))
        tl.store(part_f64 + 1, tl.sum(f * f))
        tl.store(part_f64 + 2, tl.min(tl.where(finite, v, _INF)))
        tl.store(part_f64 + 3, tl.max(tl.where(finite, v, -_INF)))
        word = _mix64(_SK_SEED + _GAMMA * blk_u)
        bucket = _bucket(lane, word, place_g_ptr, place_x_ptr, K)
        lane_u = lane.to(tl.uint64)
        minus = _bent((lane_u ^ (word >> 32)) & (_LANES - 1)) ^ (word >> 63)
        sketch = f64_ptr + tl.load(d + 6) * (_NM + K) + _NM
        tl.atomic_add(sketch + bucket, tl.where(minus != 0, -f, f), mask=live)


@triton.jit
def _finish_kernel(desc_ptr, part_i64_ptr, part_f64_ptr, f64_ptr, i64_ptr,
                   K: tl.constexpr, FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    """One piece's row from its tiles' partials: ``i64[row]`` = numel, nan, +inf, -inf, zeros,
    fingerprint; ``f64[row, :5]`` = sum, sum of squares, min, max, abs-max (0, 0, inf, -inf, 0
    for integers and for a piece without finite values)."""
    d = desc_ptr + tl.program_id(0).to(tl.int64) * _W
    start = tl.load(d)
    tiles = tl.load(d + 1)
    row = tl.load(d + 6)
    idx = tl.arange(0, BLOCK).to(tl.int64)
    fp = tl.zeros([BLOCK], tl.int64)
    zeros = tl.zeros([BLOCK], tl.int64)
    nan = tl.zeros([BLOCK], tl.int64)
    posinf = tl.zeros([BLOCK], tl.int64)
    neginf = tl.zeros([BLOCK], tl.int64)
    s = tl.zeros([BLOCK], tl.float64)
    ss = tl.zeros([BLOCK], tl.float64)
    lo = tl.full([BLOCK], _INF, tl.float64)
    hi = tl.full([BLOCK], -_INF, tl.float64)
    for i in range(0, tiles, BLOCK):
        live = i + idx < tiles
        at = start + i + idx
        fp += tl.load(part_i64_ptr + at * 5, mask=live, other=0)
        zeros += tl.load(part_i64_ptr + at * 5 + 4, mask=live, other=0)
        if FLOAT is not None:
            nan += tl.load(part_i64_ptr + at * 5 + 1, mask=live, other=0)
            posinf += tl.load(part_i64_ptr + at * 5 + 2, mask=live, other=0)
            neginf += tl.load(part_i64_ptr + at * 5 + 3, mask=live, other=0)
            s += tl.load(part_f64_ptr + at * 4, mask=live, other=0.0)
            ss += tl.load(part_f64_ptr + at * 4 + 1, mask=live, other=0.0)
            lo = tl.minimum(lo, tl.load(part_f64_ptr + at * 4 + 2, mask=live, other=_INF))
            hi = tl.maximum(hi, tl.load(part_f64_ptr + at * 4 + 3, mask=live, other=-_INF))
    out_i = i64_ptr + row * 6
    tl.store(out_i, tl.load(d + 3))
    tl.store(out_i + 1, tl.sum(nan))
    tl.store(out_i + 2, tl.sum(posinf))
    tl.store(out_i + 3, tl.sum(neginf))
    tl.store(out_i + 4, tl.sum(zeros))
    tl.store(out_i + 5, tl.sum(fp))  # int64 addition wraps: the fingerprint mod 2**64
    out_f = f64_ptr + row * (_NM + K)
    low = tl.min(lo)
    high = tl.max(hi)
    tl.store(out_f, tl.sum(s))
    tl.store(out_f + 1, tl.sum(ss))
    tl.store(out_f + 2, low)
    tl.store(out_f + 3, high)
    tl.store(out_f + 4, tl.where(low <= high, tl.maximum(tl.abs(low), tl.abs(high)), 0.0))


FINISH_BLOCK = 128
"""Tile partials a finishing program reads per step."""


def _merged(t: torch.Tensor, gs: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(size, stride, gstride) of ``t``'s dims, size-1 dims dropped and dims contiguous in both
    memory and the logical tensor merged (as the C++ kernel does), outermost first."""
    dims: list[list[int]] = []
    for s, st, g in zip(t.shape, t.stride(), gs):
        if s == 1:
            continue
        if dims and dims[-1][1] == s * st and dims[-1][2] == s * g:
            dims[-1] = [dims[-1][0] * s, st, g]
        else:
            dims.append([s, st, g])
    return [tuple(d) for d in dims]  # type: ignore[misc]


@dataclass(slots=True)
class Prepared:
    """A piece as the kernels read it, worked out on the host (:func:`prepare`)."""

    x: torch.Tensor
    """The piece viewed as its load dtype (``_LOAD_VIEW``)."""
    float_type: object
    """Its Triton float type (moments and sketch), or None."""
    mixed: bool
    """Whether its elements enter the fingerprint through mix64 (hashing.mixed_dtype of its
    dtype; a complex piece's is that of its real view)."""
    aligned: bool
    n: int
    origin: int
    lead: int
    tiles: int
    dims: tuple[int, ...]
    """s0..s3, t0..t3, g0..g3 (see ``_W``)."""


MAX_PLANS = 4096
"""Plans :func:`prepare` keeps (per layout, shape, strides and dtype) before starting afresh."""

_PLANS: dict[tuple, tuple] = {}
"""(id(layout), shape, strides, dtype) -> (layout, plan): what a piece's descriptor holds apart
from its address is the same for every capture of a site and shape, so it is worked out once
(the layout is kept so that its id is not reused while cached)."""


def prepare(t: torch.Tensor, layout: PieceLayout) -> Prepared:
    """Work out how the kernels read piece ``t`` of ``layout``. Raises ValueError for a dtype
    the kernels do not read (float8 types), more than ``MAX_DIMS`` dims after merging, or a bad
    layout."""
    t = t.detach()
    key = (id(layout), t.shape, t.stride(), t.dtype)
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not layout:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        hit = _PLANS[key] = (layout, _plan(t, layout))
    x = torch.view_as_real(t) if t.dtype.is_complex else t
    return Prepared(x.view(_LOAD_VIEW[x.dtype]), *hit[1])


def _plan(t: torch.Tensor, layout: PieceLayout) -> tuple:
    """Everything of :class:`Prepared` but the tensor, for pieces like ``t``."""
    if t.dtype.is_complex:
        if len(layout.shape) == t.dim():
            layout = complex_real_layout(layout)
        t = torch.view_as_real(t)
    if t.dtype not in _LOAD_VIEW:
        raise ValueError(f"dtype: {t.dtype} is not read by the Triton digest")
    base, gs = index_map(tuple(t.shape), layout)
    dims = _merged(t, gs)
    if len(dims) > MAX_DIMS:
        raise ValueError(f"shape: {len(dims)} dims after merging > {MAX_DIMS}")
    aligned = len(dims) <= 1 and all(g == 1 for _, _, g in dims)
    dims = [(1, 0, 0)] * (MAX_DIMS - len(dims)) + dims
    n = t.numel()
    if aligned:  # tiles of whole hash blocks, from the one holding index `base` on
        origin, lead = base >> hashing.LANE_BITS, base & (hashing.LANES - 1)
    else:
        origin, lead = base, 0
    tiles = triton.cdiv(triton.cdiv(lead + n, hashing.LANES), ROWS) if n else 0
    flat = tuple(d[0] for d in dims) + tuple(d[1] for d in dims) + tuple(d[2] for d in dims)
    return (_FLOAT.get(t.dtype), hashing.mixed_dtype(t.dtype), aligned, n, origin, lead, tiles,
            flat)


def _search_steps(pieces: int) -> int:
    """Binary search steps over ``pieces`` first tiles, rounded up to a multiple of 4 so that
    few kernel variants are compiled."""
    return -(-(pieces - 1).bit_length() // 4) * 4


def _upload(desc: np.ndarray, device: torch.device) -> torch.Tensor:
    """The descriptor table on ``device``, without a host synchronization: through pinned
    memory on CUDA (the caching host allocator keeps the buffer until the copy has run)."""
    host = torch.from_numpy(desc)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned.to(device, non_blocking=True)
    return host.to(device)


def digest_prepared(pieces: list[Prepared], *, sketch_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``pieces`` (all on one device): ``(f64 [m, 5 + k], i64 [m, 6])`` on that
    device, row j the digest of piece j, as agents.digest.digest_piece computes it.

    Pieces are grouped by load dtype, float type, ``V`` rule (mix64 or not) and index path (and
    by address alignment, for the offsets from the anchor): per group one launch digests every
    tile of every piece and one launch finishes every row, after one descriptor upload and one
    zeroed output for the whole list. No host synchronization."""
    if sketch_k < 1 or sketch_k & (sketch_k - 1):
        raise ValueError(f"sketch_k: {sketch_k} is not a power of two")
    m = len(pieces)
    if not m:
        raise ValueError("pieces: empty list")
    device = pieces[0].x.device
    if any(p.x.device != device for p in pieces):
        raise ValueError("pieces: on more than one device")
    groups: dict[tuple, list[int]] = {}
    for j, p in enumerate(pieces):
        x = p.x
        # The float type and V rule too: bfloat16, float16 and uint16 all load as uint16 (only
        # uint16 is mixed), bool and uint8 as uint8 (both mixed).
        groups.setdefault((x.dtype, p.float_type, p.mixed, p.aligned,
                           x.data_ptr() % x.element_size() if p.n else 0), []).append(j)
    desc: list[tuple[int, ...]] = []
    spans = []
    for members in groups.values():
        live = [j for j in members if pieces[j].n]
        anchor = pieces[live[0]].x if live else None
        at, size = (anchor.data_ptr(), anchor.element_size()) if live else (0, 1)
        first, tile = len(desc), 0
        for j in members:
            p = pieces[j]
            off = (p.x.data_ptr() - at) // size if p.n else 0
            desc.append((tile, p.tiles, off, p.n, p.origin, p.lead, j, *p.dims))
            tile += p.tiles
        spans.append((pieces[members[0]], first, len(members), tile, anchor))
    table_d = _upload(np.array(desc, dtype=np.int64), device)
    f64 = torch.zeros((m, N_MOMENTS + sketch_k), dtype=torch.float64, device=device)
    i64 = torch.empty((m, 6), dtype=torch.int64, device=device)
    table, _, _, _, place_g, place_x = hashing.tables(device)
    powers = hashing.power_tensor(device).reshape(-1)
    for p0, first, count, tiles, anchor in spans:
        d = table_d[first:first + count]
        part_i64 = torch.empty((max(tiles, 1), 5), dtype=torch.int64, device=device)
        part_f64 = torch.empty((max(tiles, 1), 4), dtype=torch.float64, device=device)
        if tiles:
            _tiles_kernel[(tiles,)](
                anchor, d, count, table, powers, place_g.reshape(-1), place_x.reshape(-1),
                part_i64, part_f64, f64,
                K=sketch_k, FLOAT=p0.float_type, MIXED=p0.mixed, ALIGNED=p0.aligned, ROWS=ROWS,
                SEARCH=_search_steps(count),
            )
        _finish_kernel[(count,)](d, part_i64, part_f64, f64, i64,
                                 K=sketch_k, FLOAT=p0.float_type, BLOCK=FINISH_BLOCK)
    return f64, i64


def digest_pieces_triton(
    pieces: list[tuple[torch.Tensor, PieceLayout]], *, sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`digest_prepared` of ``(tensor, layout)`` pieces; raises ValueError where
    :func:`prepare` does for any of them."""
    return digest_prepared([prepare(t, layout) for t, layout in pieces], sketch_k=sketch_k)


def digest_piece_triton(
    t: torch.Tensor, layout: PieceLayout, *, sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as agents.digest.digest_piece: ``(f64 [5 + k], i64 [6])`` on ``t``'s device
    (one piece through :func:`digest_pieces_triton`)."""
    f64, i64 = digest_pieces_triton([(t, layout)], sketch_k=sketch_k)
    return f64[0], i64[0]
