"""Per-sample digests of batch-holding captures (docs/digests.md "Per-sample digests").

A piece's sketch is keyed by each element's global flat index, so when the auditor learns only
afterwards where a piece's samples belong (microbatches regrouped: gradient accumulation against
one batch, DDP ranks with local microbatches against one process), the sketch cannot follow
them (docs/digests.md "Placing pieces after the fact"). So a capture whose piece holds samples
along its batch dim (phases fwd, bwd and input) also carries a digest per *unit* of consecutive
samples, whose sketch is keyed *within the sample*: element ``i`` of a sample (its flat index in
the sample's own logical shape, the logical tensor without the batch dim) goes to the bucket and
sign of index ``i`` of the ordinary scheme, with ``k`` buckets. Such a digest means the same
wherever the sample ends up; the auditor compares the runs sample by sample and adds the
squared distances, so samples never share a bucket with each other.

Units: a piece of ``n`` samples gets ``n`` units of one sample when ``n <= MAX_UNITS``, with
``k = BUCKET_BUDGET / n`` buckets (a power of two, at least ``MIN_SKETCH_K``), so a record grows
by about the same ~1-2 KiB whatever ``n``. Beyond, units of ``u`` consecutive samples (``u`` a
power of two, at most ``MAX_UNITS`` units) whose sketch is ``sum_t X_t S_t``: sample ``t`` of the
unit (``t < u <= k``) has its within-sample sketch ``S_t`` with bucket ``b`` moved to ``c = b XOR
t`` and its sign flipped where ``popcount(t AND c)`` is odd (``(X_t S)[c] = (-1)^<t,c> S[c XOR
t]``). Same-index elements of different samples of a unit then never share a bucket (XOR with
different ``t`` never maps a bucket to the same one); the signs (Walsh characters) keep the
unit's buckets independent when its samples differ alike (with plain XOR the same difference in
every sample of a unit would fill only k / u distinct sums); and since ``X_o X_t = X_(o XOR t)``
when ``o`` and ``t`` share no bit, a unit of ``u`` samples at an offset ``o`` (a multiple of
``u``) of a larger unit is ``X_o`` of it: units nest, and the auditor builds any coarser grid
from finer ones (a unit of one sample is the finest). The unit's fingerprint is
the one of the unit as a tensor of its own (``sum_t F_t h**(t numel_s)``), its moments those of
its samples together. Pieces of more than ``MAX_SAMPLES`` samples get none.

The sample digests run through the same implementations as the piece's own digest (a sample is
a piece: the fused CPU kernel and Triton take lists of pieces, agents/digest/fastpath.py), or
through :func:`digest_samples_eager`, which digests every sample of a piece in the same few
vectorized ops per chunk.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from numaudit.agents.digest import hashing
from numaudit.agents.digest.digest import (
    N_MOMENTS,
    _bits_view,
    _chunks,
    _IndexMap,
    _workspace,
    has_moments,
)
from numaudit.agents.layout import PieceLayout

SAMPLE_PHASES = frozenset({1, 2, 6})
"""Phase ids whose captures hold a microbatch's samples (fwd, bwd, input: numaudit.v1 Phase)."""
MAX_UNITS = 16
"""Units per record at most: pieces of up to this many samples get one unit per sample."""
BUCKET_BUDGET = 128
"""Sketch buckets of a record's units together, for pieces of up to MAX_UNITS samples."""
MIN_SKETCH_K = 8
"""Fewest buckets of a unit's sketch (sigma of one unit's norm estimate: 1/sqrt(2k) = 25%)."""
DIGEST_MIN_K = 16
"""Fewest buckets samples are digested with: the fused kernel's loop is about a third slower at
8 buckets (a group's 8 lanes all land in one run of 8 buckets) than at 16, so units of 8
buckets are digested with 16 and folded (`combine_units`: exact, the scheme's buckets nest)."""
MAX_SAMPLES = 256
"""Pieces of more samples than this get no sample digests: units of more than 16 samples need
as many buckets (``u <= k``), so records would grow with the batch (8 bytes a sample)."""


@dataclass(slots=True)
class SampleDigests:
    """The unit digests of one captured piece (what travels as numaudit.v1 SampleDigests)."""

    dim: int
    """The piece's batch dim: sample s is index s along it."""
    unit: int
    """Samples per unit (a power of two); the last unit may hold fewer."""
    count: int
    """Samples in the piece."""
    sketch_k: int
    f64: torch.Tensor | np.ndarray
    """[units, 5 + k]: sum, sum_sq, min, max, abs_max, sketch (the digest row's layout); a numpy
    array on the host, a tensor on its accelerator until the batch's copy."""
    fingerprint: torch.Tensor | np.ndarray
    """[units] int64: each unit's fingerprint (uint64 bits)."""

    @property
    def units(self) -> int:
        return int(self.f64.shape[0])


