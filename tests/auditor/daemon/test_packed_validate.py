"""Vectorized validation of packed (and per-record) batches against the per-record rules.

The reference is `validate_record` applied to each record in order (what the daemon did before
batches were validated as columns): for any batch, validate_batch must refuse with exactly the
message the first faulty record gets from it (`records[i]...` per record, `packed[i]...` packed),
or accept when every record passes.
"""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from numaudit.auditor.daemon.validate import ValidationError, validate_batch, validate_record
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import batches as WB
from numaudit.wire import limits
from numaudit.wire import packed as P
from numaudit.wire import record_form as RF
from tests.auditor.builders import batch, none_record, record


def _variants() -> list[pb.Record]:
    out = [record(microbatch=i, shape=(2 + i, 3)) for i in range(3)] + [none_record()]
    red = record(site="loss", shape=(1, 1))
    red.layout.logical_shape[:] = [1, 1]
    red.layout.reduce, red.layout.reduce_weight = pb.REDUCTION_MEAN, 4.0
    red.layout.reduce_index, red.layout.reduce_count = 1, 2
    red.digest.nan_count = red.digest.zero_count = 0
    rag = record(site="experts", shape=(4, 3))
    rag.layout.ragged_parts, rag.layout.ragged_first, rag.layout.ragged_span = 4, 1, 2
    cplx = record(site="rope", shape=(4, 2))
    cplx.layout.logical_shape[:] = [8, 2]
    cplx.layout.complex_as_real = True
    ints = record(site="ids", shape=(2, 2))
    ints.layout.dtype = "int64"
    ints.digest.has_moments = False
    ints.digest.ClearField("sketch")
    flat = record(site="fsdp1.weight", shape=(4, 3))  # elements 12 .. 24 of a flattened (8, 3)
    flat.layout.logical_shape[:], flat.layout.offsets[:], flat.layout.shape[:] = [24], [12], [12]
    flat.layout.flat = True
    return out + [red, rag, cplx, ints, flat]


# (path, values): a field set to each value breaks (or keeps) some rule.
_MUTATIONS = [
    ("key.step", [-1, limits.MAX_KEY_STEP + 1, 5]), ("key.microbatch", [-2, 0]),
    ("key.phase", [0, 99, 2]), ("key.role", [0, 42]), ("key.site", ["", "a\x00b", "x" * 600]),
    ("key.index", [-1, limits.MAX_KEY_INDEX + 1]), ("key.call", [-3, 1 << 20]),
    ("stage", [-2, -1, 7]), ("is_none", [True]),
    ("capture_order", [-1, 0, 3, limits.MAX_CAPTURE_ORDER, limits.MAX_CAPTURE_ORDER + 1]),
    ("layout.dtype", ["", "float31", "bfloat16", "int8"]),
    ("layout.logical_shape", [[], [8], [8, 3, 1], [-1, 3], [1 << 40, 1 << 40]]),
    ("layout.offsets", [[7, 0], [-1, 0], [0]]), ("layout.shape", [[0, 3], [4, -3], [9, 3]]),
    ("layout.replica", [True]), ("layout.partial", [True]), ("layout.complex_as_real", [True]),
    ("layout.reduce", [1, 2, 7]), ("layout.reduce_weight", [0.0, -1.0, math.nan, math.inf]),
    ("layout.reduce_index", [-1, 2, 5]), ("layout.reduce_count", [0, 3, limits.MAX_WORLD_SIZE + 1]),
    ("layout.ragged_parts", [0, 1, 3]), ("layout.ragged_first", [-1, 3, 0]),
    ("layout.ragged_span", [0, 9, 1]), ("layout.flat", [True, False]),
    ("digest.numel", [0, 11, -1]), ("digest.nan_count", [-1, 13, 12]),
    ("digest.posinf_count", [5, 100]), ("digest.neginf_count", [11, -4]),
    ("digest.zero_count", [10, 12]), ("digest.has_moments", [False, True]),
    ("digest.sum", [math.nan, math.inf]), ("digest.sum_sq", [-1.0, math.nan]),
    ("digest.min", [3.0, math.nan]), ("digest.max", [-5.0]), ("digest.abs_max", [-0.5]),
    ("digest.sketch", [[], [math.nan], [1.0, math.nan, 2.0], [0.0] * 3]),
    ("digest.fingerprint", [(1 << 64) - 1]),
]


def _set(r: pb.Record, path: str, value) -> None:
    *parents, name = path.split(".")
    msg = r
    for p in parents:
        msg = getattr(msg, p)
    if isinstance(value, list):
        getattr(msg, name)[:] = value
    else:
        setattr(msg, name, value)


def _reference(records: list[pb.Record], label: str) -> str | None:
    for i, r in enumerate(records):
        try:
            validate_record(r, f"{label}[{i}]")
        except ValidationError as exc:
            return str(exc)
    return None


def _outcome(b: pb.RecordBatch) -> str | None:
    try:
        validate_batch(b)
    except ValidationError as exc:
        return str(exc)
    return None


def _packed(records: list[pb.Record]) -> pb.RecordBatch:
    return WB.packed_batch("sess-0", 1, RF.from_records(records))


