"""The hash scheme's torch side: its tables as tensors on a device and its mixing on int64
tensors, for the eager digest (agents/digest/digest.py) and the kernels' launchers.

The scheme itself (constants, keys, buckets and signs, as pure functions of a global index) is
`numaudit.wire.hashing`, shared with the auditor; its names are re-exported here, so the agent's
code reads the whole scheme from one module.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from numaudit.wire.hashing import (  # noqa: F401  (re-exported: the agent's view of the scheme)
    FINGERPRINT_SEED,
    FINGERPRINT_SEED_V2,
    GOLDEN_GAMMA,
    GROUPS,
    H_BASE,
    H_BLOCK,
    LANE_BITS,
    LANES,
    M64,
    MIX_C1,
    MIX_C2,
    MIX_SHIFTS,
    PLACE_ROWS,
    PLACE_SEED,
    POW_BYTES,
    SKETCH_SEED,
    U_SCALE,
    bent,
    block_power,
    block_word,
    bucket_sign,
    cached_place_table,
    key,
    lane_key,
    mix64,
    place_table,
    power_table,
    shift,
    value_term,
)


def mixed_dtype(dtype) -> bool:
    """Whether a torch dtype's elements enter through mix64 (all but 16/32-bit floats)."""
    return not (dtype.is_floating_point and dtype.itemsize <= 4)




def signed64(u: int) -> int:
    """An unsigned 64-bit constant as the int64 torch needs (same bits)."""
    u &= M64
    return u - (1 << 64) if u >> 63 else u


_C1, _C2, _GAMMA = signed64(MIX_C1), signed64(MIX_C2), signed64(GOLDEN_GAMMA)


def mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer in place on int64 ``z`` (int64 multiplies wrap); torch's ``>>``
    is arithmetic, so each logical shift is a shift and a mask."""
    for bits, mult in zip(MIX_SHIFTS, (_C1, _C2, None)):
        torch.bitwise_right_shift(z, bits, out=tmp)
        tmp.bitwise_and_((1 << (64 - bits)) - 1)
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
    keys ``u h**j``, bent(u) for u in [0, 256), 0..255, the [256, 256] table ``bent(j ^ s)`` (row s,
    column j), and the placement table split into its group and lane-XOR parts, [4096, 32]."""
    lane = torch.arange(LANES, dtype=torch.int64)
    t = torch.tensor([signed64(lane_key(j)) for j in range(LANES)], dtype=torch.int64)
    b = torch.tensor([bent(u) for u in range(LANES)], dtype=torch.int64)
    shifted = b[lane.unsqueeze(1) ^ lane.unsqueeze(0)]
    place = torch.from_numpy(cached_place_table().astype(np.int64))
    return tuple(x.to(device) for x in (t, b, lane, shifted, place & 31, place >> 5))


@functools.lru_cache(maxsize=16)
def power_tensor(device: torch.device) -> torch.Tensor:
    """:func:`power_table` as an int64 [7, 256] tensor on ``device``."""
    return torch.tensor([[signed64(v) for v in row] for row in power_table()],
                        dtype=torch.int64, device=device)


def block_powers(blocks: torch.Tensor, top: int) -> torch.Tensor:
    """``P(b) = h**(256 b)`` for an int64 tensor of block indices (a new tensor): one table
    gather per byte up to the highest byte of ``top``, a bound on the blocks the caller knows
    on the host (reading the tensor's maximum would wait on an accelerator); int64 multiplies
    wrap."""
    table = power_tensor(blocks.device)
    out = table[0].index_select(0, blocks.bitwise_and(LANES - 1))
    t = 1
    while top >> (8 * t) and t < POW_BYTES:
        byte = torch.bitwise_right_shift(blocks, 8 * t).bitwise_and_(LANES - 1)
        out.mul_(table[t].index_select(0, byte))
        t += 1
    return out

