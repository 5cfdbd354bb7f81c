"""The digest as one Triton kernel per piece, for accelerator tensors (CUDA, ROCm).

Computes what agents/digest.py computes, on hash scheme version 2 (agents/hashing.py, whose
constants and lane table it uses): fingerprint ``sum_i (T[j] ^ C(b)) * bits(x_i) mod 2**64``,
counts, float64 sum and sum of squares, min/max/abs-max over finite elements, and the
CountSketch, where ``j = i mod 256`` and ``b = i div 256`` split the global flat index ``i``:
bucket ``((8 g + ((j & 7) ^ x)) ^ (W(b) & (k - 1) & ~255)) mod k`` with ``g`` and ``x`` read
from the placement table (``hashing.tables``' PLACE_G and PLACE_X, passed flattened) at row
``(W(b) >> 40) mod 4096``, column ``j >> 3``; sign from ``bent`` of the lane and ``W(b)``.

One pass per piece: each program reads a tile of ``ROWS x 256`` elements once, writes its
fingerprint sum, counts, float64 sums and min/max as one row of partials, and adds its elements
into the sketch with ``tl.atomic_add`` (Triton has no block-local scatter into shared memory; k
buckets are few, so the atomics hit L2). A few torch reductions over the partials finish the
rows on the device: no host synchronization per capture.

Two ways to map a tile onto indices, chosen per piece on the host:

- *aligned*: when the piece is one run of consecutive global indices (full tensors, Shard(0),
  batch splits; any memory stride), each tile row is one whole hash block, so ``C(b)`` and
  ``W(b)`` are drawn once per row, ``T[j]`` is the table itself and a row's placement gathers
  touch one 32-entry table row; rows that stick out of the piece at either end are masked.
- *general*: any other piece (up to ``MAX_DIMS`` dims after merging): the tile is ``ROWS x 256``
  consecutive piece elements, each element's global index comes from its coordinates, and the
  block words are drawn per element.

The agent uses it for accelerator pieces once a self-check on that device, dtype and k agreed
with the eager reference (agents/kernels/accel.py, called from agents/fastpath.py). It is tested
against the eager reference (fingerprints, counts, min/max/abs-max bitwise; sums and
sketch within float64 rounding) under Triton's CPU interpreter only (``TRITON_INTERPRET=1``,
tests/agents/test_triton_digest.py): it has not been compiled, run or timed on a GPU. Triton is
optional: importing this module without it raises ImportError.
"""

from __future__ import annotations

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
_FP_SEED = tl.constexpr(hashing.FINGERPRINT_SEED)
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
_EVEN = tl.constexpr(hashing.M64 - 1)
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
def _count(mask):
    return tl.sum(mask.to(tl.int64))


