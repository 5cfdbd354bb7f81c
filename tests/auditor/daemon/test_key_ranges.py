"""Issue 10 item 5: validation and the comparison engine agree on one key range.

Records the engine cannot pack are refused at ingest (INVALID_ARGUMENT naming the field) instead
of being stored and then failing every Compare of their run."""

from __future__ import annotations

import json

import grpc
import pytest

from numaudit.auditor.compare.read import reads
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from tests.auditor.builders import batch, record, register_request

T = 10
pytestmark = pytest.mark.timeout(60)


def test_limits_are_the_engines_packing_bounds():
    assert limits.MAX_KEY_STEP == reads.MAX_STEP
    assert limits.MAX_KEY_MICROBATCH == reads.MAX_MICROBATCH
    assert limits.MAX_KEY_INDEX == reads.MAX_INDEX
    assert limits.MAX_KEY_CALL == reads.MAX_CALL


def _keyed(**key) -> pb.Record:
    r = record(0, 0, "layers.0")
    for name, value in key.items():
        if name == "stage":
            r.stage = value
        else:
            setattr(r.key, name, value)
    return r


@pytest.mark.parametrize("field, value", [
    ("call", 16384), ("index", 16384), ("microbatch", 1048575), ("step", 1 << 39),
    ("stage", (1 << 31) - 1),
])
def test_out_of_range_key_is_refused_naming_the_field(auditor_stub, field, value):
    auditor_stub.Register(register_request(), timeout=T)
    with pytest.raises(grpc.RpcError) as info:
        list(auditor_stub.Ingest(iter([batch(1, [_keyed(**{field: value})])]), timeout=T))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    where = "records[0].stage" if field == "stage" else f"records[0].key.{field}"
    assert info.value.details().startswith(where + ":"), info.value.details()


def test_largest_keys_are_stored_and_compared(auditor_stub):
    top = dict(step=limits.MAX_KEY_STEP, microbatch=limits.MAX_KEY_MICROBATCH,
               index=limits.MAX_KEY_INDEX, call=limits.MAX_KEY_CALL)
    for run in ("ref", "cand"):
        auditor_stub.Register(register_request(run=run, session_id=run), timeout=T)
        (ack,) = auditor_stub.Ingest(iter([batch(1, [_keyed(**top)], session_id=run)]), timeout=T)
        assert ack.stored == 1
    resp = auditor_stub.Compare(pb.CompareRequest(ref="ref", cand="cand"), timeout=60)
    assert resp.exit_code in (0, 1)  # compared (the piece is half a tensor: incomplete)
    assert json.loads(resp.report_json)["findings"]
