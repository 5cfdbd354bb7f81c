"""Records as columns: the one in-memory form of a batch's records, and its wire form.

`RecordColumns` holds n records as numpy arrays (row i of every column is record i). Every path
that carries records uses it: the agent builds it from the capture's rows, the wire carries it as
`PackedRecords` (`to_packed` / `from_packed`: little-endian arrays in `bytes` fields, read
zero-copy), per-record batches of older agents and spools convert to it (wire/record_form.py),
batches are built of it and read into it (wire/batches.py), and the daemon validates, hashes
(wire/content_hash.py) and stores it.

No torch, no auditor imports: wire is shared by both ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from numaudit.protos import numaudit_pb2 as pb

IS_NONE, REPLICA, PARTIAL, COMPLEX_AS_REAL, HAS_MOMENTS, FLAT = 1, 2, 4, 8, 16, 32
FLAG_BITS = IS_NONE | REPLICA | PARTIAL | COMPLEX_AS_REAL | HAS_MOMENTS | FLAT

# Per-record numeric columns: (name, little-endian dtype on the wire and in memory).
SCALAR_COLUMNS: tuple[tuple[str, str], ...] = (
    ("site", "<i4"), ("step", "<i8"), ("microbatch", "<i8"), ("phase", "<i4"), ("role", "<i4"),
    ("index", "<i4"), ("call", "<i4"), ("stage", "<i4"), ("flags", "u1"), ("dtype", "<i4"),
    ("ndim", "<i4"), ("reduce", "<i4"), ("reduce_weight", "<f8"), ("reduce_index", "<i4"),
    ("reduce_count", "<i4"), ("ragged_parts", "<i4"), ("ragged_first", "<i4"),
    ("ragged_span", "<i4"), ("numel", "<i8"), ("nan_count", "<i8"), ("posinf_count", "<i8"),
    ("neginf_count", "<i8"), ("zero_count", "<i8"), ("sum", "<f8"), ("sum_sq", "<f8"),
    ("min", "<f8"), ("max", "<f8"), ("abs_max", "<f8"), ("fingerprint", "<u8"),
    ("fingerprint_seed", "<u8"), ("sketch_seed", "<u8"), ("sketch_len", "<i4"),
    ("capture_order", "<i8"), ("sample_dim", "<i4"), ("sample_unit", "<i4"),
    ("sample_count", "<i4"), ("sample_k", "<i4"),
)
_DTYPES = dict(SCALAR_COLUMNS)
SAMPLE_COLUMNS = ("sample_dim", "sample_unit", "sample_count", "sample_k")
"""Record.samples' scalar fields (dim, unit, count, sketch_k); its values and fingerprints are
`RecordColumns.sample_values` and `sample_fps`."""
NOT_CONTENT = frozenset({"capture_order", *SAMPLE_COLUMNS})
"""Columns left out of a record's content hash: when a capture was made is not what it says
(a record resent with or without its number, by this build or an earlier one, is a
duplicate, not a conflict), and neither are its sample digests (derived from the same values:
a resend by an agent of an earlier build, without them, is a duplicate too)."""
MOMENTS = ("sum", "sum_sq", "min", "max", "abs_max")
COUNTS = ("numel", "nan_count", "posinf_count", "neginf_count", "zero_count")


class PackedFormatError(ValueError):
    """A PackedRecords message whose arrays do not fit together. `field`, `why` as validation's."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field, self.why = field, why


@dataclass(slots=True)
class PayloadChunk:
    """A payload chunk as a sender holds it until its batch is built: `Payload`'s fields, set
    into the batch message once (:func:`put_payload`). A `Payload` built first was copied into
    the message again, its data included (the logits of the DS3-style model: ~4 MB a step)."""

    codec: str
    raw_nbytes: int
    compressed_nbytes: int
    crc32: int
    chunk_index: int
    chunk_count: int
    data: bytes | memoryview
    """A view where the payload travels raw (the agent's host copy, kept alive by it)."""


def put_payload(dst: pb.Payload, p: pb.Payload | PayloadChunk) -> None:
    """Fill the empty message `dst` with payload chunk `p`."""
    if type(p) is not PayloadChunk:
        dst.CopyFrom(p)
        return
    dst.codec, dst.raw_nbytes, dst.compressed_nbytes = p.codec, p.raw_nbytes, p.compressed_nbytes
    dst.crc32, dst.chunk_index, dst.chunk_count = p.crc32, p.chunk_index, p.chunk_count
    dst.data = p.data if type(p.data) is bytes else bytes(p.data)