def unit_plan(n: int) -> tuple[int, int] | None:
    """``(unit, k)`` for a piece of ``n`` samples, None for none (module docstring)."""
    if n < 1 or n > MAX_SAMPLES:
        return None
    if n <= MAX_UNITS:
        k = 1 << max(int(BUCKET_BUDGET // n).bit_length() - 1, 0)
        return 1, max(k, MIN_SKETCH_K)
    unit = 1 << (math.ceil(n / MAX_UNITS) - 1).bit_length()
    return unit, max(MIN_SKETCH_K, unit)


@dataclass(slots=True)
class SamplePlan:
    """How the samples of captures of one layout, shape, strides and dtype are digested: worked
    out once (`agents.digest.fastpath.Digester.sample_plan` caches it), so that a capture's samples
    cost a dictionary lookup, an addition to a descriptor array and a share of one kernel call."""

    layout: PieceLayout
    """The captures' layout (kept: its identity keys the cache)."""
    dim: int
    unit: int
    k: int
    """Buckets of the units sent."""
    kd: int
    """Buckets the samples are digested with (>= k, folded to k)."""
    count: int
    slayout: PieceLayout
    """Where a sample sits in the sample's logical tensor (`sample_layout`)."""
    numel_s: int
    """Elements of a whole sample."""
    descriptors: np.ndarray | None = None
    """The fused kernel's descriptors of the samples, [count, 5 + 3 ndim] int64, with addresses
    relative to the piece's (add its data pointer to column 0); None where the kernel does not
    read the piece."""


def plan_samples(layout: PieceLayout | None, dim: int, dtype: torch.dtype, phase: int
                 ) -> SamplePlan | None:
    """The plan of a capture's sample digests, None when it gets none (`wants_samples`)."""
    if layout is None or not wants_samples(phase, layout, dtype, dim):
        return None
    count = layout.shape[dim]
    plan = unit_plan(count)
    if plan is None:  # wants_samples has checked it is not
        return None
    unit, k = plan
    slayout = sample_layout(layout, dim)
    return SamplePlan(layout, dim, unit, k, max(k, DIGEST_MIN_K), count, slayout,
                      math.prod(slayout.logical_shape))


def wants_samples(phase: int, layout: PieceLayout | None, dtype: torch.dtype, dim: int) -> bool:
    """Whether a capture gets sample digests: a batch phase, a float piece that is a box of
    samples along ``dim`` (not a reduction, a Partial addend, a ragged or flat piece)."""
    return (phase in SAMPLE_PHASES and layout is not None and has_moments(dtype)
            and not dtype.is_complex and 0 <= dim < len(layout.shape)
            and not (layout.partial or layout.reduce or layout.flat
                     or layout.ragged is not None)
            and unit_plan(layout.shape[dim]) is not None)


@functools.lru_cache(maxsize=4096)
def sample_layout(layout: PieceLayout, dim: int) -> PieceLayout:
    """Where one sample of the piece sits in the sample's logical tensor: the layout without
    the batch dim (a tensor-parallel shard of a sample is a box of the sample)."""
    drop = lambda v: v[:dim] + v[dim + 1:]  # noqa: E731
    return PieceLayout(drop(layout.logical_shape), drop(layout.offsets), drop(layout.shape))


@functools.lru_cache(maxsize=256)
def _unit_powers(unit: int, numel_s: int) -> tuple[int, ...]:
    """``h**(t numel_s)`` for t < unit, as int64 values: sample t of a unit starts t samples in."""
    return tuple(hashing.signed64(hashing.shift(1, t * numel_s)) for t in range(unit))


def combine_units(f64: torch.Tensor | np.ndarray, i64: torch.Tensor | np.ndarray, unit: int,
                  numel_s: int, k: int
                  ) -> tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]:
    """Per-sample rows ``(f64 [n, 5 + K], i64 [n, 6])`` into unit rows ``(f64 [g, 5 + k],
    fingerprint [g])`` (module docstring): sketches of K buckets folded to ``k`` (bucket b into
    b mod k: the scheme's bucket of k), then units of ``unit`` samples. ``numel_s``: elements
    of a whole sample (its logical shape's, not the piece's). CPU rows are combined with numpy
    (numpy arrays back: a dozen torch calls on small tensors cost more than the digest's own
    kernel call), others with torch on their device."""
    if isinstance(f64, np.ndarray):
        return _combine(np, f64, i64[:, 5], unit, numel_s, k)
    if f64.device.type == "cpu":
        i64_np = i64 if isinstance(i64, np.ndarray) else i64.numpy()  # f64's kind: a tensor
        return _combine(np, f64.numpy(), i64_np[:, 5], unit, numel_s, k)
    return _combine(_Torch, f64, i64[:, 5], unit, numel_s, k)


def _combine(xp, f64, fp, unit: int, numel_s: int, k: int):
    """`combine_units` written once for numpy and torch (``xp``: numpy or `_Torch`)."""
    n, width = f64.shape
    big = width - N_MOMENTS
    if big != k:
        folded = xp.empty_like(f64[:, :N_MOMENTS + k])
        folded[:, :N_MOMENTS] = f64[:, :N_MOMENTS]
        folded[:, N_MOMENTS:] = f64[:, N_MOMENTS:].reshape(n, big // k, k).sum(1)
        f64 = folded
    if unit == 1:
        return f64, fp
    width = N_MOMENTS + k
    g = -(-n // unit)
    pad = g * unit - n
    if pad:
        empty = xp.zeros_like(f64[:pad])
        empty[:, 2], empty[:, 3] = math.inf, -math.inf
        f64 = xp.concatenate([f64, empty])
        fp = xp.concatenate([fp, xp.zeros_like(fp[:pad])])
    slot = (xp.arange(g * unit, like=fp) % unit)[:, None]
    lanes = xp.arange(k, like=fp)[None, :]
    # (X_t S)[c] = (-1)^<t,c> S[c ^ t]: sample t's bucket b lands in c = b ^ t
    moved = xp.take_along_axis(f64[:, N_MOMENTS:], lanes ^ slot, 1)
    moved = xp.where(_parity(lanes & slot) == 1, -moved, moved)
    out = xp.empty_like(f64[:g])
    out[:, N_MOMENTS:] = moved.reshape(g, unit, k).sum(1)
    m = f64[:, :N_MOMENTS].reshape(g, unit, N_MOMENTS)
    out[:, :2] = m[:, :, :2].sum(1)
    out[:, 2] = xp.amin(m[:, :, 2], 1)
    out[:, 3] = xp.amax(m[:, :, 3], 1)
    out[:, 4] = xp.amax(m[:, :, 4], 1)
    powers = xp.asarray(_unit_powers(unit, numel_s), like=fp)
    with np.errstate(over="ignore"):
        fps = (fp.reshape(g, unit) * powers).sum(1)  # int64 products and sums wrap mod 2**64
    return out, fps


class _Torch:
    """The numpy names `_combine` uses, for torch tensors."""

    empty_like, zeros_like, where = torch.empty_like, torch.zeros_like, torch.where

    @staticmethod
    def concatenate(parts):
        return torch.cat(parts)

    @staticmethod
    def arange(n, like):
        return torch.arange(n, device=like.device)

    @staticmethod
    def asarray(values, like):
        return torch.tensor(values, dtype=like.dtype, device=like.device)

    @staticmethod
    def take_along_axis(a, idx, axis):
        return a.gather(axis, idx)

    @staticmethod
    def amin(a, axis):
        return a.amin(axis)

    @staticmethod
    def amax(a, axis):
        return a.amax(axis)


def _parity(x):
    """popcount(x) mod 2 of int64 values below 2**32 (numpy or torch)."""
    for shift in (16, 8, 4, 2, 1):
        x = x ^ (x >> shift)
    return x & 1


# --------------------------------------------------------------------------- eager


@torch.no_grad()
def digest_samples_eager(t: torch.Tensor, slayout: PieceLayout, dim: int, sketch_k: int, *,
                         sync_free: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The digest of every sample of ``t`` along ``dim``, each placed by ``slayout`` (the
    samples' common layout, `sample_layout`): ``(f64 [n, 5 + k], i64 [n, 6])`` on t's device,
    row s equal to ``digest_piece(t.select(dim, s), slayout)``.

    The samples share their keys and buckets, which are built once per chunk of sample indices
    and broadcast over the samples of the chunk: a few ops per chunk of at most the workspace's
    elements, whatever the number of samples (at most one chunk is copied)."""
    t = t.detach()
    x = t.movedim(dim, 0)
    n = x.shape[0]
    device = t.device
    if sync_free is None:
        sync_free = device.type != "cpu"
    m = slayout.numel
    f64 = torch.zeros((n, N_MOMENTS + sketch_k), dtype=torch.float64, device=device)
    f64[:, 2], f64[:, 3] = math.inf, -math.inf
    i64 = torch.zeros((n, 6), dtype=torch.int64, device=device)
    i64[:, 0] = m
    if n == 0 or m == 0:
        return f64, i64
    if tuple(x.shape[1:]) != slayout.shape and [s for s in x.shape[1:] if s != 1] != \
            [s for s in slayout.shape if s != 1]:
        raise ValueError(f"shape: samples {tuple(x.shape[1:])} != layout.shape {slayout.shape}")
    ws = _workspace(device)
    imap = _IndexMap.of(slayout)
    bits_dtype = _bits_view(t.dtype)
    mixed = hashing.mixed_dtype(t.dtype)
    acc = torch.zeros((n, 2 * sketch_k), dtype=torch.float64, device=device)
    if m <= ws.chunk:
        # whole samples, as many as fit a chunk (a non-contiguous group is copied: one chunk)
        rows_per = ws.chunk // m
        for s0 in range(0, n, rows_per):
            s1 = min(n, s0 + rows_per)
            _block(x[s0:s1].reshape(s1 - s0, m), 0, ws, imap, sketch_k, f64[s0:s1],
                   i64[s0:s1], acc[s0:s1], bits_dtype, mixed, sync_free)
    else:
        for s in range(n):  # samples over a chunk each: the per-sample loop costs nothing more
            for a, chunk in _chunks(x[s], ws.chunk):
                _block(chunk.view(1, -1), a, ws, imap, sketch_k, f64[s:s + 1], i64[s:s + 1],
                       acc[s:s + 1], bits_dtype, mixed, sync_free)
    f64[:, N_MOMENTS:] = acc[:, :sketch_k] - acc[:, sketch_k:]
    f64[:, 4] = torch.where(f64[:, 2] <= f64[:, 3],
                            torch.maximum(f64[:, 2].abs(), f64[:, 3].abs()), 0.0)
    return f64, i64


def _block(x: torch.Tensor, a: int, ws, imap: _IndexMap, k: int, f64: torch.Tensor,
           i64: torch.Tensor, acc: torch.Tensor, bits_dtype, mixed: bool, sync_free: bool
           ) -> None:
    """Fold one block of ``r`` samples x ``c`` sample indices (from ``a``) into the rows."""
    r, c = x.shape
    rc = r * c
    keys, bins = imap.keys_into(a, c, ws, k)
    assert bins is not None  # keys_into gives bins whenever sketch_k is passed
    term = ws.term[:rc]
    term.view(r, c).copy_(x.view(bits_dtype) if bits_dtype is not None else x)
    if mixed:
        hashing.mix64_(term, ws.tmp[:rc])
    i64[:, 5] += term.view(r, c).mul_(keys.unsqueeze(0)).sum(1)  # wraps mod 2**64
    f = ws.f64[:rc].view(r, c)
    if x.dtype == torch.float16:
        f.copy_(ws.f32[:rc].view(r, c).copy_(x))
    else:
        f.copy_(x)
    i64[:, 4] += c - torch.count_nonzero(f, dim=1)
    if not sync_free and math.isfinite(f.sum().item()):
        lo, hi = torch.aminmax(f, dim=1)
    else:
        i64[:, 1] += torch.isnan(f).sum(1)
        i64[:, 2] += (f == math.inf).sum(1)
        i64[:, 3] += (f == -math.inf).sum(1)
        finite = torch.isfinite(f)
        lo = torch.where(finite, f, math.inf).amin(1)
        hi = torch.where(finite, f, -math.inf).amax(1)
        f.masked_fill_(finite.logical_not_(), 0.0)
    torch.minimum(f64[:, 2], lo, out=f64[:, 2])
    torch.maximum(f64[:, 3], hi, out=f64[:, 3])
    f64[:, 0] += f.sum(1)
    f64[:, 1] += (f * f).sum(1)
    index = ws.tmp[:rc].view(r, c)
    torch.add(bins.unsqueeze(0), (torch.arange(r, device=x.device) * (2 * k)).unsqueeze(1),
              out=index)
    acc.view(-1).scatter_add_(0, index.view(-1), f.view(-1))
