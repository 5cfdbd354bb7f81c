"""Outputs that do not hold the batch (auditor.compare.merge.replicas): transformers' rotary
cos/sin, ``[1, seq, dim]`` whole on every rank, are compared per microbatch as replicas, never
joined as batch pieces: with one sample per rank (the agent cannot tell them from a one-row share)
and under any grouping of the samples into microbatches.

Real tensors digested by the agent's code with the agent's layouts, stored through the ingest
path (tests/auditor/synth)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from numaudit.agents.layout import PieceLayout, batch_layout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.json_report import to_json
from tests.auditor.synth import RunBuilder, write_runs

S, D = 8, 16
ROT = "model.rotary_emb"


def _rotary(seed: int = 0) -> torch.Tensor:
    return torch.randn(1, S, D, generator=torch.Generator().manual_seed(100 + seed))


def _samples(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, S, D, generator=torch.Generator().manual_seed(seed))


def _report(db: Path, ref: str, cand: str) -> dict:
    return json.loads(to_json(compare_runs(db, ref, cand, preset_policy("fp32"))))


def _verdicts(report: dict, site: str) -> dict[tuple[int, int], str]:
    return {(f["key"]["microbatch"], f["key"]["index"]): f["verdict"]
            for f in report["findings"] if f["key"]["site"] == site}


def _one_process(name: str, mbs: int, per_mb: int, rotary=_rotary) -> RunBuilder:
    """One process: `mbs` microbatches of `per_mb` samples, the rotary whole in each."""
    run = RunBuilder(name)
    x = _samples(mbs * per_mb)
    for m in range(mbs):
        key = dict(step=0, microbatch=m, phase="fwd", payload=True)
        run.add_full(x[m * per_mb:(m + 1) * per_mb], site="model.embed_tokens", **key)
        run.add_full(rotary(m), site=ROT, **key)
    return run


def _data_parallel(name: str, world: int, rotary_layout, rotary=_rotary,
                   rows=None) -> RunBuilder:
    """`world` dp ranks, one microbatch of `world` x (rows // world) samples; each rank's rotary
    placed by `rotary_layout(rank)`."""
    run = RunBuilder(name, world_size=world)
    x = _samples(world) if rows is None else rows
    share = len(x) // world
    key = dict(step=0, microbatch=0, phase="fwd", payload=True)
    for rank in range(world):
        mine = x[rank * share:(rank + 1) * share]
        run.add(rank, mine, batch_layout(tuple(mine.shape), rank, world),
                site="model.embed_tokens", **key)
        run.add(rank, rotary(rank), rotary_layout(rank), site=ROT, **key)
    return run


def test_one_sample_per_rank_rotary_copies_compare_as_the_one_tensor(tmp_path):
    """DDP-2 with one sample per rank: the agent records each rank's [1, S, D] as a one-row
    share of [2, S, D]; bitwise copies where the reference holds [1, S, D] are that one
    tensor (identical), not a batch of two."""
    ref = _one_process("ref", 1, 2, rotary=lambda m: _rotary(0))
    cand = _data_parallel("ddp", 2, lambda r: batch_layout((1, S, D), r, 2),
                          rotary=lambda r: _rotary(0))
    report = _report(write_runs(tmp_path / "a.db", ref, cand), "ref", "ddp")
    assert report["summary"]["breaches"] == 0, report["summary"]
    assert _verdicts(report, ROT) == {(0, 0): "identical"}


def test_one_row_shares_that_differ_stay_shares(tmp_path):
    """Rank 1's rotary differs from rank 0's: not copies, so never collapsed into one tensor
    (which would hide the difference): the key stays a batch of two and breaches."""
    ref = _one_process("ref", 1, 2, rotary=lambda m: _rotary(0))
    cand = _data_parallel("ddp", 2, lambda r: batch_layout((1, S, D), r, 2),
                          rotary=lambda r: _rotary(r))
    report = _report(write_runs(tmp_path / "b.db", ref, cand), "ref", "ddp")
    assert report["summary"]["exit_code"] == 1
    assert _verdicts(report, ROT)[(0, 0)] != "identical"


def test_every_rank_reading_the_same_sample_is_not_taken_for_a_replica(tmp_path):
    """Both ranks read sample 0 (a data bug): their one-row pieces are bitwise copies, but the
    reference holds the key as two different rows, so they stay batch shares and differ."""
    x = _samples(2)
    ref = _data_parallel("ref", 2, lambda r: batch_layout((1, S, D), r, 2), rows=x)
    cand = _data_parallel("bug", 2, lambda r: batch_layout((1, S, D), r, 2),
                          rows=torch.cat([x[:1], x[:1]]))
    report = _report(write_runs(tmp_path / "c.db", ref, cand), "ref", "bug")
    assert _verdicts(report, "model.embed_tokens")[(0, 0)] == "diverged"


def test_regrouped_replicas_are_compared_in_every_target_microbatch(tmp_path):
    """One process with 2 microbatches of 2 samples against DDP-2 with one microbatch of 4
    (2 a rank): each rank's samples are one microbatch of the reference, and the rotary (a
    replica on both ranks) is compared with each microbatch's, not missing from microbatch 1."""
    ref = _one_process("ref", 2, 2, rotary=lambda m: _rotary(0))
    cand = _data_parallel("ddp", 2, lambda r: PieceLayout((1, S, D), (0, 0, 0), (1, S, D),
                                                          replica=True),
                          rotary=lambda r: _rotary(0), rows=_samples(4))
    db = write_runs(tmp_path / "d.db", ref, cand)
    report = _report(db, "ref", "ddp")
    assert report["summary"]["breaches"] == 0, report["summary"]
    assert _verdicts(report, ROT) == {(0, 0): "identical", (1, 0): "identical"}
    # a reference whose microbatch 1 rotary differs is found there, against the spread copy
    bad = _one_process("ref_bad", 2, 2, rotary=lambda m: _rotary(m))
    report = _report(write_runs(db, bad), "ref_bad", "ddp")
    assert _verdicts(report, ROT) == {(0, 0): "identical", (1, 0): "diverged"}


def test_microbatches_regrouped_into_one_must_agree_with_each_other(tmp_path):
    """4 accumulated microbatches of 2 against one of 8: the four rotary outputs come together
    in the one microbatch as replicas of one another and of the reference's; one that differs
    is a replica divergence, never averaged away."""
    ref = _one_process("one", 1, 8, rotary=lambda m: _rotary(0))
    acc = _one_process("acc", 4, 2, rotary=lambda m: _rotary(0))
    odd = _one_process("acc_odd", 4, 2, rotary=lambda m: _rotary(int(m == 2)))
    db = write_runs(tmp_path / "e.db", ref, acc, odd)
    report = _report(db, "one", "acc")
    assert report["summary"]["breaches"] == 0, report["summary"]
    assert report["summary"]["verdicts"]["missing_in_cand"] == 0
    assert _verdicts(report, ROT) == {(0, 0): "identical"}
    report = _report(db, "one", "acc_odd")
    assert _verdicts(report, ROT) == {(0, 0): "replica_divergence"}
