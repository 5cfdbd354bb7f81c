"""Layouts: boxes from DTensor placements and batch splits tile their logical tensor."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from numaudit.agents.layout import (
    PieceLayout,
    UnsupportedLayout,
    batch_layout,
    complex_real_layout,
    dtensor_layout,
    flat_layout,
    placements_layout,
)

# ----------------------------------------------------------------- PieceLayout


def test_full_and_validate():
    lay = PieceLayout.full((3, 4))
    assert lay == PieceLayout((3, 4), (0, 0), (3, 4)) and lay.is_full and lay.numel == 12
    lay.validate()
    PieceLayout.full(()).validate()
    with pytest.raises(ValueError, match="offsets"):
        PieceLayout((3, 4), (0,), (3, 4)).validate()
    with pytest.raises(ValueError, match=r"shape\[1\]"):
        PieceLayout((3, 4), (0, 2), (3, 3)).validate()
    with pytest.raises(ValueError, match=r"offsets\[0\].*negative"):
        PieceLayout((3, 4), (-1, 0), (1, 4)).validate()


def test_layout_proto_round_trip():
    from numaudit.protos import numaudit_pb2 as pb

    lay = PieceLayout((8, 6, 2), (4, 0, 0), (4, 6, 2), replica=True)
    msg = lay.to_proto(pb.Layout(), dtype="float32", complex_as_real=True)
    assert (msg.dtype, msg.complex_as_real) == ("float32", True)
    assert PieceLayout.from_proto(pb.Layout.FromString(msg.SerializeToString())) == lay


def test_flat_layout_is_a_range_of_the_flattening_and_travels_flat():
    """An FSDP1 rank's range of a parameter: its flattening, elements start .. start + count."""
    from numaudit.protos import numaudit_pb2 as pb

    lay = flat_layout(12, 5, 7)
    assert lay == PieceLayout((12,), (5,), (7,), flat=True) and lay.numel == 7
    assert flat_layout(12, 0, 0).numel == 0  # a rank that holds none of it
    msg = lay.to_proto(pb.Layout(), dtype="float32")
    assert msg.flat and PieceLayout.from_proto(pb.Layout.FromString(
        msg.SerializeToString())) == lay
    assert not PieceLayout.full((4, 3)).to_proto(pb.Layout(), dtype="float32").flat
    with pytest.raises(ValueError, match="start"):
        flat_layout(12, 6, 7)


def test_batch_layout():
    assert batch_layout((4, 16), dp_rank=2, dp_size=3) == PieceLayout((12, 16), (8, 0), (4, 16))
    assert batch_layout((), dp_rank=1, dp_size=4) == PieceLayout((4,), (1,), (1,))
    assert batch_layout((4, 16), 0, 1) == PieceLayout.full((4, 16))
    assert batch_layout((), 0, 1) == PieceLayout.full(())
    with pytest.raises(ValueError, match="dp_rank"):
        batch_layout((4,), 4, 4)
    # sequence-first tensors and an RNN's hidden state: the batch on dim 1
    assert batch_layout((5, 2, 8), 1, 2, dim=1) == PieceLayout((5, 4, 8), (0, 2, 0), (5, 2, 8))
    assert batch_layout((6,), 1, 2, dim=1) == PieceLayout((12,), (6,), (6,))  # no dim 1: dim 0


def test_complex_real_layout():
    lay = complex_real_layout(PieceLayout((8, 3), (4, 0), (4, 3), partial=True))
    assert lay == PieceLayout((8, 3, 2), (4, 0, 0), (4, 3, 2), partial=True)


# ----------------------------------------------------------------- placements (no processes)


def replay_box(global_shape, mesh_shape, coord, placements, dim):
    """The piece's indices on ``dim``, split the way distribute_tensor splits them."""
    index = torch.arange(global_shape[dim])
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == dim:
            index = Shard(0)._split_tensor(index, mesh_shape[mesh_dim], with_padding=False)[0][
                coord[mesh_dim]]
    return index


@st.composite
def sharded(draw):
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.integers(0, 9)) for _ in range(ndim))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 3))))
    kinds = st.one_of(st.builds(Shard, st.integers(0, ndim - 1)), st.just(Replicate()),
                      st.just(Partial()))
    placements = [draw(kinds) for _ in mesh_shape]
    return global_shape, mesh_shape, placements


