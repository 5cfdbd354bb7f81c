"""Flat pieces (Layout.flat): FSDP1 holds each rank's range of a parameter's flattening, whatever
the parameter's shape. Their digests index elements by flat index, as every piece's do, so a key
held as flat pieces compares with the same tensor held as boxes of its own shape when the element
counts agree, through the real ingest path, store (SQLite and PostgreSQL) and comparison."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from numaudit.agents.layout import PieceLayout
from numaudit.auditor.compare.engine import compare_runs
from numaudit.auditor.compare.measure.verdicts import same_shapes
from numaudit.auditor.compare.merge.tiling import INCOMPLETE, plan_tiling
from numaudit.auditor.compare.policy.load import preset_policy
from numaudit.auditor.compare.read.pieces import Piece
from numaudit.auditor.report.json_report import to_json
from numaudit.auditor.report.text import to_text
from tests.auditor.synth import RunBuilder, piece_record, write_runs

pytestmark = pytest.mark.timeout(120)

SITE = "layers.0.weight"
KEY = dict(step=0, microbatch=-1, phase="param", site=SITE, role="value")


def weight(numel: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(numel, generator=g)


def add_flat(b: RunBuilder, rank: int, values: torch.Tensor, start: int, stop: int, *,
             payload: bool = False, **key) -> None:
    """Elements start .. stop of `values`' flattening as a flat piece of `rank`."""
    flat = values.reshape(-1)
    lay = PieceLayout((flat.numel(),), (start,), (stop - start,))
    rec = piece_record(flat[start:stop], lay, sketch_k=b.sketch_k, payload=payload,
                       **(key or KEY))
    rec.layout.flat = True
    b.records.setdefault(rank, []).append(rec)


def box_run(values: torch.Tensor, *, payload: bool = False) -> RunBuilder:
    """The single-process reference: the (4, 3) tensor as one full box on rank 0."""
    ref = RunBuilder("ref")
    ref.add(0, values.reshape(4, 3), payload=payload, **KEY)
    return ref


def flat_run(values: torch.Tensor, cuts: list[int], name: str = "cand", *,
             payload: bool = False) -> RunBuilder:
    """FSDP1-like: rank r holds elements cuts[r] .. cuts[r + 1] of the flattening."""
    cand = RunBuilder(name, world_size=len(cuts) - 1)
    for rank, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        add_flat(cand, rank, values, a, b, payload=payload)
    return cand


def only(report):
    (finding,) = list(report.findings())
    return finding


def json_finding(report) -> dict:
    (finding,) = json.loads(to_json(report))["findings"]
    return finding


@pytest.mark.parametrize("payload", [False, True])
def test_flat_pieces_are_identical_to_the_box_of_the_same_values(store_location, payload):
    w = weight()
    write_runs(store_location, box_run(w, payload=payload), flat_run(w, [0, 5, 12],
                                                                     payload=payload))
    report = compare_runs(store_location, "ref", "cand", preset_policy("bitwise"))
    f = only(report)
    assert (f.verdict, f.breach, f.metric) == ("identical", False, "exact")
    assert f.ranks == {"ref": [0], "cand": [0, 1]} and f.numel == 12
    assert f.shape == [4, 3]  # the reference's: the flat side's says only its count
    assert json_finding(report)["shape"] == [4, 3]  # the JSON report's own renderer too
    assert json_finding(report)["verdict"] == "identical"
    to_text(report)


@pytest.mark.parametrize("payload", [False, True])
def test_one_changed_element_of_a_flat_piece_diverges(store_location, payload):
    w = weight()
    changed = w.clone()
    changed[7] += 0.5
    write_runs(store_location, box_run(w, payload=payload),
               flat_run(changed, [0, 5, 12], payload=payload))
    report = compare_runs(store_location, "ref", "cand", preset_policy("fp32"))
    f = only(report)
    assert f.verdict == "diverged" and f.breach and f.metric != "shape"
    assert not any("logical shape" in n for n in f.notes)
    assert json_finding(report)["verdict"] == "diverged"
    to_text(report)
    # the pieces are named by their ranges of the flattening: the reference's box is [0:12]
    if payload:
        assert (f.pieces["method"], f.pieces["side"]) == ("payload", "cand")
        assert [(d["ranks"], d["box"]) for d in f.pieces["differ"]] == [([1], "[5:12]")]
    else:
        assert f.pieces["cannot_localize"].startswith("ref holds [0:12] as one piece (rank 0)")


def test_boxes_that_are_ranges_of_the_flattening_localize_against_flat_pieces(store_location):
    """Rows sharded on dim 0 are ranges of the flattening: [0:6] and [6:12] against flat pieces
    [0, 6) + [6, 12), compared range by range; column shards are no such ranges."""
    w = weight()
    changed = w.clone()
    changed[9] += 0.5
    rows = RunBuilder("rows", world_size=2)
    rows.add_sharded(changed.reshape(4, 3), [0, 1], dim=0, **KEY)
    columns = RunBuilder("columns", world_size=2)
    columns.add_sharded(changed.reshape(4, 3), [0, 1], dim=1, **KEY)
    write_runs(store_location, flat_run(w, [0, 6, 12], "ref"), rows, columns)
    f = only(compare_runs(store_location, "ref", "rows", preset_policy("fp32")))
    assert f.verdict == "diverged" and f.pieces["side"] == "cand"
    assert [(d["ranks"], d["box"]) for d in f.pieces["differ"]] == [([1], "[6:12]")]
    assert f.pieces["agree"] == 1
    f = only(compare_runs(store_location, "ref", "columns", preset_policy("fp32")))
    assert f.verdict == "diverged"
    assert f.pieces["cannot_localize"] == (
        "one run holds flat pieces (ranges of the tensor's flattening), the other boxes of its "
        "shape that are not such ranges")


