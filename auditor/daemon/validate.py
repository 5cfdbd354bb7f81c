"""Validation of everything the daemon accepts, before anything is stored.

Pure functions over the protobuf messages (no gRPC): each raises a `ValidationError` whose message
is `field.path: why`; its `kind` tells the server which status code to answer with (the mapping
lives in one place, `auditor.daemon.server`). A batch is validated whole before any of it is stored.

Contracts checked here that a sender must know (docs/protocol.md has the full list):
- NaN/Inf inside tensors are data: they show up as counts. The float64 moments cover finite
  elements only, so `sum`/`sum_sq` are never NaN (they may overflow to +-inf); min/max are +inf/-inf
  when a piece has no finite element; NaN in any moment or sketch bucket is refused.
- `complex_as_real`: the tensor was complex and travels as its real view, so `dtype` is the real
  dtype (float32 for complex64) and the shapes carry a trailing dim of 2 that is never split.
- `flat`: the piece is a row-major range of its tensor's flattening, so `logical_shape` has one
  dim; such a piece is not ragged, Partial, a reduction or complex_as_real.
- A payload's `raw_nbytes` is exactly `prod(layout.shape) * itemsize(layout.dtype)`.
- zstd payloads: one frame that declares its content size (== raw_nbytes), no dictionary, a window
  of at most `limits.MAX_ZSTD_WINDOW_BYTES`. The header is checked before decompressing, and
  decompression reads bounded blocks and stops one byte past `raw_nbytes`, so an untrusted size is
  never allocated. A payload whose chunks all arrive in one batch is checked whole (length, CRC-32,
  decompression); a payload split across batches gets its header checks per chunk (and the zstd
  frame header on chunk 0) — its CRC-32 is for readers of the store to check.
"""

from __future__ import annotations

import math
import threading

import zstandard

from numaudit.auditor.daemon import validate_columns as vc
from numaudit.auditor.daemon.errors import (
    CorruptedInTransit,
    CorruptPayload,
    TooLarge,
    UnsupportedVersion,
    ValidationError,
    short,
)
from numaudit.auditor.daemon.validate_layout import (
    ITEMSIZE,
    REAL_FLOAT_DTYPES,
    REDUCTIONS,
    check_layout,
)
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits, names
from numaudit.wire.batches import batch_columns, batch_record_count
from numaudit.wire.checksum import batch_checksum, crc32
from numaudit.wire.packed import PackedFormatError, PayloadChunk, RecordColumns

CODECS = ("zstd", "raw")
_PHASES = frozenset(v for v in pb.Phase.values() if v != pb.PHASE_UNSPECIFIED)
_ROLES = frozenset(v for v in pb.Role.values() if v != pb.ROLE_UNSPECIFIED)


# -- Scalars and names ---------------------------------------------------------------------------

def check_schema_version(version: int, field: str = "schema_version") -> None:
    supported = ", ".join(str(v) for v in limits.SUPPORTED_SCHEMA_VERSIONS)
    if version == 0:
        raise ValidationError(field, f"not set; this auditor supports schema versions {supported}")
    if version not in limits.SUPPORTED_SCHEMA_VERSIONS:
        raise UnsupportedVersion(
            field, f"version {version} is not supported; this auditor supports {supported}"
        )


def check_run_name(name: str, field: str = "run") -> None:
    """The rules of `wire.names` (the sidecar builds paths from the same checked names)."""
    try:
        names.check_run_name(name, field)
    except names.BadName as exc:
        raise ValidationError(exc.field, exc.why) from None


def check_session_id(session_id: str, field: str = "session_id") -> None:
    try:
        names.check_session_id(session_id, field)
    except names.BadName as exc:
        raise ValidationError(exc.field, exc.why) from None


def _check_text(value: str, field: str, *, limit: int = limits.MAX_TEXT_CHARS,
                required: bool = False) -> None:
    if required and not value:
        raise ValidationError(field, "missing")
    if len(value) > limit:
        raise ValidationError(field, f"{len(value)} characters exceed the limit of {limit}")
    if not value.isprintable():
        raise ValidationError(field, "contains non-printable characters")


# -- Register and close ----------------------------------------------------------------------------

