"""Keys at the edges: tensors without elements, and keys stored twice with other content."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.report.text import to_text
from numaudit.auditor.store.writer import StoreWriter
from numaudit.protos import numaudit_pb2 as pb
from numaudit.wire import limits
from tests.auditor.synth import RunBuilder, piece_record, write_runs


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "audit.db"


def _expert_runs(db: Path, *, partial: bool, cand_dtype=torch.float32):
    """An MoE expert that received no tokens ([0, 16]) between two keys that differ."""
    g = torch.Generator().manual_seed(0)
    before, after = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    empty = torch.zeros(0, 16)
    ref, cand = RunBuilder("ref"), RunBuilder("ep", world_size=2)
    key = dict(step=0, microbatch=0, phase="fwd", role="output")
    for b, ranks in ((ref, [0]), (cand, [0, 1])):
        for site, t in (("layers.0.experts.0", before), ("layers.0.experts.1", empty),
                        ("layers.0.experts.2", after * (1.5 if b is cand else 1.0))):
            if b is cand and t.numel() == 0:
                t = t.to(cand_dtype)  # a bf16 candidate: fingerprints cannot decide
            for r in ranks:
                lay = PieceLayout.full(tuple(t.shape))
                if len(ranks) > 1:
                    lay = PieceLayout(lay.logical_shape, lay.offsets, lay.shape,
                                      partial=partial, replica=not partial)
                b.add(r, t / len(ranks) if partial else t, lay, site=site, **key)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "ep", preset_policy("fp32"))


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("cand_dtype", [torch.float32, torch.bfloat16])
def test_an_empty_tensor_compares_as_empty_and_lends_nothing(db, partial, cand_dtype):
    report = _expert_runs(db, partial=partial, cand_dtype=cand_dtype)
    by_site = {f.key.site: f for f in report.findings()}
    empty = by_site["layers.0.experts.1"]
    assert empty.verdict == "identical" and empty.numel == 0 and empty.shape == [0, 16]
    assert "rel_l2" not in empty.metrics
    assert report.first.key.site == "layers.0.experts.2"
    assert report.first.cause.kind == "introduced"
    to_json(report)
    to_text(report)


def test_empty_against_a_tensor_is_a_shape_difference(db):
    ref, cand = RunBuilder("ref"), RunBuilder("cand")
    key = dict(step=0, microbatch=0, phase="fwd", site="e", role="output")
    ref.add_full(torch.zeros(0, 4), **key)
    cand.add_full(torch.ones(2, 4), **key)
    write_runs(db, ref, cand)
    f = compare_runs(db, "ref", "cand").first
    assert f.verdict == "diverged" and f.metric == "shape"


def test_merge_side_with_an_empty_key_last_does_not_crash():
    import numpy as np

    from numaudit.auditor.compare.read.segments import segment_reduce
    v = np.arange(5.0)
    out = segment_reduce(np.add, v, np.array([0, 2, 5, 5]), 5, 0.0)
    assert out.tolist() == [1.0, 9.0, 0.0, 0.0]
    assert segment_reduce(np.maximum, v, np.array([0, 0, 3]), 5, -np.inf).tolist() == \
        [-np.inf, 2.0, 4.0]


def _store_twice(db: Path, run: str, first: torch.Tensor, second: torch.Tensor) -> None:
    """One session sends a key, then sends it again with other content (a rerun)."""
    writer = StoreWriter(db, synchronous="NORMAL")
    try:
        sid = f"{run}-0"
        req = pb.RegisterRequest(schema_version=limits.CURRENT_SCHEMA_VERSION, run=run,
                                 session_id=sid, rank=0, world_size=1, torch_version="2.13.0",
                                 dtype="float32", host="synth", local_rank=0)
        writer.submit(lambda s: s.register(req)).result()
        for seq, t in enumerate((first, second), start=1):
            rec = piece_record(t, PieceLayout.full(tuple(t.shape)), step=0, microbatch=0,
                               phase="fwd", site="layers.0")
            batch = pb.RecordBatch(schema_version=limits.CURRENT_SCHEMA_VERSION, session_id=sid,
                                   seq=seq, records=[rec])
            writer.submit(lambda s, b=batch: s.ingest(b)).result()
    finally:
        writer.close()


def test_conflicting_content_for_one_key_is_a_conflict_never_identical(db):
    t = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    _store_twice(db, "ref", t, t)
    _store_twice(db, "cand", t, t + 1)  # the first stored equals ref: a false pass before
    report = compare_runs(db, "ref", "cand", preset_policy("bitwise"))
    f = report.first
    assert f is not None and f.verdict == "conflict" and f.breach
    assert report.exit_code == 1 and report.counts["conflict"] == 1
    assert "rank 0 sent this key again with other content" in " ".join(f.notes)
    assert "conflict" in to_text(report)
    assert '"conflict": 1' in to_json(report)
