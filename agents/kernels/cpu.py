"""The fused CPU digest as a torch op: ``torch.ops.numaudit.digest_batch``.

The C++ kernel (digest_cpu.cpp) is loaded with ctypes over raw data pointers: no torch headers,
so it builds in seconds and never inside training (``make kernels``). It is registered through
``torch.library.custom_op`` with a fake implementation, so it is a real op that tracing and
``torch.compile`` see with the right output shapes.

An index map says where each piece sits in its logical tensor: element ``c`` (coordinates in the
piece tensor's own dims) has global flat index ``base + sum_d c_d * gstrides[d]``.
:func:`index_map` derives it from a :class:`PieceLayout`. Complex pieces are digested as
``torch.view_as_real``, with an index map for that view (one more dim).

:func:`digest_rows` is the op's body, callable directly: the agent's hooks use it to skip the
dispatcher's per-call cost (docs/agent.md has the measured figures). Nothing here raises into
training: :func:`load` logs one warning and returns None when the library is missing or stale,
and callers then use the eager path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import struct
import threading

import torch

from numaudit.agents.digest.digest import N_MOMENTS
from numaudit.agents.kernels import build
from numaudit.agents.layout import PieceLayout

logger = logging.getLogger(__name__)

ABI_VERSION = 3
"""Descriptor format this module writes; the library reports the one it reads."""

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4,
    torch.uint16: 5, torch.uint32: 6, torch.uint64: 7, torch.bool: 8,
    torch.float16: 9, torch.bfloat16: 10, torch.float32: 11, torch.float64: 12,
}
"""Element types the kernel reads; keep in step with ``enum Dtype`` in digest_cpu.cpp. Others
(float8 types) go to the eager path."""

MAX_DIMS = 16

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_loaded = False


def load() -> ctypes.CDLL | None:
    """The kernel library, loaded once; None (and one warning) when it cannot be used.

    A library built from other sources than those beside it is refused rather than run: it
    could compute a different digest than the sources say.
    """
    global _lib, _load_error, _loaded
    if _loaded:
        return _lib
    with _lock:
        if _loaded:
            return _lib
        try:
            if build.stale():
                raise OSError(f"{build.LIBRARY} is missing or was built from other sources "
                              "(in a checkout: run `make kernels`; installed: reinstall numaudit "
                              "where a C++ compiler is present)")
            lib = ctypes.CDLL(str(build.LIBRARY))
            lib.numaudit_digest_abi.restype = ctypes.c_int64
            lib.numaudit_digest_isa.restype = ctypes.c_int64
            if lib.numaudit_digest_abi() != ABI_VERSION:
                raise OSError(f"ABI {lib.numaudit_digest_abi()} != {ABI_VERSION}")
            fn = lib.numaudit_digest_batch
            fn.restype = ctypes.c_int64
            # The descriptor is passed as bytes (c_char_p: a pointer to the bytes' buffer).
            fn.argtypes = (ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_void_p)
            _lib = lib
        except OSError as exc:
            _load_error = str(exc)
            logger.warning("numaudit: fused CPU digest unavailable, using the eager path: %s", exc)
        _loaded = True
    return _lib


def load_error() -> str | None:
    """Why :func:`load` returned None, for tests and diagnostics."""
    load()
    return _load_error


def isa_level() -> int | None:
    """4 (AVX-512), 3 (AVX2) or 1 (baseline): the kernel build in use; None when not loaded."""
    lib = load()
    return None if lib is None else int(lib.numaudit_digest_isa())


def supports(t: torch.Tensor) -> bool:
    """The kernel can digest this (detached, local) piece: a CPU tensor of a known dtype.

    Only a plain tensor: a subclass may not own its bytes yet (the AsyncCollectiveTensor a
    RowwiseParallel output is, until its all-reduce is waited on: reading its data pointer
    crashed the process), so subclasses take the eager path, whose torch ops resolve them.
    """
    if type(t) is not torch.Tensor or not t.is_cpu or t.dim() > MAX_DIMS:
        return False
    if t.dtype.is_complex:
        return t.dtype in (torch.complex64, torch.complex128, torch.complex32)
    return t.dtype in DTYPE_CODES


@functools.lru_cache(maxsize=4096)
def index_map(shape: tuple[int, ...], layout: PieceLayout) -> tuple[int, tuple[int, ...]]:
    """``(base, gstrides)`` of a piece tensor of ``shape`` placed by ``layout``.

    ``shape`` may differ from ``layout.shape`` by size-1 dims only (as digest_piece allows); a
    size-1 dim gets gstride 0. Raises ValueError like agents/digest/digest.py does for a bad layout.
    """
    layout.validate()
    logical = layout.logical_shape
    gs = [1] * len(logical)
    acc = 1
    for d in range(len(logical) - 1, -1, -1):
        gs[d] = acc
        acc *= logical[d]
    base = sum(o * g for o, g in zip(layout.offsets, gs))
    if shape == layout.shape:
        return base, tuple(gs)
    kept = [g for s, g in zip(layout.shape, gs) if s != 1]
    if [s for s in shape if s != 1] != [s for s in layout.shape if s != 1]:
        raise ValueError(f"shape: tensor {shape} != layout.shape {layout.shape}")
    it = iter(kept)
    return base, tuple(0 if s == 1 else next(it) for s in shape)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """Complex pieces are digested as their (..., 2) real view, like the eager path."""
    return torch.view_as_real(t) if t.is_complex() else t


_HEAD = struct.Struct("<5q")
pack_head = _HEAD.pack
"""``pack_head(data, dtype code, ndim, base, payload)``: a descriptor's head (see
:func:`descriptor`), for callers that cache everything but the addresses."""


def descriptor_tail(t: torch.Tensor, gstrides) -> bytes:
    """The part of a piece's descriptor fixed by its shape, strides and index map:
    ``(size, stride, gstride)`` per dim (callers may cache it per shape and strides)."""
    return struct.pack(f"<{3 * t.dim()}q", *[v for d in zip(t.shape, t.stride(), gstrides)
                                             for v in d])


def descriptor(t: torch.Tensor, base: int, tail: bytes, payload: int = 0) -> bytes:
    """One piece's descriptor: ``[data, dtype, ndim, base, payload, tail]`` as int64s.

    ``payload``: 0, or the address of ``t.numel() * t.element_size()`` writable bytes that the
    kernel fills with the piece's elements in C order (the bytes of ``t.contiguous()``).
    """
    return _HEAD.pack(t.data_ptr(), DTYPE_CODES[t.dtype], t.dim(), base, payload) + tail


def kernel():
    """The library's batch entry point, ``(n, descriptors joined, sketch_k, f64_ptr, i64_ptr)
    -> 0 or 1 + the first rejected piece``, for a caller that checked ``sketch_k`` once and
    keeps the call (what :func:`digest_into` does, without its checks); None when the library
    is not loaded."""
    lib = load()
    return None if lib is None else lib.numaudit_digest_batch


def digest_into(descriptors: list[bytes], sketch_k: int, f64_ptr: int, i64_ptr: int) -> None:
    """Run the kernel over ``descriptors``, writing ``len(descriptors)`` consecutive rows at the
    addresses ``f64_ptr`` (float64 ``[n, 5 + k]``) and ``i64_ptr`` (int64 ``[n, 6]``).

    The caller owns the memory and keeps every piece (and payload buffer) alive during the
    call. Raises RuntimeError when the library is not loaded or rejects a descriptor.
    """
    lib = load()
    if lib is None:
        raise RuntimeError(f"fused CPU digest unavailable: {_load_error}")
    if sketch_k < 1 or sketch_k & (sketch_k - 1) or sketch_k > 1 << 24:
        raise ValueError(f"sketch_k: {sketch_k} is not a power of two in [1, 2**24]")
    n = len(descriptors)
    if n:
        bad = lib.numaudit_digest_batch(n, b"".join(descriptors), sketch_k, f64_ptr, i64_ptr)
        if bad:
            raise RuntimeError(f"pieces[{bad - 1}]: descriptor rejected by the kernel")


def digest_rows(
    pieces: list[torch.Tensor], bases: list[int], gstrides: list[int], sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest every piece in one kernel call: ``(f64 [n, 5 + k], i64 [n, 6])`` on the CPU.

    ``pieces`` are CPU tensors of kernel dtypes (complex ones already viewed as real: callers
    check :func:`supports`); ``gstrides`` concatenates each piece's per-dim global strides.
    Raises RuntimeError when the library is not loaded or rejects a descriptor, ValueError on
    inconsistent arguments. (The agent writes rows straight into its batch's buffers with
    :func:`digest_into` instead.)
    """
    n = len(pieces)
    descs: list[bytes] = []
    at = 0
    for t, base in zip(pieces, bases):
        nd = t.dim()
        descs.append(descriptor(t, base, descriptor_tail(t, gstrides[at:at + nd])))
        at += nd
    if len(bases) != n or at != len(gstrides):
        raise ValueError(f"gstrides/bases: {len(gstrides)} strides and {len(bases)} bases for "
                         f"{n} pieces of {at} dims in all")
    f64 = torch.empty((n, N_MOMENTS + sketch_k), dtype=torch.float64)
    i64 = torch.empty((n, 6), dtype=torch.int64)
    digest_into(descs, sketch_k, f64.data_ptr(), i64.data_ptr())
    return f64, i64