def validate_register(req: pb.RegisterRequest) -> None:
    check_schema_version(req.schema_version)
    check_run_name(req.run)
    check_session_id(req.session_id)
    if not 1 <= req.world_size <= limits.MAX_WORLD_SIZE:
        raise ValidationError("world_size",
                              f"{req.world_size} is not in [1, {limits.MAX_WORLD_SIZE}]")
    if not 0 <= req.rank < req.world_size:
        raise ValidationError("rank", f"{req.rank} is not in [0, world_size {req.world_size})")
    if req.local_rank < 0:
        raise ValidationError("local_rank", f"{req.local_rank} is negative")
    _check_mesh(req)
    if len(req.stages) > limits.MAX_STAGES:
        raise TooLarge("stages",
                       f"{len(req.stages)} entries exceed the limit of {limits.MAX_STAGES}")
    for i, stage in enumerate(req.stages):
        if stage < 0:
            raise ValidationError(f"stages[{i}]", f"{stage} is negative")
    _check_text(req.torch_version, "torch_version")
    _check_text(req.dtype, "dtype")
    _check_text(req.host, "host")
    _check_text(req.job_id, "job_id")
    if not (math.isfinite(req.grad_scale) and req.grad_scale >= 0):
        raise ValidationError("grad_scale", f"{req.grad_scale} is not a finite number >= 0 "
                                            "(0 = not declared)")
    _check_text(req.grad_scale_source, "grad_scale_source")
    _check_text(req.agent_version, "agent_version")
    if len(req.labels) > limits.MAX_LABELS:
        raise TooLarge("labels",
                       f"{len(req.labels)} entries exceed the limit of {limits.MAX_LABELS}")
    for k, v in req.labels.items():
        _check_text(k, "labels", required=True)
        _check_text(v, f"labels[{k!r}]", limit=limits.MAX_LABEL_CHARS)


def _check_mesh(req: pb.RegisterRequest) -> None:
    shape, names, coord = list(req.mesh_shape), list(req.mesh_dim_names), list(req.mesh_coordinate)
    if len(shape) > limits.MAX_TENSOR_DIMS:
        raise ValidationError("mesh_shape",
                              f"{len(shape)} dims exceed the limit of {limits.MAX_TENSOR_DIMS}")
    for d, n in enumerate(shape):
        if n < 1:
            raise ValidationError(f"mesh_shape[{d}]", f"{n} is not >= 1")
    if names and len(names) != len(shape):
        raise ValidationError("mesh_dim_names", f"{len(names)} names for {len(shape)} mesh dims")
    for d, name in enumerate(names):
        _check_text(name, f"mesh_dim_names[{d}]", required=True)
    if len(set(names)) != len(names):
        raise ValidationError("mesh_dim_names", "names repeat")
    if len(coord) != len(shape):
        raise ValidationError("mesh_coordinate", f"{len(coord)} entries for {len(shape)} mesh dims")
    for d, (c, n) in enumerate(zip(coord, shape)):
        if not 0 <= c < n:
            raise ValidationError(f"mesh_coordinate[{d}]", f"{c} is not in [0, mesh_shape {n})")
    if shape and math.prod(shape) != req.world_size:
        raise ValidationError(
            "mesh_shape", f"{shape} has {math.prod(shape)} ranks, world_size is {req.world_size}"
        )


def validate_close(req: pb.CloseSessionRequest) -> None:
    check_schema_version(req.schema_version)
    check_session_id(req.session_id)
    for name in ("records_sent", "records_dropped", "capture_errors"):
        if getattr(req, name) < 0:
            raise ValidationError(name, f"{getattr(req, name)} is negative")
    if len(req.dropped_by_reason) > limits.MAX_DROP_REASONS:
        raise TooLarge("dropped_by_reason",
                       f"{len(req.dropped_by_reason)} entries exceed the limit of "
                       f"{limits.MAX_DROP_REASONS}")
    for reason, n in req.dropped_by_reason.items():
        _check_text(reason, "dropped_by_reason", required=True)
        if n < 0:
            raise ValidationError(f"dropped_by_reason[{reason!r}]", f"{n} is negative")


def validate_describe(req: pb.DescribeRunRequest) -> None:
    check_run_name(req.run)


# -- Batches and records ---------------------------------------------------------------------------

