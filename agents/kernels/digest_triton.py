"""The digest as one Triton kernel per piece, for accelerator tensors (CUDA, ROCm).

Computes what agents/digest.py computes (the same hash scheme, seeds and rows; the constants are
imported from there) in one pass: each program reads ``BLOCK`` elements once and produces the
block's fingerprint sum, counts, float64 sums and min/max as partials, and adds its elements
into the sketch with ``tl.atomic_add`` (Triton has no block-local scatter into shared memory:
the 2k buckets are few, so the atomics hit L2). A few torch reductions over the per-block
partials finish the rows on the device: no host synchronization per capture.

Not yet wired into the agent (agents/fastpath.py sends accelerator pieces to the eager path):
it is tested for bitwise equality with the eager reference under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, tests/agents/test_triton_digest.py) but has not been run or timed
on a GPU. Triton is optional: importing this module without it raises ImportError.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agents.digest import (FINGERPRINT_SEED, FMIX32_C1, FMIX32_C2, G32_HI, G32_LO, GOLDEN_GAMMA,
                           MIX_C1, MIX_C2, N_MOMENTS, SKETCH_SEED)
from agents.kernels.cpu import index_map
from agents.layout import PieceLayout, complex_real_layout

MAX_DIMS = 4
"""Dims of a piece after merging those contiguous in both memory and the logical tensor."""

BLOCK = 1024

# Per-dtype: (integer view with the same width, zero-extend the raw bits (floats, unsigned,
# bool) rather than sign-extend (signed integers), has moments).
_VIEWS: dict[torch.dtype, tuple[torch.dtype, bool, bool]] = {
    torch.float32: (torch.int32, True, True),
    torch.float64: (torch.int64, True, True),
    torch.bfloat16: (torch.int16, True, True),
    torch.float16: (torch.int16, True, True),
    torch.int8: (torch.int8, False, False),
    torch.int16: (torch.int16, False, False),
    torch.int32: (torch.int32, False, False),
    torch.int64: (torch.int64, False, False),
    torch.uint8: (torch.uint8, True, False),
    torch.bool: (torch.uint8, True, False),
}
_FLOAT_KIND = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}

# Compile-time constants for the kernels (Triton reads only constexpr globals).
_FP_SEED = tl.constexpr(FINGERPRINT_SEED)
_GAMMA = tl.constexpr(GOLDEN_GAMMA)
_C1 = tl.constexpr(MIX_C1)
_C2 = tl.constexpr(MIX_C2)
_SK_SEED = tl.constexpr(SKETCH_SEED)
_G_LO = tl.constexpr(G32_LO)
_G_HI = tl.constexpr(G32_HI)
_F1 = tl.constexpr(FMIX32_C1)
_F2 = tl.constexpr(FMIX32_C2)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _mix64(z):
    z = z ^ (z >> 30)
    z = z * _C1
    z = z ^ (z >> 27)
    z = z * _C2
    return z ^ (z >> 31)


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * _F1
    h = h ^ (h >> 13)
    h = h * _F2
    return h ^ (h >> 16)


@triton.jit
def _digest_kernel(
    x_ptr, n, base,
    s0, s1, s2, s3, t0, t1, t2, t3, g0, g1, g2, g3,
    part_i64_ptr, part_f64_ptr, sketch_ptr,
    K: tl.constexpr, ZERO_EXTEND: tl.constexpr, FLOAT_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = e < n
    # Coordinates in the (up to) 4 merged dims, innermost last.
    c3 = e % s3
    r = e // s3
    c2 = r % s2
    r = r // s2
    c1 = r % s1
    c0 = r // s1
    off = c0 * t0 + c1 * t1 + c2 * t2 + c3 * t3
    g = base + c0 * g0 + c1 * g1 + c2 * g2 + c3 * g3
    raw = tl.load(x_ptr + off, mask=live, other=0)
    if ZERO_EXTEND:
        if raw.dtype.primitive_bitwidth == 8:
            bits = raw.to(tl.uint8, bitcast=True).to(tl.uint64)
        elif raw.dtype.primitive_bitwidth == 16:
            bits = raw.to(tl.uint16, bitcast=True).to(tl.uint64)
        elif raw.dtype.primitive_bitwidth == 32:
            bits = raw.to(tl.uint32, bitcast=True).to(tl.uint64)
        else:
            bits = raw.to(tl.uint64, bitcast=True)
    else:
        bits = raw.to(tl.int64).to(tl.uint64, bitcast=True)
    gu = g.to(tl.uint64, bitcast=True)
    key = _FP_SEED + _GAMMA * gu
    term = tl.where(live, _mix64(key ^ bits), 0)
    fp = tl.sum(term.to(tl.int64, bitcast=True), axis=0)  # wraps: the sum mod 2**64
    row = pid.to(tl.int64)
    if FLOAT_KIND == 0:
        zeros = tl.sum(tl.where(live & (raw == 0), 1, 0).to(tl.int64), axis=0)
        tl.store(part_i64_ptr + row * 5 + 0, fp)
        tl.store(part_i64_ptr + row * 5 + 4, zeros)
    else:
        if FLOAT_KIND == 1:
            v = raw.to(tl.float32, bitcast=True).to(tl.float64)
        elif FLOAT_KIND == 2:
            v = raw.to(tl.float64, bitcast=True)
        elif FLOAT_KIND == 3:
            v = raw.to(tl.bfloat16, bitcast=True).to(tl.float64)
        else:
            v = raw.to(tl.float16, bitcast=True).to(tl.float64)
        isnan = v != v
        posinf = v == _INF
        neginf = v == -_INF
        finite = live & ~isnan & ~posinf & ~neginf
        f = tl.where(finite, v, 0.0)
        tl.store(part_i64_ptr + row * 5 + 0, fp)
        tl.store(part_i64_ptr + row * 5 + 1, tl.sum(tl.where(live & isnan, 1, 0).to(tl.int64), axis=0))
        tl.store(part_i64_ptr + row * 5 + 2, tl.sum(tl.where(live & posinf, 1, 0).to(tl.int64), axis=0))
        tl.store(part_i64_ptr + row * 5 + 3, tl.sum(tl.where(live & neginf, 1, 0).to(tl.int64), axis=0))
        tl.store(part_i64_ptr + row * 5 + 4, tl.sum(tl.where(live & (v == 0.0), 1, 0).to(tl.int64), axis=0))
        tl.store(part_f64_ptr + row * 4 + 0, tl.sum(f, axis=0))
        tl.store(part_f64_ptr + row * 4 + 1, tl.sum(f * f, axis=0))
        tl.store(part_f64_ptr + row * 4 + 2, tl.min(tl.where(finite, v, _INF), axis=0))
        tl.store(part_f64_ptr + row * 4 + 3, tl.max(tl.where(finite, v, -_INF), axis=0))
        lo32 = (gu & 0xFFFFFFFF).to(tl.uint32)
        hi32 = (gu >> 32).to(tl.uint32)
        h = _fmix32(_SK_SEED + _G_LO * lo32 + _G_HI * hi32)
        b = (h & (2 * K - 1)).to(tl.int32)
        signed = tl.where(b >= K, -f, f)
        tl.atomic_add(sketch_ptr + (b % K), signed, mask=live)


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
    if t.dtype not in _VIEWS:
        raise ValueError(f"dtype: {t.dtype} is not read by the Triton digest")
    view_dtype, zero_extend, moments = _VIEWS[t.dtype]
    base, gs = index_map(tuple(t.shape), layout)
    dims = _merged(t, gs)
    if len(dims) > MAX_DIMS:
        raise ValueError(f"shape: {len(dims)} dims after merging > {MAX_DIMS}")
    dims = [(1, 0, 0)] * (MAX_DIMS - len(dims)) + dims
    n = t.numel()
    device = t.device
    f64 = torch.zeros(N_MOMENTS + sketch_k, dtype=torch.float64, device=device)
    i64 = torch.zeros(6, dtype=torch.int64, device=device)
    i64[0] = n
    f64[2], f64[3] = float("inf"), float("-inf")
    if n == 0:
        return f64, i64
    blocks = triton.cdiv(n, BLOCK)
    part_i64 = torch.zeros((blocks, 5), dtype=torch.int64, device=device)
    part_f64 = torch.zeros((blocks, 4), dtype=torch.float64, device=device)
    bits = t.view(view_dtype)
    (s0, t0, g0), (s1, t1, g1), (s2, t2, g2), (s3, t3, g3) = dims
    _digest_kernel[(blocks,)](
        bits, n, base, s0, s1, s2, s3, t0, t1, t2, t3, g0, g1, g2, g3,
        part_i64, part_f64, f64[N_MOMENTS:],
        K=sketch_k, ZERO_EXTEND=zero_extend, FLOAT_KIND=_FLOAT_KIND.get(t.dtype, 0) if moments else 0,
        BLOCK=BLOCK,
    )
    i64[5] = part_i64[:, 0].sum()  # int64 addition wraps: the fingerprint mod 2**64
    i64[1:5] = part_i64[:, 1:5].sum(dim=0)
    if moments:
        f64[0:2] = part_f64[:, 0:2].sum(dim=0)
        lo, hi = part_f64[:, 2].amin(), part_f64[:, 3].amax()
        f64[2], f64[3] = lo, hi
        f64[4] = torch.where(lo <= hi, torch.maximum(lo.abs(), hi.abs()), 0.0)
    return f64, i64
