"""Key segments: a stored batch's comparison columns in one blob, so a run loads as arrays.

The comparison reads, for every record of a run, its key, rank, stage, a few flags, its layout,
its fingerprint, its capture order and its record id (`auditor.compare.read.columns`). Read as SQL
rows that is six Python objects a record (about 4 s per million on this machine); read from segments
it is a few `numpy.frombuffer` calls per batch. The SQLite writer stores one segment per batch in
the same transaction as the batch's rows (`Store.ingest_columns`), holding exactly the records that
batch stored, with their record ids. The records table stays the source of truth: a run's segments
are used only when they account for every one of its records (`complete`), so a store written
before segments existed, or by an older numaudit, is read row by row as before.

A segment also holds each record's counts and moments, so that a comparison whose keys mostly
differ (bf16 against fp32) reads only the sketches from rows
(`auditor.compare.read.reads.Digests.prefetch`).

A segment is ``MAGIC, n, len(table)``, the layout table as JSON, then the columns of `INTS`
(int64) and `MOMENTS` (float64), ``layout`` (int32, an index into the table) and ``flags``
(uint8, the `FLAG_BITS` of each record). A table entry is a distinct tuple of `LAYOUT_COLUMNS`
values, as stored.
"""

from __future__ import annotations

import json
import sqlite3
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MAGIC = b"NAS3"
_HEAD = struct.Struct("<4sII")

INTS = ("step", "microbatch", "phase", "site_id", "role", "idx", "call", "rank", "stage",
        "fingerprint", "record_id", "nan", "posinf", "neginf", "zeros", "numel", "capture_order")
"""int64 columns of a segment, as stored in `records` (fingerprints as the signed int64)."""
_INTS_OF = {MAGIC: INTS, b"NAS2": INTS[:-1]}
"""The int64 columns of each segment format: NAS2, written before records carried their
capture order, decodes with capture_order 0 (not numbered), as its records are stored."""

MOMENTS = (("sum", 0.0), ("sum_sq", 0.0), ("min", float("inf")), ("max", -float("inf")),
           ("abs_max", 0.0))
"""float64 columns of a segment, and the value a record without moments (NULL in `records`:
integer and None pieces) holds there: the identity of how the comparison merges the column."""

LAYOUT_COLUMNS = ("dtype", "logical_shape", "offsets", "shape", "ragged_parts", "ragged_first",
                  "ragged_span", "reduce", "reduce_index", "reduce_count", "reduce_weight",
                  "fingerprint_seed", "sketch_seed")
"""What a layout table entry holds: the columns that describe a piece rather than name it."""

IS_NONE, REPLICA, PARTIAL, COMPLEX_AS_REAL, HAS_MOMENTS, NONFINITE, ALL_ZERO, FLAT = (
    1 << i for i in range(8))
FLAG_BITS = (("is_none", IS_NONE), ("replica", REPLICA), ("partial", PARTIAL),
             ("complex_as_real", COMPLEX_AS_REAL), ("has_moments", HAS_MOMENTS), ("flat", FLAT))
"""Flag columns stored as bits; NONFINITE (nan + posinf + neginf > 0) and ALL_ZERO (zeros =
numel > 0) are derived from the counts. Segments written before FLAT existed have its bit clear:
their records read as not flat, as they are."""

SOURCE_COLUMNS = tuple(c for c in INTS if c != "record_id") + LAYOUT_COLUMNS + tuple(
    c for c, _ in FLAG_BITS) + tuple(c for c, _ in MOMENTS)
"""Columns of `records` a segment is built from (with the record ids)."""

_TABLE = """
CREATE TABLE IF NOT EXISTS segments (
    segment_id INTEGER PRIMARY KEY,
    run_id INTEGER NOT NULL,
    n INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS segments_by_run ON segments (run_id);
"""


class SegmentError(ValueError):
    """A segment blob that does not decode (truncated, another format)."""


def create_table(conn: sqlite3.Connection) -> None:
    conn.executescript(_TABLE)


def encode(columns: Mapping[str, Sequence[Any]], rids: Sequence[int]) -> bytes:
    """One segment from the stored values of `SOURCE_COLUMNS` (each a sequence or a numpy
    array, one value per record) and the records' ids."""
    n = len(rids)
    layout = (columns[c] for c in LAYOUT_COLUMNS)
    keys = list(zip(*(v.tolist() if isinstance(v, np.ndarray) else v for v in layout)))
    entries: dict[tuple, int | None] = dict.fromkeys(keys)  # distinct entries, at C speed
    for i, e in enumerate(entries):
        entries[e] = i
    codes = np.fromiter(map(entries.__getitem__, keys), dtype=np.int32, count=n)
    table = json.dumps(list(entries), separators=(",", ":")).encode()
    ints = [np.asarray(rids if c == "record_id" else columns[c], dtype=np.int64) for c in INTS]
    floats = []
    for c, identity in MOMENTS:
        values = columns[c]
        if isinstance(values, np.ndarray) or None not in values:
            floats.append(np.asarray(values, dtype=np.float64))
            continue
        filled = np.asarray(values, dtype=object)  # None where the record has no moments
        # numpy's stubs refuse None as an operand; on an object array it compares elementwise
        filled[np.equal(filled, None)] = identity  # type: ignore[call-overload]
        floats.append(filled.astype(np.float64))
    flags = np.zeros(n, np.uint8)
    for name, bit in FLAG_BITS:
        flags |= np.where(np.asarray(columns[name], dtype=np.int64) != 0, bit, 0).astype(np.uint8)
    counts = dict(zip(INTS, ints))
    nonfinite = counts["nan"] + counts["posinf"] + counts["neginf"] > 0
    flags |= np.where(nonfinite, NONFINITE, 0).astype(np.uint8)
    all_zero = (counts["zeros"] == counts["numel"]) & (counts["numel"] > 0)
    flags |= np.where(all_zero, ALL_ZERO, 0).astype(np.uint8)
    pad = b"\0" * (-(_HEAD.size + len(table)) % 8)
    return b"".join([_HEAD.pack(MAGIC, n, len(table)), table, pad]
                    + [a.astype("<i8").tobytes() for a in ints]
                    + [a.astype("<f8").tobytes() for a in floats]
                    + [codes.astype("<i4").tobytes(), flags.tobytes()])