@triton.jit
def _digest_kernel(
    x_ptr, n, origin, lead,
    s0, s1, s2, s3, t0, t1, t2, t3, g0, g1, g2, g3,
    table_ptr, place_g_ptr, place_x_ptr, part_i64_ptr, part_f64_ptr, sketch_ptr,
    K: tl.constexpr, FLOAT: tl.constexpr, ALIGNED: tl.constexpr, ROWS: tl.constexpr,
):
    """One tile of a piece of ``n`` elements: (size, stride, gstride) of 4 merged dims in
    ``s*, t*, g*``. ALIGNED: the piece's elements have global indices ``origin * 256 + lead``
    on, one after the other. Otherwise ``origin`` is element 0's global index. (The host splits
    the index, rather than the kernel shifting an argument: the interpreter stores an int
    argument in [2**31, 2**32) as uint32 and shifts it wrongly.) ``place_*_ptr``: the
    placement table's group and lane-XOR parts, int64 [4096 * 32], row-major."""
    pid = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, ROWS).to(tl.int64)[:, None]
    cols = tl.arange(0, _LANES).to(tl.int64)[None, :]
    if ALIGNED:
        # Row r of the tile is the whole hash block `blk`; the rows outside the piece are masked.
        tile_row = pid * ROWS + rows  # [ROWS, 1]
        blk = origin + tile_row
        lane = cols  # [1, LANES]
        e = (tile_row << _LANE_BITS) + lane - lead
        live = (e >= 0) & (e < n)
        off = e * t3
    else:
        # Consecutive piece elements; coordinates in the 4 merged dims, innermost last.
        e = (pid * ROWS + rows) * _LANES + cols
        live = e < n
        c3 = e % s3
        r = e // s3
        c2 = r % s2
        r = r // s2
        c1 = r % s1
        c0 = r // s1
        off = c0 * t0 + c1 * t1 + c2 * t2 + c3 * t3
        g = origin + c0 * g0 + c1 * g1 + c2 * g2 + c3 * g3
        lane = g & (_LANES - 1)
        blk = g >> _LANE_BITS
    raw = tl.load(x_ptr + off, mask=live, other=0)
    bits = raw.to(tl.int64).to(tl.uint64, bitcast=True)
    blk_u = blk.to(tl.uint64, bitcast=True)
    key = tl.load(table_ptr + lane).to(tl.uint64, bitcast=True) ^ (
        _mix64(_FP_SEED + _GAMMA * blk_u) & _EVEN)
    term = tl.where(live, key * bits, 0).to(tl.int64, bitcast=True)
    part_i64 = part_i64_ptr + pid * 5
    tl.store(part_i64, tl.sum(term))  # int64 addition wraps: the sum mod 2**64
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
        tl.atomic_add(sketch_ptr + bucket, tl.where(minus != 0, -f, f), mask=live)


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


def digest_piece_triton(
    t: torch.Tensor, layout: PieceLayout, *, sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as agents.digest.digest_piece: ``(f64 [5 + k], i64 [6])`` on ``t``'s device.

    Raises ValueError for a dtype the kernel does not read (float8 types), more than
    ``MAX_DIMS`` dims after merging, or a bad layout.
    """
    if sketch_k < 1 or sketch_k & (sketch_k - 1):
        raise ValueError(f"sketch_k: {sketch_k} is not a power of two")
    t = t.detach()
    if t.is_complex():
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
    device = t.device
    f64 = torch.zeros(N_MOMENTS + sketch_k, dtype=torch.float64, device=device)
    i64 = torch.zeros(6, dtype=torch.int64, device=device)
    i64[0] = n
    f64[2], f64[3] = float("inf"), float("-inf")
    if n == 0:
        return f64, i64
    if aligned:  # tiles of whole hash blocks, from the one holding index `base` on
        origin, lead = base >> hashing.LANE_BITS, base & (hashing.LANES - 1)
    else:
        origin, lead = base, 0
    blocks = triton.cdiv(lead + n, hashing.LANES)
    programs = triton.cdiv(blocks, ROWS)
    part_i64 = torch.zeros((programs, 5), dtype=torch.int64, device=device)
    part_f64 = torch.zeros((programs, 4), dtype=torch.float64, device=device)
    float_type = _FLOAT.get(t.dtype)
    (s0, t0, g0), (s1, t1, g1), (s2, t2, g2), (s3, t3, g3) = dims
    table, _, _, _, place_g, place_x = hashing.tables(device)
    _digest_kernel[(programs,)](
        t.view(_LOAD_VIEW[t.dtype]), n, origin, lead,
        s0, s1, s2, s3, t0, t1, t2, t3, g0, g1, g2, g3,
        table, place_g.reshape(-1), place_x.reshape(-1), part_i64, part_f64, f64[N_MOMENTS:],
        K=sketch_k, FLOAT=float_type, ALIGNED=aligned, ROWS=ROWS,
    )
    i64[5] = part_i64[:, 0].sum()  # int64 addition wraps: the fingerprint mod 2**64
    i64[1:5] = part_i64[:, 1:5].sum(dim=0)
    if float_type is not None:
        f64[0:2] = part_f64[:, 0:2].sum(dim=0)
        lo, hi = part_f64[:, 2].amin(), part_f64[:, 3].amax()
        f64[2], f64[3] = lo, hi
        f64[4] = torch.where(lo <= hi, torch.maximum(lo.abs(), hi.abs()), 0.0)
    return f64, i64
