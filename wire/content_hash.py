"""The content hash of records as columns: what tells a resend from a conflict.

`content_hashes` is defined on the columns, so a record hashes the same however it travelled
(packed or per record): 128 bits from two independent 64-bit lanes of a keyed mix over the
record's words (key fields, layout, digest, sketch, payload header). It is not a security
boundary (a writer may already store what it likes). No torch, no auditor imports.
"""
from __future__ import annotations

import numpy as np

from numaudit.wire.hashing import MIX_C2, mix64_array
from numaudit.wire.packed import IS_NONE, NOT_CONTENT, SCALAR_COLUMNS, RecordColumns

_M2 = np.uint64(MIX_C2)
_LANE_SEEDS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))
_mix = mix64_array
"""splitmix64's finalizer (a bijection of uint64), in place on a fresh array."""


_TEXT_WORDS: dict[str, int] = {}


def _text_words(names: list[str]) -> np.ndarray:
    """A 64-bit word per table entry (site or dtype name), from blake2b of its UTF-8."""
    import hashlib

    words = []
    for s in names:
        w = _TEXT_WORDS.get(s)
        if w is None:
            w = int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
            if len(_TEXT_WORDS) < 1 << 20:  # site names are few; a bound all the same
                _TEXT_WORDS[s] = w
        words.append(w)
    return np.array(words or [0], np.uint64)


_KEYS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _keys(domain: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-position keys of a domain (0 fixed words, 1 dims, 2 sketch): an xor key that makes
    each word's mix depend on its position, and an odd multiplier for the second lane."""
    length = max(length, 1)
    have = _KEYS.get((domain, 0))
    if have is None or len(have[0]) < length:
        size = max(length, 64 if have is None else 2 * len(have[0]))
        with np.errstate(over="ignore"):
            base = (np.arange(size, dtype=np.uint64) * _LANE_SEEDS[0]
                    + np.uint64(domain + 1) * _LANE_SEEDS[1])
            have = (_mix(base.copy()), _mix(base ^ _M2) | np.uint64(1))
        _KEYS[(domain, 0)] = have
    return have[0][:length], have[1][:length]


def _lanes(words: np.ndarray, starts: np.ndarray, n: int, domain: int) -> tuple[np.ndarray,
                                                                                 np.ndarray]:
    """Two 64-bit lanes per record over its segment of `words` (starts[i]:starts[i+1]):
    lane 0 sums m = mix(word ^ key[position]), lane 1 sums m x odd[position] (wrapping)."""
    out0, out1 = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    if not len(words):
        return out0, out1
    lens = np.diff(starts)
    width = int(lens.max())
    xk, mk = _keys(domain, width)
    with np.errstate(over="ignore"):
        if (lens == width).all():  # every record as long: a 2-D array, no gathers
            m = _mix(words.reshape(n, width) ^ xk)
            return m.sum(axis=1, dtype=np.uint64), (m * mk).sum(axis=1, dtype=np.uint64)
        pos = np.arange(len(words), dtype=np.int64) - np.repeat(starts[:-1], lens)
        m = _mix(words ^ xk[pos])
        m1 = m * mk[pos]
    nz = lens > 0
    out0[nz] = np.add.reduceat(m, starts[:-1][nz])
    out1[nz] = np.add.reduceat(m1, starts[:-1][nz])
    return out0, out1


def content_hashes(c: RecordColumns) -> list[bytes]:
    """16 bytes per record: what it says (key, stage, layout, digest, sketch, payload header;
    the payload's chunk index and bytes excluded, and the `NOT_CONTENT` columns), the same
    whether it travelled packed or per record. is_none records hash their key and stage only
    (their layout and digest are empty).

    Each 64-bit word of a record (its fixed fields, its dims, its sketch) is mixed with a key of
    its position (splitmix64's finalizer, a bijection); lane 0 sums the mixed words, lane 1
    sums them times odd per-position multipliers, and each lane is mixed again at the end."""
    n = c.n
    if n == 0:
        return []
    cols = c.cols
    none = (cols["flags"] & IS_NONE) != 0
    fixed = []
    for name, dt in SCALAR_COLUMNS:
        if name in NOT_CONTENT:
            continue
        a = cols[name]
        if name == "site":
            w = _text_words(c.sites)[np.clip(a, 0, len(c.sites) - 1 if c.sites else 0)]
        elif name == "dtype":
            w = _text_words(c.dtypes)[np.clip(a, 0, len(c.dtypes) - 1 if c.dtypes else 0)]
        elif dt == "<f8":
            w = a.view(np.uint64) if a.dtype == np.float64 else a.astype("<f8").view(np.uint64)
        else:
            w = a.astype(np.int64).view(np.uint64)
        if name not in ("site", "step", "microbatch", "phase", "role", "index", "call", "stage",
                        "flags") and none.any():
            w = np.where(none, np.uint64(0), w)
        fixed.append(w)
    fixed.append(_payload_words(c))
    table = np.stack(fixed, axis=1).reshape(-1)  # n x W, row-major
    width = len(fixed)
    lanes_fixed = _lanes(table, np.arange(n + 1, dtype=np.int64) * width, n, 0)
    lanes_dims = _lanes(c.dims.astype(np.int64, copy=False).view(np.uint64), c.dim_starts(), n, 1)
    lanes_sketch = _lanes(c.sketch.astype("<f8", copy=False).view(np.uint64), c.sketch_starts(),
                          n, 2)
    out = []
    with np.errstate(over="ignore"):
        for lane in (0, 1):
            h = (lanes_fixed[lane] + _mix(lanes_dims[lane] + np.uint64(1 + lane))
                 + _mix(lanes_sketch[lane] + np.uint64(3 + lane)))
            out.append(_mix(h ^ _LANE_SEEDS[lane]))
    raw = np.stack(out, axis=1).astype("<u8").tobytes()
    return [raw[i:i + 16] for i in range(0, 16 * n, 16)]


def _payload_words(c: RecordColumns) -> np.ndarray:
    """One word per record summarizing its payload header (0: no payload)."""
    w = np.zeros(c.n, np.uint64)
    if c.payloads:
        import hashlib

        for row, p in c.payloads.items():
            head = f"{p.codec}\0{p.raw_nbytes}\0{p.compressed_nbytes}\0{p.crc32}\0{p.chunk_count}"
            w[row] = int.from_bytes(hashlib.blake2b(head.encode(), digest_size=8).digest(),
                                    "little") | 1
    return w