@dataclass
class RecordColumns:
    """n records as columns. Arrays are read-only views when they come from the wire."""

    n: int
    cols: dict[str, np.ndarray]
    """The SCALAR_COLUMNS, each of length n."""
    sites: list[str]
    dtypes: list[str]
    dims: np.ndarray
    """int64, per record logical_shape, offsets, shape (ndim each), concatenated."""
    sketch: np.ndarray
    """float64, every record's sketch concatenated (sketch_len each)."""
    payloads: dict[int, pb.Payload | PayloadChunk] = field(default_factory=dict)
    """Row -> its payload chunk, for the records that carry one (a PayloadChunk where the agent
    built it)."""
    parts: list[tuple[int, str]] = field(default_factory=lambda: [(0, "records")])
    """(first row, name) of each part, for naming a row in errors: "packed", "records"."""
    unfit: dict[int, pb.Record] = field(default_factory=dict)
    """Row -> the per-record message, for records that columns cannot hold as sent (layout
    lists of different lengths; a dtype on an is_none record): their row has no dims;
    validation refuses them from this message."""
    sample_values: np.ndarray = field(default_factory=lambda: np.zeros(0, "<f8"))
    """float64, every record's SampleDigests.values concatenated (`sample_units` x (5 + k))."""
    sample_fps: np.ndarray = field(default_factory=lambda: np.zeros(0, "<u8"))
    """uint64, every record's SampleDigests.fingerprints concatenated (`sample_units` each)."""

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["cols"][name]
        except KeyError:
            raise AttributeError(name) from None

    def where(self, row: int) -> str:
        """The record's name in errors: `packed[i]` or `records[i]`."""
        start, name = 0, "records"
        for s, label in self.parts:
            if row >= s:
                start, name = s, label
        return f"{name}[{row - start}]"

    def flag(self, bit: int) -> np.ndarray:
        return (self.cols["flags"] & bit) != 0

    def dim_starts(self) -> np.ndarray:
        """Index in `dims` where each record's logical_shape starts (n + 1 entries)."""
        out = np.zeros(self.n + 1, np.int64)
        np.cumsum(self.cols["ndim"].astype(np.int64) * 3, out=out[1:])
        return out

    def sketch_starts(self) -> np.ndarray:
        out = np.zeros(self.n + 1, np.int64)
        np.cumsum(self.cols["sketch_len"].astype(np.int64), out=out[1:])
        return out

    def sample_units(self) -> np.ndarray:
        """Units of each record's sample digests: ceil(count / unit) where sample_k > 0 (0
        without, and where unit or count is not positive: validation refuses those)."""
        return sample_units(self.cols)

    def sample_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """(index in `sample_values`, index in `sample_fps`) where each record's samples start
        (n + 1 entries each)."""
        units = self.sample_units()
        width = np.maximum(self.cols["sample_k"].astype(np.int64), 0) + 5
        v, f = np.zeros(self.n + 1, np.int64), np.zeros(self.n + 1, np.int64)
        np.cumsum(units * width, out=v[1:])
        np.cumsum(units, out=f[1:])
        return v, f

    def layout_of(self, row: int) -> tuple[list[int], list[int], list[int]]:
        """(logical_shape, offsets, shape) of one record."""
        nd = int(self.cols["ndim"][row])
        s = int(self.dim_starts()[row]) if self.n < 64 else int(3 * self.cols["ndim"][:row].sum())
        d = self.dims[s:s + 3 * nd].tolist()
        return d[:nd], d[nd:2 * nd], d[2 * nd:]

    def repeated_rows(self) -> set[int]:
        """Rows carrying a later chunk of a payload whose first chunk is in these columns too:
        each repeats that record's key and content (the store keeps the record once, with
        every chunk), so the store counts and flags the record with its first row only. A
        later chunk that travels without its first is counted as the record it belongs to."""
        later = [row for row, p in self.payloads.items() if p.chunk_index > 0]
        if not later:
            return set()
        firsts = {self._key(row) for row, p in self.payloads.items() if p.chunk_index == 0}
        return {row for row in later if self._key(row) in firsts}

    def _key(self, row: int) -> tuple:
        c = self.cols
        return (self.sites[int(c["site"][row])] if self.sites else None,
                *(int(c[name][row]) for name in ("step", "microbatch", "phase", "role",
                                                  "index", "call")))

    def captures(self) -> int:
        """Rows less the later chunks of a payload: each capture once, in the batch that carries
        its first chunk (see batch_capture_count)."""
        return self.n - sum(1 for p in self.payloads.values() if p.chunk_index > 0)

    @property
    def record_bytes(self) -> int:
        """Bytes of the record columns (what a bench counts as record bytes)."""
        return (sum(a.nbytes for a in self.cols.values()) + self.dims.nbytes + self.sketch.nbytes
                + self.sample_values.nbytes + self.sample_fps.nbytes
                + sum(len(p.data) for p in self.payloads.values()))


