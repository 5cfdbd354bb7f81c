"""A run's records as numpy columns: the comparison engine's view of the store.

Comparing a million keys must not build a Python object per record field, so the engine reads a
narrow projection of ``records`` (key packed into two integers, the layout as one interned
string, the counts, the fingerprint, the record id and the capture order) and keeps it as arrays
(`auditor.compare.read.reads` reads it: key segments, the packed PostgreSQL read, or rows). Moments
and sketches are read later, and only for the keys whose fingerprints differ.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from numaudit.auditor.compare.digests.algebra import (
    FINGERPRINT_SEED,
    SKETCH_SEED,
    fingerprint_to_int64,
    shift_fingerprint,
)
from numaudit.auditor.compare.read import reads
from numaudit.auditor.compare.read.align import RenameRule, canonical_sites, normalize_site
from numaudit.auditor.compare.read.pieces import Piece
from numaudit.auditor.compare.read.reads import (  # noqa: F401  (DIGEST_COLUMNS, no_gc: re-exported)
    DIGEST_COLUMNS,
    ID_CHUNK,
    KEY_ORDER,
    MAX_CALL,
    MAX_MICROBATCH,
    MAX_STEP,
    SELECT,
    Arrays,
    ids_in,
    no_gc,
    row_arrays,
)
from numaudit.auditor.compare.read.segments import unique
from numaudit.auditor.store import Reader


def translation(old: Piece, new: Piece) -> int | None:
    """``g_new - g_old`` when moving a piece from layout ``old`` to ``new`` adds one constant to
    the global flat index of every element (every dim the piece spans has the same global
    stride in both logical shapes: the dims before the one it moves along hold one index),
    else None. Flat, complex-as-real and None pieces are never moved this way."""
    if (old.is_none or new.is_none or old.flat or new.flat or old.complex_as_real
            or new.complex_as_real or old.shape != new.shape
            or len(old.logical_shape) != len(new.logical_shape)):
        return None
    delta, so, sn = 0, 1, 1
    for d in range(len(old.shape) - 1, -1, -1):
        if old.shape[d] > 1 and so != sn:
            return None
        delta += new.offsets[d] * sn - old.offsets[d] * so
        so *= old.logical_shape[d]
        sn *= new.logical_shape[d]
    return delta


class KeyRangeError(ValueError):
    """A key field beyond what the packed comparison key holds."""


_FIELDS = ("when", "where", "rank", "stage", "flags", "layout", "fp", "rid", "order")
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
    when: np.ndarray
    """Per record, when in training: step << 24 | (microbatch + 1) << 4 | phase (`unpack_when`)."""
    where: np.ndarray
    """Per record, where in the model: site << 32 | role << 28 | index << 14 | call."""
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
    order: np.ndarray | None = None
    """`Record.capture_order` of each piece: where its rank's agent captured it (0: not
    numbered, a record of an earlier build's agent). None when made: all 0."""

    def __post_init__(self) -> None:
        if self.order is None:
            self.order = np.zeros(len(self.when), np.int64)

    def __len__(self) -> int:
        return len(self.when)

    @property
    def numbered(self) -> bool:
        """Every piece carries its capture order (vacuously true without pieces)."""
        assert self.order is not None  # __post_init__ sets it
        return bool((self.order > 0).all())

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
        order = np.lexsort((self.rank, self.where, self.when))
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


