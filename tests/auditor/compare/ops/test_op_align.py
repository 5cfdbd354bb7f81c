"""Aligning two runs' operations of one module call (auditor/compare/ops/align.py): an operation
one run adds or lacks is said, never paired with the wrong partner."""

from __future__ import annotations

from numaudit.auditor.compare.ops.align import align_ops, describe, unpaired_kind
from numaudit.wire.ops import is_collective, op_site, parse_op_site


def _ops(*names: str) -> list[tuple[int, str]]:
    return list(enumerate(names))


def test_equal_sequences_pair_one_to_one():
    al = align_ops(_ops("aten.t", "aten.mm", "aten.relu"), _ops("aten.t", "aten.mm", "aten.relu"))
    assert al.pairs == [(0, 0), (1, 1), (2, 2)] and not al.only_ref and not al.only_cand
    assert describe(al, "ref", "cand") == []


def test_a_missing_all_reduce_is_unpaired_and_what_follows_still_pairs():
    ref = _ops("aten.t", "aten.mm", "c10d.allreduce_", "aten.add.Tensor", "aten.relu")
    cand = _ops("aten.t", "aten.mm", "aten.add.Tensor", "aten.relu")
    al = align_ops(ref, cand)
    assert al.pairs == [(0, 0), (1, 1), (3, 2), (4, 3)]
    assert al.only_ref == [2] and al.place[("ref", 2)] == 2
    assert describe(al, "ref", "cand") == [
        "ref runs the collective c10d.allreduce_ (op 2), which cand does not"]


def test_an_added_collective_sits_after_the_operation_before_it():
    al = align_ops(_ops("aten.mm", "aten.relu"),
                   _ops("aten.mm", "_c10d_functional.all_gather_into_tensor", "aten.relu"))
    assert al.pairs == [(0, 0), (1, 2)] and al.only_cand == [1]
    assert 0 < al.place[("cand", 1)] < 1
    assert unpaired_kind("_c10d_functional.all_gather_into_tensor") == "collective"


def test_a_split_operation_is_said_as_decomposed_otherwise():
    al = align_ops(_ops("aten.t", "aten.addmm", "aten.relu"),
                   _ops("aten.t", "aten.mm", "aten.add.Tensor", "aten.relu"))
    assert al.pairs == [(0, 0), (2, 3)]
    (line,) = describe(al, "ref", "cand")
    assert "aten.addmm (op 1) in ref are aten.mm (op 1), aten.add.Tensor (op 2) in cand" in line
    assert "decompose this computation otherwise" in line


def test_casts_are_named_as_casts():
    al = align_ops(_ops("aten.t", "aten.mm"), _ops("aten._to_copy", "aten.t", "aten.mm"))
    assert describe(al, "f32", "bf16") == [
        "bf16 runs the cast aten._to_copy (op 0), which f32 does not"]


def test_op_sites_round_trip_and_module_sites_are_not_ops():
    site = op_site("layers.1.attention", 12, "aten.mm")
    assert site == "layers.1.attention/12:aten.mm"
    assert parse_op_site(site) == ("layers.1.attention", 12, "aten.mm")
    assert parse_op_site("layers.1.attention") is None
    assert parse_op_site("a/x:aten.mm") is None
    assert is_collective("c10d.allreduce_") and not is_collective("aten.mm")
