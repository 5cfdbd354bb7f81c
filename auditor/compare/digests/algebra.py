"""Host-side digest algebra: merge pieces, estimate distances from sketches (docs/digests.md).

The auditor rebuilds a logical tensor's digest from the pieces ranks sent: disjoint pieces (a
tiling) merge exactly (:func:`merge_disjoint`); Partial addends merge only in their sum and
sketch (:func:`merge_partial`). Two runs' logical tensors are then compared through their
fingerprints (bitwise equality) and sketches (L2 distance, relative error, cosine, each with a
1-sigma band).

numpy only, no torch: the daemon must start fast. The hash scheme's seeds and key constants
are the agent's own (`numaudit.wire.hashing`, imported by both sides); the row layout mirrors
``agents/digest/digest.py`` (a test keeps them equal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from numaudit.wire.hashing import FINGERPRINT_SEED, SKETCH_SEED
from numaudit.wire.hashing import H_BASE as FINGERPRINT_H
from numaudit.wire.hashing import U_SCALE as FINGERPRINT_U

N_MOMENTS = 5
"""Leading moments in an f64 row: sum, sum_sq, min, max, abs_max; the sketch follows."""

_U64 = 1 << 64
_MASK64 = _U64 - 1


MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
"""Where a float's exponent field starts: multiplying a normal number by 2**e adds e to it."""


def key_sum(n: int) -> int:
    """``sum_{i < n} u h**i mod 2**64``: the version-3 keys of a whole logical tensor of n
    elements (doubling: S(2m) = S(m)(1 + h**m), S(2m + 1) = 1 + h S(2m))."""
    power, total = 1, 0
    for bit in bin(n)[2:] if n > 0 else "":
        total = total * (1 + power) & _MASK64
        power = power * power & _MASK64
        if bit == "1":
            total = (1 + FINGERPRINT_H * total) & _MASK64
            power = power * FINGERPRINT_H & _MASK64
    return FINGERPRINT_U * total & _MASK64


