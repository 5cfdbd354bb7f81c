"""A run's records as numpy columns: the comparison engine's view of the store.

Comparing a million keys must not build a Python object per record field, so the engine reads a
narrow projection of ``records`` (key packed into two integers, the layout as one interned
string, the counts, the fingerprint and the record id) and keeps it as arrays. Moments and
sketches are read later, and only for the keys whose fingerprints differ.

This module reads the store's tables directly (auditor/store/sqlite.py's schema, the same on
PostgreSQL) through a `store.Reader`'s connection, in SQL both backends run; it writes nothing.
"""

from __future__ import annotations

import gc
import json
import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from auditor.compare.align import RenameRule, canonical_sites, normalize_site
from auditor.compare.digests import FINGERPRINT_SEED, SKETCH_SEED, fingerprint_to_int64
from auditor.compare.merge import Piece
from auditor.compare.segments import unique
from auditor.store import Reader, key_segments

# Packed key: A = step << 24 | (microbatch + 1) << 4 | phase,
#             B = site << 32 | role << 28 | index << 14 | call.
# Both preserve the key's sort order, so (A, B) sorts like the key.
MAX_STEP = (1 << 39) - 1
MAX_MICROBATCH = (1 << 20) - 2
MAX_SITE_ID = (1 << 31) - 1
MAX_INDEX = MAX_CALL = (1 << 14) - 1

_SELECT = (
    # Portable SQL (SQLite and PostgreSQL): booleans become bits through CASE, not by shifting
    # a comparison (PostgreSQL has no integer value for a boolean); every shift is in
    # parentheses (PostgreSQL gives << and | the same precedence).
    "SELECT"
    " (step << 24) | ((microbatch + 1) << 4) | phase,"
    " (site_id << 32) | (role << 28) | (idx << 14) | call,"
    " (rank << 40) | ((stage + 1) << 8)"
    "  | (is_none << 7) | (replica << 6) | (partial << 5) | (complex_as_real << 4)"
    "  | (has_moments << 3)"
    "  | CASE WHEN fingerprint_seed = :fs AND sketch_seed = :ss THEN 4 ELSE 0 END"
    "  | CASE WHEN nan + posinf + neginf > 0 THEN 2 ELSE 0 END"
    "  | CASE WHEN zeros = numel AND numel > 0 THEN 1 ELSE 0 END"
    f"  | CASE WHEN step > {MAX_STEP} OR microbatch > {MAX_MICROBATCH} OR site_id > {MAX_SITE_ID}"
    f"     OR idx > {MAX_INDEX} OR call > {MAX_CALL} OR stage > 2147483646"
    "     THEN 549755813888 ELSE 0 END,"  # 1 << 39
    " dtype || logical_shape || offsets || shape"
    "  || CASE WHEN ragged_parts > 0 THEN '[' || ragged_first || ',' || ragged_span || ','"
    "     || ragged_parts || ']' ELSE '' END"
    "  || CASE WHEN reduce <> 0 THEN '|' || reduce"
    "  || ',' || reduce_index || ',' || reduce_count || ',' || reduce_weight ELSE '' END,"
    " fingerprint, record_id"
    " FROM records"
)
_KEY_ORDER = " ORDER BY step, microbatch, phase, site_id, role, idx, call, rank"

DIGEST_COLUMNS = ("nan", "posinf", "neginf", "zeros", "numel", "sum", "sum_sq", "min", "max",
                  "abs_max")
ID_CHUNK = 50_000
"""Record ids per lookup (`_ids_in`)."""
RANGE_GAP = 64
"""Record ids further apart than this split a read by ranges (`Catalog._rows_of`)."""
PREFETCH_MIN = 20_000
"""Records from which `Catalog.prefetch_digests` reads counts and moments from segments."""
PG_BLOCK = 1 << 22
"""Record ids per block of the packed PostgreSQL read of a run too large for one value
(`Catalog._pg_arrays`)."""


def _ids_in(reader: Reader, ids: list[int]) -> tuple[str, tuple]:
    """``record_id IN`` a list of ids, as SQL and its parameter: json_each on SQLite, an array
    on PostgreSQL."""
    if getattr(reader, "dialect", "sqlite") == "postgres":
        return "record_id = ANY(?)", (ids,)
    return "record_id IN (SELECT value FROM json_each(?))", (json.dumps(ids),)


