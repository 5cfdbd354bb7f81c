"""The digest's hash scheme (version 3): index keys for the fingerprint, buckets and signs for
the sketch, as functions of a global flat index ``i`` only (docs/digests.md). A contract of both
ends of the wire: the agent computes digests with it, the auditor moves fingerprints and
predicts scaled ones with it (auditor/compare/digests/algebra.py), so both import it from here.

Every implementation — the eager torch path (agents/digest/digest.py, with
agents/digest/hashing.py's torch tables), the fused CPU kernel (agents/kernels/digest_cpu.cpp) and
the Triton kernel — computes exactly these; the constants here are the source of truth and the
kernels' tests hold them to it. Pure Python and numpy: the daemon imports it at start-up, without
torch.

The index splits into a lane ``j = i mod 256`` and a block ``b = i div 256``.

- fingerprint (version 3): ``sum_i K(i) * V(x_i) mod 2**64`` with the geometric key
  ``K(i) = u * h**i`` (``u`` odd, ``h = 5 mod 8``, so every key is odd and ``h`` has the
  largest order there is mod 2**64, 2**62). It is computed as ``K(i) = T[j] * P(b)``: the lane
  table ``T[j] = u * h**j`` and the block power ``P(b) = h**(256 b)``, the product of up to 7
  byte-indexed table entries (``POW[t][byte t of b]``). So a kernel sums ``T[j] * V(x)`` over a
  block's elements and multiplies the block's sum by ``P(b)`` once. Why geometric: a piece's
  fingerprint made at global offset ``g`` becomes the one at ``g + d`` by one multiplication,
  ``F * h**d`` (:func:`shift`), so the auditor can place a piece after the fact once it knows
  where its rows belong (ragged pieces, regrouped microbatches; docs/digests.md).
- ``V(x)``: float16, bfloat16 and float32 enter by their raw bits (below 2**32); float64, every
  integer dtype and bool by ``mix64(bits)`` of their 64-bit bits (floats' pattern, integers'
  value sign-extended), a bijection. Without it a geometric key would be blind to changes whose
  bit difference is a multiple of a high power of two repeated over a power-of-two count of
  elements (``sum h**i`` over 2**t consecutive indices is a multiple of 2**t): doubling every
  element of a float64 tensor of 4096 elements adds 2**52 to each pattern and would cancel.
  Narrow floats' differences are below 2**32, so that needs 2**33 elements in one tensor.
- sketch word ``W(b) = mix64(SKETCH_SEED + GAMMA * b)`` (unchanged since version 2). Lanes
  come in groups of 8 (``q = j >> 3``, ``r = j & 7``); row ``(W >> 40) mod 4096`` of the
  placement table ``PLACE`` (4096 rows, each a random permutation of the 32 groups with a
  random 3-bit lane XOR per group) sends group q to bucket group ``g`` with lanes permuted by
  ``r XOR x``: ``bucket = ((8 g + (r XOR x)) XOR (W & (k - 1) & ~255)) mod k``. So 8
  consecutive lanes land in 8 consecutive buckets (one vector add in the kernels), while lanes
  that a regular pattern ties together (a column of a matrix: the same r in several groups)
  scatter independently.
- sign: negative when ``bent((j XOR (W >> 32)) & 255) XOR (W >> 63)`` is 1, with
  ``bent(u) = parity((u & 15) & (u >> 4))``. A bent function's autocorrelation is exactly zero,
  so two lanes of one block that share a bucket (k < 256) have uncorrelated signs over blocks and
  the sketch's distance estimate stays unbiased.

The sketch cannot be shifted the same way: a sketch whose buckets and signs move by a fixed rule
when the index moves makes elements a fixed distance apart collide with fixed signs, which
biases the distance estimate (docs/digests.md "Placing pieces after the fact").
"""

from __future__ import annotations

import functools

import numpy as np

FINGERPRINT_SEED = 0x6E61763366696E67  # b"nav3fing"
"""Seed of the fingerprint's keys; written to Digest.fingerprint_seed, it names the scheme.
Version 2 used 0x6E61763266696E67 (random keys ``T[j] XOR C(b)``, not shiftable), version 1
0x6E756D6175646974: fingerprints of different versions never compare as equal or different."""

FINGERPRINT_SEED_V2 = 0x6E61763266696E67
"""Version 2's fingerprint seed (same sketch): stores recorded with it are read and compared
among themselves; their fingerprints cannot be shifted."""

SKETCH_SEED = 0x6E6176327368656B  # b"nav2shek"
"""Seed of the sketch's block words; written to Digest.sketch_seed (64-bit)."""

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB
MIX_SHIFTS = (30, 27, 31)
"""splitmix64's finalizer: z ^= z>>30; z *= C1; z ^= z>>27; z *= C2; z ^= z>>31 (logical >>)."""

