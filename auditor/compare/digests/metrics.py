"""Distances between a key's logical tensors in two runs (docs/comparison.md, "Metrics").

From digests, for many keys at once (numpy arrays, one entry per key):

- exact: fingerprint equality (bitwise equal logical tensors, whatever the sharding);
- relative L2 error and cosine distance estimated from the CountSketches. The sketch is linear,
  so ``S(cand) - S(ref) = S(cand - ref)`` and ``||S(cand - ref)||^2`` estimates
  ``||cand - ref||^2`` with a relative standard deviation of at most ``sqrt(2/k)``: the
  uncertainty scales with the difference itself, which is what lets a tiny difference be called
  tiny. A float64-rounding floor is added to the sigma (sketch buckets are sums in different
  orders when the runs shard differently);
- norm ratio and abs-max ratio from the moments (exact up to float64 rounding).

From payloads (the raw bytes, when both runs sent them), for one key at a time: max-abs,
max-relative and ULP distance, assert_close's elementwise test, and the exact relative L2 error.
Payloads are decompressed with bounded reads after their declared size was checked against
shape x dtype (FIELD-NOTES: zstd's max_output_size is not a bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from numaudit.wire import limits
from numaudit.wire.checksum import crc32

EPS64 = float(np.finfo(np.float64).eps)
ROUNDING_FLOOR = 4.0
"""Multiplier of the float64-rounding floor: eps64 * sqrt(numel / k + 1) * max norm."""
BAND_Z = 3.0
"""How far below the truth an estimate may fall when sigma is read off the estimate itself."""


def sketch_band(k: int | np.ndarray) -> np.ndarray | float:
    """Relative 1-sigma of the sketched distance ||S(d)|| read off its own estimate.

    A CountSketch with k buckets and random signs estimates ||d||^2 without bias with variance
    (2/k) (||d||^4 - sum d_i^4) <= (2/k) ||d||^4, so sigma(||S d||^2) <= sqrt(2/k) ||d||^2 and,
    to first order, sigma(||S d||) <= ||d|| / sqrt(2k). The band must be stated from the
    *estimate*, which is low exactly when the noise is unkind: the truth can be as large as
    est^2 / (1 - z sqrt(2/k)) (z = BAND_Z), so sigma is widened by that factor (2.1x at k = 64,
    1.36x at k = 256, 1.07x at k = 4096; at most 4x for tiny k). Relative errors of any size
    (1 and beyond) keep the band, since it is relative to the difference itself.
    """
    s = np.sqrt(2.0 / np.asarray(k, np.float64))
    return (s / 2.0) / np.maximum(1.0 - BAND_Z * s, 0.25)


# -- digest metrics (vectorized over keys) ---------------------------------------------------------

@dataclass
class SketchMetrics:
    """Per-key estimates; NaN where not computable."""

    dist: np.ndarray
    """||cand - ref|| estimate."""
    dist_sigma: np.ndarray
    rel_l2: np.ndarray
    rel_sigma: np.ndarray
    cos_dist: np.ndarray
    """1 - cosine similarity estimate."""
    cos_sigma: np.ndarray
    ref_norm: np.ndarray
    cand_norm: np.ndarray
    norm_from_sketch: np.ndarray
    """True where a norm had to be estimated from the sketch (Partial keys)."""


def sketch_metrics(s_ref: np.ndarray, s_cand: np.ndarray, ss_ref: np.ndarray,
                   ss_cand: np.ndarray, numel: np.ndarray) -> SketchMetrics:
    """Estimates from [n, k] sketches and the exact sums of squares (NaN when unknown)."""
    n, k = s_ref.shape
    diff = s_cand - s_ref
    d2 = np.einsum("ij,ij->i", diff, diff)
    dist = np.sqrt(d2)
    ss_ref = np.asarray(ss_ref, dtype=np.float64).copy()
    ss_cand = np.asarray(ss_cand, dtype=np.float64).copy()
    from_sketch = np.isnan(ss_ref) | np.isnan(ss_cand)
    if from_sketch.any():
        est_r = np.einsum("ij,ij->i", s_ref, s_ref)
        est_c = np.einsum("ij,ij->i", s_cand, s_cand)
        ss_ref = np.where(np.isnan(ss_ref), est_r, ss_ref)
        ss_cand = np.where(np.isnan(ss_cand), est_c, ss_cand)
    rn, cn = np.sqrt(np.maximum(ss_ref, 0)), np.sqrt(np.maximum(ss_cand, 0))
    rel_k = float(sketch_band(k))
    # A difference concentrated in a few elements fills few buckets; its error then comes from
    # rare collisions (a heavy tail the variance does not describe): widen by the occupancy
    tail = concentration_factor(diff, d2)
    floor = ROUNDING_FLOOR * EPS64 * np.sqrt(np.asarray(numel, np.float64) / k + 1.0) \
        * np.maximum(rn, cn)
    dist_sigma = dist * rel_k * tail + floor
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(rn > 0, dist / rn, np.where(dist > 0, np.inf, 0.0))
        rel_sigma = np.where(rn > 0, dist_sigma / rn, np.where(dist > 0, np.inf, 0.0))
        # a norm estimated from a sketch adds its own relative noise
        rel_sigma = np.where(from_sketch, np.hypot(rel_sigma, rel * rel_k), rel_sigma)
        denom = 2.0 * rn * cn
        cos = np.where(denom > 0, (d2 - (rn - cn) ** 2) / denom,
                       np.where((rn == 0) & (cn == 0), 0.0, 1.0))
        cos_sigma = np.where(denom > 0, (2.0 * dist * dist_sigma) / denom, 0.0)
    return SketchMetrics(dist=dist, dist_sigma=dist_sigma, rel_l2=rel, rel_sigma=rel_sigma,
                         cos_dist=np.clip(cos, 0.0, 2.0), cos_sigma=cos_sigma, ref_norm=rn,
                         cand_norm=cn, norm_from_sketch=from_sketch)


def concentration_factor(diff: np.ndarray, d2: np.ndarray) -> np.ndarray:
    """Widening of the band for differences that occupy few of the k buckets.

    m_eff = (sum b^2)^2 / sum b^4 over the buckets b of S(cand - ref) counts the buckets that
    carry the difference (about k/3 to k/6 for a difference spread over many elements). When it
    is far below k the estimate's error is that of a few possible collisions, each moving
    ||S d||^2 by about ||d||^2 / m_eff: the band becomes sqrt(k / (8 m_eff)) times wider
    (never narrower). Sparse differences are also bounded below by the extremes (slow.py).
    """
    k = diff.shape[1] if diff.ndim == 2 else 1
    with np.errstate(divide="ignore", invalid="ignore"):
        b4 = np.einsum("ij,ij->i", diff * diff, diff * diff)
        m_eff = np.where(b4 > 0, d2 * d2 / b4, k)
    return np.sqrt(np.maximum(1.0, k / (8.0 * np.maximum(m_eff, 1.0))))


def ratio(cand: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """cand / ref with 0/0 = 1 and x/0 = inf."""
    cand, ref = np.asarray(cand, np.float64), np.asarray(ref, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref != 0, cand / ref, np.where(cand == 0, 1.0, np.inf))


# -- payloads --------------------------------------------------------------------------------------

class PayloadUnavailable(Exception):
    """A payload that cannot be used for exact metrics (too large, corrupt, unsupported dtype)."""


ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
MACHINE_EPS = {
    "float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
    "float8_e4m3fn": 2.0 ** -3, "float8_e4m3fnuz": 2.0 ** -3, "float8_e5m2": 2.0 ** -2,
    "float8_e5m2fnuz": 2.0 ** -2, "float8_e8m0fnu": 1.0,
}
"""Machine epsilon per floating dtype: one rounding of a sum in that dtype."""
FLOAT_DTYPES = frozenset(d for d in ITEMSIZE if d.startswith("float") or d == "bfloat16")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _fp8_table(exp_bits: int, bias: int, kind: str) -> np.ndarray:
    """float64 value of each of the 256 codes of an 8-bit float."""
    man_bits = 7 - exp_bits
    out = np.empty(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b >> 7 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if e == 0:
            v = s * (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            v = s * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        if kind == "fn" and e == (1 << exp_bits) - 1 and m == (1 << man_bits) - 1:
            v = math.nan
        elif kind == "ieee" and e == (1 << exp_bits) - 1:
            v = s * math.inf if m == 0 else math.nan
        elif kind == "fnuz" and b == 0x80:
            v = math.nan
        out[b] = v
    return out


_FP8 = {
    "float8_e4m3fn": (4, 7, "fn"), "float8_e4m3fnuz": (4, 8, "fnuz"),
    "float8_e5m2": (5, 15, "ieee"), "float8_e5m2fnuz": (5, 16, "fnuz"),
}
_FP8_TABLES: dict[str, np.ndarray] = {}


def bits_to_values(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Raw element bits (unsigned ints of the dtype's size) → float64 values."""
    if dtype == "float64":
        return bits.view("<f8")
    if dtype == "float32":
        return bits.view("<f4").astype(np.float64)
    if dtype == "float16":
        return bits.view("<f2").astype(np.float64)
    if dtype == "bfloat16":
        return (bits.astype(np.uint32) << 16).view("<f4").astype(np.float64)
    if dtype in _FP8:
        table = _FP8_TABLES.get(dtype)
        if table is None:
            table = _FP8_TABLES[dtype] = _fp8_table(*_FP8[dtype])
        return table[bits]
    if dtype == "float8_e8m0fnu":
        v = np.exp2(bits.astype(np.float64) - 127.0)
        v[bits == 255] = np.nan
        return v
    if dtype == "bool":
        return (bits != 0).astype(np.float64)
    if dtype.startswith("int"):
        return bits.view(f"<i{ITEMSIZE[dtype]}").astype(np.float64)
    if dtype.startswith("uint"):
        return bits.astype(np.float64)
    raise PayloadUnavailable(f"dtype {dtype} has no payload decoding")


