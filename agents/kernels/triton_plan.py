"""How the Triton digest reads a piece, worked out on the host (no Triton needed here).

The kernels (agents/kernels/triton_kernels.py) walk a piece in *rows*: each row is one hash
block of 256 consecutive global indices (``B * 256 + j``, lane ``j``) intersected with one
*line* of the piece, a run of consecutive global indices that sits at one memory stride. A
contiguous piece, a Shard(0) or a batch split is one line (any memory stride); a column shard,
a 2-D box or a transposed view is many lines, the piece's innermost dim (its other dims, up to
``MAX_DIMS`` after merging, are the lines' outer coordinates). A row is read in lane order,
as a copy reads memory; its signed values are then permuted into the order of the sketch's
buckets: lane ``j`` of block ``B`` goes to bucket ``8 g + (r XOR x)`` with ``g`` and ``x`` from
the block's row of the placement table (agents/digest/hashing.py), so position ``c`` takes lane
``8 q + ((c AND 7) XOR x_q)`` with ``q`` the group the placement sends to bucket group
``c >> 3`` (:func:`inverse_place_table`). A row then adds into its program's sketch at
positions that depend only on ``c``: for ``k <= 256`` bucket ``c mod k``, for ``k > 256``
bucket ``256 w + c`` with the block's window ``w`` — no scatter, no atomics, so the sketch
stays in registers and its bits are the same on every run.

A *tile* is up to ``MAX_TILE_ROWS`` rows of one piece (64k elements), one program: its sums and
sketch are accumulated in float32 (float64 for float64 pieces) and written as one row of
partials, which a second launch adds in float64, tile after tile in a fixed order
(docs/digests.md "On an accelerator": the error this adds).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from numaudit.agents.config import ENV_TRITON_ROWS, ENV_TRITON_WARPS
from numaudit.agents.digest import hashing
from numaudit.agents.kernels.cpu import index_map
from numaudit.agents.layout import PieceLayout, complex_real_layout

MAX_DIMS = 4
"""Dims of a piece after merging those contiguous in both memory and the logical tensor."""
ROWS = int(os.environ.get(ENV_TRITON_ROWS, "2"))
"""Rows a program reads per loop step for k <= 256 (one for k > 256: its window picks the
sketch's 256 buckets a row adds to). A power of two; NUMAUDIT_TRITON_ROWS sets it (for
``python -m bench.gpu``'s sweep: the bound below holds for any). With NUM_WARPS, chosen
without a GPU from ptxas's register counts for sm_90 (docs/benchmarks.md): 4 elements a thread
and a step, about 128 registers, 16 warps a multiprocessor."""
NUM_WARPS = int(os.environ.get(ENV_TRITON_WARPS, "4"))
"""Warps per program of the tiles kernel (NUMAUDIT_TRITON_WARPS sets it)."""
MAX_TILE_ROWS = 256
"""Rows of a tile at most: 64k elements, the float32 accumulation's span (the contract)."""
SLOT_TERMS = 64
"""For k <= 256, rows of a tile at most per row a loop step reads: an accumulator slot then adds
at most 64 terms in float32, which keeps the rounding it adds to a sketch near 1.4e-7 of the
norm (docs/digests.md "On an accelerator"); for k > 256 a slot may add MAX_TILE_ROWS."""
MAX_K = 4096
"""Most sketch buckets the kernels take (a program holds its k-bucket sketch in registers);
pieces digested with more go to the eager path."""
TARGET_TILES = 512
"""Tiles a large piece is cut into (at least; tiles stay within MAX_TILE_ROWS rows), so a
launch has programs enough for every multiprocessor of a large GPU."""
MIN_TILE_ROWS = 16
"""Rows of a tile at least (4096 elements): a smaller piece is one tile."""

F32_TILE_ERROR = (MAX_TILE_ROWS + 1) * 2.0 ** -24
"""Bound on the relative error float32 accumulation within tiles adds (docs/digests.md):
a sum, a sum of squares or a sketch bucket is within ``F32_TILE_ERROR * sum |terms|`` (plus
``2**-126`` per term for subnormals) of its float64 value. Each accumulator slot of a program
sums at most ``MAX_TILE_ROWS / rows per step`` terms in float32 (each square rounded once
more), and everything past the slots runs in float64."""
F32_SAFE = (2.0 ** -40, 2.0 ** 55)
"""A tile whose largest finite magnitude is outside this range is summed again in float64
(in the kernel): above, a float32 sum of squares could overflow; below, its terms could
underflow to a visible share of the result."""

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

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""Float dtypes: moments and a sketch (their loaded bits are bitcast back)."""

FIELDS = ("first_tile", "tiles", "x_off", "n", "out_row", "tile_rows", "rows", "bpl",
          "line_len", "line_stride", "origin", "top", "s1", "s2", "s3",
          "t0", "t1", "t2", "t3", "g0", "g1", "g2", "g3")
"""A piece's descriptor (int64 each), in this order: its first tile in its launch group, its
tiles, its first element's offset in elements from the group's anchor, numel, its output row,
rows per tile, rows, rows per line (blocks a line can touch), line length and memory stride,
the global index of its element 0, its largest block index, then its outer dims: sizes s1..s3
(s0 is implied), memory strides t0..t3 and global strides g0..g3."""
W = len(FIELDS)
STATIC = FIELDS.index("tile_rows")
"""Fields from here on depend only on the piece's plan (and k), not on where it lies."""


@functools.lru_cache(maxsize=1)
def inverse_place_table() -> np.ndarray:
    """``INV[row, G] = q | x_q << 5`` as int32 [4096, 32]: the lane group ``q`` that placement
    row ``row`` sends to bucket group ``G``, and that group's lane XOR."""
    place = hashing.place_table().astype(np.int32)
    g, x = place & 31, place >> 5
    inv = np.empty_like(place)
    rows = np.arange(hashing.PLACE_ROWS)[:, None]
    q = np.arange(hashing.GROUPS)[None, :]
    inv[rows, g] = q | (x << 5)
    return inv


@functools.lru_cache(maxsize=16)
def inverse_place_tensor(device: torch.device) -> torch.Tensor:
    """:func:`inverse_place_table`, flattened, on ``device``."""
    return torch.from_numpy(inverse_place_table().reshape(-1).copy()).to(device)


def merged_dims(t: torch.Tensor, gs: tuple[int, ...]) -> list[tuple[int, int, int]]:
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
class Plan:
    """What the kernels need of a piece apart from its address (one per layout, shape,
    strides and dtype)."""

    load_dtype: torch.dtype
    """The dtype the piece is read as (``_LOAD_VIEW``)."""
    float_dtype: torch.dtype | None
    """Its float dtype (moments and sketch), or None."""
    mixed: bool
    """Whether its elements enter the fingerprint through mix64 (hashing.mixed_dtype)."""
    lines: bool
    """More than one line (the kernel works out each row's line from its outer coordinates)."""
    unit: bool
    """Its lines have memory stride 1."""
    n: int
    rows: int
    element_size: int
    fields: tuple[int, ...]
    """The descriptor from ``rows`` on (``FIELDS[STATIC + 1:]``: rows, bpl, ...)."""
    tilings: dict[int, tuple[int, int]]
    """k -> (rows per tile, tiles), made on first use (:func:`tiling`)."""
    vec_lead: int = -1
    """For one line of stride 1 whose live lanes come in whole groups of 8 (its first index and
    its end multiples of 8): its first element's lane, so that a piece at an address where that
    lane's row starts on 16 bytes can be read in vectors (:func:`vector_reads`); else -1."""
    group: tuple = ()
    """What a launch group shares (with the sketch's k and the address alignment): load
    dtype, float dtype, mixed, lines, unit."""

    def __post_init__(self) -> None:
        self.group = (self.load_dtype, self.float_dtype, self.mixed, self.lines, self.unit)


def plan_piece(t: torch.Tensor, layout: PieceLayout) -> Plan:
    """Work out how the kernels read pieces like ``t`` (its shape, strides and dtype) placed by
    ``layout``. Raises ValueError for a dtype the kernels do not read (float8 types), more than
    ``MAX_DIMS`` dims after merging, or a bad layout."""
    if t.dtype.is_complex:
        if len(layout.shape) == t.dim():
            layout = complex_real_layout(layout)
        t = torch.view_as_real(t)
    if t.dtype not in _LOAD_VIEW:
        raise ValueError(f"dtype: {t.dtype} is not read by the Triton digest")
    base, gs = index_map(tuple(t.shape), layout)
    dims = merged_dims(t, gs)
    if len(dims) > MAX_DIMS:
        raise ValueError(f"shape: {len(dims)} dims after merging > {MAX_DIMS}")
    n = t.numel()
    if dims and dims[-1][2] == 1:  # the innermost dim is a run of consecutive indices
        line_len, line_stride, _ = dims.pop()
    else:
        line_len, line_stride = 1, 0
    lines = len(dims) > 0
    outer = [(1, 0, 0)] * (MAX_DIMS - len(dims)) + dims
    # Blocks a line can touch: lines start at base + sum c_d g_d, so their offsets within a
    # block are base's mod the gcd of 256 and the outer global strides, plus multiples of it.
    step = math.gcd(hashing.LANES, *(g for _, _, g in dims))
    lead = base % step + hashing.LANES - step
    bpl = (lead + line_len + hashing.LANES - 1) // hashing.LANES
    rows = 0 if n == 0 else bpl * (n // line_len)
    last = base + sum((s - 1) * g for s, _, g in outer) + line_len - 1
    fields = (rows, bpl, line_len, line_stride, base, max(last, 0) >> hashing.LANE_BITS,
              outer[1][0], outer[2][0], outer[3][0], *(d[1] for d in outer),
              *(d[2] for d in outer))
    float_dtype = t.dtype if t.dtype in FLOATS else None
    lead = base % hashing.LANES
    whole = not lines and line_stride == 1 and lead % 8 == 0 and (lead + n) % 8 == 0
    return Plan(_LOAD_VIEW[t.dtype], float_dtype, hashing.mixed_dtype(t.dtype), lines,
                line_stride == 1, n, rows, t.element_size(), fields, {},
                lead if whole and n else -1)


def vector_reads(plan: Plan, ptr: int) -> bool:
    """Whether the piece at address ``ptr`` can be read in 16-byte vectors: one line of stride
    1 in whole groups of 8 lanes whose rows start on 16 bytes."""
    return plan.vec_lead >= 0 and (ptr - plan.vec_lead * plan.element_size) % 16 == 0


def tiling(plan: Plan, k: int) -> tuple[int, int]:
    """``(rows per tile, tiles)`` of ``plan`` for a sketch of ``k`` buckets: a power of two of
    rows, at least ``MIN_TILE_ROWS`` and ``rows / TARGET_TILES``, and enough that a tile's
    partial sketch (8 k bytes) is at most an eighth of the bytes it reads; but at most
    ``MAX_TILE_ROWS``, and for k <= 256 at most ``SLOT_TERMS`` per row a step reads."""
    hit = plan.tilings.get(k)
    if hit is None:
        rows = plan.rows
        want = max(rows // TARGET_TILES, -(-8 * 8 * k // (hashing.LANES * plan.element_size)),
                   MIN_TILE_ROWS)
        cap = MAX_TILE_ROWS if k > hashing.LANES else min(MAX_TILE_ROWS, SLOT_TERMS * ROWS)
        tile_rows = min(cap, 1 << (want - 1).bit_length())
        hit = plan.tilings[k] = (tile_rows, -(-rows // tile_rows))
    return hit


def rows_per_step(k: int) -> int:
    """Rows a program reads per loop step: ``ROWS``, or one when the sketch has windows."""
    return ROWS if k <= hashing.LANES else 1


def check_k(k: int) -> None:
    """Raises ValueError for a k the kernels do not take."""
    if k < 1 or k & (k - 1) or k > MAX_K:
        raise ValueError(f"sketch_k: {k} is not a power of two in [1, {MAX_K}]")
