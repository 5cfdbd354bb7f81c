"""The Triton digest for accelerator pieces, used only where it keeps the digest's contract.

`agents.kernels.digest_triton` digests a list of pieces in a few launches, without a host
synchronization. The agent does not take it on trust: the first piece of each (device, dtype,
sketch buckets) triggers a self-check that digests a few test pieces both ways on that device
(one whole tensor and a shard starting mid-block, one line each, and a transposed piece of
many lines, with NaN, infinities and signed zeros for float dtypes; for float32 and bfloat16
also a piece whose tile takes the float64 pass; as one list, as the agent makes them, and each
alone), each twice. Triton is used for that combination only if every
row keeps the contract (docs/digests.md "On an accelerator"): fingerprints, counts and
min/max/abs-max bitwise equal to the eager reference's; sums, sums of squares and sketch
buckets within ``F32_TILE_ERROR`` of the sum of their terms' magnitudes (float32 accumulation
within a tile, :func:`within_contract`); and the second run's rows the same bits as the first's.
Otherwise, or when Triton is missing or fails to compile, the agent warns once and those pieces
keep the eager path. The second run also goes through the compiled kernels' own launchers
(agents/kernels/triton_launch.py), which the agent uses from then on.

The check compiles the kernels for that combination (seconds, once per process), in the step of
the first such capture.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from numaudit.agents.digest import hashing
from numaudit.agents.digest.digest import N_MOMENTS, digest_piece
from numaudit.agents.kernels.cpu import index_map
from numaudit.agents.kernels.triton_plan import F32_TILE_ERROR
from numaudit.agents.layout import PieceLayout, complex_real_layout

log = logging.getLogger(__name__)

Rows = tuple[torch.Tensor, torch.Tensor]


def _load():
    """The Triton digest module (``prepare``, ``digest_prepared``, ``digest_rows``), or why it
    cannot be used."""
    try:
        from numaudit.agents.kernels import digest_triton
    except Exception as exc:  # ImportError without triton; anything triton raises on import
        return f"{type(exc).__name__}: {exc}"
    return digest_triton


def _test_pieces(device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor,
                                                                          PieceLayout]]:
    """Pieces exercising the kernels' launch kinds and index paths, with special values for
    floats, and for bfloat16 and float32 one whose magnitudes send its tile to the float64
    pass (float32 could neither hold its squares nor keep its small elements)."""
    g = torch.Generator().manual_seed(20261201)
    shape = (4, 300)
    if dtype.is_floating_point:
        base = torch.randn(shape, generator=g, dtype=torch.float64) * 3
        flat = base.view(-1)
        flat[5], flat[300], flat[301], flat[1000] = float("nan"), float("inf"), -float("inf"), 0.0
        flat[1001] = -0.0
        full = base.to(dtype)
    elif dtype == torch.bool:
        full = torch.rand(shape, generator=g) > 0.5
    else:
        full = torch.randint(-100, 100, shape, generator=g).to(dtype)
    full = full.to(device)
    rows = full[1:3]  # a shard of dim 0: consecutive indices starting mid-block
    cols = full[:, 100:116].t()  # strided, and not one run of consecutive indices
    pieces = [
        (full, PieceLayout.full(shape)),
        (rows, PieceLayout(shape, (1, 0), (2, 300))),
        (cols, PieceLayout((300, 4), (100, 0), (16, 4))),
    ]
    if dtype in (torch.float32, torch.bfloat16):
        scale = torch.tensor([[2.0 ** 60], [2.0 ** -60]], dtype=torch.float64)
        extremes = (torch.randn((2, 300), generator=g, dtype=torch.float64) * scale).to(dtype)
        pieces.append((extremes.to(device), PieceLayout.full((2, 300))))
    return pieces


SUBNORMAL = 2.0 ** -126
"""Absolute error a float32 accumulation may add per term (a subnormal flushed to zero)."""


def term_magnitudes(t: torch.Tensor, layout: PieceLayout,
                    sketch_k: int) -> tuple[float, float, torch.Tensor, torch.Tensor] | None:
    """What the contract's float bounds scale with, for float piece ``t`` (None otherwise):
    ``(sum |x|, sum x**2, per bucket sum |x|, per bucket term count)`` over its finite elements,
    each element in its sketch bucket (agents/digest/hashing.py ``bucket_sign``, its definition: one
    Python call per element, for the small pieces of a check)."""
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return None
    t = t.detach().cpu()
    if t.dtype.is_complex:
        if len(layout.shape) == t.dim():
            layout = complex_real_layout(layout)
        t = torch.view_as_real(t)
    x = t.reshape(-1).to(torch.float64)
    x = torch.where(torch.isfinite(x), x, 0.0)
    base, gs = index_map(tuple(t.shape), layout)
    index = torch.zeros((), dtype=torch.int64) + base
    for d, (size, g) in enumerate(zip(t.shape, gs)):
        shape = [1] * t.dim()
        shape[d] = size
        index = index + torch.arange(size, dtype=torch.int64).reshape(shape) * g
    buckets = torch.tensor([hashing.bucket_sign(i, sketch_k)[0]
                            for i in index.reshape(-1).tolist()], dtype=torch.int64)
    per_bucket = torch.zeros(sketch_k, dtype=torch.float64).index_add_(0, buckets, x.abs())
    counts = torch.bincount(buckets, minlength=sketch_k).to(torch.float64)
    return x.abs().sum().item(), (x * x).sum().item(), per_bucket, counts


def within_contract(got: Rows, want: Rows, magnitudes) -> bool:
    """Rows ``got`` keep the contract against the eager reference's ``want``: i64 row and
    min/max/abs-max equal; sum, sum of squares and each sketch bucket within
    ``F32_TILE_ERROR`` of their terms' magnitudes plus ``SUBNORMAL`` per term
    (``magnitudes``: :func:`term_magnitudes` of the piece; None for integers, whose f64 row
    must be equal)."""
    (fa, ia), (fb, ib) = (r.cpu() for r in got), (r.cpu() for r in want)
    if not torch.equal(ia, ib):
        return False
    if magnitudes is None:
        return torch.equal(fa, fb)
    if not torch.equal(fa[2:N_MOMENTS], fb[2:N_MOMENTS]):
        return False
    total, squares, per_bucket, counts = magnitudes
    n = float(counts.sum())
    if abs(float(fa[0] - fb[0])) > F32_TILE_ERROR * total + SUBNORMAL * n:
        return False
    if abs(float(fa[1] - fb[1])) > F32_TILE_ERROR * squares + SUBNORMAL * n:
        return False
    bound = F32_TILE_ERROR * per_bucket + SUBNORMAL * counts
    return bool(((fa[N_MOMENTS:] - fb[N_MOMENTS:]).abs() <= bound).all())


class TritonDigest:
    """Routes pieces on `device_types` to the Triton digest where it passed its self-check."""

    def __init__(self, device_types: tuple[str, ...] = ("cuda",)) -> None:
        self.device_types = device_types
        self._impl: ModuleType | None = None
        """The Triton digest module, loaded by the first `trusts` that needs it."""
        self._unavailable: str | None = None
        self._trusted: dict[tuple[str, torch.dtype, int], bool] = {}
        self._warned = False

    def trusts(self, device: torch.device, dtype: torch.dtype, sketch_k: int) -> bool:
        """Whether Triton is used for pieces of this device, dtype and k: it is installed and
        its self-check there passed (run on the first ask, then remembered)."""
        if device.type not in self.device_types or self._unavailable is not None:
            return False
        if self._impl is None:
            impl = _load()
            if isinstance(impl, str):
                self._unavailable = impl
                log.info("numaudit: Triton digest unavailable (%s); accelerator pieces use the "
                         "eager digest", impl)
                return False
            self._impl = impl
        key = (str(device), dtype, sketch_k)
        trusted = self._trusted.get(key)
        if trusted is None:
            trusted = self._trusted[key] = self._check(device, dtype, sketch_k)
        return trusted

    def digest_many(self, pieces: list[tuple[torch.Tensor, PieceLayout]],
                    sketch_k: int) -> list[Rows | None]:
        """Per piece its rows from Triton (views of one block per device), or None: the caller
        takes the eager path for it. The pieces Triton takes are digested in one call per
        device. Never raises: a failing call distrusts its (device, dtype, k) combinations,
        with one warning, and leaves its pieces to the caller."""
        out: list[Rows | None] = [None] * len(pieces)
        by_device: dict[torch.device, list[tuple[int, object]]] = {}
        for i, (t, layout) in enumerate(pieces):
            try:
                if not self.trusts(t.device, t.dtype, sketch_k):
                    continue
                impl = self._impl
                if impl is None:  # trusts has loaded it
                    continue
                prepared = impl.prepare(t, layout)
            except ValueError:  # a dtype or a shape the kernel does not take: eager, as documented
                continue
            except Exception as exc:
                self._distrust([(t.device, t.dtype)], sketch_k, exc)
                continue
            by_device.setdefault(t.device, []).append((i, prepared))
        impl = self._impl
        if impl is None:  # then nothing was prepared
            return out
        for device, items in by_device.items():
            try:
                rows = impl.digest_rows([p for _, p in items], sketch_k=sketch_k)
            except Exception as exc:
                self._distrust([(device, pieces[i][0].dtype) for i, _ in items], sketch_k, exc)
                continue
            for (i, _), got in zip(items, rows):
                out[i] = got
        return out

    def _distrust(self, combos: list[tuple[torch.device, torch.dtype]], sketch_k: int,
                  exc: Exception) -> None:
        names = sorted({f"{d} {t}" for d, t in combos})
        for device, dtype in combos:
            self._trusted[(str(device), dtype, sketch_k)] = False
        self._warn(f"the Triton digest failed on {', '.join(names)} ({type(exc).__name__}: "
                   f"{exc})")

    def _check(self, device: torch.device, dtype: torch.dtype, sketch_k: int) -> bool:
        try:
            pieces = _test_pieces(device, dtype)
            wants = [(digest_piece(p, layout, sketch_k=sketch_k),
                      term_magnitudes(p, layout, sketch_k)) for p, layout in pieces]
            impl = self._impl
            if impl is None:  # trusts loads it before it checks
                return False
            # as one list, and each alone (the other launch kind)
            runs = [list(range(len(pieces)))] + [[j] for j in range(len(pieces))]
            first = None
            for _attempt in range(2):  # the second launches through the compiled kernels
                got = []
                for run in runs:
                    f64, i64 = impl.digest_prepared([impl.prepare(*pieces[j]) for j in run],
                                                    sketch_k=sketch_k)
                    got += [(f64[i].cpu(), i64[i].cpu(), j) for i, j in enumerate(run)]
                for f64, i64, j in got:
                    want, magnitudes = wants[j]
                    if not within_contract((f64, i64), want, magnitudes):
                        self._warn(f"the Triton digest disagrees with the eager reference on "
                                   f"{device} {dtype} (k={sketch_k})")
                        return False
                if first is not None and not all(
                        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                        for a, b in zip(first, got)):
                    self._warn(f"the Triton digest is not deterministic on {device} {dtype} "
                               f"(k={sketch_k})")
                    return False
                first = got
        except ValueError:
            return False  # a dtype or a k the kernel does not take: eager, silently
        except Exception as exc:
            self._warn(f"the Triton digest's self-check failed on {device} {dtype} "
                       f"({type(exc).__name__}: {exc})")
            return False
        return True

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("numaudit: %s; those pieces use the eager digest (same digests, slower)",
                        what)
