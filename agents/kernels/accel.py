"""The Triton digest for accelerator pieces, used only where it agrees with the eager reference.

`agents.kernels.digest_triton` digests a list of pieces in a few launches, without a host
synchronization. It has been checked against the eager reference under Triton's CPU interpreter
only, so the agent does not take it on trust: the first piece of each (device, dtype, sketch
buckets) triggers a self-check that digests a few test pieces both ways on that device (one
whole tensor for the kernel's aligned path, a shard starting mid-block and a transposed piece for
its general path, in one call as the agent makes them, with NaN, infinities and signed zeros for
float dtypes). Only if fingerprints, counts and min/max/abs-max are bitwise equal and sums and
sketches equal within float64 rounding is Triton used for that combination; otherwise, or when
Triton is missing or fails to compile, the agent warns once and those pieces keep the eager
path. Digests therefore never depend on which implementation ran.

The check compiles the kernel for that combination (seconds, once per process), in the step of
the first such capture.
"""

from __future__ import annotations

import logging

import torch

from agents.digest import N_MOMENTS, digest_piece
from agents.layout import PieceLayout

log = logging.getLogger(__name__)

Rows = tuple[torch.Tensor, torch.Tensor]


def _load():
    """The Triton digest module (``prepare``, ``digest_prepared``), or why it cannot be used."""
    try:
        from agents.kernels import digest_triton
    except Exception as exc:  # ImportError without triton; anything triton raises on import
        return f"{type(exc).__name__}: {exc}"
    return digest_triton


def _test_pieces(device: torch.device, dtype: torch.dtype) -> list[tuple[torch.Tensor,
                                                                          PieceLayout]]:
    """Pieces exercising both of the kernel's index paths, with special values for floats."""
    g = torch.Generator().manual_seed(20261201)
    shape = (6, 700)
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
    rows = full[1:4]  # a shard of dim 0: consecutive indices starting mid-block
    cols = full[:, 100:400].t()  # strided, and not one run of consecutive indices
    return [
        (full, PieceLayout.full(shape)),
        (rows, PieceLayout(shape, (1, 0), (3, 700))),
        (cols, PieceLayout((700, 6), (100, 0), (300, 6))),
    ]


def _agree(a: Rows, b: Rows) -> bool:
    (fa, ia), (fb, ib) = a, b
    if not torch.equal(ia.cpu(), ib.cpu()):
        return False
    fa, fb = fa.cpu(), fb.cpu()
    exact = torch.equal(torch.nan_to_num(fa[2:N_MOMENTS]), torch.nan_to_num(fb[2:N_MOMENTS]))
    sums = torch.allclose(fa[:2], fb[:2], rtol=1e-12, atol=1e-9, equal_nan=True)
    scale = float(fb[N_MOMENTS:].abs().max()) if fb.numel() > N_MOMENTS else 0.0
    sketch = torch.allclose(fa[N_MOMENTS:], fb[N_MOMENTS:], rtol=1e-12,
                            atol=1e-12 * max(scale, 1.0))
    return exact and sums and sketch


class TritonDigest:
    """Routes pieces on `device_types` to the Triton digest where it passed its self-check."""

    def __init__(self, device_types: tuple[str, ...] = ("cuda",)) -> None:
        self.device_types = device_types
        self._impl = None
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
                prepared = self._impl.prepare(t, layout)
            except ValueError:  # a dtype or a shape the kernel does not take: eager, as documented
                continue
            except Exception as exc:
                self._distrust([(t.device, t.dtype)], sketch_k, exc)
                continue
            by_device.setdefault(t.device, []).append((i, prepared))
        for device, items in by_device.items():
            try:
                f64, i64 = self._impl.digest_prepared([p for _, p in items], sketch_k=sketch_k)
            except Exception as exc:
                self._distrust([(device, pieces[i][0].dtype) for i, _ in items], sketch_k, exc)
                continue
            for j, (i, _) in enumerate(items):
                out[i] = (f64[j], i64[j])
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
            f64, i64 = self._impl.digest_prepared(
                [self._impl.prepare(p, layout) for p, layout in pieces], sketch_k=sketch_k)
            for j, (piece, layout) in enumerate(pieces):
                want = digest_piece(piece, layout, sketch_k=sketch_k)
                if not _agree((f64[j], i64[j]), want):
                    self._warn(f"the Triton digest disagrees with the eager reference on "
                               f"{device} {dtype} (k={sketch_k})")
                    return False
        except ValueError:
            return False  # a dtype the kernel does not read: eager, silently
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