def validate_batch(batch: pb.RecordBatch) -> RecordColumns:
    """Everything about a batch that can be checked without the store; raises on the first fault.

    Returns the batch's records as columns (packed first, then per record), checked with the
    rules of `validate_record` on whole arrays (`validate_columns`): the same messages, naming the
    record as `packed[i]` or `records[i]`.
    """
    if batch.HasField("records_crc32") and batch_checksum(batch) != batch.records_crc32:
        # First: a corrupted batch must be resent, not refused for what the corruption says.
        raise CorruptedInTransit("records_crc32", "does not match the records (corrupted in "
                                                  "transit); resend the batch")
    check_schema_version(batch.schema_version)
    check_session_id(batch.session_id)
    if batch.seq < 1:
        raise ValidationError("seq", f"{batch.seq} is not >= 1 (sequences start at 1)")
    records = batch.records
    count = batch_record_count(batch)
    if batch.HasField("packed") and batch.packed.count < 0:
        raise ValidationError("packed.count", f"{batch.packed.count} is negative")
    if count > limits.MAX_BATCH_RECORDS:
        raise TooLarge("records", f"{count} records exceed the per-batch limit of "
                                  f"{limits.MAX_BATCH_RECORDS}")
    payload_bytes = sum(len(r.payload.data) for r in records if r.HasField("payload"))
    if batch.HasField("packed"):
        payload_bytes += sum(len(pp.payload.data) for pp in batch.packed.payloads)
    try:
        cols = batch_columns(batch)
    except PackedFormatError as exc:
        raise ValidationError(exc.field, exc.why) from None
    vc.check_rows(cols, vc.suspects(cols, ITEMSIZE, REAL_FLOAT_DTYPES, _PHASES, _ROLES,
                                    REDUCTIONS, _check_payload_header), validate_record)
    if payload_bytes > limits.MAX_BATCH_PAYLOAD_BYTES:
        raise TooLarge("records", f"payload data of {payload_bytes} bytes exceeds the per-batch "
                                  f"limit of {limits.MAX_BATCH_PAYLOAD_BYTES}")
    if cols.payloads:
        _verify_batch_payloads(cols)
    return cols


def validate_record(r: pb.Record, where: str = "record") -> None:
    _check_key(r.key, f"{where}.key")
    if not -1 <= r.stage <= limits.MAX_RECORD_STAGE:
        raise ValidationError(f"{where}.stage",
                              f"{r.stage} is not in [-1, {limits.MAX_RECORD_STAGE}]")
    if not 0 <= r.capture_order <= limits.MAX_CAPTURE_ORDER:
        raise ValidationError(f"{where}.capture_order",
                              f"{r.capture_order} is not in [0, {limits.MAX_CAPTURE_ORDER}]")
    if r.is_none:
        for name in ("layout", "digest"):
            if getattr(r, name).ByteSize():
                raise ValidationError(f"{where}.{name}", "must be empty when is_none is set")
        if r.HasField("payload"):
            raise ValidationError(f"{where}.payload", "must be absent when is_none is set")
        if r.samples.ByteSize():
            raise ValidationError(f"{where}.samples", "must be absent when is_none is set")
        return
    numel = check_layout(r.layout, f"{where}.layout")
    _check_digest(r.digest, numel, f"{where}.digest")
    if r.samples.ByteSize():
        _check_samples(r.samples, r.layout, r.digest, f"{where}.samples")
    if r.HasField("payload"):
        _check_payload_header(r.payload, r.layout.dtype, numel, f"{where}.payload")


def _check_key(k: pb.Key, where: str) -> None:
    if not 0 <= k.step <= limits.MAX_KEY_STEP:
        raise ValidationError(f"{where}.step", f"{k.step} is not in [0, {limits.MAX_KEY_STEP}]")
    if not -1 <= k.microbatch <= limits.MAX_KEY_MICROBATCH:
        raise ValidationError(f"{where}.microbatch",
                              f"{k.microbatch} is not in [-1, {limits.MAX_KEY_MICROBATCH}]")
    if k.phase not in _PHASES:
        raise ValidationError(f"{where}.phase", f"{k.phase} is not a known Phase")
    if k.role not in _ROLES:
        raise ValidationError(f"{where}.role", f"{k.role} is not a known Role")
    _check_text(k.site, f"{where}.site", limit=limits.MAX_SITE_CHARS, required=True)
    if not 0 <= k.index <= limits.MAX_KEY_INDEX:
        raise ValidationError(f"{where}.index", f"{k.index} is not in [0, {limits.MAX_KEY_INDEX}]")
    if not 0 <= k.call <= limits.MAX_KEY_CALL:
        raise ValidationError(f"{where}.call", f"{k.call} is not in [0, {limits.MAX_KEY_CALL}]")




