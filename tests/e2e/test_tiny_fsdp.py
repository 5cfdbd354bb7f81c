"""Issue 2 end to end: `auditor serve` + a 2-rank FSDP2 torchrun job with the agent attached."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest

from numaudit.auditor.store import RECORD_COLUMNS, Reader
from numaudit.protos import numaudit_pb2 as pb

from .helpers import Daemon, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _tiles(pieces) -> bool:
    """Distinct regions of the pieces are disjoint boxes covering the logical shape exactly."""
    logical = pieces[0]["logical"]
    regions = {(tuple(p["offsets"]), tuple(p["shape"])) for p in pieces}
    if any(p["logical"] != logical for p in pieces):
        return False
    # identical regions are allowed only when declared replicas
    if len(regions) < len(pieces) and not all(p["replica"] for p in pieces):
        return False
    boxes = sorted(regions)
    for i, (o1, s1) in enumerate(boxes):
        for o2, s2 in boxes[i + 1:]:
            if all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2)):
                return False  # overlap
    return sum(math.prod(s) for _, s in boxes) == math.prod(logical)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    daemon = Daemon(tmp)
    try:
        proc = torchrun("tiny_fsdp.py", 2, "--name", "tiny", "--payload", "fwd:head",
                        env={"NUMAUDIT_ADDR": daemon.address})
    finally:
        rc = daemon.stop()
    assert rc == 0, "auditor did not stop cleanly on SIGTERM"
    return daemon.db, proc


def test_store_holds_expected_keys_and_summary_counts(tiny_store):
    db, proc = tiny_store
    assert "dropped 0; errors 0" in proc.stdout + proc.stderr
    reader = Reader(db)
    rows = list(reader.records("tiny"))
    keys = {(r[1], r[2], r[3]) for r in rows}
    for mb in (0, 1):
        for site in ("inp", "blocks.0", "blocks.0.norm", "blocks.0.proj", "blocks.1", "head",
                     "head.out"):
            assert (mb, pb.PHASE_FWD, site) in keys, site
        assert (mb, pb.PHASE_LOSS, "loss") in keys
        assert (mb, pb.PHASE_INPUT, "x") in keys
    params = {"inp.weight", "inp.bias", "head.out.weight", "head.out.bias", "head.unused"}
    params |= {f"blocks.{i}.{m}.{p}" for i in (0, 1) for m in ("norm", "proj")
               for p in ("weight", "bias")}
    assert {s for mb, ph, s in keys if ph == pb.PHASE_GRAD} == params
    sessions = reader.sessions("tiny")
    assert len(sessions) == 2 and all(s["closed"] for s in sessions)
    assert all(s["records_dropped"] == 0 for s in sessions)
    assert sum(s["records_stored"] for s in sessions) == len(rows)


def test_layouts_tile_every_logical_tensor(tiny_store):
    db, _ = tiny_store
    groups = defaultdict(list)
    col = {name: i for i, name in enumerate(RECORD_COLUMNS)}
    for r in Reader(db).records("tiny"):
        if r[9]:  # None records carry no layout
            continue
        groups[r[:7]].append(dict(logical=json.loads(r[11]), offsets=json.loads(r[12]),
                                  shape=json.loads(r[13]), replica=bool(r[14]), rank=r[7],
                                  reduce=r[col["reduce"]], addend=r[col["reduce_index"]],
                                  addends=r[col["reduce_count"]]))
    assert groups
    for key, pieces in groups.items():
        assert len({p["rank"] for p in pieces}) == 2, key  # both ranks hold a piece
        if pieces[0]["reduce"]:  # the per-rank loss: one addend per dp rank, not a tiling
            assert sorted(p["addend"] for p in pieces) == [0, 1], (key, pieces)
            assert {p["addends"] for p in pieces} == {2}, (key, pieces)
            continue
        assert _tiles(pieces), (key, pieces)
    loss = groups[(0, 0, pb.PHASE_LOSS, "loss", pb.ROLE_VALUE, 0, 0)]
    assert loss and all(p["reduce"] == pb.REDUCTION_MEAN for p in loss)
    # activations: the batch of 4 per rank is one logical batch of 8
    fwd = groups[(0, 0, pb.PHASE_FWD, "head.out", pb.ROLE_OUTPUT, 0, 0)]
    assert sorted(p["offsets"][0] for p in fwd) == [0, 4]
    assert all(p["logical"] == [8, 5] for p in fwd)


def test_parameter_outside_the_graph_is_an_explicit_none_record(tiny_store):
    db, _ = tiny_store
    rows = [r for r in Reader(db).records("tiny")
            if r[3] == "head.unused" and r[2] == pb.PHASE_GRAD]
    assert sorted(r[7] for r in rows) == [0, 1]
    assert all(r[9] == 1 for r in rows)
    assert Reader(db).none_grad_sites("tiny") == ["head.unused"]


def test_payload_stored_for_selected_site(tiny_store):
    """`--payload fwd:head` sends head's bytes; other pieces carry theirs only when they are
    small enough to travel whole (payload_max_bytes, 16 KiB by default)."""
    db, _ = tiny_store
    reader = Reader(db)
    col = {name: i for i, name in enumerate(RECORD_COLUMNS)}
    rows = [r for r in reader.records("tiny") if r[col["has_payload"]]]
    assert "head" in {r[3] for r in rows}
    for r in rows:
        if r[3] != "head":
            assert r[col["numel"]] * 4 <= 16 << 10, r[:8]
