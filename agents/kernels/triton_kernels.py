"""The Triton digest's kernels: tiles (one pass over the data) and finish (partials into rows).

What they compute and how a piece is walked is in agents/kernels/triton_plan.py; the hash
scheme is agents/digest/hashing.py's (version 3). ``_tiles_kernel`` runs one program per tile of
one launch group (pieces of one dtype and index path): the program finds its piece (from its
arguments when the group is one piece, else by a binary search over the pieces' first tiles in
the descriptor table), reads the tile's rows once, in lane order as a copy would, keeps the
fingerprint, counts, sums and min/max in per-slot accumulators in registers, and adds each
row's signed values, permuted into the sketch's bucket order, into a per-program sketch; at
the tile's end it reduces them (in float64 past the slots) and writes one row of partials.
``_finish_kernel`` runs one program per (piece, slice of 256 buckets) and adds a piece's
partials tile after tile in a fixed order into its output row. Nothing is atomic: the same
tensor gives the same bits on every run.

Every runtime argument is unspecialized (neither on its value nor on a pointer's alignment),
so one compiled kernel per constexpr combination serves every launch and can be launched
through its handle (agents/kernels/triton_launch.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from numaudit.agents.digest import hashing
from numaudit.agents.kernels.triton_plan import F32_SAFE, W

_SK_SEED = tl.constexpr(hashing.SKETCH_SEED)
_GAMMA = tl.constexpr(hashing.GOLDEN_GAMMA)
_C1 = tl.constexpr(hashing.MIX_C1)
_C2 = tl.constexpr(hashing.MIX_C2)
_S1 = tl.constexpr(hashing.MIX_SHIFTS[0])
_S2 = tl.constexpr(hashing.MIX_SHIFTS[1])
_S3 = tl.constexpr(hashing.MIX_SHIFTS[2])
_LANES = tl.constexpr(hashing.LANES)
_GROUPS = tl.constexpr(hashing.GROUPS)
_PLACE_ROWS = tl.constexpr(hashing.PLACE_ROWS)
_POW_BYTES = tl.constexpr(hashing.POW_BYTES)
_W = tl.constexpr(W)
_INF = tl.constexpr(float("inf"))
_SAFE_LO = tl.constexpr(F32_SAFE[0])
_SAFE_HI = tl.constexpr(F32_SAFE[1])
_NAN_ONE = tl.constexpr(1)
_POS_ONE = tl.constexpr(1 << 21)
_NEG_ONE = tl.constexpr(1 << 42)
"""Non-finite elements of a tile counted in one int64 slot: NaN, +Inf and -Inf in fields of
21 bits (a tile has at most 2**16 elements)."""
_BENT = tl.constexpr(0x6996)
"""Parity of a 4-bit value t is bit t of 0x6996: bent(u) = parity((u & 15) & (u >> 4))."""

_PARAMS = ("x_ptr", "desc_ptr", "pieces", "inv_ptr", "table_ptr", "pow_ptr", "part_i64_ptr",
           "part_f64_ptr", "part_sk_ptr", "first_tile", "tiles", "x_off", "n", "out_row",
           "tile_rows", "rows", "bpl", "line_len", "line_stride", "origin", "top", "s1", "s2",
           "s3", "t0", "t1", "t2", "t3", "g0", "g1", "g2", "g3")
_POINTERS = ("x_ptr", "desc_ptr", "inv_ptr", "table_ptr", "pow_ptr", "part_i64_ptr",
             "part_f64_ptr", "part_sk_ptr", "out_f64_ptr", "out_i64_ptr")
_SCALARS = tuple(p for p in _PARAMS if p not in _POINTERS)


@triton.jit
def _mix64(z):
    """splitmix64's finalizer on uint64 (Triton's ``>>`` on unsigned is logical)."""
    z = z ^ (z >> _S1)
    z = z * _C1
    z = z ^ (z >> _S2)
    z = z * _C2
    return z ^ (z >> _S3)


@triton.jit
def _block_power(pow_ptr, blk, top):
    """``P(b) = h**(256 b)`` as uint64 for int64 block indices ``blk`` (any shape, each in
    [0, 2**56)): the product of ``POW[t][(b >> 8 t) & 255]``. ``top`` (a scalar) bounds every
    ``b``: bytes above its highest non-zero one are skipped (their entries are 1)."""
    p = tl.load(pow_ptr + (blk & (_LANES - 1))).to(tl.uint64, bitcast=True)
    for t in tl.static_range(1, _POW_BYTES):
        if (top >> (8 * t)) != 0:
            byte = (blk >> (8 * t)) & (_LANES - 1)
            p = p * tl.load(pow_ptr + t * _LANES + byte).to(tl.uint64, bitcast=True)
    return p


@triton.jit
def _tile_pass(x_ptr, x_off, inv_ptr, table_ptr, pow_ptr, row_start, row_end, bpl, line_len,
               line_stride, origin, top, s1, s2, s3, t0, t1, t2, t3, g0, g1, g2, g3,
               K: tl.constexpr, NW: tl.constexpr, FLOAT: tl.constexpr, ACC: tl.constexpr,
               MIXED: tl.constexpr, LINES: tl.constexpr, UNIT: tl.constexpr, VEC: tl.constexpr,
               R: tl.constexpr, FULL: tl.constexpr):
    """Rows ``[row_start, row_end)`` of one piece, R at a time, as [R, 256] lanes. Everything
    but the sketch is order-blind and is accumulated in lane order, from loads laid out as a
    copy's; the rows' signed values are then permuted into bucket order within the row
    (``tl.gather`` through the inverse placement) and added to the sketch's slots. Returns
    per-slot accumulators: fingerprint terms (uint64), zeros and packed non-finite counts,
    and, for floats, sums, squares, min, max (ACC) and the sketch, [R, 256] (k <= 256: slot
    = bucket position) or [NW, 256] (k > 256, R == 1: the row's window picks the slice).
    FULL=False skips the fingerprint and counts (the float64 pass over a tile float32 could
    not sum). VEC: every row's first lane is 16-byte aligned and its live lanes come in whole
    groups of 8, so the loads can be vectors."""
    rr = tl.arange(0, R).to(tl.int64)[:, None]
    lanes = tl.arange(0, _LANES)[None, :]
    groups = lanes // 8  # (a division, not a shift: the compiler sees it constant over 8 lanes)
    if FULL:
        lane_key = tl.load(table_ptr + lanes).to(tl.uint64, bitcast=True)  # [1, 256]
    fp = tl.zeros([R, _LANES], tl.uint64)
    zeros = tl.zeros([R, _LANES], tl.int32)
    bad = tl.zeros([R, _LANES], tl.int64)
    s = tl.zeros([R, _LANES], ACC)
    ss = tl.zeros([R, _LANES], ACC)
    lo = tl.full([R, _LANES], _INF, ACC)
    hi = tl.full([R, _LANES], -_INF, ACC)
    if K > _LANES:  # noqa: SIM108  (a constexpr branch: Triton compiles only the one taken)
        sk = tl.zeros([NW, _LANES], ACC)
    else:
        sk = tl.zeros([R, _LANES], ACC)
    for r0 in range(row_start, row_end, R):
        row = r0 + rr  # [R, 1]
        if LINES:
            line = row // bpl
            blk_in = row - line * bpl
            c3 = line % s3
            rest = line // s3
            c2 = rest % s2
            rest = rest // s2
            c1 = rest % s1
            c0 = rest // s1
            line_g = origin + c0 * g0 + c1 * g1 + c2 * g2 + c3 * g3
            line_m = c0 * t0 + c1 * t1 + c2 * t2 + c3 * t3
        else:
            blk_in = row
            line_g = origin + rr * 0
            line_m = rr * 0
        blk = (line_g >> 8) + blk_in
        base = blk * _LANES - line_g  # lane j is element base + j of the line
        lo_lane = tl.minimum(tl.maximum(-base, 0), _LANES).to(tl.int32)
        hi_lane = tl.maximum(tl.minimum(line_len - base, _LANES), 0).to(tl.int32)
        hi_lane = tl.where(row < row_end, hi_lane, 0)
        if VEC:  # one line; whole groups of 8 (a mask constant over each vector)
            live = (groups >= lo_lane // 8) & (groups < hi_lane // 8)
            start = tl.multiple_of(x_ptr + (x_off - (origin & (_LANES - 1))), 16)  # row 0
            raw = tl.load(start + blk_in * _LANES + lanes, mask=live, other=0)
        else:
            live = (lanes >= lo_lane) & (lanes < hi_lane)
            if UNIT:  # noqa: SIM108  (a constexpr branch, as above)
                off = line_m + base + lanes
            else:
                off = line_m + (base + lanes) * line_stride
            raw = tl.load(x_ptr + x_off + off, mask=live, other=0)
        word = _mix64(_SK_SEED + _GAMMA * blk.to(tl.uint64, bitcast=True))  # [R, 1]
        if FULL:
            bits = raw.to(tl.int64).to(tl.uint64, bitcast=True)
            if MIXED:
                bits = _mix64(bits)
            fp += tl.where(live, lane_key * _block_power(pow_ptr, blk, top) * bits, 0)
        if FLOAT is None:
            if FULL:
                zeros += (live & (raw == 0)).to(tl.int32)
        else:
            v = raw.to(FLOAT, bitcast=True).to(ACC)
            finite = tl.abs(v) < _INF
            fin = live & finite
            if FULL:
                zeros += (live & (v == 0.0)).to(tl.int32)
                kind = tl.where(v != v, _NAN_ONE, tl.where(v > 0.0, _POS_ONE, _NEG_ONE))
                bad += tl.where(live & ~finite, kind, 0)
            f = tl.where(fin, v, 0.0)
            s += f
            ss += f * f
            lo = tl.minimum(lo, tl.where(fin, v, _INF))
            hi = tl.maximum(hi, tl.where(fin, v, -_INF))
            u = lanes ^ ((word >> 32) & (_LANES - 1)).to(tl.int32)
            minus = (((u * 0 + _BENT) >> ((u & 15) & (u >> 4))) & 1) ^ (word >> 63).to(tl.int32)
            signed = tl.where(minus != 0, -f, f)
            # Bucket order: position c of a row takes lane 8 q + ((c & 7) ^ x_q), q the lane
            # group that the row's placement sends to bucket group c >> 3.
            place = ((word >> 40) & (_PLACE_ROWS - 1)).to(tl.int32)
            entry = tl.load(inv_ptr + place * _GROUPS + groups)  # [R, 256]
            ordered = tl.gather(signed, (entry & 31) * 8 + ((lanes & 7) ^ (entry >> 5)), axis=1)
            if K > _LANES:
                window = ((word & (K - 1)) >> 8).to(tl.int32)  # [1, 1]
                sk += tl.where(tl.arange(0, NW)[:, None] == window, ordered, 0.0)
            else:
                sk += ordered
    return fp, zeros, bad, s, ss, lo, hi, sk


@triton.jit
def _sketch_of(sk, K: tl.constexpr):
    """A tile's sketch [K] (float64) from its slots (one return: the compiler wants one type)."""
    if K > _LANES:
        out = tl.reshape(sk.to(tl.float64), [K])
    else:
        flat = tl.sum(sk.to(tl.float64), axis=0)
        out = tl.sum(tl.reshape(flat, [_LANES // K, K]), axis=0)
    return out


@triton.jit(do_not_specialize=_SCALARS, do_not_specialize_on_alignment=_POINTERS)
def _tiles_kernel(
    x_ptr, desc_ptr, pieces: tl.int64, inv_ptr, table_ptr, pow_ptr, part_i64_ptr, part_f64_ptr,
    part_sk_ptr, first_tile: tl.int64, tiles: tl.int64, x_off: tl.int64, n: tl.int64,
    out_row: tl.int64, tile_rows: tl.int64, rows: tl.int64, bpl: tl.int64, line_len: tl.int64,
    line_stride: tl.int64, origin: tl.int64, top: tl.int64, s1: tl.int64, s2: tl.int64,
    s3: tl.int64, t0: tl.int64, t1: tl.int64, t2: tl.int64, t3: tl.int64, g0: tl.int64,
    g1: tl.int64, g2: tl.int64, g3: tl.int64,
    K: tl.constexpr, NW: tl.constexpr, FLOAT: tl.constexpr, ACC: tl.constexpr,
    WIDE: tl.constexpr, MIXED: tl.constexpr, LINES: tl.constexpr, UNIT: tl.constexpr,
    VEC: tl.constexpr, SINGLE: tl.constexpr, R: tl.constexpr, SEARCH: tl.constexpr,
):
    """One tile of one piece of a launch group. SINGLE: the group is one piece whose
    descriptor is in the arguments (no table to upload); else ``desc_ptr`` holds a row per
    piece (triton_plan.FIELDS) and the program finds its piece by a binary search over their
    first tiles (SEARCH >= log2(pieces) steps). Writes ``part_i64[pid]`` = fingerprint, nan,
    +inf, -inf, zeros; ``part_f64[pid]`` = sum, sum of squares, min, max; ``part_sk[pid]``,
    the tile's sketch (floats only). ACC: the accumulators' type (float64 for float64 pieces,
    WIDE, else float32: then a tile outside F32_SAFE is summed again in float64)."""
    pid = tl.program_id(0).to(tl.int64)
    if not SINGLE:
        lo = pid * 0
        hi = lo + pieces
        for _ in tl.static_range(SEARCH):
            mid = (lo + hi) // 2
            go = tl.load(desc_ptr + mid * _W) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        d = desc_ptr + lo * _W
        first_tile = tl.load(d)
        x_off = tl.load(d + 2)
        tile_rows = tl.load(d + 5)
        rows = tl.load(d + 6)
        bpl = tl.load(d + 7)
        line_len = tl.load(d + 8)
        line_stride = tl.load(d + 9)
        origin = tl.load(d + 10)
        top = tl.load(d + 11)
        s1, s2, s3 = tl.load(d + 12), tl.load(d + 13), tl.load(d + 14)
        t0, t1, t2, t3 = tl.load(d + 15), tl.load(d + 16), tl.load(d + 17), tl.load(d + 18)
        g0, g1, g2, g3 = tl.load(d + 19), tl.load(d + 20), tl.load(d + 21), tl.load(d + 22)
    row_start = (pid - first_tile) * tile_rows
    row_end = tl.minimum(row_start + tile_rows, rows)
    fp, zeros, bad, s, ss, lo_v, hi_v, sk = _tile_pass(
        x_ptr, x_off, inv_ptr, table_ptr, pow_ptr, row_start, row_end, bpl, line_len,
        line_stride, origin, top, s1, s2, s3, t0, t1, t2, t3, g0, g1, g2, g3,
        K, NW, FLOAT, ACC, MIXED, LINES, UNIT, VEC, R, True)
    out_i = part_i64_ptr + pid * 5
    tl.store(out_i, tl.sum(fp.to(tl.int64, bitcast=True)))  # int64 sums wrap: mod 2**64
    tl.store(out_i + 4, tl.sum(zeros.to(tl.int64)))
    if FLOAT is not None:
        packed = tl.sum(bad)
        tl.store(out_i + 1, packed & ((1 << 21) - 1))
        tl.store(out_i + 2, (packed >> 21) & ((1 << 21) - 1))
        tl.store(out_i + 3, packed >> 42)
        low = tl.min(lo_v).to(tl.float64)
        high = tl.max(hi_v).to(tl.float64)
        total = tl.sum(s.to(tl.float64))
        squares = tl.sum(ss.to(tl.float64))
        sketch = _sketch_of(sk, K)
        if not WIDE:
            amax = tl.maximum(tl.abs(low), tl.abs(high))
            if (low <= high) & ((amax >= _SAFE_HI) | ((amax < _SAFE_LO) & (amax > 0.0))):
                fp64_, zeros64_, bad64_, s64, ss64, lo64_, hi64_, sk64 = _tile_pass(
                    x_ptr, x_off, inv_ptr, table_ptr, pow_ptr, row_start, row_end, bpl,
                    line_len, line_stride, origin, top, s1, s2, s3, t0, t1, t2, t3, g0, g1,
                    g2, g3, K, NW, FLOAT, tl.float64, MIXED, LINES, UNIT, VEC, R, False)
                total = tl.sum(s64)
                squares = tl.sum(ss64)
                sketch = _sketch_of(sk64, K)
        out_f = part_f64_ptr + pid * 4
        tl.store(out_f, total)
        tl.store(out_f + 1, squares)
        tl.store(out_f + 2, low)
        tl.store(out_f + 3, high)
        tl.store(part_sk_ptr + pid * K + tl.arange(0, K), sketch)


@triton.jit(do_not_specialize=_SCALARS, do_not_specialize_on_alignment=_POINTERS)
def _finish_kernel(desc_ptr, part_i64_ptr, part_f64_ptr, part_sk_ptr, out_f64_ptr, out_i64_ptr,
                   first_tile: tl.int64, tiles: tl.int64, n: tl.int64, out_row: tl.int64,
                   K: tl.constexpr, KC: tl.constexpr, FLOAT: tl.constexpr,
                   SINGLE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (piece, c): buckets ``[c KC, (c + 1) KC)`` of the piece's row, and for c = 0
    its scalars: ``out_i64[row]`` = numel, nan, +inf, -inf, zeros, fingerprint;
    ``out_f64[row, :5]`` = sum, sum of squares, min, max, abs-max (0, 0, inf, -inf, 0 for
    integers and for a piece without finite values). Tiles are added BLOCK at a time in order,
    each slot in float64, then the slots: the same order on every run."""
    if not SINGLE:
        d = desc_ptr + tl.program_id(0).to(tl.int64) * _W
        first_tile = tl.load(d)
        tiles = tl.load(d + 1)
        n = tl.load(d + 3)
        out_row = tl.load(d + 4)
    c = tl.program_id(1)
    idx = tl.arange(0, BLOCK).to(tl.int64)
    cols = c * KC + tl.arange(0, KC)
    out_f = out_f64_ptr + out_row * (5 + K)
    if FLOAT is None:
        tl.store(out_f + 5 + cols, tl.zeros([KC], tl.float64))
    else:
        acc = tl.zeros([BLOCK, KC], tl.float64)
        for i in range(0, tiles, BLOCK):
            at = first_tile + i + idx
            live = (i + idx) < tiles
            acc += tl.load(part_sk_ptr + at[:, None] * K + cols[None, :], mask=live[:, None],
                           other=0.0)
        tl.store(out_f + 5 + cols, tl.sum(acc, axis=0))
    if c == 0:
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
            at = first_tile + i + idx
            fp += tl.load(part_i64_ptr + at * 5, mask=live, other=0)
            zeros += tl.load(part_i64_ptr + at * 5 + 4, mask=live, other=0)
            if FLOAT is not None:
                nan += tl.load(part_i64_ptr + at * 5 + 1, mask=live, other=0)
                posinf += tl.load(part_i64_ptr + at * 5 + 2, mask=live, other=0)
                neginf += tl.load(part_i64_ptr + at * 5 + 3, mask=live, other=0)
                s += tl.load(part_f64_ptr + at * 4, mask=live, other=0.0)
                ss += tl.load(part_f64_ptr + at * 4 + 1, mask=live, other=0.0)
                lo = tl.minimum(lo, tl.load(part_f64_ptr + at * 4 + 2, mask=live, other=_INF))
                hi = tl.maximum(hi, tl.load(part_f64_ptr + at * 4 + 3, mask=live,
                                            other=-_INF))
        out_i = out_i64_ptr + out_row * 6
        tl.store(out_i, n)
        tl.store(out_i + 1, tl.sum(nan))
        tl.store(out_i + 2, tl.sum(posinf))
        tl.store(out_i + 3, tl.sum(neginf))
        tl.store(out_i + 4, tl.sum(zeros))
        tl.store(out_i + 5, tl.sum(fp))  # int64 addition wraps: the fingerprint mod 2**64
        low = tl.min(lo)
        high = tl.max(hi)
        tl.store(out_f, tl.sum(s))
        tl.store(out_f + 1, tl.sum(ss))
        tl.store(out_f + 2, low)
        tl.store(out_f + 3, high)
        tl.store(out_f + 4, tl.where(low <= high, tl.maximum(tl.abs(low), tl.abs(high)), 0.0))


TILES_CONSTEXPRS = ("K", "NW", "FLOAT", "ACC", "WIDE", "MIXED", "LINES", "UNIT", "VEC", "SINGLE",
                    "R", "SEARCH")
"""The tiles kernel's constexprs, in order (after its runtime arguments)."""
FINISH_CONSTEXPRS = ("K", "KC", "FLOAT", "SINGLE", "BLOCK")
tiles_kernel = _tiles_kernel
finish_kernel = _finish_kernel
TILES_INTS = tuple(n for n in _SCALARS if n in _PARAMS)
"""The tiles kernel's integer arguments (annotated int64)."""
FINISH_INTS = ("first_tile", "tiles", "n", "out_row")
"""The finish kernel's integer arguments (annotated int64)."""