@torch.library.custom_op("numaudit::digest_batch", mutates_args=(), device_types="cpu")
def digest_batch(
    pieces: list[torch.Tensor], bases: list[int], gstrides: list[int], sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest rows of a list of pieces, one kernel call (see :func:`digest_rows`).

    Complex pieces are accepted; their index maps are those of the real view.
    """
    pieces = [real_view(t.detach()) for t in pieces]
    for i, t in enumerate(pieces):
        if not supports(t):
            raise ValueError(f"pieces[{i}]: {t.dtype} on {t.device} is not read by the CPU kernel")
    return digest_rows(pieces, bases, gstrides, sketch_k)


@digest_batch.register_fake
def _digest_batch_fake(pieces, bases, gstrides, sketch_k):
    n = len(pieces)
    device = pieces[0].device if pieces else torch.device("cpu")
    return (torch.empty((n, N_MOMENTS + sketch_k), dtype=torch.float64, device=device),
            torch.empty((n, 6), dtype=torch.int64, device=device))


def digest_piece_fused(
    t: torch.Tensor, layout: PieceLayout, *, sketch_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as agents.digest.digest.digest_piece, through the op:
    ``(f64 [5 + k], i64 [6])``.

    ``layout`` is the piece's layout (its complex layout for complex ``t``, as digest_piece
    accepts; the real view's layout is accepted too).
    """
    from numaudit.agents.layout import complex_real_layout

    t = t.detach()
    if t.is_complex():
        if len(layout.shape) == t.dim():
            layout = complex_real_layout(layout)
        t = torch.view_as_real(t)
    base, gs = index_map(tuple(t.shape), layout)
    f64, i64 = torch.ops.numaudit.digest_batch([t], [base], list(gs), sketch_k)
    return f64[0], i64[0]