def decode_payload(header: dict, data: bytes, dtype: str, shape: Sequence[int], *,
                   max_bytes: int) -> np.ndarray:
    """A record's payload as raw element bits (unsigned ints) of ``shape``; bounded.

    Raises PayloadUnavailable naming the reason (size over ``max_bytes``, CRC, codec, size).
    """
    if dtype not in ITEMSIZE:
        raise PayloadUnavailable(f"dtype {dtype} has no payload decoding")
    itemsize = ITEMSIZE[dtype]
    want = math.prod(shape) * itemsize
    raw = int(header.get("raw_nbytes", -1))
    if raw != want:
        raise PayloadUnavailable(f"payload declares {raw} bytes, shape x dtype is {want}")
    if raw > max_bytes:
        raise PayloadUnavailable(f"payload of {raw} bytes exceeds payload_max_bytes {max_bytes}")
    if len(data) != header.get("compressed_nbytes", len(data)):
        raise PayloadUnavailable("payload stream length differs from its header")
    if crc32(data) != header.get("crc32", crc32(data)):
        raise PayloadUnavailable("payload CRC-32 mismatch")
    codec = header.get("codec")
    if codec == "raw":
        if len(data) != raw:
            raise PayloadUnavailable(f"raw payload of {len(data)} bytes, expected {raw}")
        buf = bytes(data)
    elif codec == "zstd":
        buf = _bounded_zstd(data, raw)
    else:
        raise PayloadUnavailable(f"codec {codec!r} is not supported")
    return np.frombuffer(buf, dtype=np.dtype(_UINT[itemsize]).newbyteorder("<")).astype(
        _UINT[itemsize], copy=False).reshape(tuple(shape))


