"""Incremental reads on PostgreSQL with concurrent writers (`auditor watch` against replicas).

Record ids come from a sequence, so a transaction that took lower ids can commit after one that
took higher ids. A read that resumes after the largest id it saw would skip the late records
forever; `Catalog.load_new` must return every record exactly once, in whatever order the
transactions commit. Two real writer connections on a real server provoke it."""

from __future__ import annotations

import numpy as np
import pytest

from numaudit.auditor.compare.live import LiveComparison
from numaudit.auditor.compare.read.columns import Catalog, ReadMark
from numaudit.auditor.store import Reader
from numaudit.auditor.store.postgres import PgStore
from tests.auditor.builders import batch, record, register_request

pytestmark = pytest.mark.timeout(60)


def _stores(url, run="ref"):
    stores = [PgStore(url, synchronous="NORMAL") for _ in range(2)]
    for rank, st in enumerate(stores):
        st.begin()
        st.register_session(register_request(run=run, session_id=f"{run}-{rank}", rank=rank))
        # the site exists: else the second writer's insert of the name waits for the first
        st.site_ids(["layers.0"], create=True)
        st.commit()
    return stores


def test_a_lower_record_id_committed_late_is_read_once(pg_url):
    a, b = _stores(pg_url)
    reader = Reader(pg_url)
    try:
        a.begin()  # takes the lower record ids, commits last
        a.ingest(batch(1, [record(0, j) for j in range(3)], session_id="ref-0"))
        b.begin()
        b.ingest(batch(1, [record(0, j) for j in range(3)], session_id="ref-1"))
        b.commit()
        catalog = Catalog(reader)
        first, mark = catalog.load_new("ref", "ref", ReadMark())
        assert first.rank.tolist() == [1, 1, 1]
        a.commit()
        # the situation: the late records' ids are below every id read before, so a read by
        # id (what watch did) misses them
        late_rids = [r for (r,) in reader.conn.execute(
            "SELECT record_id FROM records r JOIN sessions s USING (session_id)"
            " WHERE s.rank = 0").fetchall()]
        assert max(late_rids) < first.rid.min()
        assert len(catalog.load("ref", "ref", after_rid=first.max_rid)) == 0
        second, mark = catalog.load_new("ref", "ref", mark)
        assert second.rank.tolist() == [0, 0, 0]
        assert sorted(second.rid.tolist()) == sorted(late_rids)
        third, mark = catalog.load_new("ref", "ref", mark)  # nothing read twice
        assert len(third) == 0
        b.begin()
        b.ingest(batch(2, [record(1, 0)], session_id="ref-1"))
        b.commit()
        fourth, _ = catalog.load_new("ref", "ref", mark)
        assert fourth.rank.tolist() == [1] and (fourth.when >> 24).tolist() == [1]
    finally:
        reader.close()
        a.close()
        b.close()


def test_live_comparison_reports_a_key_whose_piece_committed_late(pg_url):
    """Watch-level: each key of two ranks (disjoint shards) becomes final only with both pieces;
    the piece of rank 0 commits after rank 1's higher ids were polled, and must still arrive."""
    stores = {run: _stores(pg_url, run) for run in ("ref", "cand")}

    def shard(rank):
        r = record(0, 0, "layers.0")
        r.layout.logical_shape[:] = [8]
        r.layout.offsets[:] = [4 * rank]
        r.layout.shape[:] = [4]
        return r

    reader = Reader(pg_url)
    try:
        live = LiveComparison(reader, "ref", "cand")
        for run, (a, b) in stores.items():
            a.begin()
            a.ingest(batch(1, [shard(0)], session_id=f"{run}-0"))
            b.begin()
            b.ingest(batch(1, [shard(1)], session_id=f"{run}-1"))
            b.commit()
        assert [e.finding for e in live.poll() if e.finding] == []  # half of each key so far
        for a, _ in stores.values():
            a.commit()
        found = [e.finding for e in live.poll() if e.finding]
        assert len(found) == 1 and found[0].key.step == 0, found
        assert all(np.sort(live.cols[s].rank).tolist() == [0, 1] for s in ("ref", "cand"))
    finally:
        reader.close()
        for pair in stores.values():
            for st in pair:
                st.close()
