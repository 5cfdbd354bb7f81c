"""Records as columns: the one in-memory form of a batch's records, and its wire form.

`RecordColumns` holds n records as numpy arrays (row i of every column is record i). Every path
that carries records uses it: the agent builds it from the capture's rows (`ColumnsBuilder`), the
wire carries it as `PackedRecords` (`to_packed` / `from_packed`: little-endian arrays in `bytes`
fields, read zero-copy), per-record batches of older agents and spools convert to it
(`from_records`), and the daemon validates, hashes (`content_hashes`) and stores it.

`content_hashes` is defined on the columns, so a record hashes the same however it travelled
(packed or per record): 128 bits from two independent 64-bit lanes of a keyed mix over the
record's words (key fields, layout, digest, sketch, payload header). It tells a resend from a
conflict; it is not a security boundary (a writer may already store what it likes).

No torch, no auditor imports: wire is shared by both ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


# -- per-record form ------------------------------------------------------------------------------

class ColumnsBuilder:
    """Appends records one at a time (Python values) and makes `RecordColumns` at the end.

    Used by the legacy converter and by the agent, which appends straight from the capture's
    rows: no protobuf message per record.
    """

    def __init__(self) -> None:
        self.vals: dict[str, list] = {name: [] for name, _ in SCALAR_COLUMNS}
        self.dims: list[int] = []
        self.sketch: list[np.ndarray | Sequence[float]] = []
        self.site_ids: dict[str, int] = {}
        self.dtype_ids: dict[str, int] = {}
        self.payloads: dict[int, pb.Payload] = {}
        self.sample_values: list[Sequence[float]] = []
        self.sample_fps: list[Sequence[int]] = []
        self.n = 0

    def site_id(self, site: str) -> int:
        i = self.site_ids.get(site)
        if i is None:
            i = self.site_ids[site] = len(self.site_ids)
        return i

    def dtype_id(self, dtype: str) -> int:
        i = self.dtype_ids.get(dtype)
        if i is None:
            i = self.dtype_ids[dtype] = len(self.dtype_ids)
        return i

    def add(self, values: dict, logical: Sequence[int] = (), offsets: Sequence[int] = (),
            shape: Sequence[int] = (), sketch: Sequence[float] = (),
            payload: pb.Payload | None = None,
            samples: tuple[Sequence[float], Sequence[int]] | None = None) -> int:
        """One record: `values` maps column names (site and dtype as strings) to values; absent
        columns are 0; `samples`: its sample digests' values and fingerprints (the scalar
        fields in `values`). Returns its row."""
        row = self.n
        v = self.vals
        for name, col in v.items():
            if name == "site":
                col.append(self.site_id(values["site"]))
            elif name == "dtype":
                col.append(self.dtype_id(values.get("dtype", "")))
            elif name == "ndim":
                col.append(len(logical))
            elif name == "sketch_len":
                col.append(len(sketch))
            else:
                col.append(values.get(name, 0))
        self.dims.extend(logical)
        self.dims.extend(offsets)
        self.dims.extend(shape)
        if len(sketch):
            self.sketch.append(sketch)
        if payload is not None:
            self.payloads[row] = payload
        if samples is not None:
            self.sample_values.append(samples[0])
            self.sample_fps.append(samples[1])
        self.n += 1
        return row

    def build(self) -> RecordColumns:
        cols = {name: np.array(self.vals[name], dt) if self.n else np.zeros(0, dt)
                for name, dt in SCALAR_COLUMNS}
        sketch = (np.concatenate([np.asarray(s, "<f8") for s in self.sketch]) if self.sketch
                  else np.zeros(0, "<f8"))
        out = RecordColumns(self.n, cols, list(self.site_ids), list(self.dtype_ids),
                            np.array(self.dims, "<i8"), sketch, dict(self.payloads))
        if self.sample_values:
            out.sample_values = np.concatenate([np.asarray(v, "<f8") for v in self.sample_values])
            out.sample_fps = np.concatenate([np.asarray(f, np.uint64).astype("<u8")
                                             for f in self.sample_fps])
        return out


def _u64(x: int) -> int:
    return x & 0xFFFFFFFFFFFFFFFF


def from_records(records: Iterable[pb.Record], label: str = "records") -> RecordColumns:
    """Columns of per-record messages (older agents, spools, payload records)."""
    b = ColumnsBuilder()
    unfit: dict[int, pb.Record] = {}
    for r in records:
        k, lay, d = r.key, r.layout, r.digest
        logical, offsets, shape = lay.logical_shape, lay.offsets, lay.shape
        if not len(logical) == len(offsets) == len(shape) or (r.is_none and lay.dtype):
            unfit[b.n] = r
            logical = offsets = shape = ()
        samples = None
        if r.HasField("samples"):
            smp = r.samples
            units = sample_units({"sample_k": np.array([smp.sketch_k]),
                                  "sample_unit": np.array([smp.unit]),
                                  "sample_count": np.array([smp.count])})[0]
            if len(smp.values) == units * (5 + max(smp.sketch_k, 0)) and \
                    len(smp.fingerprints) == units:
                samples = (smp.values, smp.fingerprints)
            else:  # lists that do not fit its fields: refused from its message
                unfit[b.n] = r
        flags = ((IS_NONE if r.is_none else 0) | (REPLICA if lay.replica else 0)
                 | (PARTIAL if lay.partial else 0) | (COMPLEX_AS_REAL if lay.complex_as_real else 0)
                 | (HAS_MOMENTS if d.has_moments else 0) | (FLAT if lay.flat else 0))
        b.add({"site": k.site, "step": k.step, "microbatch": k.microbatch, "phase": k.phase,
               "role": k.role, "index": k.index, "call": k.call, "stage": r.stage, "flags": flags,
               "dtype": lay.dtype, "reduce": lay.reduce, "reduce_weight": lay.reduce_weight,
               "reduce_index": lay.reduce_index, "reduce_count": lay.reduce_count,
               "ragged_parts": lay.ragged_parts, "ragged_first": lay.ragged_first,
               "ragged_span": lay.ragged_span, "numel": d.numel, "nan_count": d.nan_count,
               "posinf_count": d.posinf_count, "neginf_count": d.neginf_count,
               "zero_count": d.zero_count, "sum": d.sum, "sum_sq": d.sum_sq, "min": d.min,
               "max": d.max, "abs_max": d.abs_max, "fingerprint": d.fingerprint,
               "fingerprint_seed": d.fingerprint_seed, "sketch_seed": d.sketch_seed,
               **({"sample_dim": r.samples.dim, "sample_unit": r.samples.unit,
                   "sample_count": r.samples.count, "sample_k": r.samples.sketch_k}
                  if samples is not None else {}),
               "capture_order": r.capture_order},
              logical, offsets, shape, d.sketch,
              r.payload if r.HasField("payload") else None, samples)
    c = b.build()
    c.parts = [(0, label)]
    c.unfit = unfit
    return c


def to_records(c: RecordColumns, into=None) -> list[pb.Record]:
    """Per-record messages of the columns (for a peer that does not take packed batches).

    `into`: a repeated Record field (``RecordBatch.records``) to build them in, in place (no
    copy of each message, payload bytes included, by a later ``extend``); returns it then."""
    out = [] if into is None else into
    new_record = pb.Record if into is None else into.add
    cols = {name: a.tolist() for name, a in c.cols.items()}
    starts, sk = c.dim_starts().tolist(), c.sketch_starts().tolist()
    dims, sketch = c.dims.tolist(), c.sketch
    sv, sf = c.sample_starts()
    for i in range(c.n):
        r = new_record(stage=cols["stage"][i], is_none=bool(cols["flags"][i] & IS_NONE),
                       capture_order=cols["capture_order"][i])
        k = r.key
        k.step, k.microbatch, k.phase = cols["step"][i], cols["microbatch"][i], cols["phase"][i]
        k.site, k.role = c.sites[cols["site"][i]], cols["role"][i]
        k.index, k.call = cols["index"][i], cols["call"][i]
        f = cols["flags"][i]
        # An is_none record's layout and digest are filled too (zeros leave them empty), so
        # that a packed record that breaks "empty when is_none" is refused as a Record would be.
        lay, d = r.layout, r.digest
        nd, s = cols["ndim"][i], starts[i]
        lay.logical_shape.extend(dims[s:s + nd])
        lay.offsets.extend(dims[s + nd:s + 2 * nd])
        lay.shape.extend(dims[s + 2 * nd:s + 3 * nd])
        lay.replica, lay.partial = bool(f & REPLICA), bool(f & PARTIAL)
        lay.complex_as_real, lay.flat = bool(f & COMPLEX_AS_REAL), bool(f & FLAT)
        if not f & IS_NONE:
            lay.dtype = c.dtypes[cols["dtype"][i]] if c.dtypes else ""
        for name in ("reduce", "reduce_weight", "reduce_index", "reduce_count",
                     "ragged_parts", "ragged_first", "ragged_span"):
            setattr(lay, name, cols[name][i])
        for name in COUNTS + MOMENTS + ("fingerprint", "fingerprint_seed", "sketch_seed"):
            setattr(d, name, cols[name][i])
        d.has_moments = bool(f & HAS_MOMENTS)
        d.sketch.extend(sketch[sk[i]:sk[i + 1]].tolist())
        if cols["sample_k"][i] or cols["sample_unit"][i] or cols["sample_count"][i] \
                or cols["sample_dim"][i]:
            smp = r.samples
            smp.dim, smp.unit = cols["sample_dim"][i], cols["sample_unit"][i]
            smp.count, smp.sketch_k = cols["sample_count"][i], cols["sample_k"][i]
            smp.values.extend(c.sample_values[sv[i]:sv[i + 1]].tolist())
            smp.fingerprints.extend(c.sample_fps[sf[i]:sf[i + 1]].tolist())
        if f & IS_NONE:
            for name in ("layout", "digest"):
                if not getattr(r, name).ByteSize():
                    r.ClearField(name)
        if i in c.payloads:
            put_payload(r.payload, c.payloads[i])
        if into is None:
            out.append(r)
    return out


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


def batch_columns(batch: pb.RecordBatch) -> RecordColumns:
    """The records of a batch, packed ones first, then the per-record ones."""
    parts = []
    if batch.HasField("packed"):
        parts.append(from_packed(batch.packed))
    if len(batch.records) or not parts:
        parts.append(from_records(batch.records))
    return concat(parts)


def batch_record_count(batch: pb.RecordBatch) -> int:
    """Records a batch carries (packed and per record), without converting anything. A payload
    in several chunks is a record per chunk here (what the batch limits count); see
    :func:`batch_capture_count`."""
    return len(batch.records) + (batch.packed.count if batch.HasField("packed") else 0)


def batch_capture_count(batch: pb.RecordBatch) -> int:
    """Captures a batch carries: its records less the later chunks of a payload (each chunk
    travels as a record of the same key; the store keeps one record). What an agent's or
    sidecar's delivery counts, so that captured = acked + spooled + dropped holds with chunked
    payloads too."""
    later = sum(1 for r in batch.records if r.payload.chunk_index > 0)
    if batch.HasField("packed"):
        later += sum(1 for p in batch.packed.payloads if p.payload.chunk_index > 0)
    return batch_record_count(batch) - later


def packed_batch(session_id: str, seq: int, cols: RecordColumns) -> pb.RecordBatch:
    """A batch carrying `cols`: packed, with the payload records per record, checksum set."""
    single = sorted(set(cols.payloads) | set(cols.unfit))
    if not single:
        return split_batch(session_id, seq, cols, None)
    if not cols.unfit:
        keep = np.ones(cols.n, bool)
        keep[single] = False
        return split_batch(session_id, seq, take(cols, np.flatnonzero(keep)),
                           take(cols, np.array(single)))
    msg = pb.RecordBatch(schema_version=pb.SCHEMA_VERSION_1, session_id=session_id, seq=seq)
    keep = np.ones(cols.n, bool)
    keep[single] = False
    rest = take(cols, np.flatnonzero(keep))
    rebuilt = to_records(take(cols, np.array(single)))
    msg.records.extend(cols.unfit.get(row, r) for row, r in zip(single, rebuilt))
    return _finish_batch(msg, rest)


def split_batch(session_id: str, seq: int, packed: RecordColumns,
                single: RecordColumns | None, *, checksum: bool = True) -> pb.RecordBatch:
    """A batch of `packed` records and `single` ones sent per record (those carrying a
    payload), given apart: what packed_batch sends, without taking them out of one
    RecordColumns first (the agent keeps them apart from the start). Checksum set unless
    `checksum` is False (for a caller that sums the bytes it sends itself)."""
    msg = pb.RecordBatch(schema_version=pb.SCHEMA_VERSION_1, session_id=session_id, seq=seq)
    if single is not None and single.n:
        to_records(single, into=msg.records)
    return _finish_batch(msg, packed, checksum)


def _finish_batch(msg: pb.RecordBatch, packed: RecordColumns,
                  checksum: bool = True) -> pb.RecordBatch:
    from numaudit.wire.checksum import batch_checksum

    if packed.n:
        to_packed(packed, into=msg.packed)
    if checksum:
        msg.records_crc32 = batch_checksum(msg)
    return msg


def for_peer(batch: pb.RecordBatch, packed_batches: bool, packed_payloads: bool) -> pb.RecordBatch:
    """The batch as a peer takes it, by what its RegisterResponse (or a sidecar's Ack) said: a
    peer of an earlier build would drop packed records or packed payloads (unknown fields) and
    ack them. PackedFormatError when the packed columns do not fit (nothing to convert)."""
    if not batch.HasField("packed") or (packed_batches and packed_payloads):
        return batch
    return payloads_apart(batch) if packed_batches else unpacked_batch(batch)


def payloads_apart(batch: pb.RecordBatch) -> pb.RecordBatch:
    """The same batch with its packed payload records per record (for a peer that takes packed
    batches but not packed payloads: one of an earlier build would drop them); the batch as it
    is when its packed records carry no payload."""
    if not batch.HasField("packed") or not len(batch.packed.payloads):
        return batch
    from numaudit.wire.checksum import batch_checksum

    moved = packed_batch(batch.session_id, batch.seq, from_packed(batch.packed))
    moved.schema_version = batch.schema_version
    moved.records.extend(batch.records)
    moved.records_crc32 = batch_checksum(moved)
    return moved


def unpacked_batch(batch: pb.RecordBatch) -> pb.RecordBatch:
    """The same batch with every record per record (for a peer without packed batches)."""
    from numaudit.wire.checksum import batch_checksum

    if not batch.HasField("packed"):
        return batch
    out = pb.RecordBatch(schema_version=batch.schema_version, session_id=batch.session_id,
                         seq=batch.seq)
    out.records.extend(to_records(from_packed(batch.packed)))
    out.records.extend(batch.records)
    out.records_crc32 = batch_checksum(out)
    return out


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


# -- content hash ---------------------------------------------------------------------------------

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_LANE_SEEDS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (a bijection of uint64), in place on a fresh array."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


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