def test_valid_variants_pass_packed_and_per_record():
    records = _variants()
    assert _reference(records, "records") is None
    cols = validate_batch(batch(1, records))
    assert cols.n == len(records)
    packed = validate_batch(_packed(records))
    assert RF.to_records(packed) == records


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_vectorized_rules_match_per_record_rules(data):
    records = _variants()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(records) - 1))
        path, values = data.draw(st.sampled_from(_MUTATIONS))
        _set(records[i], path, data.draw(st.sampled_from(values)))
    want = _reference(records, "records")
    assert _outcome(batch(1, records)) == want
    if not all(_fits(r) for r in records):
        return  # packed rows keep batch order only without records that travel per record
    assert _outcome(_packed(records)) == (None if want is None else _reference(records, "packed"))


def _fits(r: pb.Record) -> bool:
    """Columns hold the record as sent (layout lists of one length, no dtype when is_none)."""
    lay = r.layout
    return (len(lay.logical_shape) == len(lay.offsets) == len(lay.shape)
            and not (r.is_none and lay.dtype))


def test_every_mutation_value_is_checked_alone():
    """Each (field, value) on each variant: the same verdict and message both ways."""
    refused = 0
    for path, values in _MUTATIONS:
        for value in values:
            for v in range(len(_variants())):
                records = _variants()
                _set(records[v], path, value)
                want = _reference(records, "records")
                refused += want is not None
                assert _outcome(batch(1, records)) == want, (path, value, v)
                if not _fits(records[v]):
                    continue
                packed_want = None if want is None else _reference(records, "packed")
                assert _outcome(_packed(records)) == packed_want, (path, value, v)
    assert refused > 200  # the mutations do break rules


def test_packed_only_faults_name_the_field_and_record():
    records = _variants()
    b = _packed(records)
    b.packed.site = (b.packed.site[:-4] + (99).to_bytes(4, "little"))
    b.ClearField("records_crc32")
    assert _outcome(b) == (f"packed[{len(records) - 1}].key.site: index 99 is not in the site "
                           f"table ({len(b.packed.sites)} entries)")
    b = _packed(records)
    b.ClearField("records_crc32")
    b.packed.microbatch = b.packed.microbatch[:-1]
    assert _outcome(b) == (f"packed.microbatch: {8 * len(records) - 1} bytes; "
                           f"count {len(records)} x 8 bytes (int64) = {8 * len(records)}")
    b = _packed(records)
    b.ClearField("records_crc32")
    flags = bytearray(b.packed.flags)
    flags[2] |= 64
    b.packed.flags = bytes(flags)
    assert _outcome(b).startswith("packed[2].flags: ")
    b = _packed(records)
    b.ClearField("records_crc32")
    b.packed.sketch = b.packed.sketch[:-8]
    assert _outcome(b).startswith("packed.sketch: ")
    b = _packed(records)
    b.ClearField("records_crc32")
    b.packed.count = limits.MAX_BATCH_RECORDS + 1
    assert _outcome(b).startswith("records: 4097 records exceed")


def test_a_packed_site_index_cannot_borrow_a_site_of_the_per_record_part():
    """Tables are checked per part, before they are merged: an index past an empty packed site
    table is refused, not resolved against the sites of the records that follow it."""
    b = _packed([record(site="only.packed")])
    b.packed.ClearField("sites")
    b.records.append(record(site="per.record"))
    b.ClearField("records_crc32")
    assert _outcome(b) == "packed[0].key.site: index 0 is not in the site table (0 entries)"


def test_corrupted_packed_bytes_are_a_resend_not_a_refusal():
    b = _packed(_variants())
    sketch = bytearray(b.packed.sketch)
    sketch[5] ^= 1
    b.packed.sketch = bytes(sketch)
    assert _outcome(b).startswith("records_crc32: does not match")


def test_mixed_batch_names_packed_then_per_record_rows():
    records = _variants()
    bad = record(site="")
    b = _packed(records)
    b.records.append(bad)
    b.ClearField("records_crc32")
    assert _outcome(b) == "records[0].key.site: missing"
    cols = validate_batch(_packed(records + [record(payload=b"\x01" * 48, shape=(4, 3))]))
    assert cols.n == len(records) + 1 and list(cols.payloads) == [len(records)]


def test_random_columns_never_crash():
    """Arbitrary numbers in every packed column: an answer or a ValidationError, never another
    exception (the daemon maps anything else to UNAVAILABLE and the agent would retry forever)."""
    rng = random.Random(7)
    base = P.to_packed(RF.from_records(_variants()))
    n = base.count
    for _ in range(300):
        m = pb.PackedRecords()
        m.CopyFrom(base)
        name, dt = rng.choice(P.SCALAR_COLUMNS)
        import numpy as np
        a = np.frombuffer(getattr(m, name) or bytes(n * np.dtype(dt).itemsize), dt).copy()
        a[rng.randrange(n)] = np.array(rng.choice([-1, 0, 1, 2, 255, 1 << 62, -(1 << 62)]))\
            .astype(dt) if dt[-2] != "f" else rng.choice([math.nan, -0.0, 1e308, -math.inf])
        setattr(m, name, a.tobytes())
        b = pb.RecordBatch(schema_version=1, session_id="sess-0", seq=1, packed=m)
        try:
            validate_batch(b)
        except ValidationError:
            pass