def _bounded_zstd(data: bytes, raw: int) -> bytes:
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise PayloadUnavailable(f"not a zstd frame ({exc})") from None
    if params.content_size not in (raw, zstandard.CONTENTSIZE_UNKNOWN):
        raise PayloadUnavailable(f"zstd frame declares {params.content_size} bytes, expected {raw}")
    if params.window_size > limits.MAX_ZSTD_WINDOW_BYTES:
        raise PayloadUnavailable(f"zstd window of {params.window_size} bytes is over the limit")
    out = bytearray()
    dctx = zstandard.ZstdDecompressor(max_window_size=limits.MAX_ZSTD_WINDOW_BYTES)
    try:
        with dctx.stream_reader(data, read_size=1 << 16) as reader:
            while len(out) <= raw:
                block = reader.read(min(limits.DECOMPRESS_READ_BYTES, raw + 1 - len(out)))
                if not block:
                    break
                out += block
    except (zstandard.ZstdError, MemoryError) as exc:
        raise PayloadUnavailable(f"zstd decompression failed ({exc})") from None
    if len(out) != raw:
        raise PayloadUnavailable(f"zstd stream holds {len(out)} bytes, expected {raw}")
    return bytes(out)


def ordered_bits(bits: np.ndarray) -> np.ndarray:
    """Sign-magnitude float bits → integers that order like the floats (+0 == -0), as int64.

    For 64-bit floats the result is float64 (exact up to 2**53 ulps, enough to read a distance).
    """
    nbits = bits.dtype.itemsize * 8
    if nbits == 64:
        mag: np.ndarray = (bits & np.uint64((1 << 63) - 1)).astype(np.float64)
        return np.where(bits >> np.uint64(63) != 0, -mag, mag)
    b = bits.astype(np.int64)
    sign = b >> (nbits - 1)
    mag = b & ((1 << (nbits - 1)) - 1)
    return np.where(sign != 0, -mag, mag)


