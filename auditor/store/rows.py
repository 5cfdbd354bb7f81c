"""Rows of the `records` table from `RecordColumns`, built column-wise for bulk inserts.

The values are those the per-record path stored (so readers see no difference): layouts as JSON
lists, uint64 digests as the int64 of the same bits, sketches as native-order float64 blobs,
moments NULL without moments, reduce_weight 1 and reduce_count 1 when not a reduction. Any SQL
backend that takes the same columns can use `record_rows` (a list of tuples, one per record, in
`INSERT_COLUMNS` order).
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

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

INSERT_COLUMNS = (
    "run_id", "step", "microbatch", "phase", "site_id", "role", "idx", "call", "rank",
    "stage", "is_none", "dtype", "logical_shape", "offsets", "shape", "replica", "partial",
    "complex_as_real", "numel", "nan", "posinf", "neginf", "zeros", "has_moments", "sum",
    "sum_sq", "min", "max", "abs_max", "fingerprint", "fingerprint_seed", "sketch",
    "sketch_seed", "content_hash", "session_id", "seq", "received", "reduce", "reduce_weight",
    "reduce_index", "reduce_count", "ragged_parts", "ragged_first", "ragged_span", "flat",
    "capture_order",
)
"""Columns of a row of `record_rows`; the first 9 are the unique key (run, key, rank)."""

INSERT_RECORD = (f"INSERT INTO records ({', '.join(INSERT_COLUMNS)}) VALUES "
                 f"({', '.join('?' * len(INSERT_COLUMNS))}) ON CONFLICT DO NOTHING")

ROWS_PER_INSERT = 128
"""Rows one multi-row INSERT carries (`insert_rows`): 128 x 46 = 5,888 bound values, under
SQLite's limit of 32,766 (3.32+). One statement per 128 rows instead of one step per row: the
writer thread drops and retakes the GIL once per statement step, and under load each retake can
wait for the event loop's or validation's thread; fewer, larger steps spend less time queued."""


@functools.lru_cache(maxsize=8)
def insert_rows_sql(rows: int) -> str:
    """`INSERT_RECORD` for `rows` rows at once."""
    one = "(" + ", ".join("?" * len(INSERT_COLUMNS)) + ")"
    return (f"INSERT INTO records ({', '.join(INSERT_COLUMNS)}) VALUES "
            f"{', '.join([one] * rows)} ON CONFLICT DO NOTHING")


def insert_rows(conn: Any, rows: list[tuple]) -> None:
    """Insert `record_rows` output (ON CONFLICT DO NOTHING) in multi-row statements."""
    full = len(rows) - len(rows) % ROWS_PER_INSERT
    if full:
        conn.executemany(insert_rows_sql(ROWS_PER_INSERT),
                         (list(itertools.chain.from_iterable(rows[i:i + ROWS_PER_INSERT]))
                          for i in range(0, full, ROWS_PER_INSERT)))
    if full < len(rows):
        conn.execute(insert_rows_sql(len(rows) - full),
                     list(itertools.chain.from_iterable(rows[full:])))


def _layout_texts(c: RecordColumns) -> tuple[list[str], list[str], list[str]]:
    """JSON of logical_shape, offsets and shape per record (as json.dumps writes a list)."""
    ndim = c.cols["ndim"].tolist()
    dims = c.dims.tolist()
    cache: dict[tuple, tuple[str, str, str]] = {}
    logical, offsets, shape = [], [], []
    pos = 0
    for nd in ndim:
        key = tuple(dims[pos:pos + 3 * nd])
        pos += 3 * nd
        t = cache.get(key)
        if t is None:
            t = cache[key] = ("[" + ", ".join(map(str, key[:nd])) + "]",
                              "[" + ", ".join(map(str, key[nd:2 * nd])) + "]",
                              "[" + ", ".join(map(str, key[2 * nd:])) + "]")
        logical.append(t[0])
        offsets.append(t[1])
        shape.append(t[2])
    return logical, offsets, shape


def _sketch_blobs(c: RecordColumns) -> list[bytes]:
    lens = c.cols["sketch_len"]
    sk = c.sketch if sys.byteorder == "little" else c.sketch.astype("=f8")
    raw = sk.tobytes()
    if c.n and (lens == lens[0]).all():
        w = int(lens[0]) * 8
        return [raw[i:i + w] for i in range(0, w * c.n, w)] if w else [b""] * c.n
    ends = np.cumsum(lens.astype(np.int64) * 8).tolist()
    out, start = [], 0
    for e in ends:
        out.append(raw[start:e])
        start = e
    return out


def record_columns(c: RecordColumns, site_ids: Sequence[int], run_id: int, rank: int,
                   hashes: Sequence[bytes], session_id: str, seq: int,
                   now: float) -> dict[str, Sequence[Any]]:
    """The values of each column of `INSERT_COLUMNS`, one per record: a list of Python values,
    or an integer numpy array where the column came from one (`record_rows` makes lists of
    them). `site_ids[j]` is the store's id of `c.sites[j]`."""
    n = c.n
    cols = c.cols
    flags = cols["flags"]
    none = (flags & IS_NONE) != 0
    moments = ((flags & HAS_MOMENTS) != 0) & ~none
    sid = np.asarray(site_ids, np.int64)[cols["site"]] if n else np.zeros(0, np.int64)
    dtypes = c.dtypes or [""]
    dtype_text = [dtypes[i] if not z else "" for i, z in zip(cols["dtype"].tolist(), none.tolist())]
    logical, offsets, shape = _layout_texts(c)
    reducing = cols["reduce"] != 0
    weight = np.where(reducing, cols["reduce_weight"], 1.0).tolist()
    rcount = np.where(reducing, cols["reduce_count"], 1)

    def moment(name: str) -> list:
        values = cols[name].tolist()
        if not moments.all():
            for i in np.flatnonzero(~moments).tolist():
                values[i] = None
        return values

    def signed(name: str) -> np.ndarray:
        return cols[name].astype(np.uint64).view(np.int64)

    def bit(b: int) -> np.ndarray:
        return ((flags & b) != 0).astype(np.int64)

    return dict(zip(INSERT_COLUMNS, (
        [run_id] * n, cols["step"], cols["microbatch"], cols["phase"],
        sid, cols["role"], cols["index"], cols["call"], np.full(n, rank, np.int64),
        cols["stage"], none.astype(np.int64), dtype_text, logical, offsets,
        shape, bit(REPLICA), bit(PARTIAL), bit(COMPLEX_AS_REAL),
        cols["numel"], cols["nan_count"], cols["posinf_count"],
        cols["neginf_count"], cols["zero_count"],
        moments.astype(np.int64),
        moment("sum"), moment("sum_sq"), moment("min"), moment("max"), moment("abs_max"),
        signed("fingerprint"), signed("fingerprint_seed"), _sketch_blobs(c),
        signed("sketch_seed"), list(hashes), [session_id] * n, [seq] * n, [now] * n,
        cols["reduce"], weight, cols["reduce_index"], rcount,
        cols["ragged_parts"], cols["ragged_first"], cols["ragged_span"], bit(FLAT),
        cols["capture_order"],
    )))