def test_flat_pieces_that_leave_a_gap_are_incomplete(store_location):
    w = weight()
    cand = RunBuilder("cand", world_size=2)
    add_flat(cand, 0, w, 0, 5)
    add_flat(cand, 1, w, 6, 12)
    write_runs(store_location, box_run(w), cand)
    f = only(compare_runs(store_location, "ref", "cand", preset_policy("bitwise")))
    assert (f.verdict, f.breach) == ("incomplete", True)
    assert "cover 11 of 12 elements" in f.detail and "[5:6]" in f.detail


def test_flat_pieces_of_another_element_count_diverge_on_the_shape(store_location):
    w = weight(13)
    write_runs(store_location, box_run(w[:12]), flat_run(w, [0, 5, 13]))
    report = compare_runs(store_location, "ref", "cand", preset_policy("bitwise"))
    f = only(report)
    assert (f.verdict, f.breach, f.metric) == ("diverged", True, "shape")
    assert f.notes == ["logical shape [4, 3] in ref, [13] (flat pieces) in cand"]
    assert json_finding(report)["metric"] == "shape"
    to_text(report)


def test_a_flat_piece_next_to_a_box_in_one_run_is_incomplete(store_location):
    """Two mixes: a (12,) tensor whose logical shapes agree (only the flag tells them apart),
    and the (4, 3) one whose logical shapes differ."""
    w = weight()
    cand = RunBuilder("cand", world_size=2)
    add_flat(cand, 0, w, 0, 5)
    cand.add(1, w[5:], PieceLayout((12,), (5,), (7,)), **KEY)
    other = dict(KEY, site="layers.1.weight")
    add_flat(cand, 0, w, 0, 6, **other)
    cand.add(1, w.reshape(4, 3)[2:], PieceLayout((4, 3), (2, 0), (2, 3)), **other)
    ref = box_run(w)
    ref.add(0, w.reshape(4, 3), **other)
    write_runs(store_location, ref, cand)
    findings = {f.key.site: f for f in compare_runs(store_location, "ref", "cand").findings()}
    for site in (SITE, "layers.1.weight"):
        f = findings[site]
        assert (f.verdict, f.breach) == ("incomplete", True), site
        assert f.detail == ("cand: ranks disagree on the layout: ranks 0 send flat pieces "
                            "(ranges of the tensor's flattening), ranks 1 boxes of its own "
                            "shape"), site


def test_flat_pieces_of_two_splits_are_identical(store_location):
    """Both runs FSDP1-like, sharded differently: [0, 5) + [5, 12) against [0, 7) + [7, 12)."""
    w = weight()
    write_runs(store_location, flat_run(w, [0, 5, 12], "ref"), flat_run(w, [0, 7, 12]))
    f = only(compare_runs(store_location, "ref", "cand", preset_policy("bitwise")))
    assert (f.verdict, f.breach, f.shape) == ("identical", False, [12])


def test_flat_against_flat_of_another_count_diverges_on_the_shape(store_location):
    w = weight(13)
    write_runs(store_location, flat_run(w[:12], [0, 5, 12], "ref"), flat_run(w, [0, 7, 13]))
    f = only(compare_runs(store_location, "ref", "cand", preset_policy("bitwise")))
    assert (f.verdict, f.metric) == ("diverged", "shape")
    assert f.notes == ["logical shape [12] (flat pieces) in ref, [13] (flat pieces) in cand"]


def test_shapes_agree_by_element_count_only_where_a_side_is_flat():
    """`Catalog.shapes` entries are (shape, complex_as_real, flat). complex_as_real must agree
    too: a (2, 3, 2) real view of a complex tensor is not 12 flat real elements."""
    catalog = SimpleNamespace(shapes=[((4, 3), False, False), ((2, 3, 2), True, False),
                                      ((12,), False, True), ((13,), False, True),
                                      ((12,), False, False)])
    box, cplx, flat, flat13, vector = range(5)
    r = np.array([box, cplx, flat, flat, -1, flat13, box, vector])
    c = np.array([flat, flat, box, flat, flat, flat, vector, flat])
    n_r = np.array([12, 12, 12, 12, -1, 13, 12, 12])
    n_c = np.array([12, 12, 12, 12, 12, 12, 12, 12])
    assert same_shapes(catalog, r, c, n_r, n_c).tolist() == [
        True, False, True, True, False, False, False, True]


def test_the_merge_refuses_a_mix_whatever_the_shapes():
    flat = Piece("float32", (12,), (0,), (5,), flat=True)
    assert plan_tiling([flat, Piece("float32", (12,), (5,), (7,))]).status == INCOMPLETE
    assert plan_tiling([flat, Piece("float32", (12,), (5,), (7,), flat=True)]).flat