def sample_units(cols: dict[str, np.ndarray]) -> np.ndarray:
    """`RecordColumns.sample_units` of a dict of columns."""
    k, unit = cols["sample_k"].astype(np.int64), cols["sample_unit"].astype(np.int64)
    count = cols["sample_count"].astype(np.int64)
    ok = (k > 0) & (unit > 0) & (count > 0)
    return np.where(ok, -(-count // np.where(ok, unit, 1)), 0)


def empty() -> RecordColumns:
    return RecordColumns(0, {k: np.zeros(0, t) for k, t in SCALAR_COLUMNS}, [], [],
                         np.zeros(0, "<i8"), np.zeros(0, "<f8"))


# -- packed wire form -----------------------------------------------------------------------------

def to_packed(c: RecordColumns, into: pb.PackedRecords | None = None) -> pb.PackedRecords:
    """The wire form, payloads included (`PackedRecords.payloads`: for a peer that said
    packed_payloads; `payloads_apart` moves them out for one that did not). `into`: an empty
    message to fill (a batch's `packed` field: no copy of the columns and payloads after)."""
    msg = pb.PackedRecords() if into is None else into
    msg.count = c.n
    msg.sites.extend(c.sites)
    msg.dtypes.extend(c.dtypes)
    for name, dt in SCALAR_COLUMNS:
        a = c.cols[name]
        if a.any():  # an all-zero column travels empty
            setattr(msg, name, np.ascontiguousarray(a, dt).tobytes())
    msg.dims = np.ascontiguousarray(c.dims, "<i8").tobytes()
    msg.sketch = np.ascontiguousarray(c.sketch, "<f8").tobytes()
    if len(c.sample_values) or len(c.sample_fps):
        msg.sample_values = np.ascontiguousarray(c.sample_values, "<f8").tobytes()
        msg.sample_fingerprints = np.ascontiguousarray(c.sample_fps, "<u8").tobytes()
    if c.payloads:
        add = msg.payloads.add
        for row in sorted(c.payloads):
            put_payload(add(row=row).payload, c.payloads[row])
    return msg


def from_packed(msg: pb.PackedRecords, label: str = "packed") -> RecordColumns:
    """Columns over the message's bytes (no copy). PackedFormatError when arrays do not fit."""
    n = msg.count
    if n < 0:
        raise PackedFormatError(f"{label}.count", f"{n} is negative")
    cols: dict[str, np.ndarray] = {}
    for name, dt in SCALAR_COLUMNS:
        raw = getattr(msg, name)
        if not raw:
            cols[name] = np.zeros(n, dt)
            continue
        size = np.dtype(dt).itemsize
        if len(raw) != n * size:
            raise PackedFormatError(f"{label}.{name}", f"{len(raw)} bytes; count {n} x {size} "
                                                       f"bytes ({np.dtype(dt).name}) = {n * size}")
        cols[name] = np.frombuffer(raw, dt)
    c = RecordColumns(n, cols, list(msg.sites), list(msg.dtypes),
                      _array(msg.dims, "<i8", f"{label}.dims"),
                      _array(msg.sketch, "<f8", f"{label}.sketch"), parts=[(0, label)])
    want = int(cols["ndim"].astype(np.int64).sum()) * 3 if n else 0
    if (cols["ndim"] < 0).any():
        i = int(np.flatnonzero(cols["ndim"] < 0)[0])
        raise PackedFormatError(f"{label}[{i}].layout.logical_shape",
                                f"ndim {int(cols['ndim'][i])} is negative")
    if len(c.dims) != want:
        raise PackedFormatError(f"{label}.dims", f"{len(c.dims)} values; 3 x sum(ndim) = {want}")
    if (cols["sketch_len"] < 0).any():
        i = int(np.flatnonzero(cols["sketch_len"] < 0)[0])
        raise PackedFormatError(f"{label}[{i}].digest.sketch",
                                f"sketch_len {int(cols['sketch_len'][i])} is negative")
    want = int(cols["sketch_len"].astype(np.int64).sum())
    if len(c.sketch) != want:
        raise PackedFormatError(f"{label}.sketch", f"{len(c.sketch)} values; sum(sketch_len) = "
                                                   f"{want}")
    c.sample_values = _array(msg.sample_values, "<f8", f"{label}.sample_values")
    c.sample_fps = _array(msg.sample_fingerprints, "<u8", f"{label}.sample_fingerprints")
    want_v, want_f = (int(a[-1]) for a in c.sample_starts())
    for name, have, want in (("sample_values", len(c.sample_values), want_v),
                             ("sample_fingerprints", len(c.sample_fps), want_f)):
        if have != want:
            raise PackedFormatError(f"{label}.{name}", f"{have} values; the records' sample "
                                                       f"digests hold {want}")
    check_tables(c, PackedFormatError)  # before tables of several parts are merged
    for j, pp in enumerate(msg.payloads):
        if not 0 <= pp.row < n:
            raise PackedFormatError(f"{label}.payloads[{j}].row",
                                    f"{pp.row} is not a record of this message (count {n})")
        if pp.row in c.payloads:
            raise PackedFormatError(f"{label}.payloads[{j}].row",
                                    f"record {pp.row} already has a payload chunk")
        c.payloads[pp.row] = pp.payload
    return c


def check_tables(c: RecordColumns, error: type = PackedFormatError) -> None:
    """Indices inside the site and dtype tables (dtype: not for is_none records), no unknown
    flag bits: what only a packed record can get wrong. Raises error(field, why)."""
    cols = c.cols
    for name, table, what in (("site", c.sites, "site table"), ("dtype", c.dtypes, "dtype table")):
        idx = cols[name]
        bad = (idx < 0) | (idx >= len(table))
        if name == "dtype":
            bad &= (cols["flags"] & IS_NONE) == 0
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            field = "key.site" if name == "site" else "layout.dtype"
            raise error(f"{c.where(i)}.{field}",
                        f"index {int(idx[i])} is not in the {what} ({len(table)} entries)")
    bad = (cols["flags"] & ~np.uint8(FLAG_BITS)) != 0
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise error(f"{c.where(i)}.flags", f"{int(cols['flags'][i])} has bits other than "
                                           f"{FLAG_BITS} set")


def _array(raw: bytes, dt: str, where: str) -> np.ndarray:
    size = np.dtype(dt).itemsize
    if len(raw) % size:
        raise PackedFormatError(where, f"{len(raw)} bytes is not a whole number of "
                                       f"{size}-byte values")
    return np.frombuffer(raw, dt)


def concat(parts: Sequence[RecordColumns]) -> RecordColumns:
    """One RecordColumns of several (site and dtype tables merged; rows keep their names)."""
    parts = [p for p in parts if p.n] or list(parts[:1]) or [empty()]
    if len(parts) == 1:
        return parts[0]
    sites: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    cols: dict[str, list[np.ndarray]] = {name: [] for name, _ in SCALAR_COLUMNS}
    payloads: dict[int, pb.Payload | PayloadChunk] = {}
    unfit: dict[int, pb.Record] = {}
    names: list[tuple[int, str]] = []
    base = 0
    for p in parts:
        smap = np.array([sites.setdefault(s, len(sites)) for s in p.sites] or [0], np.int32)
        dmap = np.array([dtypes.setdefault(d, len(dtypes)) for d in p.dtypes] or [0], np.int32)
        for name, _ in SCALAR_COLUMNS:
            a = p.cols[name]
            if name == "site":
                a = smap[np.clip(a, 0, len(smap) - 1)] if p.sites else a
            elif name == "dtype":
                a = dmap[np.clip(a, 0, len(dmap) - 1)] if p.dtypes else a
            cols[name].append(a)
        payloads.update({base + i: v for i, v in p.payloads.items()})
        unfit.update({base + i: v for i, v in p.unfit.items()})
        names.extend((base + s, label) for s, label in p.parts)
        base += p.n
    return RecordColumns(base, {name: np.concatenate(v).astype(_DTYPES[name], copy=False)
                                for name, v in cols.items()},
                         list(sites), list(dtypes), np.concatenate([p.dims for p in parts]),
                         np.concatenate([p.sketch for p in parts]), payloads, names, unfit,
                         np.concatenate([p.sample_values for p in parts]),
                         np.concatenate([p.sample_fps for p in parts]))


def take(c: RecordColumns, rows: np.ndarray) -> RecordColumns:
    """The records at `rows`, in that order (tables kept)."""
    rows = np.asarray(rows, np.int64)
    ds, ss = c.dim_starts(), c.sketch_starts()
    dim_idx = _ranges(ds[rows], ds[rows + 1])
    sk_idx = _ranges(ss[rows], ss[rows + 1])
    pos = {int(r): i for i, r in enumerate(rows.tolist())}
    out = RecordColumns(len(rows), {k: v[rows] for k, v in c.cols.items()}, c.sites, c.dtypes,
                        c.dims[dim_idx], c.sketch[sk_idx],
                        {pos[r]: p for r, p in c.payloads.items() if r in pos})
    if len(c.sample_values) or len(c.sample_fps):
        sv, sf = c.sample_starts()
        out.sample_values = c.sample_values[_ranges(sv[rows], sv[rows + 1])]
        out.sample_fps = c.sample_fps[_ranges(sf[rows], sf[rows + 1])]
    return out


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, e) for each pair, vectorized."""
    lens = ends - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offs = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens)
    return np.arange(total, dtype=np.int64) + offs
