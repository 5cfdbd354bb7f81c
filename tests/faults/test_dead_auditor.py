"""An auditor that never started: training is not blocked, close is bounded, the spill replays
once."""

from __future__ import annotations

import pytest

from tests.faults.harness import StoreView, Writer, figure, free_port, replay_into_file

pytestmark = pytest.mark.timeout(60)


def test_never_started_training_not_blocked_close_bounded_spill_replayed_once(tmp_path):
    n, flush = 600, 1.0
    w = Writer(tmp_path, records=n, address=f"127.0.0.1:{free_port()}", inprocess=True,
               extra=["--flush-timeout", str(flush)])
    rep = w.finish(45)
    s = rep["summary"]
    figure("never_started.close_s", round(rep["close_s"], 3))
    figure("never_started.max_step_s", round(rep["max_step_s"], 3))
    assert rep["close_s"] <= flush + 1.0 + 0.2, rep["close_s"]
    assert rep["max_step_s"] < 1.0, rep  # a step waiting on the network would take >= 1 s
    assert s["captured"] == n and s["acked"] == 0
    assert s["spooled"] == n and s["dropped"] == 0, s

    db = tmp_path / "replayed.db"
    (first,) = replay_into_file(w.spool_files(), db)
    assert (first.stored, first.rejected, first.skipped_frames, first.error) == (n, [], 0, None)
    view = StoreView.read(db)
    view.check_clean(w.manifest())
    assert set(view.rows) == w.expected_keys(n)
    (again,) = replay_into_file(w.spool_files(), db)
    assert (again.stored, again.duplicates) == (0, n)
    assert StoreView.read(db).rows == view.rows
    (session,) = view.sessions
    assert session["records_sent"] == n and session["records_dropped"] == 0
