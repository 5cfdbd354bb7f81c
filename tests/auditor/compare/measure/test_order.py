"""Execution order is the order the agents' hooks fired (Record.capture_order), not the order
records were stored in: the first divergence, predecessors and heatmap rows follow it; runs
stored without numbers are ordered by record id, and the report says so once.

Runs are written through the real ingest path with each rank's records stored in another order
than their numbers (as an agent stores a microbatch's payload-carrying captures after its
sketch-only ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.live import LiveComparison
from numaudit.auditor.compare.measure.order import APPROXIMATED
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.html import to_html
from numaudit.auditor.store import Reader
from tests.auditor.synth import RunBuilder, shards, write_runs

pytestmark = pytest.mark.timeout(60)

EXECUTED = ["emb", "blocks.0.ln1", "blocks.0.qkv", "blocks.0.ln2", "blocks.0.fc1", "head"]
STORED = ["emb", "blocks.0.qkv", "blocks.0.fc1", "head", "blocks.0.ln1", "blocks.0.ln2"]
"""The layer norms' outputs travel as payloads: stored after the sketch-only captures."""


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


def model_run(name: str, *, bug_at: str | None = None, numbered: bool = True,
              world: int = 1, microbatches: int = 2) -> RunBuilder:
    """Each rank's fwd captures numbered in EXECUTED order and stored in STORED order; a bug
    at ``bug_at`` (microbatch 1, the last rank) changes that output and every later one."""
    b = RunBuilder(name, world_size=world, numbered=numbered)
    g = torch.Generator().manual_seed(0)
    outs = {(mb, s): torch.randn(4, 8, generator=g) for mb in range(microbatches) for s in EXECUTED}
    for rank in range(world):
        for mb in range(microbatches):
            broken = False
            for site in EXECUTED:
                t, layout = shards(outs[(mb, site)], world)[rank]  # dp: rows of the batch
                broken |= site == bug_at and mb == 1 and rank == world - 1
                b.add(rank, t + 1.0 if broken else t, layout, step=0, microbatch=mb,
                      phase="fwd", site=site, role="output")
        recs = b.records[rank]
        stored = sorted(recs, key=lambda r: (r.key.microbatch, STORED.index(r.key.site)))
        b.records[rank] = stored
    return b


def heatmap_rows(html: str, phase: str) -> list[str]:
    blob = re.search(r'<script type="application/json" id="numaudit-data">(.*?)</script>',
                     html, re.S).group(1)
    data = json.loads(blob)
    return next(h["rows"] for h in data["heatmaps"] if h["phase"] == phase)


def order_warnings(report) -> list[str]:
    return [w for w in report.warnings if w.startswith(APPROXIMATED)]


def test_first_divergence_and_rows_follow_the_capture_order(db):
    write_runs(db, model_run("ref"), model_run("cand", bug_at="blocks.0.ln1"))
    report = compare_runs(db, "ref", "cand", preset_policy("fp32"))
    first = report.first
    assert (first.key.site, first.key.microbatch) == ("blocks.0.ln1", 1)
    assert order_warnings(report) == []
    comp = report.comparison
    fwd_mb1 = [comp.key(int(i)).site for i in comp.order if comp.key(int(i)).microbatch == 1]
    assert fwd_mb1 == EXECUTED
    # the next key's predecessor is the bug's key: it inherited the divergence
    qkv = comp.find(0, 1, 1, comp.catalog.site_id("blocks.0.qkv"), 1)
    assert comp.key(int(comp.pred[qkv])).site == "blocks.0.ln1"
    assert heatmap_rows(to_html(report), "fwd") == EXECUTED


def test_runs_stored_without_numbers_are_ordered_by_storage_and_say_so(db):
    """An earlier build's agents: record-id order as before, and one warning."""
    write_runs(db, model_run("ref", numbered=False),
               model_run("cand", bug_at="blocks.0.ln1", numbered=False))
    report = compare_runs(db, "ref", "cand", preset_policy("fp32"))
    assert report.first.key.site == "blocks.0.qkv"  # the first stored of those that differ
    assert order_warnings(report) == [
        f"{APPROXIMATED} (record ids) for run 'ref': its records carry no capture order "
        "(stored by an agent of an earlier build), so the first divergence, causes and heatmap "
        "rows may not follow the order the hooks fired; re-run with a current agent"]
    assert heatmap_rows(to_html(report), "fwd") == STORED


