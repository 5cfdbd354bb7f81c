"""Records built from host batches: parts of a wire batch built together are the records built
one part at a time, and the batch the sender cuts carries what packed_batch would."""

from __future__ import annotations

import pytest
import torch

import agents
from agents.columns import PayloadCompressor, part_columns, split_payloads
from wire import packed as P

pytestmark = pytest.mark.timeout(60)


def _host_batches():
    agent = agents.attach(None, run="cols", spool_mode="off", phases=("input", "fwd", "loss"),
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
    assert P.to_records(together) == P.to_records(apart)
    assert together.record_bytes == sum(p.record_bytes() for p in parts)
    # a slice of a part is the same records as the slice of its columns
    head = parts[0].slice(1, 3)
    assert P.to_records(part_columns([head])) == P.to_records(P.take(apart, [1, 2]))

    plain = part_columns([p for p in parts if p.payloads is None])
    single = part_columns([p for p in parts if p.payloads is not None])
    cut = P.split_batch("s", 1, plain, single)
    whole = P.packed_batch("s", 1, apart)
    assert P.batch_record_count(cut) == P.batch_record_count(whole) == apart.n
    assert list(cut.records) == list(whole.records)  # the payload records, in order
    assert P.to_records(P.batch_columns(cut)) == P.to_records(P.batch_columns(whole))