LANE_BITS = 8
LANES = 1 << LANE_BITS
POW_BYTES = 7
"""Bytes of a block index the power table covers: blocks below 2**56 (indices below 2**64)."""
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


def mix64_array(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array, in place (numpy's multiplies wrap)."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(MIX_SHIFTS[0])
        z *= np.uint64(MIX_C1)
        z ^= z >> np.uint64(MIX_SHIFTS[1])
        z *= np.uint64(MIX_C2)
        z ^= z >> np.uint64(MIX_SHIFTS[2])
    return z


def bent(u: int) -> int:
    """The 8-bit bent function of the sketch's signs: parity of (low nibble AND high nibble)."""
    t = (u & 15) & (u >> 4)
    t ^= t >> 2
    t ^= t >> 1
    return t & 1


def _h_and_u() -> tuple[int, int]:
    h = (mix64(FINGERPRINT_SEED) & ~7 | 5) & M64
    u = mix64(FINGERPRINT_SEED + GOLDEN_GAMMA) | 1
    return h, u


H_BASE, U_SCALE = _h_and_u()
"""``h`` (5 mod 8: multiplicative order 2**62) and ``u`` (odd) of the keys ``u * h**i``."""
H_BLOCK = pow(H_BASE, LANES, 1 << 64)
"""``h**256``: the key's factor from one block to the next."""


def lane_key(j: int) -> int:
    """``T[j] = u * h**j``: the fingerprint key's lane part (odd)."""
    return U_SCALE * pow(H_BASE, j, 1 << 64) & M64


def block_power(b: int) -> int:
    """``P(b) = h**(256 b)``: the fingerprint key's block part (odd)."""
    return pow(H_BLOCK, b, 1 << 64)


def power_table() -> list[list[int]]:
    """``POW[t][v] = h**(256 * v * 256**t)`` for t < 7, v < 256: ``P(b)`` is the product of
    ``POW[t][(b >> 8 t) & 255]`` over the bytes t of b (stop at the highest non-zero one)."""
    return [[pow(H_BLOCK, v << (8 * t), 1 << 64) for v in range(LANES)]
            for t in range(POW_BYTES)]


def shift(fp: int, delta: int) -> int:
    """The fingerprint of a piece moved by ``delta`` global indices (negative: towards 0):
    every key ``u h**i`` becomes ``u h**(i + delta)``, so the sum is multiplied by
    ``h**delta`` (h is odd, hence invertible mod 2**64)."""
    return fp * pow(H_BASE, delta, 1 << 64) & M64


def value_term(bits: int, mixed: bool) -> int:
    """``V(x)`` from the element's 64-bit bits: ``mix64(bits)`` for float64, integers and bool
    (``mixed``), the bits themselves for float16, bfloat16 and float32."""
    return mix64(bits) if mixed else bits & M64


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
        z = mix64_array(n * np.uint64(GOLDEN_GAMMA) + np.uint64(PLACE_SEED))
    z = z.reshape(PLACE_ROWS, per_row)
    perm = np.tile(np.arange(GROUPS, dtype=np.int64), (PLACE_ROWS, 1))
    rows = np.arange(PLACE_ROWS)
    for step, t in enumerate(range(GROUPS - 1, 0, -1)):
        u = (z[:, step] % np.uint64(t + 1)).astype(np.int64)
        perm[rows, t], perm[rows, u] = perm[rows, u], perm[rows, t].copy()
    x = (z[:, GROUPS - 1:] & np.uint64(7)).astype(np.int64)
    return (perm | x << 5).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def cached_place_table() -> np.ndarray:
    """:func:`place_table`, built once per process (it takes a few milliseconds)."""
    return place_table()


def key(i: int) -> int:
    """The fingerprint key of global index i: ``u * h**i``."""
    return U_SCALE * pow(H_BASE, i, 1 << 64) & M64


def bucket_sign(i: int, k: int) -> tuple[int, int]:
    """``(bucket, sign bit)`` of global index i in a sketch of k buckets (sign bit 1: minus)."""
    j, w = i & (LANES - 1), block_word(i >> LANE_BITS)
    e = int(cached_place_table()[(w >> 40) % PLACE_ROWS, j >> 3])
    bucket = ((8 * (e & 31) + ((j & 7) ^ (e >> 5))) ^ (w & (k - 1) & ~(LANES - 1))) & (k - 1)
    return bucket, bent((j ^ (w >> 32)) & (LANES - 1)) ^ (w >> 63)