@settings(max_examples=150, deadline=None)
@given(sharded())
def test_shard_pieces_are_boxes_that_tile(case):
    """Uneven, empty and nested shards on any dim of any mesh: boxes that tile, as torch splits."""
    global_shape, mesh_shape, placements = case
    copies = math.prod(s for s, p in zip(mesh_shape, placements) if not isinstance(p, Shard))
    cover = np.zeros(global_shape, dtype=np.int64)
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        lay = placements_layout(global_shape, mesh_shape, coord, placements)
        lay.validate()
        assert lay.replica == any(isinstance(p, Replicate) for p in placements)
        assert lay.partial == any(isinstance(p, Partial) for p in placements)
        cover[tuple(slice(o, o + s) for o, s in zip(lay.offsets, lay.shape))] += 1
        for d in range(len(global_shape)):
            index = replay_box(global_shape, mesh_shape, coord, placements, d)
            assert lay.shape[d] == index.numel()
            if index.numel():
                expected = torch.arange(lay.offsets[d], lay.offsets[d] + lay.shape[d])
                assert torch.equal(index, expected)
    assert (cover == copies).all()


def test_fsdp_tp_strided_shard_is_a_box():
    """FSDP2 + TP: TP shards rows first, FSDP shards each TP shard; every piece is one box."""
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    got = {c: placements_layout((8, 3), (2, 2), c, placements) for c in
           itertools.product(range(2), range(2))}
    assert {c: lay.offsets[0] for c, lay in got.items()} == {
        (0, 0): 0, (0, 1): 4, (1, 0): 2, (1, 1): 6}
    assert all(lay.shape == (2, 3) for lay in got.values())


def test_interleaved_strided_shard_is_refused():
    placements = [Shard(0), _StridedShard(0, split_factor=2)]
    with pytest.raises(UnsupportedLayout, match="_StridedShard"):
        placements_layout((8, 3), (2, 2), (0, 0), placements)


# ----------------------------------------------------------------- DTensors, fake process group
# (the fake_rank fixture is in conftest.py)


def test_dtensor_layout_matches_placements(fake_rank):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    cases = {
        (2, 2): [
            ((5, 7), [Shard(0), Shard(1)]),
            ((5, 3), [Shard(0), Replicate()]),
            ((6, 4), [Replicate(), Shard(0)]),
            ((3, 9), [Shard(1), Shard(1)]),
            ((2, 2), [Shard(0), Shard(0)]),  # rank (1, 1) holds nothing
        ],
        (4,): [((5, 3), [Shard(0)]), ((3, 6, 2), [Shard(1)])],
        (2, 1, 2): [((7, 5), [Shard(1), Replicate(), Shard(0)])],
    }
    for rank in range(4):
        fake_rank(rank)
        for mesh_shape, shard_cases in cases.items():
            mesh = DeviceMesh("cpu", torch.arange(4).view(mesh_shape))
            coord = mesh.get_coordinate()
            for shape, placements in shard_cases:
                dt = distribute_tensor(torch.zeros(shape), mesh, placements)
                lay = dtensor_layout(dt)
                assert lay == placements_layout(shape, mesh_shape, coord, placements)
                assert lay.shape == tuple(dt.to_local().shape)
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2))
        coord = mesh.get_coordinate()
        # digest_piece accepts the DTensor itself and digests its local shard
        from numaudit.agents.digest.digest import digest_piece

        dt = distribute_tensor(torch.arange(20.0).view(5, 4), mesh, [Shard(0), Shard(1)])
        lay = dtensor_layout(dt)
        assert torch.equal(digest_piece(dt, lay)[1], digest_piece(dt.to_local(), lay)[1])
        partial = DTensor.from_local(torch.zeros(3, 4), mesh, [Partial(), Shard(0)],
                                     run_check=False)
        lay = dtensor_layout(partial)
        assert lay.partial and not lay.replica and lay.logical_shape == (6, 4)
        assert lay.offsets == (3 * coord[1], 0)


# ----------------------------------------------------------------- real gloo job (slow)

GLOO_CASES = {
    # name: (mesh shape, global shape, placements)
    "shard0": ((4,), (8, 6), [Shard(0)]),
    "shard1": ((4,), (6, 8), [Shard(1)]),
    "uneven4_with_empty": ((4,), (5, 3), [Shard(0)]),
    "uneven2": ((2, 2), (5, 3), [Shard(0), Replicate()]),
    "shard0_shard1": ((2, 2), (5, 7), [Shard(0), Shard(1)]),
    "replicate_shard0": ((2, 2), (6, 4), [Replicate(), Shard(0)]),
    "nested_uneven": ((2, 2), (3, 9), [Shard(1), Shard(1)]),
    "fsdp_tp_strided": ((2, 2), (8, 3), [_StridedShard(0, split_factor=2), Shard(0)]),
    "interleaved_strided": ((2, 2), (8, 3), [Shard(0), _StridedShard(0, split_factor=2)]),
}


