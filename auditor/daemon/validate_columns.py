"""Vectorized validation of a batch's records as columns (`wire.packed.RecordColumns`).

The rules are those of `validate.validate_record`, evaluated on whole arrays at once. Each rule
marks the records it may fail; the marks are a superset of the faults (rounding and overflow
make a rule mark, never miss; a payload's header is tried by the per-record rule itself, once
per payload). Marked records are then checked one by one in batch order by `validate_record`, on
the record rebuilt from the columns, so a fault is reported with exactly the per-record message
and the record's own name (`packed[i]` or `records[i]`), and the first faulty record is the one
reported. Checks that only a packed record can fail (a site or dtype index outside its table,
unknown flag bits) are made when the packed message is read (`wire.packed.check_tables`), before
its tables are merged with those of the batch's per-record part.
"""

from __future__ import annotations

import functools

import numpy as np

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from numaudit.wire.packed import (
    COMPLEX_AS_REAL,
    FLAT,
    HAS_MOMENTS,
    IS_NONE,
    PARTIAL,
    RecordColumns,
    take,
)
from numaudit.wire.record_form import to_records


@functools.lru_cache(maxsize=1 << 16)  # a run's site names recur in every batch
def _text_ok(value: str, limit: int) -> bool:
    return bool(value) and len(value) <= limit and value.isprintable()


