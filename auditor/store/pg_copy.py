"""A batch's `records` rows as one PostgreSQL binary COPY buffer, built column-wise with numpy.

Binary COPY is a header, then per row a 16-bit field count and, per field, a 32-bit byte length
(-1 for NULL) and the value (integers and floats big-endian, text and bytea as their bytes); a
16-bit -1 ends it. Every field of a row is a run of bytes whose width is known per record, so the
whole buffer is a byte matrix with one row per record, assembled a group of fields at a time:

- the fixed-width fields (every integer and float column that is never NULL) are one int64
  matrix of their 8-byte values (floats by their bits), converted to big-endian at once;
- the moments (NULL without moments) are 60 or 20 bytes;
- content hash and sketch are length-prefixed blobs (one reshape when all have one length);
- the texts (dtype and the three JSON layout lists, which readers parse) come from a table of
  the batch's distinct (dtype, layout) combinations, built once per combination.

Records whose rows are shorter than the widest leave padding in the matrix; a boolean mask drops
it. No Python object per record. The values are those `auditor.store.rows.record_rows` gives the
SQLite store (uint64 digests as the int64 of the same bits, sketches as native-order float64
blobs, moments NULL without moments, reduce_weight and reduce_count 1 when not a reduction), so a
reader sees the same whichever backend or path stored a record.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from numaudit.wire.packed import (
    COMPLEX_AS_REAL,
    FLAT,
    HAS_MOMENTS,
    IS_NONE,
    PARTIAL,
    REPLICA,
    RecordColumns,
)

HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
TRAILER = struct.pack(">h", -1)

FIXED = (
    ("run_id", "i8"), ("step", "i8"), ("microbatch", "i8"), ("phase", "i8"), ("site_id", "i8"),
    ("role", "i8"), ("idx", "i8"), ("call", "i8"), ("rank", "i8"), ("stage", "i8"),
    ("is_none", "i8"), ("replica", "i8"), ("partial", "i8"), ("complex_as_real", "i8"),
    ("numel", "i8"), ("nan", "i8"), ("posinf", "i8"), ("neginf", "i8"), ("zeros", "i8"),
    ("has_moments", "i8"), ("fingerprint", "i8"), ("fingerprint_seed", "i8"),
    ("sketch_seed", "i8"), ("seq", "i8"), ("received", "f8"), ("reduce", "i8"),
    ("reduce_weight", "f8"), ("reduce_index", "i8"), ("reduce_count", "i8"),
    ("ragged_parts", "i8"), ("ragged_first", "i8"), ("ragged_span", "i8"), ("flat", "i8"),
    ("capture_order", "i8"),
)
MOMENTS = ("sum", "sum_sq", "min", "max", "abs_max")
BLOBS = ("content_hash", "sketch")
TEXTS = ("session_id", "dtype", "logical_shape", "offsets", "shape")
COLUMNS = tuple(n for n, _ in FIXED) + MOMENTS + BLOBS + TEXTS
"""The `records` columns of a row, in the order of the COPY buffer."""
STAGE_COLUMNS = ("pos",) + COLUMNS
"""With `pos` (the record's index in the batch), for a staging table."""
ID_COLUMNS = ("record_id",) + COLUMNS
"""With the record ids the writer drew from the table's sequence beforehand."""
SQL_TYPES = {**{n: ("float8" if t == "f8" else "int8") for n, t in FIXED}, "pos": "int8",
             **{m: "float8" for m in MOMENTS}, "content_hash": "bytea", "sketch": "bytea",
             **{t: "text" for t in TEXTS}}


_FIELD = np.dtype([("length", ">i4"), ("value", ">i8")])  # an 8-byte field, its bits as >i8
_MOMENT_DTYPE = np.dtype([(part + m, dt) for m in MOMENTS
                          for part, dt in (("l_", ">i4"), ("v_", ">f8"))])


def _template(dtype: np.dtype, count: int | None) -> np.ndarray:
    t = np.zeros((), dtype)
    assert dtype.names is not None  # the templates are of structured dtypes
    for name in dtype.names:
        if name.startswith("l_"):
            t[name] = 8
    if count is not None:
        t["count"] = count
    return t


_MOMENTS_TEMPLATE = _template(_MOMENT_DTYPE, None)


def _blob_section(flat: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Length-prefixed byte strings, one per row: (matrix, row widths or None when all equal)."""
    n = len(lens)
    width = int(lens.max(initial=0))
    if n and (lens == width).all():
        mat = np.empty((n, 4 + width), np.uint8)
        mat[:, 4:] = flat.reshape(n, width)
        mat[:, :4] = np.full(n, width, ">i4").view(np.uint8).reshape(n, 4)
        return mat, None
    mat = np.zeros((n, 4 + width), np.uint8)
    mat[:, :4] = lens.astype(">i4").view(np.uint8).reshape(n, 4)
    mat[:, 4:][np.arange(width) < lens[:, None]] = flat
    return mat, lens + 4


def _distinct_rows(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of an int64 matrix and each row's index among them."""
    if (k == k[0]).all():  # the common case: one layout and dtype in the batch
        return k[:1], np.zeros(len(k), np.int64)
    k = np.ascontiguousarray(k)
    _, first, inverse = np.unique(k.view(np.dtype((np.void, k.itemsize * k.shape[1]))).ravel(),
                                  return_index=True, return_inverse=True)
    return k[first], inverse


def _text_section(c: RecordColumns, none: np.ndarray,
                  session_id: str) -> tuple[np.ndarray, np.ndarray | None]:
    """session_id, dtype, logical_shape, offsets and shape, each length-prefixed."""
    n = c.n
    ndim = c.cols["ndim"].astype(np.int64)
    starts = c.dim_starts()
    dcode = np.where(none, -1, c.cols["dtype"].astype(np.int64))
    dtypes = c.dtypes or [""]
    combo = np.zeros(n, np.int64)
    tails: list[bytes] = []
    sid = session_id.encode()
    head = struct.pack(">i", len(sid)) + sid
    for nd in np.unique(ndim).tolist():
        rows = np.flatnonzero(ndim == nd)
        dims = c.dims[starts[rows][:, None] + np.arange(3 * nd)] if nd else \
            np.zeros((len(rows), 0), np.int64)
        keys, inverse = _distinct_rows(np.column_stack([dcode[rows], dims]))
        combo[rows] = len(tails) + inverse.reshape(-1)
        for key in keys.tolist():
            d = key[1:]
            fields = [b"" if key[0] < 0 else dtypes[key[0]].encode()] + [
                ("[" + ", ".join(map(str, d[i * nd:(i + 1) * nd])) + "]").encode()
                for i in range(3)]
            tails.append(head + b"".join(struct.pack(">i", len(f)) + f for f in fields))
    lens = np.array([len(t) for t in tails], np.int64)
    width = int(lens.max())
    table = np.zeros((len(tails), width), np.uint8)
    table[np.arange(width) < lens[:, None]] = np.frombuffer(b"".join(tails), np.uint8)
    row_lens = lens[combo]
    return table[combo], (None if (row_lens == width).all() else row_lens)


def copy_buffer(c: RecordColumns, site_ids: Sequence[int], run_id: int, rank: int,
                hashes: Sequence[bytes], session_id: str, seq: int, now: float, *,
                pos: bool = False, record_ids: np.ndarray | None = None) -> bytes:
    """The COPY ... (COLUMNS) FROM STDIN (FORMAT BINARY) data of the batch's rows (with `pos`:
    of STAGE_COLUMNS; with `record_ids`, one per record: of ID_COLUMNS). `site_ids[j]` is the
    store's id of `c.sites[j]`."""
    n = c.n
    if n == 0:
        return HEADER + TRAILER
    cols = c.cols
    flags = cols["flags"]
    none = (flags & IS_NONE) != 0
    moments = ((flags & HAS_MOMENTS) != 0) & ~none
    reducing = cols["reduce"] != 0
    values = {
        "run_id": run_id, "step": cols["step"], "microbatch": cols["microbatch"],
        "phase": cols["phase"], "site_id": np.asarray(site_ids, np.int64)[cols["site"]],
        "role": cols["role"], "idx": cols["index"], "call": cols["call"], "rank": rank,
        "stage": cols["stage"], "is_none": none, "replica": (flags & REPLICA) != 0,
        "partial": (flags & PARTIAL) != 0, "complex_as_real": (flags & COMPLEX_AS_REAL) != 0,
        "numel": cols["numel"], "nan": cols["nan_count"], "posinf": cols["posinf_count"],
        "neginf": cols["neginf_count"], "zeros": cols["zero_count"], "has_moments": moments,
        "fingerprint": cols["fingerprint"].astype(np.uint64).view(np.int64),
        "fingerprint_seed": cols["fingerprint_seed"].astype(np.uint64).view(np.int64),
        "sketch_seed": cols["sketch_seed"].astype(np.uint64).view(np.int64),
        "seq": seq, "received": now, "reduce": cols["reduce"],
        "reduce_weight": np.where(reducing, cols["reduce_weight"], 1.0),
        "reduce_index": cols["reduce_index"],
        "reduce_count": np.where(reducing, cols["reduce_count"], 1),
        "ragged_parts": cols["ragged_parts"], "ragged_first": cols["ragged_first"],
        "ragged_span": cols["ragged_span"], "flat": (flags & FLAT) != 0,
        "capture_order": cols["capture_order"],
    }
    lead: tuple[str, ...] = ()
    if pos:
        values["pos"], lead = np.arange(n), ("pos",)
    elif record_ids is not None:
        values["record_id"], lead = np.asarray(record_ids, np.int64), ("record_id",)
    names = lead + tuple(name for name, _ in FIXED)
    words = np.empty((n, len(names)), np.int64)  # every value as its 8 bytes
    for j, name in enumerate(names):
        v = values[name]
        words[:, j] = v.view(np.int64) if getattr(v, "dtype", None) == np.float64 else \
            (np.float64(v).view(np.int64) if isinstance(v, float) else v)
    fields = np.empty((n, len(names)), _FIELD)
    fields["length"] = 8
    fields["value"] = words  # one big-endian conversion for all of them
    count = np.full((n, 1), len(lead) + len(COLUMNS), ">i2").view(np.uint8)
    sections: list[tuple[np.ndarray, np.ndarray | None]] = [
        (count, None), (fields.view(np.uint8).reshape(n, 12 * len(names)), None)]

    mom = np.empty(n, _MOMENT_DTYPE)
    mom[:] = _MOMENTS_TEMPLATE
    for m in MOMENTS:
        mom["v_" + m] = cols[m]
    mom_bytes = mom.view(np.uint8).reshape(n, _MOMENT_DTYPE.itemsize)
    if moments.all():
        sections.append((mom_bytes, None))
    else:
        mom_bytes[~moments, :4 * len(MOMENTS)] = 0xFF  # five NULLs: length -1, no value
        sections.append((mom_bytes, np.where(moments, _MOMENT_DTYPE.itemsize, 4 * len(MOMENTS))))

    hash_flat = np.frombuffer(b"".join(hashes), np.uint8)
    hash_lens = np.fromiter((len(h) for h in hashes), np.int64, n) if len(hash_flat) != 16 * n \
        else np.full(n, 16, np.int64)
    sections.append(_blob_section(hash_flat, hash_lens))
    sk = c.sketch.astype("=f8", copy=False)
    sections.append(_blob_section(np.ascontiguousarray(sk).view(np.uint8),
                                  cols["sketch_len"].astype(np.int64) * 8))
    sections.append(_text_section(c, none, session_id))

    return HEADER + _rows(sections) + TRAILER


def _rows(sections: list[tuple[np.ndarray, np.ndarray | None]]) -> bytes:
    """The rows' bytes: each row the concatenation of its part of every section (a section's
    row is its first `lens[i]` bytes, all of it where lens is None). Rows of one width
    signature are cut and joined as one matrix; the groups follow each other, each in batch
    order (the order of rows in `records` carries no meaning: keys are unique)."""
    n = len(sections[0][0])
    var = [(i, lens) for i, (_, lens) in enumerate(sections) if lens is not None]
    if not var:
        return np.hstack([m for m, _ in sections]).tobytes()
    signature, span = np.zeros(n, np.int64), 1
    for _, lens in var:
        span *= int(lens.max()) + 1
        signature = signature * (int(lens.max()) + 1) + lens
    values, first = np.unique(signature, return_index=True)
    if len(values) > 64 or span >= 1 << 62:  # many widths: cut the padding out with a mask
        matrix = np.hstack([m for m, _ in sections])
        mask = np.hstack([np.ones(m.shape, bool) if lens is None
                          else np.arange(m.shape[1]) < lens[:, None] for m, lens in sections])
        return matrix[mask].tobytes()
    out = []
    for value, row in zip(values.tolist(), first.tolist()):
        idx = np.flatnonzero(signature == value) if len(values) > 1 else slice(None)
        out.append(np.hstack([m[idx] if lens is None else m[idx, :int(lens[row])]
                              for m, lens in sections]).tobytes())
    return b"".join(out)

