"""Gradients of declared captures (`backward=True`): an input's and an output's are two keys.

The gradient reaching a tensor captured under role `input` is its `grad_input`, under `output`
its `grad_output`; before, both were keyed `grad_output` and the second hook was taken for a
repeat of the first (captured once per key), so an expert's input gradient was silently lost.
"""

from __future__ import annotations

import pytest
import torch

import numaudit
from numaudit.agents.digest.digest import digest_piece
from numaudit.agents.layout import ragged_layout
from numaudit.agents.ragged import rows_from_counts
from numaudit.auditor.store import RECORD_COLUMNS, Reader, from_int64
from numaudit.protos import numaudit_pb2 as pb

pytestmark = pytest.mark.timeout(60)
COL = {c: i for i, c in enumerate(RECORD_COLUMNS)}


def _bwd(db: str, run: str) -> dict[tuple[str, int, int], int]:
    """(site, role, index) -> fingerprint of every bwd record."""
    reader = Reader(db)
    try:
        return {(r[COL["site"]], r[COL["role"]], r[COL["idx"]]): from_int64(r[COL["fingerprint"]])
                for r in reader.records(run) if r[COL["phase"]] == pb.PHASE_BWD}
    finally:
        reader.close()


def _fp(t: torch.Tensor, counts: list[int], e: int) -> int:
    (rows,) = [rows_from_counts([counts], 0)[e]]
    n = counts[e]
    lay = ragged_layout((n, *t.shape[1:]), rows.offset, rows.total, part=0, parts=1)
    _, i64 = digest_piece(t.split(counts)[e].contiguous(), lay)
    return int(i64[5]) % (1 << 64)  # the fingerprint


def test_input_and_output_gradients_of_ragged_segments_are_both_captured(auditor_server):
    torch.manual_seed(0)
    counts = [3, 0, 2]
    w = torch.randn(4, 4, requires_grad=True)
    agent = numaudit.attach(None, run="seg", address=auditor_server.address, phases=("fwd", "bwd"))
    rows = rows_from_counts([counts], 0)
    grads = {}
    with agent.step(0), agent.microbatch(0):
        x = torch.randn(5, 4, requires_grad=True)
        routed_in = x * 1.0
        agent.capture_segments(routed_in, counts, rows, site="moe.experts", role="input",
                               backward=True)
        routed_out = torch.tanh(routed_in @ w)
        agent.capture_segments(routed_out, counts, rows, site="moe.experts", role="output",
                               backward=True)
        routed_in.register_hook(lambda g: grads.__setitem__("in", g))
        routed_out.register_hook(lambda g: grads.__setitem__("out", g))
        routed_out.square().sum().backward()
    assert agent.close()["errors"] == 0
    got = _bwd(auditor_server.db_path, "seg")
    assert set(got) == {("moe.experts", role, e) for role in (pb.ROLE_GRAD_INPUT,
                                                               pb.ROLE_GRAD_OUTPUT)
                        for e in range(3)}
    for e in range(3):
        assert got[("moe.experts", pb.ROLE_GRAD_INPUT, e)] == _fp(grads["in"], counts, e)
        assert got[("moe.experts", pb.ROLE_GRAD_OUTPUT, e)] == _fp(grads["out"], counts, e)


def test_input_and_output_gradients_of_one_capture_site_are_both_captured(auditor_server):
    agent = numaudit.attach(None, run="one", address=auditor_server.address, phases=("fwd", "bwd"))
    with agent.step(0), agent.microbatch(0):
        x = torch.randn(3, 2, requires_grad=True)
        h = x * 2.0
        agent.capture(h, site="expert", role="input", backward=True)
        y = h.square()
        agent.capture(y, site="expert", role="output", backward=True)
        y.sum().backward()
    assert agent.close()["errors"] == 0
    assert set(_bwd(auditor_server.db_path, "one")) == {
        ("expert", pb.ROLE_GRAD_INPUT, 0), ("expert", pb.ROLE_GRAD_OUTPUT, 0)}