def unpack_when(A: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """step, microbatch, phase."""
    return A >> 24, ((A >> 4) & 0xFFFFF) - 1, A & 0xF


def unpack_where(B: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
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
        self.sample_orders: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        """(when, where) of a key re-keyed by `auditor.compare.merge.regroup` for runs whose samples
        lie in other orders → (perm, batch dim): the candidate's row g is the reference's row
        perm[g]; the reference's values are put in the candidate's order before comparing."""
        self.placed: list[bool] = []
        """False for layouts `derived_piece` made for records moved to another place, whose
        fingerprints and sketches describe where they were digested, not where they now lie."""
        self._layout_ids: dict[tuple, int] = {}
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
        """Runs whose records were read from their key segments."""
        self._digests = reads.Digests(reader)
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
                self.warn(w)
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
            self.placed.append(True)
        return code

    def derived_piece(self, piece: Piece, like: int, *, placed: bool,
                      fingerprint: bool = False) -> int:
        """Code of a layout the comparison made itself (a record re-keyed into another run's
        microbatches: auditor.compare.merge.regroup), with the flags of layout ``like`` it replaces;
        ``placed`` False when the record's sketch does not describe the piece at its new place
        (it is then never merged or compared), and neither does its fingerprint unless
        ``fingerprint`` (one `moved` has shifted to the new place)."""
        seeds_ok = self.seeds_ok[like] and (placed or fingerprint)
        has_moments = self.has_moments[like]
        k = (piece, seeds_ok, has_moments, placed)
        code = self._layout_ids.get(k)
        if code is None:
            code = self._layout_ids[k] = len(self.pieces)
            self.pieces.append(piece)
            self.seeds_ok.append(seeds_ok)
            self.has_moments.append(has_moments)
            self.placed.append(placed)
        return code

    def moved(self, piece: Piece, like: int, fp: int, *, exact: bool = True) -> tuple[int, int]:
        """(layout code, fingerprint) of the record of layout ``like`` and fingerprint ``fp``
        put at ``piece``'s place (another offset, or another logical size on the dim it
        moves along). Version-3 fingerprints follow the piece when the move is a translation
        of its global flat indices (`translation`): the fingerprint digested at the new place
        is ``fp * h**delta``. Its sketch never follows (docs/digests.md "Placing pieces after
        the fact"). ``exact`` False: the place is not one the other run's fingerprint can be
        compared at (its rows in another order), the fingerprint is dropped too."""
        delta = translation(self.pieces[like], piece) if exact and self.shiftable(like) else None
        if delta is None:
            return self.derived_piece(piece, like, placed=False), fp
        return (self.derived_piece(piece, like, placed=False, fingerprint=True),
                shift_fingerprint(int(fp), delta))

    def shiftable(self, code: int) -> bool:
        """Whether layout ``code``'s fingerprints can be moved: made with the reference's seeds,
        those of version 3, at the place the record says."""
        return self.seeds_ok[code] and self.placed[code] and self.fingerprints_v3

    @property
    def fingerprints_v3(self) -> bool:
        """The reference's fingerprints are version 3 (geometric keys: movable, and a whole
        tensor's exact power-of-two rescaling predictable: `digests.scaled_fingerprint`)."""
        return self._seeds is not None and \
            self._seeds[0] == fingerprint_to_int64(FINGERPRINT_SEED)

    def dtype_code(self, dtype: str) -> int:
        code = self._dtype_ids.get(dtype)
        if code is None:
            code = self._dtype_ids[dtype] = len(self.dtypes)
            self.dtypes.append(dtype)
        return code

    def shape_code(self, shape: tuple, complex_as_real: bool, flat: bool = False) -> int:
        """Code of a key's logical shape: ``shapes[code]`` is (shape, complex_as_real, flat)."""
        k = (tuple(shape), complex_as_real, flat)
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
            sql = SELECT + " WHERE record_id > :after AND run_id = :run"
        else:
            sql = SELECT + " WHERE run_id = :run" + KEY_ORDER
        with no_gc():
            arrays = None
            if not after_rid and getattr(self.reader, "dialect", "sqlite") == "postgres":
                arrays = reads.pg_arrays(self.reader, params)
            elif not after_rid:
                arrays = reads.segment_arrays(self.reader, run_id, fs, ss, self.warn)
                if arrays is not None:
                    self._segmented.add(run_id)
            if arrays is None:
                rows = self.reader.conn.execute(sql, params).fetchall()
                arrays = row_arrays(rows)
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
            rows = conn.execute(SELECT + " WHERE run_id = :run AND xid >= :xid",
                                params).fetchall()
            cols = _columns(self, row_arrays(rows), run, side)
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

    def warn(self, message: str) -> None:
        """Add a line to the report's warnings (once, however often it is said)."""
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
        """Moments, counts and sketches of the given records, in the order given
        (`reads.Digests.fetch`)."""
        return self._digests.fetch(rids)

    def prefetch_digests(self, rids: np.ndarray) -> None:
        """Counts and moments of many records from the key segments of the runs read from
        them, in one pass (`reads.Digests.prefetch`); `drop_prefetched` frees them."""
        self._digests.prefetch(self._segmented, rids)

    def drop_prefetched(self) -> None:
        self._digests.drop()

    def payload_rids(self, rids: np.ndarray) -> set[int]:
        """Which of these records have a complete payload stored."""
        found: set[int] = set()
        uniq = unique(rids)
        for start in range(0, len(uniq), ID_CHUNK):
            where, param = ids_in(self.reader, uniq[start:start + ID_CHUNK].tolist())
            found.update(r for (r,) in self.reader.conn.execute(
                f"SELECT record_id FROM payload_chunks WHERE {where} GROUP BY record_id"
                " HAVING COUNT(*) = MAX(chunk_count)", param))
        return found


def shape_flags(shapes: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    """Per code of `Catalog.shapes` ((shape, complex_as_real, flat) entries): (flat,
    complex_as_real) as bool arrays, one entry more at the end so that code -1 (no shape) reads
    False."""
    flat = np.array([f for _, _, f in shapes] + [False], bool)
    car = np.array([c for _, c, _ in shapes] + [False], bool)
    return flat, car


def _split_layout(text: str) -> tuple[str, tuple, tuple, tuple, dict]:
    """``float32[8, 4][0, 0][4, 4]`` → dtype, logical shape, offsets, shape (JSON lists), and
    further `Piece` fields: ``ragged`` (first, span, parts) from a fourth list ``[1,1,2]``, the
    reduction fields from a ``|reduce,index,count,weight`` suffix, ``flat`` from a
    `reads.FLAT_PREFIX` (``flat:float32[12][0][5]``)."""
    extra: dict = {}
    if text.startswith(reads.FLAT_PREFIX):
        text = text[len(reads.FLAT_PREFIX):]
        extra["flat"] = True
    if "|" in text:
        text, tail = text.split("|", 1)
        kind, index, count, weight = tail.split(",")
        extra.update(reduce=int(kind), reduce_index=int(index), reduce_count=int(count),
                     reduce_weight=float(weight))
    i = text.index("[")
    parts = text[i + 1:-1].split("][")
    if len(parts) not in (3, 4):
        raise ValueError(f"layout {text!r} is not dtype + three JSON lists (+ ragged parts)")
    logical, offsets, shape = (tuple(json.loads(f"[{p}]")) for p in parts[:3])
    if len(parts) == 4:
        extra["ragged"] = tuple(json.loads(f"[{parts[3]}]"))
    return text[:i], logical, offsets, shape, extra


def _columns(cat: Catalog, arrays: Arrays | None, run: str, side: str) -> RunColumns:
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
        when=arrays.when,
        where=arrays.where,
        rank=(R >> 40).astype(np.int32),
        stage=(((R >> 8) & 0x7FFFFFFF) - 1).astype(np.int32),
        flags=(R & 3).astype(np.uint8),
        layout=codes[inv.reshape(-1)],
        fp=arrays.fp.view(np.uint64),
        rid=arrays.rid,
        order=arrays.order,
    )
    site = cols.where >> 32
    lut = cat.site_lut(side, int(site.max()))
    canon = lut[site]
    if np.any(canon != site):
        cols.where = (canon << 32) | (cols.where & 0xFFFFFFFF)
        cols.sort()
    return cols
