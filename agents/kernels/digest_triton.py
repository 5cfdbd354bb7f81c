"""The digest of a list of pieces in a few Triton launches, for accelerator tensors (CUDA, ROCm).

Computes what agents/digest/digest.py computes, on hash scheme version 3 (agents/digest/hashing.py):
fingerprint ``sum_i T[j] * P(b) * V(x_i) mod 2**64``, counts, sum and sum of squares, min,
max and abs-max over finite elements, and the CountSketch. How a piece is walked (rows of hash
blocks in the sketch's bucket order, tiles of up to 64k elements) is in
agents/kernels/triton_plan.py, the kernels in agents/kernels/triton_kernels.py, how they are
launched in agents/kernels/triton_launch.py.

A hook's captures (every output of a module, every gradient of a parameter sweep) are digested
together: pieces are grouped by what the kernels specialize on (load dtype, float type, ``V``
rule, one line or many, unit line stride; and address alignment, for the offsets from the
group's anchor), and each group costs two launches, tiles then finish. A group of one piece
(the usual hook) passes its descriptor in the launch's arguments; a larger group uploads a
descriptor table (one asynchronous copy through pinned memory). Nothing here waits on the
device.

Contract (docs/digests.md "On an accelerator"): fingerprints, counts, min, max and abs-max are
bitwise those of the eager reference and of the CPU kernel; sums, sums of squares and sketch
buckets are accumulated in float32 within a tile (float64 for float64 pieces, and for a tile
float32 cannot sum safely) and in float64 across tiles, within ``triton_plan.F32_TILE_ERROR``;
the same tensor gives the same bits on every run (no atomics). agents/kernels/accel.py checks
that on each device, dtype and k before the agent uses it. Triton is optional: importing this
module without it raises ImportError.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton.language as tl

from numaudit.agents.digest import hashing
from numaudit.agents.digest.digest import N_MOMENTS
from numaudit.agents.kernels import triton_kernels as kern
from numaudit.agents.kernels.triton_launch import Launchers, RowArena, Workspace, current_stream
from numaudit.agents.kernels.triton_plan import (  # noqa: F401
    MAX_DIMS,
    NUM_WARPS,
    Plan,
    check_k,
    inverse_place_tensor,
    plan_piece,
    rows_per_step,
    tiling,
    vector_reads,
)
from numaudit.agents.layout import PieceLayout

FINISH_BLOCK = 16
"""Tiles a finishing program adds per step."""
BUCKETS_PER_FINISH = 256
"""Sketch buckets per finishing program."""

_TL_FLOAT = {torch.float32: tl.float32, torch.float64: tl.float64,
             torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(slots=True)
class Prepared:
    """A piece as the kernels read it (:func:`prepare`)."""

    x: torch.Tensor
    """The piece (its real view if complex); kept so that it is not freed before the launch."""
    ptr: int
    """Its first element's address."""
    plan: Plan


MAX_PLANS = 4096
"""Plans :func:`prepare` keeps (per layout, shape, strides and dtype) before starting afresh."""

_PLANS: dict[tuple, tuple[PieceLayout, Plan]] = {}
"""(id(layout), shape, strides, dtype) -> (layout, plan): a piece's plan is the same for every
capture of a site and shape (the layout is kept so that its id is not reused while cached)."""


def prepare(t: torch.Tensor, layout: PieceLayout) -> Prepared:
    """Work out how the kernels read piece ``t`` of ``layout``. Raises ValueError for a dtype
    the kernels do not read (float8 types), more than ``MAX_DIMS`` dims after merging, or a bad
    layout."""
    key = (id(layout), t.shape, t.stride(), t.dtype)
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not layout:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        hit = _PLANS[key] = (layout, plan_piece(t, layout))
    if t.dtype.is_complex:
        t = torch.view_as_real(t)
    return Prepared(t, t.data_ptr(), hit[1])


