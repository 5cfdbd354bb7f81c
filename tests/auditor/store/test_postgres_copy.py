"""The binary COPY buffer (`auditor.store.pg_copy`) on a real PostgreSQL server: the rows it
stores read back equal, field for field, to the rows `auditor.store.rows.record_rows` gives the
SQLite store, for batches that mix what makes rows differ in width (is_none records, records
without moments, sketches of several lengths, layouts of several ranks and lengths, reductions,
ragged pieces, flat pieces, several dtypes)."""

from __future__ import annotations

import psycopg
import pytest

from numaudit.auditor.store import pg_copy
from numaudit.auditor.store.rows import INSERT_COLUMNS, record_rows
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire.content_hash import content_hashes
from numaudit.wire.record_form import from_records

pytestmark = pytest.mark.timeout(60)


def _record(i: int, variety: int = 1000) -> pb.Record:
    nd = i % 4
    shape = [3 + (i * 7 + d) % variety for d in range(nd)]
    r = pb.Record(key=pb.Key(step=i // 10, microbatch=i % 3, phase=1 + i % 2,
                             site=f"layers.{i % 5}.mlp", role=1 + i % 3, index=i % 2, call=i % 4),
                  stage=i % 3)
    if i % 11 == 5:
        r.is_none = True
        return r
    r.layout.logical_shape.extend([s * 2 for s in shape])
    r.layout.offsets.extend([s if i % 2 else 0 for s in shape])
    r.layout.shape.extend(shape)
    r.layout.dtype = ("float32", "bfloat16", "int64")[i % 3]
    r.layout.replica = i % 5 == 1
    r.layout.partial = i % 7 == 2
    r.layout.complex_as_real = i % 13 == 3
    if i % 6 == 4:
        r.layout.reduce = 1
        r.layout.reduce_weight = 2.5
        r.layout.reduce_index = 1
        r.layout.reduce_count = 3
    if i % 9 == 8:
        r.layout.ragged_parts, r.layout.ragged_first, r.layout.ragged_span = 4, 1, 2
    r.layout.flat = i % 8 == 3
    d = r.digest
    d.numel, d.nan_count, d.posinf_count, d.neginf_count, d.zero_count = 10 + i, i % 2, 0, 1, 3
    d.fingerprint = (0xF000_0000_0000_0000 + i * 1_000_003) & ((1 << 64) - 1)
    d.fingerprint_seed, d.sketch_seed = 7, (1 << 63) + 5
    d.sketch.extend([0.25 * (i + j) for j in range((i % 4) * 8)])
    if r.layout.dtype != "int64":
        d.has_moments = True
        d.sum, d.sum_sq, d.min, d.max, d.abs_max = 0.5 * i, 1.5 * i, -1.0 - i, 2.0, 1.0 + i
    return r


@pytest.mark.parametrize("n, variety", [(1, 1000), (7, 1000), (300, 2), (300, 1000),
                                        (2000, 1000)])
def test_copy_buffer_stores_the_rows_of_record_rows(pg_url, n, variety):
    """variety 2: a few row widths (cut as groups); 1000: many (cut with a mask)."""
    cols = from_records([_record(i, variety) for i in range(n)])
    hashes = content_hashes(cols)
    site_ids = [10 + j for j in range(len(cols.sites))]
    args = (site_ids, 3, 17, hashes, "sess-é", 42, 1234.5)
    want = record_rows(cols, *args)
    types = dict(pg_copy.SQL_TYPES)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (pos BIGSERIAL, "
                     + ", ".join(f"{c} {types[c]}" for c in pg_copy.COLUMNS) + ")")
        with conn.cursor().copy(f"COPY t ({', '.join(pg_copy.COLUMNS)}) FROM STDIN"
                                " (FORMAT BINARY)") as copy:
            copy.write(pg_copy.copy_buffer(cols, *args))
        got = conn.execute(f"SELECT {', '.join(INSERT_COLUMNS)} FROM t ORDER BY"
                           f" {', '.join(INSERT_COLUMNS[:9])}").fetchall()
    assert len(got) == n
    want.sort(key=lambda row: row[:9])  # rows of one width are written together
    for i, (g, w) in enumerate(zip(got, want)):
        g = tuple(bytes(v) if isinstance(v, memoryview) else v for v in g)
        assert g == tuple(w), (i, [(c, a, b) for c, a, b in zip(INSERT_COLUMNS, g, w) if a != b])


def test_uniform_batch_has_no_padding(pg_url):
    """The common case (every row one width) skips the mask and still reads back right."""
    rows = [_record(1) for _ in range(4)]
    for i, r in enumerate(rows):
        r.key.step = i
    cols = from_records(rows)
    buf = pg_copy.copy_buffer(cols, [1], 1, 0, content_hashes(cols), "s", 1, 0.0)
    assert buf.startswith(pg_copy.HEADER) and buf.endswith(pg_copy.TRAILER)
    width = (len(buf) - len(pg_copy.HEADER) - len(pg_copy.TRAILER)) // 4
    assert len(buf) == len(pg_copy.HEADER) + len(pg_copy.TRAILER) + 4 * width
