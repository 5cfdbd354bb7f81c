"""The digest's hash scheme (version 2): index keys for the fingerprint, buckets and signs for
the sketch, as functions of a global flat index ``i`` only (docs/digests.md).

Every implementation — the eager torch path (agents/digest.py), the fused CPU kernel
(agents/kernels/digest_cpu.cpp) and the Triton kernel — computes exactly these; the constants
here are the source of truth and the kernels' tests hold them to it.

The index splits into a lane ``j = i mod 256`` and a block ``b = i div 256``. One splitmix64
finalizer per *block* (not per element) draws the block's random words; per element, only table
lookups and XORs remain, which is what lets the kernels run at memory speed:

- fingerprint key ``K(i) = T[j] XOR C(b)``: ``T[j] = mix64(FP_SEED + GAMMA * (2**56 + j)) | 1``
  (256 odd words) and ``C(b) = mix64(FP_SEED + GAMMA * b) & ~1``, so every key is odd;
  the fingerprint is ``sum_i K(i) * bits(x_i) mod 2**64``. A multiply by an odd number is a
  bijection mod 2**64, so changing any one element always changes the fingerprint.
- sketch word ``W(b) = mix64(SKETCH_SEED + GAMMA * b)``. Lanes come in groups of 8
  (``q = j >> 3``, ``r = j & 7``); row ``(W >> 40) mod 4096`` of the placement table ``PLACE``
  (4096 rows, each a random permutation of the 32 groups with a random 3-bit lane XOR per group)
  sends group q to bucket group ``g`` with lanes permuted by ``r XOR x``:
  ``bucket = ((8 g + (r XOR x)) XOR (W & (k - 1) & ~255)) mod k``. So 8 consecutive lanes land in
  8 consecutive buckets (one vector add in the kernels), while lanes that a regular pattern ties
  together (a column of a matrix: the same r in several groups) scatter independently.
- sign: negative when ``bent((j XOR (W >> 32)) & 255) XOR (W >> 63)`` is 1, with
  ``bent(u) = parity((u & 15) & (u >> 4))``. A bent function's autocorrelation is exactly zero,
  so two lanes of one block that share a bucket (k < 256) have uncorrelated signs over blocks and
  the sketch's distance estimate stays unbiased.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

FINGERPRINT_SEED = 0x6E61763266696E67  # b"nav2fing"
"""Seed of the fingerprint's keys; written to Digest.fingerprint_seed. Version 1 used
0x6E756D6175646974: digests of the two versions never compare as equal or different."""

SKETCH_SEED = 0x6E6176327368656B  # b"nav2shek"
"""Seed of the sketch's block words; written to Digest.sketch_seed (64-bit)."""

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB
MIX_SHIFTS = (30, 27, 31)
"""splitmix64's finalizer: z ^= z>>30; z *= C1; z ^= z>>27; z *= C2; z ^= z>>31 (logical >>)."""

LANE_BITS = 8
LANES = 1 << LANE_BITS
TABLE_OFFSET = 1 << 56
"""Keys of the lane table are drawn at Weyl positions no block index reaches."""
GROUPS = LANES // 8
PLACE_ROWS = 4096
PLACE_SEED = SKETCH_SEED ^ 0x706C616365000000  # b"place"

M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64)."""
    z &= M64
    z ^= z >> 30
    z = (z * MIX_C1) & M64
    z ^= z >> 27
    z = (z * MIX_C2) & M64
    return z ^ (z >> 31)


def bent(u: int) -> int:
    """The 8-bit bent function of the sketch's signs: parity of (low nibble AND high nibble)."""
    t = (u & 15) & (u >> 4)
    t ^= t >> 2
    t ^= t >> 1
    return t & 1


def lane_key(j: int) -> int:
    """``T[j]``: the fingerprint key's lane part (odd)."""
    return mix64(FINGERPRINT_SEED + GOLDEN_GAMMA * (TABLE_OFFSET + j)) | 1


def block_key(b: int) -> int:
    """``C(b)``: the fingerprint key's block part (even)."""
    return mix64(FINGERPRINT_SEED + GOLDEN_GAMMA * b) & (M64 - 1)