def full_tensor(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _gloo_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from numaudit.agents.digest.digest import digest_piece

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4,
                            init_method=f"file://{out_dir}/store")
    results = {}
    try:
        meshes = {}  # one mesh per shape: creating sub-groups is the slow part of the job
        for name, (mesh_shape, shape, placements) in GLOO_CASES.items():
            if mesh_shape not in meshes:
                meshes[mesh_shape] = init_device_mesh("cpu", mesh_shape)
            mesh = meshes[mesh_shape]
            full = full_tensor(name, shape)
            dt = distribute_tensor(full, mesh, placements)
            local = dt.to_local()
            try:
                lay = dtensor_layout(dt)
            except UnsupportedLayout as exc:
                results[name] = {"error": str(exc)}
                continue
            box = tuple(slice(o, o + s) for o, s in zip(lay.offsets, lay.shape))
            f, i = digest_piece(local, lay)
            results[name] = {"layout": [lay.logical_shape, lay.offsets, lay.shape, lay.replica],
                             "data_ok": bool(torch.equal(local, full[box])),
                             "f64": f.tolist(), "i64": i.tolist()}
        # Partial: each rank holds its own addend of a row shard; the sum is the logical tensor.
        mesh = meshes[(2, 2)]
        g = torch.Generator().manual_seed(100 + rank)
        addend = torch.randn(3, 4, generator=g)
        dt = DTensor.from_local(addend, mesh, [Partial(), Shard(0)], run_check=False)
        total = dt.full_tensor()
        lay = dtensor_layout(dt)
        f, i = digest_piece(addend, lay)
        results["partial"] = {"layout": [lay.logical_shape, lay.offsets, lay.shape, lay.partial],
                              "f64": f.tolist(), "i64": i.tolist(), "full": total.tolist()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    import multiprocessing

    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("gloo")
    # For these workers only: left in os.environ, it reached every later torchrun job of the
    # suite, where torch 2.13's gloo then aborted ranks at exit ("terminate called without an
    # active exception", after destroy_process_group: 4 of 24 DS3 reference jobs).
    with pytest.MonkeyPatch.context() as env:
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            env.setenv("GLOO_SOCKET_IFNAME", "lo")
        # Fresh processes, as with spawn, but torch and this module are imported once, in the
        # fork server, not once per rank: four imports at once were most of this job on 2 cores.
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
        mp.start_processes(_gloo_worker, args=(str(out),), nprocs=4, join=True,
                           start_method="forkserver")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_gloo_dtensor_pieces_tile_and_digests_merge(gloo_results):
    from numaudit.agents.digest.digest import digest_piece
    from numaudit.auditor.compare.digests.algebra import DigestValues, merge_disjoint, merge_partial

    for name, (_, shape, _) in GLOO_CASES.items():
        per_rank = [r[name] for r in gloo_results]
        if name == "interleaved_strided":
            assert all("_StridedShard" in r["error"] for r in per_rank)
            continue
        assert all(r["data_ok"] for r in per_rank), name
        boxes = {}
        for r in per_rank:  # replicas: one copy per box, all copies identical
            key = (tuple(r["layout"][1]), tuple(r["layout"][2]))
            if key in boxes:
                assert r["i64"] == boxes[key]["i64"] and r["layout"][3]
            boxes[key] = r
        cover = np.zeros(shape, dtype=np.int64)
        for off, size in boxes:
            cover[tuple(slice(o, o + s) for o, s in zip(off, size))] += 1
        assert (cover == 1).all(), name
        merged = merge_disjoint([DigestValues.from_rows(r["f64"], r["i64"], True)
                                 for r in boxes.values()])
        full = full_tensor(name, shape)
        f, i = digest_piece(full, PieceLayout.full(shape))
        whole = DigestValues.from_rows(f.tolist(), i.tolist(), True)
        assert merged.fingerprint == whole.fingerprint, name
        assert merged.numel == whole.numel and merged.min == whole.min
        assert merged.sum == pytest.approx(whole.sum, rel=1e-9, abs=1e-9)
        np.testing.assert_allclose(merged.sketch, whole.sketch, atol=1e-9)

    per_rank = [r["partial"] for r in gloo_results]
    full = torch.tensor(per_rank[0]["full"])
    by_box = {}
    for r in per_rank:
        assert r["layout"][3]  # partial
        by_box.setdefault(tuple(r["layout"][1]), []).append(
            DigestValues.from_rows(r["f64"], r["i64"], True))
    merged = merge_disjoint([merge_partial(v) for v in by_box.values()])
    f, _ = digest_piece(full, PieceLayout.full(tuple(full.shape)))
    assert merged.sum == pytest.approx(float(f[0]), abs=1e-5)
    np.testing.assert_allclose(merged.sketch, f[5:].numpy(), atol=1e-5)
    assert not merged.exact
