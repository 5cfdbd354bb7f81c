"""Records one message each: the per-record form of `RecordColumns` (wire/packed.py).

Older agents, spools and payload records carry `pb.Record` messages; `from_records` makes columns
of them and `to_records` the messages again. `ColumnsBuilder` appends records as Python values and
makes the columns at the end. No torch, no auditor imports.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.packed import (
    COMPLEX_AS_REAL,
    COUNTS,
    FLAT,
    HAS_MOMENTS,
    IS_NONE,
    MOMENTS,
    PARTIAL,
    REPLICA,
    SCALAR_COLUMNS,
    RecordColumns,
    put_payload,
    sample_units,
)


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
