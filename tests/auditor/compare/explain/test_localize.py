"""Localize a diverged key to the ranks whose pieces differ (the finding's `pieces` field)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.report.text import to_text
from numaudit.protos import numaudit_pb2 as pb
from tests.auditor.synth import RunBuilder, one_ulp, shards, write_runs

DP2 = dict(world_size=2, mesh={0: [0], 1: [1]},
           register={"mesh_shape": [2], "mesh_dim_names": ["dp"]})


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _one_rank_reads_another(db: Path, *, payload: bool):
    """Single-process reference; DDP-2 candidate whose rank 1 reads rank 0's rows."""
    x, h = _batch()
    ref, cand = RunBuilder("ref"), RunBuilder("cand", **DP2)
    key = dict(step=0, microbatch=0, phase="input", site="input", role="value", payload=payload)
    ref.add_full(x, **key)
    bad = x.clone()
    bad[4:8] = x[0:4]
    cand.add_sharded(bad, [0, 1], **key)
    hk = dict(step=0, microbatch=0, phase="fwd", site="layers.0", role="output",
              payload=payload)
    ref.add_full(h, **hk)
    cand.add_sharded(h, [0, 1], **hk)
    write_runs(db, ref, cand)
    return compare_runs(db, "ref", "cand", preset_policy("fp32"))


def test_a_rank_reading_another_ranks_data_is_named_by_payloads(tmp_path):
    report = _one_rank_reads_another(tmp_path / "a.db", payload=True)
    first = report.first
    assert first.key.phase == "input"
    p = first.pieces
    assert p["method"] == "payload" and p["side"] == "cand" and p["cannot_localize"] is None
    assert p["agree"] == 1 and p["differ_count"] == 1
    [d] = p["differ"]
    assert d["ranks"] == [1] and d["mesh"] == {"dp": 1} and d["box"] == "[4:8, 0:16]"
    # the cause names the microbatch and the ranks
    assert "microbatch 0" in first.cause.reason and "ranks differ: dp=1" in first.cause.reason
    text = to_text(report, width=200)
    assert "ranks differ: dp=1 (rank 1 [4:8, 0:16]); 1 of 2 pieces agree (by payload)" in text
    doc = json.loads(to_json(report))
    assert doc["first_divergence"]["pieces"]["differ"][0]["mesh"] == {"dp": 1}
    assert all(f["pieces"] is None for f in doc["findings"] if not f["breach"])


def test_without_payloads_a_sub_box_cannot_be_localized_and_says_what_is_needed(tmp_path):
    p = _one_rank_reads_another(tmp_path / "a.db", payload=False).first.pieces
    assert p["method"] is None and p["differ"] == []
    assert "payloads from both runs" in p["cannot_localize"]
    assert "[0:8, 0:16] as one piece" in p["cannot_localize"]


def test_equal_boxes_use_fingerprints_and_leave_out_rounding_differences(tmp_path):
    """DDP-2 against DDP-2 on a 2-D mesh: rank 2's piece is far off, rank 0's one ulp off."""
    x, _ = _batch(1)
    mesh = dict(world_size=4, mesh={r: [r // 2, r % 2] for r in range(4)},
                register={"mesh_shape": [2, 2], "mesh_dim_names": ["dp", "tp"]})
    ref, cand = RunBuilder("ref", **mesh), RunBuilder("cand", **mesh)
    bad = one_ulp(x, 0)
    bad[4:8] += 1.0
    key = dict(step=0, microbatch=0, phase="fwd", site="layers.0", role="output")
    for b, t in ((ref, x), (cand, bad)):
        for half, (piece, lay) in enumerate(shards(t, 2)):
            for r in (2 * half, 2 * half + 1):  # replicas over tp
                b.add(r, piece, PieceLayout(lay.logical_shape, lay.offsets, lay.shape,
                                            replica=True), **key)
    write_runs(tmp_path / "a.db", ref, cand)
    report = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32"))
    p = report.first.pieces
    assert p["method"] == "fingerprint" and p["agree"] == 1
    [d] = p["differ"]
    assert d["ranks"] == [2, 3] and d["mesh"] == {"dp": 1} and d["box"] == "[4:8, 0:16]"
    assert d["rel_l2"] > 0.1


def test_reductions_over_the_batch_are_not_localized(tmp_path):
    """A per-rank loss is an addend of the whole value, not a piece of it: said, not guessed."""
    ref, cand = RunBuilder("ref"), RunBuilder("cand", **DP2)
    key = dict(step=0, microbatch=0, phase="loss", site="loss", role="value")
    ref.add_full(torch.tensor(1.0), **key)
    for r, v in enumerate((1.0, 3.0)):
        cand.add(r, torch.tensor(v), **key)
        lay = cand.records[r][-1].layout
        lay.reduce, lay.reduce_index, lay.reduce_count, lay.reduce_weight = \
            pb.REDUCTION_MEAN, r, 2, 1.0
    write_runs(tmp_path / "a.db", ref, cand)
    p = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32")).first.pieces
    assert p["method"] is None and "reduction over the batch" in p["cannot_localize"]


def test_rescaled_activation_gradients_are_localized_by_their_sketches(tmp_path):
    """DDP-2 with per-rank mean loss (grad_scale 2) against DDP-2 (grad_scale 1 declared as 2
    would hide it): equal boxes, no comparable fingerprints, so the pieces' sketches decide."""
    g = torch.Generator().manual_seed(5)
    gy = torch.randn(8, 64, generator=g)
    ref = RunBuilder("ref", **DP2)
    cand = RunBuilder("cand", **{**DP2, "register": {**DP2["register"], "grad_scale": 2.0}})
    key = dict(step=0, microbatch=0, phase="bwd", site="layers.0", role="grad_output")
    ref.add_sharded(gy, [0, 1], **key)
    bad = gy * 2
    bad[0:4] *= 1.5  # rank 0's rows are off beyond the x2 the conventions explain
    cand.add_sharded(bad, [0, 1], **key)
    write_runs(tmp_path / "a.db", ref, cand)
    p = compare_runs(tmp_path / "a.db", "ref", "cand", preset_policy("fp32")).first.pieces
    assert p["method"] == "moments" and p["agree"] == 1
    [d] = p["differ"]
    assert d["ranks"] == [0] and d["mesh"] == {"dp": 0} and d["box"] == "[0:4, 0:64]"


def test_mesh_helpers_name_shared_and_varying_dims():
    from numaudit.auditor.compare.merge.ranks import fixed_dims, varying_dims

    mesh = {"dims": ["dp", "tp"], "coords": {r: (r // 2, r % 2) for r in range(4)}}
    assert fixed_dims(mesh, [2, 3]) == {"dp": 1}
    assert varying_dims(mesh, [2, 3]) == ["tp"]
    assert varying_dims(mesh, [0, 3]) == ["dp", "tp"]
    assert fixed_dims({"dims": [], "coords": {}}, [0]) == {}
    assert varying_dims(mesh, [0, 7]) == []  # rank 7 registered no coordinate