class _Device:
    """What launches on one device share: the hash tables, the launchers, and per stream a
    workspace and per k an arena of output rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        table = hashing.tables(device)[0]
        powers = hashing.power_tensor(device).reshape(-1)
        inv = inverse_place_tensor(device)
        self.tables = (inv, table, powers)
        self.table_ptrs = tuple(t.data_ptr() for t in self.tables)
        self.launchers = Launchers()
        self.workspaces: dict[int, Workspace] = {}
        self.arenas: dict[tuple[int, int], RowArena] = {}
        self.variants: dict[tuple, tuple] = {}

    def workspace(self, stream: int) -> Workspace:
        ws = self.workspaces.get(stream)
        if ws is None:
            ws = self.workspaces[stream] = Workspace(self.device)
        return ws

    def arena(self, stream: int, k: int) -> RowArena:
        arena = self.arenas.get((stream, k))
        if arena is None:
            arena = self.arenas[(stream, k)] = RowArena(self.device, k)
        return arena


@functools.lru_cache(maxsize=16)
def _device(device: torch.device) -> _Device:
    return _Device(device)


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


def digest_prepared(pieces: list[Prepared], *,
                    sketch_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``pieces`` (all on one device): ``(f64 [m, 5 + k], i64 [m, 6])`` on that
    device, row j the digest of piece j (agents.digest.digest.digest_piece's rows, within the
    contract above). No host synchronization."""
    check_k(sketch_k)
    m = len(pieces)
    if not m:
        raise ValueError("pieces: empty list")
    device = pieces[0].x.device
    f64 = torch.empty((m, N_MOMENTS + sketch_k), dtype=torch.float64, device=device)
    i64 = torch.empty((m, 6), dtype=torch.int64, device=device)
    _digest_into(pieces, sketch_k, device, (f64, i64), (f64.data_ptr(), i64.data_ptr()), 0)
    return f64, i64