def scaled_fingerprint(fp: int, numel: int, dtype: str, exponent: int) -> int | None:
    """The version-3 fingerprint of a whole float32/bfloat16/float16 logical tensor of
    ``numel`` elements, fingerprint ``fp``, multiplied by ``2**exponent`` — valid when every
    element is normal and stays so (then its bits grow by ``exponent << mantissa bits``);
    None for other dtypes. A zero, subnormal, overflowing or non-finite element breaks the
    prediction, so a match can only be a false *difference*, never a false equality."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None:
        return None
    return (fp + ((exponent << bits) & _MASK64) * key_sum(numel)) & _MASK64


def shift_fingerprint(fp: int, delta: int) -> int:
    """A version-3 fingerprint (uint64) of a piece moved by ``delta`` global flat indices."""
    return fp * pow(FINGERPRINT_H, delta, _U64) & _MASK64


def fingerprint_to_int64(u: int) -> int:
    """A uint64 fingerprint as the signed int64 with the same bits (SQLite INTEGER is int64)."""
    if not 0 <= u < _U64:
        raise ValueError(f"fingerprint: {u} is not a uint64")
    return u - _U64 if u >= 1 << 63 else u


def fingerprint_from_int64(i: int) -> int:
    """The uint64 fingerprint stored as a signed int64."""
    if not -(1 << 63) <= i < 1 << 63:
        raise ValueError(f"fingerprint: {i} is not an int64")
    return i & _MASK64


@dataclass
class DigestValues:
    """Host-side mirror of ``numaudit.v1.Digest``, plus whether it is exact.

    Moments cover finite elements only. Without moments (integer and bool tensors) the float
    fields hold the merge identity (sum 0, min +inf, max -inf, abs_max 0) and ``sketch`` is empty.
    """

    numel: int
    nan: int
    posinf: int
    neginf: int
    zeros: int
    has_moments: bool
    sum: float
    sum_sq: float
    min: float
    max: float
    abs_max: float
    fingerprint: int
    """uint64 in [0, 2**64)."""
    sketch: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """float64 [k] CountSketch; empty without moments."""
    exact: bool = True
    """False after merge_partial: fingerprint, min/max/abs_max, sum_sq and zeros are unknown."""
    fingerprint_seed: int = FINGERPRINT_SEED
    sketch_seed: int = SKETCH_SEED

    @property
    def nonfinite(self) -> int:
        """NaN + Inf elements."""
        return self.nan + self.posinf + self.neginf

    @property
    def sketch_k(self) -> int:
        return int(self.sketch.shape[0])

    @classmethod
    def empty(cls, has_moments: bool, sketch_k: int) -> DigestValues:
        """The digest of no elements: the identity of merge_disjoint."""
        return cls(
            numel=0, nan=0, posinf=0, neginf=0, zeros=0, has_moments=has_moments,
            sum=0.0, sum_sq=0.0, min=math.inf, max=-math.inf, abs_max=0.0, fingerprint=0,
            sketch=np.zeros(sketch_k if has_moments else 0),
        )

    @classmethod
    def from_rows(
        cls, f64_row: Sequence[float], i64_row: Sequence[int], has_moments: bool
    ) -> DigestValues:
        """From one row of each of the agent's digest tensors
        (agents.digest.digest.digest_piece)."""
        f = np.asarray(f64_row, dtype=np.float64)
        i = [int(v) for v in i64_row]
        if f.ndim != 1 or f.shape[0] < N_MOMENTS:
            raise ValueError(f"f64_row: shape {f.shape}, want [{N_MOMENTS} + k]")
        if len(i) != 6:
            raise ValueError(f"i64_row: {len(i)} values, want 6")
        if has_moments:
            s, ss, lo, hi, amax = (float(v) for v in f[:N_MOMENTS])
            sketch = f[N_MOMENTS:].copy()
        else:
            s, ss, lo, hi, amax = 0.0, 0.0, math.inf, -math.inf, 0.0
            sketch = np.zeros(0)
        return cls(
            numel=i[0], nan=i[1], posinf=i[2], neginf=i[3], zeros=i[4],
            has_moments=has_moments, sum=s, sum_sq=ss, min=lo, max=hi, abs_max=amax,
            fingerprint=fingerprint_from_int64(i[5]), sketch=sketch,
        )

    @classmethod
    def from_proto(cls, pb: Any) -> DigestValues:
        """From a ``numaudit.v1.Digest`` message."""
        d = cls.from_rows(
            [pb.sum, pb.sum_sq, pb.min, pb.max, pb.abs_max, *pb.sketch],
            [pb.numel, pb.nan_count, pb.posinf_count, pb.neginf_count, pb.zero_count, 0],
            pb.has_moments,
        )
        d.fingerprint = int(pb.fingerprint)
        d.fingerprint_seed = int(pb.fingerprint_seed)
        d.sketch_seed = int(pb.sketch_seed)
        return d

    def to_proto(self, pb: Any) -> Any:
        """Fill a ``numaudit.v1.Digest`` message; float fields stay unset without moments."""
        pb.numel = self.numel
        pb.nan_count = self.nan
        pb.posinf_count = self.posinf
        pb.neginf_count = self.neginf
        pb.zero_count = self.zeros
        pb.has_moments = self.has_moments
        if self.has_moments:
            pb.sum = self.sum
            pb.sum_sq = self.sum_sq
            pb.min = self.min
            pb.max = self.max
            pb.abs_max = self.abs_max
            pb.sketch[:] = self.sketch.tolist()
        pb.fingerprint = self.fingerprint
        pb.fingerprint_seed = self.fingerprint_seed
        pb.sketch_seed = self.sketch_seed
        return pb


def _check_compatible(pieces: Sequence[DigestValues], what: str) -> None:
    if not pieces:
        raise ValueError(f"{what}: no pieces")
    first = pieces[0]
    for p in pieces[1:]:
        if p.has_moments != first.has_moments:
            raise ValueError(f"{what}: has_moments differs between pieces")
        if p.sketch_k != first.sketch_k:
            raise ValueError(f"{what}: sketch lengths differ ({p.sketch_k} != {first.sketch_k})")
        if (p.fingerprint_seed, p.sketch_seed) != (first.fingerprint_seed, first.sketch_seed):
            raise ValueError(f"{what}: pieces were digested with different seeds")


def merge_disjoint(pieces: Sequence[DigestValues]) -> DigestValues:
    """Digest of the region that disjoint ``pieces`` tile (shards of one logical tensor).

    Counts, sums and sketches add; min/max combine; fingerprints add mod 2**64. Checking that the
    pieces really tile the region is the caller's job (it has the layouts).
    """
    _check_compatible(pieces, "merge_disjoint")
    first = pieces[0]
    return DigestValues(
        numel=sum(p.numel for p in pieces),
        nan=sum(p.nan for p in pieces),
        posinf=sum(p.posinf for p in pieces),
        neginf=sum(p.neginf for p in pieces),
        zeros=sum(p.zeros for p in pieces),
        has_moments=first.has_moments,
        sum=math.fsum(p.sum for p in pieces),
        sum_sq=math.fsum(p.sum_sq for p in pieces),
        min=min(p.min for p in pieces),
        max=max(p.max for p in pieces),
        abs_max=max(p.abs_max for p in pieces),
        fingerprint=sum(p.fingerprint for p in pieces) & _MASK64,
        sketch=np.sum([p.sketch for p in pieces], axis=0),
        exact=all(p.exact for p in pieces),
        fingerprint_seed=first.fingerprint_seed,
        sketch_seed=first.sketch_seed,
    )


def merge_partial(addends: Sequence[DigestValues]) -> DigestValues:
    """Digest of the elementwise sum of Partial ``addends`` of one region, as far as derivable.

    Exact: numel (of the region), sum and sketch (both linear in the values, finite elements
    only). Unknowable from the addends' digests: fingerprint (0), min/max/abs_max and sum_sq
    (NaN), zeros (-1); ``exact`` is False so nobody compares them. nan/posinf/neginf are sums over
    addends: their total is nonzero exactly when some element of the sum is non-finite (a
    non-finite addend makes the sum non-finite; the kind may change, inf + -inf is NaN).
    """
    _check_compatible(addends, "merge_partial")
    first = addends[0]
    if any(a.numel != first.numel for a in addends):
        raise ValueError("merge_partial: addends of one region must have equal numel")
    if len(addends) == 1:
        return replace(first, sketch=first.sketch.copy())
    unknown = math.nan if first.has_moments else 0.0
    return DigestValues(
        numel=first.numel,
        nan=sum(a.nan for a in addends),
        posinf=sum(a.posinf for a in addends),
        neginf=sum(a.neginf for a in addends),
        zeros=-1,
        has_moments=first.has_moments,
        sum=math.fsum(a.sum for a in addends),
        sum_sq=unknown,
        min=unknown if first.has_moments else math.inf,
        max=unknown if first.has_moments else -math.inf,
        abs_max=unknown,
        fingerprint=0,
        sketch=np.sum([a.sketch for a in addends], axis=0),
        exact=False,
        fingerprint_seed=first.fingerprint_seed,
        sketch_seed=first.sketch_seed,
    )


def _sketches(a: DigestValues, b: DigestValues) -> tuple[np.ndarray, np.ndarray]:
    if not (a.has_moments and b.has_moments):
        raise ValueError("sketch: integer/bool digests have no sketch")
    if a.sketch_k != b.sketch_k or a.sketch_seed != b.sketch_seed:
        raise ValueError(
            f"sketch: incompatible sketches (k {a.sketch_k} vs {b.sketch_k}, "
            f"seed {a.sketch_seed:#x} vs {b.sketch_seed:#x})"
        )
    return a.sketch, b.sketch


def sketch_l2_estimate(a: DigestValues, b: DigestValues) -> tuple[float, float]:
    """Estimate ``||a - b||_2`` over finite elements and its 1-sigma uncertainty.

    ``||S(a - b)||^2`` is unbiased for ``||a - b||^2`` with variance at most
    ``2 ||a - b||^4 / k``, so the norm's relative sigma is about ``1 / sqrt(2k)``. The band holds
    for differences spread over many elements; a difference confined to a handful of elements
    can collide in one bucket and be badly under- or over-estimated (docs/digests.md).
    """
    from numaudit.auditor.compare.digests.metrics import (
        sketch_band,  # the one definition of the band
    )
    sa, sb = _sketches(a, b)
    est = float(np.sqrt(np.sum((sa - sb) ** 2)))
    return est, est * float(sketch_band(sa.shape[0]))


def _band(k: int) -> float:
    from numaudit.auditor.compare.digests.metrics import sketch_band
    return float(sketch_band(k))


def sketch_rel_error(a_ref: DigestValues, b_cand: DigestValues) -> tuple[float, float]:
    """Estimate ``||cand - ref|| / ||ref||`` and its 1-sigma band; ``||ref||`` is exact.

    A zero reference gives ``(0, 0)`` when the candidate's sketch is zero too, else ``(inf, inf)``.
    """
    dist, sigma = sketch_l2_estimate(a_ref, b_cand)
    ref_norm = math.sqrt(max(a_ref.sum_sq, 0.0))
    if not math.isfinite(ref_norm):
        return math.nan, math.nan
    if ref_norm == 0.0:
        return (0.0, 0.0) if dist == 0.0 else (math.inf, math.inf)
    return dist / ref_norm, sigma / ref_norm


def sketch_cosine(a: DigestValues, b: DigestValues) -> tuple[float, float]:
    """Estimate the cosine similarity of ``a`` and ``b`` and its 1-sigma band.

    Uses the exact norms and the sketched distance: ``<a, b> = (|a|^2 + |b|^2 - |a - b|^2) / 2``.
    The error is then ``sigma(|a - b|^2) / (2 |a| |b|)``, small exactly when the tensors are
    close, which is when a cosine is read most closely. Clamped to [-1, 1]. Two all-zero
    tensors have cosine 1 (they are equal); a zero and a nonzero tensor have cosine 0.
    """
    dist, _ = sketch_l2_estimate(a, b)
    na2, nb2 = max(a.sum_sq, 0.0), max(b.sum_sq, 0.0)
    product = na2 * nb2  # one sqrt, so that identical tensors give exactly 1.0
    denom = 2.0 * (math.sqrt(product) if math.isfinite(product) else
                   math.sqrt(na2) * math.sqrt(nb2))
    if not math.isfinite(denom):
        return math.nan, math.nan
    if denom == 0.0:
        return (1.0, 0.0) if na2 == nb2 == 0.0 else (0.0, 0.0)
    d2 = dist * dist
    sigma = 2.0 * d2 * _band(a.sketch_k) / denom
    cos = (na2 + nb2 - d2) / denom
    return min(1.0, max(-1.0, cos)), sigma
