"""The agent numbers its captures in the order its hooks fire (Record.capture_order), on the
training thread, whatever path a capture takes afterwards: fused or eager digest, with a payload
(in chunks or whole) or without, straight to the auditor, through the node sidecar, or spooled
and loaded later by `auditor ingest`."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

import numaudit
from numaudit.agents.delivery.columns import part_columns, split_payloads
from numaudit.agents.digest.batching import Capture
from numaudit.agents.layout import PieceLayout
from numaudit.agents.sidecar import Sidecar
from numaudit.auditor.daemon.replay import replay_into_db
from numaudit.auditor.store import RECORD_COLUMNS, Reader
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits

pytestmark = pytest.mark.timeout(90)
COL = {name: i for i, name in enumerate(RECORD_COLUMNS)}


class Mixed(torch.nn.Module):
    """LayerNorms 32 wide (their outputs, 16 KiB at batch 8 x 16 tokens, travel as payloads)
    between projections 96 and 128 wide (sketch-only): the captures a microbatch stores
    payload-carrying records after the others of its batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln1 = torch.nn.LayerNorm(32)
        self.qkv = torch.nn.Linear(32, 96)
        self.proj = torch.nn.Linear(96, 32)
        self.ln2 = torch.nn.LayerNorm(32)
        self.fc1 = torch.nn.Linear(32, 128)
        self.fc2 = torch.nn.Linear(128, 32)

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x)))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


FORWARD = ["ln1", "qkv", "proj", "ln2", "fc1", "fc2"]
"""Modules in the order their forward hooks fire."""


def _train(agent, model, microbatches: int = 2) -> None:
    with agent.step(0):
        for mb in range(microbatches):
            with agent.microbatch(mb):
                x = torch.randn(8, 16, 32)
                agent.capture(x, site="input", phase="input")
                loss = model(x).square().mean()
                agent.capture(loss, site="loss", phase="loss")
                loss.backward()


def _rows(db, run: str) -> list[tuple]:
    reader = Reader(db)
    try:
        return list(reader.records(run))
    finally:
        reader.close()


def _check_hook_order(rows: list[tuple]) -> None:
    """Every record numbered, numbers unique, and in the order the hooks fired."""
    orders = [r[COL["capture_order"]] for r in rows]
    assert min(orders) > 0 and len(set(orders)) == len(orders)
    by_order = sorted(rows, key=lambda r: r[COL["capture_order"]])
    seq = [(r[1], r[2], r[3]) for r in by_order]  # (microbatch, phase, site)
    per_mb = defaultdict(list)
    for mb, phase, site in seq:
        per_mb[mb].append((phase, site))
    for mb in (0, 1):
        fwd = [s for p, s in per_mb[mb] if p == pb.PHASE_FWD]
        bwd = [s for p, s in per_mb[mb] if p == pb.PHASE_BWD]
        assert fwd == FORWARD
        assert bwd == FORWARD[::-1]  # backward hooks fire in reverse
        phases = [p for p, _ in per_mb[mb]]
        assert phases == sorted(phases, key=[pb.PHASE_INPUT, pb.PHASE_FWD, pb.PHASE_LOSS,
                                             pb.PHASE_BWD].index)
    # microbatch 0 entirely before microbatch 1, the step's gradient sweep after both
    assert [mb for mb, _, _ in seq] == sorted(mb for mb, _, _ in seq if mb >= 0) + [-1] * sum(
        mb == -1 for mb, _, _ in seq)
    grads = [s for mb, p, s in seq if p == pb.PHASE_GRAD]
    assert grads == [n for n, _ in Mixed().named_parameters()]  # the sweep's order


def test_numbers_follow_the_hooks_not_the_storage(auditor_server):
    model = Mixed()
    agent = numaudit.attach(model, run="mixed", address=auditor_server.address,
                          phases=("fwd", "bwd", "grad", "loss", "input"))
    _train(agent, model)
    s = agent.close()
    assert s["dropped"] == 0 and s["errors"] == 0
    rows = _rows(auditor_server.db_path, "mixed")
    _check_hook_order(rows)
    # what makes the numbers necessary: stored (record ids) in another order than captured
    fwd = [r for r in rows if r[2] == pb.PHASE_FWD and r[1] == 0]
    by_rid = [r[3] for r in sorted(fwd, key=lambda r: r[COL["record_id"]])]
    assert by_rid != FORWARD
    assert {r[3] for r in fwd if not r[COL["has_payload"]]} == {"qkv", "fc1"}  # 96, 128 wide


def test_numbers_survive_the_sidecar_its_spool_and_auditor_ingest(tmp_path):
    sock = f"unix://{tmp_path}/s.sock"
    sidecar = Sidecar(sock, tmp_path / "relay")  # no auditor: everything stays spooled
    sidecar.start()
    try:
        model = Mixed()
        agent = numaudit.attach(model, run="relayed", sidecar=sock,
                              phases=("fwd", "bwd", "grad", "loss", "input"))
        _train(agent, model)
        s = agent.close()
        assert s["dropped"] == 0 and s["held_by_sidecar"] == s["captured"]
    finally:
        sidecar.stop(grace=1)
    (result,) = replay_into_db([tmp_path / "relay"], tmp_path / "late.db")
    assert result.rejected == [] and result.stored == s["captured"]
    _check_hook_order(_rows(tmp_path / "late.db", "relayed"))


def test_fused_and_eager_captures_share_one_clock(auditor_server):
    """Captures that take the fused path and the general one (a replica override, a None, a
    complex tensor) interleaved: numbered as they were made."""
    agent = numaudit.attach(None, run="paths", address=auditor_server.address)
    with agent.step(0), agent.microbatch(0):
        agent.capture(torch.ones(4), site="a", phase="input")
        agent.capture(torch.ones(4), site="b", phase="input", replicate=True)
        agent.capture(torch.ones(4, dtype=torch.complex64), site="c", phase="input")
        agent.capture(None, site="d", phase="input")
        agent.capture(torch.ones(5000), site="e", phase="input")  # 20 KiB: no payload
        agent.capture(torch.ones(4), site="f", phase="input")
    s = agent.close()
    assert s["dropped"] == 0 and s["errors"] == 0
    rows = _rows(auditor_server.db_path, "paths")
    got = [r[3] for r in sorted(rows, key=lambda r: r[COL["capture_order"]])]
    assert got == ["a", "b", "c", "d", "e", "f"]


def test_every_chunk_of_a_payload_carries_its_capture_number(monkeypatch):
    """A payload cut into chunks travels as a record per chunk: each with its capture's
    number (the store keeps one record)."""
    monkeypatch.setattr(limits, "PAYLOAD_CHUNK_BYTES", 1 << 10)
    key = dict(step=0, microbatch=0, phase=pb.PHASE_INPUT, role=pb.ROLE_VALUE, index=0, call=0,
               stage=-1)
    none = Capture(site="none", layout=None, dtype="", is_none=True, moments=False, **key)
    big = Capture(site="big", layout=PieceLayout.full((2048,)), dtype="float32", moments=False,
                  row=0, payload=torch.randn(2048), **key)
    assert big.order > none.order > 0
    i64 = np.zeros((1, 6), np.int64)
    i64[0, 0] = 2048
    cols = part_columns(split_payloads([none, big], np.zeros((1, 5)), i64,
                                       lambda c, raw: ("raw", raw)))
    chunks = sorted(cols.payloads)
    assert len(chunks) == 8  # 8 KiB raw in 1 KiB chunks
    assert set(cols.cols["capture_order"][chunks].tolist()) == {big.order}
    assert cols.cols["capture_order"].tolist() == [none.order] + [big.order] * 8
