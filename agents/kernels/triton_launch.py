"""Launching the Triton digest's kernels cheaply, and the device buffers they write.

Triton's own launcher (``kernel[grid](...)``) works out each argument's specialization and the
cache key in Python on every call: ~166 us a launch on an H200's host (FIELD-NOTES), more than
the digest of most captures. So each kernel variant (one combination of constexprs on one
device) is launched through Triton once, which compiles it, and afterwards through the compiled
kernel's own launcher with raw addresses: one C call. That is sound because the kernels'
runtime arguments are neither specialized on their values nor on a pointer's alignment
(agents/kernels/triton_kernels.py) and their integers are typed int64 by annotation, so one
compiled kernel serves every launch of its variant. Under Triton's CPU interpreter every
launch goes through Triton (there is no compiled kernel).

The partials of a launch's tiles live in a :class:`Workspace` per device and stream, reused from
launch to launch (kernels of one stream run in order), and output rows in :class:`RowArena` s,
so a capture allocates nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton

from numaudit.agents.config import ENV_TRITON_FAST_LAUNCH
from numaudit.agents.digest.digest import N_MOMENTS

_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
ALL_ARGS = _VERSION >= (3, 3)
"""Since Triton 3.3 a compiled kernel's launcher takes every argument, constexprs included (it
skips them); before, only the runtime ones."""

FAST_LAUNCH = os.environ.get(ENV_TRITON_FAST_LAUNCH, "1") != "0"
"""``NUMAUDIT_TRITON_FAST_LAUNCH=0`` launches every time through Triton's JIT (to compare)."""


def _interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def _all_int64(compiled, names: tuple[str, ...]) -> bool:
    """Whether the compiled kernel typed every one of ``names`` int64 (its annotation): a
    Triton that typed one by the first call's value (int32 for a small one) would truncate a
    later, larger one passed through the handle, so such a kernel keeps Triton's launcher."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    return isinstance(signature, dict) and all(signature.get(n) == "i64" for n in names)


class Launcher:
    """One kernel at one constexpr combination on one device."""

    __slots__ = ("kernel", "constexprs", "extra", "num_warps", "ints", "_run")

    def __init__(self, kernel, constexprs: dict, num_warps: int,
                 ints: tuple[str, ...] = ()) -> None:
        self.kernel = kernel
        self.constexprs = constexprs
        self.extra = tuple(constexprs.values()) if ALL_ARGS else ()
        self.num_warps = num_warps
        self.ints = ints
        """The kernel's integer arguments, which must be compiled as int64 (_all_int64)."""
        self._run: Callable | None = None

    def __call__(self, grid: tuple[int, int], stream: int, fast: tuple,
                 slow: Callable[[], tuple]) -> None:
        """Launch on ``grid``: ``fast`` holds the runtime arguments with pointers as addresses,
        ``slow()`` the same with tensors (for Triton's own launcher, which needs their dtypes,
        and for the interpreter, which reads them)."""
        run = self._run
        if run is not None:
            run(grid[0], grid[1], 1, stream, *fast, *self.extra)
            return
        compiled = self.kernel[grid](*slow(), **self.constexprs, num_warps=self.num_warps)
        if (FAST_LAUNCH and not _interpreted(self.kernel) and hasattr(compiled, "packed_metadata")
                and _all_int64(compiled, self.ints)):
            launch, function, meta = compiled.run, compiled.function, compiled.packed_metadata

            def run(g0, g1, g2, stream, *args):
                launch(g0, g1, g2, stream, function, meta, None, None, None, *args)

            self._run = run


class Launchers:
    """The launchers of one device, by kernel and constexprs."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, Launcher] = {}

    def get(self, kernel, constexprs: dict, num_warps: int,
            ints: tuple[str, ...] = ()) -> Launcher:
        key = (id(kernel), *constexprs.values())
        hit = self._by_key.get(key)
        if hit is None:
            hit = self._by_key[key] = Launcher(kernel, constexprs, num_warps, ints)
        return hit


class Workspace:
    """Tile partials of one device and stream: ``part_i64 [tiles, 5]``, ``part_f64 [tiles, 4]``
    and ``part_sk`` (tiles x k float64), grown when a launch needs more."""

    __slots__ = ("device", "tiles", "sk", "part_i64", "part_f64", "part_sk", "ptrs")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tiles = self.sk = 0
        self.part_i64: torch.Tensor | None = None
        self.part_f64: torch.Tensor | None = None
        self.part_sk: torch.Tensor | None = None
        self.ptrs = (0, 0, 0)

    def ensure(self, tiles: int, k: int) -> None:
        """Room for ``tiles`` tiles of a k-bucket sketch. The old buffers are freed to the
        caching allocator, which hands them out again only to work queued after this on the
        same stream, the one every launch using them is queued on."""
        tiles = max(tiles, 1)
        if tiles > self.tiles:
            self.tiles = max(tiles, 2 * self.tiles, 64)
            self.part_i64 = torch.empty((self.tiles, 5), dtype=torch.int64, device=self.device)
            self.part_f64 = torch.empty((self.tiles, 4), dtype=torch.float64, device=self.device)
        if tiles * k > self.sk:
            self.sk = max(tiles * k, 2 * self.sk, 64 * 256)
            self.part_sk = torch.empty(self.sk, dtype=torch.float64, device=self.device)
        part_i64, part_f64, part_sk = self.part_i64, self.part_f64, self.part_sk
        # made above: tiles >= 1 and k >= 1 (check_k)
        assert part_i64 is not None and part_f64 is not None and part_sk is not None
        self.ptrs = (part_i64.data_ptr(), part_f64.data_ptr(), part_sk.data_ptr())


ARENA_ROWS = 1024
"""Output rows per arena."""


class RowArena:
    """Device rows the finish kernel writes (``f64 [rows, 5 + k]``, ``i64 [rows, 6]``), handed
    out a list at a time; a full arena is replaced, the old one kept alive by the row views the
    batcher holds until its host transfer."""

    __slots__ = ("device", "k", "f64", "i64", "used", "capacity", "ptrs")

    def __init__(self, device: torch.device, k: int) -> None:
        self.device = device
        self.k = k
        self.used = self.capacity = 0
        self.f64: torch.Tensor | None = None
        self.i64: torch.Tensor | None = None
        self.ptrs = (0, 0)

    def take(self, m: int) -> int:
        """The first of ``m`` consecutive free rows (in ``f64`` and ``i64``)."""
        if self.used + m > self.capacity:
            rows = self.capacity = max(m, ARENA_ROWS)
            self.f64 = f64 = torch.empty((rows, N_MOMENTS + self.k), dtype=torch.float64,
                                         device=self.device)
            self.i64 = i64 = torch.empty((rows, 6), dtype=torch.int64, device=self.device)
            self.ptrs = (f64.data_ptr(), i64.data_ptr())
            self.used = 0
        first = self.used
        self.used += m
        return first


def current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None
                                              else torch.cuda.current_device())