def digest_rows(pieces: list[Prepared], *,
                sketch_k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per piece its rows ``(f64 [5 + k], i64 [6])``, views of the device's row arena for the
    current stream (triton_launch.RowArena): what the agent uses, as nothing is allocated per
    call. Same contract as :func:`digest_prepared`."""
    check_k(sketch_k)
    m = len(pieces)
    if not m:
        raise ValueError("pieces: empty list")
    device = pieces[0].x.device
    arena = _device(device).arena(current_stream(device), sketch_k)
    first = arena.take(m)
    f64, i64 = arena.f64, arena.i64
    assert f64 is not None and i64 is not None  # take made them: m >= 1
    _digest_into(pieces, sketch_k, device, (f64, i64), arena.ptrs, first)
    return [(f64[j], i64[j]) for j in range(first, first + m)]


def _digest_into(pieces: list[Prepared], k: int, device: torch.device,
                 out: tuple[torch.Tensor, torch.Tensor], out_ptrs: tuple[int, int],
                 first: int) -> None:
    """Launch the digests of ``pieces`` into rows ``first`` on of ``out``."""
    dev = _device(device)
    stream = current_stream(device)
    ws = dev.workspace(stream)
    if len(pieces) == 1:
        p = pieces[0]
        _launch_group(dev, ws, stream, pieces, [first], k, out, out_ptrs,
                      vector_reads(p.plan, p.ptr))
        return
    if any(p.x.device != device for p in pieces):
        raise ValueError("pieces: on more than one device")
    groups: dict[tuple, list[int]] = {}
    for j, p in enumerate(pieces):
        # The float type and V rule too: bfloat16, float16 and uint16 all load as uint16 (only
        # uint16 is mixed), bool and uint8 as uint8 (both mixed).
        key = (p.plan.group, p.ptr % p.plan.element_size if p.plan.n else 0,
               vector_reads(p.plan, p.ptr))
        groups.setdefault(key, []).append(j)
    for key, members in groups.items():
        _launch_group(dev, ws, stream, [pieces[j] for j in members],
                      [first + j for j in members], k, out, out_ptrs, key[2])


def constexprs(plan: Plan, k: int, count: int, vec: bool) -> tuple[dict, dict]:
    """The tiles and finish kernels' constexprs for a group like ``plan``'s of ``count`` pieces
    (``vec``: read in vectors)."""
    single = count == 1
    float_tl = None if plan.float_dtype is None else _TL_FLOAT.get(plan.float_dtype)
    wide = plan.float_dtype == torch.float64
    tiles = dict(K=k, NW=max(k // hashing.LANES, 1), FLOAT=float_tl,
                 ACC=tl.float64 if wide else tl.float32, WIDE=wide, MIXED=plan.mixed,
                 LINES=plan.lines, UNIT=plan.unit, VEC=vec, SINGLE=single, R=rows_per_step(k),
                 SEARCH=0 if single else _search_steps(count))
    finish = dict(K=k, KC=min(k, BUCKETS_PER_FINISH), FLOAT=float_tl, SINGLE=single,
                  BLOCK=FINISH_BLOCK)
    return tiles, finish


def _variant(dev: _Device, plan: Plan, k: int, count: int, vec: bool) -> tuple:
    """``(tiles launcher, finish launcher, finish grid columns)`` of a group like ``plan``'s of
    ``count`` pieces (``vec``: read in vectors), made once per device."""
    key = (plan.group, k, count == 1, 0 if count == 1 else _search_steps(count), vec)
    hit = dev.variants.get(key)
    if hit is None:
        tiles, finish = constexprs(plan, k, count, vec)
        hit = dev.variants[key] = (
            dev.launchers.get(kern.tiles_kernel, tiles, NUM_WARPS, kern.TILES_INTS),
            dev.launchers.get(kern.finish_kernel, finish, 4, kern.FINISH_INTS),
            k // finish["KC"])
    return hit


def _launch_group(dev: _Device, ws: Workspace, stream: int, group: list[Prepared],
                  out_rows: list[int], k: int, out: tuple[torch.Tensor, torch.Tensor],
                  out_ptrs: tuple[int, int], vec: bool) -> None:
    """The two launches of one group of pieces (tiles, then finish) into rows ``out_rows``."""
    plan = group[0].plan
    count = len(group)
    tiles_launch, finish_launch, columns = _variant(dev, plan, k, count, vec)
    inv_at, table_at, pow_at = dev.table_ptrs
    anchor: Prepared | None
    if count == 1:
        anchor = group[0]
        at = anchor.ptr
        tile_rows, tiles_total = tiling(plan, k) if plan.n else (1, 0)
        scalars = (0, tiles_total, 0, plan.n, out_rows[0], tile_rows, *plan.fields)
        desc_t, desc_at = None, pow_at
    else:
        anchor = next((p for p in group if p.plan.n), None)
        at = anchor.ptr if anchor is not None else 0
        tiles_total = 0
        desc = []
        for p, row in zip(group, out_rows):
            tile_rows, tiles = tiling(p.plan, k) if p.plan.n else (1, 0)
            desc.append((tiles_total, tiles, (p.ptr - at) // plan.element_size, p.plan.n, row,
                         tile_rows, *p.plan.fields))
            tiles_total += tiles
        desc_t = _upload(np.array(desc, dtype=np.int64), dev.device)
        desc_at, scalars = desc_t.data_ptr(), (0,) * len(desc[0])
    ws.ensure(tiles_total, k)
    pi_at, pf_at, ps_at = ws.ptrs
    inv, table, powers = dev.tables
    if desc_t is None:
        desc_t = powers  # not read (the descriptor is in the arguments); a pointer of its type
    if tiles_total:
        assert anchor is not None  # tiles only where a piece has elements
        tiles_launch(
            (tiles_total, 1), stream,
            (at, desc_at, count, inv_at, table_at, pow_at, pi_at, pf_at, ps_at, *scalars),
            lambda: (anchor.x.detach().view(plan.load_dtype), desc_t, count, inv, table,
                     powers, ws.part_i64, ws.part_f64, ws.part_sk, *scalars))
    tail = (scalars[0], scalars[1], scalars[3], scalars[4])
    finish_launch((count, columns), stream, (desc_at, pi_at, pf_at, ps_at, *out_ptrs, *tail),
                  lambda: (desc_t, ws.part_i64, ws.part_f64, ws.part_sk, *out, *tail))


def digest_pieces_triton(
    pieces: list[tuple[torch.Tensor, PieceLayout]], *, sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`digest_prepared` of ``(tensor, layout)`` pieces; raises ValueError where
    :func:`prepare` does for any of them."""
    return digest_prepared([prepare(t, layout) for t, layout in pieces], sketch_k=sketch_k)


def digest_piece_triton(
    t: torch.Tensor, layout: PieceLayout, *, sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as agents.digest.digest.digest_piece: ``(f64 [5 + k], i64 [6])`` on ``t``'s
    device (one piece through :func:`digest_pieces_triton`)."""
    f64, i64 = digest_pieces_triton([(t, layout)], sketch_k=sketch_k)
    return f64[0], i64[0]