def block_word(b: int) -> int:
    """``W(b)``: the sketch's random word of block b."""
    return mix64(SKETCH_SEED + GOLDEN_GAMMA * b)


def place_table() -> np.ndarray:
    """``PLACE[row, q] = g | x << 5`` as uint8 [4096, 32]: per row a Fisher-Yates permutation
    ``g`` of the 32 groups (draws ``z = mix64(PLACE_SEED + GAMMA * n)``, n counting from 1 over
    the whole table; swap t with ``z % (t + 1)`` for t = 31 .. 1), then 32 lane XORs
    ``x = z & 7``; 63 draws per row, rows in order."""
    per_row = 2 * GROUPS - 1
    n = np.arange(1, PLACE_ROWS * per_row + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = n * np.uint64(GOLDEN_GAMMA) + np.uint64(PLACE_SEED)
        z ^= z >> np.uint64(30)
        z *= np.uint64(MIX_C1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(MIX_C2)
        z ^= z >> np.uint64(31)
    z = z.reshape(PLACE_ROWS, per_row)
    perm = np.tile(np.arange(GROUPS, dtype=np.int64), (PLACE_ROWS, 1))
    rows = np.arange(PLACE_ROWS)
    for step, t in enumerate(range(GROUPS - 1, 0, -1)):
        u = (z[:, step] % np.uint64(t + 1)).astype(np.int64)
        perm[rows, t], perm[rows, u] = perm[rows, u], perm[rows, t].copy()
    x = (z[:, GROUPS - 1:] & np.uint64(7)).astype(np.int64)
    return (perm | x << 5).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def _place() -> np.ndarray:
    return place_table()


def key(i: int) -> int:
    """The fingerprint key of global index i."""
    return lane_key(i & (LANES - 1)) ^ block_key(i >> LANE_BITS)


def bucket_sign(i: int, k: int) -> tuple[int, int]:
    """``(bucket, sign bit)`` of global index i in a sketch of k buckets (sign bit 1: minus)."""
    j, w = i & (LANES - 1), block_word(i >> LANE_BITS)
    e = int(_place()[(w >> 40) % PLACE_ROWS, j >> 3])
    bucket = ((8 * (e & 31) + ((j & 7) ^ (e >> 5))) ^ (w & (k - 1) & ~(LANES - 1))) & (k - 1)
    return bucket, bent((j ^ (w >> 32)) & (LANES - 1)) ^ (w >> 63)


# --------------------------------------------------------------------------- torch


def signed64(u: int) -> int:
    """An unsigned 64-bit constant as the int64 torch needs (same bits)."""
    u &= M64
    return u - (1 << 64) if u >> 63 else u


_C1, _C2, _GAMMA = signed64(MIX_C1), signed64(MIX_C2), signed64(GOLDEN_GAMMA)


def mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place on int64 ``z`` (int64 multiplies wrap); torch's ``>>``
    is arithmetic, so each logical shift is a shift and a mask."""
    for shift, mult in zip(MIX_SHIFTS, (_C1, _C2, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)
    return z


def block_words(blocks: torch.Tensor, seed: int) -> torch.Tensor:
    """``mix64(seed + GAMMA * b)`` for an int64 tensor of block indices (a new tensor)."""
    z = blocks.mul(_GAMMA).add_(signed64(seed))
    return mix64_(z, torch.empty_like(z))


@functools.lru_cache(maxsize=16)
def tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(T, BENT, LANE, BENT_SHIFTED, PLACE_G, PLACE_X)`` on ``device``, int64: the 256 lane
    keys, bent(u) for u in [0, 256), 0..255, the [256, 256] table ``bent(j ^ s)`` (row s,
    column j), and the placement table split into its group and lane-XOR parts, [4096, 32]."""
    lane = torch.arange(LANES, dtype=torch.int64)
    t = torch.tensor([signed64(lane_key(j)) for j in range(LANES)], dtype=torch.int64)
    b = torch.tensor([bent(u) for u in range(LANES)], dtype=torch.int64)
    shifted = b[lane.unsqueeze(1) ^ lane.unsqueeze(0)]
    place = torch.from_numpy(_place().astype(np.int64))
    return tuple(x.to(device) for x in (t, b, lane, shifted, place & 31, place >> 5))