def rows_of(columns: dict[str, Sequence[Any]]) -> list[tuple]:
    """`record_columns` as one tuple per record, in INSERT_COLUMNS order (Python values)."""
    return list(zip(*(v.tolist() if isinstance(v, np.ndarray) else v
                      for v in (columns[name] for name in INSERT_COLUMNS))))


def record_rows(c: RecordColumns, site_ids: Sequence[int], run_id: int, rank: int,
                hashes: Sequence[bytes], session_id: str, seq: int, now: float) -> list[tuple]:
    """One tuple per record, in INSERT_COLUMNS order. `site_ids[j]` is the store's id of
    `c.sites[j]`."""
    return rows_of(record_columns(c, site_ids, run_id, rank, hashes, session_id, seq, now))


INSERT_SAMPLES = ("INSERT INTO sample_digests (record_id, dim, unit, count, sketch_k, rows,"
                  " fingerprints) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING")
"""One record's sample digests (a record stored again keeps the first)."""


def sample_rows(c: RecordColumns, record_ids: Sequence[int] | Mapping[int, int] | np.ndarray,
                rows: Sequence[int] | None = None) -> list[tuple]:
    """(record id, dim, unit, count, sketch_k, values as little-endian float64 bytes,
    fingerprints as little-endian uint64 bytes) of the records with sample digests (all, or
    those at ``rows``), the i-th under ``record_ids[i]``."""
    k = c.cols["sample_k"]
    if not len(c.sample_values) or not k.any():
        return []
    sv, sf = c.sample_starts()
    values = np.ascontiguousarray(c.sample_values, "<f8")
    fps = np.ascontiguousarray(c.sample_fps, "<u8")
    cols = c.cols
    out = []
    for i in (np.flatnonzero(k) if rows is None else [r for r in rows if k[r]]):
        i = int(i)
        out.append((int(record_ids[i]), int(cols["sample_dim"][i]), int(cols["sample_unit"][i]),
                    int(cols["sample_count"][i]), int(k[i]), values[sv[i]:sv[i + 1]].tobytes(),
                    fps[sf[i]:sf[i + 1]].tobytes()))
    return out