def decode(blob: bytes) -> tuple[dict[str, np.ndarray], list[tuple]]:
    """The columns of a segment (`INTS`, "flags", "layout") and its layout table."""
    if len(blob) < _HEAD.size:
        raise SegmentError("segment: shorter than its header")
    magic, n, tlen = _HEAD.unpack_from(blob)
    ints = _INTS_OF.get(magic)
    if ints is None:
        raise SegmentError(f"segment: magic {magic!r} is not {MAGIC!r}")
    at = _HEAD.size + tlen
    at += -at % 8
    if len(blob) != at + n * (8 * (len(ints) + len(MOMENTS)) + 5):
        raise SegmentError(f"segment: {len(blob)} bytes do not hold {n} records")
    try:
        table = [tuple(e) for e in json.loads(blob[_HEAD.size:_HEAD.size + tlen])]
    except (ValueError, TypeError) as exc:
        raise SegmentError(f"segment: its layout table is not a JSON list of lists ({exc})") \
            from None
    for e in table:
        if not _entry_ok(e):
            raise SegmentError(f"segment: layout table entry {str(e)[:80]} is not "
                               f"{len(LAYOUT_COLUMNS)} values of the columns' types")
    out: dict[str, np.ndarray] = {}
    for c in ints:
        out[c] = np.frombuffer(blob, "<i8", n, at)
        at += 8 * n
    for c in INTS[len(ints):]:
        out[c] = np.zeros(n, np.int64)
    for c, _ in MOMENTS:
        out[c] = np.frombuffer(blob, "<f8", n, at)
        at += 8 * n
    out["layout"] = np.frombuffer(blob, "<i4", n, at)
    out["flags"] = np.frombuffer(blob, np.uint8, n, at + 4 * n)
    if n and (out["layout"].min() < 0 or out["layout"].max() >= len(table)):
        raise SegmentError("segment: a layout code outside its table")
    return out, table


def _entry_ok(e: tuple) -> bool:
    """A layout table entry as `encode` writes it: 4 texts, then integers (the weight may be
    a float)."""
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    weight = LAYOUT_COLUMNS.index("reduce_weight")
    return (len(e) == len(LAYOUT_COLUMNS) and all(isinstance(v, str) for v in e[:4])
            and all(whole(v) for i, v in enumerate(e[4:], 4) if i != weight)
            and (whole(e[weight]) or isinstance(e[weight], float)))


def covered(conn: Any, run_id: int) -> int:
    """The run's record count when its segments hold all of its records (so a reader may use
    them alone), else 0."""
    try:
        segs = conn.execute("SELECT COALESCE(SUM(n), 0) FROM segments WHERE run_id = ?",
                            (run_id,)).fetchone()[0]
    except sqlite3.OperationalError:  # a store from before segments: no table
        return 0
    records = conn.execute("SELECT COUNT(*) FROM records WHERE run_id = ?", (run_id,)).fetchone()[0]
    return records if records > 0 and segs == records else 0


def complete(conn: Any, run_id: int) -> bool:
    """Whether the run's segments hold all of its records."""
    return covered(conn, run_id) > 0


def store(conn: sqlite3.Connection, run_id: int, columns: Mapping[str, Sequence[Any]],
          rids: Sequence[int]) -> None:
    """Insert one segment of a run (inside the caller's transaction)."""
    if len(rids):
        conn.execute("INSERT INTO segments (run_id, n, data) VALUES (?, ?, ?)",
                     (run_id, len(rids), encode(columns, rids)))


def backfill(conn: sqlite3.Connection, run_id: int, *, per_segment: int = 4096) -> int:
    """Rebuild a run's segments from its rows (a store written before segments, or a benchmark
    that wrote rows directly); returns the records covered. Runs in one transaction."""
    select = f"SELECT record_id, {', '.join(SOURCE_COLUMNS)} FROM records WHERE run_id = ?" \
             " ORDER BY record_id"
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("DELETE FROM segments WHERE run_id = ?", (run_id,))
        cur = conn.execute(select, (run_id,))
        total = 0
        while rows := cur.fetchmany(per_segment):
            cols = list(zip(*rows))
            store(conn, run_id, dict(zip(SOURCE_COLUMNS, cols[1:])), cols[0])
            total += len(rows)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return total