def _check_digest(d: pb.Digest, numel: int, where: str) -> None:
    if d.numel != numel:
        raise ValidationError(f"{where}.numel", f"{d.numel} != prod(layout.shape) = {numel}")
    for name in ("nan_count", "posinf_count", "neginf_count", "zero_count"):
        value = getattr(d, name)
        if not 0 <= value <= numel:
            raise ValidationError(f"{where}.{name}", f"{value} is not in [0, numel {numel}]")
    nonfinite = d.nan_count + d.posinf_count + d.neginf_count
    if nonfinite + d.zero_count > numel:
        raise ValidationError(
            f"{where}.nan_count",
            f"nan + posinf + neginf + zero counts ({nonfinite + d.zero_count}) "
            f"exceed numel {numel}",
        )
    if len(d.sketch) > limits.MAX_SKETCH_BUCKETS:
        raise TooLarge(f"{where}.sketch",
                       f"{len(d.sketch)} buckets exceed the limit of {limits.MAX_SKETCH_BUCKETS}")
    if not d.has_moments:
        if d.sketch:
            raise ValidationError(f"{where}.sketch", "must be empty when has_moments is false")
        return
    for name in ("sum", "sum_sq", "min", "max", "abs_max"):
        if math.isnan(getattr(d, name)):
            raise ValidationError(f"{where}.{name}", "NaN (moments cover finite elements only)")
    if d.sum_sq < 0:
        raise ValidationError(f"{where}.sum_sq", f"{d.sum_sq} is negative")
    if d.abs_max < 0:
        raise ValidationError(f"{where}.abs_max", f"{d.abs_max} is negative")
    if numel - nonfinite > 0 and d.min > d.max:
        raise ValidationError(f"{where}.min", f"{d.min} > max {d.max}")
    if d.sketch and math.isnan(sum(d.sketch)):  # fast path; inf + -inf also lands here
        for i, v in enumerate(d.sketch):
            if math.isnan(v):
                raise ValidationError(f"{where}.sketch[{i}]", "NaN")