def test_numbers_of_either_run_give_the_order(db):
    """A reference stored before numbers against a numbered candidate: the candidate's
    numbers order the keys both have; nothing rests on storage order, so no warning."""
    write_runs(db, model_run("old", numbered=False), model_run("new", bug_at="blocks.0.ln1"))
    report = compare_runs(db, "old", "new", preset_policy("fp32"))
    assert report.first.key.site == "blocks.0.ln1"
    assert order_warnings(report) == []


def test_ranks_of_a_data_parallel_run_agree_on_the_order(db):
    """Two ranks, each with its own clock, the bug on rank 1 only."""
    write_runs(db, model_run("ref"), model_run("dp2", world=2, bug_at="blocks.0.ln1"))
    report = compare_runs(db, "ref", "dp2", preset_policy("fp32"))
    assert (report.first.key.site, report.first.key.microbatch) == ("blocks.0.ln1", 1)


def test_stages_of_a_pipelined_reference_keep_their_order(db):
    """The reference runs layers 0-1 on stage 0 (rank 0) and 2-3 on stage 1 (rank 1), each
    rank numbering from 1; the candidate is one process. Keys of both stages share the
    candidate's stage (-1), so the reference's own stages order them (its ranks' clocks are
    not comparable): l1 (stage 0) breaches before l2 (stage 1), though their numbers tie."""
    sites = ["l0", "l1", "l2", "l3"]
    g = torch.Generator().manual_seed(1)
    outs = {s: torch.randn(4, 8, generator=g) for s in sites}
    ref = RunBuilder("pp2", world_size=2, stages={0: [0], 1: [1]})
    cand = RunBuilder("one")
    for i, s in enumerate(sites):
        ref.add(i // 2, outs[s], step=0, microbatch=0, phase="fwd", site=s, role="output",
                stage=i // 2)
        cand.add(0, outs[s] + (1.0 if s in ("l1", "l2") else 0.0), step=0, microbatch=0,
                 phase="fwd", site=s, role="output")
        if s == "l2":  # a module only the candidate has: placed after l2, in stage 1's frame
            cand.add(0, outs[s], step=0, microbatch=0, phase="fwd", site="l2_extra",
                     role="output")
    write_runs(db, ref, cand)
    report = compare_runs(db, "pp2", "one", preset_policy("fp32"))
    comp = report.comparison
    assert [comp.key(int(i)).site for i in comp.order] == ["l0", "l1", "l2", "l2_extra", "l3"]
    assert report.first.key.site == "l1"


def test_watch_reports_in_capture_order_and_warns_once_for_unnumbered_runs(db):
    write_runs(db, model_run("ref"), model_run("cand", bug_at="blocks.0.ln1"))
    reader = Reader(db)
    try:
        live = LiveComparison(reader, "ref", "cand", preset_policy("fp32"))
        events = live.poll() + live.flush()
        sites = [e.finding.key.site for e in events if e.finding and not e.first_divergence
                 and e.finding.key.microbatch == 1]
        assert sites == EXECUTED
        first = [e.finding for e in events if e.first_divergence]
        assert [f.key.site for f in first] == ["blocks.0.ln1"]
        assert not [e for e in events if e.status.startswith(APPROXIMATED)]
    finally:
        reader.close()
    write_runs(db, model_run("old-ref", numbered=False),
               model_run("old-cand", bug_at="blocks.0.ln1", numbered=False))
    reader = Reader(db)
    try:
        live = LiveComparison(reader, "old-ref", "old-cand", preset_policy("fp32"))
        events = live.poll() + live.poll() + live.flush()
        assert len([e for e in events if e.status.startswith(APPROXIMATED)]) == 1
    finally:
        reader.close()
