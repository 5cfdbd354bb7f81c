"""Record batches built from and read into `RecordColumns`: the packed records and the records
sent one message each, the checksum, and conversions for a peer of an earlier build (one that
takes no packed records, or no packed payloads). No torch, no auditor imports.
"""
from __future__ import annotations

import numpy as np

from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.packed import RecordColumns, concat, from_packed, take, to_packed
from numaudit.wire.record_form import from_records, to_records


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