def _infinity(reader: Reader) -> str:
    """A float +inf literal (SQLite overflows 9e999 to inf; PostgreSQL needs its name)."""
    return "'Infinity'::float8" if getattr(reader, "dialect", "sqlite") == "postgres" \
        else "9e999"


class KeyRangeError(ValueError):
    """A key field beyond what the packed comparison key holds."""


@contextmanager
def no_gc() -> Iterator[None]:
    """Millions of fresh tuples make the cyclic GC rescan the heap over and over: pause it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_FIELDS = ("A", "B", "rank", "stage", "flags", "layout", "fp", "rid")
NONFINITE_FLAG = 2
"""flags bit: the piece holds NaN or Inf."""
ALL_ZERO_FLAG = 1
"""flags bit: every element of the piece is zero (and it has elements)."""
CONFLICT_FLAG = 4
"""flags bit: the key was resent for this rank with other content (the `conflicts` table)."""


@dataclass
class RunColumns:
    """One run's records, sorted by (key, rank)."""

    name: str
    side: str
    """"ref" or "cand"."""
    A: np.ndarray
    B: np.ndarray
    rank: np.ndarray
    stage: np.ndarray
    flags: np.ndarray
    """NONFINITE_FLAG | ALL_ZERO_FLAG | CONFLICT_FLAG bits per piece."""
    layout: np.ndarray
    """Index into `Catalog.pieces`."""
    fp: np.ndarray
    """uint64 fingerprints."""
    rid: np.ndarray
    max_rid: int = 0
    """Largest record id read (for incremental reads)."""

    def __len__(self) -> int:
        return len(self.A)

    @classmethod
    def empty(cls, name: str, side: str) -> RunColumns:
        i8 = np.zeros(0, np.int64)
        return cls(name, side, i8, i8, i8.astype(np.int32), i8.astype(np.int32),
                   i8.astype(np.uint8), i8.astype(np.int32), i8.astype(np.uint64), i8)

    def concat(self, other: RunColumns) -> RunColumns:
        """Rows of both, re-sorted by (key, rank)."""
        merged = {f: np.concatenate([getattr(self, f), getattr(other, f)]) for f in _FIELDS}
        out = RunColumns(self.name, self.side, **merged,
                         max_rid=max(self.max_rid, other.max_rid))
        out.sort()
        return out

    def sort(self) -> None:
        order = np.lexsort((self.rank, self.B, self.A))
        if np.any(order[1:] < order[:-1]):
            for f in _FIELDS:
                setattr(self, f, getattr(self, f)[order])

    def take(self, mask: np.ndarray) -> RunColumns:
        return RunColumns(self.name, self.side, **{f: getattr(self, f)[mask] for f in _FIELDS},
                          max_rid=self.max_rid)


