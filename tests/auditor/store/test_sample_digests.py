"""Record.samples (per-sample digests) on the wire and in both stores: the same columns however a
record travelled (per record, packed, sealed), refused with the field named when they do not fit
the piece, stored by every write path, outside the content hash, and absent for records of an
earlier build (and in stores made before the table)."""

from __future__ import annotations

import numpy as np
import pytest

from numaudit.auditor.compare.read.sample_digests import fetch
from numaudit.auditor.daemon.validate import ValidationError, validate_batch
from numaudit.auditor.store.backend import open_writer
from numaudit.auditor.store.reader import Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.batches import split_batch
from numaudit.wire.packed import from_packed, to_packed
from numaudit.wire.record_form import from_records, to_records
from numaudit.wire.sealed import sealed_batch
from tests.auditor.builders import batch, float32_bytes, payload_for, record
from tests.auditor.store.test_backends import ingest, read, register

pytestmark = pytest.mark.timeout(60)


def sampled(step: int = 0, microbatch: int = 0, *, unit: int = 1, k: int = 8,
            seed: float = 1.0, **kw) -> pb.Record:
    """A builders.record (4 samples of 3 along dim 0) with sample digests of `unit`-sample
    units."""
    r = record(step, microbatch, **kw)
    units = -(-4 // unit)
    r.samples.dim, r.samples.unit, r.samples.count, r.samples.sketch_k = 0, unit, 4, k
    r.samples.values.extend((np.arange(units * (5 + k)) * seed).tolist())
    r.samples.fingerprints.extend([(1 << 63) + 5 + u for u in range(units)])
    return r


class _Catalog:
    def __init__(self, reader):
        self.reader = reader


def stored_samples(reader) -> dict:
    rids = [row[30] for row in reader.records("ref")]
    return {rid: (s.dim, s.unit, s.count, s.k, s.f64.tolist(), s.fp.tolist())
            for rid, s in fetch(_Catalog(reader), np.array(rids)).items()}


def test_samples_travel_alike_per_record_packed_and_sealed():
    recs = [sampled(0, 0), record(0, 1), sampled(0, 2, unit=2, k=16, seed=0.5)]
    cols = from_records(recs)
    assert cols.cols["sample_k"].tolist() == [8, 0, 16]
    assert len(cols.sample_values) == 4 * 13 + 2 * 21 and len(cols.sample_fps) == 6
    back = to_records(from_packed(to_packed(cols)))
    assert [r.SerializeToString() for r in back] == [r.SerializeToString() for r in recs]
    sealed = pb.RecordBatch.FromString(sealed_batch("sess-0", 1, cols))
    assert sealed.packed.SerializeToString() == to_packed(cols).SerializeToString()
    from numaudit.wire.packed import take
    assert to_records(take(cols, np.array([2])))[0] == recs[2]


@pytest.mark.parametrize("change, field", [
    (lambda s: setattr(s, "sketch_k", 12), "records[0].samples.sketch_k"),
    (lambda s: setattr(s, "unit", 16), "records[0].samples.unit"),
    (lambda s: setattr(s, "dim", 2), "records[0].samples.dim"),
    (lambda s: setattr(s, "count", 3), "records[0].samples.count"),
    (lambda s: s.values.append(1.0), "records[0].samples.values"),
    (lambda s: s.fingerprints.append(1), "records[0].samples.fingerprints"),
    (lambda s: s.values.__setitem__(3, float("nan")), "records[0].samples.values[3]"),
])
def test_samples_that_do_not_fit_their_piece_are_refused_naming_the_field(change, field):
    r = sampled()
    change(r.samples)
    with pytest.raises(ValidationError) as exc:
        validate_batch(batch(1, [r]))
    assert exc.value.field == field


@pytest.mark.parametrize("column, value, field", [
    ("sample_dim", 5, "packed[1].samples.dim"),
    ("sample_count", 3, "packed[1].samples.count"),  # 2 units of 2 all the same
    ("sample_k", 16, "packed.sample_values"),  # the values no longer fit: a format error
])
def test_packed_samples_that_do_not_fit_are_refused_naming_the_record(column, value, field):
    cols = from_records([record(0, 1), sampled(unit=2)])
    cols.cols[column] = cols.cols[column].copy()
    cols.cols[column][1] = value
    with pytest.raises(ValidationError) as exc:
        validate_batch(split_batch("sess-0", 1, cols, None))
    assert exc.value.field == field


def test_samples_on_a_piece_without_moments_are_refused():
    r = sampled()
    r.digest.has_moments = False
    r.digest.ClearField("sketch")
    with pytest.raises(ValidationError, match="samples"):
        validate_batch(batch(1, [r]))


def test_every_write_path_stores_them_outside_the_content_hash(store_location):
    w = open_writer(store_location, synchronous="NORMAL")
    try:
        register(w)
        assert ingest(w, batch(1, [sampled(0, 0), record(0, 1)])).stored == 2
        packed = split_batch("sess-0", 2, from_records([sampled(1, 0, unit=2, k=16)]), None)
        assert ingest(w, packed).stored == 1
        with_payload = sampled(2, 0)
        with_payload.payload.CopyFrom(payload_for(float32_bytes(12), raw_nbytes=48, codec="raw"))
        assert ingest(w, split_batch("sess-0", 3, from_records([with_payload]), None)).stored == 1
        # a batch one of whose keys is stored: the staging path; the resend of (0, 0) without
        # its samples (an earlier build's agent) and of (1, 0) with others are duplicates
        again = ingest(w, batch(4, [record(0, 0), sampled(1, 0, unit=2, k=16, seed=3.0),
                                    sampled(3, 0, k=32)]))
        assert (again.stored, again.duplicates, again.conflicts) == (1, 2, 0)
    finally:
        w.close()
    got = read(store_location, stored_samples)
    assert sorted((s[0], s[1], s[2], s[3]) for s in got.values()) == [
        (0, 1, 4, 8), (0, 1, 4, 8), (0, 1, 4, 32), (0, 2, 4, 16)]
    first = [s for s in got.values() if s[1] == 2][0]
    assert first[4][1] == [21.0 + i for i in range(21)]  # the first stored is kept
    assert first[5] == [(1 << 63) + 5, (1 << 63) + 6]


def test_a_store_without_the_table_reads_as_no_samples(tmp_path):
    w = open_writer(tmp_path / "audit.db", synchronous="NORMAL")
    register(w)
    ingest(w, batch(1, [sampled(0, 0)]))
    w.close()
    import sqlite3
    with sqlite3.connect(tmp_path / "audit.db") as conn:
        conn.execute("DROP TABLE sample_digests")
    reader = Reader(tmp_path / "audit.db")
    try:
        assert stored_samples(reader) == {}
    finally:
        reader.close()