def _in(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return (a >= lo) & (a <= hi)


def suspects(c: RecordColumns, itemsize: dict, real_floats: frozenset, phases: frozenset,
             roles: frozenset, reductions: frozenset, payload_header) -> np.ndarray:
    """Rows that may break a rule of `validate_record` (a superset), in batch order.

    `payload_header(payload, dtype, numel, where)` raises ValidationError for a payload chunk's
    header that breaks a rule (validate._check_payload_header): it is tried on each payload
    whose record is not marked otherwise, so records with a payload are not all rebuilt and
    checked one by one (that cost ~50 us a payload)."""
    n = c.n
    if n == 0:  # an empty batch breaks no record rule (and the array code below needs rows)
        return np.zeros(0, np.int64)
    cols = c.cols
    flags = cols["flags"]
    none = (flags & IS_NONE) != 0
    bad = np.zeros(n, bool)
    # key and stage
    bad |= ~_in(cols["step"], 0, limits.MAX_KEY_STEP)
    bad |= ~_in(cols["microbatch"], -1, limits.MAX_KEY_MICROBATCH)
    bad |= ~np.isin(cols["phase"], list(phases))
    bad |= ~np.isin(cols["role"], list(roles))
    site_ok = np.array([_text_ok(s, limits.MAX_SITE_CHARS) for s in c.sites] or [False])
    bad |= ~site_ok[np.clip(cols["site"], 0, len(site_ok) - 1)]
    bad |= ~_in(cols["index"], 0, limits.MAX_KEY_INDEX)
    bad |= ~_in(cols["call"], 0, limits.MAX_KEY_CALL)
    bad |= ~_in(cols["stage"], -1, limits.MAX_RECORD_STAGE)
    bad |= ~_in(cols["capture_order"], 0, limits.MAX_CAPTURE_ORDER)
    # is_none records: layout and digest empty
    body = np.zeros(n, bool)
    for name in ("ndim", "reduce", "reduce_weight", "reduce_index", "reduce_count",
                 "ragged_parts", "ragged_first", "ragged_span", "numel", "nan_count",
                 "posinf_count", "neginf_count", "zero_count", "sum", "sum_sq", "min", "max",
                 "abs_max", "fingerprint", "fingerprint_seed", "sketch_seed", "sketch_len"):
        a = cols[name]
        body |= (a.view(np.uint64) if a.dtype.kind == "f" else a) != 0
    body |= (flags & ~np.uint8(IS_NONE)) != 0
    bad |= none & body
    live = ~none
    # layout
    dtype_ok = np.array([d in itemsize for d in c.dtypes] or [False])
    dtype_real = np.array([d in real_floats for d in c.dtypes] or [False])
    didx = np.clip(cols["dtype"], 0, len(dtype_ok) - 1)
    bad |= live & ~dtype_ok[didx]
    ndim = cols["ndim"].astype(np.int64)
    bad |= ndim > limits.MAX_TENSOR_DIMS
    starts = c.dim_starts()
    rec = np.repeat(np.arange(n), ndim)  # record of each dim
    first = starts[:-1]
    pos_in = np.arange(len(rec), dtype=np.int64) - np.repeat(
        np.concatenate(([0], np.cumsum(ndim)[:-1])), ndim)
    base = np.repeat(first, ndim) + pos_in
    nd_rep = np.repeat(ndim, ndim)
    lg, off, sh = c.dims[base], c.dims[base + nd_rep], c.dims[base + 2 * nd_rep]
    elem_bad = (lg < 0) | (off < 0) | (sh < 0) | (off > lg - sh)
    bad[rec[elem_bad]] = True
    has_dims = ndim > 0
    with np.errstate(over="ignore", invalid="ignore"):
        logical_f = np.ones(n)
        shape_f = np.ones(n)
        if has_dims.any():
            at = np.flatnonzero(has_dims)
            seg = np.concatenate(([0], np.cumsum(ndim)))[at]
            logical_f[at] = np.multiply.reduceat(lg.astype(np.float64), seg)
            shape_f[at] = np.multiply.reduceat(sh.astype(np.float64), seg)
            shape_i = np.ones(n, np.int64)
            shape_i[at] = np.multiply.reduceat(sh, seg)
        else:
            shape_i = np.ones(n, np.int64)
    bad |= logical_f > 2.0 ** 62
    big = shape_f > 2.0 ** 50  # exact products and float sums of counts are not trusted past here
    bad |= big
    # complex_as_real: a real float dtype and a trailing dim of 2
    car = live & ((flags & COMPLEX_AS_REAL) != 0)
    last = np.clip(starts[:-1] + 3 * ndim - 1, 0, max(len(c.dims) - 1, 0))
    last_l = np.clip(starts[:-1] + ndim - 1, 0, max(len(c.dims) - 1, 0))
    if len(c.dims):
        trailing_ok = has_dims & (c.dims[last_l] == 2) & (c.dims[last] == 2)
    else:
        trailing_ok = np.zeros(n, bool)
    bad |= car & (~dtype_real[didx] | ~trailing_ok)
    # reductions and ragged pieces: whole tensors / row slices
    red = cols["reduce"]
    reducing = live & (red != 0)
    whole = np.ones(n, bool)
    rows_only = np.ones(n, bool)
    if len(rec):
        np.logical_and.at(whole, rec, (off == 0) & (sh == lg))
        np.logical_and.at(rows_only, rec, (pos_in == 0) | ((off == 0) & (sh == lg)))
    rc, ri = cols["reduce_count"], cols["reduce_index"]
    w = cols["reduce_weight"]
    bad |= reducing & (~np.isin(red, list(reductions)) | ((flags & PARTIAL) != 0) | ~whole
                       | ~_in(rc, 1, limits.MAX_WORLD_SIZE) | (ri < 0) | (ri >= rc)
                       | ((red == pb.REDUCTION_MEAN) & ~(np.isfinite(w) & (w > 0))))
    rp, rf, rs = cols["ragged_parts"], cols["ragged_first"], cols["ragged_span"]
    ragged = live & ((rp != 0) | (rf != 0) | (rs != 0))
    bad |= ragged & (~_in(rp, 1, limits.MAX_WORLD_SIZE) | (rf < 0) | (rf >= rp) | (rs < 1)
                     | (rs > rp - rf) | ~has_dims | ~rows_only | (red != 0))
    # flat pieces: one dim, and none of the above
    flat = live & ((flags & FLAT) != 0)
    bad |= flat & ((ndim != 1) | ((flags & (PARTIAL | COMPLEX_AS_REAL)) != 0) | (red != 0)
                   | (rp != 0) | (rf != 0) | (rs != 0))
    # digest
    numel = cols["numel"]
    bad |= live & (numel != shape_i)
    counts = [cols[k] for k in ("nan_count", "posinf_count", "neginf_count", "zero_count")]
    for a in counts:
        bad |= live & ((a < 0) | (a > numel))
    total = sum(a.astype(np.float64) for a in counts)
    bad |= live & (total > numel.astype(np.float64))
    moments = (flags & HAS_MOMENTS) != 0
    sl = cols["sketch_len"]
    bad |= live & ((sl > limits.MAX_SKETCH_BUCKETS) | (~moments & (sl != 0)))
    m = live & moments
    for k in ("sum", "sum_sq", "min", "max", "abs_max"):
        bad |= m & np.isnan(cols[k])
    finite_left = numel.astype(np.float64) - sum(a.astype(np.float64) for a in counts[:3])
    bad |= m & ((cols["sum_sq"] < 0) | (cols["abs_max"] < 0)
                | ((finite_left > 0) & (cols["min"] > cols["max"])))
    if len(c.sketch):
        nan_at = np.flatnonzero(np.isnan(c.sketch))
        if len(nan_at):
            owner = np.searchsorted(c.sketch_starts(), nan_at, side="right") - 1
            bad[owner] = True
    bad |= _sample_suspects(c, none, moments, ndim, starts)
    for row in c.unfit:
        bad[row] = True
    for row, p in c.payloads.items():
        if bad[row]:
            continue
        if none[row]:  # a payload on an is_none record
            bad[row] = True
            continue
        try:
            payload_header(p, c.dtypes[int(didx[row])], int(shape_i[row]), "")
        except ValueError:  # ValidationError and its kinds
            bad[row] = True
    return np.flatnonzero(bad)


def _sample_suspects(c: RecordColumns, none: np.ndarray, moments: np.ndarray, ndim: np.ndarray,
                     starts: np.ndarray) -> np.ndarray:
    """Records whose sample digests (Record.samples) may break a rule of
    `validate._check_samples`."""
    cols = c.cols
    k, unit = cols["sample_k"].astype(np.int64), cols["sample_unit"].astype(np.int64)
    count, dim = cols["sample_count"].astype(np.int64), cols["sample_dim"].astype(np.int64)
    some = (k != 0) | (unit != 0) | (count != 0) | (dim != 0)
    if not some.any():
        return np.zeros(c.n, bool)
    bad = some & none
    bad |= some & ((k < 1) | (k > limits.MAX_SKETCH_BUCKETS) | ((k & (k - 1)) != 0) | ~moments
                   | (unit < 1) | (unit > k) | ((unit & (unit - 1)) != 0) | (count < 1)
                   | (dim < 0) | (dim >= ndim))
    ok = some & ~bad
    at = np.flatnonzero(ok)
    if len(at) and len(c.dims):  # the piece's extent along dim
        extent = c.dims[np.clip(starts[at] + 2 * ndim[at] + dim[at], 0, len(c.dims) - 1)]
        bad[at[extent != count[at]]] = True
    units = -(-count // np.maximum(unit, 1))
    bad |= some & ((units > limits.MAX_SAMPLE_UNITS)
                   | (units * (5 + np.maximum(k, 0)) > limits.MAX_SAMPLE_VALUES))
    if len(c.sample_values):
        nan_at = np.flatnonzero(np.isnan(c.sample_values))
        if len(nan_at):
            bad[np.searchsorted(c.sample_starts()[0], nan_at, side="right") - 1] = True
    return bad


def check_rows(c: RecordColumns, rows: np.ndarray, validate_record) -> None:
    """Per-record validation of the suspect rows, in order: the first fault raises.

    The rows' messages are rebuilt in one `take`: a take per row walked every payload of the
    batch each time, and 4096 suspects with payloads cost the daemon ~2 s of CPU a batch."""
    order = rows.tolist()
    fit = [row for row in order if row not in c.unfit]
    built = dict(zip(fit, to_records(take(c, np.array(fit, np.int64))))) if fit else {}
    for row in order:
        validate_record(c.unfit[row] if row in c.unfit else built[row], c.where(row))