@dataclass
class ReadMark:
    """Where an incremental read of a run stands (`Catalog.load_new`): what the next read
    must return is exactly the records committed since.

    SQLite has one writer, and record ids grow in commit order: everything up to `rid` was
    read. On PostgreSQL, writers (replicas, a replica's connections) commit concurrently, and a
    transaction that took lower record ids can commit after one that took higher ones, so a
    read by id would miss it. There each record carries the transaction that stored it (`xid`),
    and `xmin` is the oldest transaction still in progress when the last read began: every
    older one had finished, and its records were read then or before. A read takes the records
    of transactions >= xmin and skips those it already returned (`seen`: what the last read
    fetched, a superset of what can come back)."""

    rid: int = 0
    xmin: int = 0
    seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def unpack_a(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """step, microbatch, phase."""
    return A >> 24, ((A >> 4) & 0xFFFFF) - 1, A & 0xF


def unpack_b(B: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """site id, role, index, call."""
    return B >> 32, (B >> 28) & 0xF, (B >> 14) & 0x3FFF, B & 0x3FFF


class Catalog:
    """What the two runs' columns share: interned layouts, dtypes, shapes and site names.

    Site ids are the store's; names that a rename rule turns into names the store does not know
    get new ids above the store's largest.
    """

    def __init__(self, reader: Reader, renames: Sequence[RenameRule] = ()) -> None:
        self.reader = reader
        self.renames = list(renames)
        self.pieces: list[Piece] = []
        self.seeds_ok: list[bool] = []
        self._seeds: tuple[int, int] | None = None
        self.has_moments: list[bool] = []
        self._layout_ids: dict[str, int] = {}
        self.dtypes: list[str] = []
        self._dtype_ids: dict[str, int] = {}
        self.shapes: list[tuple] = []
        self._shape_ids: dict[tuple, int] = {}
        self.site_names: dict[int, str] = {}
        """Aligned (canonical) site id → name."""
        self._name_ids: dict[str, int] = {}
        self._store_names: dict[int, str] = {}
        self._luts: dict[str, np.ndarray] = {}
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self._segmented: set[int] = set()
        """Runs whose records were read from their key segments (`_segment_arrays`)."""
        self._prefetched: tuple[np.ndarray, dict[str, np.ndarray]] | None = None
        """(sorted record ids, their DIGEST_COLUMNS and sketch seeds): `prefetch_digests`."""
        self._refresh_sites()

    # -- sites ----------------------------------------------------------------------------------

    def _refresh_sites(self) -> None:
        rows = self.reader.conn.execute("SELECT site_id, name FROM sites").fetchall()
        new = {sid: name for sid, name in rows if sid not in self._store_names}
        if not new and self._luts:
            return
        self._store_names.update(new)
        for sid, name in self._store_names.items():
            self._name_ids.setdefault(name, sid)
        top = max(self._store_names, default=0)
        if not self.renames and all(normalize_site(n) is n for n in new.values()) and \
                all(normalize_site(n) is n for n in self.site_names.values()):
            # nothing to rename (the agent normalized already): ids are the store's
            self.site_names.update(new)
            identity = np.arange(top + 1, dtype=np.int64)
            self._luts = {"ref": identity, "cand": identity}
            return
        for side in ("ref", "cand"):
            canon, warnings = canonical_sites(self._store_names, self.renames, side)
            for w in warnings:
                if w not in self._warned:
                    self._warned.add(w)
                    self.warnings.append(w)
            lut = np.arange(top + 1, dtype=np.int64)
            for sid, name in canon.items():
                cid = self._name_ids.get(name)
                if cid is None:
                    cid = self._name_ids[name] = max(max(self._name_ids.values(), default=0),
                                                     top) + 1
                lut[sid] = cid
                self.site_names[cid] = name
            self._luts[side] = lut

    def site_lut(self, side: str, max_site: int) -> np.ndarray:
        lut = self._luts[side]
        if max_site >= len(lut):
            self._refresh_sites()
            lut = self._luts[side]
        return lut

    def site_id(self, name: str) -> int | None:
        return self._name_ids.get(name)

    # -- layouts --------------------------------------------------------------------------------

    def layout_code(self, text: str, bits: int) -> int:
        """Code of a piece layout: the layout text and the flag bits of the query."""
        k = (text, bits)
        code = self._layout_ids.get(k)
        if code is None:
            code = self._layout_ids[k] = len(self.pieces)
            dtype, logical, offsets, shape, extra = _split_layout(text)
            self.pieces.append(Piece(
                dtype=dtype, logical_shape=logical, offsets=offsets, shape=shape,
                replica=bool(bits & 16), partial=bool(bits & 8), complex_as_real=bool(bits & 4),
                is_none=bool(bits & 32), **extra))
            self.seeds_ok.append(bool(bits & 1))
            self.has_moments.append(bool(bits & 2))
        return code

    def dtype_code(self, dtype: str) -> int:
        code = self._dtype_ids.get(dtype)
        if code is None:
            code = self._dtype_ids[dtype] = len(self.dtypes)
            self.dtypes.append(dtype)
        return code

    def shape_code(self, shape: tuple, complex_as_real: bool) -> int:
        k = (tuple(shape), complex_as_real)
        code = self._shape_ids.get(k)
        if code is None:
            code = self._shape_ids[k] = len(self.shapes)
            self.shapes.append(k)
        return code

    # -- reading --------------------------------------------------------------------------------

    def load(self, run: str, side: str, *, after_rid: int = 0) -> RunColumns:
        """The run's records (those with record id > after_rid), as sorted columns."""
        run_id = self.reader.run_id(run)
        fs, ss = self.seeds(run_id)
        params = {"run": run_id, "fs": fs, "ss": ss, "after": after_rid}
        if after_rid:
            sql = _SELECT + " WHERE record_id > :after AND run_id = :run"
        else:
            sql = _SELECT + " WHERE run_id = :run" + _KEY_ORDER
        with no_gc():
            arrays = None
            if not after_rid:
                arrays = self._pg_arrays(params) if self._dialect == "postgres" \
                    else self._segment_arrays(run_id, fs, ss)
            if arrays is None:
                rows = self.reader.conn.execute(sql, params).fetchall()
                arrays = _row_arrays(rows)
                del rows
            cols = _columns(self, arrays, run, side)
        if after_rid or (arrays is not None and not arrays.sorted):
            cols.sort()
        conflicted = self.conflicted_rids(run_id, after_rid)
        if len(conflicted) and len(cols):
            cols.flags[np.isin(cols.rid, conflicted)] |= CONFLICT_FLAG
        cols.max_rid = int(cols.rid.max(initial=after_rid))
        return cols

    def load_new(self, run: str, side: str, mark: ReadMark) -> tuple[RunColumns, ReadMark]:
        """The run's records committed since `mark` (see `ReadMark`), and the mark after them."""
        conn = self.reader.conn
        if getattr(self.reader, "dialect", "sqlite") != "postgres":
            cols = self.load(run, side, after_rid=mark.rid)
            return cols, ReadMark(rid=cols.max_rid)
        run_id = self.reader.run_id(run)
        fs, ss = self.seeds(run_id)
        # first the horizon, then the rows (each statement its own snapshot): a transaction
        # older than the horizon had finished, so the rows read next include all of its own
        xmin = max(mark.xmin, int(conn.execute(
            "SELECT txid_snapshot_xmin(txid_current_snapshot())").fetchone()[0]))
        params = {"run": run_id, "fs": fs, "ss": ss, "xid": mark.xmin}
        with no_gc():
            rows = conn.execute(_SELECT + " WHERE run_id = :run AND xid >= :xid",
                                params).fetchall()
            cols = _columns(self, _row_arrays(rows), run, side)
            del rows
        fetched = cols.rid.copy()
        if len(mark.seen):
            cols = cols.take(np.flatnonzero(~np.isin(cols.rid, mark.seen)))
        cols.sort()
        conflicted = np.array([r for (r,) in conn.execute(
            "SELECT DISTINCT c.record_id FROM conflicts c JOIN records r"
            " ON r.record_id = c.record_id WHERE r.run_id = ? AND r.xid >= ?",
            (run_id, mark.xmin)).fetchall()], np.int64)
        if len(conflicted) and len(cols):
            cols.flags[np.isin(cols.rid, conflicted)] |= CONFLICT_FLAG
        cols.max_rid = int(cols.rid.max(initial=0))
        return cols, ReadMark(rid=max(mark.rid, cols.max_rid), xmin=xmin, seen=fetched)

    @property
    def _dialect(self) -> str:
        return getattr(self.reader, "dialect", "sqlite")

    def _pg_arrays(self, params: dict) -> _Arrays | None:
        """A run's records on PostgreSQL in one row: the server packs each `_SELECT` column into
        one bytea (8 big-endian bytes a record) and the layout texts into one text, so the
        client builds no Python object per record. Every aggregate of the row reads the same
        records in the same pass, so the i-th values belong to the same record; lengths that
        disagree (which cannot happen) send the read back to rows. A run too large for one
        value (PostgreSQL caps a value at 1 GB: about 15M records' layout texts) is read in
        blocks of `PG_BLOCK` record ids. None when the run has no records."""
        import psycopg

        try:
            rows = [self._pg_packed(params, "")]
        except (psycopg.errors.ProgramLimitExceeded, psycopg.errors.OutOfMemory):
            lo, hi = self.reader.conn.execute(
                "SELECT MIN(record_id), MAX(record_id) FROM records WHERE run_id = :run",
                params).fetchone()
            rows = [self._pg_packed(params, f" AND record_id >= {a} AND record_id < {a + PG_BLOCK}")
                    for a in range(lo, hi + 1, PG_BLOCK)] if lo is not None else []
        rows = [r for r in rows if r[0]]
        n = sum(int(r[0]) for r in rows)
        if n == 0:
            return None
        A, B, R, fp, rid = (np.concatenate([np.frombuffer(bytes(r[j]), ">i8") for r in rows])
                            .astype(np.int64) for j in range(1, 6))
        lay = [t for r in rows for t in r[6].split("\n")]
        if not all(len(a) == n for a in (A, B, R, fp, rid, lay)):
            return None
        texts: dict[str, int] = dict.fromkeys(lay)
        text_list = list(texts)
        for i, t in enumerate(text_list):
            texts[t] = i
        return _Arrays(A=A, B=B, R=R, texts=text_list,
                       text_code=np.fromiter(map(texts.__getitem__, lay), np.int64, count=n),
                       fp=fp, rid=rid, sorted=False)

    def _pg_packed(self, params: dict, where: str) -> tuple:
        """(count, A, B, R, fingerprints, record ids as packed bytea, layouts) of the run's
        records (and `where`)."""
        packed = ", ".join(f"string_agg(int8send({c}), ''::bytea)"
                           for c in ("a", "b", "r", "fp", "rid"))
        return self.reader.conn.execute(
            f"SELECT COUNT(*), {packed}, string_agg(lay, chr(10)) FROM"
            f" ({_SELECT} WHERE run_id = :run{where}) AS t(a, b, r, lay, fp, rid)",
            params).fetchone()

    def _segment_arrays(self, run_id: int, fs: int, ss: int) -> _Arrays | None:
        """The run's records from its key segments (`auditor.store.key_segments`), computed as
        `_SELECT` computes them from rows; None when the run has no complete set of segments
        (a store from before them, PostgreSQL) or one does not decode (then rows are read)."""
        conn = self.reader.conn
        if not key_segments.complete(conn, run_id):
            return None
        parts, entries = [], {}
        try:
            for (blob,) in conn.execute(
                    "SELECT data FROM segments WHERE run_id = ? ORDER BY segment_id", (run_id,)):
                cols, table = key_segments.decode(blob)
                lut = np.array([entries.setdefault(e, len(entries)) for e in table], np.int64)
                parts.append((cols, lut))
        except key_segments.SegmentError as exc:
            self._warn(f"run_id {run_id}: {exc}; its records were read row by row")
            return None
        self._segmented.add(run_id)
        c = {name: np.concatenate([p[name] for p, _ in parts])
             for name in key_segments.INTS + ("flags",)}
        code = np.concatenate([lut[p["layout"]] for p, lut in parts])
        at = {name: i for i, name in enumerate(key_segments.LAYOUT_COLUMNS)}
        table = list(entries)
        texts = [self._layout_text(e, at) for e in table]
        seeds_ok = np.array([e[at["fingerprint_seed"]] == fs and e[at["sketch_seed"]] == ss
                             for e in table], dtype=np.int64)
        flags = c["flags"].astype(np.int64)

        def bit(mask: int, shift: int) -> np.ndarray:
            return ((flags & mask) != 0).astype(np.int64) << shift

        step, mb, site, idx, call, stage = (c[k] for k in (
            "step", "microbatch", "site_id", "idx", "call", "stage"))
        out_of_range = (step > MAX_STEP) | (mb > MAX_MICROBATCH) | (site > MAX_SITE_ID) | \
            (idx > MAX_INDEX) | (call > MAX_CALL) | (stage > 2147483646)
        R = (c["rank"] << 40) | ((stage + 1) << 8) | bit(key_segments.IS_NONE, 7) | \
            bit(key_segments.REPLICA, 6) | bit(key_segments.PARTIAL, 5) | \
            bit(key_segments.COMPLEX_AS_REAL, 4) | bit(key_segments.HAS_MOMENTS, 3) | \
            (seeds_ok[code] << 2) | bit(key_segments.NONFINITE, 1) | bit(key_segments.ALL_ZERO, 0) | \
            (out_of_range.astype(np.int64) << 39)
        return _Arrays(
            A=(step << 24) | ((mb + 1) << 4) | c["phase"],
            B=(site << 32) | (c["role"] << 28) | (idx << 14) | call,
            R=R, texts=texts, text_code=code, fp=c["fingerprint"], rid=c["record_id"],
            sorted=False)

    def _layout_text(self, entry: tuple, at: dict[str, int]) -> str:
        """The layout text `_SELECT` builds from a record with these layout columns."""
        text = "".join(entry[at[k]] for k in ("dtype", "logical_shape", "offsets", "shape"))
        if entry[at["ragged_parts"]] > 0:
            text += (f"[{entry[at['ragged_first']]},{entry[at['ragged_span']]},"
                     f"{entry[at['ragged_parts']]}]")
        if entry[at["reduce"]] != 0:
            # the weight as the database turns a REAL into text, so that the text is the row
            # path's to the byte
            weight = self.reader.conn.execute(
                "SELECT '' || ?", (float(entry[at["reduce_weight"]]),)).fetchone()[0]
            text += (f"|{entry[at['reduce']]},{entry[at['reduce_index']]},"
                     f"{entry[at['reduce_count']]},{weight}")
        return text

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self.warnings.append(message)

    def conflicted_rids(self, run_id: int, after_rid: int = 0) -> np.ndarray:
        """Record ids of the run whose key was resent by its rank with other content."""
        rows = self.reader.conn.execute(
            "SELECT DISTINCT c.record_id FROM conflicts c JOIN records r"
            " ON r.record_id = c.record_id WHERE r.run_id = ? AND r.record_id > ?",
            (run_id, after_rid)).fetchall()
        return np.array([r for (r,) in rows], np.int64)

    def seeds(self, run_id: int) -> tuple[int, int]:
        """The (fingerprint, sketch) seeds fingerprints must share to be compared: those of the
        first run read that has a record (the reference), else the agent's defaults. Pieces
        digested with other seeds get no exact comparison (their keys say so)."""
        if self._seeds is None:
            row = self.reader.conn.execute(
                "SELECT fingerprint_seed, sketch_seed FROM records WHERE run_id = ? AND"
                " is_none = 0 LIMIT 1", (run_id,)).fetchone()
            if row is None:
                return (fingerprint_to_int64(FINGERPRINT_SEED), fingerprint_to_int64(SKETCH_SEED))
            self._seeds = (int(row[0]), int(row[1]))
        return self._seeds

    @property
    def sketch_seed(self) -> int:
        """The seed (as int64) a sketch must have to be merged and compared: the reference's."""
        return self._seeds[1] if self._seeds is not None else fingerprint_to_int64(SKETCH_SEED)

    def fetch_digests(self, rids: np.ndarray) -> dict[str, np.ndarray]:
        """Moments, counts and sketches of the given records, in the order given.

        Returns float64 arrays keyed by DIGEST_COLUMNS (integer pieces, which have no moments,
        hold the merge identity: sums 0, min +inf, max -inf), "sketch" as an [n, k] array (k the
        longest sketch, shorter ones zero-padded), "sketch_k" (each row's own length) and
        "sketch_seed" (int64: sketches with another seed place elements in other buckets).
        """
        n = len(rids)
        if n == 0:
            out = {c: np.zeros(0) for c in DIGEST_COLUMNS}
            out["sketch"], out["sketch_k"] = np.zeros((0, 0)), np.zeros(0, np.int64)
            out["sketch_seed"] = np.zeros(0, np.int64)
            return out
        uniq = unique(rids)
        with no_gc():
            got_rid, num, blobs, seeds = self._digests_of(uniq)
            if len(got_rid) != len(uniq) or not np.array_equal(got_rid, uniq):
                raise sqlite3.DatabaseError("records vanished from the store while comparing")
            pos = np.searchsorted(got_rid, rids)
            out = {c: num[c][pos] for c in DIGEST_COLUMNS}
            lengths = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)) // 8
        k = int(lengths.max(initial=0))
        if len(lengths) and (lengths == k).all():
            sketch = np.frombuffer(b"".join(blobs), dtype="<f8").reshape(len(blobs), k)
        else:
            sketch = np.zeros((len(blobs), k))
            for j, b in enumerate(blobs):
                sketch[j, :len(b) // 8] = np.frombuffer(b, dtype="<f8")
        out["sketch"] = sketch[pos]
        out["sketch_k"] = lengths[pos]
        out["sketch_seed"] = seeds[pos] if len(seeds) else np.zeros(0, np.int64)
        return out

    def _digests_of(self, uniq: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray], list,
                                                     np.ndarray]:
        """(record ids found, DIGEST_COLUMNS as float64, sketch blobs, sketch seeds) of the
        sorted record ids `uniq`: from `prefetch_digests` and only the sketches from rows when
        it holds them all, else everything from rows."""
        pre = self._prefetched
        if pre is not None:
            prid, pcols = pre
            at = np.minimum(np.searchsorted(prid, uniq), max(len(prid) - 1, 0))
            if len(prid) and np.array_equal(prid[at], uniq):
                got = self._rows_of(uniq, "record_id, sketch")
                cols = list(zip(*got)) if got else [()] * 2
                return (np.array(cols[0], dtype=np.int64),
                        {c: pcols[c][at] for c in DIGEST_COLUMNS}, cols[1],
                        pcols["sketch_seed"][at])
        inf = _infinity(self.reader)
        got = self._rows_of(
            uniq, "record_id, nan, posinf, neginf, zeros, numel, COALESCE(sum, 0.0),"
            f" COALESCE(sum_sq, 0.0), COALESCE(min, {inf}), COALESCE(max, -{inf}),"
            " COALESCE(abs_max, 0.0), sketch, sketch_seed")
        cols = list(zip(*got)) if got else [()] * 13
        return (np.array(cols[0], dtype=np.int64),
                {c: np.array(cols[j], dtype=np.float64)
                 for j, c in enumerate(DIGEST_COLUMNS, start=1)},
                cols[-2], np.array(cols[-1], dtype=np.int64))

    def _rows_of(self, uniq: np.ndarray, columns: str) -> list[tuple]:
        """``SELECT columns FROM records`` for the sorted record ids `uniq`, in record id order
        (the first column must be record_id). Ids close together (a run of keys stored
        together, the common case) are read by ranges, ``record_id BETWEEN a AND b``, with the
        few rows in between dropped; scattered ones by a list of ids (`_ids_in`)."""
        if not len(uniq):
            return []
        cut = np.flatnonzero(np.diff(uniq) > RANGE_GAP) + 1
        starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(uniq)]])
        span = uniq[ends - 1] - uniq[starts] + 1
        dense = span <= 2 * (ends - starts)  # at most as many rows dropped as kept
        got: list[tuple] = []
        conn = self.reader.conn
        for a, b in zip(starts[dense].tolist(), ends[dense].tolist()):
            rows = conn.execute(f"SELECT {columns} FROM records WHERE record_id BETWEEN ? AND ?"
                                " ORDER BY record_id", (int(uniq[a]), int(uniq[b - 1]))).fetchall()
            if len(rows) != b - a:
                want = uniq[a:b]
                rid = np.fromiter((r[0] for r in rows), np.int64, count=len(rows))
                rows = [rows[i] for i in np.flatnonzero(np.isin(rid, want)).tolist()]
            got.extend(rows)
        scattered = np.concatenate([uniq[a:b] for a, b in zip(starts[~dense].tolist(),
                                                             ends[~dense].tolist())] or [uniq[:0]])
        for start in range(0, len(scattered), ID_CHUNK):
            where, param = _ids_in(self.reader, scattered[start:start + ID_CHUNK].tolist())
            got.extend(conn.execute(f"SELECT {columns} FROM records WHERE {where}"
                                    " ORDER BY record_id", param).fetchall())
        if len(scattered) and dense.any():
            got.sort(key=lambda r: r[0])
        return got

    def prefetch_digests(self, rids: np.ndarray) -> None:
        """Take the counts and moments of these records from their runs' key segments, in one
        pass over the segments, so that `fetch_digests` reads only their sketches from rows
        (about 3x cheaper per record). Worth it from `PREFETCH_MIN` records (the pass reads a
        run's every segment); a no-op below that, on PostgreSQL and for runs read from rows.
        `drop_prefetched` frees it."""
        self._prefetched = None
        uniq = unique(rids)
        if not self._segmented or len(uniq) < PREFETCH_MIN:
            return
        at = key_segments.LAYOUT_COLUMNS.index("sketch_seed")
        found: dict[str, list[np.ndarray]] = {c: [] for c in ("record_id", "sketch_seed")
                                             + DIGEST_COLUMNS}
        try:
            for run_id in sorted(self._segmented):
                for (blob,) in self.reader.conn.execute(
                        "SELECT data FROM segments WHERE run_id = ?", (run_id,)):
                    cols, table = key_segments.decode(blob)
                    rid = cols["record_id"]
                    i = np.minimum(np.searchsorted(uniq, rid), len(uniq) - 1)
                    hit = uniq[i] == rid
                    if not hit.any():
                        continue
                    seeds = np.array([e[at] for e in table], dtype=np.int64)
                    found["record_id"].append(rid[hit])
                    found["sketch_seed"].append(seeds[cols["layout"][hit]])
                    for c in DIGEST_COLUMNS:
                        found[c].append(cols[c][hit].astype(np.float64))
        except key_segments.SegmentError:
            return  # rows are read instead (the load already warned about this segment)
        if not found["record_id"]:
            return
        rid = np.concatenate(found["record_id"])
        order = np.argsort(rid, kind="stable")
        self._prefetched = (rid[order], {c: np.concatenate(v)[order] for c, v in found.items()
                                         if c != "record_id"})

    def drop_prefetched(self) -> None:
        self._prefetched = None

    def payload_rids(self, rids: np.ndarray) -> set[int]:
        """Which of these records have a complete payload stored."""
        found: set[int] = set()
        uniq = unique(rids)
        for start in range(0, len(uniq), ID_CHUNK):
            where, param = _ids_in(self.reader, uniq[start:start + ID_CHUNK].tolist())
            found.update(r for (r,) in self.reader.conn.execute(
                f"SELECT record_id FROM payload_chunks WHERE {where} GROUP BY record_id"
                " HAVING COUNT(*) = MAX(chunk_count)", param))
        return found