def _check_samples(smp: pb.SampleDigests, layout: pb.Layout, d: pb.Digest, where: str) -> None:
    """Record.samples (docs/protocol.md): units of samples along a dim of the piece."""
    k, unit = smp.sketch_k, smp.unit
    if k == 0:
        raise ValidationError(f"{where}.sketch_k", "0 (no sample digests) with other fields set")
    if not d.has_moments:
        raise ValidationError(f"{where}", "only pieces with moments (floats) have sample digests")
    if not 1 <= k <= limits.MAX_SKETCH_BUCKETS or k & (k - 1):
        raise ValidationError(f"{where}.sketch_k", f"{k} is not a power of two in [1, "
                                                   f"{limits.MAX_SKETCH_BUCKETS}]")
    if not 1 <= unit <= k or unit & (unit - 1):
        raise ValidationError(f"{where}.unit", f"{unit} is not a power of two in [1, sketch_k "
                                               f"{k}]")
    if not 0 <= smp.dim < len(layout.shape):
        raise ValidationError(f"{where}.dim", f"{smp.dim} is not a dim of the piece (it has "
                                              f"{len(layout.shape)})")
    if smp.count < 1 or smp.count != layout.shape[smp.dim]:
        raise ValidationError(f"{where}.count", f"{smp.count} != layout.shape[{smp.dim}] = "
                                                f"{layout.shape[smp.dim]} (>= 1)")
    units = -(-smp.count // unit)
    if units > limits.MAX_SAMPLE_UNITS or units * (5 + k) > limits.MAX_SAMPLE_VALUES:
        raise TooLarge(f"{where}.values", f"{units} units of {5 + k} values exceed the limits "
                                          f"of {limits.MAX_SAMPLE_UNITS} units, "
                                          f"{limits.MAX_SAMPLE_VALUES} values")
    if len(smp.values) != units * (5 + k):
        raise ValidationError(f"{where}.values", f"{len(smp.values)} values; {units} units x "
                                                 f"(5 + sketch_k) = {units * (5 + k)}")
    if len(smp.fingerprints) != units:
        raise ValidationError(f"{where}.fingerprints", f"{len(smp.fingerprints)} values; "
                                                       f"{units} units")
    if math.isnan(sum(smp.values)):
        for i, v in enumerate(smp.values):
            if math.isnan(v):
                raise ValidationError(f"{where}.values[{i}]", "NaN")


def _zstd_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND plus slack for the frame header and checksum."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 64


def _check_payload_header(p: pb.Payload, dtype: str, numel: int, where: str) -> None:
    """The header of a payload chunk of a record whose layout (`dtype`, `numel` elements) passed."""
    if p.codec not in CODECS:
        raise ValidationError(f"{where}.codec",
                              f"{short(p.codec)} is not one of {', '.join(CODECS)}")
    expected = numel * ITEMSIZE[dtype]
    if p.raw_nbytes != expected:
        raise ValidationError(
            f"{where}.raw_nbytes",
            f"{p.raw_nbytes} != prod(layout.shape) {numel} x itemsize {ITEMSIZE[dtype]} "
            f"({dtype}) = {expected}",
        )
    if p.raw_nbytes > limits.MAX_PAYLOAD_RAW_BYTES:
        raise TooLarge(f"{where}.raw_nbytes",
                       f"{p.raw_nbytes} exceeds the per-record payload limit "
                       f"of {limits.MAX_PAYLOAD_RAW_BYTES}")
    if p.chunk_count < 1:
        raise ValidationError(f"{where}.chunk_count", f"{p.chunk_count} is not >= 1")
    if not 0 <= p.chunk_index < p.chunk_count:
        raise ValidationError(f"{where}.chunk_index",
                              f"{p.chunk_index} is not in [0, chunk_count {p.chunk_count})")
    bound = p.raw_nbytes if p.codec == "raw" else _zstd_bound(p.raw_nbytes)
    if p.codec == "raw" and p.compressed_nbytes != p.raw_nbytes:
        raise ValidationError(f"{where}.compressed_nbytes",
                              f"{p.compressed_nbytes} != raw_nbytes {p.raw_nbytes} for codec raw")
    if not 0 <= p.compressed_nbytes <= bound:
        raise ValidationError(f"{where}.compressed_nbytes",
                              f"{p.compressed_nbytes} is not in [0, {bound}] for "
                              f"{p.raw_nbytes} raw bytes")
    if p.chunk_count > max(1, p.compressed_nbytes):
        raise ValidationError(f"{where}.chunk_count",
                              f"{p.chunk_count} chunks for a {p.compressed_nbytes}-byte stream")
    if p.chunk_count == 1 and len(p.data) != p.compressed_nbytes:
        raise CorruptPayload(f"{where}.data",
                             f"{len(p.data)} bytes, compressed_nbytes says {p.compressed_nbytes}")
    if p.chunk_count > 1 and not 0 < len(p.data) <= p.compressed_nbytes:
        raise CorruptPayload(f"{where}.data", f"chunk of {len(p.data)} bytes in a "
                                              f"{p.compressed_nbytes}-byte stream")


def check_zstd_header(prefix: bytes | memoryview, raw_nbytes: int, where: str) -> None:
    """Refuses a zstd frame before decompressing it: size undeclared or wrong, window too large."""
    try:
        params = zstandard.get_frame_parameters(prefix)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"{where}.data", f"not a zstd frame ({exc})") from None
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise ValidationError(f"{where}.data", "zstd frame does not declare its content size")
    if params.content_size != raw_nbytes:
        raise CorruptPayload(f"{where}.data", f"zstd frame declares {params.content_size} bytes, "
                                              f"raw_nbytes says {raw_nbytes}")
    if params.window_size > limits.MAX_ZSTD_WINDOW_BYTES:
        raise TooLarge(f"{where}.data", f"zstd window of {params.window_size} bytes exceeds the "
                                        f"limit of {limits.MAX_ZSTD_WINDOW_BYTES}")
    if params.dict_id:
        raise ValidationError(f"{where}.data", "zstd dictionaries are not supported")


