"""Records as columns straight from a host batch: the capture metadata and the digest rows.

`capture_columns` turns the captures of one `HostBatch` and its stacked digest rows (f64
[n, 5 + k]: sum, sum_sq, min, max, abs_max, sketch; i64 [n, 6]: numel, nan, +inf, -inf, zero
counts, fingerprint) into `wire.packed.RecordColumns` with numpy indexing: no protobuf message per
record. Captures whose bytes travel too come back separately (`with_payloads`), one row per
payload chunk, since payload records travel per record.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from agents.digest import FINGERPRINT_SEED, SKETCH_SEED
from wire import limits
from wire.packed import (COMPLEX_AS_REAL, HAS_MOMENTS, IS_NONE, PARTIAL, REPLICA, SCALAR_COLUMNS,
                         RecordColumns)
from protos import numaudit_pb2 as pb

_REDUCE = {"": pb.REDUCTION_NONE, "mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM}


def capture_columns(captures: Sequence, f64: np.ndarray | None,
                    i64: np.ndarray | None) -> RecordColumns:
    """Every capture as one record (payloads not attached)."""
    n = len(captures)
    sites: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    cols: dict[str, np.ndarray] = {}
    cols["site"] = np.array([sites.setdefault(c.site, len(sites)) for c in captures], "<i4")
    for name, attr in (("step", "step"), ("microbatch", "microbatch"), ("phase", "phase"),
                       ("role", "role"), ("index", "index"), ("call", "call"),
                       ("stage", "stage")):
        cols[name] = np.array([getattr(c, attr) for c in captures], dict(SCALAR_COLUMNS)[name])
    none = np.array([c.is_none for c in captures], bool)
    lays = [c.layout if not c.is_none else None for c in captures]
    cols["dtype"] = np.array([0 if c.is_none else dtypes.setdefault(c.dtype, len(dtypes))
                              for c in captures], "<i4")
    flags = np.where(none, IS_NONE, 0).astype(np.uint8)
    flags |= np.array([bool(lay and lay.replica) for lay in lays], bool) * np.uint8(REPLICA)
    flags |= np.array([bool(lay and lay.partial) for lay in lays], bool) * np.uint8(PARTIAL)
    flags |= (np.array([c.complex_as_real and not c.is_none for c in captures], bool)
              * np.uint8(COMPLEX_AS_REAL))
    moments = np.array([c.moments and not c.is_none for c in captures], bool)
    flags |= moments * np.uint8(HAS_MOMENTS)
    cols["flags"] = flags
    dims: list[int] = []
    ndim = []
    for lay in lays:
        if lay is None:
            ndim.append(0)
            continue
        ndim.append(len(lay.logical_shape))
        dims.extend(lay.logical_shape)
        dims.extend(lay.offsets)
        dims.extend(lay.shape)
    cols["ndim"] = np.array(ndim, "<i4")
    red = [lay if lay is not None and lay.reduce else None for lay in lays]
    cols["reduce"] = np.array([_REDUCE[r.reduce] if r else 0 for r in red], "<i4")
    cols["reduce_weight"] = np.array([r.reduce_weight if r else 0.0 for r in red], "<f8")
    cols["reduce_index"] = np.array([r.reduce_index if r else 0 for r in red], "<i4")
    cols["reduce_count"] = np.array([r.reduce_count if r else 0 for r in red], "<i4")
    rag = [lay.ragged if lay is not None and lay.ragged is not None else None for lay in lays]
    cols["ragged_parts"] = np.array([g.parts if g else 0 for g in rag], "<i4")
    cols["ragged_first"] = np.array([g.first if g else 0 for g in rag], "<i4")
    cols["ragged_span"] = np.array([g.span if g else 0 for g in rag], "<i4")
    rows = np.array([c.row for c in captures], np.int64)
    live = ~none
    lr = rows[live]
    k = (f64.shape[1] - 5) if f64 is not None and f64.ndim == 2 else 0
    for j, name in enumerate(("numel", "nan_count", "posinf_count", "neginf_count",
                              "zero_count")):
        a = np.zeros(n, "<i8")
        if len(lr):
            a[live] = i64[lr, j]
        cols[name] = a
    fp = np.zeros(n, "<u8")
    if len(lr):
        fp[live] = i64[lr, 5].astype(np.int64).view(np.uint64)
    cols["fingerprint"] = fp
    cols["fingerprint_seed"] = np.where(live, np.uint64(FINGERPRINT_SEED), np.uint64(0))
    cols["sketch_seed"] = np.where(live, np.uint64(SKETCH_SEED), np.uint64(0))
    mr = rows[moments]
    for j, name in enumerate(("sum", "sum_sq", "min", "max", "abs_max")):
        a = np.zeros(n, "<f8")
        if len(mr):
            a[moments] = f64[mr, j]
        cols[name] = a
    cols["sketch_len"] = np.where(moments, k, 0).astype("<i4")
    sketch = (np.ascontiguousarray(f64[mr, 5:], "<f8").reshape(-1) if len(mr) and k
              else np.zeros(0, "<f8"))
    cols = {name: np.ascontiguousarray(cols[name], dt) for name, dt in SCALAR_COLUMNS}
    return RecordColumns(n, cols, list(sites), list(dtypes), np.array(dims, "<i8"), sketch)


def with_payloads(captures: Sequence, f64: np.ndarray | None, i64: np.ndarray | None,
                  compress) -> tuple[RecordColumns, list[RecordColumns]]:
    """(the records without payload, the payload-carrying records with a row per chunk).

    The second part is one RecordColumns for all of the batch's payloads (a list of at most
    one, empty when none), each part built straight from its captures: a part per payload, cut
    from the whole batch's columns, cost the sender a `take` and a merge per capture, tens of
    them per microbatch. `compress(capture, raw bytes) -> compressed bytes` (zstd: a
    PayloadCompressor). A payload larger than MAX_PAYLOAD_RAW_BYTES is left out: the digest
    still travels.
    """
    plain, chunked, payloads = [], [], {}
    chunk = limits.PAYLOAD_CHUNK_BYTES
    for c in captures:
        p = c.payload
        if p is None or c.is_none or p.numel() * p.element_size() > limits.MAX_PAYLOAD_RAW_BYTES:
            plain.append(c)
            continue
        raw = payload_bytes(p)
        data = compress(c, raw)
        count = max(1, -(-len(data) // chunk))
        crc = zlib.crc32(data)
        for j in range(count):
            payloads[len(chunked)] = pb.Payload(
                codec="zstd", raw_nbytes=raw.nbytes, compressed_nbytes=len(data), crc32=crc,
                chunk_index=j, chunk_count=count, data=data[j * chunk:(j + 1) * chunk])
            chunked.append(c)
    cols = capture_columns(plain, f64, i64)
    if not chunked:
        return cols, []
    piece = capture_columns(chunked, f64, i64)
    piece.payloads = payloads
    return cols, [piece]


class PayloadCompressor:
    """zstd for payloads: level 1 where it pays, a store-speed level where it does not.

    Float payloads barely compress (7 % at level 1), and level 1 costs 35-55 us of setup per
    call even for a few KiB (150 small payloads a step at scale 1 of the DS3-style model) and
    runs at 0.5 GB/s on large ones (its logits: 10 ms a step), against a few us and 7 GB/s at
    level -1. A payload that level 1 shrinks by less than 10 % puts its (phase, site, role) on
    level -1 for its next RETRY payloads; then level 1 is tried again. Both are zstd frames:
    the receiver reads them alike.
    """

    RETRY = 16

    def __init__(self) -> None:
        import zstandard

        self._good = zstandard.ZstdCompressor(level=1, write_content_size=True)
        self._fast = zstandard.ZstdCompressor(level=-1, write_content_size=True)
        self._fast_left: dict[tuple, int] = {}

    def __call__(self, capture, raw) -> bytes:
        key = (capture.phase, capture.site, capture.role)
        left = self._fast_left.get(key, 0)
        if left:
            self._fast_left[key] = left - 1
            return self._fast.compress(raw)
        data = self._good.compress(raw)
        if len(data) > 0.9 * raw.nbytes:
            if len(self._fast_left) >= 4096:
                self._fast_left.clear()
            self._fast_left[key] = self.RETRY
        return data


def payload_bytes(p) -> memoryview:
    """A payload's bytes in C order, without a copy where it is a flat host byte tensor (what
    the fused kernel fills); otherwise as a host copy."""
    import torch

    if p.dtype is torch.uint8 and p.is_cpu and p.is_contiguous():
        return memoryview(p.numpy()).cast("B")
    return memoryview(p.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