def _split_layout(text: str) -> tuple[str, tuple, tuple, tuple, dict]:
    """``float32[8, 4][0, 0][4, 4]`` → dtype, logical shape, offsets, shape (JSON lists), and
    further `Piece` fields: ``ragged`` (first, span, parts) from a fourth list ``[1,1,2]``, the
    reduction fields from a ``|reduce,index,count,weight`` suffix."""
    extra: dict = {}
    if "|" in text:
        text, tail = text.split("|", 1)
        kind, index, count, weight = tail.split(",")
        extra = dict(reduce=int(kind), reduce_index=int(index), reduce_count=int(count),
                     reduce_weight=float(weight))
    i = text.index("[")
    parts = text[i + 1:-1].split("][")
    if len(parts) not in (3, 4):
        raise ValueError(f"layout {text!r} is not dtype + three JSON lists (+ ragged parts)")
    logical, offsets, shape = (tuple(json.loads(f"[{p}]")) for p in parts[:3])
    if len(parts) == 4:
        extra["ragged"] = tuple(json.loads(f"[{parts[3]}]"))
    return text[:i], logical, offsets, shape, extra


@dataclass
class _Arrays:
    """A run's records as read, before interning: packed keys and bits as the SQL of `_SELECT`
    computes them, each record's layout text as an index into `texts`."""

    A: np.ndarray
    B: np.ndarray
    R: np.ndarray
    texts: list[str]
    text_code: np.ndarray
    fp: np.ndarray
    rid: np.ndarray
    sorted: bool = True
    """Whether the records come in (key, rank) order."""