def verify_stream(p: pb.Payload | PayloadChunk, stream: bytes | memoryview, where: str) -> None:
    """Checks a whole compressed stream: length, CRC-32, and for zstd a bounded decompression."""
    if len(stream) != p.compressed_nbytes:
        raise CorruptPayload(f"{where}.data", f"stream of {len(stream)} bytes, compressed_nbytes "
                                              f"says {p.compressed_nbytes}")
    crc = crc32(stream)
    if crc != p.crc32:
        raise CorruptPayload(f"{where}.crc32",
                             f"stream has CRC-32 {crc:#010x}, header says {p.crc32:#010x}")
    if p.codec != "zstd":
        return
    check_zstd_header(stream, p.raw_nbytes, where)
    n = _decompressed_size(stream, p.raw_nbytes, where)
    if n != p.raw_nbytes:
        raise CorruptPayload(f"{where}.data", f"zstd stream decompresses to {n} bytes, raw_nbytes "
                                              f"says {p.raw_nbytes} (truncated or corrupt)")


_DCTX = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompression context: making one costs ~12 us, more than checking a small
    payload (reusable one operation at a time, so one per thread)."""
    dctx = getattr(_DCTX, "dctx", None)
    if dctx is None:
        dctx = _DCTX.dctx = zstandard.ZstdDecompressor(
            max_window_size=limits.MAX_ZSTD_WINDOW_BYTES)
    return dctx


def _decompressed_size(stream: bytes | memoryview, raw_nbytes: int, where: str) -> int:
    """Bytes the stream decompresses to, reading at most raw_nbytes + 1 of them."""
    dctx = _decompressor()
    n = 0
    try:
        with dctx.stream_reader(stream, read_size=1 << 16) as reader:
            while n <= raw_nbytes:
                block = reader.read(min(limits.DECOMPRESS_READ_BYTES, raw_nbytes + 1 - n))
                if not block:
                    break
                n += len(block)
    except (zstandard.ZstdError, MemoryError) as exc:
        raise CorruptPayload(f"{where}.data", f"zstd decompression failed ({exc})") from None
    return n


def _verify_batch_payloads(c: RecordColumns) -> None:
    """Whole-stream checks for payloads complete in this batch (packed or per record); header
    checks for the others."""
    complete: list[tuple[str, pb.Payload | PayloadChunk, bytes | memoryview]] = []
    groups: dict[tuple, dict[int, int]] = {}
    cols = c.cols
    for row in sorted(c.payloads):
        p = c.payloads[row]
        where = f"{c.where(row)}.payload"
        if p.chunk_count == 1:
            complete.append((where, p, p.data))
            continue
        if p.chunk_index == 0 and p.codec == "zstd":
            check_zstd_header(p.data, p.raw_nbytes, where)
        key = (int(cols["step"][row]), int(cols["microbatch"][row]), int(cols["phase"][row]),
               c.sites[int(cols["site"][row])], int(cols["role"][row]), int(cols["index"][row]),
               int(cols["call"][row]))
        group = (key, p.chunk_count, p.crc32, p.compressed_nbytes, p.codec, p.raw_nbytes)
        groups.setdefault(group, {}).setdefault(p.chunk_index, row)
    for chunks in groups.values():
        first = chunks.get(0)
        if first is not None and len(chunks) == c.payloads[first].chunk_count:
            joined = b"".join(c.payloads[chunks[j]].data for j in range(len(chunks)))
            complete.append((f"{c.where(first)}.payload", c.payloads[first], joined))
    raw_total = sum(p.raw_nbytes for _, p, _ in complete if p.codec == "zstd")
    if raw_total > limits.MAX_BATCH_RAW_BYTES:
        raise TooLarge("records", f"payloads would decompress to {raw_total} bytes, over the "
                                  f"per-batch limit of {limits.MAX_BATCH_RAW_BYTES}; send fewer "
                                  "per batch")
    for where, p, stream in complete:
        verify_stream(p, stream, where)

