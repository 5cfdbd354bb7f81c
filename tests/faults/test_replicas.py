"""Two `auditor serve` replicas on one PostgreSQL database, agents reaching them through gRPC
client-side load balancing (the address lists both; round robin).

- SIGKILL the replica serving the streams mid-stream: the agents continue on the other, nothing
  acked is lost, nothing is stored twice, nothing is stored that no agent produced.
- Restart the database server mid-run: the replicas reconnect, the agents resume, same checks.
"""

from __future__ import annotations

import time

import pytest

from tests.faults.harness import Auditor, StoreView, Writer, figure, wait_until

FLUSH_S = 3.0


def pg_view(url: str, run: str = "faults") -> StoreView:
    """`StoreView` of a PostgreSQL store (the unique index stands in for SQLite's
    integrity_check: PostgreSQL checks its own pages)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        run_row = conn.execute("SELECT run_id FROM runs WHERE name = %s", (run,)).fetchone()
        if run_row is None:
            return StoreView({}, 0, 0, "ok")
        (run_id,) = run_row
        rows = conn.execute(
            "SELECT r.step, r.microbatch, r.phase, s.name, r.role, r.idx, r.call, r.rank,"
            " encode(r.content_hash, 'hex') FROM records r JOIN sites s ON s.site_id = r.site_id"
            " WHERE r.run_id = %s", (run_id,)).fetchall()
        distinct = conn.execute(
            "SELECT COUNT(*) FROM (SELECT DISTINCT step, microbatch, phase, site_id, role, idx,"
            " call, rank FROM records WHERE run_id = %s) d", (run_id,)).fetchone()[0]
        sessions = [dict(zip(("session_id", "rank", "acked_seq", "closed", "records_sent",
                              "records_dropped"), r)) for r in conn.execute(
            "SELECT session_id, rank, acked_seq, closed, records_sent, records_dropped"
            " FROM sessions WHERE run_id = %s", (run_id,))]
        unique = conn.execute("SELECT indisunique FROM pg_index WHERE indexrelid ="
                              " 'records_by_key'::regclass").fetchone()[0]
    return StoreView({tuple(r[:8]): r[8] for r in rows}, len(rows), distinct,
                     "ok" if unique else "records_by_key is not unique", sessions)


def _replicas(tmp_path, url):
    reps = [Auditor(tmp_path / name, db=url, grace=0.5) for name in ("a", "b")]
    for r in reps:
        r.tmp.mkdir(parents=True, exist_ok=True)
        r.start(60)
    return reps


def _writers(tmp_path, address, stop_file, n, rate):
    return [Writer(tmp_path, f"rank{r}", records=200_000, address=address, rank=r,
                   world_size=n, extra=["--rate", str(rate), "--until-file", str(stop_file),
                                        "--flush-timeout", str(FLUSH_S)], inprocess=n == 1)
            for r in range(n)]


def _serving(rep: Auditor) -> int:
    """Sessions this replica registered (from its log)."""
    try:
        return rep.log.read_text().count("registered run=")
    except OSError:
        return 0


def _check(jobs, reports, view) -> None:
    view.check_clean(*[j.manifest() for j in jobs])
    for job, rep in zip(jobs, reports):
        s = rep["summary"]
        acked = job.acked_keys()
        assert len(acked) == s["acked"], "the instrumentation lost track of acks"
        lost = acked - set(view.rows)
        assert not lost, f"{len(lost)} acked records missing, e.g. {sorted(lost)[:3]}"
        mine = {k for k in view.rows if k[7] == job.rank}
        assert len(mine) + s["dropped"] == s["captured"] == rep["records"], (len(mine), s)
        (session,) = [x for x in view.sessions if x["session_id"] == rep["session_id"]]
        assert (session["records_sent"], session["records_dropped"]) == (s["captured"],
                                                                           s["dropped"])


@pytest.mark.timeout(180)
def test_sigkill_one_replica_the_agents_continue_on_the_other(tmp_path, pg_url):
    reps = _replicas(tmp_path, pg_url)
    stop_file = tmp_path / "stop"
    jobs: list[Writer] = []
    try:
        address = ",".join(r.address for r in reps)
        jobs = _writers(tmp_path, address, stop_file, 2, rate=400)
        wait_until(lambda: all(j.acks() for j in jobs), 90, "first acks")
        time.sleep(1.0)
        victim = max(reps, key=_serving)  # one that holds streams
        survivor = reps[1 - reps.index(victim)]
        acked_before = [len(j.acked_keys()) for j in jobs]
        victim.kill()
        killed_at = time.monotonic()
        wait_until(lambda: all(j.first_ack_after(killed_at) for j in jobs), 30,
                   "acks from the surviving replica")
        resumed_s = max(j.first_ack_after(killed_at) for j in jobs) - killed_at
        at = [j.progress() for j in jobs]
        wait_until(lambda: all(j.progress() >= p + 400 for j, p in zip(jobs, at)), 30,
                   "captures after the kill")
        stop_file.touch()
        reports = [j.finish(90) for j in jobs]
        assert survivor.alive()
        assert survivor.stop() == 0
    finally:
        for j in jobs:
            j.kill()
        for r in reps:
            r.close()
    view = pg_view(pg_url)
    _check(jobs, reports, view)
    assert any(j.fails() for j in jobs), "the kill broke no stream"
    assert all(len(j.acked_keys()) > n for j, n in zip(jobs, acked_before))  # went on after
    assert all(r["summary"]["dropped"] == 0 for r in reports), [r["summary"] for r in reports]
    figure("replicas.kill.resumed_s", round(resumed_s, 3))
    figure("replicas.kill.records_stored", view.count)
    figure("replicas.kill.acked_lost", 0)
    figure("replicas.kill.duplicates", view.count - view.distinct)


@pytest.mark.timeout(180)
def test_restart_the_database_server_the_agents_resume(tmp_path, pg_server, pg_url):
    reps = _replicas(tmp_path, pg_url)
    stop_file = tmp_path / "stop"
    jobs: list[Writer] = []
    try:
        jobs = _writers(tmp_path, ",".join(r.address for r in reps), stop_file, 1, rate=400)
        wait_until(lambda: all(j.acks() for j in jobs), 90, "first acks")
        time.sleep(0.5)
        pg_server.restart(down_s=1.0)
        back = time.monotonic()
        wait_until(lambda: all(j.first_ack_after(back) for j in jobs), 60,
                   "acks after the database restart")
        resumed_s = max(j.first_ack_after(back) for j in jobs) - back
        at = [j.progress() for j in jobs]
        wait_until(lambda: all(j.progress() >= p + 400 for j, p in zip(jobs, at)), 30,
                   "captures after the restart")
        stop_file.touch()
        reports = [j.finish(90) for j in jobs]
        assert all(r.alive() for r in reps)  # the replicas rode it out
        assert all(r.stop() == 0 for r in reps)
    finally:
        for j in jobs:
            j.kill()
        for r in reps:
            r.close()
    view = pg_view(pg_url)
    _check(jobs, reports, view)
    assert all(r["summary"]["dropped"] == 0 for r in reports), [r["summary"] for r in reports]
    figure("replicas.db_restart.resumed_s", round(resumed_s, 3))
    figure("replicas.db_restart.records_stored", view.count)
