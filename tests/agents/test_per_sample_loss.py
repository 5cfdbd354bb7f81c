"""A per-sample loss vector (``reduction="none"``) captured with phase loss is the batch's rows,
joined across dp ranks like an activation, not a reduction over them (issue 37, point 6).

Two dp ranks are two agents in this process (dp_rank/dp_size given to attach, RANK set), against
a real daemon and store; the comparison is the auditor's own."""

from __future__ import annotations

import copy

import pytest
import torch

import numaudit
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.text import to_text
from numaudit.auditor.store import RECORD_COLUMNS, Reader
from numaudit.protos import numaudit_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def _job(address: str, run: str, model: torch.nn.Module, x: torch.Tensor, rows: slice,
         dp_rank: int, dp_size: int, monkeypatch, vector: bool = True) -> None:
    monkeypatch.setenv("RANK", str(dp_rank))
    monkeypatch.setenv("WORLD_SIZE", str(dp_size))
    model = copy.deepcopy(model)
    agent = numaudit.attach(model, run=run, address=address, dp_rank=dp_rank, dp_size=dp_size,
                          phases=("loss",))
    with agent.step(0), agent.microbatch(0):
        per_sample = torch.nn.functional.mse_loss(model(x[rows]), torch.zeros(len(x[rows]), 1),
                                                  reduction="none").squeeze(-1)
        agent.capture(per_sample if vector else per_sample.reshape(-1)[:1], site="loss",
                      phase="loss")
        per_sample.mean().backward()
    summary = agent.close()
    assert summary["acked"] == summary["captured"] == 1


def test_a_per_sample_loss_vector_is_joined_on_the_batch_dim(auditor_server, monkeypatch):
    """Before, each rank's [2] was taken as its mean over its rows: "logical shape [4] in one,
    [2] in dp … no loss reduction explains the difference"."""
    addr, db = auditor_server.address, auditor_server.db_path
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 1), torch.randn(4, 4)
    _job(addr, "one", model, x, slice(0, 4), 0, 1, monkeypatch)
    for rank in range(2):
        _job(addr, "dp", model, x, slice(2 * rank, 2 * rank + 2), rank, 2, monkeypatch)
    reader = Reader(db)
    try:
        rows = [dict(zip(RECORD_COLUMNS, r)) for r in reader.records("dp")]
    finally:
        reader.close()
    assert {(r["reduce"], r["logical_shape"], r["offsets"]) for r in rows} == {
        (pb.REDUCTION_NONE, "[4]", "[0]"), (pb.REDUCTION_NONE, "[4]", "[2]")}
    report = compare_runs(db, "one", "dp", preset_policy("fp32"))
    assert report.exit_code == 0, to_text(report)
    [loss] = list(report.findings())
    assert loss.shape == [4] and loss.verdict in ("identical", "close")


def test_a_loss_of_one_element_is_still_a_reduction(auditor_server, monkeypatch):
    """Not 0-dim, but not as many elements as the rank's samples: a reduction, as before."""
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 1), torch.randn(4, 4)
    _job(auditor_server.address, "dp1", model, x, slice(0, 2), 0, 2, monkeypatch, vector=False)
    reader = Reader(auditor_server.db_path)
    try:
        [row] = [dict(zip(RECORD_COLUMNS, r)) for r in reader.records("dp1")]
    finally:
        reader.close()
    assert row["reduce"] == pb.REDUCTION_MEAN and row["logical_shape"] == "[1]"
