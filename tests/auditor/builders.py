"""Valid messages to start from; tests mutate copies of them."""

from __future__ import annotations

import struct
import zlib

import zstandard

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits

V1 = limits.CURRENT_SCHEMA_VERSION


def register_request(run: str = "ref", session_id: str = "sess-0", rank: int = 0,
                     world_size: int = 2, **kw) -> pb.RegisterRequest:
    fields = dict(schema_version=V1, run=run, session_id=session_id, rank=rank,
                  world_size=world_size, mesh_shape=[world_size], mesh_dim_names=["dp"],
                  mesh_coordinate=[rank], stages=[0], torch_version="2.13.0", dtype="float32",
                  seed=1234, labels={"model": "tiny"}, host="node0", local_rank=rank)
    fields.update(kw)
    return pb.RegisterRequest(**fields)


def record(step: int = 0, microbatch: int = 0, site: str = "layers.0", *, phase: int = pb.PHASE_FWD,
           role: int = pb.ROLE_OUTPUT, shape=(4, 3), fingerprint: int = 0xDEADBEEF,
           payload: bytes | None = None) -> pb.Record:
    """A float32 piece: the top half of a (2*shape[0], shape[1]) logical tensor."""
    numel = shape[0] * shape[1]
    r = pb.Record(
        key=pb.Key(step=step, microbatch=microbatch, phase=phase, site=site, role=role),
        stage=0,
        layout=pb.Layout(logical_shape=[2 * shape[0], shape[1]], offsets=[0, 0], shape=list(shape),
                         dtype="float32"),
        digest=pb.Digest(numel=numel, nan_count=1, posinf_count=0, neginf_count=0, zero_count=2,
                         has_moments=True, sum=1.5, sum_sq=7.25, min=-1.0, max=2.0, abs_max=2.0,
                         fingerprint=fingerprint, fingerprint_seed=7, sketch=[0.25] * 16,
                         sketch_seed=11),
    )
    if payload is not None:
        r.payload.CopyFrom(zstd_payload(payload))
    return r


def none_record(step: int = 0, site: str = "layers.1.weight") -> pb.Record:
    return pb.Record(key=pb.Key(step=step, microbatch=-1, phase=pb.PHASE_GRAD, site=site,
                                role=pb.ROLE_VALUE), stage=0, is_none=True)


def zstd_payload(raw: bytes, **kw) -> pb.Payload:
    data = zstandard.ZstdCompressor(level=1).compress(raw)
    return payload_for(data, raw_nbytes=len(raw), **kw)


def payload_for(data: bytes, *, raw_nbytes: int, codec: str = "zstd") -> pb.Payload:
    return pb.Payload(codec=codec, raw_nbytes=raw_nbytes, compressed_nbytes=len(data),
                      crc32=zlib.crc32(data), chunk_index=0, chunk_count=1, data=data)


def float32_bytes(n: int) -> bytes:
    return struct.pack(f"<{n}f", *(float(i) - n / 2 for i in range(n)))


def batch(seq: int, records, session_id: str = "sess-0") -> pb.RecordBatch:
    return pb.RecordBatch(schema_version=V1, session_id=session_id, seq=seq, records=list(records))


def zstd_header(content_size: int, window_log: int = 20) -> bytes:
    """A forged zstd frame: header declaring `content_size`, then one RLE block of 128 KiB."""
    magic = b"\x28\xb5\x2f\xfd"
    descriptor = bytes([0xC0])                    # 8-byte content size, not single-segment
    window = bytes([(window_log - 10) << 3])
    block = ((128 << 10) << 3 | 1 << 1 | 1).to_bytes(3, "little") + b"\x00"  # last, RLE
    return magic + descriptor + window + struct.pack("<Q", content_size) + block