def _row_arrays(rows: list[tuple]) -> _Arrays | None:
    """`_SELECT` rows as arrays."""
    if not rows:
        return None
    n = len(rows)
    A, B, R, lay, fp, rid = zip(*rows)
    texts: dict[str, int] = dict.fromkeys(lay)  # distinct layouts, at C speed
    text_list = list(texts)
    for i, t in enumerate(text_list):
        texts[t] = i
    return _Arrays(
        A=np.fromiter(A, dtype=np.int64, count=n), B=np.fromiter(B, dtype=np.int64, count=n),
        R=np.fromiter(R, dtype=np.int64, count=n), texts=text_list,
        text_code=np.fromiter(map(texts.__getitem__, lay), dtype=np.int64, count=n),
        fp=np.fromiter(fp, dtype=np.int64, count=n), rid=np.fromiter(rid, dtype=np.int64, count=n))


def _columns(cat: Catalog, arrays: _Arrays | None, run: str, side: str) -> RunColumns:
    if arrays is None:
        return RunColumns.empty(run, side)
    R = arrays.R
    if np.any(R & (1 << 39)):
        raise KeyRangeError(
            f"run {run!r}: a key field is beyond the comparable range (step <= {MAX_STEP}, "
            f"microbatch <= {MAX_MICROBATCH}, index and call <= {MAX_CALL})")
    text_list, tcode = arrays.texts, arrays.text_code
    combo = tcode * 64 + ((R >> 2) & 0x3F)
    uniq, inv = np.unique(combo, return_inverse=True)
    codes = np.array([cat.layout_code(text_list[u >> 6], int(u & 0x3F)) for u in uniq.tolist()],
                     dtype=np.int32)
    cols = RunColumns(
        name=run, side=side,
        A=arrays.A,
        B=arrays.B,
        rank=(R >> 40).astype(np.int32),
        stage=(((R >> 8) & 0x7FFFFFFF) - 1).astype(np.int32),
        flags=(R & 3).astype(np.uint8),
        layout=codes[inv.reshape(-1)],
        fp=arrays.fp.view(np.uint64),
        rid=arrays.rid,
    )
    site = cols.B >> 32
    lut = cat.site_lut(side, int(site.max()))
    canon = lut[site]
    if np.any(canon != site):
        cols.B = (canon << 32) | (cols.B & 0xFFFFFFFF)
        cols.sort()
    return cols