@dataclass
class PayloadMetrics:
    """Exact metrics of one key from both runs' bytes."""

    max_abs: float
    max_rel: float
    """Over elements whose reference is non-zero."""
    allclose: float
    """max |c - r| / (atol + rtol |r|): assert_close passes at <= 1 (finite elements)."""
    mismatched: int
    """Elements failing assert_close's test, non-finite disagreements included."""
    rel_l2: float
    ulp: float | None
    """Largest ULP distance; None when the dtypes differ or are not floats."""
    nonfinite_mismatch: int
    worst_index: tuple[int, ...] | None
    """Logical index of the element with the largest |c - r|."""
    worst_ref: float | None
    worst_cand: float | None

    def as_dict(self) -> dict:
        return {
            "max_abs": json_float(self.max_abs), "max_rel": json_float(self.max_rel),
            "allclose": json_float(self.allclose), "mismatched": self.mismatched,
            "rel_l2": json_float(self.rel_l2), "ulp": json_float(self.ulp),
            "nonfinite_mismatch": self.nonfinite_mismatch,
            "worst": None if self.worst_index is None else {
                "index": list(self.worst_index), "ref": json_float(self.worst_ref),
                "cand": json_float(self.worst_cand)},
        }


def payload_metrics(ref: np.ndarray, cand: np.ndarray, *, rtol: float, atol: float,
                    ref_bits: np.ndarray | None = None, cand_bits: np.ndarray | None = None,
                    ulp_ok: bool = False) -> PayloadMetrics:
    """Exact metrics between two logical tensors of equal shape (float64 values).

    ``ref_bits``/``cand_bits`` (raw bits of the same float dtype, ``ulp_ok``) give the ULP
    distance. NaN matches NaN and an infinity its own sign for the non-finite count.
    """
    r, c = ref.reshape(-1), cand.reshape(-1)
    fin_r, fin_c = np.isfinite(r), np.isfinite(c)
    both = fin_r & fin_c
    nf_mismatch = int(np.count_nonzero(~both & ~((np.isnan(r) & np.isnan(c)) | (r == c))))
    rz = np.where(both, r, 0.0)
    cz = np.where(both, c, 0.0)
    diff = np.abs(cz - rz)
    absr = np.abs(rz)
    tol = atol + rtol * absr
    with np.errstate(divide="ignore", invalid="ignore"):
        close_ratio = np.where(tol > 0, diff / tol, np.where(diff > 0, np.inf, 0.0))
        rel = np.where(absr > 0, diff / absr, 0.0)
    mismatched = int(np.count_nonzero(diff > tol)) + nf_mismatch
    norm_r = float(np.sqrt(np.dot(rz, rz)))
    norm_d = float(np.sqrt(np.dot(cz - rz, cz - rz)))
    rel_l2 = norm_d / norm_r if norm_r > 0 else (0.0 if norm_d == 0 else math.inf)
    worst = worst_r = worst_c = None
    max_abs = float(diff.max(initial=0.0))
    if diff.size and max_abs > 0:
        w = int(np.argmax(diff))
        worst = tuple(int(i) for i in np.unravel_index(w, ref.shape)) if ref.ndim else ()
        worst_r, worst_c = float(r[w]), float(c[w])
    ulp = None
    if ulp_ok and ref_bits is not None and cand_bits is not None:
        ob_r = ordered_bits(ref_bits.reshape(-1))
        ob_c = ordered_bits(cand_bits.reshape(-1))
        d = np.abs(ob_c - ob_r)
        nan = np.isnan(r) | np.isnan(c)
        ulp = float(np.where(nan, 0, d).max(initial=0))
    return PayloadMetrics(
        max_abs=max_abs, max_rel=float(rel.max(initial=0.0)),
        allclose=float(close_ratio.max(initial=0.0)), mismatched=mismatched, rel_l2=rel_l2,
        ulp=ulp, nonfinite_mismatch=nf_mismatch, worst_index=worst, worst_ref=worst_r,
        worst_cand=worst_c,
    )


def json_float(v: float | None, nan: str | None = "nan") -> float | str | None:
    """A float for JSON, which has no infinities or NaN: ±inf as "inf"/"-inf", NaN as `nan`
    ("nan", or None where a NaN only means "not measured", as in a finding's metrics)."""
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return nan
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v
