"""Records built from host batches: parts of a wire batch built together are the records built
one part at a time, and the batch the sender cuts carries what packed_batch would."""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.agents.delivery.columns import PayloadCompressor, part_columns, split_payloads
from numaudit.wire import batches as WB
from numaudit.wire import packed as P
from numaudit.wire import record_form as RF

pytestmark = pytest.mark.timeout(60)


def _host_batches():
    agent = numaudit.attach(None, run="cols", spool_mode="off", phases=("input", "fwd", "loss"),
                          payload=("input:pay",), sketch_k=16, device_batch=4)
    got = []
    agent.capturer._batches._sink = got.append
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        with agent.step(step), agent.microbatch(0):
            for i in range(6):
                agent.capture(torch.randn(4, 3, generator=g), site=f"m{i % 4}", phase="fwd")
            agent.capture(None, site="none", phase="input")
            agent.capture(torch.randn(2, 2, generator=g), site="pay", phase="input")
            agent.capture(torch.arange(6), site="ids", phase="input")
            agent.capture(torch.randn(3, dtype=torch.complex64, generator=g), site="c", phase="fwd")
            agent.capture(torch.tensor(1.5), site="loss", phase="loss")
    agent.close(timeout=1.0)
    return got


def test_parts_built_together_are_the_records_built_apart():
    compress = PayloadCompressor()
    parts = [p for b in _host_batches()
             for p in split_payloads(b.captures, b.f64.numpy(), b.i64.numpy(), compress)]
    assert len({id(p.f64) for p in parts}) > 1 and any(p.payloads for p in parts)
    apart = P.concat([part_columns([p]) for p in parts])
    together = part_columns(parts)
    assert RF.to_records(together) == RF.to_records(apart)
    assert together.record_bytes == sum(p.record_bytes() for p in parts)
    # a slice of a part is the same records as the slice of its columns
    head = parts[0].slice(1, 3)
    assert RF.to_records(part_columns([head])) == RF.to_records(P.take(apart, [1, 2]))

    plain = part_columns([p for p in parts if p.payloads is None])
    single = part_columns([p for p in parts if p.payloads is not None])
    cut = WB.split_batch("s", 1, plain, single)
    whole = WB.packed_batch("s", 1, apart)
    assert WB.batch_record_count(cut) == WB.batch_record_count(whole) == apart.n
    assert list(cut.records) == list(whole.records)  # the payload records, in order
    assert RF.to_records(WB.batch_columns(cut)) == RF.to_records(WB.batch_columns(whole))


def _layouts():
    from numaudit.agents.layout import PieceLayout, RaggedParts

    full = PieceLayout.full((4, 3))
    return [
        full,
        PieceLayout((8, 3), (4, 0), (4, 3)),  # a shard
        PieceLayout((8, 3), (0, 0), (8, 3), replica=True),
        PieceLayout((5,), (0,), (5,), partial=True),
        PieceLayout((), (), (), reduce="mean", reduce_weight=4.0, reduce_index=1, reduce_count=2),
        PieceLayout((2,), (0,), (2,), reduce="sum", reduce_index=3, reduce_count=4),
        PieceLayout((9, 2), (3, 0), (2, 2), ragged=RaggedParts(first=1, span=2, parts=4)),
        PieceLayout.full((1, 1, 1, 7)),
        PieceLayout((12,), (5,), (7,), flat=True),  # an FSDP1 rank's range of a (4, 3) weight
    ]


def _expected_layout_columns(lay):
    """What a record carries for a layout, written out field by field (docs/protocol.md)."""
    red = {"": 0, "mean": 1, "sum": 2}[lay.reduce]
    rag = lay.ragged
    return {"ndim": len(lay.logical_shape), "reduce": red,
            "reduce_index": lay.reduce_index if red else 0,
            "reduce_count": lay.reduce_count if red else 0,
            "reduce_weight": lay.reduce_weight if red else 0.0,
            "ragged_parts": rag.parts if rag else 0, "ragged_first": rag.first if rag else 0,
            "ragged_span": rag.span if rag else 0,
            "flags": (P.REPLICA if lay.replica else 0) | (P.PARTIAL if lay.partial else 0)
                     | (P.FLAT if lay.flat else 0) | P.HAS_MOMENTS,
            "dims": [*lay.logical_shape, *lay.offsets, *lay.shape]}


@pytest.mark.parametrize("table_size", [8192, 3])
def test_layout_columns_are_each_layouts_fields_also_after_the_table_starts_afresh(
        monkeypatch, table_size):
    """The sender keeps a table row per layout and gathers a batch's layout columns from it; a
    full table starts afresh (here every third layout) without changing any record."""
    import numpy as np

    import numaudit.agents.delivery.columns as C
    from numaudit.agents.digest.batching import Capture

    monkeypatch.setattr(C, "MAX_TABLE_LAYOUTS", table_size)
    monkeypatch.setattr(C, "_TABLE", C._LayoutTable())
    lays = _layouts()
    k = 4
    f64 = np.arange(len(lays) * (5 + k), dtype="<f8").reshape(len(lays), 5 + k)
    i64 = np.arange(len(lays) * 6, dtype="<i8").reshape(len(lays), 6)
    for rnd in range(3):  # the same layouts again, then new objects equal to them
        if rnd == 2:
            lays = _layouts()
        order = list(range(len(lays)))[rnd:] + list(range(len(lays)))[:rnd]
        caps = [Capture(step=rnd, microbatch=0, phase=1, site=f"s{i}", role=1, index=0, call=0,
                        stage=-1, layout=lays[i], dtype="float32", row=i) for i in order]
        caps.append(Capture(step=rnd, microbatch=0, phase=1, site="none", role=1, index=0,
                            call=0, stage=-1, layout=None, dtype="", is_none=True,
                            moments=False))
        c = part_columns([C.Part(caps, f64, i64)])
        dims = c.dims.tolist()
        at = 0
        for r, i in enumerate(order):
            want = _expected_layout_columns(lays[i])
            nd = want["ndim"]
            assert dims[at:at + 3 * nd] == want.pop("dims")
            at += 3 * nd
            assert {name: c.cols[name][r].item() for name in want} == want
            assert c.cols["sum"][r] == f64[i, 0] and c.cols["numel"][r] == i64[i, 0]
        assert at == len(dims)  # the None record has no dims
        assert c.cols["ndim"][-1] == 0 and c.cols["flags"][-1] == P.IS_NONE
    # the table holds the last batch's layouts (and None's row) when it started afresh for it,
    # else both sets of layout objects
    assert len(C._TABLE.current.kept) == (len(lays) + 1 if table_size == 3 else 2 * len(lays) + 1)
